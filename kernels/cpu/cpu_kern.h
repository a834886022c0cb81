/* cpu_kern.h — private to kernels/cpu/: the per-ISA kernel table of the cpu backend.
 *
 * Owns: the k3_cpu_kern struct (the hot loops: matmul row ranges, matmul_tn column ranges, the
 * elementwise activations, one softmax row, tiles of latent attention, the norms' row blocks) and
 * the three tables built from one template (kern_tmpl.h) in three translation units compiled with
 * their own flags: kern_avx512.c (AVX-512 F/BW/VL/DQ), kern_avx2.c (AVX2 + FMA + F16C),
 * kern_scalar.c (no SIMD flags). isa.c picks one at backend creation from cpuid, or
 * K3_ISA=avx512|avx2|scalar. Invariants: a table's results are bit-reproducible on their own (every
 * output is one fixed-order reduction, independent of T, of the row/column range and of the
 * thread); two tables may differ from each other by summation order and by their exp/tanh
 * polynomials (within the reference tolerances of tests/tolerances.h), never from ref's semantics.
 * Callers must not call a table whose ISA the CPU lacks (only isa.c hands them out). */
#ifndef K3_CPU_KERN_H
#define K3_CPU_KERN_H

#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <stdatomic.h>

/* Work below this many multiply-adds runs on the calling thread only (every cpu op file). */
#define K3_CPU_PAR_MIN_MACS (1 << 15)

typedef struct k3_cpu_kern k3_cpu_kern;
struct k3_cpu_kern {
    const char *name; /* "avx512", "avx2", "scalar" */
    /* y[t, o] for t < T, o in [o0, o1): W [out, in] F32/BF16/MXFP4 (checked by the caller);
       x [T, in]; y [T, out]. */
    void (*mm_rows)(const k3_tensor *W, const float *x, int64_t T, int64_t o0, int64_t o1, float *y,
                    bool gemv_seq /* the backend's decode row order (k3_cpu_ctx) */);
    /* Prefill (T >= 4) with x packed once per call for all tasks: xpk_floats(T, in) floats,
       xpk_pack fills tokens [t0, t1) of them (t0 a multiple of gt, the tile's tokens; W gives
       the layout: MXFP4 may pack x in another order), mm_rows_xpk = mm_rows reading them. */
    int gt;
    int mx_gemv_t; /* MXFP4 products of fewer tokens take the decode path (k3_cpu_gemv_path) */
    int gemv_t;    /* F32/BF16 products of fewer tokens take it (>= 4) */
    int64_t (*xpk_floats)(int64_t T, int64_t in);
    void (*xpk_pack)(const k3_tensor *W, const float *x, int64_t T, int64_t t0, int64_t t1,
                     float *xpk);
    void (*mm_rows_xpk)(const k3_tensor *W, const float *x, const float *xpk, int64_t T, int64_t o0,
                        int64_t o1, float *y);
    /* y[t, c] = Σ_o x[t, o] W[o, c] (o ascending, one fma per term) for c in [c0, c1). */
    void (*mmtn_cols)(const k3_tensor *W, const float *x, int64_t T, int64_t c0, int64_t c1,
                      float *y);
    void (*silu)(const float *x, int64_t n, float *y);
    void (*sigmoid)(const float *x, int64_t n, float *y);
    void (*situ)(const float *g, const float *u, int64_t n, float beta, float lin_beta, float *y);
    void (*swiglu)(const float *g, const float *u, int64_t n, float *y);
    /* one row: y = softmax(x), max-subtracted; y may alias x */
    void (*softmax_row)(const float *x, int64_t n, float *y);
    /* attn_latent_causal on the (query j, head h) rows j in [j0, j1), h in [h0, h1): qc
       [n_q, H, W], cache, o_lat [n_q, H, Rkv]; query j attends to cache rows [0, pos0 + j].
       blk NULL: the cache rows are contiguous; else the sequence's block table (row k is row
       k % K3_KV_BLOCK of block blk[k / K3_KV_BLOCK] of a paged cache). A row's bits depend only
       on its query, its context and the cache rows (kern_attn.h), not on where they lie. */
    void (*attn_rows)(const float *qc, const float *cache, const int32_t *blk, int64_t pos0,
                      int64_t j0, int64_t j1, int h0, int h1, int H, int W, int Rkv, float scale,
                      float *o_lat);
    /* A decode step split by superblocks of attn_sb keys at absolute boundaries (kern_attn.h),
       attn_rows' bits: attn_part computes heads [h0, h1) (at most 16 of them, so that any W up
       to K3_ATTN_MAX_W fits its tile) of the query qc [H, W] over the superblock from key k0s of
       a context of n_ctx keys: an unnormalised output o [h1 − h0, Rkv], its max m and sum l
       [h1 − h0]. attn_merge folds such a partial of R rows into their running (M, L, o), the
       superblocks in ascending order, the first superblock's partial being the running state;
       attn_final divides o [R, Rkv] by L. */
    int attn_sb;
    void (*attn_part)(const float *qc, const float *cache, const int32_t *blk, int64_t n_ctx,
                      int h0, int h1, int W, int Rkv, float scale, int64_t k0s, float *o, float *m,
                      float *l);
    void (*attn_merge)(int R, float *M, float *L, float *o, const float *m, const float *l,
                       const float *op, int Rkv);
    void (*attn_final)(int R, float *o, const float *L, int Rkv);
    /* the KDA recurrence of one head (K3-MODEL.md §2.2, ref's k3_ref_kda_head_recurrent) over n
       tokens for value columns [j0, j1): q, k, g [n] rows sqk apart, v, o rows svo apart, beta
       sb apart; S [dk, dv] (in/out). A column's bits depend neither on [j0, j1) nor on how a
       sequence's tokens are split into calls. */
    void (*kda_head)(const float *q, const float *k, const float *v, const float *g,
                     const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb, int dk,
                     int dv, int j0, int j1, float scale, float *S, float *o);
    /* ref's short_conv outputs of channels [c0, c1) (K <= 16), rows_wsum segment j, attnres_mix
       tokens [t0, t1) (n_bank < 64): ref's bits, several elements at a time (kern_tmpl.h). */
    void (*conv_cols)(const float *in, int64_t n, int64_t P, int K, const float *w,
                      const float *state, float *out, int64_t c0, int64_t c1);
    void (*wsum_seg)(const float *x, const float *w, const int64_t *seg, int64_t seg_len, int64_t j,
                     int64_t width, float *y);
    void (*attnres_rows)(const float *bank, int n_bank, const float *p, const float *w, int64_t T,
                         int64_t D, float eps, float *out, int64_t t0, int64_t t1);
    /* rmsnorm (l2 false; w NULL: ones) or l2norm (l2 true) of rows [t0, t1), row t at x + t·xs
       and y + t·ys (y may alias x with the same strides): ref's row code's bits, VL rows at a
       time with the tokens in the lanes (kern_tmpl.h). */
    void (*norm_rows)(const float *x, int64_t xs, const float *w, int64_t n, float eps, bool l2,
                      float *y, int64_t ys, int64_t t0, int64_t t1);
};

