/* kernels — the compute floor of k3: the tensor type (k3_tensor.h), the MXFP4 block format
 * (k3_mxfp4.h), the batch descriptor (k3_seqs), the backend object and the op list that covers
 * the whole forward (docs/DESIGN.md §1 and §3a, STYLE.md §4, §14).
 *
 * A backend (k3_backend) is one object: a name, its op table, its context (the cpu backend's
 * thread pool lives there, not in a global), and its memory: alloc/free of buffers in its memory
 * space, upload/download between host memory and its buffers, synchronise, supports_op and
 * free/total memory; optionally stream-ordered copies, events, op counters (guard, cuda) and a
 * native stream. Backends: "ref" (plain C, the semantics of every op), "cpu" (AVX-512, AVX2 + FMA
 * or scalar kernels picked by cpuid or K3_ISA; a thread pool), "guard" (a test backend: cpu ops
 * on memory that is PROT_NONE outside its own ops and transfers, so any host code that touches an
 * activation, a cache or a weight faults), "cuda" (kernels/cuda/: every op as a kernel on the
 * backend's stream; run under emulation, not yet on a device, so "auto" does not pick it).
 * Every op that touches sequences takes the batch descriptor, so one call covers every sequence,
 * head and token of a step.
 * Callers must not: know which backend runs; read or write a non-host buffer except through
 * upload/download; allocate inside an op (scratch comes from the caller).
 *
 * Every op takes the backend first and returns a k3_status (device backends report launch
 * errors; the host backends return K3_OK or a shape/argument error). Pointers named "host" are
 * host memory (small routing metadata: indices, segment offsets); every other pointer is a
 * buffer of the backend (or a view into one).
 *
 * Determinism rule (what makes `--deterministic` bit-identical): every output element is ONE
 * fixed-order reduction that depends neither on how many tokens T share a call nor on the
 * number of threads. Threads split over output rows/heads/tokens, never inside one dot product.
 * Two backends may differ from each other (ref vs cpu) but each is reproducible on its own; the
 * guard backend runs the cpu ops, so it is bit-identical to cpu.
 *
 * Layout conventions: row-major; "[T, n]" = T rows of n floats. Weights are k3_tensor [out, in]
 * (PyTorch order) of dtype F32, BF16 or MXFP4. */
#ifndef K3_KERNELS_H
#define K3_KERNELS_H

#include "k3_base.h"
#include "k3_tensor.h"

typedef struct k3_backend k3_backend;

/* One product of matmul_group: y [T, out] = x [T, in] · Wᵀ, as matmul computes it. */
typedef struct k3_mm {
    const float *x;
    int64_t T;
    const k3_tensor *W;
    float *y;
} k3_mm;

/* ---- the batch descriptor ------------------------------------------------------------------
 * One step's varlen batch, as FlashAttention's cu_seqlens + block table and fla's state indices:
 * built once per step on the host and uploaded in one copy (the arrays are backend memory, the
 * scalars host values that size launches). Every op that touches sequences takes it, so one call
 * covers the whole batch, however many sequences, decode steps and prompt pieces it mixes.
 * Sequence i owns token rows [tok0[i], tok0[i+1]) of every [T, *] activation; its first token
 * sits at position pos[i] (the tokens before it are in its cache and state); its KDA and
 * short-conv states are slot slot[i] of the stage's slot pool; position p of its latent cache is
 * row p % K3_KV_BLOCK of block blocks[i·max_blocks + p / K3_KV_BLOCK] of the paged cache. */
/* K3_KV_BLOCK (k3_tensor.h): tokens per paged-cache block. */
typedef struct k3_seqs {
    int n_seqs;            /* >= 0 */
    int64_t T;             /* Σ tokens = tok0[n_seqs] */
    int64_t max_ctx;       /* max over i of pos[i] + n_tokens[i] (sizes scratch and launches) */
    int64_t max_new;       /* max over i of n_tokens[i] (1: a pure decode step) */
    int max_blocks;        /* row stride of blocks */
    const int32_t *tok0;   /* [n_seqs + 1] token offsets, tok0[0] = 0 */
    const int32_t *pos;    /* [n_seqs] position of the first token */
    const int32_t *slot;   /* [n_seqs] state slot, distinct */
    const int32_t *blocks; /* [n_seqs, max_blocks] cache block ids (NULL when no op reads it) */
} k3_seqs;
/* Floats of backend memory a descriptor of up to n_seqs sequences and max_blocks blocks each
 * takes (k3_seqs_build lays it out). */
size_t k3_seqs_floats(int n_seqs, int max_blocks);
/* Lay a descriptor out in host memory h (k3_seqs_floats floats) from the per-sequence values,
 * pointing its arrays into dev (backend memory of the same size, which the caller uploads h to);
 * blocks_h [n_seqs, max_blocks] may be NULL. Checks n_tokens >= 1, pos >= 0. */
k3_status k3_seqs_build(int n_seqs, const int32_t *n_tokens, const int32_t *pos,
                        const int32_t *slot, const int32_t *blocks_h, int max_blocks, void *h,
                        void *dev, k3_seqs *out);

