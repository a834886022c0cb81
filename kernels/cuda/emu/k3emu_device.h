/* k3emu_device.h — the device side of k3's CUDA emulation (C++, K3_CUDA_EMULATE builds only):
 * what the kernels of the kernels/cuda sources need to compile and run on the host, unchanged.
 *
 * Execution model (emu_runtime.cpp): a launch is run by its stream's worker thread
 * (emu_streams.cpp), after the host has gone on; it runs its blocks one after another; the threads
 * of a block are fibers on one host thread, each running until it reaches a barrier, a warp
 * primitive or its end. __syncthreads releases when every thread of the block has arrived (a
 * thread that has exited, or that waits at another barrier, is a reported error, not a hang); a
 * warp primitive releases when every thread its mask names has arrived at the same primitive.
 * Shared memory (K3C_SHARED, K3C_DYN_SHARED) is one heap block per declaration and launch,
 * filled with 0xff bytes (NaN floats) at every block's start, so a read before the write that
 * a barrier should order shows up as NaN, and ASan sees every out-of-bounds access. Atomics are
 * plain read-modify-writes (only one fiber runs at a time) returning the old value.
 * Launches: K3C_LAUNCH(grid, block, shmem, stream, kernel)(args...) — the macro cuda_math.cuh
 * defines as kernel<<<grid, block, shmem, stream>>>(args...) for nvcc — so no kernel source forks
 * between the builds. A launch that breaks a CUDA rule (a bad configuration, more than 48 KiB of
 * shared memory, a divergent barrier, a warp primitive with a missing or exited lane) prints one
 * line naming the kernel, block and thread, and the next cudaGetLastError returns
 * cudaErrorLaunchFailure (or cudaErrorInvalidConfiguration). */
#ifndef K3_EMU_DEVICE_H
#define K3_EMU_DEVICE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <utility>

#include "cuda_runtime_api.h"

/* ---- qualifiers ----------------------------------------------------------------------------- */
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
/* Shared memory is declared through K3C_SHARED / K3C_DYN_SHARED (both builds): a bare __shared__
 * does not compile here, so every shared array is one the emulation knows. */
#define __shared__ k3emu_use_K3C_SHARED_or_K3C_DYN_SHARED

/* ---- built-in types ---------------------------------------------------------------------------
 */
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
static inline float4 make_float4(float x, float y, float z, float w) {
    return float4{x, y, z, w};
}
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
    return uint4{x, y, z, w};
}
static inline float2 make_float2(float x, float y) {
    return float2{x, y};
}

namespace k3emu {

/* the running fiber (one CUDA thread) and its launch; emu_runtime.cpp */
struct fiber {
    void *sp;      /* saved stack pointer while switched out */
    uint3 tid;     /* threadIdx */
    unsigned lin;  /* linear thread index in the block */
    int state;     /* k3emu::ST_* (emu_runtime.cpp) */
    unsigned mask; /* the mask of the collective it waits in */
    int pred;      /* the __syncthreads_* predicate it brought */
    void *stack, *asan_fake;
    size_t stack_size;
    uint64_t got[32]; /* the lanes' values of its last warp collective, copied at release */
    const char *op;   /* the warp collective it waits in (nullptr: a shuffle, vote or syncwarp) */
    /* cp.async copies issued and not yet completed by a wait_group (k3c_mma.cuh): the source's
     * 16 bytes as read at issue, the destination poisoned until completion */
    struct cp_pending {
        void *dst;
        unsigned group; /* == cp_groups: the open (uncommitted) group */
        unsigned char data[16];
    } cp[32];
    unsigned n_cp, cp_groups;
};
struct launch_state {
    uint3 bid; /* blockIdx */
    dim3 bdim, gdim;
};
/* the running thread and its launch (functions, not extern thread_local variables: g++ with
 * -fsanitize=undefined mis-addresses those across translation units) */
fiber *self(void);
launch_state *launch(void);

void syncthreads(void);
int syncthreads_count(int pred); /* every thread gets the count of true predicates */
/* The warp collective under every __shfl / vote: this thread's 8-byte value in; out, the 32
 * lanes' values of this round (lanes outside the mask: stale, not to be read). */
const uint64_t *warp_exchange(unsigned mask, uint64_t v);
/* the same, for a named warp-wide instruction (ldmatrix, mma: k3c_mma.cuh): every lane the mask
 * names must arrive at the same op, else the launch fails naming both */
const uint64_t *warp_exchange_op(unsigned mask, uint64_t v, const char *op);
unsigned lane_id(void);
/* Reports a CUDA rule broken inside a kernel (one `k3emu: kernel K, block (x,y,z): thread T: ...`
 * line; the launch then fails with cudaErrorLaunchFailure); the thread goes on. */
void device_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* whether [p, p + n) lies inside one shared-memory array of the running block */
bool in_shared(const void *p, size_t n);
/* one warp-level mma of the running kernel (counted per kernel: k3emu_mma_count) */
void count_mma(void);
/* mma.m16n8k16 bf16 -> f32 of a whole warp (emu_mma.cpp): lanes[l] points at lane l's fragment;
 * d = A·B + c for every lane, by the PTX fragment maps, each element summed in double over k in
 * order (exact for the products; one rounding to fp32 at the end) */
struct mma_frag {
    uint32_t a[4], b[2];
    float c[4], d[4];
};
void mma_m16n8k16_bf16(const uint64_t *lanes);
/* cp.async of 16 bytes (dst shared, src global; both 16-byte aligned), commit_group, wait_group */
void cp_async16(void *dst, const void *src);
void cp_commit(void);
void cp_wait(unsigned n);
/* site: one address per K3C_SHARED declaration (so a declaration met twice, in a loop or a helper
 * called twice, is one array, as on the device) */
void *shared_static(const void *site, size_t bytes, size_t align, const char *what);
void *shared_dynamic(void);
/* Enqueues the grid on stream s (emu_streams.cpp): body(closure) per thread, run later by the
 * stream's worker; drop(closure) frees it after. On a capturing stream it becomes a node of the
 * graph instead, which owns the closure (emu_graph.cpp). A bad configuration is reported at once
 * (the next cudaGetLastError); a kernel that breaks a CUDA rule, at the next synchronisation. */
void run_grid(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t s,
              void (*body)(void *), void *closure, void (*drop)(void *));

template <class... P> struct launcher {
    const char *name;
    dim3 grid, block;
    size_t shmem;
    cudaStream_t stream;
    void (*kernel)(P...);
    template <class... A> void operator()(A &&...a) const {
        struct closure {
            void (*k)(P...);
            std::tuple<P...> args;
        };
        /* the arguments as of the launch, kept until the stream runs it */
        closure *c = new closure{kernel, std::tuple<P...>(static_cast<P>(a)...)};
        /* each thread gets its own copy of the by-value parameters, as from constant memory */
        run_grid(
            name, grid, block, shmem, stream,
            [](void *p) {
                closure *cl = static_cast<closure *>(p);
                std::tuple<P...> mine = cl->args;
                std::apply(cl->k, mine);
            },
            c, [](void *p) { delete static_cast<closure *>(p); });
    }
};
template <class... P>
static inline launcher<P...> make_launcher(const char *name, dim3 grid, dim3 block, size_t shmem,
                                           cudaStream_t stream, void (*kernel)(P...)) {
    return launcher<P...>{name, grid, block, shmem, stream, kernel};
}

template <class T> static inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp primitives move at most 8 bytes per lane");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof v);
    return b;
}
template <class T> static inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof v);
    return v;
}
/* lane src of the round, or the caller's own value when src is outside its width segment */
template <class T> static inline T shfl_from(unsigned mask, T v, int src, int width, bool up_down) {
    const uint64_t *all = warp_exchange(mask, to_bits(v));
    const int lane = (int)lane_id(), w = width > 0 && width <= 32 ? width : 32;
    const int base = lane / w * w;
    if (up_down ? (src < base || src >= base + w) : (src >= base + w)) return v;
    return from_bits<T>(all[src & 31]);
}

} // namespace k3emu

