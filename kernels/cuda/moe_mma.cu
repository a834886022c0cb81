// moe_mma.cu — the grouped MXFP4 expert GEMM (W4A16) on the tensor-core primitives of
// k3c_mma.cuh (issue 44): y = x · W_eᵀ per expert e, contiguous layout (the rows of expert e
// are x rows [off[e], off[e+1])), weights repacked at load time into mma B-fragment order
// (k3c_repack.h), so each lane's B fragments for a k32 step are one 32-bit load, dequantised with
// k3c_e2m1x8_to_bf16 (bit operations and one multiply by 2^126) and one multiply by the group's
// E8M0 scale (exact: a power of two), then two mma.m16n8k16 (bf16 in, fp32 accumulate).
// Activations, split (k3c_split_bf16): each block converts its 16-row tile of x, K3C_W4_KC columns
// at a time, into `terms` (1 .. K3C_SPLIT_MAX) bf16 planes in shared memory, x = Σ_i x_i + r with
// |r| <= 2^(-8·terms)·|x|; each plane's A fragments come through ldmatrix.x4 and meet the same
// dequantised B registers (the weights are loaded and decoded once per k step, `terms` mma per
// k16 step, one fp32 accumulator). MXFP4 weights are exact in bf16, so every product w·x_i is
// exact: with 3 terms the GEMM is fp32 W·x up to the order of the fp32 sums; with 1 it is the
// plain W4A16 (bf16(x)) GEMM. Decode is memory-bound, so the extra mma are free there; prefill pays
// `terms` x the tensor FLOPs (docs/DESIGN.md §3b: the measured fidelity of 1, 2, 3 terms).
// Block: K3C_W4_WARPS warps, warp w the n-tile (8 outputs) blockIdx.x · K3C_W4_WARPS + w; grid.y:
// 16-row tiles of the expert (max_rows sizes it; a block past the expert's rows exits whole);
// grid.z: the expert. Layouts: contiguous (per-expert row offsets) for prefill, masked (fixed
// capacity, per-expert counts in device memory, as for graph-captured decode). Gate/up fused: with
// W3, the same lane holds the same (row, column) of both accumulators, so the activation is the
// epilogue. Swap-AB when no expert has more than 8 rows (max_rows <= 8, w4a16_swap_kernel): the
// weights become the M = 16 operand from the same fragment-order words. Optional row maps
// (k3c_w4_rows): wslot (expert -> weight slot, < 0 absent), src_row (the gather of routed rows),
// dst_row (the scatter of results to slot rows). The backend's moe_experts for MXFP4 experts and
// the masked entry point of k3_cuda_moe.h (backend_cuda.c; docs/DESIGN.md §3b); k3c_moe_combine:
// the slot-order weighted sum of the masked layout's outputs.
//
// Verified in the emulation (tests/gpu/test_cuda_mma.cu) against the checkpoint's decode;
// device run pending.
#include "cuda_launch.h"
#include "k3c_mma.cuh"

#define K3C_W4_WARPS 4
#define K3C_W4_KC    256             /* k columns of x per shared tile */
#define K3C_W4_LD    (K3C_W4_KC + 8) /* row stride in bf16: 528 bytes, 16-aligned, bank-skewed */

/* one fragment word of 8 E2M1 codes and its E8M0 scale -> 4 bf16x2 (exact) */
static __device__ __forceinline__ void w4_dequant(uint32_t word, uint8_t sc, uint32_t b[4]) {
    k3c_e2m1x8_to_bf16(word, b);
    const uint32_t s1 = k3c_e8m0_to_bf16(sc), s2 = s1 | s1 << 16;
    for (int j = 0; j < 4; j++) b[j] = k3c_bf16x2_mul(b[j], s2);
}
/* acc += the 16 x 8 tile's product over one k32 group: A of one activation term, B (dequantised
 * once, w4_dequant) shared by the terms */