/* ---- the op list: X(name, (parameters), (argument names)) -------------------------------- */
/* Every op returns k3_status; the argument list lets wrappers (the guard backend) forward. */
#define K3_OP_LIST(X)                                                                                     \
    /* y[T, out] = x[T, in] · Wᵀ ; W [out, in] F32/BF16/MXFP4. K3_ERR_SHAPE on other dtypes. */        \
    X(matmul, (k3_backend * be, const float *x, int64_t T, const k3_tensor *W, float *y),                 \
      (be, x, T, W, y))                                                                                   \
    /* n independent matmuls in one call: mm[i].y = matmul(mm[i].x, mm[i].T, mm[i].W), bit for bit        \
       what n matmul calls give; mm a host array (n >= 0); no item's y overlaps another's x or y.         \
       One dispatch for a MoE step's experts or a layer's projections of one input: the cpu pool          \
       shares the rows of all items among its threads at once. */                                         \
    X(matmul_group, (k3_backend * be, const k3_mm *mm, int n), (be, mm, n))                               \
    /* y[T, in] = x[T, out] · W ; W [out, in] (the transposed product, for absorbed MLA). */             \
    X(matmul_tn, (k3_backend * be, const float *x, int64_t T, const k3_tensor *W, float *y),              \
      (be, x, T, W, y))                                                                                   \
    /* y[t] = w ⊙ x[t] / sqrt(mean(x[t]²) + eps); x, y [T, n]; w [n] (NULL = ones). */                 \
    X(rmsnorm,                                                                                            \
      (k3_backend * be, const float *x, const float *w, int64_t T, int64_t n, float eps,                  \
       float *y),                                                                                         \
      (be, x, w, T, n, eps, y))                                                                           \
    /* y[t] = x[t] · rsqrt(Σ x[t]² + eps)  (fla's l2norm); x, y [T, n]. */                             \
    X(l2norm, (k3_backend * be, const float *x, int64_t T, int64_t n, float eps, float *y),               \
      (be, x, T, n, eps, y))                                                                              \
    /* y = x σ(x), elementwise over n. y may alias x. */                                                 \
    X(silu, (k3_backend * be, const float *x, int64_t n, float *y), (be, x, n, y))                        \
    /* y = σ(x) = 1/(1+e^-x), elementwise. y may alias x. */                                             \
    X(sigmoid, (k3_backend * be, const float *x, int64_t n, float *y), (be, x, n, y))                     \
    /* y = [β tanh(g/β) σ(g)]·[λ tanh(u/λ)] (λ ≤ 0: u unchanged); g, u, y [n]; y may alias g. */ \
    X(situ,                                                                                               \
      (k3_backend * be, const float *g, const float *u, int64_t n, float beta, float lin_beta,            \
       float *y),                                                                                         \
      (be, g, u, n, beta, lin_beta, y))                                                                   \
    /* y = SiLU(g)·u ; y may alias g. */                                                                 \
    X(swiglu, (k3_backend * be, const float *g, const float *u, int64_t n, float *y),                     \
      (be, g, u, n, y))                                                                                   \
    /* row softmax: x, y [T, n] (max-subtracted, fp32). y may alias x. */                                 \
    X(softmax, (k3_backend * be, const float *x, int64_t T, int64_t n, float *y),                         \
      (be, x, T, n, y))                                                                                   \
    /* y = a + b elementwise over n (residual adds, shared-expert add). y may alias a or b. */            \
    X(add, (k3_backend * be, const float *a, const float *b, int64_t n, float *y),                        \
      (be, a, b, n, y))                                                                                   \
    /* y = a ⊙ b elementwise over n (output gates). y may alias a or b. */                              \
    X(mul, (k3_backend * be, const float *a, const float *b, int64_t n, float *y),                        \
      (be, a, b, n, y))                                                                                   \
    /* y[i] = v for i < n (state resets). */                                                              \
    X(fill, (k3_backend * be, float *y, int64_t n, float v), (be, y, n, v))                               \
    /* rows × cols floats: dst[r·dst_stride + c] = src[r·src_stride + c]; no overlap (strides in       \
       floats). Stage hand-offs, bank slabs, cache writes, per-head staging, head rows. */                \
    X(copy2d,                                                                                             \
      (k3_backend * be, float *dst, int64_t dst_stride, const float *src, int64_t src_stride,             \
       int64_t rows, int64_t cols),                                                                       \
      (be, dst, dst_stride, src, src_stride, rows, cols))                                                 \
    /* dst [n] = the n elements of t (F32/BF16/F16) decoded to f32 (small weight vectors). */             \
    X(to_f32, (k3_backend * be, const k3_tensor *t, int64_t n, float *dst), (be, t, n, dst))              \
    /* out[t] = row ids[t] of the embedding W [V, D] (F32/BF16/F16) decoded to f32; ids [T] int32         \
       in backend memory, each in [0, V) (checked: K3_ERR_ARG naming the position). */                    \
    X(embed_rows,                                                                                         \
      (k3_backend * be, const k3_tensor *W, const int32_t *ids, int64_t T, float *out),                   \
      (be, W, ids, T, out))                                                                               \
    /* Depthwise causal conv (KDA short conv, K3-MODEL.md §2.1), NO activation: out[t, c] =              \
       Σ_j w[c, j]·in_{t-(K-1)+j}[c], in_{<0} from state [K-1, P] (oldest first); then state =          \
       the last K-1 inputs of (state ++ in). in, out [n, P]; w [P, K]. */                                 \
    X(short_conv,                                                                                         \
      (k3_backend * be, const float *in, int64_t n, int64_t P, int K, const float *w,                     \
       float *state, float *out),                                                                         \
      (be, in, n, P, K, w, state, out))                                                                   \
    /* KDA decay gate in log space (§2.1) over r [T, H·dk] in place: v = r + dt_bias[c],                \
       a = exp(a_log[h]); lower_bound form: lb·σ(a·v); else −a·softplus(v). */                      \
    X(kda_gate,                                                                                           \
      (k3_backend * be, float *r, const float *dt_bias, const float *a_log, int64_t T, int H,             \
       int dk, bool has_lower_bound, float lower_bound),                                                  \
      (be, r, dt_bias, a_log, T, H, dk, has_lower_bound, lower_bound))                                    \
    /* AttnRes mix (K3-MODEL.md §1.3) per token t: sources v_0..v_{N-1} = bank[i][t], v_N = p[t];        \
       s_i = Σ_d v_i[d]/sqrt(mean(v_i²)+eps)·w[d]; out[t] = Σ_i softmax(s)_i v_i (raw values).        \
       bank [N, T, D] (slab stride T·D), p, out [T, D], w [D]; N ≥ 0. out may alias p. */              \
    X(attnres_mix,                                                                                        \
      (k3_backend * be, const float *bank, int n_bank, const float *p, const float *w, int64_t T,         \
       int64_t D, float eps, float *out),                                                                 \
      (be, bank, n_bank, p, w, T, D, eps, out))                                                           \
    /* KDA delta rule, recurrent (ground truth), n tokens, H heads (K3-MODEL.md §2.2).                   \
       q, k, g [n, H·dk] (q, k already L2-normed; q NOT scaled), v [n, H·dv], beta [n, H];              \
       S [H, dk, dv] fp32 in/out; o [n, H·dv] = scale·Sᵀq read after each update. */                  \
    X(kda_recurrent,                                                                                      \
      (k3_backend * be, const float *q, const float *k, const float *v, const float *g,                   \
       const float *beta, int64_t n, int H, int dk, int dv, float scale, float *S, float *o),             \
      (be, q, k, v, g, beta, n, H, dk, dv, scale, S, o))                                                  \
    /* KDA chunked (WY/UT) form, same contract as kda_recurrent; full chunks of C tokens use the          \
       chunked math (always exp of a difference ≤ 0, §2.4), a ragged tail the recurrence.              \
       work: >= k3_kda_chunk_work_floats(C, dk, dv) floats per head, for H heads. */                      \
    X(kda_chunked,                                                                                        \
      (k3_backend * be, const float *q, const float *k, const float *v, const float *g,                   \
       const float *beta, int64_t n, int H, int dk, int dv, float scale, float *S, float *o,              \
       int C, float *work),                                                                               \
      (be, q, k, v, g, beta, n, H, dk, dv, scale, S, o, C, work))                                         \
    /* Latent attention for ONE query token over n_ctx cached tokens (absorbed MLA, §3.2):               \
       qc [H, W] (W = Rkv + dr: [q_abs | q_pe]), cache [n_ctx, W] ([c | k_pe] rows);                      \
       s_h(j) = scale·qc[h]·cache[j]; p = softmax_j; o_lat[h] = Σ_j p_j cache[j][0:Rkv];               \
       o_lat [H, Rkv]; work >= H·n_ctx floats; 1 <= Rkv <= W <= K3_ATTN_MAX_W. The cpu backend           \
       computes it as attn_latent_causal with pos0 = n_ctx − 1, n_q = 1 (the same bits). */             \
    X(attn_latent,                                                                                        \
      (k3_backend * be, const float *qc, const float *cache, int64_t n_ctx, int H, int W, int Rkv,        \
       float scale, float *o_lat, float *work),                                                           \
      (be, qc, cache, n_ctx, H, W, Rkv, scale, o_lat, work))                                              \
    /* Causal latent attention of n_q consecutive query tokens of ONE sequence (prefill chunk or          \
       decode step): query j < n_q sits at position pos0 + j and attends to cache rows                    \
       [0, pos0 + j], i.e. o_lat[j] = attn_latent(qc[j], cache, n_ctx = pos0 + j + 1). qc [n_q, H,        \
       W], cache [>= pos0 + n_q, W] (the queries' own rows written), o_lat [n_q, H, Rkv]; pos0 >=         \
       0, 1 <= Rkv <= W <= K3_ATTN_MAX_W; work >= k3_attn_latent_causal_work_floats(pos0 + n_q,           \
       H); no argument aliases another. Determinism: a query's result depends only on its qc row,         \
       its context length and the cache — not on n_q, pos0 or the thread count — so one prefill       \
       call, prefill in chunks and token-by-token decode agree bit for bit (cpu: flash-style              \
       blocks of cache rows at fixed absolute boundaries with an online softmax,                          \
       kernels/cpu/kern_attn.h). */                                                                       \
    X(attn_latent_causal,                                                                                 \
      (k3_backend * be, const float *qc, const float *cache, int64_t pos0, int64_t n_q, int H,            \
       int W, int Rkv, float scale, float *o_lat, float *work),                                           \
      (be, qc, cache, pos0, n_q, H, W, Rkv, scale, o_lat, work))                                          \
    /* MoE router selection (K3-MODEL.md §4.3, experts/k3_experts.h "Slot order"): scores σ(z)          \
       [T, E]; bias [E] (NULL = none) added for selection only; grouped top-k (n_group groups,            \
       topk_group kept; group score = sum of its two best biased scores; ties to the lower                \
       index); ids [T, K] int32, w [T, K] = σ(z)[id], renormalised (sum in slot order + 1e-20)           \
       when renorm, × scale. work: [T, E] floats. A token with a non-finite (biased) score gets          \
       ids 0..K-1 and NaN weights: its MoE output is NaN, so its sequence alone fails the step's          \
       check. */                                                                                          \
    X(moe_topk,                                                                                           \
      (k3_backend * be, const float *scores, const float *bias, int64_t T, int E, int K,                  \
       int n_group, int topk_group, bool renorm, float scale, float *work, int32_t *ids,                  \
       float *w),                                                                                         \
      (be, scores, bias, T, E, K, n_group, topk_group, renorm, scale, work, ids, w))                      \
    /* dst[j] = src[idx[j]] (rows of width floats), j < n; idx host int64. */                             \
    X(rows_gather,                                                                                        \
      (k3_backend * be, const float *src, int64_t width, const int64_t *idx, int64_t n,                   \
       float *dst),                                                                                       \
      (be, src, width, idx, n, dst))                                                                      \
    /* dst[idx[j]] = src[j] (rows of width floats), j < n; idx host int64, distinct. */                   \
    X(rows_scatter,                                                                                       \
      (k3_backend * be, const float *src, int64_t width, const int64_t *idx, int64_t n,                   \
       float *dst),                                                                                       \
      (be, src, width, idx, n, dst))                                                                      \
    /* Segment-weighted row sums: y[j] = Σ_{i in segment j} w[i]·x[i] accumulated in i order, the       \
       first term initialising (w NULL: weights 1). Segment j = [seg[j], seg[j+1]) with seg host          \
       int64 [n_seg + 1], or, when seg is NULL, [j·seg_len, (j+1)·seg_len). Every segment is            \
       non-empty. x [rows, width], y [n_seg, width]. The MoE slot sum (segments of K slots) and           \
       the per-owner pre-sum of the combine. */                                                           \
    X(rows_wsum,                                                                                          \
      (k3_backend * be, const float *x, const float *w, const int64_t *seg, int64_t seg_len,              \
       int64_t n_seg, int64_t width, float *y),                                                           \
      (be, x, w, seg, seg_len, n_seg, width, y))                                                          \
    /* ---- varlen ops: one call for every sequence, head and token of a step ---- */                     \
    /* rmsnorm with row strides (floats): y[t·ys ..+n] = rmsnorm(x[t·xs ..+n]); the same bits as        \
       rmsnorm row by row. y may alias x (same strides). */                                               \
    X(rmsnorm_rows,                                                                                       \
      (k3_backend * be, const float *x, int64_t xs, const float *w, int64_t T, int64_t n,                 \
       float eps, float *y, int64_t ys),                                                                  \
      (be, x, xs, w, T, n, eps, y, ys))                                                                   \
    /* Per-head products of H heads over T tokens with strided rows (absorbed MLA): head h's              \
       weight W_h = rows [r0 + h·rh, + nr) of W (F32/BF16), x_h[t] = x + t·xt + h·xh,                  \
       y_h[t] = y + t·yt + h·yh. trans false: y_h[t] [nr] = W_h·x_h[t] (x rows W->shape[1] wide,       \
       matmul); trans true: y_h[t] [W->shape[1]] = W_hᵀ·x_h[t] (x rows nr wide, matmul_tn). Bit        \
       for bit H matmul / matmul_tn calls on contiguous copies. work >= T·(in + out) floats. */          \
    X(matmul_heads,                                                                                       \
      (k3_backend * be, const float *x, int64_t xt, int64_t xh, int64_t T, int H,                         \
       const k3_tensor *W, int64_t r0, int64_t rh, int64_t nr, bool trans, float *y, int64_t yt,          \
       int64_t yh, float *work),                                                                          \
      (be, x, xt, xh, T, H, W, r0, rh, nr, trans, y, yt, yh, work))                                       \
    /* Paged cache write: token row t of sequence i (src [T, W]) goes to its position's row of the        \
       paged cache [n_blocks, K3_KV_BLOCK, W] through the block table. */                                 \
    X(kv_write, (k3_backend * be, const k3_seqs *sq, const float *src, int W, float *cache),              \
      (be, sq, src, W, cache))                                                                            \
    /* Latent attention of every token of the batch over its own sequence's paged cache: token t          \
       of sequence i at position p attends to positions [0, p] (written by kv_write before):              \
       o_lat[t] = attn_latent(qc[t], cache rows 0..p) bit for bit (attn_latent_causal of a                \
       contiguous copy). qc [T, H, W], o_lat [T, H, Rkv]; work >=                                         \
       k3_attn_latent_causal_work_floats(sq->max_ctx, H). */                                              \
    X(attn_paged,                                                                                         \
      (k3_backend * be, const k3_seqs *sq, const float *qc, const float *cache, int H, int W,             \
       int Rkv, float scale, float *o_lat, float *work),                                                  \
      (be, sq, qc, cache, H, W, Rkv, scale, o_lat, work))                                                 \
    /* short_conv of every sequence on its own token rows, its state at state +                           \
       slot[i]·state_stride                                                                              \
       ([K-1, P] floats, updated; a sequence at pos[i] == 0 starts from zeros). in, out [T, P]. */        \
    X(short_conv_seqs,                                                                                    \
      (k3_backend * be, const k3_seqs *sq, const float *in, int64_t P, int K, const float *w,             \
       float *state, int64_t state_stride, float *out),                                                   \
      (be, sq, in, P, K, w, state, state_stride, out))                                                    \
    /* The KDA delta rule of every sequence on its own token rows, state S + slot[i]·S_stride            \
       ([H, dk, dv] fp32): kda_chunked (C >= 2 and the sequence has >= C tokens) or kda_recurrent,        \
       bit for bit. q, k, g [T, H·dk], v, o [T, H·dv], beta [T, H]; work as kda_chunked (C >= 2).       \
       A sequence at pos[i] == 0 starts from S = 0 (a new sequence's state needs no reset op). */         \
    X(kda_seqs,                                                                                           \
      (k3_backend * be, const k3_seqs *sq, const float *q, const float *k, const float *v,                \
       const float *g, const float *beta, int H, int dk, int dv, float scale, float *S,                   \
       int64_t S_stride, float *o, int C, float *work),                                                   \
      (be, sq, q, k, v, g, beta, H, dk, dv, scale, S, S_stride, o, C, work))                              \
    /* The non-finite check of a step, on the backend: for each sequence i with flags[i] == 0             \
       whose rows of y hold a NaN or Inf, flags[i] = code and those rows are zeroed (the layers           \
       after it must not fail the other sequences). Rows: its token rows of y [T, D], or row i of         \
       y [n_seqs, D] when per_seq. flags: backend int32 [n_seqs], read by the host once a step. */        \
    X(nonfinite_rows,                                                                                     \
      (k3_backend * be, const k3_seqs *sq, float *y, int64_t D, bool per_seq, int32_t code,               \
       int32_t *flags),                                                                                   \
      (be, sq, y, D, per_seq, code, flags))                                                               \
    /* Each sequence's last token row of n_slab slabs: dst[(j·n_seqs + i)·D ..] = src[j·slab +         \
       (tok0[i+1] − 1)·D ..], j < n_slab (the rows that get logits, and their AttnRes bank). */        \
    X(rows_last,                                                                                          \
      (k3_backend * be, const k3_seqs *sq, const float *src, int64_t slab, int n_slab, int64_t D,         \
       float *dst),                                                                                       \
      (be, sq, src, slab, n_slab, D, dst))                                                                \
    /* The routed experts of a MoE layer over n slot rows, expert ids in BACKEND memory (one op:          \
       the cpu backend groups the rows by expert itself, a device runs a grouped GEMM): out[i] =          \
       W2_e·act(W1_e·r_i, W3_e·r_i), e = ids[i], r_i = src row i / row_div (row_div K: the T·K        \
       slot rows of T token rows), or src row row_of[i] when row_of (backend int32 [n], >= 0: the         \
       rows an expert-parallel lane received) is not NULL. Expert e's matrices: *(const k3_tensor         \
       *)((const char *)w1 + e·e_stride) (w3, w2 alike: fields of a table of structs); an expert         \
       with no data is not on this rank (K3_ERR_MISSING naming row and expert). act: swiglu (beta         \
       < 0) or situ(beta, lin_beta). w NULL: out [n, Lw], row i = item i, bit for bit                     \
       k3_moe_expert_rows (experts/) (cuda's MXFP4 tensor-core form: split bf16 rows, within the          \
       bound of tests/tolerances.h instead); w [n] (backend): out [n / row_div, Lw], row t = Σ_k         \
       w[t·row_div + k]·item(t·row_div + k) in k order, the first term initialising (rows_wsum's       \
       order), without an [n, Lw] buffer. work                                                            \
       >= k3_moe_experts_work_floats. cuda's MXFP4 form routes on the device (no host read): with         \
       w, an expert takes at most one slot of each token (the router's top-k names distinct               \
       experts): more is K3_ERR_STATE naming the expert and its capacity, never a dropped row; its        \
       check is deferred like moe_topk's (errors_defer), so out is written before a bad id is             \
       reported. */                                                                                       \
    X(moe_experts,                                                                                        \
      (k3_backend * be, const float *src, int64_t row_div, const int32_t *row_of,                         \
       const int32_t *ids, const float *w, int64_t n, int E, const k3_tensor *w1,                         \
       const k3_tensor *w3, const k3_tensor *w2, size_t e_stride, float beta, float lin_beta,             \
       float *out, float *work),                                                                          \
      (be, src, row_div, row_of, ids, w, n, E, w1, w3, w2, e_stride, beta, lin_beta, out, work))