/* The table of a cpu backend (its ISA's). */
static inline const k3_cpu_kern *k3_cpu_kern_of(k3_backend *be) {
    return ((k3_cpu_ctx *)be->ctx)->kern;
}

/* Ops of the cpu backend defined outside cpu.c (their contracts: k3_kernels.h). */
k3_status k3_cpu_kda_recurrent(k3_backend *be, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                               float scale, float *S, float *o);
k3_status k3_cpu_kda_chunked(k3_backend *be, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                             float scale, float *S, float *o, int C, float *work);
k3_status k3_cpu_kda_gate(k3_backend *be, float *r, const float *dt_bias, const float *a_log,
                          int64_t T, int H, int dk, bool has_lower_bound, float lower_bound);
k3_status k3_cpu_attn_latent(k3_backend *be, const float *qc, const float *cache, int64_t n_ctx,
                             int H, int W, int Rkv, float scale, float *o_lat, float *work);
k3_status k3_cpu_attn_latent_causal(k3_backend *be, const float *qc, const float *cache,
                                    int64_t pos0, int64_t n_q, int H, int W, int Rkv, float scale,
                                    float *o_lat, float *work);

/* The decode path (kern_gemv.h: rows streamed once, a row group's sums of every token in
 * registers) takes a product of T < 4 tokens, and on AVX-512 more: MXFP4 up to k->mx_gemv_t - 1
 * tokens (15), F32/BF16 up to k->gemv_t - 1 (23), 3 tokens at a time per pass over a row group
 * (in L1): its weights are decoded / widened once per 3 tokens in registers, which beats the
 * prefill path's panels (the decoded floats stored and loaded again, waiting on DRAM with too few
 * tokens to hide it) for a decode batch's few tokens. 1 thread, 4096-wide rows: MXFP4 T = 8-15
 * 79-84 GFLOP/s against the panels' 53-69; BF16 T = 4, 8, 15, 24: 36, 60, 74, 80 against 21,
 * 36, 48, 52 (at 32 the panels lead). AVX2 (16 registers): F32/BF16 up to 11 tokens, 2 rows
 * at a time (forced on this Zen 4, BF16 T = 4, 6, 11: 25, 35, 34 -> 31, 42, 43), MXFP4 T < 4. The
 * other products take the prefill path (kern_tmpl.h's packed panels and register tiles). Same bits
 * either way. */
static inline bool k3_cpu_gemv_path(const k3_cpu_kern *k, const k3_tensor *W, int64_t T) {
    return T < (W->dtype == K3_DT_MXFP4 ? k->mx_gemv_t : k->gemv_t);
}
extern const k3_cpu_kern k3_cpu_kern_scalar;
extern const k3_cpu_kern k3_cpu_kern_avx2;
extern const k3_cpu_kern k3_cpu_kern_avx512;

#endif /* K3_CPU_KERN_H */
