/* rank — `k3 run` as a client of the engine (k3_engine.h): every rank opens the engine; rank 0
 * submits the command line's prompts at once (prompt i samples with k3_rank_seq_seed(seed, i), so
 * a batch is reproducible and independent of the split), steps until every request ended and
 * prints the ids + text lines or one JSON object (streaming text to a terminal for one prompt) and
 * the logits dump; the other ranks serve. Lanes, slots, micro-batches, sampling and stop rules are
 * the engine's. The single-process `k3 run` is the same on a world of one (MPI singleton). Must
 * not: parse files beyond the model directory and the expert map, or call MPI directly (all
 * traffic goes through comm/).
 *
 * Failure policy: an error every rank sees identically (bad flags, bad plan) makes every rank
 * return 2 and only rank 0 prints it; any other error on a rank is logged as
 * "rank R (stage S, lane E) failed: cause" and ends the whole job with MPI_Abort.
 * Test hooks (opts.test_fail, from env K3_TEST_FAIL): "load:R" makes rank R fail while loading;
 * "stall-load:R" makes rank R stop itself (SIGSTOP) half-way through its load (the others must
 * name it after --comm-timeout without load progress and end the job);
 * "plan:R" makes rank R's plan hash differ (every other rank must refuse to start);
 * "decode:R:N" makes rank R kill itself with SIGKILL when it starts its N-th forward step (a
 * worker) or has received N logits messages (a dedicated coordinator); "hang:R:N" makes it stop
 * answering there instead (the other ranks must time out after --comm-timeout and end the job). */
#ifndef K3_RANK_H
#define K3_RANK_H

#include "k3_partition.h"
#include "k3_sampler.h"
#include "k3_tokenizer.h"

typedef struct k3_rank_opts {
    const char *model_dir;
    int pp, ep; /* stages S, lanes E (world = S x E [+ 1 dedicated coordinator]) */
    k3_coord_mode coord;
    const char *expert_map_path; /* NULL = contiguous expert ranges */
    bool deterministic;          /* combine per (token, expert) row, summed in slot order
                                    (bit-identical for every split); else each owner pre-sums */
    double comm_timeout_s;       /* every blocking wait; <= 0 means 600 */
    double load_timeout_s;       /* the whole load; <= 0: derived (k3_engine_opts) */
    const int32_t *prompt_ids;   /* all prompts concatenated */
    const int64_t *prompt_lens;  /* [n_prompts], each >= 1 */
    int n_prompts;
    int n_new;                /* most new tokens per prompt (fewer when a sequence stops) */
    int64_t chunk;            /* prefill tokens per sequence per step; 0 = whole prompt */
    int max_seqs;             /* engine slots per lane; 0 = what the prompts need */
    int64_t max_ctx;          /* tokens per sequence; 0 = longest prompt + n_new */
    int64_t max_batch_tokens; /* tokens per step of a lane; 0 = every prefill in one step */
    int64_t kv_cache_tokens;  /* paged MLA cache per lane; 0 = max_seqs x max_ctx */
    bool verify;              /* k3_engine_opts.verify */
    const char *dump_logits;  /* .npy of every position's logits (prompts concatenated) or NULL */
    const char *op_stats;     /* k3_engine_opts.op_stats: JSON of the backend's ops per step */
    bool json;                /* one JSON object on stdout instead of text lines */
    int n_threads;            /* cpu threads per rank; <= 0: k3_engine_opts.n_threads */
    const char *bind;         /* k3_engine_opts.bind ("auto"/NULL or "none") */
    int kda_chunk;            /* k3_stage_params.kda_chunk (0 = default) */
    const char *backend;      /* kernel backend name (k3_backend_create); NULL = "cpu" */
    const char *comm;         /* k3_engine_opts.comm: "mpi" or "nccl"; NULL = "mpi" */
    const char *test_fail;    /* K3_TEST_FAIL value or NULL (read by the caller, once) */
    /* sampling on the coordinator. `seed` is the run's seed: sequence i samples with
     * k3_rank_seq_seed(seed, i). stop_ids are extra stop ids (copied); the model's EOS
     * (config eos_token_id) and the tokenizer's <|end_of_msg|> / [EOS] are added unless
     * ignore_eos. Stop strings need `tok`. The penalty history holds generated ids only. */
    k3_sampler_params sampling;
    bool ignore_eos;
    const k3_tokenizer *tok; /* borrowed, may be NULL: decoded text + stop strings */
    bool quiet;              /* rank 0 prints no results (the caller uses `result`) */
    /* This machine's limits when the caller measured them (`k3 run --bench-limits`), else 0:
     * the summary gives decode GB/s and prefill GFLOP/s, and with these also their % of them. */
    double limit_triad_gbs, limit_fma_gflops;
    int limit_threads;
    struct k3_rank_result *result; /* rank 0: filled when non-NULL (free: k3_rank_result_free) */
} k3_rank_opts;