#define K3_OP_FIELD(name, params, args) k3_status(*name) params;
typedef struct k3_ops {
    K3_OP_LIST(K3_OP_FIELD)
} k3_ops;
#undef K3_OP_FIELD

#define K3_OP_ENUM(name, params, args) K3_OP_##name,
enum { K3_OP_LIST(K3_OP_ENUM) K3_OP_COUNT };
#undef K3_OP_ENUM
_Static_assert(sizeof(k3_ops) == K3_OP_COUNT * sizeof(void (*)(void)),
               "k3_ops must hold exactly one pointer per op of K3_OP_LIST");
const char *k3_op_name(int op); /* "matmul", ... ; "?" out of range */

/* ---- the backend object ------------------------------------------------------------------ */
/* opaque, backend-defined (not the engine's k3_event) */
typedef struct k3_backend_event k3_backend_event;
/* opaque, backend-defined: a captured and instantiated sequence of ops (cuda: a cudaGraphExec_t) */
typedef struct k3_backend_graph k3_backend_graph;

/* What a counting backend (guard, cuda) has done since it was created: op calls by op, host
 * syncs (device -> host reads the host waits for: download, synchronize, event_sync) and the
 * bytes each way. Differences of two reads give one step's figures (k3 run --op-stats). */
typedef struct k3_op_stats {
    uint64_t calls[K3_OP_COUNT];
    uint64_t host_syncs;
    uint64_t h2d_bytes, d2h_bytes; /* upload(_async), download(_async) */
    uint64_t graph_launches;       /* captured steps replayed (cuda graphs; 0 elsewhere) */
    /* The FLOPs of the ops' matrix products (2 per multiply-add, the useful ones: no padding),
     * by op, and of those the ones a tensor-core kernel did (cuda: counted where the kernel was
     * built for tensor cores; in the emulation only when the emulator counted its mma). 0 where
     * a backend does not count them (guard: its inner backend's ops are not counted). */
    uint64_t flops[K3_OP_COUNT], tc_flops[K3_OP_COUNT];
} k3_op_stats;

