/* model — everything about reading and writing a K3 checkpoint, no compute.
 *
 * Owns: config.json -> k3_config (parse + validate); the catalogue of tensors a config implies
 * (ONE source of truth used by make-tiny, inspect and the loader); safetensors index + shards
 * with per-tensor byte-range reads and the shard writer; MXFP4 checkpoint parts (the format
 * itself is kernels/k3_mxfp4.h); the in-memory weights of the layers a rank owns (k3_weights);
 * the presets. The tiny/small checkpoint writer and its tokenizer are tiny/ (k3_tiny.h), a user
 * of this header. Callers must not: open shard files themselves, or hard-code a shape (read it
 * from k3_config).
 *
 * Layer indices are 0-based everywhere in k3 (config.json lists are 1-based; converted here). */
#ifndef K3_MODEL_H
#define K3_MODEL_H

#include "k3_base.h"
#include "k3_tensor.h"

#define K3_MAX_LAYERS 256

/* ---- config ----------------------------------------------------------------------------- */
typedef enum { K3_MIXER_KDA = 0, K3_MIXER_MLA = 1 } k3_mixer;
typedef enum { K3_ACT_SITU = 0, K3_ACT_SWIGLU = 1 } k3_act;

typedef struct k3_config {
    /* global */
    int64_t vocab_size;       /* 163840 */
    int64_t hidden_size;      /* D = 7168 */
    int n_layers;             /* 93 */
    float rms_norm_eps;       /* 1e-5: layer norms, final norm, AttnRes scores, o_norm, latent */
    float mla_norm_eps;       /* 1e-6: q_a_layernorm, kv_a_layernorm (K3-MODEL.md §3.2) */
    bool tie_word_embeddings; /* false for K3; true => no lm_head tensor, head = embedding */
    int eos_token_id;         /* 163586 */
    int attn_res_block_size;  /* 12; 0 = no AttnRes (Kimi-Linear: plain pre-norm residual) */
    int64_t max_position_embeddings; /* 1048576: the trained context (NoPE: no table reads
                                        it); 0 = not given in config.json */
    k3_mixer mixer[K3_MAX_LAYERS];

    /* MLA (every layer with mixer == K3_MIXER_MLA) */
    int n_heads;              /* 96 */
    int q_lora_rank;          /* 1536; 0 = no q LoRA (q_proj directly) */
    int kv_lora_rank;         /* 512 */
    int qk_nope_head_dim;     /* 128 */
    int qk_rope_head_dim;     /* 64 (NoPE: a plain extra dot-product term) */
    int v_head_dim;           /* 128 */
    bool mla_use_output_gate; /* true: sigmoid(g_proj x) gates the heads before o_proj */

    /* KDA (linear_attn_config) */
    int kda_n_heads;            /* 96 */
    int kda_head_dim;           /* 128 (dk = dv) */
    int kda_conv_kernel;        /* 4 */
    bool kda_has_lower_bound;   /* K3 sigmoid gate form; false = Kimi-Linear softplus form */
    float kda_gate_lower_bound; /* -5.0 */
    bool kda_full_rank_gate;    /* K3 g_proj [P, D]; false = Kimi-Linear g_a_proj/g_b_proj */
    int kda_gate_rank;          /* rank of f_a/f_b (and g_a/g_b): = kda_head_dim in K3 (128) */
    int kda_a_log_len;          /* stored length of A_log (>= kda_n_heads; K3: 128, zero-padded) */

    /* FFN */
    k3_act act;
    float situ_beta;             /* 4.0  */
    float situ_linear_beta;      /* 25.0; <= 0 means the up branch is not capped */
    int64_t intermediate_size;   /* dense layers: 33792 */
    int first_k_dense_replace;   /* layers < this are dense (1) */
    int moe_layer_freq;          /* 1 */
    int n_experts;               /* 896 */
    int n_experts_per_tok;       /* 16 */
    int n_shared_experts;        /* 2 (fused width = n_shared * moe_intermediate_size) */
    int moe_intermediate_size;   /* 3072 */
    int latent_size;             /* routed_expert_hidden_size 3584; 0 = no latent (experts on D) */
    bool latent_moe_use_norm;    /* RMSNorm of the weighted expert sum (latent) */
    bool moe_renormalize;        /* true */
    float routed_scaling_factor; /* 1.0 */
    int n_group, topk_group;     /* grouped top-k (1/1 = no-op; the general rule is implemented) */

    /* quantisation of routed experts */
    bool experts_mxfp4; /* compressed-tensors mxfp4-pack-quantized, group 32 */

    /* checkpoint naming */
    char tensor_prefix[32]; /* "language_model." when config.json nests text_config (K3),
                               "" for a flat Kimi-Linear-style config */
} k3_config;