static __device__ __forceinline__ void w4_mma(float acc[4], const uint32_t a[2][4],
                                              const uint32_t b[4]) {
    k3c_mma_bf16_16816(acc, a[0], b, acc);
    k3c_mma_bf16_16816(acc, a[1], b + 2, acc);
}
/* swap-AB: W rows [16mt, 16mt + 16) over one k32 group as A fragments (dequantised once, shared by
 * the activation terms). The B-order words of n-tiles 2mt (rows g) and 2mt + 1 (rows g + 8) of the
 * same lane are exactly A's fragment: a[s][0..3] of step s = lo[2s], hi[2s], lo[2s + 1],
 * hi[2s + 1] */
static __device__ __forceinline__ void w4_swap_a(const uint32_t *words, const uint8_t *scales,
                                                 int64_t w0, int64_t w1, int64_t s0, int64_t s1,
                                                 bool has1, int64_t kt, unsigned lane,
                                                 uint32_t a[2][4]) {
    uint32_t lo[4], hi[4] = {0u, 0u, 0u, 0u};
    w4_dequant(words[w0 + kt * 32 + lane], scales[s0 + kt * 8 + (lane >> 2)], lo);
    if (has1) w4_dequant(words[w1 + kt * 32 + lane], scales[s1 + kt * 8 + (lane >> 2)], hi);
    for (int st = 0; st < 2; st++) {
        a[st][0] = lo[2 * st], a[st][1] = hi[2 * st];
        a[st][2] = lo[2 * st + 1], a[st][3] = hi[2 * st + 1];
    }
}
/* swap-AB: acc += W rows (A, w4_swap_a) times 8 token columns of one activation term (B) */
static __device__ __forceinline__ void w4_swap_mma(float acc[4], const uint32_t a[2][4],
                                                   const uint32_t b[2][2]) {
    for (int st = 0; st < 2; st++) k3c_mma_bf16_16816(acc, a[st], b[st], acc);
}

/* the rows [r0, r1) of expert e that block row tile `tile` of `rows_per` rows covers */
static __device__ __forceinline__ void w4_rows(const k3c_w4_rows &rows, int64_t e, int64_t tile,
                                               int64_t *r0, int64_t *r1) {
    if (rows.cap > 0) {
        const int64_t c = rows.count[e] < rows.cap ? rows.count[e] : rows.cap;
        *r0 = e * rows.cap + tile, *r1 = e * rows.cap + (c > 0 ? c : 0);
    } else {
        *r0 = rows.off[e] + tile, *r1 = rows.off[e + 1];
    }
}

/* the y row of GEMM row r */
static __device__ __forceinline__ int64_t w4_dst(const k3c_w4_rows &rows, int64_t r) {
    return rows.dst_row ? (int64_t)rows.dst_row[r] : r;
}

/* x rows [r0, r0 + nr) ∩ [r0, r1), columns [kc, kc + kn), split into `terms` bf16 planes of xs
 * (plane i at xs + i·nr·K3C_W4_LD; rows past r1: 0) */
static __device__ __forceinline__ void w4_fill(uint16_t *xs, int nr, int terms, const float *x,
                                               int64_t K, const int32_t *src_row, int64_t r0,
                                               int64_t r1, int64_t kc, int kn) {
    for (int i = (int)threadIdx.x; i < nr * kn; i += (int)blockDim.x) {
        const int r = i / kn, c = i % kn;
        const int64_t xr = src_row && r0 + r < r1 ? (int64_t)src_row[r0 + r] : r0 + r;
        const float v = r0 + r < r1 ? x[xr * K + kc + c] : 0.0f;
        uint16_t h[K3C_SPLIT_MAX];
        k3c_split_bf16(v, terms, h);
#pragma unroll
        for (int p = 0; p < K3C_SPLIT_MAX; p++)
            if (p < terms) xs[(p * nr + r) * K3C_W4_LD + c] = h[p];
    }
}

