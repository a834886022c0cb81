/* cuda_launch.h — the launchers of the cuda kernels, callable from C (backend_cuda.c). Private to
 * kernels/cuda/. Each launcher enqueues its kernel(s) on stream s and returns the cudaError_t of
 * the launch (cudaGetLastError) as an int, 0 = success; none of them synchronises. Pointers are
 * device memory unless named *_host. Argument checks (shapes, dtypes, limits) are the caller's:
 * backend_cuda.c makes the same checks as kernels/ref before it launches anything.
 * Weight dtypes are K3C_DT_* (cuda_math.cuh), equal to the k3_dtype values. */
#ifndef K3_CUDA_LAUNCH_H
#define K3_CUDA_LAUNCH_H

#include <cuda_runtime_api.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* pointwise ops of k3c_pointwise */
enum { K3C_PW_SILU, K3C_PW_SIGMOID, K3C_PW_SITU, K3C_PW_SWIGLU, K3C_PW_ADD, K3C_PW_MUL };

/* elementwise.cu */
int k3c_fill(cudaStream_t s, float *y, int64_t n, float v);
/* y = op(a, b) elementwise over n; p0, p1: SiTU's beta and lin_beta. */
int k3c_pointwise(cudaStream_t s, int op, const float *a, const float *b, int64_t n, float p0,
                  float p1, float *y);
/* dst [n] = src [n] of dtype dt (F32/BF16/F16) decoded. */
int k3c_decode_f32(cudaStream_t s, int dt, const void *src, int64_t n, float *dst);
/* out[t] = row ids[t] of W [V, D]; *err (preset to ~0 by the caller) = min bad position t. */
int k3c_embed_rows(cudaStream_t s, int dt, const void *W, int64_t V, int64_t D, const int32_t *ids,
                   int64_t T, float *out, unsigned long long *err);

/* norms.cu */
/* rmsnorm (l2 = 0) or l2norm (l2 = 1) of T rows of n, row t at x + t·xs -> y + t·ys (strides in
 * floats); w NULL = ones (rmsnorm only). */
int k3c_rownorm(cudaStream_t s, int l2, const float *x, int64_t xs, const float *w, int64_t T,
                int64_t n, float eps, float *y, int64_t ys);
int k3c_softmax(cudaStream_t s, const float *x, int64_t T, int64_t n, float *y);
int k3c_attnres_mix(cudaStream_t s, const float *bank, int n_bank, const float *p, const float *w,
                    int64_t T, int64_t D, float eps, float *out);

/* matmul.cu: W [out, in] of dtype dt (data; scale E8M0 [out, in/32] for MXFP4). */
int k3c_matmul(cudaStream_t s, int dt, const void *data, const uint8_t *scale, int64_t out,
               int64_t in, const float *x, int64_t T, float *y);
int k3c_matmul_tn(cudaStream_t s, int dt, const void *data, const uint8_t *scale, int64_t out,
                  int64_t in, const float *x, int64_t T, float *y);
/* matmul_heads: H heads in one launch; head h's weight = nr rows from row h·rh of data/scale (the
 * caller offsets them to row r0), x_h[t] = x + t·xt + h·xh, y_h[t] = y + t·yt + h·yh (floats).
 * trans 0: y_h[t] [nr] = W_h·x_h[t] (matmul's kernel); trans 1: y_h[t] [in] = W_hᵀ·x_h[t]. */
int k3c_matmul_heads(cudaStream_t s, int dt, const void *data, const uint8_t *scale, int64_t nr,
                     int64_t in, int64_t rh, int H, const float *x, int64_t xt, int64_t xh,
                     int64_t T, float *y, int64_t yt, int64_t yh, bool trans);

/* matmul_mma.cu: the bf16 weight's GEMM on tensor cores (mma.m16n8k16, cp.async + ldmatrix),
 * H heads as matmul_heads (grid.z); x split into `splits` bf16 planes: 1 = W16A16 (x rounded to
 * bf16), 3 = every fp32 bit of x (K3C_MM_TC_SPLITS, what the ops use). k3c_mm_tc_ok: the weight
 * fits it (16-byte aligned, in % 8 == 0). */
#define K3C_MM_TC_SPLITS 3
bool k3c_mm_tc_ok(const void *w, int64_t in);
int k3c_mm_bf16_tc(cudaStream_t s, int splits, const uint16_t *w, int64_t out, int64_t in,
                   int64_t rh, int H, const float *x, int64_t xt, int64_t xh, int64_t T, float *y,
                   int64_t yt, int64_t yh);

