// test_cuda_emu.cu — the CUDA emulation's own semantics (issue 28; label gpuemu): small kernels,
// each checked against values computed on the host, for what kernels/cuda relies on: the index
// built-ins of 3-D grids and blocks, __syncthreads and its _or/_and/_count forms (and that a
// missing barrier shows up as NaN poison), the warp primitives with widths, edges and a partial
// mask, per-block static and dynamic shared memory, atomics, the errors a broken kernel must
// produce instead of a hang, and the runtime API (allocation, copies, memsets, streams, events,
// device count). Under ASan (-DK3_SANITIZE=ON) death tests re-run this program with
// `--oob global|shared|shared-index` and expect the child to die with a sanitizer report.
//
// The kernels use the shared dialect (K3C_SHARED / K3C_DYN_SHARED / K3C_LAUNCH from
// cuda_math.cuh), so nvcc can compile the file for a device; what only the emulation defines
// (NaN poison in shared memory, reported barrier errors, K3_EMU_DEVICES, the counters, the
// death tests) is checked only under K3_CUDA_EMULATION. Not covered here: the kernels of
// kernels/cuda themselves (test_cuda_ops) and the NCCL stand-in (test_comm_nccl).
// Also: warp collectives on divergent paths (disjoint masks in one warp), shared memory declared
// in a helper called twice (one array, as on the device), a negative source lane.
#include "cuda_math.cuh"

#include <algorithm>
#include <limits.h>
#include <math.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#ifdef K3_CUDA_EMULATION
static const bool k_emu = true;
#else
static const bool k_emu = false;
#endif
#if defined(__SANITIZE_ADDRESS__)
#define TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TEST_ASAN 1
#endif
#endif
#ifdef TEST_ASAN
static const bool k_asan = true;
#else
static const bool k_asan = false;
#endif

extern char **environ;

/* ---- harness: FAIL lines, one summary line, the exit code -------------------------------------
 */
static int g_pass, g_fail;
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (cond) {                                                                                \
            g_pass++;                                                                              \
        } else {                                                                                   \
            g_fail++;                                                                              \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                        \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, "\n");                                                                 \
        }                                                                                          \
    } while (0)
#define CUDA_OK(expr)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        CHECK(e_ == cudaSuccess, "%s -> %s", #expr, cudaGetErrorName(e_));                         \
    } while (0)

static const unsigned FULL = 0xffffffffu, EVEN = 0x55555555u;
static const uint64_t k_seed = 20260528;
static uint64_t g_rng = k_seed;
static uint64_t rnd(void) { /* xorshift64* */
    g_rng ^= g_rng >> 12, g_rng ^= g_rng << 25, g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}