static __global__ void __launch_bounds__(K3C_W4_WARPS * 32)
    w4a16_grouped_kernel(const uint32_t *words, const uint8_t *scales, const uint32_t *words3,
                         const uint8_t *scales3, int64_t N, int64_t K, k3c_w4_rows rows, float beta,
                         float lin_beta, int terms, const float *x, float *y) {
    K3C_SHARED(uint16_t, xs, [K3C_SPLIT_MAX * 16 * K3C_W4_LD]);
    const int64_t e = blockIdx.z;
    int64_t r0, r1;
    w4_rows(rows, e, 16 * (int64_t)blockIdx.y, &r0, &r1);
    const int64_t ws = rows.wslot ? (int64_t)rows.wslot[e] : e;
    if (r0 >= r1 || ws < 0) return; /* the whole block: past this expert's rows, or no expert */
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3u;
    const int64_t NT = N / 8, KT = K / 32, nt = (int64_t)blockIdx.x * K3C_W4_WARPS + warp;
    const bool active = nt < NT;
    const int64_t w0 = (ws * NT + nt) * KT * 32, s0 = (ws * NT + nt) * KT * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc3[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t kc = 0; kc < K; kc += K3C_W4_KC) {
        const int kn = (int)(K - kc < K3C_W4_KC ? K - kc : K3C_W4_KC);
        __syncthreads(); /* the previous tile is consumed */
        w4_fill(xs, 16, terms, x, K, rows.src_row, r0, r1, kc, kn);
        __syncthreads();
        if (!active) continue;
        for (int kk = 0; kk < kn; kk += 32) {
            const int64_t kt = (kc + kk) / 32;
            uint32_t b[4], b3[4];
            w4_dequant(words[w0 + kt * 32 + lane], scales[s0 + kt * 8 + g], b);
            if (words3) w4_dequant(words3[w0 + kt * 32 + lane], scales3[s0 + kt * 8 + g], b3);
#pragma unroll
            for (int p = 0; p < K3C_SPLIT_MAX; p++) {
                if (p >= terms) break;
                uint32_t a[2][4];
                /* per k16 step, matrix lane / 8: rows 8·(m & 1) .. +7, columns 8·(m >> 1) */
                for (int step = 0; step < 2; step++)
                    k3c_ldmatrix_x4(a[step],
                                    xs + (p * 16 + (lane / 8 & 1u) * 8 + lane % 8) * K3C_W4_LD +
                                        kk + 16 * step + (lane / 16) * 8);
                w4_mma(acc, a, b);
                if (words3) w4_mma(acc3, a, b3);
            }
        }
    }
    if (!active) return;
    for (int i = 0; i < 4; i++) {
        const int64_t r = r0 + g + 8 * (i >> 1);
        if (r < r1)
            y[w4_dst(rows, r) * N + 8 * nt + 2 * t + (i & 1)] =
                words3 ? k3c_moe_act(acc[i], acc3[i], beta, lin_beta) : acc[i];
    }
}

/* swap-AB for experts of <= 8 rows: warp w computes W rows [16mt, 16mt + 16) (mt = blockIdx.x ·
 * K3C_W4_WARPS + w) for the block's 8 rows of x, so an expert with one token does not waste 15 of
 * 16 mma rows. D's c[i] is (W row 16mt + g + 8(i >> 1), x row 2t + (i & 1)). */
