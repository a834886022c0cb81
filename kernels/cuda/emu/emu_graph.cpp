/* emu_graph.cpp — k3's CUDA emulation (K3_CUDA_EMULATE builds only): CUDA graphs as record and
 * replay. cudaStreamBeginCapture puts a stream in capture: from then on every operation enqueued
 * on it (kernel launches through K3C_LAUNCH, cudaMemcpyAsync / cudaMemcpy2DAsync /
 * cudaMemsetAsync, cudaEventRecord, and k3emu_stream_host_work, which the NCCL stand-in uses for
 * its groups) becomes a node holding a copy of its arguments, and nothing runs. EndCapture returns
 * the node list as a graph; GraphInstantiate shares it (refcounted) with an exec; GraphLaunch
 * enqueues one operation on the launch stream whose worker replays the nodes in order, inside one
 * work_begin / work_end (the device range open), so pointers are read at launch, by-value
 * arguments are those of the capture, as on the device. A graph holding host work (the NCCL
 * stand-in's groups, which call MPI: the host thread's only, MPI_THREAD_FUNNELED) is replayed on
 * the host thread instead, after every stream's work (k3emu_device_open), as its group would run
 * outside a capture. An event recorded in the capture completes with the launch's operation.
 * What CUDA forbids in a capture is an error here too, with a `k3emu:` line naming the call:
 * synchronous copies and memsets, stream / event / device synchronize and query, cudaMalloc /
 * cudaFree (and the host variants), a wait on an event not recorded in the capture, and a graph
 * launch into a capturing stream. The call returns cudaErrorStreamCaptureUnsupported and
 * invalidates the capture: later operations on the stream return
 * cudaErrorStreamCaptureInvalidated and EndCapture returns it with a NULL graph. Mode Global
 * (the default) checks calls from every thread, ThreadLocal from the capturing thread only,
 * Relaxed only calls that name the capturing stream. Not emulated: fork/join of other streams
 * into a capture, child graphs, graph updates. */
#include "emu_graph.h"
#include "emu_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <vector>

namespace {

struct node {
    const char *what;
    void (*run)(void *, cudaStream_t);
    void *data;
    void (*drop)(void *);
    bool host;      /* host work: the graph replays on the host thread */
    cudaEvent_t ev; /* an event record: completes with the launch */
};

/* a captured node list, shared by a graph and the execs made from it */
struct nodes {
    std::vector<node> v;
    int refs;
};

void release(nodes *n) {
    if (!n || --n->refs > 0) return;
    for (const node &x : n->v)
        if (x.drop) x.drop(x.data);
    delete n;
}

struct capture {
    cudaStream_t s;
    cudaStreamCaptureMode mode;
    pthread_t thread;
    bool invalid;
    nodes *n;
    std::vector<cudaEvent_t> events; /* recorded on s inside the capture */
};

pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
std::vector<capture> g_caps;
int g_n_caps; /* g_caps.size(), read without the lock for the fast path */
unsigned long long g_graph_launches;

struct lock {
    lock() {
        pthread_mutex_lock(&g_mu);
    }
    ~lock() {
        pthread_mutex_unlock(&g_mu);
    }
};

capture *find(cudaStream_t s) {
    for (capture &c : g_caps)
        if (c.s == s) return &c;
    return nullptr;
}

const char *mode_name(cudaStreamCaptureMode m) {
    return m == cudaStreamCaptureModeGlobal        ? "global"
           : m == cudaStreamCaptureModeThreadLocal ? "thread-local"
                                                   : "relaxed";
}

struct kernel_node {
    const char *name;
    dim3 grid, block;
    size_t shmem;
    void (*body)(void *);
    void *closure;
    void (*drop)(void *);
};

struct host_node {
    void (*fn)(void *);
    void *data;
    void (*drop)(void *);
};

} // namespace