/* kda.cu */
int k3c_kda_gate(cudaStream_t s, float *r, const float *dt_bias, const float *a_log, int64_t T,
                 int H, int dk, bool has_lb, float lb);
int k3c_short_conv(cudaStream_t s, const float *in, int64_t n, int64_t P, int K, const float *w,
                   float *state, float *out);
/* C = 0: the recurrence; else the chunked form with chunk C and work (per head
 * k3_kda_chunk_work_floats(C, dk, dv) floats, wf of them). mode: K3C_KDA_MMA runs chunk 16 on
 * tensor cores where the shape fits (bf16 operands; the backend's K3_CUDA_MMA); K3C_KDA_BF16 keeps
 * each head's state as dk·dv bf16 at the start of its fp32 region (K3_CUDA_KDA_STATE=bf16: the
 * shapes of k3c_kda_bf16_fits, S 8-byte aligned, S_stride even; else cudaErrorInvalidValue). */
#define K3C_KDA_MMA  1
#define K3C_KDA_BF16 2
int k3c_kda(cudaStream_t s, const float *q, const float *k, const float *v, const float *g,
            const float *beta, int64_t n, int H, int dk, int dv, float scale, float *S, float *o,
            int C, float *work, size_t wf, int mode);
/* seqs kernels: the batch descriptor's device arrays (k3_seqs: tok0 [n_seqs + 1], pos, slot
 * [n_seqs], blocks [n_seqs, max_blocks]) and its host scalars, which size the grids. */
typedef struct k3c_seqs {
    int n_seqs, max_blocks;
    int64_t T, max_ctx, max_new;
    const int32_t *tok0, *pos, *slot, *blocks;
} k3c_seqs;
/* short_conv of every sequence, state at state + slot[i]·state_stride. */
int k3c_short_conv_seqs(cudaStream_t s, const k3c_seqs *sq, const float *in, int64_t P, int K,
                        const float *w, float *state, int64_t state_stride, float *out);
/* the KDA delta rule of every sequence (C >= 2: chunked for sequences of >= C tokens, work per
 * head wf floats for H heads), state at S + slot[i]·S_stride. */
int k3c_kda_seqs(cudaStream_t s, const k3c_seqs *sq, const float *q, const float *k, const float *v,
                 const float *g, const float *beta, int H, int dk, int dv, float scale, float *S,
                 int64_t S_stride, float *o, int C, float *work, size_t wf, int mode);
/* the bf16 state's shapes: the streamed recurrence, and chunk 16 on tensor cores */
bool k3c_kda_bf16_fits(int dk, int dv, int C);

/* attn.cu */
int k3c_attn_latent(cudaStream_t s, const float *qc, const float *cache, int64_t n_ctx, int H,
                    int W, int Rkv, float scale, float *o_lat, float *work);
/* attn_paged: every token over its own sequence's paged cache (one launch, no scratch). */
int k3c_attn_paged(cudaStream_t s, const k3c_seqs *sq, const float *qc, const float *cache, int H,
                   int W, int Rkv, float scale, float *o_lat);
/* mla_mma.cu: attn_paged (sq) or attn_latent (sq NULL: one query over n_ctx contiguous rows) on
 * tensor cores, W <= K3C_MLA_MAX_W; part: the split partials, k3c_attn_mla_part_floats(max_ctx,
 * H, Rkv) floats per token, tb tokens of them (tokens are launched tb at a time); terms: the
 * products of each mma step, 1 (bf16 operands), 3 (split hi + lo: hi·hi + hi·lo + lo·hi, the
 * default) or 4 (+ lo·lo). */
#define K3C_MLA_MAX_W 640
int k3c_attn_mla(cudaStream_t s, const k3c_seqs *sq, int64_t n_ctx, const float *qc,
                 const float *cache, int H, int W, int Rkv, float scale, float *o_lat, float *part,
                 int64_t tb, int terms);
int64_t k3c_attn_mla_part_floats(int64_t max_ctx, int H, int Rkv);
/* kv_write: token rows of src [T, W] to their positions' rows of the paged cache. */
int k3c_kv_write(cudaStream_t s, const k3c_seqs *sq, const float *src, int W, float *cache);