/* Parse config.json text (top-level with text_config, or a flat text config). Every missing or
 * invalid value is an error naming the key (K3_ERR_CONFIG); nothing is clamped. */
k3_status k3_config_parse(const char *json_text, const char *path_for_errors, k3_config *out);
k3_status k3_config_load(const char *model_dir, k3_config *out);
/* The rules k3_config_parse applies after reading (also used for presets): K3_ERR_CONFIG naming
 * the key of the first invalid value. */
k3_status k3_config_validate(const k3_config *c, const char *path_for_errors);
/* config.json text (K3 layout: top level + text_config + quantization_config) for `c`; the
 * caller frees with k3_free. Parsing it gives back `c`. */
k3_status k3_config_to_json(const k3_config *c, char **out_json);
/* A stable hash of every field (ranks compare it). */
uint64_t k3_config_hash(const k3_config *c);
/* Counts from the catalogue: total parameters (MXFP4 counted per logical element), the
 * parameters one token touches (top-k routed experts of each MoE layer, one embedding row),
 * and the bytes one decoded token reads (same rule, stored sizes). Streams the catalogue (no
 * allocation). K3_ERR_CONFIG (naming the total) when a sum overflows int64; `out` is then
 * zeroed. */
typedef struct k3_config_counts {
    int64_t n_tensors;
    int64_t params_total, params_active;
    int64_t bytes_total, bytes_active;
    int64_t bytes_by_dtype[8]; /* indexed by k3_dtype (stored dtypes: F32, BF16, U8, ...) */
} k3_config_counts;
k3_status k3_config_count(const k3_config *c, k3_config_counts *out);
static inline bool k3_config_is_moe(const k3_config *c, int layer) {
    return layer >= c->first_k_dense_replace && c->n_experts > 0 &&
           (layer - c->first_k_dense_replace) % (c->moe_layer_freq > 0 ? c->moe_layer_freq : 1) ==
               0;
}
/* Rows of the MoE expert step's tiles (experts/moe.c; sizes its scratch, which k3 plan counts:
 * partition/partition.c). Results do not depend on it. */
#define K3_MOE_ROW_TILE 256
/* AttnRes: does `layer` start a block (bank its input)? */
static inline bool k3_config_is_block_start(const k3_config *c, int layer) {
    return c->attn_res_block_size > 0 && layer % c->attn_res_block_size == 0;
}

/* ---- tensors ------------------------------------------------------------------------------ */
/* k3_dtype, k3_tensor and the memory spaces are kernels/k3_tensor.h. */

/* ---- the catalogue: which tensors a config implies ----------------------------------------- */
typedef enum {
    K3_TK_GLOBAL = 0, /* embedding, final norm, output AttnRes, lm_head */
    K3_TK_LAYER,      /* a layer's non-expert tensor (norms, mixer, router, latent, shared) */
    K3_TK_EXPERT,     /* one routed expert's tensor */
} k3_tensor_kind;

/* What a catalogue entry is, so the loader maps it to a k3_layer_w field without string
 * matching. */
