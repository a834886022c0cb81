/* emu_devmem.cpp — k3's CUDA emulation (K3_CUDA_EMULATE builds only): device memory in its own
 * address range (issue 44). cudaMalloc carves allocations out of one reserved range (the emulated
 * device's K3_EMU_DEVICE_MEM_GB, default 64, plus room for the gaps), first fit, 256-byte aligned,
 * each followed by a gap of at least 256 bytes. The range is PROT_NONE whenever no device work
 * runs; work_begin / work_end (a stream's worker running a kernel, a copy or a memset, a
 * synchronous copy, the NCCL stand-in's transfers) open it for their duration, one executor at a
 * time. So a host dereference of a device pointer faults, and the SIGSEGV handler installed with
 * the range prints one line, `k3emu: host access to device memory at P: byte B of a N-byte
 * cudaMalloc (#I)`, and where it was allocated (the caller's frames), then aborts; a fault
 * outside the range goes to the handler that was there before (ASan's, in a sanitizer build).
 * What it cannot catch: a host access while device work is in flight (the range is open then).
 * Under ASan the gaps and freed allocations are poisoned (ASAN_POISON_MEMORY_REGION), so an
 * out-of-bounds or use-after-free access by a kernel is still ASan's report, as with heap
 * blocks; a freed allocation's pages go back to the system (MADV_DONTNEED). cudaMallocHost is
 * ordinary host memory. */
#include "emu_graph.h"
#include "emu_internal.h"

#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <map>
#include <mutex>

#if defined(__SANITIZE_ADDRESS__)
#define K3EMU_DEVMEM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define K3EMU_DEVMEM_ASAN 1
#endif
#endif
#ifdef K3EMU_DEVMEM_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n)   __asan_poison_memory_region((p), (n))
#define UNPOISON(p, n) __asan_unpoison_memory_region((p), (n))
#else
#define POISON(p, n)   ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace {

enum { ALIGN = 256, GAP = 256, FRAMES = 10 };

struct alloc_info {
    size_t n, span; /* bytes asked; bytes held (with the gap) */
    unsigned long long seq;
    void *frames[FRAMES];
    int n_frames;
};

/* Heap objects never freed: worker threads may still use them while the process exits. */
struct devmem {
    std::mutex mu;                        /* the maps and the counters */
    std::map<uintptr_t, size_t> free_;    /* address -> bytes, coalesced */
    std::map<uintptr_t, alloc_info> live; /* address -> its allocation */
    size_t allocated = 0;
    unsigned long long seq = 0;
    std::recursive_mutex work; /* the device: one executor at a time */
    int open_depth = 0;        /* under work */
};
devmem *g_dm;
uintptr_t g_base;
size_t g_size;
struct sigaction g_old_segv;

size_t round_up(size_t n, size_t a) {
    return (n + a - 1) / a * a;
}

void say(const char *s) {
    size_t n = strlen(s);
    while (n) {
        const ssize_t w = write(2, s, n);
        if (w <= 0) return;
        s += w, n -= (size_t)w;
    }
}

