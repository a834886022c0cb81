// cuda_math.cuh — the per-element and per-row math of the cuda kernels, as __host__ __device__
// inline functions, so that the host-only test tests/gpu/test_cuda_math.cu runs the very same
// arithmetic on the CPU (through the lane loops the kernels use, with the same reduction trees)
// and compares it with kernels/ref on random inputs. The kernels (*.cu in this folder) call
// these functions and add only indexing, loads and the cross-lane shuffles, whose order the
// host emulations below (k3c_xor_tree, k3c_block_tree) reproduce exactly.
//
// Verified on host math only; device run pending (no GPU was available when this was written).
//
// Invariants: every reduction has one fixed order that depends on the row length and the lane
// count only, never on T or on timing (no atomics in sums): the determinism rule of
// kernels/k3_kernels.h. All products-and-adds are explicit fmaf(), so the host emulation and
// the device agree on contraction (nvcc would otherwise fuse a*b+c on the device only).
#ifndef K3_CUDA_MATH_CUH
#define K3_CUDA_MATH_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "k3_mxfp4.h"

#define K3C_FN static __host__ __device__ __forceinline__

/* Shared memory and launches, written once for both builds: nvcc gets the CUDA keywords here;
 * the emulation build (kernels/cuda/emu, K3_CUDA_EMULATION from its cuda_runtime_api.h) defines
 * the same three macros to run the kernels on host fibers.
 *   K3C_SHARED(float, part, [8][32]);         a static __shared__ array of the block
 *   K3C_DYN_SHARED(float, sh);                the block's dynamic (extern __shared__) array
 *   K3C_LAUNCH(grid, block, shmem, stream, kernel)(args...);   kernel<<<...>>>(args...) */
#ifndef K3_CUDA_EMULATION
#define K3C_SHARED(T, name, dims)                   __shared__ T name dims
#define K3C_DYN_SHARED(T, name)                     extern __shared__ T name[]
#define K3C_LAUNCH(grid, block, shmem, stream, ...) __VA_ARGS__<<<grid, block, shmem, stream>>>
#endif

#define K3C_WARP        32  /* lanes of a warp */
#define K3C_ROW_THREADS 256 /* threads of a per-row block (norms, softmax, AttnRes, latent) */
#define K3C_MM_ROWS     32  /* matmul: output rows per block (one per lane of a warp) */
#define K3C_MM_SLICES   8   /* matmul: K-slices per row (one per warp of the block) */
#define K3C_MM_TOK      8   /* matmul: tokens per pass (accumulators per thread) */
#define K3C_TN_SLICES   16  /* matmul_tn: slices of the summed dimension (one per warp) */

/* weight dtypes as the launchers see them (mirrors k3_dtype; checked in backend_cuda.c) */
enum { K3C_DT_F32 = 0, K3C_DT_BF16 = 1, K3C_DT_F16 = 2, K3C_DT_MXFP4 = 6 };

/* ---- scalars ------------------------------------------------------------------------------ */
K3C_FN float k3c_bf16(uint16_t h) {
    return k3_mxfp4_bits_to_f32((uint32_t)h << 16);
}
/* IEEE half -> float (the same cases as base/base.c k3_f16_to_f32, branch-light). */
K3C_FN float k3c_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (e == 0) {
        /* zero or subnormal: man · 2^-24 exactly */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    uint32_t u =
        e == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((e + 112u) << 23) | (man << 13));
    return k3_mxfp4_bits_to_f32(u);
}
K3C_FN float k3c_sigm(float x) {
    return 1.0f / (1.0f + expf(-x));
}
K3C_FN float k3c_silu(float x) {
    return x * k3c_sigm(x);
}
K3C_FN float k3c_situ(float g, float u, float beta, float lin_beta) {
    float a = beta * tanhf(g / beta) * k3c_sigm(g);
    float b = lin_beta > 0.0f ? lin_beta * tanhf(u / lin_beta) : u;
    return a * b;
}
K3C_FN float k3c_swiglu(float g, float u) {
    return g * k3c_sigm(g) * u;
}
/* PyTorch softplus (beta 1, threshold 20), as ref. */
K3C_FN float k3c_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}
/* KDA gate of one channel: v = r + dt_bias; a = exp(a_log[h]) computed by the caller. */
K3C_FN float k3c_kda_gate(float r, float dt_bias, float a, bool has_lb, float lb) {
    float v = r + dt_bias;
    return has_lb ? lb * (1.0f / (1.0f + expf(-a * v))) : -a * k3c_softplus(v);
}