typedef enum k3_role {
    K3_R_EMBED = 0,
    K3_R_FINAL_NORM,
    K3_R_OUT_RES_NORM,
    K3_R_OUT_RES_PROJ,
    K3_R_LM_HEAD,
    K3_R_INPUT_NORM,
    K3_R_POST_NORM,
    K3_R_ATTN_RES_NORM,
    K3_R_ATTN_RES_PROJ,
    K3_R_MLP_RES_NORM,
    K3_R_MLP_RES_PROJ,
    K3_R_KDA_Q,
    K3_R_KDA_K,
    K3_R_KDA_V,
    K3_R_KDA_QCONV,
    K3_R_KDA_KCONV,
    K3_R_KDA_VCONV,
    K3_R_KDA_FA,
    K3_R_KDA_FB,
    K3_R_KDA_DT_BIAS,
    K3_R_KDA_A_LOG,
    K3_R_KDA_B,
    K3_R_KDA_G,
    K3_R_KDA_GA,
    K3_R_KDA_GB,
    K3_R_KDA_O_NORM,
    K3_R_KDA_O,
    K3_R_MLA_QA,
    K3_R_MLA_QA_NORM,
    K3_R_MLA_QB,
    K3_R_MLA_Q,
    K3_R_MLA_KVA,
    K3_R_MLA_KVA_NORM,
    K3_R_MLA_KVB,
    K3_R_MLA_G,
    K3_R_MLA_O,
    K3_R_FFN_GATE,
    K3_R_FFN_UP,
    K3_R_FFN_DOWN,
    K3_R_ROUTER,
    K3_R_ROUTER_BIAS,
    K3_R_LAT_DOWN,
    K3_R_LAT_NORM,
    K3_R_LAT_UP,
    K3_R_SH_GATE,
    K3_R_SH_UP,
    K3_R_SH_DOWN,
    K3_R_EXP_W1_PACKED,
    K3_R_EXP_W1_SCALE,
    K3_R_EXP_W2_PACKED,
    K3_R_EXP_W2_SCALE,
    K3_R_EXP_W3_PACKED,
    K3_R_EXP_W3_SCALE,
    K3_R_EXP_W1,
    K3_R_EXP_W2,
    K3_R_EXP_W3, /* BF16 experts (no quantization_config) */
    K3_R_COUNT
} k3_role;

typedef struct k3_tensor_spec {
    char name[160]; /* full checkpoint name,
                       "language_model.model.layers.3.self_attn.q_a_proj.weight" */
    k3_dtype dtype; /* as stored: F32/BF16/U8 (MXFP4 parts are U8) */
    int ndim;
    int64_t shape[K3_MAX_DIMS];
    k3_tensor_kind kind;
    int layer;        /* -1 for globals */
    int expert;       /* -1 unless K3_TK_EXPERT */
    bool first_stage; /* globals: embedding (true) vs head side (false) */
    k3_role role;
} k3_tensor_spec;

/* Enumerate every tensor of the checkpoint in a stable order. Returns the count; fills up to
 * `cap` entries of `out` (call with out=NULL to size). */
int64_t k3_catalog(const k3_config *c, k3_tensor_spec *out, int64_t cap);
/* bytes of a spec as stored; -1 if the product overflows int64 (never for a validated config:
 * k3_config_validate's bounds keep every tensor under 2^63 bytes) */
int64_t k3_tensor_spec_bytes(const k3_tensor_spec *s);

/* ---- safetensors checkpoint ---------------------------------------------------------------- */
typedef struct k3_ckpt k3_ckpt;
typedef struct k3_ckpt_tensor {
    const char *name;
    k3_dtype dtype;
    int ndim;
    int64_t shape[K3_MAX_DIMS];
    int shard;       /* index into the shard list */
    uint64_t offset; /* absolute byte offset in the shard file */
    uint64_t n_bytes;
} k3_ckpt_tensor;