static __global__ void __launch_bounds__(K3C_W4_WARPS * 32)
    w4a16_swap_kernel(const uint32_t *words, const uint8_t *scales, const uint32_t *words3,
                      const uint8_t *scales3, int64_t N, int64_t K, k3c_w4_rows rows, float beta,
                      float lin_beta, int terms, const float *x, float *y) {
    K3C_SHARED(uint16_t, xs, [K3C_SPLIT_MAX * 8 * K3C_W4_LD]);
    const int64_t e = blockIdx.z;
    int64_t r0, r1;
    w4_rows(rows, e, 8 * (int64_t)blockIdx.y, &r0, &r1);
    const int64_t ws = rows.wslot ? (int64_t)rows.wslot[e] : e;
    if (r0 >= r1 || ws < 0) return; /* the whole block: past this expert's rows, or no expert */
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3u;
    const int64_t NT = N / 8, KT = K / 32, mt = (int64_t)blockIdx.x * K3C_W4_WARPS + warp;
    const bool active = 2 * mt < NT, has1 = 2 * mt + 1 < NT;
    const int64_t w0 = (ws * NT + 2 * mt) * KT * 32, w1 = w0 + KT * 32;
    const int64_t s0 = (ws * NT + 2 * mt) * KT * 8, s1 = s0 + KT * 8;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc3[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t kc = 0; kc < K; kc += K3C_W4_KC) {
        const int kn = (int)(K - kc < K3C_W4_KC ? K - kc : K3C_W4_KC);
        __syncthreads(); /* the previous tile is consumed */
        w4_fill(xs, 8, terms, x, K, rows.src_row, r0, r1, kc, kn);
        __syncthreads();
        if (!active) continue;
        for (int kk = 0; kk < kn; kk += 32) {
            const int64_t kt = (kc + kk) / 32;
            uint32_t a[2][4], a3[2][4];
            w4_swap_a(words, scales, w0, w1, s0, s1, has1, kt, lane, a);
            if (words3) w4_swap_a(words3, scales3, w0, w1, s0, s1, has1, kt, lane, a3);
#pragma unroll
            for (int p = 0; p < K3C_SPLIT_MAX; p++) {
                if (p >= terms) break;
                uint32_t b[2][2];
                /* B = x rowsᵀ: matrix lane / 8 (of lanes 0-15) is x rows 0-7, columns 8·(m & 1) */
                for (int st = 0; st < 2; st++)
                    k3c_ldmatrix_x2(b[st], xs + (p * 8 + lane % 8) * K3C_W4_LD + kk + 16 * st +
                                               (lane / 8 & 1u) * 8);
                w4_swap_mma(acc, a, b);
                if (words3) w4_swap_mma(acc3, a3, b);
            }
        }
    }
    if (!active) return;
    for (int i = 0; i < 4; i++) {
        const int64_t n = 16 * mt + g + 8 * (i >> 1), r = r0 + 2 * t + (i & 1);
        if (r < r1 && n < N)
            y[w4_dst(rows, r) * N + n] =
                words3 ? k3c_moe_act(acc[i], acc3[i], beta, lin_beta) : acc[i];
    }
}

extern "C" int k3c_w4a16_grouped(cudaStream_t s, const uint32_t *words, const uint8_t *scales,
                                 const uint32_t *words3, const uint8_t *scales3, int E, int64_t N,
                                 int64_t K, k3c_w4_rows rows, float beta, float lin_beta, int terms,
                                 const float *x, float *y) {
    static_assert(K3C_W4_MAX_TERMS == K3C_SPLIT_MAX, "the split helpers and the GEMM agree");
    if (terms < 1 || terms > K3C_SPLIT_MAX) return (int)cudaErrorInvalidValue;
    if (E <= 0 || rows.max_rows <= 0) return 0;
    if (rows.max_rows <= 8) { /* swap-AB: the weights are the M = 16 operand */
        const dim3 grid((unsigned)((N / 8 + 2 * K3C_W4_WARPS - 1) / (2 * K3C_W4_WARPS)), 1u,
                        (unsigned)E);
        K3C_LAUNCH(grid, K3C_W4_WARPS * 32, 0, s, w4a16_swap_kernel)
        (words, scales, words3, scales3, N, K, rows, beta, lin_beta, terms, x, y);
        return (int)cudaGetLastError();
    }
    const dim3 grid((unsigned)((N / 8 + K3C_W4_WARPS - 1) / K3C_W4_WARPS),
                    (unsigned)((rows.max_rows + 15) / 16), (unsigned)E);
    K3C_LAUNCH(grid, K3C_W4_WARPS * 32, 0, s, w4a16_grouped_kernel)
    (words, scales, words3, scales3, N, K, rows, beta, lin_beta, terms, x, y);
    return (int)cudaGetLastError();
}

