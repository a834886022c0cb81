// kda.cu — the KDA ops of the cuda backend (K3-MODEL.md §2): the decay gate (kda_gate), the
// depthwise causal short conv (short_conv), and the delta rule in its two forms.
//   kda_recurrent: one block per head; per token the block stages exp(g), k, q in shared memory
//     and each thread owns value columns j (S[:, j] in global memory, coalesced across j), running
//     the ref's per-column arithmetic (cuda_math.cuh k3c_kda_col_step) in the ref's order.
//   kda_chunked: one block per head, kernels/ref's chunked (WY/UT) form with the same float64
//     intra-chunk math and the same scratch layout (work, per head), in the phases of
//     cuda_math.cuh (k3c_kda_chunk_p1..p8) with a barrier after each. §2.4 overflow rule:
//     every decay factor is exp of a difference <= 0 — exp(Γ_i − Γ_j) for i >= j, exp(Γ_i) and
//     exp(Γ_last − Γ_j) — never exp(−Γ). A ragged tail (< C tokens) runs the recurrence.
// One block per head is little parallelism for long prefill (H blocks); it is correct first.
//   kda_seqs / short_conv_seqs: the same per-head / per-channel code over a varlen batch, the
//     state of sequence i at slot[i]: one launch over (head, sequence) for the sequences that
//     take the recurrence (a decode step: all of them, in parallel), and, when some sequence has
//     a full chunk (max_new >= C), one launch over heads that runs the chunked sequences in turn
//     (their scratch is the op's: one chunk's worth per head, as kda_chunked's).
//
//   State streaming (issue 44, Deliver 3c): a recurrent run (decode: one token) whose shape fits
//     (dv % 4 = 0, dk <= K3C_KDA_RPT·(256 / (dv / 4)), the state 16-byte aligned) takes
//     head_stream instead of head_recurrent: block (head[, sequence]) of 256 threads holds the
//     head's state in registers — thread (rg, cg) = (tid / (dv / 4), tid % (dv / 4)) the four
//     columns 4cg .. 4cg + 3 of rows rg, rg + R, ... (R = 256 / (dv / 4) row groups; at dk = dv =
//     128, 16 rows × 4 = 64 floats) — read once with one 16-byte load per row and lane (a warp
//     reads a row's 512 contiguous bytes: four whole 128-byte lines) and written once at the end,
//     all the run's tokens in between. Per token (fp32): the rows decay and each thread sums
//     u = Σ k_i s_ij over its rows, the row groups' partials meet in shared memory in order, δ =
//     β(v − u), S += k δᵀ and o = scale·Sᵀq the same way. The same sums as the ref in another
//     order (K3_TOL_KDA_REL_L2). The state may be stored in bf16 (K3C_KDA_BF16, the backend's
//     K3_CUDA_KDA_STATE=bf16: each head's dk·dv bf16 at the start of its fp32 region, 8-byte loads,
//     fp32 math, rounded to nearest even at each store; head_mma loads and stores it the same way).
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"
#include "k3c_mma.cuh" /* k3c_bf16_rne */

#define K3C_KDA_THREADS 256 /* head_stream's block */
#define K3C_KDA_RPT     16  /* state rows a thread of head_stream holds */