/* the fault handler: a host access to the device range is named and fatal */
void on_segv(int sig, siginfo_t *si, void *uc) {
    const uintptr_t a = (uintptr_t)si->si_addr;
    if (g_base && a >= g_base && a < g_base + g_size) {
        char line[400];
        const alloc_info *hit = nullptr;
        uintptr_t at = 0;
        /* no lock: the process is about to abort, and the maps are read only */
        auto it = g_dm->live.upper_bound(a);
        if (it != g_dm->live.begin()) {
            --it;
            if (a < it->first + it->second.span) hit = &it->second, at = it->first;
        }
        if (hit)
            snprintf(line, sizeof line,
                     "k3emu: host access to device memory at %p: byte %zu of a %zu-byte cudaMalloc "
                     "(#%llu at %p%s); the host reaches device memory only through cudaMemcpy*. "
                     "Allocated at:\n",
                     (void *)a, (size_t)(a - at), hit->n, hit->seq, (void *)at,
                     a - at >= hit->n ? ", past its end" : "");
        else
            snprintf(line, sizeof line,
                     "k3emu: host access to device memory at %p, in no live cudaMalloc (freed, "
                     "or never allocated)\n",
                     (void *)a);
        say(line);
        if (hit) backtrace_symbols_fd(hit->frames, hit->n_frames, 2);
        signal(SIGABRT, SIG_DFL);
        abort();
    }
    /* not ours: the handler that was there before */
    if (g_old_segv.sa_flags & SA_SIGINFO) {
        if (g_old_segv.sa_sigaction) {
            g_old_segv.sa_sigaction(sig, si, uc);
            return;
        }
    } else if (g_old_segv.sa_handler != SIG_DFL && g_old_segv.sa_handler != SIG_IGN) {
        g_old_segv.sa_handler(sig);
        return;
    }
    signal(SIGSEGV, SIG_DFL); /* the access runs again and kills the process */
}

/* the range and the handler, once */
bool ready(void) {
    static std::once_flag once;
    std::call_once(once, [] {
        const char *v = getenv("K3_EMU_DEVICE_MEM_GB");
        const double gb = v && *v ? atof(v) : 64.0;
        size_t total = (size_t)((gb > 0 ? gb : 64.0) * (double)((size_t)1 << 30));
        total = round_up(total + total / 8 + ((size_t)1 << 26), (size_t)1 << 21);
        /* 2 MB-aligned and advised for huge pages: an mprotect of the range then changes one
           entry per 2 MB of resident device memory instead of 512 (a model's load closes and
           opens the range once per synchronous upload) */
        const size_t huge = (size_t)1 << 21;
        void *r = mmap(nullptr, total + huge, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (r == MAP_FAILED) {
            fprintf(stderr, "k3emu: cannot reserve %zu bytes for device memory\n", total);
            return;
        }
        void *m = (void *)round_up((uintptr_t)r, huge);
        (void)madvise(m, total, MADV_HUGEPAGE); /* a hint: without THP the range still works */
        g_dm = new devmem;
        g_dm->free_[(uintptr_t)m] = total; /* never-used space is not poisoned: 9 GiB of shadow */
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_segv;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &g_old_segv);
        g_size = total;
        g_base = (uintptr_t)m;
    });
    return g_base != 0;
}

void set_prot(int prot) {
    if (mprotect((void *)g_base, g_size, prot) != 0) {
        perror("k3emu: mprotect of the device range");
        abort();
    }
}

} // namespace

namespace k3emu {

void *dev_alloc(size_t n) {
    if (!ready()) return nullptr;
    const size_t span = round_up(n ? n : 1, ALIGN) + GAP;
    std::lock_guard<std::mutex> lk(g_dm->mu);
    for (auto it = g_dm->free_.begin(); it != g_dm->free_.end(); ++it) {
        if (it->second < span) continue;
        const uintptr_t a = it->first;
        const size_t left = it->second - span;
        g_dm->free_.erase(it);
        if (left) g_dm->free_[a + span] = left;
        alloc_info &inf = g_dm->live[a];
        inf.n = n;
        inf.span = span;
        inf.seq = ++g_dm->seq;
        inf.n_frames = backtrace(inf.frames, FRAMES);
        g_dm->allocated += span;
        UNPOISON((void *)a, n);
        POISON((void *)(a + n), span - n); /* the gap after it (the tail of its last 256) */
        return (void *)a;
    }
    return nullptr;
}

bool dev_free(void *p) {
    if (!g_base) return false;
    std::lock_guard<std::mutex> lk(g_dm->mu);
    auto it = g_dm->live.find((uintptr_t)p);
    if (it == g_dm->live.end()) return false;
    uintptr_t a = it->first;
    size_t n = it->second.span;
    g_dm->allocated -= n;
    g_dm->live.erase(it);
    POISON((void *)a, n);
    /* the whole pages inside go back to the system (they read 0 when reused) */
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), lo = round_up(a, pg),
                    hi = (a + n) / pg * pg;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
    /* coalesce with the free neighbours */
    auto next = g_dm->free_.lower_bound(a);
    if (next != g_dm->free_.end() && next->first == a + n) {
        n += next->second;
        next = g_dm->free_.erase(next);
    }
    if (next != g_dm->free_.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second == a) {
            prev->second += n;
            return true;
        }
    }
    g_dm->free_[a] = n;
    return true;
}