/* one block per token, threads over the width, the K slots in order (k3c_wsum_step) */
static __global__ void moe_combine_kernel(const float *y, const int32_t *pos, const float *w,
                                          int64_t T, int K, int64_t width, float *out) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x)
        for (int64_t d = threadIdx.x; d < width; d += blockDim.x) {
            float a = 0.0f;
            bool first = true;
            for (int k = 0; k < K; k++) {
                const int64_t i = t * K + k;
                if (pos[i] < 0) continue;
                a = k3c_wsum_step(a, w, i, y[(int64_t)pos[i] * width + d], first);
                first = false;
            }
            out[t * width + d] = a;
        }
}

extern "C" int k3c_moe_combine(cudaStream_t s, const float *y, const int32_t *pos, const float *w,
                               int64_t T, int K, int64_t width, float *out) {
    if (T <= 0 || width <= 0) return 0;
    const unsigned blocks = (unsigned)(T > (1 << 20) ? (1 << 20) : T);
    K3C_LAUNCH(blocks, 256, 0, s, moe_combine_kernel)(y, pos, w, T, K, width, out);
    return (int)cudaGetLastError();
}

/* The device route of one tile (issue 45): one block. Pass 1 counts each expert's rows (a thread
 * per expert walks the items in order) and finds the first bad item (id out of range, or an
 * expert with no weight slot here); thread 0 then lays the experts out contiguously, each clamped
 * to cap rows, and records the first failure in the error word; pass 2 writes each expert's rows
 * in item order (stable: slot order within an expert). */
static __global__ void moe_route_kernel(const int32_t *ids, int64_t r0, int64_t n, int64_t n_all,
                                        int64_t row_div, const int32_t *row_of, int E,
                                        const int32_t *wslot, int64_t cap, int64_t *off,
                                        int32_t *src_row, int32_t *dst_row, int64_t dst0,
                                        unsigned long long *err) {
    K3C_SHARED(int64_t, first_bad, [256]);
    int64_t mine = n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int32_t e = ids[r0 + i];
        if ((e < 0 || e >= E || wslot[e] < 0) && i < mine) mine = i;
    }
    first_bad[threadIdx.x] = mine;
    for (int e = (int)threadIdx.x; e < E; e += (int)blockDim.x) {
        int64_t c = 0;
        for (int64_t i = 0; i < n; i++) c += ids[r0 + i] == e;
        off[e + 1] = c;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t bad = n, over = -1, over_n = 0;
        for (unsigned t = 0; t < blockDim.x; t++) bad = first_bad[t] < bad ? first_bad[t] : bad;
        off[0] = 0;
        for (int e = 0; e < E; e++) {
            const int64_t c = off[e + 1];
            if (c > cap && over < 0) over = e, over_n = c;
            off[e + 1] = off[e] + (c < cap ? c : cap);
        }
        unsigned long long key = ~0ull; /* the failure's key: the smallest wins across tiles */
        if (bad < n)
            key = (unsigned long long)(r0 + bad) << 32 | (uint32_t)ids[r0 + bad];
        else if (over >= 0)
            key = (unsigned long long)(n_all + over) << 32 | (uint32_t)over_n;
        if (key < *err) *err = key;
    }
    __syncthreads();
    for (int e = (int)threadIdx.x; e < E; e += (int)blockDim.x) {
        int64_t j = off[e];
        const int64_t end = off[e + 1];
        for (int64_t i = 0; i < n && j < end; i++)
            if (ids[r0 + i] == e) {
                src_row[j] = row_of ? row_of[r0 + i] : (int32_t)((r0 + i) / row_div);
                dst_row[j++] = (int32_t)(dst0 + i);
            }
    }
}

extern "C" int k3c_moe_route(cudaStream_t s, const int32_t *ids, int64_t r0, int64_t n,
                             int64_t n_all, int64_t row_div, const int32_t *row_of, int E,
                             const int32_t *wslot, int64_t cap, int64_t *off, int32_t *src_row,
                             int32_t *dst_row, int64_t dst0, unsigned long long *err) {
    if (n <= 0 || E <= 0) return 0;
    K3C_LAUNCH(1, 256, 0, s, moe_route_kernel)
    (ids, r0, n, n_all, row_div, row_of, E, wslot, cap, off, src_row, dst_row, dst0, err);
    return (int)cudaGetLastError();
}
