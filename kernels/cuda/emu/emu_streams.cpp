/* emu_streams.cpp — k3's CUDA emulation (K3_CUDA_EMULATE builds only): streams that really are
 * asynchronous (issue 44). Every stream (the legacy default stream, NULL, included) has a FIFO of
 * operations — kernel launches, copies, memsets, event records and event waits — and a worker
 * thread that runs them in order, each inside work_begin / work_end (one executor at a time, with
 * the device range open: emu_devmem.cpp). The host returns from an enqueue at once.
 *   - cudaStreamSynchronize / cudaEventSynchronize / cudaDeviceSynchronize wait for real;
 *     cudaStreamQuery / cudaEventQuery say cudaErrorNotReady while work is pending; an event's
 *     time is taken when the worker reaches it (cudaEventElapsedTime is the time between).
 *   - cudaStreamWaitEvent makes the stream's worker wait for the event's stream.
 *   - The legacy stream: an operation on NULL first waits for every blocking stream (created
 *     without cudaStreamNonBlocking), and one on a blocking stream for NULL — here by the host,
 *     before it enqueues (stricter than a device: it only adds order).
 *   - The synchronous calls (cudaMemcpy, cudaMemcpy2D, cudaMemset) wait for NULL and the blocking
 *     streams, then run on the calling thread; cudaFree / cudaFreeHost wait for every stream.
 *   - An asynchronous download (cudaMemcpyAsync / cudaMemcpy2DAsync into host memory) fills its
 *     destination with 0xff bytes (NaN floats, -1 integers) when it is enqueued, and the data
 *     lands only when the worker runs it: a host read before the stream or an event after the copy
 *     has synchronised reads the poison (a device would give stale or partial data, by chance).
 *     An upload reads its host source when the worker runs it (pinned-memory semantics).
 *   - A kernel that breaks a CUDA rule is reported when it runs (its k3emu: line); its error is
 *     returned by every synchronisation (and cudaMemcpy) from then on until cudaGetLastError
 *     returns it and clears it.
 * A stream in capture (emu_graph.cpp) records copies, memsets and event records as nodes instead
 * of queueing them, and the calls CUDA forbids in a capture (the synchronous ones, the queries,
 * allocation) fail it (forbid_in_capture).
 * Test hook: k3emu_stream_pause(s, 1) holds a stream's worker before its next operation (the
 * queue fills, nothing runs) until k3emu_stream_pause(s, 0). */
#include "emu_graph.h"
#include "emu_internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

namespace {

double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

struct op {
    void (*run)(void *); /* on the worker */
    void (*drop)(void *);
    void *arg;
    bool device; /* inside work_begin / work_end */
};

} // namespace

struct k3emu_stream {
    unsigned flags;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<op> q;
    unsigned long long enq = 0, done = 0; /* operations given, completed */
    bool started = false, stop = false, paused = false, exited = false;
    pthread_t th;
};
struct k3emu_event {
    unsigned flags;
    k3emu_stream *s = nullptr;  /* the stream of the last record (nullptr: never recorded) */
    unsigned long long seq = 0; /* that record's operation */
    double t = -1;              /* when the worker reached it */
};