/* four consecutive state values of a row, fp32 or bf16 */
static __device__ __forceinline__ void st_load(const float *p, float x[4]) {
    const float4 v = *(const float4 *)p;
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
static __device__ __forceinline__ void st_store(float *p, const float x[4]) {
    *(float4 *)p = make_float4(x[0], x[1], x[2], x[3]);
}
static __device__ __forceinline__ void st_load(const uint16_t *p, float x[4]) {
    const uint64_t v = *(const uint64_t *)p; /* one 8-byte load: 4 bf16 */
    for (int c = 0; c < 4; c++) x[c] = k3c_bf16((uint16_t)(v >> (16 * c)));
}
static __device__ __forceinline__ void st_store(uint16_t *p, const float x[4]) {
    uint64_t v = 0;
    for (int c = 0; c < 4; c++) v |= (uint64_t)k3c_bf16_rne(x[c]) << (16 * c);
    *(uint64_t *)p = v;
}

static __device__ __forceinline__ float st_get(const float *p) {
    return *p;
}
static __device__ __forceinline__ float st_get(const uint16_t *p) {
    return k3c_bf16(*p);
}
static __device__ __forceinline__ void st_put(float *p, float x) {
    *p = x;
}
static __device__ __forceinline__ void st_put(uint16_t *p, float x) {
    *p = k3c_bf16_rne(x);
}

/* The recurrence of one head over n tokens with the state in registers (see the top); sh:
 * 3·dk + dv + 2·R·dv floats. ST: float, or uint16_t (bf16 storage). */
template <typename ST>
static __device__ void head_stream(const float *q, const float *k, const float *v, const float *g,
                                   const float *beta, int64_t n, int64_t sqk, int64_t svo,
                                   int64_t sb, int dk, int dv, float scale, ST *S, float *o,
                                   float *sh) {
    const int cgs = dv >> 2, R = K3C_KDA_THREADS / cgs, tid = threadIdx.x;
    const int cg = tid % cgs, rg = tid / cgs, j0 = 4 * cg;
    const bool act = rg < R;
    float *se = sh, *sk = se + dk, *sq = sk + dk, *sv = sq + dk, *ru = sv + dv, *ro = ru + R * dv;
    float s[K3C_KDA_RPT][4];
#pragma unroll
    for (int r = 0; r < K3C_KDA_RPT; r++) {
        const int i = rg + r * R;
        if (act && i < dk)
            st_load(S + (int64_t)i * dv + j0, s[r]);
        else
            s[r][0] = s[r][1] = s[r][2] = s[r][3] = 0.0f;
    }
    for (int64_t t = 0; t < n; t++) {
        for (int i = tid; i < dk; i += blockDim.x) {
            se[i] = expf(g[t * sqk + i]);
            sk[i] = k[t * sqk + i];
            sq[i] = q[t * sqk + i];
        }
        for (int j = tid; j < dv; j += blockDim.x) sv[j] = v[t * svo + j];
        __syncthreads();
        float u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < K3C_KDA_RPT; r++) {
            const int i = rg + r * R;
            if (!act || i >= dk) break;
            const float e = se[i], ki = sk[i];
            for (int c = 0; c < 4; c++) {
                s[r][c] *= e;
                u[c] = fmaf(ki, s[r][c], u[c]);
            }
        }
        if (act)
            for (int c = 0; c < 4; c++) ru[rg * dv + j0 + c] = u[c];
        __syncthreads();
        const float b = beta[t * sb];
        float d[4], op[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int c = 0; c < 4; c++) {
            float uu = 0.0f;
            for (int x = 0; x < R; x++) uu += ru[x * dv + j0 + c];
            d[c] = b * (sv[j0 + c] - uu);
        }
#pragma unroll
        for (int r = 0; r < K3C_KDA_RPT; r++) {
            const int i = rg + r * R;
            if (!act || i >= dk) break;
            const float ki = sk[i], qi = sq[i];
            for (int c = 0; c < 4; c++) {
                s[r][c] = fmaf(ki, d[c], s[r][c]);
                op[c] = fmaf(qi, s[r][c], op[c]);
            }
        }
        if (act)
            for (int c = 0; c < 4; c++) ro[rg * dv + j0 + c] = op[c];
        __syncthreads();
        if (rg == 0)
            for (int c = 0; c < 4; c++) {
                float oo = 0.0f;
                for (int x = 0; x < R; x++) oo += ro[x * dv + j0 + c];
                o[t * svo + j0 + c] = scale * oo;
            }
        __syncthreads(); /* before the next token overwrites the staging and the partials */
    }
#pragma unroll
    for (int r = 0; r < K3C_KDA_RPT; r++) {
        const int i = rg + r * R;
        if (act && i < dk) st_store(S + (int64_t)i * dv + j0, s[r]);
    }
}
/* head_stream takes dk × dv (and its shared memory) */
static bool stream_fits(int dk, int dv) {
    return dv % 4 == 0 && dv / 4 <= K3C_KDA_THREADS &&
           dk <= K3C_KDA_RPT * (K3C_KDA_THREADS / (dv / 4));
}
static size_t stream_shmem(int dk, int dv) {
    return (size_t)(3 * dk + dv + 2 * (K3C_KDA_THREADS / (dv / 4)) * dv) * sizeof(float);
}

static __global__ void gate_kernel(float *r, const float *dt_bias, const float *a_log, int64_t T,
                                   int H, int dk, bool has_lb, float lb) {
    const int64_t P = (int64_t)H * dk, n = T * P;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t ch = i % P;
        const float a = expf(a_log[ch / dk]);
        r[i] = k3c_kda_gate(r[i], dt_bias[ch], a, has_lb, lb);
    }
}

