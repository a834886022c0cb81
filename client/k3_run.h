/* client — the engine's clients' shared layer, above rank/ (k3_engine.h), below server/ and
 * launcher/: the run driver of `k3 run` (this header, prefix k3_run_) and the OpenAI chat-job
 * layer that `k3 run --chat`, `k3 batch` and `k3 serve` share (chat_job.h, prefix k3_job_).
 * Callers must not: reach into the engine (rank/'s internals) through this module, or expect it
 * to parse flags (launcher/engine_args.h fills k3_engine_opts; each command its own table).
 *
 * The run driver: every rank opens the engine with the caller's k3_engine_opts (capacity,
 * grid, backend ... exactly as given: the run adds no defaults of its own); rank 0 submits the
 * prompts at once (prompt i samples with k3_run_seq_seed(seed, i), so a batch is reproducible and
 * independent of the split), steps until every request ended and prints the ids + text lines or
 * one JSON object (streaming text to a terminal for one prompt) and the logits dump; the other
 * ranks serve. Lanes, slots, micro-batches, sampling and stop rules are the engine's. The
 * single-process `k3 run` is the same on a world of one (MPI singleton). Must not: parse files
 * beyond the model directory and the expert map, or call MPI directly (all traffic goes through
 * comm/).
 *
 * Failure policy: an error every rank sees identically (bad flags, bad plan) makes every rank
 * return 2 and only rank 0 prints it; a fault of a rank comes back from the engine as a status
 * and the client ends the whole job with k3_engine_abort (one line: "rank R (stage S, lane E)
 * failed: cause", or the peer the ranks agree on). The test hooks of the environment
 * (K3_TEST_FAIL, K3_TEST_FORCE: rank/k3_engine_test.h) are passed to the engine. */
#ifndef K3_RUN_H
#define K3_RUN_H

#include "k3_engine.h"
#include "k3_sampler.h"
#include "k3_tokenizer.h"

/* What a run adds to the engine's options: the prompts, how much to generate and how to sample,
 * and what to print. The tokenizer (decoded text, stop strings) is k3_engine_opts.tok. */
typedef struct k3_run_opts {
    const int32_t *prompt_ids;  /* all prompts concatenated */
    const int64_t *prompt_lens; /* [n_prompts], each >= 1 */
    int n_prompts;
    int n_new; /* most new tokens per prompt (fewer when a sequence stops) */
    /* sampling on the coordinator. `seed` is the run's seed: sequence i samples with
     * k3_run_seq_seed(seed, i). stop_ids are extra stop ids (copied); the model's EOS
     * (config eos_token_id) and the tokenizer's <|end_of_msg|> / [EOS] are added unless
     * ignore_eos. Stop strings need the tokenizer. The penalty history holds generated ids only. */
    k3_sampler_params sampling;
    bool ignore_eos;
    const char *dump_logits; /* .npy of every position's logits (prompts concatenated) or NULL */
    bool json;               /* one JSON object on stdout instead of text lines */
    bool quiet;              /* rank 0 prints no results (the caller uses `result`) */
    /* This machine's limits when the caller measured them (`k3 run --bench-limits`), else 0:
     * the summary gives decode GB/s and prefill GFLOP/s, and with these also their % of them. */
    double limit_triad_gbs, limit_fma_gflops;
    int limit_threads;
    struct k3_run_result *result; /* rank 0: filled when non-NULL (free: k3_run_result_free) */
} k3_run_opts;

typedef struct k3_run_seq_result {
    int32_t *gen; /* [n_gen] generated ids, a stop id included */
    int n_gen;
    k3_stop_kind stop; /* K3_STOP_NONE: the length limit was hit */
    int stop_string;   /* index into sampling.stop_strings when stop == K3_STOP_STRING, else -1 */
    char *text;        /* [n_text + 1] decoded UTF-8 (stop id / stop string excluded); NULL
                        * without a tokenizer */
    size_t n_text;
} k3_run_seq_result;

typedef struct k3_run_result {
    int n_seqs;              /* 0 on ranks other than 0 */
    k3_run_seq_result *seqs; /* [n_seqs] */
} k3_run_result;
void k3_run_result_free(k3_run_result *r); /* frees the members; NULL-safe */

/* The seed of sequence `index` in a run seeded with `seed` (splitmix64 of both). */
uint64_t k3_run_seq_seed(uint64_t seed, int index);
/* "length" or "stop" (OpenAI finish_reason of a plain completion). */
const char *k3_run_finish_reason(k3_stop_kind stop);

/* Run the job on this rank: a client of the engine (k3_engine.h), opened with *eo as given
 * (model_dir, capacity, grid, tok, test hooks: the caller's). MPI must be initialised (a singleton
 * world of 1 works). Returns the process exit code (0 ok, 2 usage error agreed by all ranks, 1
 * when a prompt failed — its error printed); a rank failure aborts the job. */
int k3_run_generate(const k3_engine_opts *eo, const k3_run_opts *o);

/* Parse "1,2,3;4,5" (prompts separated by ';', ids by ',') into ids/lens (k3_alloc'd; free with
 * k3_free). Errors name the prompt and the position. */
k3_status k3_run_parse_prompts(const char *text, int32_t **ids, int64_t **lens, int *n_prompts);

#endif /* K3_RUN_H */