namespace {

std::mutex g_reg_mu; /* the registry of streams */
std::vector<k3emu_stream *> *g_streams;
k3emu_stream *g_legacy;
std::mutex g_err_mu;
cudaError_t g_async_err = cudaSuccess;

/* The device stays held (its range open) from one device operation to the next while the queue
 * has more: one mprotect pair per burst of work, not per operation. It is let go before a wait on
 * another stream (which may need the device), when the stream is held, and when the queue runs
 * empty — before the last operation counts as done, so a synchronisation returns with the range
 * closed (unless another stream works on). */
void *worker(void *p) {
    k3emu_stream *s = (k3emu_stream *)p;
    bool held = false;
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
        if (held && (s->q.empty() || s->paused)) {
            lk.unlock();
            k3emu::work_end();
            held = false;
            lk.lock();
        }
        for (int i = 0; i < 64 && s->q.empty() && !s->stop; i++) { /* as drain: a short spin */
            lk.unlock();
            sched_yield();
            lk.lock();
        }
        const auto go = [s] { return s->stop || (!s->q.empty() && !s->paused); };
        if (!s->cv.wait_for(lk, std::chrono::milliseconds(1), go)) {
            lk.unlock(); /* idle: the range closes (emu_devmem.cpp) */
            k3emu::close_idle();
            lk.lock();
            s->cv.wait(lk, go);
        }
        if (s->q.empty() || s->paused) break; /* stop with nothing to run */
        const op o = s->q.front();
        lk.unlock();
        if (o.device && !held) k3emu::work_begin();
        if (!o.device && held) k3emu::work_end();
        held = o.device;
        o.run(o.arg);
        if (o.drop) o.drop(o.arg);
        lk.lock();
        s->q.pop_front();
        if (held && (s->q.empty() || s->paused)) { /* closed before anyone sees it done */
            lk.unlock();
            k3emu::work_end();
            held = false;
            lk.lock();
        }
        s->done++;
        s->cv.notify_all();
    }
    if (held) k3emu::work_end();
    k3emu::thread_done();
    s->exited = true;
    s->cv.notify_all();
    return nullptr;
}

k3emu_stream *registry_add(unsigned flags) {
    k3emu_stream *s = new k3emu_stream;
    s->flags = flags;
    std::lock_guard<std::mutex> lk(g_reg_mu);
    if (!g_streams) g_streams = new std::vector<k3emu_stream *>;
    g_streams->push_back(s);
    return s;
}

k3emu_stream *legacy(void) {
    static std::once_flag once;
    std::call_once(once, [] { g_legacy = registry_add(cudaStreamDefault); });
    return g_legacy;
}

k3emu_stream *of(cudaStream_t s) {
    return s ? s : legacy();
}

/* wait until s has run everything it was given so far */
void drain(k3emu_stream *s) {
    std::unique_lock<std::mutex> lk(s->mu);
    const unsigned long long target = s->enq;
    /* a short spin first: a step syncs often, and a sleeping host's wake-up costs a time slice */
    for (int i = 0; i < 64 && s->done < target; i++) {
        lk.unlock();
        sched_yield();
        lk.lock();
    }
    s->cv.wait(lk, [s, target] { return s->done >= target; });
    lk.unlock();
    k3emu::close_idle(); /* a synchronisation returns with the range closed, unless work runs */
}

/* until e's last record has run */
void event_wait(k3emu_event *e) {
    if (!e->s) return;
    {
        std::unique_lock<std::mutex> lk(e->s->mu);
        e->s->cv.wait(lk, [e] { return e->s->done >= e->seq; });
    }
    k3emu::close_idle();
}
bool event_pending(k3emu_event *e) {
    if (!e->s) return false;
    std::lock_guard<std::mutex> lk(e->s->mu);
    return e->s->done < e->seq;
}

/* the host's side of the legacy stream's order: before work on s, what it must follow */
void order_before(k3emu_stream *s) {
    std::vector<k3emu_stream *> wait;
    {
        std::lock_guard<std::mutex> lk(g_reg_mu);
        if (s == g_legacy) {
            for (k3emu_stream *o : *g_streams)
                if (o != s && !(o->flags & cudaStreamNonBlocking)) wait.push_back(o);
        } else if (!(s->flags & cudaStreamNonBlocking) && g_legacy) {
            wait.push_back(g_legacy);
        }
    }
    for (k3emu_stream *o : wait) drain(o);
}

/* s's worker, started at its first operation (s->mu held) */
void start_locked(k3emu_stream *s) {
    if (s->started) return;
    s->started = true;
    if (pthread_create(&s->th, nullptr, worker, s) != 0) {
        fprintf(stderr, "k3emu: cannot start a stream's worker thread\n");
        abort();
    }
}

void enqueue(cudaStream_t hs, op o) {
    k3emu_stream *s = of(hs);
    order_before(s);
    std::lock_guard<std::mutex> lk(s->mu);
    start_locked(s);
    s->q.push_back(o);
    s->enq++;
    s->cv.notify_all();
}