/* moe.cu */
/* *err (preset to ~0) = min over bad tokens of t·(E+2) + (e, or E+1 = ran out of experts). */
int k3c_moe_topk(cudaStream_t s, const float *scores, const float *bias, int64_t T, int E, int K,
                 int G, int topk_group, bool renorm, float scale, float *work, int32_t *ids,
                 float *w, unsigned long long *err);
/* gather (scatter = 0): dst[j] = src[idx[j]]; scatter: dst[idx[j]] = src[j]; idx device int64. */
int k3c_rows_copy(cudaStream_t s, const float *src, int64_t width, const int64_t *idx, int64_t n,
                  float *dst, int scatter);
/* rows_wsum with seg device int64 [n_seg + 1] or NULL (uniform seg_len). */
int k3c_rows_wsum(cudaStream_t s, const float *x, const float *w, const int64_t *seg,
                  int64_t seg_len, int64_t n_seg, int64_t width, float *y);
/* nonfinite_rows: per sequence with flags[i] == 0 and a NaN/Inf in its rows: zero them, flag. */
int k3c_nonfinite_rows(cudaStream_t s, const k3c_seqs *sq, float *y, int64_t D, bool per_seq,
                       int32_t code, int32_t *flags);
/* rows_last: dst[(j·n_seqs + i)·D ..] = src[j·slab + (tok0[i+1] − 1)·D ..], j < n_slab. */
int k3c_rows_last(cudaStream_t s, const k3c_seqs *sq, const float *src, int64_t slab, int n_slab,
                  int64_t D, float *dst);

/* moe_experts: one expert's three matrices on the device (w1, w3 [I, Lw]; w2 [Lw, I]); data[0]
 * NULL: the expert is not on this rank (one of its three has no data); bad = 1: present, but its
 * shapes or dtypes are not the table's. The backend keeps
 * one table of E of them per expert table of the caller (backend_cuda.c). */
typedef struct k3c_expert {
    const void *data[3]; /* w1, w3, w2 */
    const uint8_t *scale[3];
    int32_t dt[3];
    int32_t bad; /* present but unusable (dtype / shape): named by the host on use */
} k3c_expert;
/* *err (preset to ~0) = the first row i whose id is outside [0, E) or names an expert without
 * data, else n + the first row whose expert is bad. */
int k3c_moe_check(cudaStream_t s, const int32_t *ids, int64_t n, int E, const k3c_expert *tab,
                  unsigned long long *err);
/* Rows [r0, r0 + m) of the n slot rows: h [m, I] = act(W1_e·r_i, W3_e·r_i), e = ids[i], r_i =
 * src row i / row_div, or row_of[i] when row_of is not NULL (src rows Lw wide; x_vec: src rows
 * 16-byte aligned). */
int k3c_moe_up(cudaStream_t s, const float *src, int64_t row_div, const int32_t *row_of,
               const int32_t *ids, const k3c_expert *tab, int64_t r0, int64_t m, int64_t Lw,
               int64_t I, bool x_vec, float beta, float lin_beta, float *h);
/* Then out: w NULL: out row i = W2_e·h[i − r0] for i in [r0, r0 + m); w: out row t =
 * Σ_k w[t·K + k]·W2·h[..] in k order for tokens t in [r0 / K, (r0 + m) / K), K = row_div (m and r0
 * multiples of K). h_vec: h rows 16-byte aligned. */
int k3c_moe_down(cudaStream_t s, const float *h, const int32_t *ids, const float *w,
                 int64_t row_div, const k3c_expert *tab, int64_t r0, int64_t m, int64_t Lw,
                 int64_t I, bool h_vec, float *out);

/* moe_mma.cu: the grouped W4A16 expert GEMM on the tensor cores (issue 44). Rows of expert e:
 * contiguous layout (cap == 0): x rows [off[e], off[e+1]) (off device int64 [E + 1]); masked
 * layout (cap > 0, fixed capacity per expert): x rows [e·cap, e·cap + min(count[e], cap)) (count
 * device int32 [E]; rows past the count are neither read nor written). max_rows (>= every
 * expert's rows) sizes the grid; max_rows <= 8 runs swap-AB (the weights as the M = 16 operand). */