/* Open DIR: model.safetensors.index.json (or a single model.safetensors) and every shard's
 * header, with strict checks (8-byte length vs file size and a sane maximum; strict JSON: UTF-8
 * names with no NUL, no key twice; dtype names; shape x dtype = span; the spans cover the data
 * section exactly: no overlap, hole or trailing byte; index and shards agree). Errors name the
 * file and the tensor or key. No tensor data is read here. */
k3_status k3_ckpt_open(const char *dir, k3_ckpt **out);
void k3_ckpt_destroy(k3_ckpt *ck);
const k3_ckpt_tensor *k3_ckpt_find(const k3_ckpt *ck, const char *name);
int64_t k3_ckpt_n_tensors(const k3_ckpt *ck);
const k3_ckpt_tensor *k3_ckpt_tensor_at(const k3_ckpt *ck, int64_t i);
int k3_ckpt_n_shards(const k3_ckpt *ck);
const char *k3_ckpt_shard_path(const k3_ckpt *ck, int shard);
uint64_t k3_ckpt_shard_size(const k3_ckpt *ck, int shard);
/* pread exactly t->n_bytes into dst. Thread-safe. Adds to the bytes-read counter. */
k3_status k3_ckpt_read(k3_ckpt *ck, const k3_ckpt_tensor *t, void *dst);
uint64_t k3_ckpt_bytes_read(const k3_ckpt *ck);
/* Check the checkpoint against the catalogue of `c`: every tensor present with the right dtype
 * and shape, nothing unexpected. Reports each problem through `report` (may be NULL) and returns
 * the number of problems. */
int64_t k3_ckpt_verify(const k3_ckpt *ck, const k3_config *c,
                       void (*report)(void *ctx, const char *problem), void *ctx);

/* Write one shard (make-tiny's writer, tiny/, and the tests' corrupters): header for
 * specs[0..n) in order (data_offsets contiguous, header padded with spaces to a multiple of 8,
 * metadata {"format":"pt"}), then each tensor's bytes as produced by fill(ctx, spec, dst) into a
 * buffer of k3_tensor_spec_bytes(spec). */
typedef k3_status (*k3_st_fill_fn)(void *ctx, const k3_tensor_spec *spec, void *dst);
k3_status k3_st_write_shard(const char *path, const k3_tensor_spec *specs, int64_t n,
                            k3_st_fill_fn fill, void *ctx);

/* ---- values check: every byte of the selected tensors (k3 inspect --verify) ---------------- */
/* Streams the data of the selected tensors (by file offset, n_threads readers with one buffer
 * each, so memory is n_threads x buf_bytes) and reports, by file, tensor and row: non-finite
 * F32/BF16/F16 values (NaN, +-Inf) and E8M0 scales of 0xFF (NaN in OCP MX) in U8 tensors named
 * "*.weight_scale" (the MXFP4 experts, spec/K3-MODEL.md §7.1). A row is the last dimension; a
 * 1-D tensor is one row. Per tensor the first rows_listed rows with a problem are reported, then
 * one line with the totals; reports come in checkpoint order (deterministic). Other dtypes are
 * read (so an unreadable byte shows) but not interpreted. Returns an error only when a read
 * fails (naming the file and tensor); problems go through report. */
typedef struct k3_scan_opts {
    int n_threads;                                      /* readers at once; 0 = 4 */
    size_t buf_bytes;                                   /* per reader; 0 = 16 MiB */
    int rows_listed;                                    /* per tensor; 0 = 4 */
    bool (*select)(void *ctx, const k3_ckpt_tensor *t); /* NULL = all */
    /* may be NULL; a status other than K3_OK stops the scan, which returns it */
    k3_status (*progress)(void *ctx, uint64_t done_bytes, uint64_t total_bytes);
    void (*report)(void *ctx, const char *problem); /* may be NULL */
    void *ctx; /* progress and report are called one at a time, never concurrently */
} k3_scan_opts;
typedef struct k3_scan_result {
    uint64_t n_bytes;     /* read and checked */
    int64_t n_tensors;    /* scanned */
    int64_t n_bad_values; /* non-finite values + 0xFF scales */
    int64_t n_bad_tensors;
    int64_t n_reports; /* lines given to report */
    double seconds;
} k3_scan_result;
k3_status k3_ckpt_scan(k3_ckpt *ck, const k3_scan_opts *opts, k3_scan_result *out);

