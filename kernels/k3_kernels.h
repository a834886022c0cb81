/* kernels — the compute primitives of k3 behind ONE op table (STYLE.md §4, §14).
 *
 * Owns: the op list (K3_OP_LIST, an X-macro: names, the k3_ops struct, its count assert and the
 * test registry all come from it); the reference backend ref/ (plain C, defines the semantics);
 * the cpu backend cpu/ (AVX2+FMA or scalar, and a small persistent pthread pool); the choice
 * of backend (k3_ops_default). The cuda backend lives in kernels/cuda/ only.
 * Callers must not: know which backend runs, or allocate/free inside an op (ops never allocate;
 * scratch comes from the caller).
 *
 * Determinism rule (what makes `--deterministic` bit-identical): every output element is ONE
 * fixed-order reduction that depends neither on how many tokens T share a call nor on the
 * number of threads. Threads split over output rows/heads/tokens, never inside one dot product.
 * Two backends may differ from each other (ref vs cpu) but each is reproducible on its own.
 *
 * Layout conventions: row-major; "[T, n]" = T rows of n floats. Weights are k3_tensor [out, in]
 * (PyTorch order) of dtype F32, BF16 or MXFP4 (model/k3_model.h). */
#ifndef K3_KERNELS_H
#define K3_KERNELS_H

#include "k3_base.h"
#include "k3_model.h"

/* ---- the op list: X(name, return type, (parameters)) ------------------------------------- */
#define K3_OP_LIST(X)                                                                                     \
    /* y[T, out] = x[T, in] · Wᵀ ; W [out, in] F32/BF16/MXFP4. K3_ERR_SHAPE on other dtypes. */        \
    X(matmul, k3_status, (const float *x, int64_t T, const k3_tensor *W, float *y))                       \
    /* y[T, in] = x[T, out] · W ; W [out, in] (the transposed product, for absorbed MLA). */             \
    X(matmul_tn, k3_status, (const float *x, int64_t T, const k3_tensor *W, float *y))                    \
    /* y[t] = w ⊙ x[t] / sqrt(mean(x[t]²) + eps); x, y [T, n]; w [n] (NULL = ones). */                 \
    X(rmsnorm, void, (const float *x, const float *w, int64_t T, int64_t n, float eps, float *y))         \
    /* y[t] = x[t] · rsqrt(Σ x[t]² + eps)  (fla's l2norm); x, y [T, n]. */                             \
    X(l2norm, void, (const float *x, int64_t T, int64_t n, float eps, float *y))                          \
    /* y = x σ(x), elementwise over n. y may alias x. */                                                 \
    X(silu, void, (const float *x, int64_t n, float *y))                                                  \
    /* y = σ(x) = 1/(1+e^-x), elementwise. y may alias x. */                                             \
    X(sigmoid, void, (const float *x, int64_t n, float *y))                                               \
    /* y = [β tanh(g/β) σ(g)]·[λ tanh(u/λ)] (λ ≤ 0: u unchanged); g, u, y [n]; y may alias g. */ \
    X(situ, void,                                                                                         \
      (const float *g, const float *u, int64_t n, float beta, float lin_beta, float *y))                  \
    /* y = SiLU(g)·u ; y may alias g. */                                                                 \
    X(swiglu, void, (const float *g, const float *u, int64_t n, float *y))                                \
    /* row softmax: x, y [T, n] (max-subtracted, fp32). y may alias x. */                                 \
    X(softmax, void, (const float *x, int64_t T, int64_t n, float *y))                                    \
    /* AttnRes mix (K3-MODEL.md §1.3) per token t: sources v_0..v_{N-1} = bank[i][t], v_N = p[t];        \
       s_i = Σ_d v_i[d]/sqrt(mean(v_i²)+eps)·w[d]; out[t] = Σ_i softmax(s)_i v_i (raw values).        \
       bank [N, T, D] (slab stride T·D), p, out [T, D], w [D]; N ≥ 0. out may alias p. */              \
    X(attnres_mix, void,                                                                                  \
      (const float *bank, int n_bank, const float *p, const float *w, int64_t T, int64_t D,               \
       float eps, float *out))                                                                            \
    /* KDA delta rule, recurrent (ground truth), n tokens, H heads (K3-MODEL.md §2.2).                   \
       q, k, g [n, H·dk] (q, k already L2-normed; q NOT scaled), v [n, H·dv], beta [n, H];              \
       S [H, dk, dv] fp32 in/out; o [n, H·dv] = scale·Sᵀq read after each update. */                  \
    X(kda_recurrent, void,                                                                                \
      (const float *q, const float *k, const float *v, const float *g, const float *beta,                 \
       int64_t n, int H, int dk, int dv, float scale, float *S, float *o))                                \
    /* KDA chunked (WY/UT) form, same contract as kda_recurrent; full chunks of C tokens use the          \
       chunked math (always exp of a difference ≤ 0, §2.4), a ragged tail the recurrence.              \
       work: >= k3_kda_chunk_work_floats(C, dk, dv) floats per head, for H heads. */                      \
    X(kda_chunked, void,                                                                                  \
      (const float *q, const float *k, const float *v, const float *g, const float *beta,                 \
       int64_t n, int H, int dk, int dv, float scale, float *S, float *o, int C, float *work))            \
    /* Latent attention for ONE query token over n_ctx cached tokens (absorbed MLA, §3.2):               \
       qc [H, W] (W = Rkv + dr: [q_abs | q_pe]), cache [n_ctx, W] ([c | k_pe] rows);                      \
       s_h(j) = scale·qc[h]·cache[j]; p = softmax_j; o_lat[h] = Σ_j p_j cache[j][0:Rkv];               \
       o_lat [H, Rkv]; work >= H·n_ctx floats. */                                                        \
    X(attn_latent, void,                                                                                  \
      (const float *qc, const float *cache, int64_t n_ctx, int H, int W, int Rkv, float scale,            \
       float *o_lat, float *work))

