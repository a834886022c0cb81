// attn.cu — absorbed MLA decode attention over the latent cache (attn_latent, K3-MODEL.md §3.2),
// one query token, H heads. Two kernels on the stream:
//   scores: one warp per (head, cached token): s = scale · qc[h]·cache[j] with the lanes' strided
//     partials meeting in the warp butterfly (cuda_math.cuh k3c_gemv_part, scalar path) → work;
//   mix: one block per head: max and Σ exp through the block tree (work ← exp(s − max)), then
//     each thread owns latent elements i and sums p_j·cache[j][i] over j in order (coalesced).
// attn_paged (every token of a varlen batch over its own sequence's paged cache) has the same
// math in one kernel, one block of K3C_ROW_THREADS per (token, head), grid (T, H): the block
// finds its sequence by binary search over tok0 (cuda_math.cuh k3c_seq_of) and walks positions
// [0, p] through the block table (k3c_kv_row) in tiles of 256 scores, warp w computing the
// scores of positions w·32 .. w·32 + 31 of a tile with attn_latent's warp arithmetic. Thread tid
// then owns positions tid, tid + 256, ... exactly as k3c_max_part / k3c_expsum_part split them,
// so max, Σ exp and the mix (p_j = exp(s_j − m) / z, Σ_j in order) are attn_latent's numbers bit
// for bit. There is no global scratch (the op's work is one query's worth): a block keeps its
// scores in shared memory when its context fits K3C_ATTN_KEEP, else recomputes a tile's scores
// in each of the three passes (max, sum, mix). kv_write: a block per token row.
// Verified on host math only; device run pending.
#include "cuda_launch.h"
#include "cuda_math.cuh"

#define K3C_ATTN_TILE 256  /* scores per tile = threads of a paged block */
#define K3C_ATTN_KEEP 8192 /* scores a paged block keeps (32 KiB of shared memory) */
#define K3C_ATTN_ACC  (2048 / K3C_ATTN_TILE) /* latent elements per thread (Rkv <= 2048) */

static __global__ void scores_kernel(const float *qc, const float *cache, int64_t n_ctx, int W,
                                     float scale, float *work) {
    const int h = blockIdx.y, lane = threadIdx.x & 31;
    const int64_t j = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (j >= n_ctx) return;
    const float s = k3c_warp_sum(k3c_gemv_part(K3C_DT_F32, false, cache + j * W, nullptr,
                                               qc + (int64_t)h * W, W, lane, K3C_WARP));
    if (lane == 0) work[(int64_t)h * n_ctx + j] = s * scale;
}

static __global__ void mix_kernel(const float *cache, int64_t n_ctx, int W, int Rkv, float *o_lat,
                                  float *work) {
    K3C_SHARED(float, sh, [32]);
    const int h = blockIdx.x;
    float *wk = work + (int64_t)h * n_ctx;
    const float m = k3c_block_reduce(k3c_max_part(wk, n_ctx, threadIdx.x, blockDim.x), sh, true);
    const float z =
        k3c_block_reduce(k3c_expsum_part(wk, m, n_ctx, threadIdx.x, blockDim.x, wk), sh, false);
    /* the block tree's barriers order every exp write before the reads below */
    for (int i = threadIdx.x; i < Rkv; i += blockDim.x) {
        float acc = 0.0f;
        for (int64_t j = 0; j < n_ctx; j++) acc = fmaf(wk[j] / z, cache[j * W + i], acc);
        o_lat[(int64_t)h * Rkv + i] = acc;
    }
}

extern "C" int k3c_attn_latent(cudaStream_t s, const float *qc, const float *cache, int64_t n_ctx,
                               int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    if (H <= 0 || Rkv <= 0) return 0;
    if (n_ctx <= 0) return k3c_fill(s, o_lat, (int64_t)H * Rkv, 0.0f);
    dim3 grid((unsigned)((n_ctx + 7) / 8), (unsigned)H);
    K3C_LAUNCH(grid, 256, 0, s, scores_kernel)(qc, cache, n_ctx, W, scale, work);
    K3C_LAUNCH((unsigned)H, K3C_ROW_THREADS, 0, s, mix_kernel)(cache, n_ctx, W, Rkv, o_lat, work);
    return (int)cudaGetLastError();
}

/* The scores of positions [j0, j0 + 256) ∩ [0, n) of one (token, head) into sc[0 ..]: warp w
 * takes positions j0 + w, j0 + w + nw, ... (warp-uniform loop: the shuffles see all lanes). */
static __device__ void paged_tile(const float *q, const float *cache, const int32_t *bt, int64_t j0,
                                  int64_t n, int W, float scale, float *sc) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int r = threadIdx.x >> 5; r < K3C_ATTN_TILE && j0 + r < n; r += nw) {
        const float *row = cache + k3c_kv_row(bt, j0 + r) * W;
        const float s =
            k3c_warp_sum(k3c_gemv_part(K3C_DT_F32, false, row, nullptr, q, W, lane, K3C_WARP));
        if (lane == 0) sc[r] = s * scale;
    }
}