static __global__ void conv_kernel(const float *in, int64_t n, int64_t P, int K, const float *w,
                                   float *state, float *out) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= P) return;
    k3c_short_conv_col(in + c, n, P, K, w + c * K, state + c, out + c);
}

/* The recurrence of one head over n tokens; sh: 3·dk floats of shared memory. */
static __device__ void head_recurrent(const float *q, const float *k, const float *v,
                                      const float *g, const float *beta, int64_t n, int64_t sqk,
                                      int64_t svo, int64_t sb, int dk, int dv, float scale,
                                      float *S, float *o, float *sh) {
    float *se = sh, *sk = sh + dk, *sq = sh + 2 * dk;
    for (int64_t t = 0; t < n; t++) {
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            se[i] = expf(g[t * sqk + i]);
            sk[i] = k[t * sqk + i];
            sq[i] = q[t * sqk + i];
        }
        __syncthreads();
        const float b = beta[t * sb];
        for (int j = threadIdx.x; j < dv; j += blockDim.x)
            o[t * svo + j] = k3c_kda_col_step(S + j, dv, dk, se, sk, sq, v[t * svo + j], b, scale);
        __syncthreads(); /* before the next token overwrites se/sk/sq */
    }
}

static __global__ void recurrent_kernel(const float *q, const float *k, const float *v,
                                        const float *g, const float *beta, int64_t n, int H, int dk,
                                        int dv, float scale, float *S, float *o) {
    K3C_DYN_SHARED(float, sh_rec);
    const int h = blockIdx.x;
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    head_recurrent(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, sqk, svo, H, dk, dv,
                   scale, S + (int64_t)h * dk * dv, o + h * dv, sh_rec);
}

/* S: fp32 [H, dk, dv]; with ST = uint16_t head h's dk·dv bf16 sit at the start of its fp32 region
 * (the bf16 state keeps the fp32 layout's offsets) */
template <typename ST>
static __global__ void __launch_bounds__(K3C_KDA_THREADS, 1)
    stream_kernel(const float *q, const float *k, const float *v, const float *g, const float *beta,
                  int64_t n, int H, int dk, int dv, float scale, float *S, float *o) {
    K3C_DYN_SHARED(float, sh_str);
    const int h = blockIdx.x;
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    head_stream<ST>(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, sqk, svo, H, dk,
                    dv, scale, (ST *)(S + (int64_t)h * dk * dv), o + h * dv, sh_str);
}

/* The chunked form of one head over n tokens (pointers at the head's token-0 rows, strides as
 * head_recurrent): full chunks by the phases, a ragged tail (< C tokens) by the recurrence. work:
 * the head's wf floats; sh: C doubles, then 3·dk floats. */