#define K3_OP_FIELD(name, ret, args) ret(*name) args;
typedef struct k3_ops {
    const char *backend; /* "ref", "cpu", "cuda" */
    K3_OP_LIST(K3_OP_FIELD)
} k3_ops;
#undef K3_OP_FIELD

#define K3_OP_ENUM(name, ret, args) K3_OP_##name,
enum { K3_OP_LIST(K3_OP_ENUM) K3_OP_COUNT };
#undef K3_OP_ENUM
_Static_assert(sizeof(k3_ops) == sizeof(const char *) + K3_OP_COUNT * sizeof(void (*)(void)),
               "k3_ops must hold exactly one pointer per op of K3_OP_LIST");

const k3_ops *k3_ops_ref(void);
const k3_ops *k3_ops_cpu(void);
/* The backend layers use unless told otherwise: cpu (the only one built without CUDA). */
const k3_ops *k3_ops_default(void);
/* Lookup by name ("ref" | "cpu"); NULL if unknown. */
const k3_ops *k3_ops_by_name(const char *name);

/* Threads of the cpu backend's process-wide pool (default: online CPUs, at most 64). May be
 * called any time no op is running; n <= 0 restores the default. The pool is created lazily
 * and its worker count only affects speed, never results (determinism rule). */
void k3_kernels_set_threads(int n);
int k3_kernels_threads(void);

/* Scratch of kda_chunked per head (floats). */
size_t k3_kda_chunk_work_floats(int C, int dk, int dv);

/* ---- tensor helpers ---------------------------------------------------------------------- */
/* A view of rows [r0, r0+n) of a 2-D weight [out, in] (F32/BF16/MXFP4): no copy. */
k3_status k3_tensor_rows(const k3_tensor *W, int64_t r0, int64_t n, k3_tensor *out);
/* Element (o, i) of a 2-D weight, decoded to float (any supported dtype; slow, for tests and
 * small vectors). */
float k3_tensor_get(const k3_tensor *W, int64_t o, int64_t i);
/* Decode a 1-D (or any) tensor of F32/BF16/F16 to floats: dst [n_elems]. */
k3_status k3_tensor_to_f32(const k3_tensor *t, float *dst, int64_t n_elems);

#endif /* K3_KERNELS_H */
