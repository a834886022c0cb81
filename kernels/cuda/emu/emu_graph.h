/* emu_graph.h — k3's CUDA emulation, internal (C++ only): the hooks by which emu_runtime.cpp and
 * K3C_LAUNCH (k3emu_device.h) defer to the stream capture of emu_graph.cpp. A stream operation
 * first asks capturing(s): when true it is recorded as a node (capture_*), not run; a call CUDA
 * forbids during a capture first asks forbid_in_capture, which fails it (and invalidates the
 * capture) with a k3emu line. */
#ifndef K3_EMU_GRAPH_H
#define K3_EMU_GRAPH_H

#include "cuda_runtime_api.h"

struct dim3;

namespace k3emu {
/* s is in an active or invalidated capture (a cheap test when no capture exists) */
bool capturing(cudaStream_t s);
/* a node on s's capture: run(data, s) at each launch, drop(data) with the last graph holding it.
 * Takes data even on failure (dropped then). host: the node is host work (a graph holding one
 * replays on the host thread); ev: the node records that event. */
cudaError_t capture_node(cudaStream_t s, const char *what, void (*run)(void *, cudaStream_t),
                         void *data, void (*drop)(void *), bool host = false,
                         cudaEvent_t ev = nullptr);
/* a kernel launch on a capturing stream: closure (a heap copy the graph owns, freed by drop) */
void capture_kernel(const char *name, const dim3 &grid, const dim3 &block, size_t shmem,
                    cudaStream_t s, void (*body)(void *), void *closure, void (*drop)(void *));
/* cudaSuccess without a capture that forbids `api` (s: the stream it names, or nullptr); else
 * one k3emu line, the capture invalidated, cudaErrorStreamCaptureUnsupported */
cudaError_t forbid_in_capture(const char *api, cudaStream_t s);
/* an event recorded on a capturing stream (the stream waits on it later in the capture) */
bool event_in_capture(cudaStream_t s, cudaEvent_t e);
void note_event(cudaStream_t s, cudaEvent_t e);
/* the runtime's sticky-error setter (emu_runtime.cpp) */
cudaError_t note_error(cudaError_t e);

/* record op (a copyable struct with run()) as a node of s's capture */
template <class T> cudaError_t record(cudaStream_t s, const char *what, const T &op) {
    return note_error(capture_node(
        s, what, [](void *p, cudaStream_t) { static_cast<T *>(p)->run(); }, new T(op),
        [](void *p) { delete static_cast<T *>(p); }));
}
} // namespace k3emu

#endif /* K3_EMU_GRAPH_H */