void set_async(cudaError_t e) {
    std::lock_guard<std::mutex> lk(g_err_mu);
    if (g_async_err == cudaSuccess) g_async_err = e;
}

/* a call CUDA forbids inside a stream capture (emu_graph.cpp) */
#define FORBID_IN_CAPTURE(api, s)                                                                  \
    do {                                                                                           \
        const cudaError_t cap_e_ = k3emu::forbid_in_capture(api, s);                               \
        if (cap_e_ != cudaSuccess) return k3emu::set_err(cap_e_);                                  \
    } while (0)

/* ---- the operations ---------------------------------------------------------------------- */
void run_grid_op(void *p) {
    if (!k3emu::exec_grid(*(k3emu::grid_job *)p)) set_async(cudaErrorLaunchFailure);
}
void drop_grid_op(void *p) {
    k3emu::grid_job *j = (k3emu::grid_job *)p;
    j->drop(j->closure);
    delete j;
}

struct copy2d {
    void *dst;
    const void *src;
    size_t dpitch, spitch, width, height;
    int v; /* memset: the byte; copy: -1 */
};
void run_copy(void *p) {
    const copy2d *c = (const copy2d *)p;
    for (size_t r = 0; r < c->height; r++) {
        char *d = (char *)c->dst + r * c->dpitch;
        if (c->v >= 0)
            memset(d, c->v, c->width);
        else
            memmove(d, (const char *)c->src + r * c->spitch, c->width);
    }
}
void drop_copy(void *p) {
    delete (copy2d *)p;
}

struct ev_rec {
    k3emu_event *e;
};
void run_record(void *p) {
    ((ev_rec *)p)->e->t = now_s();
}
void drop_record(void *p) {
    delete (ev_rec *)p;
}

struct ev_wait {
    k3emu_stream *s;
    unsigned long long seq;
};
void run_wait(void *p) {
    const ev_wait *w = (const ev_wait *)p;
    std::unique_lock<std::mutex> lk(w->s->mu);
    w->s->cv.wait(lk, [w] { return w->s->done >= w->seq; });
}
void drop_wait(void *p) {
    delete (ev_wait *)p;
}

bool valid_kind(cudaMemcpyKind k) {
    return (unsigned)k <= cudaMemcpyDefault;
}
/* an asynchronous copy into host memory: poisoned until it lands */
bool to_host(void *dst, cudaMemcpyKind k) {
    return k == cudaMemcpyDeviceToHost || k == cudaMemcpyHostToHost ||
           (k == cudaMemcpyDefault && !k3emu::dev_contains(dst));
}

cudaError_t copy_async(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                       size_t height, int v, cudaMemcpyKind kind, cudaStream_t s) {
    if (!width || !height) return cudaSuccess;
    if (k3emu::capturing(s)) /* a node of the graph: the copy runs at each launch */
        return k3emu::note_error(k3emu::capture_node(
            s, v < 0 ? "cudaMemcpyAsync" : "cudaMemsetAsync",
            [](void *p, cudaStream_t) { run_copy(p); },
            new copy2d{dst, src, dpitch, spitch, width, height, v}, drop_copy));
    if (to_host(dst, kind) && v < 0)
        for (size_t r = 0; r < height; r++) memset((char *)dst + r * dpitch, 0xff, width);
    enqueue(s,
            op{run_copy, drop_copy, new copy2d{dst, src, dpitch, spitch, width, height, v}, true});
    return cudaSuccess;
}

/* a synchronous call: after NULL and the blocking streams, on this thread */
cudaError_t copy_sync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                      size_t height, int v) {
    k3emu::sync_streams(false);
    if (width && height) {
        copy2d c{dst, src, dpitch, spitch, width, height, v};
        k3emu::work_begin();
        run_copy(&c);
        k3emu::work_end();
        k3emu::close_idle();
    }
    return k3emu::async_error(false);
}

} // namespace

