/* emu_runtime.cpp — k3's CUDA emulation (K3_CUDA_EMULATE builds only): the runtime API of
 * cuda_runtime_api.h on host memory, and the grid runner behind K3C_LAUNCH (k3emu_device.h).
 *
 * Grid runner: blocks one after another (x fastest, then y, z); the threads of a block are fibers
 * on the calling host thread, switched by a 6-register swap (x86-64; ucontext elsewhere), each on
 * its own stack with a guard page below it. A sweep resumes every runnable fiber until it
 * waits or ends; then a barrier whose whole group has arrived is released. A sweep that can
 * release nothing while threads still wait is a divergent barrier: reported, and the rest of the
 * launch is skipped. Under ASan the switches are announced (__sanitizer_*_switch_fiber).
 * A launch is enqueued on its stream (emu_streams.cpp) and run by the stream's worker thread
 * (exec_grid); device memory is emu_devmem.cpp's. The free/total of cudaMemGetInfo are an
 * emulated device of K3_EMU_DEVICE_MEM_GB GiB (default 64) less the bytes allocated. */
#include "emu_graph.h"
#include "emu_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#define K3EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define K3EMU_ASAN 1
#endif
#endif
#ifdef K3EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace k3emu {
static thread_local fiber *cur_fiber;
static thread_local launch_state *cur_launch;
fiber *self(void) {
    return cur_fiber;
}
launch_state *launch(void) {
    return cur_launch;
}
} // namespace k3emu

using k3emu::fiber;

namespace {

enum { ST_READY, ST_WAIT_BLOCK, ST_WAIT_WARP, ST_DONE };
enum { MAX_THREADS = 1024, MAX_SHARED = 48 * 1024, MAX_DECLS = 64 };
#ifdef K3EMU_ASAN
const size_t STACK_BYTES = 512 * 1024;
#else
const size_t STACK_BYTES = 128 * 1024;
#endif

thread_local cudaError_t g_last_err = cudaSuccess;
unsigned long long g_launches, g_blocks, g_threads, g_switches, g_mma;
/* warp-level mma instructions per kernel name (k3emu_mma_count) */
enum { MAX_MMA_KERNELS = 128 };
struct mma_count {
    const char *name;
    unsigned long long n;
} g_mma_by[MAX_MMA_KERNELS];
unsigned g_n_mma_by;
/* K3_EMU_SEED (or k3emu_set_seed): 0 = blocks in index order and fibers resumed in thread order;
 * else both shuffled (a seed-dependent affine permutation of the blocks per launch, a fresh
 * Fisher-Yates order of the fibers per sweep), so an ordering race shows as a difference between
 * seeds */
unsigned long long g_seed, g_rng;
bool g_seed_set;
unsigned long long seed(void) {
    if (!g_seed_set) {
        const char *v = getenv("K3_EMU_SEED");
        g_seed = v && *v ? strtoull(v, nullptr, 0) : 0;
        g_rng = g_seed;
        g_seed_set = true;
    }
    return g_seed;
}
unsigned long long rng_next(void) { /* splitmix64 */
    unsigned long long z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
unsigned long long gcd(unsigned long long a, unsigned long long b) {
    while (b) {
        const unsigned long long t = a % b;
        a = b, b = t;
    }
    return a;
}
int g_device;

using k3emu::set_err;

/* ---- fibers -------------------------------------------------------------------------------- */
#if defined(__x86_64__)
extern "C" void k3emu_switch(void **save_sp, void *to_sp);
extern "C" void k3emu_fiber_start(void);
__asm__(".text\n"
        ".globl k3emu_switch\n"
        ".type k3emu_switch,@function\n"
        "k3emu_switch:\n"
        "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
        "  ret\n"
        ".size k3emu_switch, .-k3emu_switch\n"
        ".globl k3emu_fiber_start\n"
        ".type k3emu_fiber_start,@function\n"
        "k3emu_fiber_start:\n"
        "  call k3emu_fiber_main\n"
        "  ud2\n"
        ".size k3emu_fiber_start, .-k3emu_fiber_start\n");
#endif

struct block_run {
    const char *name;
    void (*body)(void *);
    void *closure;
    fiber *f;
    unsigned n;
    void *sched_sp;
#if !defined(__x86_64__)
    ucontext_t sched_uc, *uc;
#endif
    const void *sched_stack_bottom;
    size_t sched_stack_size;
    /* shared memory of this launch */
    void *decl[MAX_DECLS];
    const void *decl_site[MAX_DECLS];
    size_t decl_bytes[MAX_DECLS];
    unsigned n_decl;
    size_t static_bytes;
    void *dyn;
    size_t dyn_bytes;
    /* each waiting lane's value, per warp; copied into the group's fibers at release */
    uint64_t (*warp_val)[32];
    int block_pred_count;
    bool failed;
    char what[256];
};
thread_local block_run *g_run;

void fail(block_run *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void fail(block_run *r, const char *fmt, ...) {
    if (r->failed) return;
    r->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->what, sizeof r->what, fmt, ap);
    va_end(ap);
    fprintf(stderr, "k3emu: kernel %s, block (%u,%u,%u): %s\n", r->name, k3emu::cur_launch->bid.x,
            k3emu::cur_launch->bid.y, k3emu::cur_launch->bid.z, r->what);
}

/* switch from the current fiber to the scheduler */
void to_scheduler(fiber *f, bool dying) {
    block_run *r = g_run;
    g_switches++;
#ifdef K3EMU_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &f->asan_fake, r->sched_stack_bottom,
                                   r->sched_stack_size);
#endif
#if defined(__x86_64__)
    k3emu_switch(&f->sp, r->sched_sp);
#else
    swapcontext(&r->uc[f->lin], &r->sched_uc);
#endif
#ifdef K3EMU_ASAN
    __sanitizer_finish_switch_fiber(f->asan_fake, nullptr, nullptr);
#endif
    (void)dying;
}

/* resume fiber f from the scheduler until it waits or ends */
void resume(block_run *r, fiber *f) {
    k3emu::cur_fiber = f;
    void *fake = nullptr;
#ifdef K3EMU_ASAN
    __sanitizer_start_switch_fiber(&fake, (char *)f->stack, f->stack_size);
#endif
#if defined(__x86_64__)
    k3emu_switch(&r->sched_sp, f->sp);
#else
    swapcontext(&r->sched_uc, &r->uc[f->lin]);
#endif
#ifdef K3EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    (void)fake;
    k3emu::cur_fiber = nullptr;
}

} // namespace