/* The memory half of a backend (ggml's buffer interface in spirit). n bytes; buffers are
 * zero-filled and 64-byte aligned. */
/* A device backend's device, for `k3 bench kernels`: its name and peaks (from the device's
 * attributes; 0 when unknown) or, under the CUDA emulation, emulated with its counters. A
 * backend without a device: K3_ERR_ARG. */
typedef struct k3_device_info {
    char name[96];
    bool emulated;          /* the CUDA emulation: no timing, counts only */
    double hbm_gbs;         /* peak memory bandwidth, GB/s */
    double tensor_tflops;   /* dense bf16 tensor-core peak, TFLOP/s */
    unsigned long long mma; /* emulated: warp-level mma run so far (after a synchronise) */
} k3_device_info;
/* The expert-parallel dispatch's fixed layout (issue 45; docs/DESIGN.md §3a): E experts, K
 * slots a token, L lanes of at most EL experts each, cap rows per (sender, expert); a lane block
 * is blk_rows = hdr + EL·cap rows of Lw floats (hdr rows hold the EL int32 counts); dest: device
 * int32 [E], expert e -> lane·EL + its index among its lane's experts (ascending ids). */
typedef struct k3_moe_ep {
    int E, K, L, EL;
    int64_t cap, hdr, blk_rows, Lw;
    const int32_t *dest;
} k3_moe_ep;
/* cap = min(T_max, max(1, ceil(T_max · K · factor / E), decode_rows)) (a token gives an expert at
 * most one row, so T_max rows never overflow, and neither does a decode step of at most
 * decode_rows rows on its sender: pass min(T_max, max_seqs)), hdr = ceil(EL / Lw), blk_rows. */