static __global__ void __launch_bounds__(K3C_ATTN_TILE)
    paged_kernel(k3c_seqs sq, const float *qc, const float *cache, int H, int W, int Rkv,
                 float scale, float *o_lat, int64_t keep) {
    K3C_DYN_SHARED(float, sh_attn); /* red [32] | sc [keep] */
    float *red = sh_attn, *sc = sh_attn + 32;
    const int64_t t = blockIdx.x;
    const int h = blockIdx.y, tid = threadIdx.x;
    const int i = k3c_seq_of(sq.tok0, sq.n_seqs, t);
    const int64_t n = (int64_t)sq.pos[i] + (t - sq.tok0[i]) + 1; /* positions [0, p] */
    const int32_t *bt = sq.blocks + (int64_t)i * sq.max_blocks;
    const float *q = qc + (t * H + h) * W;
    const bool store = (n + K3C_ATTN_TILE - 1) / K3C_ATTN_TILE * K3C_ATTN_TILE <= keep;
    /* pass 1: scores (kept, or recomputed per tile) and the max */
    float m = -INFINITY;
    for (int64_t j0 = 0; j0 < n; j0 += K3C_ATTN_TILE) {
        float *st = store ? sc + j0 : sc;
        paged_tile(q, cache, bt, j0, n, W, scale, st);
        __syncthreads();
        if (j0 + tid < n) m = fmaxf(m, st[tid]);
        __syncthreads(); /* the next tile may overwrite st */
    }
    m = k3c_block_reduce(m, red, true);
    /* pass 2: Σ exp(s − m), each thread over its positions in order */
    float z = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += K3C_ATTN_TILE) {
        float *st = store ? sc + j0 : sc;
        if (!store) {
            paged_tile(q, cache, bt, j0, n, W, scale, st);
            __syncthreads();
        }
        if (j0 + tid < n) z += expf(st[tid] - m);
        if (!store) __syncthreads();
    }
    z = k3c_block_reduce(z, red, false);
    /* pass 3: p_j = exp(s_j − m) / z (written over the score), o[e] = Σ_j p_j·cache[j][e] */
    float acc[K3C_ATTN_ACC];
#pragma unroll
    for (int a = 0; a < K3C_ATTN_ACC; a++) acc[a] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += K3C_ATTN_TILE) {
        float *st = store ? sc + j0 : sc;
        if (!store) {
            paged_tile(q, cache, bt, j0, n, W, scale, st);
            __syncthreads();
        }
        if (j0 + tid < n) st[tid] = expf(st[tid] - m) / z;
        __syncthreads();
        const int64_t nj = n - j0 < K3C_ATTN_TILE ? n - j0 : K3C_ATTN_TILE;
        for (int64_t r = 0; r < nj; r++) {
            const float p = st[r], *row = cache + k3c_kv_row(bt, j0 + r) * W;
#pragma unroll
            for (int a = 0; a < K3C_ATTN_ACC; a++)
                if (tid + a * K3C_ATTN_TILE < Rkv)
                    acc[a] = fmaf(p, row[tid + a * K3C_ATTN_TILE], acc[a]);
        }
        __syncthreads(); /* before the next tile overwrites st */
    }
    float *o = o_lat + (t * H + h) * Rkv;
#pragma unroll
    for (int a = 0; a < K3C_ATTN_ACC; a++)
        if (tid + a * K3C_ATTN_TILE < Rkv) o[tid + a * K3C_ATTN_TILE] = acc[a];
}

static __global__ void kv_write_kernel(k3c_seqs sq, const float *src, int W, float *cache) {
    for (int64_t t = blockIdx.x; t < sq.T; t += gridDim.x) {
        const int i = k3c_seq_of(sq.tok0, sq.n_seqs, t);
        const int64_t p = (int64_t)sq.pos[i] + (t - sq.tok0[i]);
        float *dst = cache + k3c_kv_row(sq.blocks + (int64_t)i * sq.max_blocks, p) * W;
        for (int e = threadIdx.x; e < W; e += blockDim.x) dst[e] = src[t * W + e];
    }
}

extern "C" int k3c_attn_paged(cudaStream_t s, const k3c_seqs *sq, const float *qc,
                              const float *cache, int H, int W, int Rkv, float scale,
                              float *o_lat) {
    if (sq->T <= 0 || H <= 0 || Rkv <= 0) return 0;
    int64_t keep = (sq->max_ctx + K3C_ATTN_TILE - 1) / K3C_ATTN_TILE * K3C_ATTN_TILE;
    if (keep > K3C_ATTN_KEEP) keep = K3C_ATTN_KEEP;
    if (keep < K3C_ATTN_TILE) keep = K3C_ATTN_TILE;
    const size_t sh = (size_t)(32 + keep) * sizeof(float);
    dim3 grid((unsigned)sq->T, (unsigned)H);
    K3C_LAUNCH(grid, K3C_ATTN_TILE, sh, s, paged_kernel)
    (*sq, qc, cache, H, W, Rkv, scale, o_lat, keep);
    return (int)cudaGetLastError();
}

extern "C" int k3c_kv_write(cudaStream_t s, const k3c_seqs *sq, const float *src, int W,
                            float *cache) {
    if (sq->T <= 0 || W <= 0) return 0;
    const unsigned blocks = (unsigned)(sq->T > (1 << 20) ? (1 << 20) : sq->T);
    K3C_LAUNCH(blocks, 128, 0, s, kv_write_kernel)(*sq, src, W, cache);
    return (int)cudaGetLastError();
}