namespace k3emu {

bool capturing(cudaStream_t s) {
    if (!__atomic_load_n(&g_n_caps, __ATOMIC_ACQUIRE) || !s) return false;
    lock l;
    return find(s) != nullptr;
}

cudaError_t capture_node(cudaStream_t s, const char *what, void (*run)(void *, cudaStream_t),
                         void *data, void (*drop)(void *), bool host, cudaEvent_t ev) {
    {
        lock l;
        capture *c = find(s);
        if (c && !c->invalid) {
            c->n->v.push_back(node{what, run, data, drop, host, ev});
            return cudaSuccess;
        }
        if (!c) fprintf(stderr, "k3emu: %s: stream %p is not capturing\n", what, (void *)s);
    }
    if (drop) drop(data);
    return cudaErrorStreamCaptureInvalidated;
}

void capture_kernel(const char *name, const dim3 &grid, const dim3 &block, size_t shmem,
                    cudaStream_t s, void (*body)(void *), void *closure, void (*drop)(void *)) {
    kernel_node *k = new kernel_node{name, grid, block, shmem, body, closure, drop};
    (void)note_error(capture_node(
        s, name,
        [](void *p, cudaStream_t st) {
            (void)st;
            const kernel_node *x = static_cast<const kernel_node *>(p);
            if (!exec_grid(
                    grid_job{x->name, x->grid, x->block, x->shmem, x->body, x->closure, nullptr}))
                set_async_error(cudaErrorLaunchFailure);
        },
        k,
        [](void *p) {
            kernel_node *x = static_cast<kernel_node *>(p);
            x->drop(x->closure);
            delete x;
        }));
}

cudaError_t forbid_in_capture(const char *api, cudaStream_t s) {
    if (!__atomic_load_n(&g_n_caps, __ATOMIC_ACQUIRE)) return cudaSuccess;
    lock l;
    const pthread_t me = pthread_self();
    for (capture &c : g_caps) {
        const bool applies =
            (s && c.s == s) || c.mode == cudaStreamCaptureModeGlobal ||
            (c.mode == cudaStreamCaptureModeThreadLocal && pthread_equal(c.thread, me));
        if (!applies) continue;
        fprintf(stderr,
                "k3emu: %s during the capture of stream %p (%s mode): CUDA forbids it inside a "
                "stream capture (cudaErrorStreamCaptureUnsupported); the capture is invalidated\n",
                api, (void *)c.s, mode_name(c.mode));
        c.invalid = true;
        return cudaErrorStreamCaptureUnsupported;
    }
    return cudaSuccess;
}

bool event_in_capture(cudaStream_t s, cudaEvent_t e) {
    lock l;
    const capture *c = find(s);
    if (!c) return false;
    for (cudaEvent_t x : c->events)
        if (x == e) return true;
    return false;
}

void note_event(cudaStream_t s, cudaEvent_t e) {
    lock l;
    if (capture *c = find(s)) c->events.push_back(e);
}

} // namespace k3emu