void k3_moe_ep_layout(k3_moe_ep *ep, int E, int K, int L, int EL, int64_t Lw, int64_t T_max,
                      double factor, int64_t decode_rows);

typedef struct k3_backend_iface {
    k3_status (*alloc)(k3_backend *be, size_t n_bytes, void **out);
    void (*free)(k3_backend *be, void *p);
    k3_status (*upload)(k3_backend *be, void *dst, const void *src_host, size_t n_bytes);
    k3_status (*download)(k3_backend *be, void *dst_host, const void *src, size_t n_bytes);
    k3_status (*synchronize)(k3_backend *be);
    /* Whether the backend runs op (K3_OP_*) at all (wt = K3_DT_COUNT), or with a weight tensor of
       dtype wt (ops without a weight tensor: false for any dtype). */
    bool (*supports_op)(const k3_backend *be, int op, k3_dtype wt);
    /* Free and total bytes of the backend's memory (host: MemAvailable / MemTotal). */
    k3_status (*memory)(const k3_backend *be, size_t *free_bytes, size_t *total_bytes);
    void (*destroy)(k3_backend *be);
    /* Optional (NULL: the k3_backend_* helpers fall back to the blocking forms / no-ops).
       Stream-ordered copies: on cuda queued on the backend's stream (the host buffer stays valid
       and unread until an event recorded after the copy has completed); host backends copy now. */
    k3_status (*upload_async)(k3_backend *be, void *dst, const void *src_host, size_t n_bytes);
    k3_status (*download_async)(k3_backend *be, void *dst_host, const void *src, size_t n_bytes);
    /* Events: a point in the backend's stream that the host can wait for. */
    k3_status (*event_create)(k3_backend *be, k3_backend_event **out);
    k3_status (*event_record)(k3_backend *be, k3_backend_event *ev);
    k3_status (*event_sync)(k3_backend *be, k3_backend_event *ev); /* the host waits: a host sync */
    void (*event_destroy)(k3_backend *be, k3_backend_event *ev);
    /* The backend's counters (guard, cuda), NULL for one that does not count. */
    k3_status (*op_stats)(const k3_backend *be, k3_op_stats *out);
    /* The backend's native stream (cuda: its cudaStream_t, with its device made current), for a
       transport that queues device-to-device transfers in the backend's stream order (comm's
       nccl); NULL for host backends. */
    void *(*native_stream)(k3_backend *be);
    /* Optional (NULL: no graphs). Captured steps (cuda graphs): capture_begin puts the backend's
       stream in capture, so every op and async copy until capture_end is recorded and none runs;
       a host sync in between (download, synchronize, event_sync, an error-word read, an
       allocation) fails with K3_ERR_DEVICE and so does capture_end (under the emulator each
       names the call in a k3emu: line). capture_end returns the instantiated graph; graph_launch
       replays it on the stream (op_stats.graph_launches). The ops a capture records count as
       calls when a launch runs them, not when recorded: a step's op count is the same replayed
       or eager. Deferred checks (below) queued in a capture that began with none queued are
       replayed too: a launch leaves them as the recorded calls did, for errors_fetch/verdict. */
    k3_status (*capture_begin)(k3_backend *be);
    k3_status (*capture_end)(k3_backend *be, k3_backend_graph **out);
    k3_status (*graph_launch)(k3_backend *be, k3_backend_graph *g);
    void (*graph_destroy)(k3_backend *be, k3_backend_graph *g);
    /* Optional (NULL: checks are immediate, as they are by default). Deferred checks: between
       errors_defer(true) and the verdict, an op whose contract reads back an error word
       (embed_rows, moe_topk on cuda) queues its check on the device and returns K3_OK, so it
       makes no host sync (and can be captured); errors_fetch queues one copy of the step's
       checks to the host, and errors_verdict, after the step's own read of its flags (a host
       sync), returns the first failed check's usual error (or makes the sync itself when none
       followed the fetch). cuda's MXFP4 moe_experts defers too (its route kernel places only
       valid rows); its CUDA-core form (F32 / BF16 experts) stays immediate. */
    k3_status (*errors_defer)(k3_backend *be, bool on);
    k3_status (*errors_fetch)(k3_backend *be);
    k3_status (*errors_verdict)(k3_backend *be);
    /* Optional: the layer the next ops belong to (-1: none), so a deferred check's error names
       it (errors_defer resets it to -1). Host state only: no device work. */
    void (*errors_layer)(k3_backend *be, int layer);
    k3_status (*device_info)(k3_backend *be, k3_device_info *out); /* NULL: none */
    /* Optional (NULL: the MoE exchange is routed on the host): the device halves of the
       expert-parallel dispatch (cuda; docs/DESIGN.md §3a "dispatch layout"), no host sync.
       moe_ep_pack: the T·K items of ids (device) into ep's send buffer (L lane blocks: counts,
       then per local expert a slab of cap rows of x rows, item order) and pos [T·K] (each item's
       row in the send / return buffer, -1 if not placed); an expert over cap rows, an id out of
       range: a deferred check (errors_defer) naming it. moe_ep_experts: the receive buffer's
       rows through this lane's experts (glob: device [EL], their global ids, -1 pads; the
       masked grouped GEMM), the outputs into ret at the rows they came from; h [EL·L·cap, I],
       iwork int32 [2·EL + EL·L·cap]. moe_combine: out row t = Σ_k w[t·K + k] · y row
       pos[t·K + k] in k order (rows_wsum's arithmetic; pos < 0 adds nothing). */
    k3_status (*moe_ep_pack)(k3_backend *be, const k3_moe_ep *ep, const int32_t *ids, int64_t T,
                             const float *x, float *send, int32_t *pos);
    k3_status (*moe_ep_experts)(k3_backend *be, const k3_moe_ep *ep, const float *recv,
                                const int32_t *glob, const k3_tensor *w1, const k3_tensor *w3,
                                const k3_tensor *w2, size_t e_stride, float beta, float lin_beta,
                                float *h, int32_t *iwork, float *ret);
    k3_status (*moe_combine)(k3_backend *be, const float *y, const int32_t *pos, const float *w,
                             int64_t T, int K, int64_t width, float *out);
} k3_backend_iface;