/* ---- fixed-order reductions: host emulation of the device trees ---------------------------- */
/* The warp butterfly: after offsets 16, 8, 4, 2, 1 every lane holds the same sum (each step adds
 * two values, and + is commutative); this is what __shfl_xor_sync computes. p[32] is consumed. */
K3C_FN float k3c_xor_tree(float *p) {
    for (int off = K3C_WARP / 2; off > 0; off >>= 1) {
        float q[K3C_WARP];
        for (int l = 0; l < K3C_WARP; l++) q[l] = p[l] + p[l ^ off];
        for (int l = 0; l < K3C_WARP; l++) p[l] = q[l];
    }
    return p[0];
}
K3C_FN float k3c_xor_tree_max(float *p) {
    for (int off = K3C_WARP / 2; off > 0; off >>= 1) {
        float q[K3C_WARP];
        for (int l = 0; l < K3C_WARP; l++) q[l] = fmaxf(p[l], p[l ^ off]);
        for (int l = 0; l < K3C_WARP; l++) p[l] = q[l];
    }
    return p[0];
}
/* A block of nt threads (nt % 32 == 0, nt <= 1024): each warp's butterfly, then the warp sums
 * (zero-padded to 32) through one more butterfly. p[nt] is consumed. */
K3C_FN float k3c_block_tree(float *p, int nt, bool is_max) {
    float w[K3C_WARP];
    for (int l = 0; l < K3C_WARP; l++) w[l] = is_max ? -INFINITY : 0.0f;
    for (int wi = 0; wi < nt / K3C_WARP; wi++)
        w[wi] = is_max ? k3c_xor_tree_max(p + wi * K3C_WARP) : k3c_xor_tree(p + wi * K3C_WARP);
    return is_max ? k3c_xor_tree_max(w) : k3c_xor_tree(w);
}

/* ---- rows: lane partials (lane of nl lanes takes elements lane, lane+nl, ...) -------------- */
K3C_FN float k3c_sumsq_part(const float *x, int64_t n, int lane, int nl) {
    float s = 0.0f;
    for (int64_t i = lane; i < n; i += nl) s = fmaf(x[i], x[i], s);
    return s;
}
K3C_FN float k3c_max_part(const float *x, int64_t n, int lane, int nl) {
    float m = -INFINITY;
    for (int64_t i = lane; i < n; i += nl) m = fmaxf(m, x[i]);
    return m;
}
/* Σ exp(x[i] - m) over the lane's elements; writes e = exp(x - m) to y (y may alias x). */
K3C_FN float k3c_expsum_part(const float *x, float m, int64_t n, int lane, int nl, float *y) {
    float s = 0.0f;
    for (int64_t i = lane; i < n; i += nl) {
        float e = expf(x[i] - m);
        y[i] = e;
        s += e;
    }
    return s;
}
/* Σ (v[d]·r)·w[d] over the lane's elements (AttnRes source score, as ref: normalise, then dot) */
K3C_FN float k3c_normdot_part(const float *v, float r, const float *w, int64_t n, int lane,
                              int nl) {
    float s = 0.0f;
    for (int64_t i = lane; i < n; i += nl) s = fmaf(v[i] * r, w[i], s);
    return s;
}
K3C_FN float k3c_rms_scale(float ss, int64_t n, float eps) {
    return 1.0f / sqrtf(ss / (float)n + eps);
}
K3C_FN float k3c_l2_scale(float ss, float eps) {
    return 1.0f / sqrtf(ss + eps);
}