typedef struct k3_rank_seq_result {
    int32_t *gen; /* [n_gen] generated ids, a stop id included */
    int n_gen;
    k3_stop_kind stop; /* K3_STOP_NONE: the length limit was hit */
    int stop_string;   /* index into sampling.stop_strings when stop == K3_STOP_STRING, else -1 */
    char *text;        /* [n_text + 1] decoded UTF-8 (stop id / stop string excluded); NULL
                        * without a tokenizer */
    size_t n_text;
} k3_rank_seq_result;

typedef struct k3_rank_result {
    int n_seqs;               /* 0 on ranks other than 0 */
    k3_rank_seq_result *seqs; /* [n_seqs] */
} k3_rank_result;
void k3_rank_result_free(k3_rank_result *r); /* frees the members; NULL-safe */

/* The seed of sequence `index` in a run seeded with `seed` (splitmix64 of both). */
uint64_t k3_rank_seq_seed(uint64_t seed, int index);
/* "length" or "stop" (OpenAI finish_reason of a plain completion). */
const char *k3_rank_finish_reason(k3_stop_kind stop);

/* Run the job on this rank: a client of the engine (k3_engine.h). MPI must be initialised (a
 * singleton world of 1 works). Returns the process exit code (0 ok, 2 usage error agreed by all
 * ranks, 1 when a prompt failed — its error printed); a rank failure aborts the job. */
int k3_rank_run(const k3_rank_opts *o);

/* Parse "1,2,3;4,5" (prompts separated by ';', ids by ',') into ids/lens (k3_alloc'd; free with
 * k3_free). Errors name the prompt and the position. */
k3_status k3_rank_parse_prompts(const char *text, int32_t **ids, int64_t **lens, int *n_prompts);

/* ---- binding (bind.c, libhwloc) --------------------------------------------------------------
 * Local rank `local` of the `n_local` ranks on this node gets a contiguous share of the node's
 * cores (with gpu: of the cores near its GPU, device = local rank); k3_engine_open applies it
 * unless --bind none, and sizes the cpu thread pool by its cores. */
typedef struct k3_bind_info {
    int n_cores;    /* cores in the share (the cpu pool's threads) */
    int device;     /* the GPU found for this local rank, -1 none */
    bool bound;     /* k3_bind_apply: the process is bound to `cores` */
    bool kept;      /* the launcher had already narrowed the process: its binding was kept */
    char cores[96]; /* OS indices of the PUs, hwloc list syntax ("0-3,8") */
    char numa[32];  /* NUMA nodes of those cores */
} k3_bind_info;
k3_status k3_bind_describe(int local, int n_local, bool gpu, k3_bind_info *out); /* no binding */
k3_status k3_bind_apply(int local, int n_local, bool gpu, k3_bind_info *out);    /* this process */

#endif /* K3_RANK_H */
