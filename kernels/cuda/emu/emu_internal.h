/* emu_internal.h — what the parts of k3's CUDA emulation share (K3_CUDA_EMULATE builds only;
 * private to kernels/cuda/emu): the grid runner (emu_runtime.cpp), device memory in its own
 * address range (emu_devmem.cpp) and the asynchronous streams (emu_streams.cpp). */
#ifndef K3_EMU_INTERNAL_H
#define K3_EMU_INTERNAL_H

#include "cuda_runtime.h"

#include <stddef.h>

namespace k3emu {

/* ---- emu_devmem.cpp: device memory ------------------------------------------------------------
 * Allocations come from one reserved range that is PROT_NONE while no device work runs; a host
 * access to it faults, and the SIGSEGV handler names the allocation (k3emu: line) and aborts. */
void *dev_alloc(size_t n);        /* nullptr: out of the emulated device's memory */
bool dev_free(void *p);           /* false: p is not the start of a live allocation */
bool dev_contains(const void *p); /* p lies in the device range */
size_t dev_allocated(void);       /* bytes held by live allocations */
/* The emulated device's work: one executor at a time (a stream worker, a synchronous copy, or
 * the NCCL stand-in's transfers), with the device range readable and writable for its duration.
 * Re-entrant on one thread. */
void work_begin(void);
void work_end(void);
/* close the range if no executor holds the device (it stays open from work_end to here) */
void close_idle(void);

/* ---- emu_runtime.cpp: the grid runner ------------------------------------------------------- */
struct grid_job {
    const char *name;
    dim3 grid, block;
    size_t shmem;
    void (*body)(void *);
    void *closure;
    void (*drop)(void *); /* frees closure */
};
/* runs the grid on the calling thread (inside work_begin / work_end); false: a kernel broke a
 * CUDA rule (reported on stderr) */
bool exec_grid(const grid_job &j);
/* a thread that ran grids ends: its fibers' stacks go back */
void thread_done(void);
/* the host thread's sticky error (cudaGetLastError) */
cudaError_t set_err(cudaError_t e);

/* ---- emu_streams.cpp ------------------------------------------------------------------------ */
/* enqueue a launch on stream s (the job is owned by the stream from here) */
void enqueue_grid(cudaStream_t s, const grid_job &j);
/* the error of device work that failed asynchronously (a kernel that broke a rule), cleared when
 * taken; cudaSuccess when none */
cudaError_t async_error(bool take);
/* wait until every stream (all: also the non-blocking ones) has run what it was given */
void sync_streams(bool all);
/* a kernel that broke a rule while its stream ran it (returned by the next synchronisation) */
void set_async_error(cudaError_t e);
/* enqueue run(arg) on stream s (device: inside work_begin / work_end), drop(arg) after; the
 * events evs[0..n_ev) complete with it (a graph launch: emu_graph.cpp) */
void enqueue_host_op(cudaStream_t s, void (*run)(void *), void *arg, void (*drop)(void *),
                     bool device, cudaEvent_t *evs, size_t n_ev);
/* e was recorded on s, complete now (a graph replayed on the host thread) */
void event_done_now(cudaEvent_t e, cudaStream_t s);

} // namespace k3emu

#endif /* K3_EMU_INTERNAL_H */