extern "C" void k3emu_fiber_main(void) {
    block_run *r = g_run;
    fiber *f = k3emu::cur_fiber;
#ifdef K3EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &r->sched_stack_bottom, &r->sched_stack_size);
#endif
    r->body(r->closure);
    f->state = ST_DONE;
    to_scheduler(f, true);
    abort(); /* a finished fiber is never resumed */
}

namespace {
#if !defined(__x86_64__)
void uc_entry(void) {
    k3emu_fiber_main();
}
#endif

/* The stacks: MAX_THREADS of STACK_BYTES with a PROT_NONE guard page below each, made once per
 * host thread and reused by every block. */
thread_local char *g_stacks;
size_t page_bytes(void) {
    static size_t p = (size_t)sysconf(_SC_PAGESIZE);
    return p;
}
void stacks_release(void) {
    if (!g_stacks) return;
#ifdef K3EMU_ASAN /* no stale frame shadow for whatever reuses the addresses */
    for (unsigned i = 0; i < MAX_THREADS; i++)
        __asan_unpoison_memory_region(g_stacks + i * (STACK_BYTES + page_bytes()) + page_bytes(),
                                      STACK_BYTES);
#endif
    munmap(g_stacks, (STACK_BYTES + page_bytes()) * MAX_THREADS);
    g_stacks = nullptr;
}
bool stacks_ready(void) {
    if (g_stacks) return true;
    const size_t one = STACK_BYTES + page_bytes();
    void *m = mmap(nullptr, one * MAX_THREADS, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return false;
    for (unsigned i = 0; i < MAX_THREADS; i++)
        mprotect((char *)m + i * one, page_bytes(), PROT_NONE);
    g_stacks = (char *)m;
    return true;
}

void fiber_init(block_run *r, fiber *f, unsigned lin, const dim3 &b) {
    const size_t one = STACK_BYTES + page_bytes();
    f->stack = g_stacks + lin * one + page_bytes();
    f->stack_size = STACK_BYTES;
    f->lin = lin;
    f->tid = uint3{lin % b.x, lin / b.x % b.y, lin / (b.x * b.y)};
    f->state = ST_READY;
    f->mask = 0;
    f->pred = 0;
    f->asan_fake = nullptr;
    f->op = nullptr;
    f->n_cp = 0;
    f->cp_groups = 0;
#if defined(__x86_64__)
    uintptr_t top = ((uintptr_t)f->stack + STACK_BYTES) & ~(uintptr_t)15;
    uintptr_t *sp = (uintptr_t *)top;
    *--sp = (uintptr_t)k3emu_fiber_start;  /* ret target; rsp = top (16-aligned) after it */
    for (int i = 0; i < 6; i++) *--sp = 0; /* rbp rbx r12 r13 r14 r15 */
    f->sp = sp;
#else
    ucontext_t *uc = &r->uc[lin];
    getcontext(uc);
    uc->uc_stack.ss_sp = f->stack;
    uc->uc_stack.ss_size = STACK_BYTES;
    uc->uc_link = nullptr;
    makecontext(uc, uc_entry, 0);
#endif
    (void)r;
}

bool same_op(const char *a, const char *b) {
    return a == b || (a && b && !strcmp(a, b));
}

/* One sweep's bookkeeping: release the barriers whose group has fully arrived. Returns true when
 * something was released; false with r->failed set on a divergent barrier. */
bool release(block_run *r) {
    const unsigned n = r->n;
    unsigned live = 0, at_block = 0, done = 0;
    for (unsigned i = 0; i < n; i++) {
        live += r->f[i].state != ST_DONE;
        done += r->f[i].state == ST_DONE;
        at_block += r->f[i].state == ST_WAIT_BLOCK;
    }
    bool any = false;
    /* warps: a group (the lanes one mask names) is released when all of them wait in a
     * collective with that same mask; disjoint groups of one warp are independent */
    for (unsigned w = 0; w * 32 < n; w++) {
        const unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
        unsigned seen = 0;
        for (unsigned i = lo; i < hi; i++) {
            const fiber &fi = r->f[i];
            if (fi.state != ST_WAIT_WARP || (seen >> (i - lo) & 1u)) continue;
            const unsigned mask = fi.mask;
            if (!(mask >> (i - lo) & 1u)) {
                fail(r, "thread %u waits in a warp primitive whose mask 0x%08x leaves it out", i,
                     mask);
                return false;
            }
            seen |= mask;
            bool all = true;
            for (unsigned l = 0; l < 32; l++) {
                if (!(mask >> l & 1u)) continue;
                if (lo + l >= hi) {
                    fail(r, "warp primitive with mask 0x%08x names lane %u of a warp of %u threads",
                         mask, l, hi - lo);
                    return false;
                }
                const fiber &g = r->f[lo + l];
                if (g.state == ST_DONE) {
                    fail(r, "warp primitive with mask 0x%08x: lane %u (thread %u) has exited", mask,
                         l, lo + l);
                    return false;
                }
                /* lanes of one mask at different warp-wide instructions never meet */
                if (g.state == ST_WAIT_WARP && g.mask == mask && !same_op(g.op, fi.op)) {
                    fail(r, "lane %u (thread %u) waits in %s while lane %u waits in %s", i - lo, i,
                         fi.op ? fi.op : "a shuffle/vote", l, g.op ? g.op : "a shuffle/vote");
                    return false;
                }
                /* elsewhere (a barrier, or a collective with another mask): not arrived yet */
                all = all && g.state == ST_WAIT_WARP && g.mask == mask;
            }
            if (!all) continue;
            for (unsigned l = 0; l < 32; l++)
                if (mask >> l & 1u) {
                    fiber &g = r->f[lo + l];
                    memcpy(g.got, r->warp_val[w], sizeof g.got);
                    g.state = ST_READY;
                }
            any = true;
        }
    }
    if (any) return true;
    if (at_block && at_block == live) {
        if (done) {
            fail(r, "__syncthreads() reached by %u of %u threads: %u have exited", at_block, n,
                 done);
            return false;
        }
        int cnt = 0;
        for (unsigned i = 0; i < n; i++) cnt += r->f[i].pred;
        r->block_pred_count = cnt;
        for (unsigned i = 0; i < n; i++) r->f[i].state = ST_READY;
        return true;
    }
    if (live) {
        unsigned at_warp = live - at_block;
        fail(r,
             "deadlock: %u threads wait in __syncthreads() and %u in warp primitives that cannot "
             "complete (a barrier in divergent code?)",
             at_block, at_warp);
    }
    return false;
}

void poison_shared(block_run *r) {
    for (unsigned i = 0; i < r->n_decl; i++) memset(r->decl[i], 0xff, r->decl_bytes[i]);
    if (r->dyn_bytes) memset(r->dyn, 0xff, r->dyn_bytes);
}

} // namespace

/* ---- device-side entry points (k3emu_device.h) ----------------------------------------------- */
namespace k3emu {

void thread_done(void) {
    stacks_release();
}

cudaError_t set_err(cudaError_t e) {
    if (e != cudaSuccess && g_last_err == cudaSuccess) g_last_err = e;
    return e;
}

unsigned lane_id(void) {
    return cur_fiber->lin & 31u;
}

void syncthreads(void) {
    (void)syncthreads_count(0);
}

int syncthreads_count(int pred) {
    fiber *f = cur_fiber;
    f->pred = pred != 0;
    f->state = ST_WAIT_BLOCK;
    to_scheduler(f, false);
    return g_run->block_pred_count;
}

const uint64_t *warp_exchange(unsigned mask, uint64_t v) {
    return warp_exchange_op(mask, v, nullptr);
}

const uint64_t *warp_exchange_op(unsigned mask, uint64_t v, const char *op) {
    fiber *f = cur_fiber;
    f->op = op;
    block_run *r = g_run;
    r->warp_val[f->lin / 32][f->lin & 31u] = v;
    f->mask = mask;
    f->state = ST_WAIT_WARP;
    to_scheduler(f, false);
    return f->got;
}

void *shared_static(const void *site, size_t bytes, size_t align, const char *what) {
    block_run *r = g_run;
    for (unsigned i = 0; i < r->n_decl; i++)
        if (r->decl_site[i] == site) return r->decl[i];
    const unsigned ix = r->n_decl;
    if (ix >= MAX_DECLS) {
        fail(r, "more than %d shared declarations", MAX_DECLS);
        abort();
    }
    void *p = nullptr;
    if (posix_memalign(&p, align < 16 ? 16 : align, bytes ? bytes : 1)) abort();
    memset(p, 0xff, bytes);
    r->decl[ix] = p;
    r->decl_site[ix] = site;
    r->decl_bytes[ix] = bytes;
    r->n_decl = ix + 1;
    r->static_bytes += bytes;
    if (r->static_bytes + r->dyn_bytes > MAX_SHARED)
        fail(r,
             "%zu bytes of static + %zu of dynamic shared memory (at %s) exceed the %d of a "
             "block",
             r->static_bytes, r->dyn_bytes, what, MAX_SHARED);
    return p;
}

void *shared_dynamic(void) {
    return g_run->dyn;
}

void device_error(const char *fmt, ...) {
    char msg[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fail(g_run, "thread %u: %s", cur_fiber->lin, msg);
}

bool in_shared(const void *p, size_t n) {
    const block_run *r = g_run;
    const uintptr_t a = (uintptr_t)p;
    for (unsigned i = 0; i < r->n_decl; i++) {
        const uintptr_t b = (uintptr_t)r->decl[i];
        if (a >= b && a + n <= b + r->decl_bytes[i]) return true;
    }
    const uintptr_t d = (uintptr_t)r->dyn;
    return r->dyn_bytes && a >= d && a + n <= d + r->dyn_bytes;
}

void count_mma(void) {
    const char *name = g_run->name;
    g_mma++;
    for (unsigned i = 0; i < g_n_mma_by; i++)
        if (!strcmp(g_mma_by[i].name, name)) {
            g_mma_by[i].n++;
            return;
        }
    if (g_n_mma_by < MAX_MMA_KERNELS) g_mma_by[g_n_mma_by++] = mma_count{name, 1};
}

/* cp.async: the source is read at issue (the device may read it any time before the wait), the
 * destination is poisoned (0xff: NaN) until the wait_group that completes its group */
void cp_async16(void *dst, const void *src) {
    fiber *f = cur_fiber;
    if (((uintptr_t)dst | (uintptr_t)src) & 15u) {
        device_error("cp.async 16 B: dst %p or src %p is not 16-byte aligned", dst, src);
        return;
    }
    if (!in_shared(dst, 16)) {
        device_error("cp.async destination %p is outside every shared-memory array", dst);
        return;
    }
    if (in_shared(src, 16)) {
        device_error("cp.async source %p is shared memory, not global", src);
        return;
    }
    if (f->n_cp >= sizeof f->cp / sizeof f->cp[0]) {
        device_error("more than %zu cp.async copies pending (a missing wait_group?)",
                     sizeof f->cp / sizeof f->cp[0]);
        return;
    }
    fiber::cp_pending &c = f->cp[f->n_cp++];
    c.dst = dst;
    c.group = f->cp_groups;
    memcpy(c.data, src, 16);
    memset(dst, 0xff, 16);
}

void cp_commit(void) {
    cur_fiber->cp_groups++;
}

void cp_wait(unsigned n) {
    fiber *f = cur_fiber;
    /* complete every committed group but the newest n; the open group stays pending */
    unsigned kept = 0;
    for (unsigned i = 0; i < f->n_cp; i++) {
        fiber::cp_pending &c = f->cp[i];
        if (c.group < f->cp_groups && f->cp_groups - c.group > n)
            memcpy(c.dst, c.data, 16);
        else
            f->cp[kept++] = c;
    }
    f->n_cp = kept;
}

void run_grid(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t s,
              void (*body)(void *), void *closure, void (*drop)(void *)) {
    g_launches++;
    const unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
    if (!grid.x || !grid.y || !grid.z || !nt || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535 || block.x > 1024 || block.y > 1024 || block.z > 64 || nt > MAX_THREADS) {
        fprintf(stderr,
                "k3emu: kernel %s: invalid configuration: grid (%u,%u,%u), block (%u,%u,%u)\n",
                name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
        set_err(cudaErrorInvalidConfiguration);
        drop(closure);
        return;
    }
    if (shmem > MAX_SHARED) {
        fprintf(stderr, "k3emu: kernel %s: %zu bytes of dynamic shared memory (at most %d)\n", name,
                shmem, MAX_SHARED);
        set_err(cudaErrorInvalidValue);
        drop(closure);
        return;
    }
    if (capturing(s)) /* a node of the graph, which owns the closure (emu_graph.cpp) */
        capture_kernel(name, grid, block, shmem, s, body, closure, drop);
    else
        enqueue_grid(s, grid_job{name, grid, block, shmem, body, closure, drop});
}

/* one grid on the calling thread (a stream's worker, inside work_begin / work_end) */
bool exec_grid(const grid_job &j) {
    const char *name = j.name;
    const dim3 grid = j.grid, block = j.block;
    const size_t shmem = j.shmem;
    void (*body)(void *) = j.body;
    void *closure = j.closure;
    const unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
    if (!stacks_ready()) {
        fprintf(stderr, "k3emu: kernel %s: no memory for the fibers' stacks\n", name);
        return false;
    }
    static thread_local fiber fibers[MAX_THREADS];
    static thread_local uint64_t warp_val[MAX_THREADS / 32][32];
    block_run run;
    memset(&run, 0, sizeof run);
    run.name = name;
    run.body = body;
    run.closure = closure;
    run.f = fibers;
    run.n = (unsigned)nt;
    run.warp_val = warp_val;
    run.dyn_bytes = shmem;
    if (posix_memalign(&run.dyn, 16, shmem ? shmem : 1)) abort();
#if !defined(__x86_64__)
    static thread_local ucontext_t ucs[MAX_THREADS];
    run.uc = ucs;
#endif
    block_run *outer = g_run;
    launch_state *outer_l = cur_launch;
    launch_state ls;
    ls.bdim = block;
    ls.gdim = grid;
    g_run = &run;
    cur_launch = &ls;
    /* block i runs block (mul·i + add) mod nb: the identity without a seed */
    const unsigned long long nb = (unsigned long long)grid.x * grid.y * grid.z;
    unsigned long long mul = 1, add = 0;
    const bool shuffled = seed() != 0;
    if (shuffled && nb > 1) {
        do mul = rng_next() % nb;
        while (mul == 0 || gcd(mul, nb) != 1);
        add = rng_next() % nb;
    }
    static thread_local unsigned order[MAX_THREADS];
    for (unsigned i = 0; i < run.n; i++) order[i] = i;
    for (unsigned long long bi = 0; bi < nb && !run.failed; bi++) {
        const unsigned long long b = (unsigned long long)(((unsigned __int128)mul * bi + add) % nb);
        ls.bid = uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                       (unsigned)(b / ((unsigned long long)grid.x * grid.y))};
        g_blocks++;
        g_threads += nt;
        poison_shared(&run);
        for (unsigned i = 0; i < run.n; i++) fiber_init(&run, &fibers[i], i, block);
        unsigned done = 0;
        while (done < run.n && !run.failed) {
            if (shuffled)
                for (unsigned i = run.n - 1; i > 0; i--) {
                    const unsigned j = (unsigned)(rng_next() % (i + 1)), t = order[i];
                    order[i] = order[j], order[j] = t;
                }
            for (unsigned i = 0; i < run.n; i++)
                if (fibers[order[i]].state == ST_READY) resume(&run, &fibers[order[i]]);
            done = 0;
            for (unsigned i = 0; i < run.n; i++) done += fibers[i].state == ST_DONE;
            if (done < run.n) {
                if (!release(&run)) break;
            }
        }
        if (run.failed) {
#ifdef K3EMU_ASAN
            /* fibers left mid-kernel: their frames' shadow must not leak into reuse */
            for (unsigned i = 0; i < run.n; i++)
                __asan_unpoison_memory_region(fibers[i].stack, fibers[i].stack_size);
#endif
        }
    }
    for (unsigned i = 0; i < run.n_decl; i++) free(run.decl[i]);
    free(run.dyn);
    g_run = outer;
    cur_launch = outer_l;
    return !run.failed;
}

cudaError_t note_error(cudaError_t e) {
    return set_err(e);
}

} // namespace k3emu

/* ---- the runtime API ---------------------------------------------------------------------- */
extern "C" {

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
        return "cudaErrorInitializationError";
    case cudaErrorLaunchFailure:
        return "cudaErrorLaunchFailure";
    case cudaErrorInvalidConfiguration:
        return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice:
        return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
        return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
        return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
        return "cudaErrorNotReady";
    case cudaErrorIllegalState:
        return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported:
        return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
        return "cudaErrorStreamCaptureInvalidated";
    default:
        return "cudaErrorUnknown";
    }
}
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorLaunchFailure:
        return "unspecified launch failure (k3emu: a kernel broke a CUDA rule; see the k3emu line "
               "above)";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
        return "invalid resource handle";
    case cudaErrorNotReady:
        return "device not ready";
    case cudaErrorIllegalState:
        return "the operation is not permitted in this state (k3emu: see the k3emu line above)";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing (k3emu: see the k3emu line "
               "above)";
    case cudaErrorStreamCaptureInvalidated:
        return "operation failed due to a previous error during capture";
    default:
        return "unknown error";
    }
}
/* the host thread's own error first, else the error of device work that failed since */
cudaError_t cudaGetLastError(void) {
    cudaError_t e = g_last_err;
    g_last_err = cudaSuccess;
    return e != cudaSuccess ? e : k3emu::async_error(true);
}
cudaError_t cudaPeekAtLastError(void) {
    return g_last_err != cudaSuccess ? g_last_err : k3emu::async_error(false);
}