/* ---- matmul: one weight row against one token ---------------------------------------------- */
/* A row is cut into chunks of 16 bytes of weights (vector path: F32 4 values, BF16 8, MXFP4 one
 * 32-element group + its E8M0 scale; scalar path: 1 value, F32/BF16 only). Slice s of nl walks
 * chunks c = s, s + nl, ... in order into one fp32 accumulator (k3c_gemv_part); the matmul adds
 * its K3C_MM_SLICES slices in slice order (k3c_gemv_row), attn_latent meets its 32 lanes in the
 * warp butterfly. x is read 4 floats at a time on the vector path (16-byte aligned there). */
K3C_FN int k3c_chunk(int dt, bool vec) {
    return dt == K3C_DT_MXFP4 ? 32 : !vec ? 1 : dt == K3C_DT_F32 ? 4 : 8;
}
K3C_FN float4 k3c_ldx4(const float *x, bool aligned) {
    return aligned ? *(const float4 *)x : make_float4(x[0], x[1], x[2], x[3]);
}
/* xa: x is 16-byte aligned (the strided heads of matmul_heads may not be; same arithmetic) */
K3C_FN float k3c_dot_chunk_f32x4(float4 w, const float *x, float acc, bool xa = true) {
    const float4 v = k3c_ldx4(x, xa);
    acc = fmaf(w.x, v.x, acc);
    acc = fmaf(w.y, v.y, acc);
    acc = fmaf(w.z, v.z, acc);
    return fmaf(w.w, v.w, acc);
}
K3C_FN float k3c_dot_chunk_bf16x8(uint4 w, const float *x, float acc, bool xa = true) {
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
    for (int m = 0; m < 4; m += 2) {
        const float4 v = k3c_ldx4(x + 2 * m, xa);
        acc = fmaf(k3_mxfp4_bits_to_f32(u[m] << 16), v.x, acc);
        acc = fmaf(k3_mxfp4_bits_to_f32(u[m] & 0xffff0000u), v.y, acc);
        acc = fmaf(k3_mxfp4_bits_to_f32(u[m + 1] << 16), v.z, acc);
        acc = fmaf(k3_mxfp4_bits_to_f32(u[m + 1] & 0xffff0000u), v.w, acc);
    }
    return acc;
}
/* One MXFP4 group: E2M1 codes decoded in registers; Σ code·x first, then × 2^(e-127) once (a
 * power of two: the same as scaling each element unless the group sum under/overflows).
 * xa: x is 16-byte aligned. */
K3C_FN float k3c_dot_chunk_mxfp4(uint4 p, uint8_t e, const float *x, float acc, bool xa) {
    const uint32_t u[4] = {p.x, p.y, p.z, p.w};
    float g = 0.0f;
    for (int m = 0; m < 4; m++)
        for (int h = 0; h < 2; h++) { /* two bytes = 4 elements = one float4 of x */
            const float4 v = k3c_ldx4(x + 8 * m + 4 * h, xa);
            const unsigned b0 = (u[m] >> (16 * h)) & 0xffu, b1 = (u[m] >> (16 * h + 8)) & 0xffu;
            g = fmaf(k3_mxfp4_e2m1(b0 & 15u), v.x, g);
            g = fmaf(k3_mxfp4_e2m1(b0 >> 4), v.y, g);
            g = fmaf(k3_mxfp4_e2m1(b1 & 15u), v.z, g);
            g = fmaf(k3_mxfp4_e2m1(b1 >> 4), v.w, g);
        }
    return fmaf(k3_e8m0_to_f32(e), g, acc);
}
/* The 16 bytes at p, aligned (one load) or not (byte loads). */
K3C_FN uint4 k3c_ld16(const uint8_t *p, bool aligned) {
    if (aligned) return *(const uint4 *)p;
    uint32_t u[4];
    for (int m = 0; m < 4; m++)
        u[m] = (uint32_t)p[4 * m] | (uint32_t)p[4 * m + 1] << 8 | (uint32_t)p[4 * m + 2] << 16 |
               (uint32_t)p[4 * m + 3] << 24;
    return make_uint4(u[0], u[1], u[2], u[3]);
}
/* Element i of a weight row in the scalar path (F32/BF16; MXFP4 never takes it). */
K3C_FN float k3c_w_elem(int dt, const void *row, int64_t i) {
    return dt == K3C_DT_F32 ? ((const float *)row)[i] : k3c_bf16(((const uint16_t *)row)[i]);
}
/* Chunk c of a row against x (the chunk's first element of the row's x). vec: weights and x
 * 16-byte aligned (MXFP4 without vec: unaligned loads of the same group). */