/* ---- weights in memory ------------------------------------------------------------------- */
typedef struct k3_expert_w {
    bool present;         /* owned and loaded by this rank */
    k3_tensor w1, w3, w2; /* gate [I, L], up [I, L], down [L, I]; MXFP4 or BF16 */
} k3_expert_w;

typedef struct k3_layer_w {
    bool present;                            /* this rank holds the layer (its stage) */
    k3_tensor input_norm, post_attn_norm;    /* [D] */
    k3_tensor attn_res_score, mlp_res_score; /* F32 [D] = res_norm ⊙ res_proj (fused at load) */
    /* KDA */
    k3_tensor q_proj, k_proj, v_proj; /* [P, D] */
    k3_tensor q_conv, k_conv, v_conv; /* F32 [P, 1, K] */
    k3_tensor f_a, f_b;               /* [R, D], [P, R] */
    k3_tensor dt_bias;                /* F32 [P] */
    k3_tensor a_log;                  /* F32 [A] (first kda_n_heads used) */
    k3_tensor b_proj;                 /* [H, D] */
    k3_tensor g_proj;                 /* KDA full-rank [P, D] or MLA gate [H*dv, D] */
    k3_tensor g_a, g_b;               /* Kimi-Linear low-rank gate (else data NULL) */
    k3_tensor o_norm;                 /* F32 [dk] */
    k3_tensor o_proj;                 /* [D, P] (KDA) / [D, H*dv] (MLA) */
    /* MLA */
    k3_tensor q_a_proj, q_a_norm, q_b_proj;    /* [Rq, D], [Rq], [H*(dn+dr), Rq] */
    k3_tensor q_proj_mla;                      /* [H*(dn+dr), D] when q_lora_rank == 0 */
    k3_tensor kv_a_proj, kv_a_norm, kv_b_proj; /* [Rkv+dr, D], [Rkv], [H*(dn+dv), Rkv] */
    /* FFN: dense */
    k3_tensor gate_proj, up_proj, down_proj; /* [F, D], [F, D], [D, F] */
    /* FFN: MoE */
    k3_tensor router, router_bias;        /* [E, D], F32 [E] */
    k3_tensor lat_down, lat_norm, lat_up; /* [L, D], [L], [D, L] */
    k3_tensor sh_gate, sh_up, sh_down;    /* [S, D], [S, D], [D, S] */
    k3_expert_w *experts;                 /* [n_experts]; present only where owned */
} k3_layer_w;

typedef struct k3_weights k3_weights; /* opaque owner of all the memory below */
typedef struct k3_weights_view {
    const k3_config *cfg;
    k3_tensor embed;         /* [V, D]   (first stage) */
    k3_tensor final_norm;    /* [D]      (last stage)  */
    k3_tensor out_res_score; /* F32 [D]  (last stage)  */
    k3_tensor lm_head;       /* [V, D]   (last stage)  */
    k3_layer_w *layers;      /* [n_layers]; layers[l].present for owned layers */
} k3_weights_view;

/* Reads in flight while loading (k3_load_sel.n_readers = 0), and the size of one read. */
#define K3_LOAD_READERS_DEFAULT 8
#define K3_LOAD_PIECE_BYTES     ((size_t)4 << 20)

/* What a rank loads: layers [layer_begin, layer_end), the embedding and/or the head, and the
 * routed experts for which expert_owned(ctx, layer, expert) is true (NULL = all). */