struct k3_backend {
    const char *name;             /* "ref", "cpu", "guard", "cuda" */
    k3_mem_space mem;             /* where its buffers live */
    const k3_ops *ops;            /* the op table (every op takes this backend first) */
    const k3_backend_iface *mem_; /* memory functions (call through the k3_backend_* helpers) */
    void *ctx;                    /* backend-private state (cpu: the thread pool) */
};

typedef struct k3_backend_params {
    int n_threads;        /* cpu/guard pool size; <= 0 = online CPUs (at most 64) */
    size_t guard_reserve; /* guard: bytes of address space to reserve; 0 = 16 GiB */
} k3_backend_params;

/* Names this build knows: "ref", "cpu", "guard" (+ "cuda" with K3_CUDA). */
k3_status k3_backend_create(const char *name, const k3_backend_params *p, k3_backend **out);
/* "auto" -> "cuda" when this build has it, a device is visible, the cuda backend implements
 * every op of the op list and its kernels have passed a device run (scripts/device-check.sh);
 * else "cpu", with the reason in why (""). Other names pass through. */
const char *k3_backend_resolve(const char *name, char *why, size_t n);
/* The SIMD kernels a cpu (or guard) backend runs ("avx512", "avx2", "scalar": cpuid's pick or
   K3_ISA's); "-" for other backends. For reports (k3 bench kernels, k3 version). */