K3C_FN float k3c_gemv_chunk(int dt, bool vec, const uint8_t *row, const uint8_t *srow,
                            const float *xc, int64_t c, float acc) {
    if (dt == K3C_DT_MXFP4)
        return k3c_dot_chunk_mxfp4(k3c_ld16(row + c * 16, vec), srow[c], xc, acc, vec);
    if (vec && dt == K3C_DT_F32) return k3c_dot_chunk_f32x4(((const float4 *)row)[c], xc, acc);
    if (vec) return k3c_dot_chunk_bf16x8(((const uint4 *)row)[c], xc, acc);
    return fmaf(k3c_w_elem(dt, row, c), xc[0], acc);
}
/* Slice s of nl: the partial of row · x over chunks s, s + nl, ... (in elements). */
K3C_FN float k3c_gemv_part(int dt, bool vec, const void *row, const uint8_t *srow, const float *x,
                           int64_t in, int s, int nl) {
    const int ch = k3c_chunk(dt, vec);
    const int64_t nch = in / ch;
    float acc = 0.0f;
    for (int64_t c = s; c < nch; c += nl)
        acc = k3c_gemv_chunk(dt, vec, (const uint8_t *)row, srow, x + c * ch, c, acc);
    return acc;
}
/* The matmul's whole row: its K3C_MM_SLICES partials added in slice order. */
K3C_FN float k3c_gemv_row(int dt, bool vec, const void *row, const uint8_t *srow, const float *x,
                          int64_t in) {
    float v = k3c_gemv_part(dt, vec, row, srow, x, in, 0, K3C_MM_SLICES);
    for (int s = 1; s < K3C_MM_SLICES; s++)
        v += k3c_gemv_part(dt, vec, row, srow, x, in, s, K3C_MM_SLICES);
    return v;
}
/* Element (o, i) of a weight [out, in] (matmul_tn reads columns). */
K3C_FN float k3c_w_get(int dt, const void *data, const uint8_t *scale, int64_t in, int64_t o,
                       int64_t i) {
    int64_t k = o * in + i;
    if (dt == K3C_DT_MXFP4) {
        unsigned b = ((const uint8_t *)data)[k >> 1];
        return k3_mxfp4_e2m1((k & 1) ? (b >> 4) : (b & 15u)) *
               k3_e8m0_to_f32(scale[o * (in / 32) + i / 32]);
    }
    return k3c_w_elem(dt, data, k);
}

/* matmul_tn, column i of token x (x [out]): slice s of nl sums rows o = s, s + nl, ... in order;
 * the kernel adds its K3C_TN_SLICES slices in slice order (k3c_tn_col). */
K3C_FN float k3c_tn_part(int dt, const void *data, const uint8_t *scale, int64_t out, int64_t in,
                         const float *x, int64_t i, int s, int nl) {
    float acc = 0.0f;
    for (int64_t o = s; o < out; o += nl)
        acc = fmaf(x[o], k3c_w_get(dt, data, scale, in, o, i), acc);
    return acc;
}
K3C_FN float k3c_tn_col(int dt, const void *data, const uint8_t *scale, int64_t out, int64_t in,
                        const float *x, int64_t i) {
    float v = k3c_tn_part(dt, data, scale, out, in, x, i, 0, K3C_TN_SLICES);
    for (int s = 1; s < K3C_TN_SLICES; s++)
        v += k3c_tn_part(dt, data, scale, out, in, x, i, s, K3C_TN_SLICES);
    return v;
}

/* ---- KDA recurrent: one value column j of one head, one token ------------------------------ */
/* S column j (stride dv) decays by e[i] = exp(g[i]), u = Sᵀk, δ = β(v_j − u), S += k δ,
 * returns scale · Sᵀq — the ref's per-j arithmetic in the ref's order. */