extern "C" {

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    if (!s) {
        fprintf(stderr, "k3emu: cudaStreamBeginCapture on the legacy default stream (CUDA "
                        "cannot capture it)\n");
        return k3emu::note_error(cudaErrorStreamCaptureUnsupported);
    }
    if ((unsigned)mode > cudaStreamCaptureModeRelaxed)
        return k3emu::note_error(cudaErrorInvalidValue);
    lock l;
    if (find(s)) {
        fprintf(stderr, "k3emu: cudaStreamBeginCapture: stream %p is already capturing\n",
                (void *)s);
        return k3emu::note_error(cudaErrorIllegalState);
    }
    nodes *n = new nodes;
    n->refs = 1;
    g_caps.push_back(capture{s, mode, pthread_self(), false, n, {}});
    __atomic_store_n(&g_n_caps, (int)g_caps.size(), __ATOMIC_RELEASE);
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *graph) {
    if (!graph) return k3emu::note_error(cudaErrorInvalidValue);
    *graph = nullptr;
    nodes *n = nullptr;
    bool invalid = false;
    {
        lock l;
        capture *c = find(s);
        if (!c) {
            fprintf(stderr, "k3emu: cudaStreamEndCapture: stream %p is not capturing\n", (void *)s);
            return k3emu::note_error(cudaErrorIllegalState);
        }
        n = c->n;
        invalid = c->invalid;
        g_caps.erase(g_caps.begin() + (c - g_caps.data()));
        __atomic_store_n(&g_n_caps, (int)g_caps.size(), __ATOMIC_RELEASE);
    }
    if (invalid) {
        release(n);
        return k3emu::note_error(cudaErrorStreamCaptureInvalidated);
    }
    *graph = reinterpret_cast<cudaGraph_t>(n);
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status) {
    if (!status) return k3emu::note_error(cudaErrorInvalidValue);
    lock l;
    const capture *c = s ? find(s) : nullptr;
    *status = !c           ? cudaStreamCaptureStatusNone
              : c->invalid ? cudaStreamCaptureStatusInvalidated
                           : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags) {
    (void)flags;
    if (!exec || !graph) return k3emu::note_error(cudaErrorInvalidValue);
    nodes *n = reinterpret_cast<nodes *>(graph);
    n->refs++;
    *exec = reinterpret_cast<cudaGraphExec_t>(n);
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (!exec) return k3emu::note_error(cudaErrorInvalidResourceHandle);
    if (k3emu::capturing(s)) {
        fprintf(stderr,
                "k3emu: cudaGraphLaunch into capturing stream %p (child graphs are not "
                "emulated)\n",
                (void *)s);
        return k3emu::note_error(cudaErrorStreamCaptureUnsupported);
    }
    __atomic_fetch_add(&g_graph_launches, 1, __ATOMIC_RELAXED);
    nodes *n = reinterpret_cast<nodes *>(exec);
    bool host = false;
    std::vector<cudaEvent_t> evs;
    for (const node &x : n->v) {
        host = host || x.host;
        if (x.ev) evs.push_back(x.ev);
    }
    struct launch {
        nodes *n;
        cudaStream_t s;
    };
    auto replay = [](void *p) {
        const launch *l = static_cast<const launch *>(p);
        for (const node &x : l->n->v) x.run(x.data, l->s);
    };
    if (host) { /* on this thread, after every stream's work, as an NCCL group outside a capture */
        launch l{n, s};
        for (cudaEvent_t e : evs) k3emu::event_done_now(e, s);
        k3emu_device_open();
        replay(&l);
        k3emu_device_close();
        return cudaSuccess;
    }
    n->refs++; /* the exec may be destroyed before the stream runs the launch */
    k3emu::enqueue_host_op(
        s, replay, new launch{n, s},
        [](void *p) {
            release(static_cast<launch *>(p)->n);
            delete static_cast<launch *>(p);
        },
        true, evs.data(), evs.size());
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    release(reinterpret_cast<nodes *>(exec));
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    release(reinterpret_cast<nodes *>(graph));
    return cudaSuccess;
}

cudaError_t k3emu_stream_host_work(cudaStream_t s, void (*fn)(void *), void *data,
                                   void (*drop)(void *)) {
    if (!fn) return k3emu::note_error(cudaErrorInvalidValue);
    if (!k3emu::capturing(s)) { /* after every stream's work, on this thread */
        k3emu_device_open();
        fn(data);
        k3emu_device_close();
        if (drop) drop(data);
        return cudaSuccess;
    }
    host_node *h = new host_node{fn, data, drop};
    return k3emu::note_error(k3emu::capture_node(
        s, "host work",
        [](void *p, cudaStream_t) {
            const host_node *x = static_cast<const host_node *>(p);
            x->fn(x->data);
        },
        h,
        [](void *p) {
            host_node *x = static_cast<host_node *>(p);
            if (x->drop) x->drop(x->data);
            delete x;
        },
        true));
}

unsigned long long k3emu_graph_launches(void) {
    return __atomic_load_n(&g_graph_launches, __ATOMIC_RELAXED);
}

} // extern "C"