const char *k3_cpu_isa_name(const k3_backend *be);
/* How the cpu backend's decode matmuls walk F32/BF16 rows: "seq" (two streams in memory order,
   for the hardware prefetcher alone: AMD's pick) or "rows" (GV_R rows side by side with a
   software prefetch a group ahead: the others'); K3_GEMV=seq|rows forces one. For reports. */
const char *k3_cpu_gemv_name(const k3_backend *be); /* "-" for other backends */
/* The backends compiled into this build ("ref cpu guard cuda") and those usable on this machine,
 * with the reason for each one that is not ("ref cpu guard; cuda: no CUDA device visible"). */
void k3_backend_inventory(char *compiled, size_t nc, char *usable, size_t nu);
void k3_backend_destroy(k3_backend *be);
/* A process-wide host backend ("cpu", one thread) for host-side helpers and tests that need an
 * op on host memory. Never destroyed; thread-safe. */
k3_backend *k3_backend_host(void);
/* true when host code may touch this backend's buffers directly (ref, cpu). */
static inline bool k3_backend_host_visible(const k3_backend *be) {
    return be->mem == K3_MEM_HOST;
}
/* Helpers with errors that name what the buffer is for. */
k3_status k3_backend_alloc(k3_backend *be, size_t n_bytes, const char *what, void **out);
void k3_backend_free(k3_backend *be, void *p); /* NULL is a no-op */
k3_status k3_backend_upload(k3_backend *be, void *dst, const void *src_host, size_t n_bytes);
k3_status k3_backend_download(k3_backend *be, void *dst_host, const void *src, size_t n_bytes);
k3_status k3_backend_sync(k3_backend *be);
bool k3_backend_supports_op(const k3_backend *be, int op, k3_dtype wt);
/* Stream-ordered copies and events (the blocking copy / a no-op where the backend has none). */
k3_status k3_backend_upload_async(k3_backend *be, void *dst, const void *src_host, size_t n_bytes);
k3_status k3_backend_download_async(k3_backend *be, void *dst_host, const void *src,
                                    size_t n_bytes);