static __device__ void head_chunked(const float *q, const float *k, const float *v, const float *g,
                                    const float *beta, int64_t n, int64_t sqk, int64_t svo,
                                    int64_t sb, int dk, int dv, float scale, float *S, float *o,
                                    int C, float *work, double *sh) {
    const int tid = threadIdx.x, nt = blockDim.x;
    k3c_kda_chunk c;
    c.q = q, c.k = k, c.v = v, c.g = g, c.beta = beta;
    c.sqk = sqk, c.svo = svo, c.sb = sb;
    c.dk = dk, c.dv = dv, c.C = C, c.scale = scale;
    c.S = S, c.o = o;
    k3c_kda_chunk_layout(&c, (double *)work, sh);
    for (c.t0 = 0; C > 1 && c.t0 + C <= n; c.t0 += C) {
        k3c_kda_chunk_p1(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p2(&c, tid, nt);
        __syncthreads();
        for (int i = 1; i < C; i++) {
            k3c_kda_chunk_p3(&c, i, tid, nt);
            __syncthreads();
            k3c_kda_chunk_p4(&c, i, tid, nt);
            __syncthreads();
        }
        k3c_kda_chunk_p5(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p6(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p7(&c, tid, nt);
        __syncthreads();
        k3c_kda_chunk_p8(&c, tid, nt);
        __syncthreads();
    }
    const int64_t t0 = c.t0;
    if (t0 < n)
        head_recurrent(q + t0 * sqk, k + t0 * sqk, v + t0 * svo, g + t0 * sqk, beta + t0 * sb,
                       n - t0, sqk, svo, sb, dk, dv, scale, S, o + t0 * svo, (float *)(sh + C));
}

/* ---- KDA prefill on tensor cores: chunks of 16 on mma.m16n8k16 (see the top) ---------------- */
K3C_FN uint32_t pack_bf16(float lo, float hi) {
    return (uint32_t)k3c_bf16_rne(lo) | (uint32_t)k3c_bf16_rne(hi) << 16;
}
/* head_mma takes dk × dv (and the tail's head_stream does) */
static bool mma_fits(int dk, int dv) {
    return dk % 16 == 0 && dv % 16 == 0 && dk <= 128 && dv <= 128 && stream_fits(dk, dv);
}
static size_t mma_shmem(int dk, int dv) {
    const size_t f = (size_t)(16 * dk + 32 * dv + 256 + 16) * sizeof(float);
    const size_t b = (size_t)(48 * (dk + 8) + 16 * (dv + 8) + 16 * 24) * 2;
    const size_t st = stream_shmem(dk, dv);
    return f + b > st ? f + b : st;
}
/* The chunk-16 form of one head over n tokens, 256 threads (8 warps): full chunks with the state
 * in registers as Sᵀ [dv × dk] mma accumulators (warp w: rows j of [16w, 16w + 16), every column
 * i), a ragged tail by head_stream. sh: mma_shmem bytes. */
template <typename ST>
static __device__ void head_mma(const float *q, const float *k, const float *v, const float *g,
                                const float *beta, int64_t n, int64_t sqk, int64_t svo, int64_t sb,
                                int dk, int dv, float scale, ST *S, float *o, float *sh) {
    const int tid = threadIdx.x, nth = blockDim.x, warp = tid >> 5, lane = tid & 31;
    const int gq = lane >> 2, tq = lane & 3, ldk = dk + 8, ldv = dv + 8, nti = dk / 8;
    float *Gm = sh, *Us = Gm + 16 * dk, *Ws = Us + 16 * dv, *Am = Ws + 16 * dv, *bt = Am + 256;
    uint16_t *KL = (uint16_t *)(bt + 16), *QL = KL + 16 * ldk, *KR = QL + 16 * ldk;
    uint16_t *Dl = KR + 16 * ldk, *Bb = Dl + 16 * ldv;
    const bool own = warp < dv / 16; /* warp-uniform */
    const int j0 = 16 * warp;
    float acc[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
        for (int r = 0; r < 4; r++)
            acc[nt][r] =
                own && nt < nti
                    ? st_get(S + (int64_t)(8 * nt + 2 * tq + (r & 1)) * dv + j0 + gq + 8 * (r >> 1))
                    : 0.0f;
    int64_t t0 = 0;
    for (; t0 + 16 <= n; t0 += 16) {
        /* Γ_t = Σ_{s <= t} g_s per channel (fp32), β */
        for (int i = tid; i < dk; i += nth) {
            float c = 0.0f;
            for (int t = 0; t < 16; t++) Gm[t * dk + i] = c += g[(t0 + t) * sqk + i];
        }
        if (tid < 16) bt[tid] = beta[(t0 + tid) * sb];
        __syncthreads();
        /* the bf16 operands (every exponent <= 0: §2.4) and the decayed scores in fp32 */
        for (int e = tid; e < 16 * dk; e += nth) {
            const int t = e / dk, i = e % dk;
            const float G = Gm[e], kk = k[(t0 + t) * sqk + i], qq = q[(t0 + t) * sqk + i];
            KL[t * ldk + i] = k3c_bf16_rne(kk * expf(G));
            QL[t * ldk + i] = k3c_bf16_rne(qq * expf(G));
            KR[t * ldk + i] = k3c_bf16_rne(kk * expf(Gm[15 * dk + i] - G));
        }
        for (int e = tid; e < 256; e += nth) {
            const int t = e >> 4, sx = e & 15;
            float a = 0.0f, b = 0.0f;
            if (sx <= t)
                for (int i = 0; i < dk; i++) {
                    const float kf =
                        k[(t0 + sx) * sqk + i] * expf(Gm[t * dk + i] - Gm[sx * dk + i]);
                    a = fmaf(k[(t0 + t) * sqk + i], kf, a);
                    b = fmaf(q[(t0 + t) * sqk + i], kf, b);
                }
            Am[e] = sx < t ? a : 0.0f;
            Bb[t * 24 + sx] = k3c_bf16_rne(b);
        }
        __syncthreads();
        /* Uᵀ = Sᵀ·KLᵀ and Wᵀ = Sᵀ·QLᵀ: A from the state accumulators, B = rows of KL / QL */
        if (own)
            for (int n2 = 0; n2 < 2; n2++) {
                float cu[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cw[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int ks = 0; ks < 8; ks++) {
                    if (ks >= dk / 16) break;
                    const uint32_t a[4] = {pack_bf16(acc[2 * ks][0], acc[2 * ks][1]),
                                           pack_bf16(acc[2 * ks][2], acc[2 * ks][3]),
                                           pack_bf16(acc[2 * ks + 1][0], acc[2 * ks + 1][1]),
                                           pack_bf16(acc[2 * ks + 1][2], acc[2 * ks + 1][3])};
                    const int off = (n2 * 8 + (lane & 7)) * ldk + ks * 16 + 8 * ((lane >> 3) & 1);
                    uint32_t bk[2], bq[2];
                    k3c_ldmatrix_x2(bk, KL + off);
                    k3c_ldmatrix_x2(bq, QL + off);
                    k3c_mma_bf16_16816(cu, a, bk, cu);
                    k3c_mma_bf16_16816(cw, a, bq, cw);
                }
                for (int r = 0; r < 4; r++) {
                    const int j = j0 + gq + 8 * (r >> 1), t = n2 * 8 + 2 * tq + (r & 1);
                    Us[t * dv + j] = cu[r];
                    Ws[t * dv + j] = cw[r];
                }
            }
        __syncthreads();
        /* Δ: δ_t = β_t(v_t − u_t − Σ_{s<t} A_ts δ_s), one column a thread, fp32 */
        for (int j = tid; j < dv; j += nth) {
            float d[16];
            for (int t = 0; t < 16; t++) {
                float x = v[(t0 + t) * svo + j] - Us[t * dv + j];
                for (int sx = 0; sx < t; sx++) x = fmaf(-Am[t * 16 + sx], d[sx], x);
                d[t] = bt[t] * x;
                Dl[t * ldv + j] = k3c_bf16_rne(d[t]);
            }
        }
        __syncthreads();
        /* o = scale·(W + B·Δ): warp w the n-tiles w, w + 8, ... */
        {
            uint32_t a[4];
            k3c_ldmatrix_x4(a, Bb + ((lane & 7) + 8 * ((lane >> 3) & 1)) * 24 + 8 * (lane >> 4));
            for (int nt = warp; nt < dv / 8; nt += 8) {
                float c[4];
                for (int r = 0; r < 4; r++)
                    c[r] = Ws[(gq + 8 * (r >> 1)) * dv + 8 * nt + 2 * tq + (r & 1)];
                uint32_t b[2];
                k3c_ldmatrix_x2_trans(b, Dl + (lane & 15) * ldv + 8 * nt);
                k3c_mma_bf16_16816(c, a, b, c);
                for (int r = 0; r < 4; r++)
                    o[(t0 + gq + 8 * (r >> 1)) * svo + 8 * nt + 2 * tq + (r & 1)] = scale * c[r];
            }
        }
        /* Sᵀ = Sᵀ·Λ_16 + Δᵀ·KR: A = Δᵀ (ldmatrix.x4.trans of Δ), B = KR (.x2.trans) */
        if (own) {
            uint32_t a[4];
            k3c_ldmatrix_x4_trans(a, Dl + (8 * (lane >> 4) + (lane & 7)) * ldv + j0 +
                                         8 * ((lane >> 3) & 1));
#pragma unroll
            for (int nt = 0; nt < 16; nt++) {
                if (nt >= nti) break;
                for (int r = 0; r < 4; r++)
                    acc[nt][r] *= expf(Gm[15 * dk + 8 * nt + 2 * tq + (r & 1)]);
                uint32_t b[2];
                k3c_ldmatrix_x2_trans(b, KR + (lane & 15) * ldk + 8 * nt);
                k3c_mma_bf16_16816(acc[nt], a, b, acc[nt]);
            }
        }
        __syncthreads(); /* before the next chunk overwrites the shared arrays */
    }
    if (own)
#pragma unroll
        for (int nt = 0; nt < 16; nt++) {
            if (nt >= nti) break;
            for (int r = 0; r < 4; r++)
                st_put(S + (int64_t)(8 * nt + 2 * tq + (r & 1)) * dv + j0 + gq + 8 * (r >> 1),
                       acc[nt][r]);
        }
    __syncthreads(); /* the tail's head_stream reads the state */
    if (t0 < n)
        head_stream<ST>(q + t0 * sqk, k + t0 * sqk, v + t0 * svo, g + t0 * sqk, beta + t0 * sb,
                        n - t0, sqk, svo, sb, dk, dv, scale, S, o + t0 * svo, sh);
}
/* head_mma on head state Sh (fp32, or bf16 at the start of the fp32 region when bf16) */
static __device__ void head_mma_st(const float *q, const float *k, const float *v, const float *g,
                                   const float *beta, int64_t n, int64_t sqk, int64_t svo,
                                   int64_t sb, int dk, int dv, float scale, float *Sh, float *o,
                                   float *sh, bool bf16) {
    if (bf16)
        head_mma<uint16_t>(q, k, v, g, beta, n, sqk, svo, sb, dk, dv, scale, (uint16_t *)Sh, o, sh);
    else
        head_mma<float>(q, k, v, g, beta, n, sqk, svo, sb, dk, dv, scale, Sh, o, sh);
}

static __global__ void __launch_bounds__(K3C_KDA_THREADS, 1)
    chunked_kernel(const float *q, const float *k, const float *v, const float *g,
                   const float *beta, int64_t n, int H, int dk, int dv, float scale, float *S,
                   float *o, int C, float *work, size_t wf, bool mma, bool bf16) {
    K3C_DYN_SHARED(double, sh_chk); /* row [C], then 3·dk floats for the tail */
    const int h = blockIdx.x;
    if (mma) {
        head_mma_st(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, (int64_t)H * dk,
                    (int64_t)H * dv, H, dk, dv, scale, S + (int64_t)h * dk * dv, o + h * dv,
                    (float *)sh_chk, bf16);
        return;
    }
    head_chunked(q + h * dk, k + h * dk, v + h * dv, g + h * dk, beta + h, n, (int64_t)H * dk,
                 (int64_t)H * dv, H, dk, dv, scale, S + (int64_t)h * dk * dv, o + h * dv, C,
                 work + (size_t)h * wf, sh_chk);
}

/* A sequence at position 0 starts from S = 0 (kda_seqs' contract): the block zeroes its head's
 * state before the recurrence reads it (pos[i] is block-uniform, so every thread syncs). */
static __device__ void zero_head(float *S, int n) {
    for (int e = threadIdx.x; e < n; e += blockDim.x) S[e] = 0.0f;
    __syncthreads();
}

/* kda_seqs, the recurrent sequences: block (h, i) runs head h of sequence i when the sequence
 * takes the recurrence (C < 2 or fewer than C tokens); the others are chunked_seqs_kernel's. */
static __global__ void __launch_bounds__(K3C_KDA_THREADS, 1)
    recurrent_seqs_kernel(k3c_seqs sq, const float *q, const float *k, const float *v,
                          const float *g, const float *beta, int H, int dk, int dv, float scale,
                          float *S, int64_t S_stride, float *o, int C, bool stream, bool bf16) {
    K3C_DYN_SHARED(float, sh_rec);
    const int h = blockIdx.x, i = blockIdx.y;
    const int64_t t0 = sq.tok0[i], n = sq.tok0[i + 1] - t0;
    if (C >= 2 && n >= C) return; /* block-uniform */
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    if (sq.pos[i] == 0) zero_head(S + sq.slot[i] * S_stride + (int64_t)h * dk * dv, dk * dv);
    float *Sh = S + sq.slot[i] * S_stride + (int64_t)h * dk * dv;
    if (stream && bf16) {
        head_stream<uint16_t>(q + t0 * sqk + h * dk, k + t0 * sqk + h * dk, v + t0 * svo + h * dv,
                              g + t0 * sqk + h * dk, beta + t0 * H + h, n, sqk, svo, H, dk, dv,
                              scale, (uint16_t *)Sh, o + t0 * svo + h * dv, sh_rec);
        return;
    }
    if (stream) {
        head_stream<float>(q + t0 * sqk + h * dk, k + t0 * sqk + h * dk, v + t0 * svo + h * dv,
                           g + t0 * sqk + h * dk, beta + t0 * H + h, n, sqk, svo, H, dk, dv, scale,
                           Sh, o + t0 * svo + h * dv, sh_rec);
        return;
    }
    head_recurrent(q + t0 * sqk + h * dk, k + t0 * sqk + h * dk, v + t0 * svo + h * dv,
                   g + t0 * sqk + h * dk, beta + t0 * H + h, n, sqk, svo, H, dk, dv, scale,
                   S + sq.slot[i] * S_stride + (int64_t)h * dk * dv, o + t0 * svo + h * dv, sh_rec);
}

/* kda_seqs, the chunked sequences (>= C tokens): block h runs head h of each of them in turn,
 * with the head's work (the op's scratch is kda_chunked's: H heads' worth, not a batch's). */
static __global__ void __launch_bounds__(K3C_KDA_THREADS, 1)
    chunked_seqs_kernel(k3c_seqs sq, const float *q, const float *k, const float *v, const float *g,
                        const float *beta, int H, int dk, int dv, float scale, float *S,
                        int64_t S_stride, float *o, int C, float *work, size_t wf, bool mma,
                        bool bf16) {
    K3C_DYN_SHARED(double, sh_chk);
    const int h = blockIdx.x;
    const int64_t sqk = (int64_t)H * dk, svo = (int64_t)H * dv;
    for (int i = 0; i < sq.n_seqs; i++) {
        const int64_t t0 = sq.tok0[i], n = sq.tok0[i + 1] - t0;
        if (n < C) continue; /* block-uniform */
        if (sq.pos[i] == 0) zero_head(S + sq.slot[i] * S_stride + (int64_t)h * dk * dv, dk * dv);
        if (mma) {
            head_mma_st(q + t0 * sqk + h * dk, k + t0 * sqk + h * dk, v + t0 * svo + h * dv,
                        g + t0 * sqk + h * dk, beta + t0 * H + h, n, sqk, svo, H, dk, dv, scale,
                        S + sq.slot[i] * S_stride + (int64_t)h * dk * dv, o + t0 * svo + h * dv,
                        (float *)sh_chk, bf16);
            continue;
        }
        head_chunked(q + t0 * sqk + h * dk, k + t0 * sqk + h * dk, v + t0 * svo + h * dv,
                     g + t0 * sqk + h * dk, beta + t0 * H + h, n, sqk, svo, H, dk, dv, scale,
                     S + sq.slot[i] * S_stride + (int64_t)h * dk * dv, o + t0 * svo + h * dv, C,
                     work + (size_t)h * wf, sh_chk);
    }
}

/* short_conv_seqs: thread (c, i) = channel c of sequence i over its tokens */
static __global__ void conv_seqs_kernel(k3c_seqs sq, const float *in, int64_t P, int K,
                                        const float *w, float *state, int64_t state_stride,
                                        float *out) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int i = blockIdx.y;
    if (c >= P) return;
    const int64_t t0 = sq.tok0[i], n = sq.tok0[i + 1] - t0;
    float *st = state + sq.slot[i] * state_stride + c;
    if (sq.pos[i] == 0) /* a new sequence: its column of the state starts from zeros */
        for (int r = 0; r < K - 1; r++) st[(int64_t)r * P] = 0.0f;
    k3c_short_conv_col(in + t0 * P + c, n, P, K, w + c * K, st, out + t0 * P + c);
}

extern "C" int k3c_kda_gate(cudaStream_t s, float *r, const float *dt_bias, const float *a_log,
                            int64_t T, int H, int dk, bool has_lb, float lb) {
    const int64_t n = T * H * dk;
    if (n <= 0) return 0;
    K3C_LAUNCH(k3c_blocks(n, 256), 256, 0, s, gate_kernel)(r, dt_bias, a_log, T, H, dk, has_lb, lb);
    return (int)cudaGetLastError();
}

extern "C" int k3c_short_conv(cudaStream_t s, const float *in, int64_t n, int64_t P, int K,
                              const float *w, float *state, float *out) {
    if (P <= 0 || (n <= 0 && K <= 1)) return 0;
    K3C_LAUNCH((unsigned)((P + 127) / 128), 128, 0, s, conv_kernel)(in, n, P, K, w, state, out);
    return (int)cudaGetLastError();
}

extern "C" bool k3c_kda_bf16_fits(int dk, int dv, int C) {
    return stream_fits(dk, dv) && (C < 2 || (C == 16 && mma_fits(dk, dv)));
}

extern "C" int k3c_kda(cudaStream_t s, const float *q, const float *k, const float *v,
                       const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                       float scale, float *S, float *o, int C, float *work, size_t wf, int mode) {
    if (n <= 0 || H <= 0) return 0;
    const bool bf16 = (mode & K3C_KDA_BF16) != 0;
    if (bf16 && (!k3c_kda_bf16_fits(dk, dv, C) || ((uintptr_t)S & 7u)))
        return (int)cudaErrorInvalidValue;
    const size_t sh_tail = 3 * (size_t)dk * sizeof(float);
    if (C == 0 && bf16) {
        K3C_LAUNCH((unsigned)H, K3C_KDA_THREADS, stream_shmem(dk, dv), s, stream_kernel<uint16_t>)
        (q, k, v, g, beta, n, H, dk, dv, scale, S, o);
    } else if (C == 0 && stream_fits(dk, dv) && ((uintptr_t)S & 15u) == 0) {
        K3C_LAUNCH((unsigned)H, K3C_KDA_THREADS, stream_shmem(dk, dv), s, stream_kernel<float>)
        (q, k, v, g, beta, n, H, dk, dv, scale, S, o);
    } else if (C == 0) {
        K3C_LAUNCH((unsigned)H, 128, sh_tail, s, recurrent_kernel)
        (q, k, v, g, beta, n, H, dk, dv, scale, S, o);
    } else {
        const bool m = (bf16 || (mode & K3C_KDA_MMA)) && C == 16 && mma_fits(dk, dv);
        const size_t sh = m ? mma_shmem(dk, dv) : (size_t)C * sizeof(double) + sh_tail;
        K3C_LAUNCH((unsigned)H, 256, sh, s, chunked_kernel)
        (q, k, v, g, beta, n, H, dk, dv, scale, S, o, C, work, wf, m, bf16);
    }
    return (int)cudaGetLastError();
}

extern "C" int k3c_short_conv_seqs(cudaStream_t s, const k3c_seqs *sq, const float *in, int64_t P,
                                   int K, const float *w, float *state, int64_t state_stride,
                                   float *out) {
    if (sq->n_seqs <= 0 || P <= 0) return 0;
    dim3 grid((unsigned)((P + 127) / 128), (unsigned)sq->n_seqs);
    K3C_LAUNCH(grid, 128, 0, s, conv_seqs_kernel)(*sq, in, P, K, w, state, state_stride, out);
    return (int)cudaGetLastError();
}

extern "C" int k3c_kda_seqs(cudaStream_t s, const k3c_seqs *sq, const float *q, const float *k,
                            const float *v, const float *g, const float *beta, int H, int dk,
                            int dv, float scale, float *S, int64_t S_stride, float *o, int C,
                            float *work, size_t wf, int mode) {
    if (sq->n_seqs <= 0 || H <= 0) return 0;
    const bool bf16 = (mode & K3C_KDA_BF16) != 0;
    if (bf16 && (!k3c_kda_bf16_fits(dk, dv, C) || ((uintptr_t)S & 7u) || S_stride % 2))
        return (int)cudaErrorInvalidValue;
    const size_t sh_tail = 3 * (size_t)dk * sizeof(float);
    dim3 grid((unsigned)H, (unsigned)sq->n_seqs);
    const bool stream =
        bf16 || (stream_fits(dk, dv) && ((uintptr_t)S & 15u) == 0 && S_stride % 4 == 0);
    if (stream) {
        K3C_LAUNCH(grid, K3C_KDA_THREADS, stream_shmem(dk, dv), s, recurrent_seqs_kernel)
        (*sq, q, k, v, g, beta, H, dk, dv, scale, S, S_stride, o, C, true, bf16);
    } else {
        K3C_LAUNCH(grid, 128, sh_tail, s, recurrent_seqs_kernel)
        (*sq, q, k, v, g, beta, H, dk, dv, scale, S, S_stride, o, C, false, false);
    }
    if (C >= 2 && sq->max_new >= C) { /* some sequence has a full chunk */
        const bool m = (bf16 || (mode & K3C_KDA_MMA)) && C == 16 && mma_fits(dk, dv);
        const size_t sh = m ? mma_shmem(dk, dv) : (size_t)C * sizeof(double) + sh_tail;
        K3C_LAUNCH((unsigned)H, 256, sh, s, chunked_seqs_kernel)
        (*sq, q, k, v, g, beta, H, dk, dv, scale, S, S_stride, o, C, work, wf, m, bf16);
    }
    return (int)cudaGetLastError();
}