K3C_FN float k3c_kda_col_step(float *S, int64_t dv, int dk, const float *e, const float *k,
                              const float *q, float vj, float b, float scale) {
    float u = 0.0f;
    for (int i = 0; i < dk; i++) {
        float s = S[i * dv] * e[i];
        S[i * dv] = s;
        u = fmaf(k[i], s, u);
    }
    float d = b * (vj - u), o = 0.0f;
    for (int i = 0; i < dk; i++) {
        float s = fmaf(k[i], d, S[i * dv]);
        S[i * dv] = s;
        o = fmaf(q[i], s, o);
    }
    return scale * o;
}

/* ---- KDA chunked (WY/UT) form: one head, one full chunk, in phases ------------------------- */
/* The ref's chunked math (kernels/ref/ref.c k3_ref_kda_head_chunked: float64 inside a chunk,
 * the state fp32 between chunks; §2.4: every decay is exp of a difference <= 0), cut into phases
 * that a block runs with a barrier after each: in a phase, thread tid of nt computes the outputs
 * tid, tid + nt, ... and reads only what earlier phases wrote, so the host test runs a phase
 * for tid = 0..nt-1 in turn and gets the device's numbers. */
typedef struct k3c_kda_chunk {
    const float *q, *k, *v, *g, *beta; /* the head's token-0 rows (strides sqk, svo, sb) */
    int64_t sqk, svo, sb, t0;          /* t0: the chunk's first token */
    int dk, dv, C;
    float scale;
    float *S, *o;                      /* S [dk, dv]; o rows of the head */
    double *G, *eG, *eL, *Wm, *U, *Ob; /* the ref's scratch layout in work */
    double *A, *Aqk, *row;             /* row: C doubles (shared memory on the device) */
} k3c_kda_chunk;
K3C_FN void k3c_kda_chunk_layout(k3c_kda_chunk *c, double *work, double *row) {
    const size_t C = (size_t)c->C, dk = (size_t)c->dk, dv = (size_t)c->dv;
    c->G = work;
    c->eG = c->G + C * dk;
    c->eL = c->eG + C * dk;
    c->Wm = c->eL + C * dk;
    c->U = c->Wm + C * dk;
    c->Ob = c->U + C * dv;
    c->A = c->Ob + C * dv;
    c->Aqk = c->A + C * C;
    c->row = row;
}
/* 1: Γ (cumulative log decay, token order) and exp Γ, per channel d */
K3C_FN void k3c_kda_chunk_p1(const k3c_kda_chunk *c, int tid, int nt) {
    for (int d = tid; d < c->dk; d += nt) {
        double acc = 0.0;
        for (int i = 0; i < c->C; i++) {
            acc = acc + (double)c->g[(c->t0 + i) * c->sqk + d];
            c->G[i * c->dk + d] = acc;
            c->eG[i * c->dk + d] = exp(acc);
        }
    }
}
/* 2: exp(Γ_last − Γ_j); A[i,j] = β_i Σ_d k_i k_j exp(Γ_i − Γ_j) (j < i), Aqk (j <= i) */
K3C_FN void k3c_kda_chunk_p2(const k3c_kda_chunk *c, int tid, int nt) {
    const int C = c->C, dk = c->dk;
    const double *Gl = c->G + (size_t)(C - 1) * dk;
    for (int x = tid; x < C * dk; x += nt) c->eL[x] = exp(Gl[x % dk] - c->G[x]);
    for (int x = tid; x < C * C; x += nt) {
        const int i = x / C, j = x % C;
        double a = 0.0, aq = 0.0;
        if (j <= i) {
            const float *ki = c->k + (c->t0 + i) * c->sqk, *qi = c->q + (c->t0 + i) * c->sqk;
            const float *kj = c->k + (c->t0 + j) * c->sqk;
            for (int d = 0; d < dk; d++) {
                double e = exp(c->G[i * dk + d] - c->G[j * dk + d]) * (double)kj[d];
                a += (double)ki[d] * e;
                aq += (double)qi[d] * e;
            }
        }
        c->A[x] = j < i ? (double)c->beta[(c->t0 + i) * c->sb] * a : 0.0;
        c->Aqk[x] = j <= i ? (double)c->scale * aq : 0.0;
    }
}
/* 3(i), 4(i): row i of T = (I + A)^-1 by forward substitution (rows < i hold T): first into
 * row[], then (after a barrier) back into A */