static int emu_devices(void) {
    const char *v = getenv("K3_EMU_DEVICES");
    return v && *v ? atoi(v) : 1;
}
cudaError_t cudaGetDeviceCount(int *count) {
    if (!count) return set_err(cudaErrorInvalidValue);
    *count = emu_devices();
    return *count > 0 ? cudaSuccess : set_err(cudaErrorNoDevice);
}
cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= emu_devices()) return set_err(cudaErrorInvalidDevice);
    g_device = device;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *device) {
    if (!device) return set_err(cudaErrorInvalidValue);
    *device = g_device;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    const char *v = getenv("K3_EMU_DEVICE_MEM_GB");
    const size_t total = (size_t)((v && *v ? atof(v) : 64.0) * (double)((size_t)1 << 30));
    if (total_bytes) *total_bytes = total;
    const size_t used = k3emu::dev_allocated();
    if (free_bytes) *free_bytes = used < total ? total - used : 0;
    return cudaSuccess;
}

void k3emu_get_counters(k3emu_counters *out) {
    out->launches = g_launches;
    out->blocks = g_blocks;
    out->threads = g_threads;
    out->switches = g_switches;
}

void k3emu_set_seed(unsigned long long s) {
    g_seed = s;
    g_rng = s;
    g_seed_set = true;
}

unsigned long long k3emu_mma_count(const char *kernel) {
    if (!kernel) return g_mma;
    for (unsigned i = 0; i < g_n_mma_by; i++)
        if (!strcmp(g_mma_by[i].name, kernel)) return g_mma_by[i].n;
    return 0;
}

} // extern "C"