typedef struct k3_load_sel {
    int layer_begin, layer_end;
    bool embed, head;
    bool (*expert_owned)(void *ctx, int layer, int expert);
    void *ctx;
    /* may be NULL; a status other than K3_OK stops the load, which returns it */
    k3_status (*progress)(void *ctx, uint64_t done_bytes, uint64_t total_bytes);
    /* Where the weights live: NULL = host memory (k3_alloc). A host-visible backend gets the
       bytes read straight into its buffer; any other is filled by one upload of the host arena
       (which is then freed), so a load peaks at twice the weight bytes of the rank in host
       memory for device/guard backends. */
    struct k3_backend *be;
    /* Called once per checkpoint tensor read (in read order), with ctx; may be NULL. A status
       other than K3_OK stops the load, which returns it. */
    k3_status (*on_read)(void *ctx, const k3_ckpt_tensor *t);
    /* How: n_readers reads of K3_LOAD_PIECE_BYTES in flight (threads; 0 = the default, 1 = one
       at a time), with O_DIRECT when `direct` and the file system allows it (else buffered).
       The callbacks are called from the calling thread only. */
    int n_readers;
    bool direct;
    /* Node sharing (host ranks of one stage on one node): the dense tensors (all but the routed
       experts, AttnRes scores fused) live in `dense`, dense_bytes long (k3_weights_dense_bytes),
       not in the rank's arena; only the dense_reader reads (and fuses) them, the others only
       point into the region and must not use it before the reader is done (the caller
       synchronises). The region is not owned; it is backend memory when `be` is set (a device:
       the caller copies the reader's region to the others). NULL: no sharing. */
    void *dense;
    uint64_t dense_bytes;
    bool dense_reader;
    /* Map the shard files instead of reading them (host memory only, no dense region): tensors
       point into the page cache's own pages, populated before the load returns; a tensor whose
       file offset is not a multiple of its element size is read into the arena instead. Logits
       are the same bytes' (bit-identical). k3_weights_mapped says how it went. */
    bool map;
} k3_load_sel;
k3_status k3_weights_load(k3_ckpt *ck, const k3_config *c, const k3_load_sel *sel,
                          k3_weights **out);
/* The bytes of the dense region a selection needs (k3_load_sel.dense), and (stored, may be NULL)
 * the checkpoint bytes of those tensors: what a rank that does not read the region skips. */
k3_status k3_weights_dense_bytes(const k3_config *c, const k3_load_sel *sel, uint64_t *out,
                                 uint64_t *stored);
const k3_weights_view *k3_weights_get(const k3_weights *w);
uint64_t k3_weights_bytes(const k3_weights *w);
/* A mapped load (k3_load_sel.map): the bytes of the tensors left in the files (64-byte rounded,
 * as the plan counts them), and of the weights' resident file pages now, the bytes mapped by
 * 2 MB entries (decode sweeps those as fast as the read loader's huge-page arena) against all of
 * them (/proc/self/smaps: it walks every page table of the process, ~30 ms for 657 MB in 4 KB
 * pages, so it is a check after the load, not part of it). Zeros for a read load. */
k3_status k3_weights_mapped(const k3_weights *w, uint64_t *mapped, uint64_t *resident,
                            uint64_t *pmd);
void k3_weights_destroy(k3_weights *w);

/* ---- presets ------------------------------------------------------------------------------ */
/* The configs `k3 make-tiny` writes (tiny/k3_tiny.h) and `k3 inspect/plan --preset` read.
 * DEEP: the tiny's widths with K3's 93-layer schedule (MLA every 4th layer and the last, AttnRes
 * blocks of 12, the first layer dense): counts of ops and syncs per step at the real depth. */
typedef enum { K3_PRESET_TINY = 0, K3_PRESET_SMALL, K3_PRESET_K3, K3_PRESET_DEEP } k3_preset;
k3_status k3_preset_parse(const char *name, k3_preset *out);
/* The config of a preset (K3_PRESET_K3 is the real Kimi-K3). */
void k3_preset_config(k3_preset p, k3_config *out);

#endif /* K3_MODEL_H */