K3C_FN void k3c_kda_chunk_p3(const k3c_kda_chunk *c, int i, int tid, int nt) {
    const int C = c->C;
    for (int j = tid; j < i; j += nt) {
        double s = 0.0;
        for (int m = j; m < i; m++) s += c->A[i * C + m] * (m == j ? 1.0 : c->A[m * C + j]);
        c->row[j] = -s;
    }
}
K3C_FN void k3c_kda_chunk_p4(const k3c_kda_chunk *c, int i, int tid, int nt) {
    for (int j = tid; j < i; j += nt) c->A[i * c->C + j] = c->row[j];
}
/* 5: T̃[i,j] = T[i,j] β_j */
K3C_FN void k3c_kda_chunk_p5(const k3c_kda_chunk *c, int tid, int nt) {
    const int C = c->C;
    for (int x = tid; x < C * C; x += nt) {
        const int i = x / C, j = x % C;
        if (j <= i) c->A[x] = (j == i ? 1.0 : c->A[x]) * (double)c->beta[(c->t0 + j) * c->sb];
    }
}
/* 6: W = T̃ (exp Γ ⊙ K), U = T̃ V */
K3C_FN void k3c_kda_chunk_p6(const k3c_kda_chunk *c, int tid, int nt) {
    const int C = c->C, dk = c->dk, dv = c->dv;
    for (int x = tid; x < C * dk; x += nt) {
        const int i = x / dk, d = x % dk;
        double acc = 0.0;
        for (int j = 0; j <= i; j++)
            acc += c->A[i * C + j] * c->eG[j * dk + d] * (double)c->k[(c->t0 + j) * c->sqk + d];
        c->Wm[x] = acc;
    }
    for (int x = tid; x < C * dv; x += nt) {
        const int i = x / dv, e = x % dv;
        double acc = 0.0;
        for (int j = 0; j <= i; j++)
            acc += c->A[i * C + j] * (double)c->v[(c->t0 + j) * c->svo + e];
        c->U[x] = acc;
    }
}
/* 7: V' = U − W S ; O = (scale·q ⊙ exp Γ) S */
K3C_FN void k3c_kda_chunk_p7(const k3c_kda_chunk *c, int tid, int nt) {
    const int C = c->C, dk = c->dk, dv = c->dv;
    for (int x = tid; x < C * dv; x += nt) {
        const int i = x / dv, e = x % dv;
        const float *qi = c->q + (c->t0 + i) * c->sqk;
        double u = c->U[x], ob = 0.0;
        for (int d = 0; d < dk; d++) {
            const double w = c->Wm[i * dk + d];
            const double qe = (double)c->scale * (double)qi[d] * c->eG[i * dk + d];
            const double sd = (double)c->S[(int64_t)d * dv + e];
            u -= w * sd;
            ob += qe * sd;
        }
        c->U[x] = u;
        c->Ob[x] = ob;
    }
}
/* 8: o = O + Aqk V'; S ← diag(exp Γ_last) S + Σ_j (exp(Γ_last − Γ_j) ⊙ k_j) V'_jᵀ (fp32) */
K3C_FN void k3c_kda_chunk_p8(const k3c_kda_chunk *c, int tid, int nt) {
    const int C = c->C, dk = c->dk, dv = c->dv;
    const double *Gl = c->G + (size_t)(C - 1) * dk;
    for (int x = tid; x < C * dv; x += nt) {
        const int i = x / dv, e = x % dv;
        double ob = c->Ob[x];
        for (int j = 0; j <= i; j++) ob += c->Aqk[i * C + j] * c->U[j * dv + e];
        c->o[(c->t0 + i) * c->svo + e] = (float)ob;
    }
    for (int x = tid; x < dk * dv; x += nt) {
        const int d = x / dv, e = x % dv;
        double acc = exp(Gl[d]) * (double)c->S[x];
        for (int j = 0; j < C; j++) {
            const double kk = c->eL[j * dk + d] * (double)c->k[(c->t0 + j) * c->sqk + d];
            acc += kk * c->U[j * dv + e];
        }
        c->S[x] = (float)acc;
    }
}