namespace k3emu {

void set_async_error(cudaError_t e) {
    set_async(e);
}

void enqueue_host_op(cudaStream_t hs, void (*run)(void *), void *arg, void (*drop)(void *),
                     bool device, cudaEvent_t *evs, size_t n_ev) {
    k3emu_stream *s = of(hs);
    order_before(s);
    std::lock_guard<std::mutex> lk(s->mu);
    start_locked(s);
    for (size_t i = 0; i < n_ev; i++) {
        evs[i]->s = s;
        evs[i]->seq = s->enq + 1;
        evs[i]->t = -1;
    }
    s->q.push_back(op{run, drop, arg, device});
    s->enq++;
    s->cv.notify_all();
}

void event_done_now(cudaEvent_t e, cudaStream_t hs) {
    k3emu_stream *s = of(hs);
    std::lock_guard<std::mutex> lk(s->mu);
    e->s = s;
    e->seq = s->enq;
    e->t = now_s();
}

void enqueue_grid(cudaStream_t s, const grid_job &j) {
    enqueue(s, op{run_grid_op, drop_grid_op, new grid_job(j), true});
}

cudaError_t async_error(bool take) {
    std::lock_guard<std::mutex> lk(g_err_mu);
    const cudaError_t e = g_async_err;
    if (take) g_async_err = cudaSuccess;
    return e;
}

void sync_streams(bool all) {
    legacy();
    std::vector<k3emu_stream *> v;
    {
        std::lock_guard<std::mutex> lk(g_reg_mu);
        for (k3emu_stream *o : *g_streams)
            if (all || o == g_legacy || !(o->flags & cudaStreamNonBlocking)) v.push_back(o);
    }
    for (k3emu_stream *o : v) drain(o);
}

} // namespace k3emu

extern "C" {

cudaError_t cudaDeviceSynchronize(void) {
    FORBID_IN_CAPTURE("cudaDeviceSynchronize", nullptr);
    k3emu::sync_streams(true);
    return k3emu::async_error(false);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
    if (n && (!dst || !src)) return k3emu::set_err(cudaErrorInvalidValue);
    if (!valid_kind(kind)) return k3emu::set_err(cudaErrorInvalidValue);
    FORBID_IN_CAPTURE("cudaMemcpy (synchronous)", nullptr);
    return copy_sync(dst, n, src, n, n, 1, -1);
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t s) {
    if (n && (!dst || !src)) return k3emu::set_err(cudaErrorInvalidValue);
    if (!valid_kind(kind)) return k3emu::set_err(cudaErrorInvalidValue);
    return copy_async(dst, n, src, n, n, 1, -1, kind, s);
}
cudaError_t cudaMemcpy2D(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                         size_t height, cudaMemcpyKind kind) {
    if (width > dpitch || width > spitch || !valid_kind(kind))
        return k3emu::set_err(cudaErrorInvalidValue);
    if (height && width && (!dst || !src)) return k3emu::set_err(cudaErrorInvalidValue);
    FORBID_IN_CAPTURE("cudaMemcpy2D (synchronous)", nullptr);
    return copy_sync(dst, dpitch, src, spitch, width, height, -1);
}
cudaError_t cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t s) {
    if (width > dpitch || width > spitch || !valid_kind(kind))
        return k3emu::set_err(cudaErrorInvalidValue);
    if (height && width && (!dst || !src)) return k3emu::set_err(cudaErrorInvalidValue);
    return copy_async(dst, dpitch, src, spitch, width, height, -1, kind, s);
}
cudaError_t cudaMemset(void *p, int v, size_t n) {
    if (n && !p) return k3emu::set_err(cudaErrorInvalidValue);
    FORBID_IN_CAPTURE("cudaMemset (synchronous)", nullptr);
    return copy_sync(p, n, nullptr, n, n, 1, v & 0xff);
}
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    if (n && !p) return k3emu::set_err(cudaErrorInvalidValue);
    return copy_async(p, n, nullptr, n, n, 1, v & 0xff, cudaMemcpyDeviceToDevice, s);
}