/* a device buffer of n T, poisoned with 0xff bytes unless told otherwise */
template <class T> struct dbuf {
    T *d = nullptr;
    size_t n;
    explicit dbuf(size_t n_, int byte = 0xff) : n(n_) {
        CUDA_OK(cudaMalloc((void **)&d, n * sizeof(T)));
        CUDA_OK(cudaMemset(d, byte, n * sizeof(T)));
    }
    dbuf(const dbuf &) = delete;
    dbuf &operator=(const dbuf &) = delete;
    ~dbuf() {
        cudaFree(d);
    }
    void put(const std::vector<T> &h) {
        CUDA_OK(cudaMemcpy(d, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    std::vector<T> get() const {
        std::vector<T> h(n);
        CUDA_OK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
};

/* the launch's error, after a synchronize, and that it was consumed (the next call is clean) */
static cudaError_t launch_error(void) {
    cudaDeviceSynchronize();
    cudaError_t e = cudaGetLastError();
    CHECK(cudaGetLastError() == cudaSuccess, "the error of a launch is returned once");
    return e;
}

/* runs f with stderr captured; returns what it printed (and echoes it, marked as expected) */
#include "k3emu_stderr.h"

template <class F> static std::string captured_stderr(F f) {
    bool ok;
    std::string s = k3emu_captured_stderr(f, &ok);
    CHECK(ok, "cannot capture stderr");
    return s;
}

/* p[i] = v + i for i < n (n = 0: a launch that touches nothing) */
static __global__ void fill_kernel(unsigned *p, unsigned n, unsigned v) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v + i;
}

/* ---- 1. indexing ------------------------------------------------------------------------------
 */
/* every thread counts its linear id once and writes its block / thread index and the dims */
static __global__ void index_kernel(unsigned *hits, unsigned *where) {
    const unsigned nb = blockDim.x * blockDim.y * blockDim.z;
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned id = b * nb + t;
    atomicAdd(&hits[id], 1u);
    unsigned *w = where + (size_t)id * 12;
    w[0] = blockIdx.x, w[1] = blockIdx.y, w[2] = blockIdx.z;
    w[3] = threadIdx.x, w[4] = threadIdx.y, w[5] = threadIdx.z;
    w[6] = gridDim.x, w[7] = gridDim.y, w[8] = gridDim.z;
    w[9] = blockDim.x, w[10] = blockDim.y, w[11] = blockDim.z;
}

static void test_indexing(dim3 g, dim3 b) {
    const unsigned nb = b.x * b.y * b.z, n = g.x * g.y * g.z * nb;
    dbuf<unsigned> hits(n, 0), where((size_t)n * 12);
#ifdef K3_CUDA_EMULATION
    k3emu_counters c0, c1;
    k3emu_get_counters(&c0);
#endif
    K3C_LAUNCH(g, b, 0, 0, index_kernel)(hits.d, where.d);
    CHECK(launch_error() == cudaSuccess, "index_kernel");
    std::vector<unsigned> h = hits.get(), w = where.get();
    int bad_hits = 0, bad_where = 0;
    for (unsigned id = 0; id < n; id++) {
        bad_hits += h[id] != 1;
        const unsigned t = id % nb, bl = id / nb;
        const unsigned want[12] = {bl % g.x,
                                   bl / g.x % g.y,
                                   bl / (g.x * g.y),
                                   t % b.x,
                                   t / b.x % b.y,
                                   t / (b.x * b.y),
                                   g.x,
                                   g.y,
                                   g.z,
                                   b.x,
                                   b.y,
                                   b.z};
        bad_where += memcmp(&w[(size_t)id * 12], want, sizeof want) != 0;
    }
    CHECK(bad_hits == 0, "grid (%u,%u,%u) block (%u,%u,%u): %d of %u ids not written exactly once",
          g.x, g.y, g.z, b.x, b.y, b.z, bad_hits, n);
    CHECK(bad_where == 0, "grid (%u,%u,%u) block (%u,%u,%u): %d of %u threads saw wrong indices",
          g.x, g.y, g.z, b.x, b.y, b.z, bad_where, n);
#ifdef K3_CUDA_EMULATION
    k3emu_get_counters(&c1);
    CHECK(c1.launches == c0.launches + 1 && c1.blocks == c0.blocks + g.x * g.y * g.z &&
              c1.threads == c0.threads + n,
          "counters: +%llu launches, +%llu blocks, +%llu threads", c1.launches - c0.launches,
          c1.blocks - c0.blocks, c1.threads - c0.threads);
#endif
}

/* ---- 2. __syncthreads -------------------------------------------------------------------------
 */
/* out = in reversed within each block, through shared memory; barrier = 0 leaves the barrier out */
static __global__ void reverse_kernel(const float *in, float *out, int barrier) {
    K3C_SHARED(float, s, [1024]);
    const unsigned t = threadIdx.x, n = blockDim.x;
    const size_t base = (size_t)blockIdx.x * n;
    s[t] = in[base + t];
    if (barrier) __syncthreads();
    out[base + t] = s[n - 1 - t];
}

/* runs reverse_kernel on `blocks` blocks of n threads; returns the bad element count, -1 on a
 * launch error; *n_nan: elements that came out NaN */
static int run_reverse(unsigned blocks, unsigned n, int barrier, int *n_nan) {
    std::vector<float> in((size_t)blocks * n);
    for (float &v : in) v = (float)(int)(rnd() % 2001) - 1000.0f;
    dbuf<float> din(in.size()), dout(in.size());
    din.put(in);
    K3C_LAUNCH(blocks, n, 0, 0, reverse_kernel)(din.d, dout.d, barrier);
    if (launch_error() != cudaSuccess) return -1;
    std::vector<float> out = dout.get();
    int bad = 0;
    *n_nan = 0;
    for (unsigned b = 0; b < blocks; b++)
        for (unsigned t = 0; t < n; t++) {
            const float got = out[(size_t)b * n + t], want = in[(size_t)b * n + n - 1 - t];
            bad += !(got == want);
            *n_nan += isnan(got) != 0;
        }
    return bad;
}

/* per thread: count / or / and of p = (t % 3 == 0 ? 7 : 0), and of an all-true and an all-false
 * predicate, and a count that differs between the blocks */
static __global__ void sync_vote_kernel(int *out) {
    const int t = (int)threadIdx.x;
    const int p = t % 3 == 0 ? 7 : 0; /* any non-zero value is true */
    int *o = out + ((size_t)blockIdx.x * blockDim.x + t) * 6;
    o[0] = __syncthreads_count(p);
    o[1] = __syncthreads_or(p);
    o[2] = __syncthreads_and(p);
    o[3] = __syncthreads_and(t + 5);
    o[4] = __syncthreads_or(0);
    o[5] = __syncthreads_count(blockIdx.x == 1 && t >= 90);
}

static void test_syncthreads(void) {
    int n_nan = 0;
    int bad = run_reverse(3, 256, 1, &n_nan);
    CHECK(bad == 0, "reverse through shared memory with __syncthreads: %d of 768 wrong", bad);
    bad = run_reverse(2, 1024, 1, &n_nan);
    CHECK(bad == 0, "reverse, blocks of 1024: %d of 2048 wrong", bad);
    if (k_emu) { /* threads run in order: the first half reads slots not yet written */
        bad = run_reverse(3, 256, 0, &n_nan);
        CHECK(bad == 384 && n_nan == 384,
              "reverse without the barrier: %d wrong, %d NaN (want 384 NaN of 768)", bad, n_nan);
    }
    const unsigned nt = 100; /* not a multiple of 32: a partial warp */
    dbuf<int> out((size_t)2 * nt * 6);
    K3C_LAUNCH(2, nt, 0, 0, sync_vote_kernel)(out.d);
    CHECK(launch_error() == cudaSuccess, "sync_vote_kernel");
    std::vector<int> o = out.get();
    int n_true = 0;
    for (unsigned t = 0; t < nt; t++) n_true += t % 3 == 0;
    int wrong = 0;
    for (unsigned b = 0; b < 2; b++)
        for (unsigned t = 0; t < nt; t++) {
            const int want[6] = {n_true, 1, 0, 1, 0, b == 1 ? 10 : 0};
            wrong += memcmp(&o[((size_t)b * nt + t) * 6], want, sizeof want) != 0;
        }
    CHECK(wrong == 0, "__syncthreads_count/_or/_and: %d of %u threads got a wrong result", wrong,
          2 * nt);
}

/* ---- 3. warp primitives -----------------------------------------------------------------------
 */
enum { W_OUT = 17 };
/* block (16, 4): lanes are the linear thread index mod 32, two warps */
static __global__ void warp_kernel(const int *in, int *out, float *outf, double *outd) {
    const unsigned lin = threadIdx.x + blockDim.x * threadIdx.y, lane = lin & 31;
    const int v = in[lin];
    int *o = out + (size_t)lin * W_OUT;
    __syncwarp();
    int s = v;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(FULL, s, off);
    o[0] = s;
    o[1] = __shfl_sync(FULL, v, 5);
    o[2] = __shfl_sync(FULL, v, 3, 8);
    o[3] = __shfl_sync(FULL, v, 17, 16); /* src lane 17 mod width 16 = 1 */
    o[4] = __shfl_up_sync(FULL, v, 3);
    o[5] = __shfl_up_sync(FULL, v, 2, 8);
    o[6] = __shfl_down_sync(FULL, v, 5);
    o[7] = __shfl_down_sync(FULL, v, 3, 16);
    o[8] = __shfl_xor_sync(FULL, v, 4, 8);
    o[9] = __shfl_xor_sync(FULL, v, 8, 8); /* a later segment: own value; an earlier one: its */
    o[10] = (int)__ballot_sync(FULL, v & 1);
    o[11] = __any_sync(FULL, lane == 7); /* one collective per statement: a fixed order */
    o[11] |= __any_sync(FULL, 0) << 1;
    o[11] |= __all_sync(FULL, 1) << 2;
    o[11] |= __all_sync(FULL, lane != 7) << 3;
    float f = (float)v * 0.25f; /* quarters of small integers: every partial sum is exact */
    for (int off = 1; off < 32; off <<= 1) f += __shfl_xor_sync(FULL, f, off);
    outf[lin] = f;
    outd[lin] = __shfl_down_sync(FULL, (double)v * 0.5 + 1e12, 1); /* 8-byte values */
    if (lane % 2 == 0) { /* only the even lanes, with their mask */
        __syncwarp(EVEN);
        o[12] = __shfl_sync(EVEN, v, 4);
        o[13] = (int)__ballot_sync(EVEN, lane % 4 == 0);
        int e = v;
        for (int off = 2; off < 32; off <<= 1) e += __shfl_xor_sync(EVEN, e, off);
        o[14] = e;
        o[15] = __all_sync(EVEN, 1);
        o[15] |= __any_sync(EVEN, lane % 2) << 1;
        o[16] = __shfl_down_sync(EVEN, v, 2); /* lane 30: lane 32 is outside, own value */
    } else {
        for (int k = 12; k < W_OUT; k++) o[k] = -1;
    }
}

/* the CUDA definitions (programming guide, warp shuffle functions), written out for the host */
static int shfl_idx(const int *w, int lane, int src, int width) {
    return w[lane / width * width + ((src % width) + width) % width];
}
static int shfl_up(const int *w, int lane, int d, int width) {
    return lane % width - d < 0 ? w[lane] : w[lane - d];
}
static int shfl_down(const int *w, int lane, int d, int width) {
    return lane % width + d >= width ? w[lane] : w[lane + d];
}
static int shfl_xor(const int *w, int lane, int m, int width) {
    const int src = lane ^ m;
    return src >= lane / width * width + width ? w[lane] : w[src];
}

static void test_warp(void) {
    const dim3 blk(16, 4);
    const int n = 64;
    std::vector<int> in(n);
    for (int &v : in) v = (int)(rnd() % 100000);
    dbuf<int> din(n), dout((size_t)n * W_OUT);
    dbuf<float> df(n);
    dbuf<double> dd(n);
    din.put(in);
    K3C_LAUNCH(1, blk, 0, 0, warp_kernel)(din.d, dout.d, df.d, dd.d);
    CHECK(launch_error() == cudaSuccess, "warp_kernel");
    std::vector<int> o = dout.get();
    std::vector<float> of = df.get();
    std::vector<double> od = dd.get();
    const char *what[W_OUT] = {"xor butterfly sum",
                               "shfl 5",
                               "shfl 3 width 8",
                               "shfl 17 width 16",
                               "up 3",
                               "up 2 width 8",
                               "down 5",
                               "down 3 width 16",
                               "xor 4 width 8",
                               "xor 8 width 8",
                               "ballot",
                               "any/all",
                               "even: shfl 4",
                               "even: ballot",
                               "even: xor sum",
                               "even: all/any",
                               "even: down 2"};
    int bad[W_OUT] = {0}, bad_f = 0, bad_d = 0;
    for (int wp = 0; wp < 2; wp++) {
        const int *w = &in[wp * 32];
        int sum = 0, even_sum = 0;
        unsigned ballot = 0;
        float fsum = 0;
        for (int l = 0; l < 32; l++) {
            sum += w[l], fsum += (float)w[l] * 0.25f;
            even_sum += l % 2 == 0 ? w[l] : 0;
            ballot |= (unsigned)(w[l] & 1) << l;
        }
        for (int l = 0; l < 32; l++) {
            const bool ev = l % 2 == 0;
            const int want[W_OUT] = {sum,
                                     shfl_idx(w, l, 5, 32),
                                     shfl_idx(w, l, 3, 8),
                                     shfl_idx(w, l, 17, 16),
                                     shfl_up(w, l, 3, 32),
                                     shfl_up(w, l, 2, 8),
                                     shfl_down(w, l, 5, 32),
                                     shfl_down(w, l, 3, 16),
                                     shfl_xor(w, l, 4, 8),
                                     shfl_xor(w, l, 8, 8),
                                     (int)ballot,
                                     1 | 4,
                                     ev ? w[4] : -1,
                                     ev ? 0x11111111 : -1,
                                     ev ? even_sum : -1,
                                     ev ? 1 : -1,
                                     ev ? (l + 2 < 32 ? w[l + 2] : w[l]) : -1};
            for (int k = 0; k < W_OUT; k++)
                bad[k] += o[(size_t)(wp * 32 + l) * W_OUT + k] != want[k];
            bad_f += of[wp * 32 + l] != fsum;
            bad_d += od[wp * 32 + l] != (double)shfl_down(w, l, 1, 32) * 0.5 + 1e12;
        }
    }
    for (int k = 0; k < W_OUT; k++)
        CHECK(bad[k] == 0, "warp primitive %s: %d of 64 lanes wrong", what[k], bad[k]);
    CHECK(bad_f == 0, "float xor butterfly: %d of 64 lanes wrong", bad_f);
    CHECK(bad_d == 0, "double shfl_down: %d of 64 lanes wrong", bad_d);
}

/* ---- divergent warps, a shared declaration met twice, a negative source lane ---------------- */
static __device__ unsigned keep_cell(unsigned v, int write) {
    K3C_SHARED(unsigned, cell, [1]); /* one array per block, however often the helper runs */
    if (write && threadIdx.x == 0) cell[0] = v;
    __syncthreads();
    const unsigned r = cell[0];
    __syncthreads();
    return r;
}
/* the even lanes one collective ahead of the odd ones, then a full-warp xor */
static __global__ void gap_ahead_kernel(const int *in, int *out) {
    const unsigned lane = threadIdx.x & 31;
    int v = in[lane];
    if (lane % 2 == 0) v = __shfl_sync(EVEN, v, 0);
    out[lane] = __shfl_xor_sync(FULL, v, 1);
}
/* two disjoint halves of a warp, each with its own mask, at the same time */
static __global__ void gap_halves_kernel(const int *in, int *out) {
    const unsigned lane = threadIdx.x & 31;
    int h = in[lane];
    if (lane < 16)
        h += __shfl_xor_sync(0x0000ffffu, h, 1);
    else
        h += __shfl_xor_sync(0xffff0000u, h, 2);
    out[lane] = h;
}
static __global__ void gap_negsrc_kernel(const int *in, int *out) {
    out[threadIdx.x] = __shfl_sync(FULL, in[threadIdx.x], -1, 8); /* src -1 mod 8 = 7 */
}
static __global__ void gap_helper_kernel(const int *in, int *out) {
    keep_cell((unsigned)in[0], 1);
    out[threadIdx.x] = (int)keep_cell(0, 0);
}
static void run_gap(const char *what, void (*kernel)(const int *, int *),
                    const std::vector<int> &in, int (*want)(const std::vector<int> &, int)) {
    dbuf<int> din(32), dout(32);
    din.put(in);
    K3C_LAUNCH(1, 32, 0, 0, kernel)(din.d, dout.d);
    const cudaError_t e = launch_error();
    std::vector<int> o = dout.get();
    int bad = 0;
    for (int l = 0; l < 32; l++) bad += o[l] != want(in, l);
    CHECK(e == cudaSuccess && bad == 0, "%s: %s, %d of 32 lanes wrong", what, cudaGetErrorName(e),
          bad);
}
static void test_gaps(void) {
    std::vector<int> in(32);
    for (int &v : in) v = (int)(rnd() % 100000);
    run_gap("even lanes a collective ahead, then a full-warp xor", gap_ahead_kernel, in,
            [](const std::vector<int> &w, int l) { return l % 2 ? w[0] : w[l + 1]; });
    run_gap("two disjoint masks at once", gap_halves_kernel, in,
            [](const std::vector<int> &w, int l) { return w[l] + w[l < 16 ? l ^ 1 : l ^ 2]; });
    run_gap("negative source lane", gap_negsrc_kernel, in,
            [](const std::vector<int> &w, int l) { return w[l / 8 * 8 + 7]; });
    run_gap("shared array of a helper called twice", gap_helper_kernel, in,
            [](const std::vector<int> &w, int) { return w[0]; });
}

/* ---- 4. shared memory -------------------------------------------------------------------------
 */
/* each thread reads a, b, d before anyone writes (after a barrier), writes its block's values,
 * and reads another thread's after a barrier; thread 0 reports whether the arrays overlap */
static __global__ void shared_kernel(unsigned *before, unsigned *after, int *overlap) {
    K3C_SHARED(unsigned, a, [64]);
    K3C_SHARED(unsigned, b, [64]);
    K3C_DYN_SHARED(unsigned, d);
    const unsigned t = threadIdx.x, n = blockDim.x, blk = blockIdx.x;
    const size_t i = ((size_t)blk * n + t) * 3;
    before[i] = a[t], before[i + 1] = b[t], before[i + 2] = d[t];
    __syncthreads();
    a[t] = blk * 1000 + t, b[t] = blk * 1000 + 300 + t, d[t] = blk * 1000 + 600 + t;
    __syncthreads();
    after[i] = a[n - 1 - t], after[i + 1] = b[n - 1 - t], after[i + 2] = d[n - 1 - t];
    if (t == 0) {
        const uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b, pd = (uintptr_t)d, sz = 64 * 4;
        overlap[blk] = (pa < pb + sz && pb < pa + sz) || (pa < pd + sz && pd < pa + sz) ||
                       (pb < pd + sz && pd < pb + sz);
    }
}

/* the whole 48 KiB of dynamic shared memory, reversed */
static __global__ void big_dyn_kernel(unsigned *out, unsigned n_words) {
    K3C_DYN_SHARED(unsigned, d);
    for (unsigned i = threadIdx.x; i < n_words; i += blockDim.x) d[i] = i;
    __syncthreads();
    for (unsigned i = threadIdx.x; i < n_words; i += blockDim.x) out[i] = d[n_words - 1 - i];
}

/* 16 KiB static shared: with 40 KiB dynamic the block asks for more than 48 KiB */
static __global__ void static16k_kernel(float *out) {
    K3C_SHARED(float, big, [4096]);
    big[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = big[threadIdx.x];
}

static void test_shared(void) {
    const unsigned blocks = 4, n = 64;
    dbuf<unsigned> before((size_t)blocks * n * 3), after((size_t)blocks * n * 3);
    dbuf<int> overlap(blocks);
    K3C_LAUNCH(blocks, n, n * sizeof(unsigned), 0, shared_kernel)(before.d, after.d, overlap.d);
    CHECK(launch_error() == cudaSuccess, "shared_kernel");
    std::vector<unsigned> hb = before.get(), ha = after.get();
    std::vector<int> ho = overlap.get();
    int bad_after = 0, bad_before = 0, bad_overlap = 0;
    for (unsigned b = 0; b < blocks; b++) {
        bad_overlap += ho[b] != 0;
        for (unsigned t = 0; t < n; t++) {
            const size_t i = ((size_t)b * n + t) * 3;
            const unsigned r = n - 1 - t;
            bad_after += ha[i] != b * 1000 + r || ha[i + 1] != b * 1000 + 300 + r ||
                         ha[i + 2] != b * 1000 + 600 + r;
            bad_before +=
                hb[i] != 0xffffffffu || hb[i + 1] != 0xffffffffu || hb[i + 2] != 0xffffffffu;
        }
    }
    CHECK(bad_after == 0, "static + dynamic shared per block: %d of %u threads read wrong values",
          bad_after, blocks * n);
    CHECK(bad_overlap == 0, "two K3C_SHARED arrays and the dynamic one overlap in %d blocks",
          bad_overlap);
    if (k_emu) /* every block, not only the first, starts from the 0xff poison */
        CHECK(bad_before == 0, "shared memory at block start: %d of %u threads saw no poison",
              bad_before, blocks * n);

    const unsigned words = 48 * 1024 / 4;
    dbuf<unsigned> big(words);
    K3C_LAUNCH(1, 256, words * 4, 0, big_dyn_kernel)(big.d, words);
    CHECK(launch_error() == cudaSuccess, "48 KiB of dynamic shared memory is allowed");
    std::vector<unsigned> hbig = big.get();
    int bad = 0;
    for (unsigned i = 0; i < words; i++) bad += hbig[i] != words - 1 - i;
    CHECK(bad == 0, "48 KiB dynamic shared: %d of %u words wrong", bad, words);

    dbuf<float> out(1024);
    cudaError_t e = cudaSuccess;
    captured_stderr([&] {
        K3C_LAUNCH(1, 1024, 40 * 1024, 0, static16k_kernel)(out.d);
        e = launch_error();
    });
    CHECK(e != cudaSuccess, "16 KiB static + 40 KiB dynamic shared launched (%s)",
          cudaGetErrorName(e));
}

/* ---- 5. atomics -------------------------------------------------------------------------------
 */
static __global__ void count_kernel(unsigned *ctr, unsigned *olds, float *fsum,
                                    unsigned long long *lsum, unsigned *ghist) {
    K3C_SHARED(unsigned, hist, [8]);
    const unsigned t = threadIdx.x, gid = blockIdx.x * blockDim.x + t;
    if (t < 8) hist[t] = 0;
    __syncthreads();
    olds[gid] = atomicAdd(ctr, 1u);
    atomicAdd(fsum, 0.5f);
    atomicAdd(lsum, 1ull << 33);
    atomicAdd(&hist[t % 8], 1u); /* shared-memory atomics */
    __syncthreads();
    if (t < 8) atomicAdd(&ghist[t], hist[t]);
}

/* res: min, max, CAS target, exchange target; old: (n, 4) the values the atomics returned */
template <class T> static __global__ void minmax_kernel(const T *v, T *res, T *old, T cas_from) {
    const unsigned gid = blockIdx.x * blockDim.x + threadIdx.x;
    const T x = v[gid];
    old[gid * 4 + 0] = atomicMin(&res[0], x);
    old[gid * 4 + 1] = atomicMax(&res[1], x);
    old[gid * 4 + 2] = atomicCAS(&res[2], cas_from, x);
    old[gid * 4 + 3] = atomicExch(&res[3], x);
}

/* values in (lo, hi) exclusive, so the initial values below cannot occur */
template <class T> static void test_minmax(const char *name, T lo, T hi, T cas_from, T exch0) {
    const unsigned blocks = 5, nt = 64, n = blocks * nt;
    std::vector<T> v(n);
    const uint64_t span = (uint64_t)(hi - lo) - 1;
    for (T &x : v) x = (T)(lo + 1 + (T)(rnd() % span));
    dbuf<T> dv(n), dres(4), dold((size_t)n * 4);
    dv.put(v);
    dres.put(std::vector<T>{hi, lo, cas_from, exch0});
    K3C_LAUNCH(blocks, nt, 0, 0, minmax_kernel<T>)(dv.d, dres.d, dold.d, cas_from);
    CHECK(launch_error() == cudaSuccess, "minmax_kernel<%s>", name);
    std::vector<T> res = dres.get(), old = dold.get();
    const T mn = *std::min_element(v.begin(), v.end()), mx = *std::max_element(v.begin(), v.end());
    CHECK(res[0] == mn && res[1] == mx, "atomicMin/Max<%s>: wrong final values", name);
    int first_min = 0, first_max = 0, cas_won = 0, cas_bad = 0, min_bad = 0;
    std::vector<T> ex{exch0}, seen{res[3]};
    for (unsigned i = 0; i < n; i++) {
        first_min += old[i * 4] == hi, first_max += old[i * 4 + 1] == lo;
        min_bad += old[i * 4] < mn || old[i * 4 + 1] > mx;
        if (old[i * 4 + 2] == cas_from)
            cas_won++, cas_bad += res[2] != v[i];
        else
            cas_bad += old[i * 4 + 2] != res[2];
        ex.push_back(v[i]), seen.push_back(old[i * 4 + 3]);
    }
    CHECK(first_min == 1 && first_max == 1 && min_bad == 0,
          "atomicMin/Max<%s>: %d / %d threads saw the initial value, %d olds out of range", name,
          first_min, first_max, min_bad);
    CHECK(cas_won == 1 && cas_bad == 0, "atomicCAS<%s>: %d winners, %d inconsistent", name, cas_won,
          cas_bad);
    std::sort(ex.begin(), ex.end()), std::sort(seen.begin(), seen.end());
    CHECK(ex == seen, "atomicExch<%s>: the olds and the final value are not the values exchanged",
          name);
}

static void test_atomics(void) {
    const unsigned blocks = 7, nt = 96, n = blocks * nt;
    dbuf<unsigned> ctr(1, 0), olds(n), ghist(8, 0);
    dbuf<float> fsum(1, 0);
    dbuf<unsigned long long> lsum(1, 0);
    K3C_LAUNCH(blocks, nt, 0, 0, count_kernel)(ctr.d, olds.d, fsum.d, lsum.d, ghist.d);
    CHECK(launch_error() == cudaSuccess, "count_kernel");
    std::vector<unsigned> o = olds.get(), hist = ghist.get();
    const unsigned c = ctr.get()[0];
    CHECK(c == n, "atomicAdd count %u, want %u", c, n);
    std::sort(o.begin(), o.end());
    int bad = 0;
    for (unsigned i = 0; i < n; i++) bad += o[i] != i;
    CHECK(bad == 0, "atomicAdd olds are not a permutation of 0..%u (%d wrong)", n - 1, bad);
    const float fs = fsum.get()[0];
    CHECK(fs == 0.5f * (float)n, "atomicAdd(float): %g, want %g", (double)fs, 0.5 * n);
    const unsigned long long ls = lsum.get()[0];
    CHECK(ls == (unsigned long long)n << 33, "atomicAdd(unsigned long long): %llu", ls);
    bad = 0;
    for (unsigned k = 0; k < 8; k++) bad += hist[k] != blocks * nt / 8;
    CHECK(bad == 0, "shared-memory atomicAdd histogram: %d of 8 bins wrong", bad);
    test_minmax<int>("int", -1000000000, 1000000000, INT_MIN, INT_MIN + 1);
    test_minmax<unsigned>("unsigned", 0u, 4000000000u, 4000000001u, 4000000002u);
    test_minmax<unsigned long long>("unsigned long long", 1ull << 40, 1ull << 62, 7ull, 9ull);
}

/* ---- 6. errors are reported, not hung (emulation: the device would hang or be undefined) ------
 */
static __global__ void early_return_kernel(int *out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
static __global__ void half_barrier_kernel(int *out) {
    if (threadIdx.x < 32) __syncthreads();
    out[threadIdx.x] = 1;
}
static __global__ void mixed_deadlock_kernel(int *out) {
    if (threadIdx.x < 16)
        __syncthreads();
    else
        out[threadIdx.x] = __shfl_sync(FULL, (int)threadIdx.x, 0);
}
static __global__ void exited_lane_kernel(int *out) {
    if ((threadIdx.x & 31) == 31) return;
    out[threadIdx.x] = __shfl_sync(FULL, (int)threadIdx.x, 0);
}
static __global__ void one_block_kernel(int *out) {
    if (blockIdx.x == 2 && blockIdx.y == 1 && threadIdx.x == 5) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

/* a good launch right after an error works */
static void check_recovers(const char *after) {
    int n_nan = 0;
    const int bad = run_reverse(2, 128, 1, &n_nan);
    CHECK(bad == 0, "a good launch after %s: %d wrong", after, bad);
}

static void expect_launch_failure(const char *what, const std::string &log, cudaError_t e,
                                  const char *kernel, const char *fragment) {
    const std::string head = std::string("k3emu: kernel ") + kernel + ", block (";
    CHECK(e == cudaErrorLaunchFailure, "%s: %s, want cudaErrorLaunchFailure", what,
          cudaGetErrorName(e));
    CHECK(log.find(head) != std::string::npos && log.find(fragment) != std::string::npos &&
              std::count(log.begin(), log.end(), '\n') == 1,
          "%s: want one line '%s...%s', got '%s'", what, head.c_str(), fragment, log.c_str());
    check_recovers(what);
}

static void test_errors(void) {
    dbuf<int> out(2048, 0);
    dbuf<unsigned> out_u(1, 0);
    cudaError_t e = cudaSuccess;
    std::string log;
    if (k_emu) {
        log = captured_stderr([&] {
            K3C_LAUNCH(1, 64, 0, 0, early_return_kernel)(out.d);
            e = launch_error();
        });
        expect_launch_failure("thread 0 returns before a barrier", log, e, "early_return_kernel",
                              "63 of 64 threads: 1 have exited");
        log = captured_stderr([&] {
            K3C_LAUNCH(1, 64, 0, 0, half_barrier_kernel)(out.d);
            e = launch_error();
        });
        expect_launch_failure("barrier inside threadIdx.x < 32", log, e, "half_barrier_kernel",
                              "32 of 64 threads");
        log = captured_stderr([&] {
            K3C_LAUNCH(1, 32, 0, 0, mixed_deadlock_kernel)(out.d);
            e = launch_error();
        });
        expect_launch_failure("half at a barrier, half in a shuffle", log, e,
                              "mixed_deadlock_kernel", "deadlock");
        log = captured_stderr([&] {
            K3C_LAUNCH(1, 64, 0, 0, exited_lane_kernel)(out.d);
            e = launch_error();
        });
        expect_launch_failure("a shuffle naming an exited lane", log, e, "exited_lane_kernel",
                              "lane 31 (thread 31) has exited");
        log = captured_stderr([&] {
            K3C_LAUNCH(dim3(3, 2), 32, 0, 0, one_block_kernel)(out.d);
            e = launch_error();
        });
        expect_launch_failure("one block of six breaks the barrier", log, e, "one_block_kernel",
                              "block (2,1,0): __syncthreads() reached by 31 of 32");
    }
    /* configurations the device refuses too */
    const struct {
        dim3 g, b;
        const char *what;
    } bad_cfg[] = {{dim3(1), dim3(2048), "block of 2048 threads"},
                   {dim3(1), dim3(1, 1, 65), "block z of 65"},
                   {dim3(1, 65536), dim3(32), "grid y of 65536"},
                   {dim3(0), dim3(32), "empty grid"}};
    for (const auto &c : bad_cfg) {
        log = captured_stderr([&] {
            K3C_LAUNCH(c.g, c.b, 0, 0, fill_kernel)(out_u.d, 0u, 0u);
            e = launch_error();
        });
        CHECK(e == cudaErrorInvalidConfiguration, "%s: %s, want cudaErrorInvalidConfiguration",
              c.what, cudaGetErrorName(e));
        if (k_emu) CHECK(log.find("fill_kernel") != std::string::npos, "%s: no message", c.what);
        check_recovers(c.what);
    }
    log = captured_stderr([&] {
        K3C_LAUNCH(1, 32, 64 * 1024, 0, fill_kernel)(out_u.d, 0u, 0u);
        e = launch_error();
    });
    CHECK(e != cudaSuccess, "64 KiB of dynamic shared memory launched");
    if (k_emu) CHECK(log.find("fill_kernel") != std::string::npos, "64 KiB shared: no message");
    check_recovers("64 KiB of dynamic shared memory");
}

/* ---- 7. the runtime API -----------------------------------------------------------------------
 */

static void test_runtime(void) {
    /* allocation: 256-byte aligned; the free memory goes down and comes back */
    size_t free0 = 0, total = 0, free1 = 0, free2 = 0;
    CUDA_OK(cudaMemGetInfo(&free0, &total));
    const size_t sizes[] = {1, 3, 1000, 4097, 1 << 20};
    void *p[5] = {nullptr};
    int misaligned = 0;
    for (int i = 0; i < 5; i++) {
        CUDA_OK(cudaMalloc(&p[i], sizes[i]));
        misaligned += (uintptr_t)p[i] % 256 != 0;
    }
    CHECK(misaligned == 0, "cudaMalloc: %d of 5 pointers not 256-byte aligned", misaligned);
    CUDA_OK(cudaMemGetInfo(&free1, &total));
    CHECK(free1 + (1 << 20) <= free0 && free0 <= total,
          "cudaMemGetInfo: free %zu -> %zu after 1 MiB (total %zu)", free0, free1, total);
    for (int i = 0; i < 5; i++) CUDA_OK(cudaFree(p[i]));
    CUDA_OK(cudaMemGetInfo(&free2, &total));
    if (k_emu)
        CHECK(free2 == free0, "cudaMemGetInfo: free %zu after freeing, was %zu", free2, free0);

    /* copies and memsets on streams, in stream order; an event orders a second stream */
    const unsigned n = 1000;
    cudaStream_t s1 = nullptr, s2 = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr, enot = nullptr;
    CUDA_OK(cudaStreamCreate(&s1));
    CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    CUDA_OK(cudaEventCreateWithFlags(&enot, cudaEventDisableTiming));
    dbuf<unsigned> a(n), b(n);
    std::vector<unsigned> h(n), back(n, 0);
    for (unsigned i = 0; i < n; i++) h[i] = (unsigned)rnd();
    CUDA_OK(cudaEventRecord(e0, s1));
    CUDA_OK(cudaMemcpyAsync(a.d, h.data(), n * 4, cudaMemcpyHostToDevice, s1));
    CUDA_OK(cudaMemcpyAsync(b.d, a.d, n * 4, cudaMemcpyDeviceToDevice, s1));
    CUDA_OK(cudaMemsetAsync(b.d + 100, 0x5a, 50 * 4, s1));
    K3C_LAUNCH((n + 255) / 256, 256, 0, s1, fill_kernel)(a.d, 10u, 7u);
    CUDA_OK(cudaEventRecord(e1, s1));
    CUDA_OK(cudaStreamWaitEvent(s2, e1, 0));
    CUDA_OK(cudaMemcpyAsync(back.data(), b.d, n * 4, cudaMemcpyDeviceToHost, s2));
    CUDA_OK(cudaStreamSynchronize(s2));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventQuery(e1));
    CUDA_OK(cudaStreamQuery(s1));
    int bad = 0;
    for (unsigned i = 0; i < n; i++) bad += back[i] != (i >= 100 && i < 150 ? 0x5a5a5a5au : h[i]);
    CHECK(bad == 0, "memcpy / memset on streams: %d of %u words wrong", bad, n);
    std::vector<unsigned> ha = a.get();
    bad = 0;
    for (unsigned i = 0; i < n; i++) bad += ha[i] != (i < 10 ? 7 + i : h[i]);
    CHECK(bad == 0, "kernel on a stream after a copy: %d of %u words wrong", bad, n);
    float ms = -1;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    CHECK(ms >= 0 && ms < 60e3f, "cudaEventElapsedTime %g ms", (double)ms);
    CUDA_OK(cudaEventRecord(enot, s1));
    CHECK(cudaEventElapsedTime(&ms, e0, enot) != cudaSuccess,
          "elapsed time of an event without timing");
    (void)cudaGetLastError();

    /* 2-D copies: rows of 12 bytes, pitches 16 (host), 32 (device), 20 (host); pads untouched */
    const size_t rows = 5, width = 12;
    std::vector<unsigned char> src(rows * 16), dst(rows * 20, 0xab);
    for (size_t i = 0; i < src.size(); i++) src[i] = (unsigned char)(i * 7 + 1);
    dbuf<unsigned char> dev(rows * 32, 0xcd);
    CUDA_OK(cudaMemcpy2DAsync(dev.d, 32, src.data(), 16, width, rows, cudaMemcpyHostToDevice, s1));
    CUDA_OK(cudaMemcpy2DAsync(dst.data(), 20, dev.d, 32, width, rows, cudaMemcpyDeviceToHost, s1));
    CUDA_OK(cudaStreamSynchronize(s1));
    std::vector<unsigned char> hd = dev.get();
    bad = 0;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = 0; c < 32; c++) {
            if (c < 20) bad += dst[r * 20 + c] != (c < width ? src[r * 16 + c] : 0xab);
            bad += hd[r * 32 + c] != (c < width ? src[r * 16 + c] : 0xcd);
        }
    CHECK(bad == 0, "cudaMemcpy2DAsync: %d bytes wrong", bad);
    CHECK(cudaMemcpy2D(dev.d, 8, src.data(), 16, width, rows, cudaMemcpyHostToDevice) ==
              cudaErrorInvalidValue,
          "cudaMemcpy2D with width > pitch");
    (void)cudaGetLastError();
    CUDA_OK(cudaEventDestroy(e0));
    CUDA_OK(cudaEventDestroy(e1));
    CUDA_OK(cudaEventDestroy(enot));
    CUDA_OK(cudaStreamDestroy(s1));
    CUDA_OK(cudaStreamDestroy(s2));

    if (k_emu) { /* K3_EMU_DEVICES: the emulated device count, read at every call */
        int count = -1, dev_ix = -1;
        setenv("K3_EMU_DEVICES", "3", 1);
        CUDA_OK(cudaGetDeviceCount(&count));
        CHECK(count == 3, "K3_EMU_DEVICES=3: %d devices", count);
        CUDA_OK(cudaSetDevice(2));
        CUDA_OK(cudaGetDevice(&dev_ix));
        CHECK(dev_ix == 2, "cudaGetDevice %d after cudaSetDevice(2)", dev_ix);
        CHECK(cudaSetDevice(3) == cudaErrorInvalidDevice, "cudaSetDevice(3) of 3 devices");
        (void)cudaGetLastError();
        setenv("K3_EMU_DEVICES", "0", 1);
        CHECK(cudaGetDeviceCount(&count) == cudaErrorNoDevice, "K3_EMU_DEVICES=0");
        (void)cudaGetLastError();
        unsetenv("K3_EMU_DEVICES");
        CUDA_OK(cudaGetDeviceCount(&count));
        CHECK(count == 1, "K3_EMU_DEVICES unset: %d devices", count);
        CUDA_OK(cudaSetDevice(0));
    }
}

/* ---- 8. ASan sees out-of-bounds accesses in kernels (death tests) ----------------------------
 */
static __global__ void oob_global_kernel(const float *x, float *y, int off) {
    y[threadIdx.x] = x[threadIdx.x + off]; /* the last thread reads one past the end */
}
/* indexing the array: in the K3_SANITIZE build (ASan + UBSan) UBSan's bounds check, which knows
 * the array's type, reports it first */
static __global__ void oob_shared_kernel(float *y, int off) {
    K3C_SHARED(float, s, [32]);
    s[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    y[threadIdx.x] = s[threadIdx.x + off];
}
/* through a pointer: ASan's redzone after the shared array's heap block */
static __global__ void oob_shared_ptr_kernel(float *y, int off) {
    K3C_SHARED(float, s, [32]);
    s[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    const float *p = s;
    y[threadIdx.x] = p[threadIdx.x + off];
}

/* the child of a death test: makes the access and, if it survives, says so and exits 0 */
static int oob_child(const char *where) {
    float *x = nullptr, *y = nullptr;
    cudaMalloc((void **)&x, 32 * sizeof(float));
    cudaMalloc((void **)&y, 32 * sizeof(float));
    cudaMemset(x, 0, 32 * sizeof(float));
    if (!strcmp(where, "global"))
        K3C_LAUNCH(1, 32, 0, 0, oob_global_kernel)(x, y, 1);
    else if (!strcmp(where, "shared"))
        K3C_LAUNCH(1, 32, 0, 0, oob_shared_ptr_kernel)(y, 1);
    else if (!strcmp(where, "shared-index"))
        K3C_LAUNCH(1, 32, 0, 0, oob_shared_kernel)(y, 1);
    else {
        fprintf(stderr, "test_cuda_emu: --oob global|shared|shared-index\n");
        return 2;
    }
    cudaDeviceSynchronize();
    printf("oob %s: no report\n", where);
    cudaFree(x);
    cudaFree(y);
    return 0;
}

/* ---- 9. seeded order: an ordering race shows as a difference between seeds ------------------ */
/* thread 0 writes sh[0], the others read it: without the barrier (race = 1, the injected bug) the
 * readers that run before thread 0 see the NaN poison */
static __global__ void race_kernel(float *out, int race) {
    K3C_SHARED(float, sh, [1]);
    if (threadIdx.x == 0) sh[0] = 1.0f + blockIdx.x;
    if (!race) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = sh[0];
}
static __global__ void block_order_kernel(unsigned *ctr, unsigned *out) {
    if (threadIdx.x == 0) out[blockIdx.x] = atomicAdd(ctr, 1u);
}

#ifdef K3_CUDA_EMULATION
static void test_seeded_order(void) {
    enum { B = 3, T = 64, NB = 16 };
    dbuf<float> out(B * T);
    dbuf<unsigned> ctr(1, 0), order(NB);
    std::vector<float> first[2];
    int differ[2] = {0, 0}, shuffled_blocks = 0, bad_perm = 0;
    for (unsigned long long seed = 0; seed < 8; seed++) {
        k3emu_set_seed(seed);
        for (int race = 0; race < 2; race++) {
            K3C_LAUNCH(B, T, 0, 0, race_kernel)(out.d, race);
            CHECK(launch_error() == cudaSuccess, "race_kernel seed %llu", seed);
            std::vector<float> h = out.get();
            if (seed == 0)
                first[race] = h;
            else
                differ[race] += memcmp(h.data(), first[race].data(), h.size() * sizeof(float)) != 0;
        }
        CUDA_OK(cudaMemset(ctr.d, 0, sizeof(unsigned)));
        K3C_LAUNCH(NB, 32, 0, 0, block_order_kernel)(ctr.d, order.d);
        CHECK(launch_error() == cudaSuccess, "block_order_kernel seed %llu", seed);
        std::vector<unsigned> o = order.get();
        std::vector<unsigned> sorted = o;
        std::sort(sorted.begin(), sorted.end());
        for (unsigned i = 0; i < NB; i++) bad_perm += sorted[i] != i;
        bool identity = true;
        for (unsigned i = 0; i < NB; i++) identity = identity && o[i] == i;
        if (seed == 0)
            CHECK(identity, "seed 0 runs the blocks in index order");
        else
            shuffled_blocks += !identity;
    }
    k3emu_set_seed(0);
    int n_nan = 0;
    for (float v : first[1]) n_nan += isnan(v) != 0;
    CHECK(n_nan == 0, "seed 0: the race is hidden (thread 0 runs first): %d NaN", n_nan);
    CHECK(differ[1] > 0, "the barrier-free race_kernel gave the same result under 8 seeds");
    CHECK(differ[0] == 0, "race_kernel with its barrier differs between seeds (%d of 7)",
          differ[0]);
    CHECK(bad_perm == 0, "a block ran twice or never under a seed");
    CHECK(shuffled_blocks > 0, "no seed changed the block order");
}
#endif

/* re-runs this program with --oob WHERE: it must die with a stderr that holds need, or alt */
static void death_test(const char *where, const char *need, const char *alt) {
    int pipefd[2];
    if (pipe(pipefd)) {
        CHECK(false, "pipe");
        return;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, pipefd[1], 2);
    posix_spawn_file_actions_addclose(&fa, pipefd[0]);
    posix_spawn_file_actions_addclose(&fa, pipefd[1]);
    char exe[] = "/proc/self/exe", oob[] = "--oob";
    char arg[16];
    snprintf(arg, sizeof arg, "%s", where);
    char *argv[] = {exe, oob, arg, nullptr};
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe, &fa, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(pipefd[1]);
    std::string err;
    char buf[4096];
    ssize_t got;
    while ((got = read(pipefd[0], buf, sizeof buf)) > 0) err.append(buf, (size_t)got);
    close(pipefd[0]);
    int status = 0;
    if (rc == 0) waitpid(pid, &status, 0);
    const bool died = rc == 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    const bool reported =
        err.find(need) != std::string::npos || (alt && err.find(alt) != std::string::npos);
    CHECK(died && reported, "out-of-bounds %s read in a kernel: child status 0x%x, report %s",
          where, status, reported ? "found" : "missing");
    if (!(died && reported)) fprintf(stderr, "%s", err.c_str());
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--oob")) return oob_child(argv[2]);
    if (argc > 1) {
        fprintf(stderr, "usage: test_cuda_emu [--oob global|shared|shared-index]\n");
        return 2;
    }
    printf("test_cuda_emu: seed %llu, %s\n", (unsigned long long)k_seed,
           k_emu ? "emulation" : "device");
    test_indexing(dim3(3, 2, 2), dim3(4, 3, 2));
    test_indexing(dim3(2, 1, 3), dim3(8, 8, 16));
    test_indexing(dim3(5), dim3(1024));
    test_syncthreads();
    test_warp();
    test_shared();
    test_atomics();
    test_errors();
    test_runtime();
    test_gaps();
#ifdef K3_CUDA_EMULATION
    test_seeded_order(); /* last: it leaves the seed at 0 */
#endif
    if (k_emu && k_asan) {
        const char *hbo = "ERROR: AddressSanitizer: heap-buffer-overflow";
        /* device memory is the emulator's own range (emu_devmem.cpp): the gap after an
         * allocation is ASan-poisoned, so ASan names it use-after-poison */
        death_test("global", hbo, "ERROR: AddressSanitizer: use-after-poison");
        death_test("shared", hbo, nullptr);
        death_test("shared-index", hbo, "index 32 out of bounds for type 'float [32]'");
    } else {
        printf("SKIP out-of-bounds global and shared reads in kernels: %s\n",
               k_emu ? "this build has no ASan (-DK3_SANITIZE=ON)" : "emulation only");
    }
    printf("k3-test cuda_emu: %d passed, %d failed\n", g_pass, g_fail);
    return g_fail || !g_pass ? 1 : 0;
}