/* ---- short conv: one channel over n tokens ------------------------------------------------- */
/* in/out column c (stride P), state column c [K-1] rows (stride P), w row [K]. */
K3C_FN void k3c_short_conv_col(const float *in, int64_t n, int64_t P, int K, const float *w,
                               float *state, float *out) {
    for (int64_t t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int j = 0; j < K; j++) {
            int64_t idx = t - (K - 1) + j;
            float v = idx >= 0 ? in[idx * P] : state[(idx + (K - 1)) * P];
            acc = fmaf(w[j], v, acc);
        }
        out[t * P] = acc;
    }
    const int km1 = K - 1;
    if (km1 <= 0) return;
    if (n >= km1) {
        for (int r = 0; r < km1; r++) state[r * P] = in[(n - km1 + r) * P];
    } else {
        const int64_t keep = km1 - n;
        for (int64_t r = 0; r < keep; r++) state[r * P] = state[(r + n) * P];
        for (int64_t r = 0; r < n; r++) state[(keep + r) * P] = in[r * P];
    }
}

/* ---- MoE router: one token (the ref's sequential algorithm, verbatim in order) -------------- */
#define K3C_TOPK_MAX_GROUPS 1024 /* = K3_MOE_TOPK_MAX_GROUPS (asserted in backend_cuda.c) */
/* Returns -1 on success, else the first expert e with a non-finite score (biased or not); -2
 * when it ran out of experts (cannot happen for a checked selection). b: the token's work row;
 * gscore, gkeep: G entries of scratch (shared memory on the device: no local-memory arrays). */
K3C_FN int k3c_topk_token(const float *s, const float *bias, int E, int K, int G, int topk_group,
                          bool renorm, float scale, float *b, int32_t *ids, float *w, float *gscore,
                          unsigned char *gkeep) {
    const int gsz = E / G;
    for (int e = 0; e < E; e++) b[e] = bias ? s[e] + bias[e] : s[e];
    for (int e = 0; e < E; e++)
        if (!isfinite(s[e]) || !isfinite(b[e])) { /* as ref: NaN weights, the token fails alone */
            for (int k = 0; k < K; k++) ids[k] = k, w[k] = NAN;
            return -1;
        }
    for (int g = 0; g < G; g++) {
        const float *bg = b + (int64_t)g * gsz;
        int i1 = 0;
        for (int i = 1; i < gsz; i++)
            if (bg[i] > bg[i1]) i1 = i;
        int i2 = -1;
        for (int i = 0; i < gsz; i++)
            if (i != i1 && (i2 < 0 || bg[i] > bg[i2])) i2 = i;
        gscore[g] = i2 < 0 ? bg[i1] : bg[i1] + bg[i2];
        gkeep[g] = 0;
    }
    if (G > 1) {
        for (int j = 0; j < topk_group; j++) { /* argmax over groups not yet kept, lowest index */
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!gkeep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
            gkeep[best] = 1;
        }
    } else {
        gkeep[0] = 1;
    }
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            if (!gkeep[e / gsz] || isinf(b[e])) continue;
            if (best < 0 || b[e] > b[best]) best = e;
        }
        if (best < 0) return -2;
        ids[k] = best;
        b[best] = -INFINITY;
    }
    float sum = 0.0f;
    for (int k = 0; k < K; k++) {
        w[k] = s[ids[k]];
        sum += w[k];
    }
    if (renorm) {
        float den = sum + 1e-20f;
        for (int k = 0; k < K; k++) w[k] = w[k] / den;
    }
    for (int k = 0; k < K; k++) w[k] *= scale;
    return -1;
}