k3_status k3_backend_event_create(k3_backend *be,
                                  k3_backend_event **out); /* *out NULL: no events */
k3_status k3_backend_event_record(k3_backend *be, k3_backend_event *ev);
k3_status k3_backend_event_sync(k3_backend *be, k3_backend_event *ev);
void k3_backend_event_destroy(k3_backend *be, k3_backend_event *ev); /* NULL is a no-op */
/* The backend's native stream (a cudaStream_t for cuda), NULL when it has none. */
void *k3_backend_native_stream(k3_backend *be);
/* Whether the backend captures graphs, and the capture / replay of its iface (K3_ERR_STATE
   without graphs); graph_destroy is NULL-safe. */
bool k3_backend_has_graphs(const k3_backend *be);
k3_status k3_backend_capture_begin(k3_backend *be);
k3_status k3_backend_capture_end(k3_backend *be, k3_backend_graph **out);
k3_status k3_backend_graph_launch(k3_backend *be, k3_backend_graph *g);
void k3_backend_graph_destroy(k3_backend *be, k3_backend_graph *g);
/* Deferred checks of the iface (no-ops, K3_OK, on a backend without them). */
k3_status k3_backend_errors_defer(k3_backend *be, bool on);
k3_status k3_backend_errors_fetch(k3_backend *be);
k3_status k3_backend_errors_verdict(k3_backend *be);
void k3_backend_errors_layer(k3_backend *be, int layer);
/* Whether the backend has the device halves of the expert-parallel dispatch (moe_ep_*). */
bool k3_backend_has_moe_ep(const k3_backend *be);
k3_status k3_backend_device_info(k3_backend *be, k3_device_info *out);
/* The backend's counters: K3_ERR_ARG when it does not count (ref, cpu). */
k3_status k3_backend_op_stats(const k3_backend *be, k3_op_stats *out);
k3_status k3_backend_memory(const k3_backend *be, size_t *free_bytes, size_t *total_bytes);
/* The host's memory from /proc/meminfo: free = MemAvailable, total = MemTotal (what the ref/cpu
 * backends report, and what callers check before any backend exists). */
k3_status k3_host_memory(size_t *free_bytes, size_t *total_bytes);
/* This process's memory: resident (VmRSS), its peak (VmHWM) and proportional (Pss of
 * /proc/self/smaps_rollup: a page shared by n processes counts 1/n, so the Pss of a node's ranks
 * add up to the node's memory). 0 where the kernel does not say. */
void k3_proc_memory(uint64_t *rss_bytes, uint64_t *hwm_bytes, uint64_t *pss_bytes);
/* The cpu/guard pool size (1 for ref). */
int k3_backend_threads(const k3_backend *be);

/* Scratch of kda_chunked per head (floats). */
size_t k3_kda_chunk_work_floats(int C, int dk, int dv);
/* The latent-attention ops' widest cache row (floats; K3: 576). */
#define K3_ATTN_MAX_W 2048
/* Scratch of attn_latent_causal (floats) for queries up to context n_ctx = pos0 + n_q over H
 * heads: H·n_ctx (what attn_latent takes for its longest query). */
size_t k3_attn_latent_causal_work_floats(int64_t n_ctx, int H);
/* Scratch of moe_experts (floats) for n slot rows over E experts of rows Lw wide and inner width
 * I (row tiles, the grouping of rows by expert). */
size_t k3_moe_experts_work_floats(int64_t Lw, int64_t I, int64_t n, int E);
#define K3_MOE_EXPERTS_TILE  256  /* rows of one tile of moe_experts (its scratch) */
#define K3_MOE_EXPERTS_ITEMS 4096 /* slot rows of one token tile of the weighted form */

/* ---- tensor helpers (no memory access: safe on any backend's tensors) --------------------- */
/* A view of rows [r0, r0+n) of a 2-D weight [out, in] (F32/BF16/MXFP4): no copy. */
k3_status k3_tensor_rows(const k3_tensor *W, int64_t r0, int64_t n, k3_tensor *out);

/* ---- host-only helpers (tensor bytes in host memory: tests, loaders, staging) ------------- */
/* Element (o, i) of a 2-D weight, decoded to float (any supported dtype; slow). */
float k3_tensor_get(const k3_tensor *W, int64_t o, int64_t i);
/* Decode a host tensor of F32/BF16/F16 to floats: dst [n_elems]. */
k3_status k3_tensor_to_f32(const k3_tensor *t, float *dst, int64_t n_elems);

#endif /* K3_KERNELS_H */