#define threadIdx (k3emu::self()->tid)
#define blockIdx  (k3emu::launch()->bid)
#define blockDim  (k3emu::launch()->bdim)
#define gridDim   (k3emu::launch()->gdim)
#define warpSize  32

#define K3C_SHARED(T, name, dims)                                                                  \
    static const char k3emu_site_##name = 0;                                                       \
    T(&name)                                                                                       \
    dims = *reinterpret_cast<T(*) dims>(                                                           \
        k3emu::shared_static(&k3emu_site_##name, sizeof(T dims), alignof(T), #name))
#define K3C_DYN_SHARED(T, name) T *name = reinterpret_cast<T *>(k3emu::shared_dynamic())
#define K3C_LAUNCH(grid, block, shmem, stream, ...)                                                \
    k3emu::make_launcher(#__VA_ARGS__, grid, block, shmem, stream, __VA_ARGS__)

/* ---- barriers, warp primitives, atomics ------------------------------------------------------ */
static inline void __syncthreads(void) {
    k3emu::syncthreads();
}
static inline int __syncthreads_or(int p) {
    return k3emu::syncthreads_count(p != 0) != 0;
}
static inline int __syncthreads_and(int p) {
    return k3emu::syncthreads_count(p == 0) == 0;
}
static inline int __syncthreads_count(int p) {
    return k3emu::syncthreads_count(p != 0);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)k3emu::warp_exchange(mask, 0);
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const int w = width > 0 && width <= 32 ? width : 32;
    return k3emu::shfl_from(mask, v, (int)k3emu::lane_id() / w * w + (src % w + w) % w, width,
                            false);
}
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lm, int width = 32) {
    return k3emu::shfl_from(mask, v, (int)k3emu::lane_id() ^ lm, width, false);
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return k3emu::shfl_from(mask, v, (int)k3emu::lane_id() - (int)d, width, true);
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return k3emu::shfl_from(mask, v, (int)k3emu::lane_id() + (int)d, width, true);
}
static inline unsigned __ballot_sync(unsigned mask, int p) {
    const uint64_t *all = k3emu::warp_exchange(mask, p != 0);
    unsigned b = 0;
    for (int l = 0; l < 32; l++)
        if ((mask >> l & 1u) && all[l]) b |= 1u << l;
    return b;
}
static inline int __any_sync(unsigned mask, int p) {
    return __ballot_sync(mask, p) != 0;
}
static inline int __all_sync(unsigned mask, int p) {
    return __ballot_sync(mask, p) == mask;
}

template <class T> static inline T atomicAdd(T *a, T v) {
    T o = *a;
    *a = o + v;
    return o;
}
template <class T> static inline T atomicSub(T *a, T v) {
    T o = *a;
    *a = o - v;
    return o;
}
template <class T> static inline T atomicMin(T *a, T v) {
    T o = *a;
    *a = v < o ? v : o;
    return o;
}
template <class T> static inline T atomicMax(T *a, T v) {
    T o = *a;
    *a = v > o ? v : o;
    return o;
}
template <class T> static inline T atomicExch(T *a, T v) {
    T o = *a;
    *a = v;
    return o;
}
template <class T> static inline T atomicCAS(T *a, T cmp, T v) {
    T o = *a;
    if (o == cmp) *a = v;
    return o;
}

#endif /* K3_EMU_DEVICE_H */