/* ---- rows_wsum: one element d of segment [i0, i1) ------------------------------------------ */
/* One term of a weighted row sum in row order: the first term initialises (w·x, or x when
 * unweighted), each later one is fused in (the order rows_wsum and moe_experts' slot sum share). */
K3C_FN float k3c_wsum_step(float a, const float *w, int64_t i, float x, bool first) {
    if (first) return w ? w[i] * x : x;
    return w ? fmaf(w[i], x, a) : a + x;
}
K3C_FN float k3c_wsum_elem(const float *x, const float *w, int64_t i0, int64_t i1, int64_t width,
                           int64_t d) {
    float a = 0.0f;
    for (int64_t i = i0; i < i1; i++) a = k3c_wsum_step(a, w, i, x[i * width + d], i == i0);
    return a;
}

/* ---- varlen batches (k3_seqs): the lookups every per-token kernel makes ------------------- */
#define K3C_KV_BLOCK 64 /* = K3_KV_BLOCK (asserted in backend_cuda.c) */
/* The sequence that owns token row t: the i with tok0[i] <= t < tok0[i + 1] (tok0 [n_seqs + 1]
 * ascending from 0, every sequence non-empty, 0 <= t < tok0[n_seqs]): a binary search, log2
 * n_seqs loads of a small array that stays in L1. */
K3C_FN int k3c_seq_of(const int32_t *tok0, int n_seqs, int64_t t) {
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if ((int64_t)tok0[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}
/* The paged-cache row of position p of a sequence whose block-table row is bt (blocks +
 * i·max_blocks): row p % 64 of block bt[p / 64]. */
K3C_FN int64_t k3c_kv_row(const int32_t *bt, int64_t p) {
    return (int64_t)bt[p / K3C_KV_BLOCK] * K3C_KV_BLOCK + p % K3C_KV_BLOCK;
}

/* ---- moe_experts: the expert activation -------------------------------------------------- */
/* act(g, u): SwiGLU when beta < 0, else SiTU(beta, lin_beta) (the elementwise ops' math). */
K3C_FN float k3c_moe_act(float g, float u, float beta, float lin_beta) {
    return beta < 0.0f ? k3c_swiglu(g, u) : k3c_situ(g, u, beta, lin_beta);
}
/* The vector path of a weight row as matmul picks it (k3c_matmul): 16-byte aligned rows of a
 * whole number of 16-byte chunks, rows of a multiple of 4 elements, and x aligned. */
K3C_FN bool k3c_mm_vec(int dt, const void *data, int64_t in, bool x_aligned) {
    const uint64_t row_bytes =
        dt == K3C_DT_MXFP4 ? (uint64_t)in / 2 : (uint64_t)in * (dt == K3C_DT_F32 ? 4u : 2u);
    return (uintptr_t)data % 16 == 0 && row_bytes % 16 == 0 && in % 4 == 0 && x_aligned;
}

/* ---- device-only: the shuffles the host trees above emulate (nvcc, or the emulation) ------- */
#if defined(__CUDACC__) || defined(K3_CUDA_EMULATION)
static __device__ __forceinline__ float k3c_warp_sum(float v) {
    for (int off = K3C_WARP / 2; off > 0; off >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}
static __device__ __forceinline__ float k3c_warp_max(float v) {
    for (int off = K3C_WARP / 2; off > 0; off >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}
/* k3c_block_tree on the device: blockDim.x % 32 == 0; every thread gets the result. sh: 32
 * floats of shared memory (reusable right after the call: the leading barrier protects it). */
static __device__ __forceinline__ float k3c_block_reduce(float v, float *sh, bool is_max) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = is_max ? k3c_warp_max(v) : k3c_warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    float t = lane < nw ? sh[lane] : (is_max ? -INFINITY : 0.0f);
    return is_max ? k3c_warp_max(t) : k3c_warp_sum(t);
}
/* blocks for a grid-stride loop over n elements with nt threads per block */
static inline unsigned k3c_blocks(int64_t n, int nt) {
    int64_t b = (n + nt - 1) / nt;
    return (unsigned)(b < 1 ? 1 : b > (1 << 20) ? (1 << 20) : b);
}
#endif

#endif /* K3_CUDA_MATH_CUH */