typedef struct k3c_w4_rows {
    const int64_t *off;
    const int32_t *count;
    int64_t cap, max_rows;
    /* optional (NULL: the identity): wslot device int32 [E], expert e's weights are slot wslot[e]
     * of words / scales (< 0: the expert is not here, its rows are neither read nor written);
     * src_row / dst_row device int32 [rows]: GEMM row r reads x row src_row[r] and writes y row
     * dst_row[r] (the gather of routed rows and the scatter to slot order, in the kernel) */
    const int32_t *wslot, *src_row, *dst_row;
} k3c_w4_rows;
/* y row r [N] = W_e · x row r [K], x split into `terms` (1 .. 3) bf16 terms (k3c_split_bf16: |x −
 * Σ x_i| <= 2^(-8·terms)·|x|; 1 is the plain bf16(x)), exact products, fp32 accumulation; with w3
 * (gate/up fused): y row r = act(W_e·x, W3_e·x) (k3c_moe_act: beta < 0 SwiGLU, else SiTU(beta,
 * lin_beta)). W_e in fragment order (k3c_repack.h: words / scales of expert e at e ·
 * k3c_mxfp4_frag_words(N, K) / e · k3c_mxfp4_frag_scales(N, K)); N % 8 == 0, K % 32 == 0. */
#define K3C_W4_MAX_TERMS 3 /* = K3C_SPLIT_MAX (k3c_mma.cuh; moe_mma.cu asserts it) */
int k3c_w4a16_grouped(cudaStream_t s, const uint32_t *words, const uint8_t *scales,
                      const uint32_t *words3, const uint8_t *scales3, int E, int64_t N, int64_t K,
                      k3c_w4_rows rows, float beta, float lin_beta, int terms, const float *x,
                      float *y);
/* The device route of items [r0, r0 + n) of ids (n_all in the call) for k3c_w4a16_grouped's
 * contiguous layout, with no host read: off device int64 [E + 1] (expert e's GEMM rows [off[e],
 * off[e+1]), at most cap each), src_row / dst_row device int32 [n] (GEMM row -> x row: row_of[i],
 * else i / row_div; -> y row dst0 + i − r0), the rows of one expert in item order.
 * err (reset to ~0 by the caller) takes the smaller of its value and this tile's first failure:
 * (item << 32 | id) for an id outside [0, E) or an expert without a weight slot (wslot < 0),
 * else ((n_all + e) << 32 | rows) for the first expert e given more than cap rows; the items
 * that fail are not placed (never an out-of-bounds row). */
int k3c_moe_route(cudaStream_t s, const int32_t *ids, int64_t r0, int64_t n, int64_t n_all,
                  int64_t row_div, const int32_t *row_of, int E, const int32_t *wslot, int64_t cap,
                  int64_t *off, int32_t *src_row, int32_t *dst_row, int64_t dst0,
                  unsigned long long *err);
/* moe_ep.cu: the expert-parallel dispatch's device halves (the lane block layout: moe_ep.cu).
 * k3c_ep_pack: the n = T·K items of ids (item i reads x row i / K) into the send buffer's slabs,
 * dest[e] = lane·EL + the expert's index among its lane's (< 0: owned by no lane); pos [n] = each
 * item's row in the send (and return) buffer, -1 if not placed; err as k3c_moe_route's ((item <<
 * 32 | id) for a bad id, ((n + e) << 32 | rows) for an expert over cap rows). k3c_ep_map: the
 * receive buffer onto the masked layout of k3c_w4a16_grouped (capacity C = L·cap, EL experts):
 * cnt [EL], wslot [EL] (slot[glob[q]]), src_row [EL·C]. */
int k3c_ep_pack(cudaStream_t s, const int32_t *ids, int64_t n, int K, const float *x, int64_t Lw,
                const int32_t *dest, int E, int L, int EL, int64_t cap, int64_t hdr,
                int64_t blk_rows, float *send, int32_t *pos, unsigned long long *err);
int k3c_ep_map(cudaStream_t s, const float *recv, int L, int EL, int64_t cap, int64_t hdr,
               int64_t blk_rows, int64_t Lw, const int32_t *glob, const int32_t *slot, int32_t *cnt,
               int32_t *wslot, int32_t *src_row);
/* out row t [width] = Σ_k w[t·K + k] · y row pos[t·K + k] in k order, the first valid term
 * initialising (k3c_wsum_step); pos < 0 contributes nothing (a token with none: zeros). */
int k3c_moe_combine(cudaStream_t s, const float *y, const int32_t *pos, const float *w, int64_t T,
                    int K, int64_t width, float *out);

#ifdef __cplusplus
}
#endif

#endif /* K3_CUDA_LAUNCH_H */
