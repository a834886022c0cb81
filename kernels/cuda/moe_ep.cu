// moe_ep.cu — the device halves of the expert-parallel MoE dispatch (issue 45; docs/DESIGN.md
// §3a "dispatch layout"): the sender's pack into fixed-capacity per-(lane, expert) slabs and the
// receiver's map of the received slabs onto the masked grouped GEMM (moe_mma.cu). Nothing here
// reads back to the host: the counts stay in device memory (graph-capturable, fixed grids).
//
// Layout of one lane block (the unit the transport moves, blk_rows rows of Lw floats): hdr rows
// whose first EL int32 words are the per-expert counts, then EL slabs of cap rows (the lane's
// local experts in ascending global id), row j of slab q the sender's j-th item for that expert in
// (token, slot) order. The send buffer is L such blocks (one per destination lane), the receive
// buffer L blocks (one per source lane), and the return buffer has the receive buffer's layout.
#include "cuda_launch.h"
#include "cuda_math.cuh"

/* one block: pos[i] = the item's row in the send buffer (-1: not placed), the counts in each
 * block's header, the first failure in *err (min key, as k3c_moe_route) */
static __global__ void ep_route_kernel(const int32_t *ids, int64_t n, const int32_t *dest, int E,
                                       int L, int EL, int64_t cap, int64_t hdr, int64_t blk_rows,
                                       int64_t Lw, float *send, int32_t *pos,
                                       unsigned long long *err) {
    K3C_SHARED(int64_t, first_bad, [256]);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) pos[i] = -1;
    for (int64_t q = threadIdx.x; q < (int64_t)L * EL; q += blockDim.x)
        ((int32_t *)(send + (q / EL) * blk_rows * Lw))[q % EL] = 0;
    int64_t mine = n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int32_t e = ids[i];
        if ((e < 0 || e >= E || dest[e] < 0) && i < mine) mine = i;
    }
    first_bad[threadIdx.x] = mine;
    __syncthreads();
    for (int e = (int)threadIdx.x; e < E; e += (int)blockDim.x) {
        const int32_t q = dest[e];
        if (q < 0) continue;
        const int64_t base = (int64_t)(q / EL) * blk_rows + hdr + (int64_t)(q % EL) * cap;
        int64_t j = 0;
        for (int64_t i = 0; i < n; i++)
            if (ids[i] == e) {
                if (j < cap) pos[i] = (int32_t)(base + j);
                j++;
            }
        ((int32_t *)(send + (int64_t)(q / EL) * blk_rows * Lw))[q % EL] =
            (int32_t)(j < cap ? j : cap);
        if (j > cap) atomicMin(err, (unsigned long long)(n + e) << 32 | (uint32_t)j);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t bad = n;
        for (unsigned t = 0; t < blockDim.x; t++) bad = first_bad[t] < bad ? first_bad[t] : bad;
        if (bad < n) atomicMin(err, (unsigned long long)bad << 32 | (uint32_t)ids[bad]);
    }
}

/* block i: the item's source row (i / K of x) into its send row */
static __global__ void ep_copy_kernel(const float *x, int64_t n, int K, int64_t Lw,
                                      const int32_t *pos, float *send) {
    for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
        const int32_t p = pos[i];
        if (p < 0) continue;
        for (int64_t c = threadIdx.x; c < Lw; c += blockDim.x)
            send[(int64_t)p * Lw + c] = x[(i / K) * Lw + c];
    }
}

extern "C" int k3c_ep_pack(cudaStream_t s, const int32_t *ids, int64_t n, int K, const float *x,
                           int64_t Lw, const int32_t *dest, int E, int L, int EL, int64_t cap,
                           int64_t hdr, int64_t blk_rows, float *send, int32_t *pos,
                           unsigned long long *err) {
    K3C_LAUNCH(1, 256, 0, s, ep_route_kernel)
    (ids, n, dest, E, L, EL, cap, hdr, blk_rows, Lw, send, pos, err);
    int rc = (int)cudaGetLastError();
    if (rc || n <= 0) return rc;
    K3C_LAUNCH((unsigned)(n < 65535 ? n : 65535), 128, 0, s, ep_copy_kernel)
    (x, n, K, Lw, pos, send);
    return (int)cudaGetLastError();
}

/* one block: expert q of this lane takes the received rows of every source lane in lane order
 * (count clamped to [0, cap]) as its masked rows [q·C, q·C + cnt[q]), C = L·cap; src_row maps each
 * to its row in the receive buffer (the GEMM's gather, and the down GEMM's scatter into the
 * return buffer of the same layout); wslot[q] = the weight slot of global expert glob[q] */
static __global__ void ep_map_kernel(const float *recv, int L, int EL, int64_t cap, int64_t hdr,
                                     int64_t blk_rows, int64_t Lw, const int32_t *glob,
                                     const int32_t *slot, int32_t *cnt, int32_t *wslot,
                                     int32_t *src_row) {
    const int64_t C = (int64_t)L * cap;
    for (int q = (int)threadIdx.x; q < EL; q += (int)blockDim.x) {
        int64_t tot = 0;
        for (int l = 0; l < L; l++) {
            int64_t c = ((const int32_t *)(recv + (int64_t)l * blk_rows * Lw))[q];
            c = c < 0 ? 0 : c > cap ? cap : c;
            for (int64_t j = 0; j < c; j++)
                src_row[q * C + tot + j] = (int32_t)(l * blk_rows + hdr + q * cap + j);
            tot += c;
        }
        cnt[q] = (int32_t)tot;
        wslot[q] = glob[q] >= 0 ? slot[glob[q]] : -1;
    }
}

extern "C" int k3c_ep_map(cudaStream_t s, const float *recv, int L, int EL, int64_t cap,
                          int64_t hdr, int64_t blk_rows, int64_t Lw, const int32_t *glob,
                          const int32_t *slot, int32_t *cnt, int32_t *wslot, int32_t *src_row) {
    K3C_LAUNCH(1, 128, 0, s, ep_map_kernel)
    (recv, L, EL, cap, hdr, blk_rows, Lw, glob, slot, cnt, wslot, src_row);
    return (int)cudaGetLastError();
}
