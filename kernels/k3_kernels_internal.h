/* k3_kernels_internal.h — private to kernels/: the reference op table and the per-head / per-row
 * pieces of the reference backend that the cpu backend reuses from its worker threads (so the
 * two cannot drift), the thread pool, and the host memory functions shared by ref and cpu.
 * Nothing outside kernels/ includes this. */
#ifndef K3_KERNELS_INTERNAL_H
#define K3_KERNELS_INTERNAL_H

#include "k3_kernels.h"

/* Upper bound on n_group handled by moe_topk (group scores live on the stack). */
#define K3_MOE_TOPK_MAX_GROUPS 1024

extern const k3_ops k3_ref_ops;
extern const k3_ops k3_cpu_ops;

/* One KDA head over n tokens. Row strides (floats) of q/k/g (sqk), v/o (svo) and beta (sb);
 * pointers already offset to the head. S [dk, dv]. */
void k3_ref_kda_head_recurrent(const float *q, const float *k, const float *v, const float *g,
                               const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                               int dk, int dv, float scale, float *S, float *o);
void k3_ref_kda_head_chunked(const float *q, const float *k, const float *v, const float *g,
                             const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                             int dk, int dv, float scale, float *S, float *o, int C, float *work);
/* One head of attn_latent: qc [W], cache [n_ctx, W] rows (blk NULL) or a paged cache's rows
 * through the block table blk (k3_seqs), o [Rkv], work [n_ctx]. */
void k3_ref_attn_latent_head(const float *qc, const float *cache, const int32_t *blk, int64_t n_ctx,
                             int W, int Rkv, float scale, float *o, float *work);
/* The latent-attention ops' shapes (H >= 1, 1 <= Rkv <= W <= K3_ATTN_MAX_W, n_ctx or pos0 and
 * n_q >= 0): K3_ERR_ARG naming them. */
k3_status k3_kernels_check_attn(const char *op, int64_t pos0, int64_t n_q, int H, int W, int Rkv);
/* The KDA ops' limits (stack rows of the reference code): K3_ERR_ARG naming them. */
k3_status k3_kernels_check_kda(int dk, int dv, int C);
/* kda_gate on token rows [t0, t1). */
void k3_ref_kda_gate_rows(float *r, const float *dt_bias, const float *a_log, int64_t t0,
                          int64_t t1, int H, int dk, bool has_lower_bound, float lower_bound);
/* moe_topk on token rows [t0, t1) (arguments checked by the caller). */
k3_status k3_ref_moe_topk_rows(const float *scores, const float *bias, int64_t t0, int64_t t1,
                               int E, int K, int G, int topk_group, bool renorm, float scale,
                               float *work, int32_t *ids, float *w);
k3_status k3_kernels_check_topk(int E, int K, int G, int topk_group);
/* rows_wsum of segment j. */
/* attnres_mix of tokens [t0, t1) (bank [n_bank, T, D]); the op checks n_bank first
   (k3_ref_attnres_check). */
void k3_ref_attnres_mix_rows(const float *bank, int n_bank, const float *p, const float *w,
                             int64_t T, int64_t D, float eps, float *out, int64_t t0, int64_t t1);
/* attnres_mix's weights from its n <= 64 scores, in place: their softmax in ref's order (the max,
   expf(s - max) summed in source order, each divided by the sum; the cpu backend's too). */
void k3_ref_attnres_softmax(float *s, int n);
k3_status k3_ref_attnres_check(int n_bank);
/* short_conv's outputs of channels [c0, c1) (state read, not written), and then its state update
   (the op = every channel's outputs, then the state). */
void k3_ref_short_conv_cols(const float *in, int64_t n, int64_t P, int K, const float *w,
                            const float *state, float *out, int64_t c0, int64_t c1);
void k3_ref_short_conv_state(const float *in, int64_t n, int64_t P, int K, float *state);
void k3_ref_rows_wsum_seg(const float *x, const float *w, const int64_t *seg, int64_t seg_len,
                          int64_t j, int64_t width, float *y);
k3_status k3_kernels_check_seg(const int64_t *seg, int64_t seg_len, int64_t n_seg);

/* The varlen ops of the ref and cpu backends (ref_seqs.c, ref_moe.c; cpu.c, cpu_attn.c, cpu_kda.c,
 * cpu_moe.c). */
/* clang-format off */
#define K3_SEQ_OPS(X)                                                                              \
    X(rmsnorm_rows) X(matmul_heads) X(kv_write) X(attn_paged) X(short_conv_seqs) X(kda_seqs)       \
    X(nonfinite_rows) X(rows_last) X(moe_experts)
/* clang-format on */

/* parameter lists of those ops, as K3_OP_LIST has them */
#define K3_OP_PARAMS_GET(name, params, args) typedef k3_status k3_op_fn_##name params;
K3_OP_LIST(K3_OP_PARAMS_GET)
#undef K3_OP_PARAMS_GET
#define K3_SEQ_DECL(name) k3_op_fn_##name k3_ref_##name, k3_cpu_##name;
K3_SEQ_OPS(K3_SEQ_DECL)
#undef K3_SEQ_DECL
/* The argument checks every backend of these ops makes (one definition, one set of messages):
 * rmsnorm_rows' strides; matmul_heads' head rows within W; moe_experts' scalars (row_div, E, whole
 * tokens with weights); and, for backends that read the ids on the host (ref, cpu), the ids, the
 * loaded experts, their shapes (w1, w3 [I, Lw], w2 [Lw, I] as the first row's: *Lw, *I) and
 * row_of, before any buffer is written. */