cudaError_t cudaStreamCreate(cudaStream_t *s) {
    return cudaStreamCreateWithFlags(s, cudaStreamDefault);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags) {
    if (!s) return k3emu::set_err(cudaErrorInvalidValue);
    legacy();
    *s = registry_add(flags);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    if (!s) return k3emu::set_err(cudaErrorInvalidResourceHandle);
    drain(s);
    {
        std::lock_guard<std::mutex> lk(g_reg_mu);
        for (size_t i = 0; i < g_streams->size(); i++)
            if ((*g_streams)[i] == s) g_streams->erase(g_streams->begin() + (long)i);
    }
    bool joined = false;
    {
        std::lock_guard<std::mutex> lk(s->mu);
        s->stop = true;
        s->paused = false;
        s->cv.notify_all();
        joined = s->started;
    }
    if (joined) pthread_join(s->th, nullptr);
    delete s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    FORBID_IN_CAPTURE("cudaStreamSynchronize", s);
    drain(of(s));
    return k3emu::async_error(false);
}
cudaError_t cudaStreamQuery(cudaStream_t hs) {
    FORBID_IN_CAPTURE("cudaStreamQuery", hs);
    k3emu_stream *s = of(hs);
    {
        std::lock_guard<std::mutex> lk(s->mu);
        if (s->done < s->enq) return cudaErrorNotReady;
    }
    k3emu::close_idle(); /* as a synchronisation */
    return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags) {
    (void)flags;
    if (!e) return k3emu::set_err(cudaErrorInvalidResourceHandle);
    if (k3emu::capturing(s)) { /* one stream per capture: only its own events, already in order */
        if (!k3emu::event_in_capture(s, e))
            FORBID_IN_CAPTURE("cudaStreamWaitEvent on an event not recorded in this capture (the "
                              "emulator captures one stream, without cross-stream joins)",
                              s);
        return cudaSuccess;
    }
    if (!e->s) return cudaSuccess; /* never recorded: nothing to wait for */
    enqueue(s, op{run_wait, drop_wait, new ev_wait{e->s, e->seq}, false});
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *e) {
    return cudaEventCreateWithFlags(e, cudaEventDefault);
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags) {
    if (!e) return k3emu::set_err(cudaErrorInvalidValue);
    *e = new k3emu_event;
    (*e)->flags = flags;
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    if (!e) return k3emu::set_err(cudaErrorInvalidResourceHandle);
    event_wait(e); /* its record may still be queued */
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t hs) {
    if (!e) return k3emu::set_err(cudaErrorInvalidResourceHandle);
    if (k3emu::capturing(hs)) { /* a node: the event completes with the graph's launch */
        k3emu::note_event(hs, e);
        return k3emu::note_error(k3emu::capture_node(
            hs, "cudaEventRecord", [](void *p, cudaStream_t) { run_record(p); }, new ev_rec{e},
            drop_record, false, e));
    }
    k3emu_stream *s = of(hs);
    order_before(s);
    std::lock_guard<std::mutex> lk(s->mu);
    start_locked(s);
    e->s = s;
    e->seq = s->enq + 1;
    e->t = -1;
    s->q.push_back(op{run_record, drop_record, new ev_rec{e}, false});
    s->enq++;
    s->cv.notify_all();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (!e) return k3emu::set_err(cudaErrorInvalidResourceHandle);
    FORBID_IN_CAPTURE("cudaEventSynchronize", nullptr);
    event_wait(e);
    return k3emu::async_error(false);
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
    if (!e) return k3emu::set_err(cudaErrorInvalidResourceHandle);
    FORBID_IN_CAPTURE("cudaEventQuery", nullptr);
    if (event_pending(e)) return cudaErrorNotReady;
    k3emu::close_idle(); /* as a synchronisation */
    return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    if (!ms || !a || !b) return k3emu::set_err(cudaErrorInvalidValue);
    if (event_pending(a) || event_pending(b)) return k3emu::set_err(cudaErrorNotReady);
    if (a->t < 0 || b->t < 0 || (a->flags | b->flags) & cudaEventDisableTiming)
        return k3emu::set_err(cudaErrorInvalidResourceHandle);
    *ms = (float)((b->t - a->t) * 1e3);
    return cudaSuccess;
}

void k3emu_stream_pause(cudaStream_t hs, int paused) {
    k3emu_stream *s = of(hs);
    std::lock_guard<std::mutex> lk(s->mu);
    s->paused = paused != 0;
    s->cv.notify_all();
}

} // extern "C"