bool dev_contains(const void *p) {
    const uintptr_t a = (uintptr_t)p;
    return g_base && a >= g_base && a < g_base + g_size;
}

size_t dev_allocated(void) {
    if (!g_dm) return 0;
    std::lock_guard<std::mutex> lk(g_dm->mu);
    return g_dm->allocated;
}

/* The range stays open after the last executor lets the device go, until the next quiet point
 * (close_idle: a host synchronisation, or a stream worker idle for a millisecond): an mprotect
 * walks every resident page of the range, so one pair per operation or burst cost more than the
 * work itself on a model (93 layers: 2/3 of the CPU time, in the kernel). */
static bool g_open; /* under g_dm->work */

void work_begin(void) {
    if (!ready()) return;
    g_dm->work.lock();
    if (g_dm->open_depth++ == 0 && !g_open) {
        set_prot(PROT_READ | PROT_WRITE);
        g_open = true;
    }
}

void work_end(void) {
    if (!g_base) return;
    --g_dm->open_depth;
    g_dm->work.unlock();
}

void close_idle(void) {
    if (!g_base || !g_dm->work.try_lock()) return; /* someone works: it stays open */
    if (g_dm->open_depth == 0 && g_open) {
        set_prot(PROT_NONE);
        g_open = false;
    }
    g_dm->work.unlock();
}

} // namespace k3emu

#define FORBID_IN_CAPTURE(api)                                                                     \
    do {                                                                                           \
        const cudaError_t cap_e_ = k3emu::forbid_in_capture(api, nullptr);                         \
        if (cap_e_ != cudaSuccess) return k3emu::set_err(cap_e_);                                  \
    } while (0)

extern "C" {

cudaError_t cudaMalloc(void **p, size_t n) {
    if (!p) return k3emu::set_err(cudaErrorInvalidValue);
    *p = nullptr;
    FORBID_IN_CAPTURE("cudaMalloc");
    *p = k3emu::dev_alloc(n);
    return *p ? cudaSuccess : k3emu::set_err(cudaErrorMemoryAllocation);
}
/* as on a device, cudaFree waits for the work in flight first */
cudaError_t cudaFree(void *p) {
    FORBID_IN_CAPTURE("cudaFree");
    if (!p) return cudaSuccess;
    k3emu::sync_streams(true);
    return k3emu::dev_free(p) ? cudaSuccess : k3emu::set_err(cudaErrorInvalidValue);
}
cudaError_t cudaMallocHost(void **p, size_t n) {
    if (!p) return k3emu::set_err(cudaErrorInvalidValue);
    *p = nullptr;
    FORBID_IN_CAPTURE("cudaMallocHost");
    if (posix_memalign(p, 64, n ? n : 1)) return k3emu::set_err(cudaErrorMemoryAllocation);
    return cudaSuccess;
}
cudaError_t cudaFreeHost(void *p) {
    FORBID_IN_CAPTURE("cudaFreeHost");
    k3emu::sync_streams(true);
    free(p);
    return cudaSuccess;
}

/* the NCCL stand-in's transfers: after every stream's work so far (stream order), with the range
 * open; nested calls on one thread only count */
static thread_local int t_open;
void k3emu_device_open(void) {
    if (t_open++ == 0) k3emu::sync_streams(true);
    k3emu::work_begin();
}
void k3emu_device_close(void) {
    k3emu::work_end();
    if (--t_open == 0) k3emu::close_idle();
}

} // extern "C"