k3_status k3_kernels_check_rows(int64_t xs, int64_t ys, int64_t n);
k3_status k3_kernels_check_heads(const k3_tensor *W, int H, int64_t T, int64_t r0, int64_t rh,
                                 int64_t nr);
k3_status k3_kernels_check_moe(int64_t row_div, const float *w, int64_t n, int E);
k3_status k3_ref_moe_check(int64_t row_div, const int32_t *row_of, const int32_t *ids,
                           const float *w, int64_t n, int E, const k3_tensor *w1,
                           const k3_tensor *w3, const k3_tensor *w2, size_t e_stride,
                           const float *work, int64_t *Lw, int64_t *I);
/* Expert e's tensor of a table whose entries are e_stride bytes apart (moe_experts). */
static inline const k3_tensor *k3_moe_expert_t(const k3_tensor *t, int e, size_t e_stride) {
    return (const k3_tensor *)(const void *)((const char *)t + (size_t)e * e_stride);
}
/* The paged cache row of position p of sequence i (host-visible descriptor arrays). */
static inline int64_t k3_seqs_kv_row(const k3_seqs *sq, int i, int64_t p) {
    return (int64_t)sq->blocks[(int64_t)i * sq->max_blocks + p / K3_KV_BLOCK] * K3_KV_BLOCK +
           p % K3_KV_BLOCK;
}

/* A matmul weight must be 2-D [out, in], F32/BF16/MXFP4 (MXFP4: in % 32 == 0, with scales). */
k3_status k3_kernels_check_weight(const k3_tensor *W, const char *op);
/* The same for every item of a matmul_group (the message names "matmul_group item i"). */
k3_status k3_kernels_check_group(const k3_mm *mm, int n);

/* The cpu backend's thread pool (one per cpu/guard backend, in its context): run fn(ctx, i) for
 * i in [0, n_tasks) on the workers + the caller; returns when all are done. Which thread runs a
 * task never changes a result (tasks own disjoint outputs). */
typedef struct k3_pool k3_pool;
typedef void (*k3_task_fn)(void *ctx, int64_t i);
k3_status k3_pool_create(int n_threads, k3_pool **out); /* n <= 0: online CPUs (<= 64) */
void k3_pool_destroy(k3_pool *p);
int k3_pool_threads(const k3_pool *p);
/* Whether a worker is awake (running a job or spinning for the next): a job then starts on it
 * within ~1 µs; otherwise it would first be woken (a futex wake-up, tens of µs on a VM, more on
 * a loaded host). False before the first job. */
bool k3_pool_awake(const k3_pool *p);
void k3_pool_run(k3_pool *p, int64_t n_tasks, k3_task_fn fn, void *ctx);

/* The cpu backend's kernel table for one ISA (kernels/cpu/cpu_kern.h), chosen at backend
 * creation by cpuid or K3_ISA=avx512|avx2|scalar (K3_ERR_ARG naming an unknown or unsupported
 * value). */
typedef struct k3_cpu_kern k3_cpu_kern;
k3_status k3_cpu_kern_select(const k3_cpu_kern **out, bool *gemv_seq);
/* Whether this CPU can run the named ISA ("avx512", "avx2", "scalar"; false for other names). */
bool k3_cpu_isa_supported(const char *name);

/* The cpu backend's context: its pool and kernel table. The guard backend embeds a cpu
 * backend. */
typedef struct k3_cpu_ctx {
    k3_pool *pool;
    const k3_cpu_kern *kern;
    /* decode F32/BF16 rows as two streams in memory order (true: AMD's pick) or GV_R rows side
       by side (false); chosen with the ISA at creation (isa.c, K3_GEMV forces one) */
    bool gemv_seq;
    /* prefill's x, packed once per matmul for all its tasks (cpu.c): grown on demand, used by
       one call at a time (a call that finds it busy packs per task instead) */
    float *xpk;
    size_t xpk_cap; /* floats */
    int xpk_busy;   /* taken and released with __atomic builtins (this header is also C++'s) */
} k3_cpu_ctx;
static inline k3_pool *k3_cpu_pool(k3_backend *be) {
    return be && be->ctx ? ((k3_cpu_ctx *)be->ctx)->pool : NULL;
}

/* Host memory functions shared by the ref and cpu backends. */
extern const k3_backend_iface k3_host_mem_iface;

/* Constructors used by k3_backend_create. */
k3_status k3_backend_create_cpu(const k3_backend_params *p, k3_backend **out);
k3_status k3_backend_create_ref(k3_backend **out);
k3_status k3_backend_create_guard(const k3_backend_params *p, k3_backend **out);
#ifdef K3_HAVE_CUDA
k3_status k3_backend_create_cuda(const k3_backend_params *p, k3_backend **out);
/* The weight dtypes each op of the op list takes (wt = K3_DT_COUNT: the op at all): matmul and
 * matmul_tn F32/BF16/MXFP4, to_f32 and embed_rows F32/BF16/F16, the rest none. A backend that
 * implements an op implements it for all of these; its supports_op calls this. */
bool k3_op_takes(int op, k3_dtype wt);
/* Without creating anything: the CUDA devices visible (0 with *why set when none or the runtime
 * fails) and the ops of K3_OP_LIST the cuda backend implements. */
int k3_backend_cuda_devices(char *why, size_t n);
int k3_backend_cuda_ops_done(void);
/* Whether the cuda kernels of this source tree have passed scripts/device-check.sh on a device
 * (K3_CUDA_DEVICE_VERIFIED in backend_cuda.c; set by the session that ran it). Until then
 * --backend auto does not pick cuda; --backend cuda still runs them, for that check. */
bool k3_backend_cuda_verified(void);
#endif

#endif /* K3_KERNELS_INTERNAL_H */
