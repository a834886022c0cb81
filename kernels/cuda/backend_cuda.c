/* backend_cuda.c — the cuda backend object: device memory (alloc, free, upload, download,
 * synchronise, free/total memory through the CUDA runtime), one stream per backend, stream-ordered
 * copies and events (upload_async / download_async are cudaMemcpyAsync on the stream, events are
 * cudaEvents recorded on it), the op counters (k3_op_stats) and the op table. Built only with
 * K3_CUDA. Each op makes the same argument checks as kernels/ref (the shared k3_kernels_check_*
 * functions), then enqueues its kernel(s) on the backend's stream (the .cu files of kernels/cuda
 * through cuda_launch.h) and returns without waiting, with three exceptions whose contract
 * returns a host-visible verdict: moe_topk (K3_ERR_INTERNAL when it runs out of experts),
 * embed_rows (K3_ERR_ARG naming an out-of-range id) and moe_experts (K3_ERR_MISSING / K3_ERR_ARG
 * naming the row whose expert is not on this rank or out of range; K3_ERR_STATE for an expert
 * over its capacity) read back one 8-byte error word and so synchronise the stream, unless
 * errors are deferred (errors_defer: one slot per check, read once at the end of the step;
 * errors_layer names the layer in the message). rows_gather / rows_scatter / rows_wsum take host
 * index arrays: they are staged through a pinned buffer into a device buffer on the stream (the
 * host waits only for the previous staging copy to finish before reusing the pinned buffer). The
 * varlen ops (rmsnorm_rows, matmul_heads, kv_write, attn_paged, short_conv_seqs, kda_seqs,
 * nonfinite_rows, rows_last, moe_experts) read the batch descriptor's arrays (k3_seqs) on the
 * device; its host scalars size the grids, so each is one launch (kda_seqs two, moe_experts two
 * per tile of rows after its check) however many sequences, heads and tokens the step mixes.
 * moe_experts' expert table: the E experts' device pointers, built on the first call for a table
 * of the caller (keyed by the w1 / w3 / w2 addresses, e_stride and E) and kept in the context; a
 * spot check of its first and last present experts rebuilds it when those move, and a free drops
 * the tables that point into the freed block (weights are loaded once: a table is not expected to
 * change in place). MXFP4 tables are also repacked into mma fragment order once (tab_repack) and
 * run on the W4A16 tensor-core GEMM (moe_mma: routed on the device by k3c_moe_route, no host
 * read; gate/up fused, down with the slot scatter, rows_wsum in slot order); the masked layout of
 * k3_cuda_moe.h for the expert-parallel dispatch. op_stats also counts the matrix ops' FLOPs and
 * their tensor-core part. Counters (op_stats): calls by op (every op, as the caller calls it), host
 * syncs (download, synchronize, event_sync, and the error-word reads above, which wait for the
 * device too), bytes of upload(_async) and download(_async) (and the error words). Atomics: ops
 * from several host threads count right.
 *
 * Owns: the stream, the error word, the staging buffers, the expert tables and the counters (in
 * the backend's context), and the device: local rank (OMPI_COMM_WORLD_LOCAL_RANK / SLURM_LOCALID /
 * MPI_LOCALRANKID) modulo the visible devices, made current on whichever host thread calls an op.
 * Verified on host math only; device run pending (no GPU was available when this was written):
 * supports_op lists the ops implemented, which is not a claim that they ran on a device. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_launch.h"
#include "k3_cuda_moe.h"
#include "k3c_repack.h"

_Static_assert(K3_DT_F32 == 0 && K3_DT_BF16 == 1 && K3_DT_F16 == 2 && K3_DT_MXFP4 == 6,
               "cuda_math.cuh K3C_DT_* mirror k3_dtype");
_Static_assert(K3_MOE_TOPK_MAX_GROUPS == 1024, "cuda_math.cuh K3C_TOPK_MAX_GROUPS");
_Static_assert(K3_KV_BLOCK == 64, "cuda_math.cuh K3C_KV_BLOCK");
_Static_assert(K3_ATTN_MAX_W == 2048, "attn.cu K3C_ATTN_ACC holds Rkv <= 2048 per block");

/* moe_experts' device table of one expert table of the caller (the key: its address, the other
 * two matrices' addresses, the stride and E) */
typedef struct moe_tab {
    const void *w1, *w3, *w2;
    size_t e_stride;
    int E;
    int e_first, e_last; /* the first and last present experts (-1: none): the spot check */
    const void *d_first, *d_last; /* their w1 data when built */
    int64_t I, Lw;                /* from the first present expert's w1 [I, Lw] */
    k3c_expert *host, *dev;       /* [E] each */
    uintptr_t lo, hi;             /* the device bytes its experts' data and scales span */
    /* the tensor-core form (every present expert MXFP4 and usable, Lw and I multiples of 32):
     * each present expert's w1, w3, w2 repacked into fragment order (k3c_repack.h) at slot
     * slot[e] (-1: not on this rank) of words[j] / scales[j]; slot_dev the same on the device */
    bool mma;
    int n_slots;
    int32_t *slot, *slot_dev;
    uint32_t *words[3];
    uint8_t *scales[3];
} moe_tab;

#define MLA_PART_CAP ((int64_t)16 << 20) /* floats of the tensor-core MLA's scratch: 64 MiB */
enum { CU_DEFER_MAX = 64 }; /* deferred checks in one step (a stage of K3 has ~12 MoE layers) */

typedef struct cu_ctx {
    int device; /* local rank % visible devices (comm_nccl.c maps ranks the same way) */
    cudaStream_t stream;
    unsigned long long *err_dev;  /* one error word (device) */
    unsigned long long *err_host; /* its pinned mirror */
    void *stage_host;             /* pinned staging of host index arrays */
    void *stage_dev;              /* their device copy */
    size_t stage_cap;             /* bytes of each */
    cudaEvent_t stage_done;       /* recorded after the last staging copy */
    moe_tab *tabs;                /* moe_experts' expert tables [n_tabs] */
    int n_tabs, cap_tabs;
    /* deferred error words (errors_defer): the checks of the step, read once at its end */
    bool defer_on;
    int defer_n;                      /* slots used since errors_defer(on) */
    unsigned long long *defer_dev;    /* [CU_DEFER_MAX] device */
    unsigned long long *defer_host;   /* [CU_DEFER_MAX] pinned; valid after a sync past fetch */
    uint64_t sync_epoch, fetch_epoch; /* host syncs made; the epoch at the last fetch */
    int fetched_n;                    /* slots the last fetch copied */
    int layer;                        /* errors_layer: the step's layer now (-1: none) */
    struct cu_deferred {              /* what each slot's check was, for its message */
        int op;                       /* K3_OP_embed_rows, K3_OP_moe_topk, K3_OP_moe_experts */
        const int32_t *ids;           /* embed_rows: its ids (device) */
        int64_t n;                    /* embed_rows: V; moe_topk: E; moe_experts: rows */
        int layer;                    /* the layer it ran in (errors_layer; -1: unknown) */
        int E;                        /* moe_experts: experts, capacity, its kind (route_error) */
        int64_t cap;
        bool per_tok;
    } defer_what[CU_DEFER_MAX];
    bool mma;             /* K3_CUDA_MMA=1: the bf16 tensor-core MLA and KDA prefill (chunk 16) */
    int mla_terms;        /* the tensor-core MLA's products per step (mla_mma.cu); 0: fp32 kernel */
    bool kda_bf16;        /* K3_CUDA_KDA_STATE=bf16: the KDA state stored in bf16 (kda.cu) */
    float *mla_part;      /* the tensor-core MLA's split partials (mla_mma.cu) */
    int64_t mla_part_cap; /* floats of it */
    void **al_p;  /* the live allocations and their sizes [n_al]: a free drops only the expert */
    size_t *al_n; /* tables that point into the freed block (their repack is costly) */
    int n_al, cap_al;
    /* the counters and deferred checks when the current capture began (cu_capture_begin) */
    uint64_t cap_calls[K3_OP_COUNT], cap_flops[K3_OP_COUNT], cap_tc_flops[K3_OP_COUNT];
    int cap_defer_n;
    k3_op_stats stats; /* updated with __atomic builtins only */
} cu_ctx;

static void count(uint64_t *c, uint64_t n) {
    __atomic_fetch_add(c, n, __ATOMIC_RELAXED);
}

/* a host sync: counted, and the epoch that tells a deferred fetch it has landed */
static void count_sync(cu_ctx *c) {
    __atomic_fetch_add(&c->stats.host_syncs, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&c->sync_epoch, 1, __ATOMIC_RELAXED);
}

static cu_ctx *CTX(k3_backend *be) {
    return (cu_ctx *)be->ctx;
}
/* The backend's stream, with its device made current on the calling thread (the current device
 * is per host thread; a launch on another device's stream would fail). */
static cudaStream_t cu_stream(k3_backend *be) {
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != CTX(be)->device)
        cudaSetDevice(CTX(be)->device);
    return CTX(be)->stream;
}
#define STREAM(be) cu_stream(be)

static k3_status cu_err(cudaError_t e, const char *file, int line, const char *what) {
    return k3_set_error(K3_ERR_DEVICE, file, line, "cuda backend: %s: %s (%s)", what,
                        cudaGetErrorString(e), cudaGetErrorName(e));
}
/* a CUDA runtime call or a launcher's result, with the expression in the message */
#define CU_TRY(expr)                                                                               \
    do {                                                                                           \
        cudaError_t cu_e_ = (cudaError_t)(expr);                                                   \
        if (cu_e_ != cudaSuccess) return cu_err(cu_e_, __FILE__, __LINE__, #expr);                 \
    } while (0)

static void tab_free(moe_tab *t) {
    cudaFree(t->dev);
    k3_free(t->host);
    k3_free(t->slot);
    cudaFree(t->slot_dev);
    for (int j = 0; j < 3; j++) cudaFree(t->words[j]), cudaFree(t->scales[j]);
}
/* Drop the expert tables that point into [p, p + n) (n 0: every table). */
static void tabs_drop(cu_ctx *c, const void *p, size_t n) {
    int k = 0;
    for (int i = 0; i < c->n_tabs; i++) {
        moe_tab *t = &c->tabs[i];
        const uintptr_t a = (uintptr_t)p, b = a + n;
        if (n == 0 || (t->lo < b && a < t->hi))
            tab_free(t);
        else
            c->tabs[k++] = *t;
    }
    c->n_tabs = k;
}

/* ---- memory -------------------------------------------------------------------------------- */
static k3_status cu_alloc(k3_backend *be, size_t n, void **out) {
    (void)cu_stream(be); /* the backend's device is current: cudaMalloc allocates there */
    cu_ctx *c = CTX(be);
    if (c->n_al == c->cap_al) {
        const int cap = c->cap_al ? 2 * c->cap_al : 64;
        void **np = NULL;
        size_t *nn = NULL;
        K3_TRY(k3_calloc((void **)&np, (size_t)cap * sizeof *np, "cuda allocation list"));
        k3_status st = k3_calloc((void **)&nn, (size_t)cap * sizeof *nn, "cuda allocation list");
        if (st != K3_OK) {
            k3_free(np);
            return st;
        }
        if (c->n_al) {
            memcpy(np, c->al_p, (size_t)c->n_al * sizeof *np);
            memcpy(nn, c->al_n, (size_t)c->n_al * sizeof *nn);
        }
        k3_free(c->al_p), k3_free(c->al_n);
        c->al_p = np, c->al_n = nn, c->cap_al = cap;
    }
    CU_TRY(cudaMalloc(out, n ? n : 1));
    c->al_p[c->n_al] = *out, c->al_n[c->n_al++] = n ? n : 1;
    CU_TRY(cudaMemsetAsync(*out, 0, n ? n : 1, STREAM(be)));
    CU_TRY(cudaStreamSynchronize(STREAM(be)));
    return K3_OK;
}
static void cu_free(k3_backend *be, void *p) {
    if (!p) return;
    cu_ctx *c = CTX(be);
    cudaStreamSynchronize(STREAM(be)); /* no kernel may still use it */
    size_t n = 0;                      /* 0 (not ours: never expected): drop every table */
    for (int i = 0; i < c->n_al; i++)
        if (c->al_p[i] == p) {
            n = c->al_n[i];
            c->al_p[i] = c->al_p[--c->n_al], c->al_n[i] = c->al_n[c->n_al];
            break;
        }
    tabs_drop(c, p, n); /* an expert table pointing into it is rebuilt (and repacked) on use */
    cudaFree(p);
}
static k3_status cu_upload(k3_backend *be, void *dst, const void *src, size_t n) {
    count(&CTX(be)->stats.h2d_bytes, n);
    CU_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, STREAM(be)));
    CU_TRY(cudaStreamSynchronize(STREAM(be))); /* the host may reuse src on return */
    return K3_OK;
}
/* a device -> host read the host waits for: a host sync */
static k3_status cu_download(k3_backend *be, void *dst, const void *src, size_t n) {
    count(&CTX(be)->stats.d2h_bytes, n);
    count_sync(CTX(be));
    CU_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, STREAM(be)));
    CU_TRY(cudaStreamSynchronize(STREAM(be)));
    return K3_OK;
}
static k3_status cu_sync(k3_backend *be) {
    count_sync(CTX(be));
    CU_TRY(cudaStreamSynchronize(STREAM(be)));
    CU_TRY(cudaGetLastError());
    return K3_OK;
}
/* Stream-ordered copies: queued behind the ops before them; the host buffer must stay valid (and,
   for a download, unread) until an event recorded after the copy has completed. Pageable host
   memory makes the runtime stage the copy (it may then return later); pinned memory overlaps. A
   download_async is no host sync by itself (the event_sync that waits for it is). */
static k3_status cu_upload_async(k3_backend *be, void *dst, const void *src, size_t n) {
    count(&CTX(be)->stats.h2d_bytes, n);
    if (n) CU_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, STREAM(be)));
    return K3_OK;
}
static k3_status cu_download_async(k3_backend *be, void *dst, const void *src, size_t n) {
    count(&CTX(be)->stats.d2h_bytes, n);
    if (n) CU_TRY(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, STREAM(be)));
    return K3_OK;
}
/* A k3_backend_event is a cudaEvent_t (itself an opaque pointer): no wrapper to allocate. */
static k3_status cu_event_create(k3_backend *be, k3_backend_event **out) {
    cudaEvent_t ev = NULL;
    (void)cu_stream(be); /* the event belongs to the current device */
    CU_TRY(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    *out = (k3_backend_event *)ev;
    return K3_OK;
}
static k3_status cu_event_record(k3_backend *be, k3_backend_event *ev) {
    CU_TRY(cudaEventRecord((cudaEvent_t)ev, STREAM(be)));
    return K3_OK;
}
static k3_status cu_event_sync(k3_backend *be, k3_backend_event *ev) {
    count_sync(CTX(be));
    CU_TRY(cudaEventSynchronize((cudaEvent_t)ev));
    return K3_OK;
}
static void cu_event_destroy(k3_backend *be, k3_backend_event *ev) {
    (void)cu_stream(be);
    if (ev) cudaEventDestroy((cudaEvent_t)ev);
}
/* Captured steps: thread-local capture mode, so a host sync the step makes on this thread fails
   the capture while other threads (the transport's watchers) run as usual. A graph keeps what the
   host did while it was recorded and a launch must redo: the op calls and FLOPs it holds (taken
   off the counters at the end of the capture, since nothing ran, and counted again at each
   launch: a step's op count is the same replayed or eager) and the deferred checks it queued
   (their slots and what each was: a launch sets them as the recorded calls left them, so the
   step's fetch and verdict read the replay's words). */
struct k3_backend_graph {
    cudaGraphExec_t x;
    uint64_t calls[K3_OP_COUNT], flops[K3_OP_COUNT], tc_flops[K3_OP_COUNT];
    bool defer_on;
    int defer_n;
    struct cu_deferred defer_what[CU_DEFER_MAX];
};
static k3_status cu_capture_begin(k3_backend *be) {
    cu_ctx *c = CTX(be);
    CU_TRY(cudaStreamBeginCapture(STREAM(be), cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < K3_OP_COUNT; i++) {
        c->cap_calls[i] = __atomic_load_n(&c->stats.calls[i], __ATOMIC_RELAXED);
        c->cap_flops[i] = __atomic_load_n(&c->stats.flops[i], __ATOMIC_RELAXED);
        c->cap_tc_flops[i] = __atomic_load_n(&c->stats.tc_flops[i], __ATOMIC_RELAXED);
    }
    c->cap_defer_n = c->defer_n;
    return K3_OK;
}
/* counters[i] += sign * d[i] */
static void count_all(uint64_t *counters, const uint64_t *d, bool add) {
    for (int i = 0; i < K3_OP_COUNT; i++)
        if (d[i]) {
            if (add)
                __atomic_fetch_add(&counters[i], d[i], __ATOMIC_RELAXED);
            else
                __atomic_fetch_sub(&counters[i], d[i], __ATOMIC_RELAXED);
        }
}
static k3_status cu_capture_end(k3_backend *be, k3_backend_graph **out) {
    cu_ctx *c = CTX(be);
    *out = NULL;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(STREAM(be), &g);
    k3_backend_graph *kg = NULL;
    if (k3_calloc((void **)&kg, sizeof *kg, "captured step") != K3_OK) {
        if (e == cudaSuccess) cudaGraphDestroy(g);
        return K3_ERR(K3_ERR_NOMEM, "captured step: out of host memory");
    }
    for (int i = 0; i < K3_OP_COUNT; i++) { /* recorded, not run */
        kg->calls[i] = __atomic_load_n(&c->stats.calls[i], __ATOMIC_RELAXED) - c->cap_calls[i];
        kg->flops[i] = __atomic_load_n(&c->stats.flops[i], __ATOMIC_RELAXED) - c->cap_flops[i];
        kg->tc_flops[i] =
            __atomic_load_n(&c->stats.tc_flops[i], __ATOMIC_RELAXED) - c->cap_tc_flops[i];
    }
    count_all(c->stats.calls, kg->calls, false);
    count_all(c->stats.flops, kg->flops, false);
    count_all(c->stats.tc_flops, kg->tc_flops, false);
    if (e != cudaSuccess) {
        k3_free(kg);
        (void)cudaGetLastError(); /* the capture's error is returned here, not left sticky */
        return cu_err(e, __FILE__, __LINE__, "the step is not capturable: cudaStreamEndCapture");
    }
    kg->defer_on = c->defer_on;
    kg->defer_n = c->defer_n;
    if (c->cap_defer_n != 0) { /* the graph's checks must start at slot 0 */
        cudaGraphDestroy(g);
        k3_free(kg);
        return K3_ERR(K3_ERR_STATE, "captured step: %d deferred checks queued before its capture",
                      c->cap_defer_n);
    }
    memcpy(kg->defer_what, c->defer_what, sizeof kg->defer_what);
    e = cudaGraphInstantiate(&kg->x, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        k3_free(kg);
        return cu_err(e, __FILE__, __LINE__, "cudaGraphInstantiate");
    }
    *out = kg;
    return K3_OK;
}
static k3_status cu_graph_launch(k3_backend *be, k3_backend_graph *g) {
    cu_ctx *c = CTX(be);
    count(&c->stats.graph_launches, 1);
    count_all(c->stats.calls, g->calls, true);
    count_all(c->stats.flops, g->flops, true);
    count_all(c->stats.tc_flops, g->tc_flops, true);
    CU_TRY(cudaGraphLaunch(g->x, STREAM(be)));
    if (g->defer_on && c->defer_on) { /* the replay's checks, as the recorded calls left them */
        c->defer_n = g->defer_n;
        memcpy(c->defer_what, g->defer_what, sizeof c->defer_what);
    }
    return K3_OK;
}
static void cu_graph_destroy(k3_backend *be, k3_backend_graph *g) {
    (void)cu_stream(be);
    if (!g) return;
    if (g->x) cudaGraphExecDestroy(g->x);
    k3_free(g);
}
static k3_status cu_op_stats(const k3_backend *be, k3_op_stats *out) {
    const cu_ctx *c = be->ctx;
    for (int i = 0; i < K3_OP_COUNT; i++)
        out->calls[i] = __atomic_load_n(&c->stats.calls[i], __ATOMIC_RELAXED);
    out->host_syncs = __atomic_load_n(&c->stats.host_syncs, __ATOMIC_RELAXED);
    out->h2d_bytes = __atomic_load_n(&c->stats.h2d_bytes, __ATOMIC_RELAXED);
    out->d2h_bytes = __atomic_load_n(&c->stats.d2h_bytes, __ATOMIC_RELAXED);
    out->graph_launches = __atomic_load_n(&c->stats.graph_launches, __ATOMIC_RELAXED);
    for (int i = 0; i < K3_OP_COUNT; i++) {
        out->flops[i] = __atomic_load_n(&c->stats.flops[i], __ATOMIC_RELAXED);
        out->tc_flops[i] = __atomic_load_n(&c->stats.tc_flops[i], __ATOMIC_RELAXED);
    }
    return K3_OK;
}
/* Every op of K3_OP_LIST has a kernel; weight dtypes as ref: matmul/matmul_tn F32/BF16/MXFP4,
 * to_f32 / embed_rows F32/BF16/F16, and the two varlen ops that take weights, matmul_heads and
 * moe_experts, F32/BF16/MXFP4 as matmul (k3_op_takes does not list them yet). */
static bool cu_supports(const k3_backend *be, int op, k3_dtype wt) {
    (void)be;
    if (wt != K3_DT_COUNT && (op == K3_OP_matmul_heads || op == K3_OP_moe_experts))
        return wt == K3_DT_F32 || wt == K3_DT_BF16 || wt == K3_DT_MXFP4;
    return k3_op_takes(op, wt); /* every op of the list is a kernel here */
}
static k3_status cu_memory(const k3_backend *be, size_t *fr, size_t *tot) {
    (void)cu_stream((k3_backend *)be); /* cudaMemGetInfo reports the current device */
    CU_TRY(cudaMemGetInfo(fr, tot));
    return K3_OK;
}
static void cu_destroy(k3_backend *be) {
    if (!be) return;
    cu_ctx *c = CTX(be);
    if (c) {
        cudaSetDevice(c->device);
        if (c->stream) cudaStreamSynchronize(c->stream);
        cudaFree(c->err_dev);
        cudaFreeHost(c->err_host);
        cudaFree(c->defer_dev);
        cudaFreeHost(c->defer_host);
        cudaFree(c->stage_dev);
        cudaFreeHost(c->stage_host);
        if (c->stage_done) cudaEventDestroy(c->stage_done);
        if (c->stream) cudaStreamDestroy(c->stream);
        tabs_drop(c, NULL, 0);
        cudaFree(c->mla_part);
        k3_free(c->tabs);
        k3_free(c->al_p), k3_free(c->al_n);
        k3_free(c);
    }
    k3_free(be);
}
static void *cu_native_stream(k3_backend *be) {
    return (void *)cu_stream(be);
}
static k3_status cu_errors_defer(k3_backend *be, bool on);
static k3_status cu_errors_fetch(k3_backend *be);
static k3_status cu_errors_verdict(k3_backend *be);
static void cu_errors_layer(k3_backend *be, int layer);
static k3_status cu_moe_ep_pack(k3_backend *be, const k3_moe_ep *ep, const int32_t *ids, int64_t T,
                                const float *x, float *send, int32_t *pos);
static k3_status cu_moe_ep_experts(k3_backend *be, const k3_moe_ep *ep, const float *recv,
                                   const int32_t *glob, const k3_tensor *w1, const k3_tensor *w3,
                                   const k3_tensor *w2, size_t e_stride, float beta, float lin_beta,
                                   float *h, int32_t *iwork, float *ret);
static k3_status cu_moe_combine_iface(k3_backend *be, const float *y, const int32_t *pos,
                                      const float *w, int64_t T, int K, int64_t width, float *out);
static k3_status route_error(unsigned long long key, int64_t n, int E, int64_t cap, bool per_tok,
                             int layer, bool deferred);
/* Peaks from the device's attributes: HBM = 2 (DDR) x memory clock x bus width; dense bf16
 * tensor FLOPs per SM and clock: 4096 on sm_90 (H100/H200: 132 SMs x 1.83 GHz x 4096 = 989
 * TFLOP/s, the published figure), 2048 on sm_80 / sm_86 / sm_89, 1024 before. */
static k3_status cu_device_info(k3_backend *be, k3_device_info *out) {
    CU_TRY(cudaStreamSynchronize(STREAM(be)));
#ifdef K3_CUDA_EMULATION
    snprintf(out->name, sizeof out->name, "k3emu (CUDA emulation on the host)");
    out->emulated = true;
    out->mma = k3emu_mma_count(NULL);
#else
    int dev = 0, mem_khz = 0, bus_bits = 0, sm_khz = 0, sms = 0, major = 0;
    CU_TRY(cudaGetDevice(&dev));
    struct cudaDeviceProp p;
    CU_TRY(cudaGetDeviceProperties(&p, dev));
    snprintf(out->name, sizeof out->name, "%.*s", (int)sizeof out->name - 1, p.name);
    CU_TRY(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev));
    CU_TRY(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
    CU_TRY(cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, dev));
    CU_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    CU_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    out->hbm_gbs = 2.0 * (double)mem_khz * 1e3 * (double)bus_bits / 8.0 / 1e9;
    const double per = major >= 9 ? 4096.0 : major == 8 ? 2048.0 : 1024.0;
    out->tensor_tflops = (double)sms * (double)sm_khz * 1e3 * per / 1e12;
#endif
    return K3_OK;
}
static const k3_backend_iface k_cuda_iface = {
    .alloc = cu_alloc,
    .free = cu_free,
    .upload = cu_upload,
    .download = cu_download,
    .synchronize = cu_sync,
    .supports_op = cu_supports,
    .memory = cu_memory,
    .destroy = cu_destroy,
    .upload_async = cu_upload_async,
    .download_async = cu_download_async,
    .event_create = cu_event_create,
    .event_record = cu_event_record,
    .event_sync = cu_event_sync,
    .event_destroy = cu_event_destroy,
    .op_stats = cu_op_stats,
    .native_stream = cu_native_stream,
    .capture_begin = cu_capture_begin,
    .capture_end = cu_capture_end,
    .graph_launch = cu_graph_launch,
    .graph_destroy = cu_graph_destroy,
    .errors_defer = cu_errors_defer,
    .errors_fetch = cu_errors_fetch,
    .errors_verdict = cu_errors_verdict,
    .errors_layer = cu_errors_layer,
    .moe_ep_pack = cu_moe_ep_pack,
    .moe_ep_experts = cu_moe_ep_experts,
    .moe_combine = cu_moe_combine_iface,
    .device_info = cu_device_info,
};

/* Copy a host array into the staging device buffer (stream-ordered); *dev points at it. */
static k3_status stage(k3_backend *be, const void *host, size_t n_bytes, const void **dev) {
    (void)cu_stream(be);
    cu_ctx *c = CTX(be);
    if (n_bytes > c->stage_cap) { /* grows rarely (first calls); never inside a warm loop */
        size_t cap = c->stage_cap ? c->stage_cap : 4096;
        while (cap < n_bytes) cap *= 2;
        CU_TRY(cudaStreamSynchronize(c->stream));
        cudaFree(c->stage_dev);
        cudaFreeHost(c->stage_host);
        c->stage_dev = c->stage_host = NULL;
        c->stage_cap = 0;
        CU_TRY(cudaMalloc(&c->stage_dev, cap));
        CU_TRY(cudaMallocHost(&c->stage_host, cap));
        c->stage_cap = cap;
    }
    CU_TRY(cudaEventSynchronize(c->stage_done)); /* the previous copy has left stage_host */
    memcpy(c->stage_host, host, n_bytes);
    CU_TRY(
        cudaMemcpyAsync(c->stage_dev, c->stage_host, n_bytes, cudaMemcpyHostToDevice, c->stream));
    CU_TRY(cudaEventRecord(c->stage_done, c->stream));
    *dev = c->stage_dev;
    return K3_OK;
}
/* Reset the error word before a checking kernel; read it back after (synchronises). */
static k3_status err_reset(k3_backend *be) {
    CU_TRY(cudaMemsetAsync(CTX(be)->err_dev, 0xff, sizeof(unsigned long long), STREAM(be)));
    return K3_OK;
}
/* The error word a deferrable check writes: the next deferred slot (reset) while errors are
   deferred and one is free, else the immediate word (reset); *deferred says which. */
static k3_status err_word(k3_backend *be, unsigned long long **w, bool *deferred) {
    cu_ctx *c = CTX(be);
    *deferred = c->defer_on && c->defer_n < CU_DEFER_MAX;
    if (!*deferred) {
        K3_TRY(err_reset(be));
        *w = c->err_dev;
        return K3_OK;
    }
    *w = c->defer_dev + c->defer_n;
    CU_TRY(cudaMemsetAsync(*w, 0xff, sizeof **w, STREAM(be)));
    return K3_OK;
}
static void err_defer(cu_ctx *c, int op, const int32_t *ids, int64_t n) {
    c->defer_what[c->defer_n] = (struct cu_deferred){op, ids, n, c->layer, 0, 0, false};
    c->defer_n++;
}

/* Deferred checks (k3_backend_errors_*): on, a deferrable check (embed_rows, moe_topk) writes a
   slot of defer_dev instead of reading its word back; fetch queues one copy of the used slots to
   pinned memory; verdict reads them once a host sync has followed the fetch (or makes one) and
   returns the first failed check's usual error. */
static k3_status cu_errors_defer(k3_backend *be, bool on) {
    cu_ctx *c = CTX(be);
    c->defer_on = on;
    c->layer = -1;
    c->defer_n = 0;
    c->fetched_n = 0;
    return K3_OK;
}
static void cu_errors_layer(k3_backend *be, int layer) {
    CTX(be)->layer = layer;
}
static k3_status cu_errors_fetch(k3_backend *be) {
    cu_ctx *c = CTX(be);
    c->fetched_n = c->defer_n;
    c->fetch_epoch = __atomic_load_n(&c->sync_epoch, __ATOMIC_RELAXED);
    if (!c->defer_n) return K3_OK;
    count(&c->stats.d2h_bytes, (uint64_t)c->defer_n * sizeof *c->defer_host);
    CU_TRY(cudaMemcpyAsync(c->defer_host, c->defer_dev, (size_t)c->defer_n * sizeof *c->defer_host,
                           cudaMemcpyDeviceToHost, STREAM(be)));
    return K3_OK;
}
static k3_status cu_errors_verdict(k3_backend *be) {
    cu_ctx *c = CTX(be);
    const int n = c->fetched_n;
    c->defer_n = c->fetched_n = 0;
    if (!n) return K3_OK;
    if (__atomic_load_n(&c->sync_epoch, __ATOMIC_RELAXED) == c->fetch_epoch) {
        count_sync(c); /* no host sync since the fetch: this is one */
        CU_TRY(cudaStreamSynchronize(STREAM(be)));
    }
    for (int i = 0; i < n; i++) {
        const unsigned long long bad = c->defer_host[i];
        if (bad == ~0ull) continue;
        const struct cu_deferred *d = &c->defer_what[i];
        if (d->op == K3_OP_moe_experts)
            return route_error(bad, d->n, d->E, d->cap, d->per_tok, d->layer, true);
        char at[32] = "";
        if (d->layer >= 0) snprintf(at, sizeof at, "layer %d: ", d->layer);
        if (d->op == K3_OP_moe_topk)
            return K3_ERR(K3_ERR_INTERNAL,
                          "%sMoE router: ran out of experts at token %lld (a deferred check, read "
                          "at the end of the step)",
                          at, (long long)(bad / (unsigned long long)(d->n + 2)));
        int32_t id = 0; /* embed_rows: the ids are the step's, still in place */
        CU_TRY(cudaMemcpy(&id, d->ids + bad, sizeof id, cudaMemcpyDeviceToHost));
        return K3_ERR(K3_ERR_ARG,
                      "embed_rows: token id %d at position %lld outside [0, %lld) (a deferred "
                      "check, read at the end of the step)",
                      id, (long long)bad, (long long)d->n);
    }
    return K3_OK;
}
static k3_status err_read(k3_backend *be, unsigned long long *v) {
    cu_ctx *c = CTX(be);
    count(&c->stats.d2h_bytes, sizeof *v);
    count_sync(c);
    CU_TRY(cudaMemcpyAsync(c->err_host, c->err_dev, sizeof *v, cudaMemcpyDeviceToHost, c->stream));
    CU_TRY(cudaStreamSynchronize(c->stream));
    *v = *c->err_host;
    return K3_OK;
}

/* ---- ops ----------------------------------------------------------------------------------- */
/* The matrix FLOPs of a call of op (2 per multiply-add), tc: done by a tensor-core kernel. Today
   only moe_experts' MXFP4 form is (W4A16, moe_mma.cu); the other matrix ops count CUDA-core
   FLOPs, so --op-stats shows their share 0 until their kernels move. */
static void count_flops(k3_backend *be, int op, double f, bool tc) {
    count(&CTX(be)->stats.flops[op], (uint64_t)f);
    if (tc) count(&CTX(be)->stats.tc_flops[op], (uint64_t)f);
}
static k3_status mm_run(k3_backend *be, const float *x, int64_t T, const k3_tensor *W, float *y) {
    CU_TRY(k3c_matmul(STREAM(be), (int)W->dtype, W->data, W->scale, W->shape[0], W->shape[1], x, T,
                      y));
    return K3_OK;
}
static k3_status cu_matmul(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                           float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul"));
    count_flops(be, K3_OP_matmul, 2.0 * (double)T * (double)W->shape[0] * (double)W->shape[1],
                false);
    return mm_run(be, x, T, W, y);
}
static k3_status cu_matmul_group(k3_backend *be, const k3_mm *mm, int n) {
    /* one launch per item on the stream, in order (a grouped GEMM is the next step) */
    K3_TRY(k3_kernels_check_group(mm, n));
    for (int i = 0; i < n; i++) {
        count_flops(be, K3_OP_matmul_group,
                    2.0 * (double)mm[i].T * (double)mm[i].W->shape[0] * (double)mm[i].W->shape[1],
                    false);
        K3_TRY(mm_run(be, mm[i].x, mm[i].T, mm[i].W, mm[i].y));
    }
    return K3_OK;
}
static k3_status cu_matmul_tn(k3_backend *be, const float *x, int64_t T, const k3_tensor *W,
                              float *y) {
    K3_TRY(k3_kernels_check_weight(W, "matmul_tn"));
    count_flops(be, K3_OP_matmul_tn, 2.0 * (double)T * (double)W->shape[0] * (double)W->shape[1],
                false);
    CU_TRY(k3c_matmul_tn(STREAM(be), (int)W->dtype, W->data, W->scale, W->shape[0], W->shape[1], x,
                         T, y));
    return K3_OK;
}
static k3_status cu_rmsnorm(k3_backend *be, const float *x, const float *w, int64_t T, int64_t n,
                            float eps, float *y) {
    CU_TRY(k3c_rownorm(STREAM(be), 0, x, n, w, T, n, eps, y, n));
    return K3_OK;
}
static k3_status cu_l2norm(k3_backend *be, const float *x, int64_t T, int64_t n, float eps,
                           float *y) {
    CU_TRY(k3c_rownorm(STREAM(be), 1, x, n, NULL, T, n, eps, y, n));
    return K3_OK;
}
static k3_status cu_silu(k3_backend *be, const float *x, int64_t n, float *y) {
    CU_TRY(k3c_pointwise(STREAM(be), K3C_PW_SILU, x, NULL, n, 0, 0, y));
    return K3_OK;
}
static k3_status cu_sigmoid(k3_backend *be, const float *x, int64_t n, float *y) {
    CU_TRY(k3c_pointwise(STREAM(be), K3C_PW_SIGMOID, x, NULL, n, 0, 0, y));
    return K3_OK;
}
static k3_status cu_situ(k3_backend *be, const float *g, const float *u, int64_t n, float beta,
                         float lin_beta, float *y) {
    CU_TRY(k3c_pointwise(STREAM(be), K3C_PW_SITU, g, u, n, beta, lin_beta, y));
    return K3_OK;
}
static k3_status cu_swiglu(k3_backend *be, const float *g, const float *u, int64_t n, float *y) {
    CU_TRY(k3c_pointwise(STREAM(be), K3C_PW_SWIGLU, g, u, n, 0, 0, y));
    return K3_OK;
}
static k3_status cu_softmax(k3_backend *be, const float *x, int64_t T, int64_t n, float *y) {
    CU_TRY(k3c_softmax(STREAM(be), x, T, n, y));
    return K3_OK;
}
static k3_status cu_add(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    CU_TRY(k3c_pointwise(STREAM(be), K3C_PW_ADD, a, b, n, 0, 0, y));
    return K3_OK;
}
static k3_status cu_mul(k3_backend *be, const float *a, const float *b, int64_t n, float *y) {
    CU_TRY(k3c_pointwise(STREAM(be), K3C_PW_MUL, a, b, n, 0, 0, y));
    return K3_OK;
}
static k3_status cu_fill(k3_backend *be, float *y, int64_t n, float v) {
    CU_TRY(k3c_fill(STREAM(be), y, n, v));
    return K3_OK;
}
static k3_status cu_copy2d(k3_backend *be, float *dst, int64_t dst_stride, const float *src,
                           int64_t src_stride, int64_t rows, int64_t cols) {
    if (rows < 0 || cols < 0 || (rows > 1 && (dst_stride < cols || src_stride < cols)))
        return K3_ERR(K3_ERR_ARG, "copy2d: %lld x %lld with strides %lld / %lld", (long long)rows,
                      (long long)cols, (long long)dst_stride, (long long)src_stride);
    if (rows == 0 || cols == 0) return K3_OK;
    const size_t w = (size_t)cols * sizeof(float);
    /* rows == 1 may carry strides < cols (the ref allows it): any pitch >= width works */
    CU_TRY(cudaMemcpy2DAsync(dst, rows > 1 ? (size_t)dst_stride * sizeof(float) : w, src,
                             rows > 1 ? (size_t)src_stride * sizeof(float) : w, w, (size_t)rows,
                             cudaMemcpyDeviceToDevice, STREAM(be)));
    return K3_OK;
}
static k3_status cu_to_f32(k3_backend *be, const k3_tensor *t, int64_t n, float *dst) {
    if (k3_tensor_n_elems(t) != n)
        return K3_ERR(K3_ERR_SHAPE, "tensor has %lld elements, expected %lld",
                      (long long)k3_tensor_n_elems(t), (long long)n);
    if (t->dtype != K3_DT_F32 && t->dtype != K3_DT_BF16 && t->dtype != K3_DT_F16)
        return K3_ERR(K3_ERR_SHAPE, "cannot decode dtype %s to f32", k3_dtype_name(t->dtype));
    CU_TRY(k3c_decode_f32(STREAM(be), (int)t->dtype, t->data, n, dst));
    return K3_OK;
}
static k3_status cu_embed_rows(k3_backend *be, const k3_tensor *W, const int32_t *ids, int64_t T,
                               float *out) {
    if (W->ndim != 2 || (W->dtype != K3_DT_F32 && W->dtype != K3_DT_BF16 && W->dtype != K3_DT_F16))
        return K3_ERR(K3_ERR_SHAPE, "embed_rows: embedding must be a 2-D F32/BF16/F16 table");
    if (T <= 0) return K3_OK;
    unsigned long long *word;
    bool deferred;
    K3_TRY(err_word(be, &word, &deferred));
    CU_TRY(k3c_embed_rows(STREAM(be), (int)W->dtype, W->data, W->shape[0], W->shape[1], ids, T, out,
                          word));
    if (deferred) {
        err_defer(CTX(be), K3_OP_embed_rows, ids, W->shape[0]);
        return K3_OK;
    }
    unsigned long long bad;
    K3_TRY(err_read(be, &bad));
    if (bad != ~0ull) {
        int32_t id = 0;
        CU_TRY(cudaMemcpy(&id, ids + bad, sizeof id, cudaMemcpyDeviceToHost));
        return K3_ERR(K3_ERR_ARG, "embed_rows: token id %d at position %lld outside [0, %lld)", id,
                      (long long)bad, (long long)W->shape[0]);
    }
    return K3_OK;
}
static k3_status cu_short_conv(k3_backend *be, const float *in, int64_t n, int64_t P, int K,
                               const float *w, float *state, float *out) {
    CU_TRY(k3c_short_conv(STREAM(be), in, n, P, K, w, state, out));
    return K3_OK;
}
static k3_status cu_kda_gate(k3_backend *be, float *r, const float *dt_bias, const float *a_log,
                             int64_t T, int H, int dk, bool has_lower_bound, float lower_bound) {
    CU_TRY(k3c_kda_gate(STREAM(be), r, dt_bias, a_log, T, H, dk, has_lower_bound, lower_bound));
    return K3_OK;
}
static k3_status cu_attnres_mix(k3_backend *be, const float *bank, int n_bank, const float *p,
                                const float *w, int64_t T, int64_t D, float eps, float *out) {
    if (n_bank < 0 || n_bank + 1 > 64)
        return K3_ERR(K3_ERR_ARG, "attnres_mix: %d banked sources (0..%d)", n_bank, 63);
    CU_TRY(k3c_attnres_mix(STREAM(be), bank, n_bank, p, w, T, D, eps, out));
    return K3_OK;
}
/* The KDA kernels' mode (K3C_KDA_*) from the backend's options; with the bf16 state
 * (K3_CUDA_KDA_STATE=bf16) the shape, the chunk and the state's alignment are checked here. */
static k3_status kda_mode(k3_backend *be, const char *op, int dk, int dv, int C, const float *S,
                          int64_t S_stride, int *mode) {
    const cu_ctx *c = CTX(be);
    *mode = (c->mma ? K3C_KDA_MMA : 0) | (c->kda_bf16 ? K3C_KDA_BF16 : 0);
    if (c->kda_bf16 && (!k3c_kda_bf16_fits(dk, dv, C) || ((uintptr_t)S & 7u) || S_stride % 2))
        return K3_ERR(K3_ERR_ARG,
                      "%s: the bf16 KDA state (K3_CUDA_KDA_STATE=bf16) takes dv %% 16 == 0, dk %% "
                      "16 == 0, both <= 128, chunk 0 or 16, an 8-byte aligned state and an even "
                      "stride; got dk %d, dv %d, chunk %d, state %p, stride %lld",
                      op, dk, dv, C, (const void *)S, (long long)S_stride);
    return K3_OK;
}
static k3_status cu_kda_recurrent(k3_backend *be, const float *q, const float *k, const float *v,
                                  const float *g, const float *beta, int64_t n, int H, int dk,
                                  int dv, float scale, float *S, float *o) {
    K3_TRY(k3_kernels_check_kda(dk, dv, 1));
    int mode;
    K3_TRY(kda_mode(be, "kda_recurrent", dk, dv, 0, S, 0, &mode));
    CU_TRY(k3c_kda(STREAM(be), q, k, v, g, beta, n, H, dk, dv, scale, S, o, 0, NULL, 0, mode));
    return K3_OK;
}
static k3_status cu_kda_chunked(k3_backend *be, const float *q, const float *k, const float *v,
                                const float *g, const float *beta, int64_t n, int H, int dk, int dv,
                                float scale, float *S, float *o, int C, float *work) {
    K3_TRY(k3_kernels_check_kda(dk, dv, C));
    int mode;
    K3_TRY(kda_mode(be, "kda_chunked", dk, dv, C, S, 0, &mode));
    CU_TRY(k3c_kda(STREAM(be), q, k, v, g, beta, n, H, dk, dv, scale, S, o, C, work,
                   k3_kda_chunk_work_floats(C, dk, dv), mode));
    return K3_OK;
}
/* The tensor-core MLA (mla_mma.cu) for W <= K3C_MLA_MAX_W, by default with split operands
 * (mla_terms 3: fp32-grade, DESIGN §3b); K3_CUDA_MMA=1 takes plain bf16 operands (moves tiny
 * models' greedy tokens), K3_CUDA_MMA=0 the fp32 CUDA-core kernels of attn.cu: attn_paged (sq) or
 * one attn_latent query (sq NULL, n_ctx rows). Its split partials live in the backend's scratch of
 * MLA_PART_CAP floats, allocated with the backend and never moved (a captured step keeps its
 * address; no call here syncs or allocates); a batch's tokens go in groups that fit it. */
static k3_status cu_attn_mla(k3_backend *be, const k3c_seqs *sq, int64_t n_ctx, const float *qc,
                             const float *cache, int H, int W, int Rkv, float scale, float *o_lat) {
    cu_ctx *c = CTX(be);
    const int64_t T = sq ? sq->T : 1;
    const int64_t per = k3c_attn_mla_part_floats(sq ? sq->max_ctx : n_ctx, H, Rkv);
    if (per > c->mla_part_cap)
        return K3_ERR(K3_ERR_ARG,
                      "%s: %d heads of %d latent columns need %lld floats of split scratch a "
                      "token, past the backend's %lld",
                      sq ? "attn_paged" : "attn_latent", H, Rkv, (long long)per,
                      (long long)c->mla_part_cap);
    const int64_t tb = per > 0 && per * T > c->mla_part_cap ? c->mla_part_cap / per : T;
    CU_TRY(k3c_attn_mla(STREAM(be), sq, n_ctx, qc, cache, H, W, Rkv, scale, o_lat, c->mla_part, tb,
                        c->mla_terms));
    return K3_OK;
}
static k3_status cu_attn_latent(k3_backend *be, const float *qc, const float *cache, int64_t n_ctx,
                                int H, int W, int Rkv, float scale, float *o_lat, float *work) {
    K3_TRY(k3_kernels_check_attn("attn_latent", 0, n_ctx, H, W, Rkv));
    if (CTX(be)->mla_terms && W <= K3C_MLA_MAX_W && n_ctx > 0)
        return cu_attn_mla(be, NULL, n_ctx, qc, cache, H, W, Rkv, scale, o_lat);
    CU_TRY(k3c_attn_latent(STREAM(be), qc, cache, n_ctx, H, W, Rkv, scale, o_lat, work));
    return K3_OK;
}
/* One attn_latent per query, in stream order (they share work and the scratch): correct, not
 * fast — a causal flash kernel is future work. */
static k3_status cu_attn_latent_causal(k3_backend *be, const float *qc, const float *cache,
                                       int64_t pos0, int64_t n_q, int H, int W, int Rkv,
                                       float scale, float *o_lat, float *work) {
    K3_TRY(k3_kernels_check_attn("attn_latent_causal", pos0, n_q, H, W, Rkv));
    for (int64_t j = 0; j < n_q; j++)
        K3_TRY(cu_attn_latent(be, qc + j * H * W, cache, pos0 + j + 1, H, W, Rkv, scale,
                              o_lat + j * H * Rkv, work));
    return K3_OK;
}
static k3_status cu_moe_topk(k3_backend *be, const float *scores, const float *bias, int64_t T,
                             int E, int K, int n_group, int topk_group, bool renorm, float scale,
                             float *work, int32_t *ids, float *w) {
    K3_TRY(k3_kernels_check_topk(E, K, n_group, topk_group));
    if (T <= 0) return K3_OK;
    unsigned long long *word;
    bool deferred;
    K3_TRY(err_word(be, &word, &deferred));
    CU_TRY(k3c_moe_topk(STREAM(be), scores, bias, T, E, K, n_group, topk_group, renorm, scale, work,
                        ids, w, word));
    if (deferred) {
        err_defer(CTX(be), K3_OP_moe_topk, NULL, E);
        return K3_OK;
    }
    unsigned long long bad;
    K3_TRY(err_read(be, &bad));
    if (bad == ~0ull) return K3_OK;
    /* a non-finite score is no error (NaN weights: the token's sequence fails alone, as on ref) */
    return K3_ERR(K3_ERR_INTERNAL, "MoE router: ran out of experts at token %lld",
                  (long long)(bad / (unsigned long long)(E + 2)));
}
static k3_status cu_rows_gather(k3_backend *be, const float *src, int64_t width, const int64_t *idx,
                                int64_t n, float *dst) {
    if (n <= 0 || width <= 0) return K3_OK;
    const void *d;
    K3_TRY(stage(be, idx, (size_t)n * sizeof(int64_t), &d));
    CU_TRY(k3c_rows_copy(STREAM(be), src, width, d, n, dst, 0));
    return K3_OK;
}
static k3_status cu_rows_scatter(k3_backend *be, const float *src, int64_t width,
                                 const int64_t *idx, int64_t n, float *dst) {
    if (n <= 0 || width <= 0) return K3_OK;
    const void *d;
    K3_TRY(stage(be, idx, (size_t)n * sizeof(int64_t), &d));
    CU_TRY(k3c_rows_copy(STREAM(be), src, width, d, n, dst, 1));
    return K3_OK;
}
static k3_status cu_rows_wsum(k3_backend *be, const float *x, const float *w, const int64_t *seg,
                              int64_t seg_len, int64_t n_seg, int64_t width, float *y) {
    K3_TRY(k3_kernels_check_seg(seg, seg_len, n_seg));
    if (n_seg <= 0 || width <= 0) return K3_OK;
    const void *d = NULL;
    if (seg) K3_TRY(stage(be, seg, (size_t)(n_seg + 1) * sizeof(int64_t), &d));
    CU_TRY(k3c_rows_wsum(STREAM(be), x, w, d, seg_len, n_seg, width, y));
    return K3_OK;
}

/* ---- varlen ops (the batch descriptor's arrays are device memory; its scalars size grids) -- */
static k3c_seqs cseqs(const k3_seqs *sq) {
    k3c_seqs c = {sq->n_seqs, sq->max_blocks, sq->T,    sq->max_ctx, sq->max_new,
                  sq->tok0,   sq->pos,        sq->slot, sq->blocks};
    return c;
}
/* The descriptor checks of kernels/ref (ref_seqs.c). paged: a block table covering max_ctx (the
   host's scalars bound every sequence's positions, so this needs no read of the arrays). */
static k3_status check_seqs(const k3_seqs *sq, bool paged, const char *op) {
    if (!sq || sq->n_seqs < 0 || sq->T < 0 ||
        (sq->n_seqs > 0 && (!sq->tok0 || !sq->pos || !sq->slot)))
        return K3_ERR(K3_ERR_ARG, "%s: no batch descriptor", op);
    if (paged && sq->n_seqs > 0 && !sq->blocks)
        return K3_ERR(K3_ERR_ARG, "%s: the descriptor has no block table", op);
    if (paged && sq->T > 0 && (sq->max_ctx - 1) / K3_KV_BLOCK >= sq->max_blocks)
        return K3_ERR(K3_ERR_ARG, "%s: position %lld past the %d blocks of a sequence", op,
                      (long long)(sq->max_ctx - 1), sq->max_blocks);
    return K3_OK;
}

static k3_status cu_rmsnorm_rows(k3_backend *be, const float *x, int64_t xs, const float *w,
                                 int64_t T, int64_t n, float eps, float *y, int64_t ys) {
    K3_TRY(k3_kernels_check_rows(xs, ys, n));
    if (T < 0) return K3_ERR(K3_ERR_ARG, "rmsnorm_rows: %lld rows", (long long)T);
    CU_TRY(k3c_rownorm(STREAM(be), 0, x, xs, w, T, n, eps, y, ys));
    return K3_OK;
}
/* One launch for all heads (grid.z = head): no use of work. */
static k3_status cu_matmul_heads(k3_backend *be, const float *x, int64_t xt, int64_t xh, int64_t T,
                                 int H, const k3_tensor *W, int64_t r0, int64_t rh, int64_t nr,
                                 bool trans, float *y, int64_t yt, int64_t yh, float *work) {
    (void)work;
    K3_TRY(k3_kernels_check_heads(W, H, T, r0, rh, nr));
    K3_TRY(k3_kernels_check_weight(W, "matmul_heads"));
    if (T == 0 || H == 0) return K3_OK;
    k3_tensor v0; /* the view of row r0 on (data and scales offset by dtype) */
    K3_TRY(k3_tensor_rows(W, r0, W->shape[0] - r0, &v0));
    count_flops(be, K3_OP_matmul_heads, 2.0 * (double)T * H * (double)nr * (double)W->shape[1],
                false);
    CU_TRY(k3c_matmul_heads(STREAM(be), (int)W->dtype, v0.data, v0.scale, nr, W->shape[1], rh, H, x,
                            xt, xh, T, y, yt, yh, trans));
    return K3_OK;
}
static k3_status cu_kv_write(k3_backend *be, const k3_seqs *sq, const float *src, int W,
                             float *cache) {
    K3_TRY(check_seqs(sq, true, "kv_write"));
    if (W < 1) return K3_ERR(K3_ERR_ARG, "kv_write: rows of %d floats", W);
    const k3c_seqs c = cseqs(sq);
    CU_TRY(k3c_kv_write(STREAM(be), &c, src, W, cache));
    return K3_OK;
}
/* W <= K3C_MLA_MAX_W: the tensor-core kernel (cu_attn_mla, mla_mma.cu) unless K3_CUDA_MMA=0; wider
   rows: one fp32 launch, no scratch (the kernel keeps scores in shared memory or recomputes them),
   attn.cu. */
static k3_status cu_attn_paged(k3_backend *be, const k3_seqs *sq, const float *qc,
                               const float *cache, int H, int W, int Rkv, float scale, float *o_lat,
                               float *work) {
    (void)work;
    K3_TRY(check_seqs(sq, true, "attn_paged"));
    K3_TRY(k3_kernels_check_attn("attn_paged", 0, sq->max_ctx, H, W, Rkv));
    const k3c_seqs c = cseqs(sq);
    if (CTX(be)->mla_terms && W <= K3C_MLA_MAX_W)
        return cu_attn_mla(be, &c, 0, qc, cache, H, W, Rkv, scale, o_lat);
    CU_TRY(k3c_attn_paged(STREAM(be), &c, qc, cache, H, W, Rkv, scale, o_lat));
    return K3_OK;
}
static k3_status cu_short_conv_seqs(k3_backend *be, const k3_seqs *sq, const float *in, int64_t P,
                                    int K, const float *w, float *state, int64_t state_stride,
                                    float *out) {
    K3_TRY(check_seqs(sq, false, "short_conv_seqs"));
    if (K < 1 || P < 0)
        return K3_ERR(K3_ERR_ARG, "short_conv_seqs: %lld channels, kernel %d", (long long)P, K);
    const k3c_seqs c = cseqs(sq);
    CU_TRY(k3c_short_conv_seqs(STREAM(be), &c, in, P, K, w, state, state_stride, out));
    return K3_OK;
}
static k3_status cu_kda_seqs(k3_backend *be, const k3_seqs *sq, const float *q, const float *k,
                             const float *v, const float *g, const float *beta, int H, int dk,
                             int dv, float scale, float *S, int64_t S_stride, float *o, int C,
                             float *work) {
    K3_TRY(check_seqs(sq, false, "kda_seqs"));
    K3_TRY(k3_kernels_check_kda(dk, dv, C >= 2 ? C : 1));
    const bool chunked = C >= 2 && sq->max_new >= C;
    if (chunked && !work) return K3_ERR(K3_ERR_ARG, "kda_seqs: chunk %d needs its work", C);
    const size_t wf = C >= 2 ? k3_kda_chunk_work_floats(C, dk, dv) : 0;
    int mode;
    K3_TRY(kda_mode(be, "kda_seqs", dk, dv, C >= 2 ? C : 0, S, S_stride, &mode));
    const k3c_seqs c = cseqs(sq);
    CU_TRY(k3c_kda_seqs(STREAM(be), &c, q, k, v, g, beta, H, dk, dv, scale, S, S_stride, o, C, work,
                        wf, mode));
    return K3_OK;
}
static k3_status cu_nonfinite_rows(k3_backend *be, const k3_seqs *sq, float *y, int64_t D,
                                   bool per_seq, int32_t code, int32_t *flags) {
    K3_TRY(check_seqs(sq, false, "nonfinite_rows"));
    if (D < 0) return K3_ERR(K3_ERR_ARG, "nonfinite_rows: rows of %lld", (long long)D);
    const k3c_seqs c = cseqs(sq);
    CU_TRY(k3c_nonfinite_rows(STREAM(be), &c, y, D, per_seq, code, flags));
    return K3_OK;
}
static k3_status cu_rows_last(k3_backend *be, const k3_seqs *sq, const float *src, int64_t slab,
                              int n_slab, int64_t D, float *dst) {
    K3_TRY(check_seqs(sq, false, "rows_last"));
    if (n_slab < 0 || D < 0)
        return K3_ERR(K3_ERR_ARG, "rows_last: %d slabs of rows of %lld", n_slab, (long long)D);
    const k3c_seqs c = cseqs(sq);
    CU_TRY(k3c_rows_last(STREAM(be), &c, src, slab, n_slab, D, dst));
    return K3_OK;
}

/* ---- moe_experts ----------------------------------------------------------------------------- */
static const k3_tensor *expert_mat(const k3_tensor *base, size_t e_stride, int e) {
    return (const k3_tensor *)((const char *)base + (size_t)e * e_stride);
}
/* A matrix moe_experts can run: 2-D [rows, cols], F32/BF16/MXFP4 (MXFP4: cols % 32, scales). */
static bool mat_ok(const k3_tensor *t, int64_t rows, int64_t cols) {
    if (!t->data || t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) return false;
    if (t->dtype == K3_DT_MXFP4) return cols % 32 == 0 && t->scale;
    return t->dtype == K3_DT_F32 || t->dtype == K3_DT_BF16;
}
/* The error naming what is wrong with expert e (a present expert whose table entry is bad). */
static k3_status expert_error(const moe_tab *t, int e) {
    const k3_tensor *m[3] = {expert_mat(t->w1, t->e_stride, e), expert_mat(t->w3, t->e_stride, e),
                             expert_mat(t->w2, t->e_stride, e)};
    const char *name[3] = {"w1", "w3", "w2"};
    const int64_t rows[3] = {t->I, t->I, t->Lw}, cols[3] = {t->Lw, t->Lw, t->I};
    for (int j = 0; j < 3; j++)
        if (!mat_ok(m[j], rows[j], cols[j]))
            return K3_ERR(K3_ERR_SHAPE,
                          "moe_experts: expert %d: %s must be a 2-D [%lld, %lld] F32/BF16/MXFP4 "
                          "matrix with its data (has %s [%lld, %lld]%s)",
                          e, name[j], (long long)rows[j], (long long)cols[j],
                          k3_dtype_name(m[j]->dtype), (long long)m[j]->shape[0],
                          (long long)m[j]->shape[1], m[j]->data ? "" : ", no data");
    return K3_ERR(K3_ERR_INTERNAL, "moe_experts: expert %d marked bad", e);
}
/* The tensor-core form of a table (every present expert MXFP4 and usable): each present expert's
   three matrices downloaded, repacked into fragment order on the host (k3c_mxfp4_repack) and
   uploaded into the table's slot buffers, one expert at a time (host memory: one expert). */
static k3_status tab_repack(moe_tab *t) {
    const int64_t N[3] = {t->I, t->I, t->Lw}, K[3] = {t->Lw, t->Lw, t->I};
    int ns = 0;
    K3_TRY(k3_calloc((void **)&t->slot, (size_t)t->E * sizeof *t->slot, "cuda expert slots"));
    for (int e = 0; e < t->E; e++) t->slot[e] = t->host[e].data[0] ? ns++ : -1;
    CU_TRY(cudaMalloc((void **)&t->slot_dev, (size_t)t->E * sizeof *t->slot_dev));
    CU_TRY(
        cudaMemcpy(t->slot_dev, t->slot, (size_t)t->E * sizeof *t->slot, cudaMemcpyHostToDevice));
    size_t nw[3], nsc[3], most = 0;
    for (int j = 0; j < 3; j++) {
        nw[j] = (size_t)k3c_mxfp4_frag_words(N[j], K[j]) * 4;
        nsc[j] = (size_t)k3c_mxfp4_frag_scales(N[j], K[j]);
        CU_TRY(cudaMalloc((void **)&t->words[j], nw[j] * (size_t)ns));
        CU_TRY(cudaMalloc((void **)&t->scales[j], nsc[j] * (size_t)ns));
        most = nw[j] + nsc[j] > most ? nw[j] + nsc[j] : most;
    }
    uint8_t *h = NULL; /* native bytes | native scales | words | scales of one matrix */
    K3_TRY(k3_calloc((void **)&h, 2 * most, "cuda expert repack"));
    k3_status st = K3_OK;
    for (int e = 0; e < t->E && st == K3_OK; e++) {
        const k3c_expert *x = &t->host[e];
        for (int j = 0; j < 3 && x->data[0] && st == K3_OK; j++) {
            uint8_t *nat = h, *nsc_h = h + nw[j], *w = h + most, *sc = w + nw[j];
            cudaError_t ce = cudaMemcpy(nat, x->data[j], nw[j], cudaMemcpyDeviceToHost);
            if (ce == cudaSuccess)
                ce = cudaMemcpy(nsc_h, x->scale[j], nsc[j], cudaMemcpyDeviceToHost);
            if (ce == cudaSuccess) {
                k3c_mxfp4_repack(nat, nsc_h, N[j], K[j], (uint32_t *)(void *)w, sc);
                const size_t at = (size_t)t->slot[e];
                ce = cudaMemcpy((uint8_t *)t->words[j] + at * nw[j], w, nw[j],
                                cudaMemcpyHostToDevice);
                if (ce == cudaSuccess)
                    ce = cudaMemcpy(t->scales[j] + at * nsc[j], sc, nsc[j], cudaMemcpyHostToDevice);
            }
            if (ce != cudaSuccess) st = cu_err(ce, __FILE__, __LINE__, "expert repack copy");
        }
    }
    k3_free(h);
    t->n_slots = ns;
    t->mma = st == K3_OK;
    return st;
}
/* Build the device table of an expert table: every expert's three matrices (data NULL: not on
   this rank; bad: present but not usable, named on use). */
static k3_status tab_build(moe_tab *t) {
    t->e_first = t->e_last = -1;
    t->I = t->Lw = 0;
    for (int e = 0; e < t->E; e++) {
        const k3_tensor *w1 = expert_mat(t->w1, t->e_stride, e);
        if (!w1->data || !expert_mat(t->w3, t->e_stride, e)->data ||
            !expert_mat(t->w2, t->e_stride, e)->data)
            continue;
        if (t->e_first < 0) {
            t->e_first = e;
            t->I = w1->ndim == 2 ? w1->shape[0] : 0;
            t->Lw = w1->ndim == 2 ? w1->shape[1] : 0;
        }
        t->e_last = e;
    }
    for (int e = 0; e < t->E; e++) {
        const k3_tensor *m[3] = {expert_mat(t->w1, t->e_stride, e),
                                 expert_mat(t->w3, t->e_stride, e),
                                 expert_mat(t->w2, t->e_stride, e)};
        k3c_expert *x = &t->host[e];
        memset(x, 0, sizeof *x);
        if (!m[0]->data || !m[1]->data || !m[2]->data) continue; /* not loaded here */
        for (int j = 0; j < 3; j++) {
            x->data[j] = m[j]->data;
            x->scale[j] = m[j]->scale;
            x->dt[j] = (int32_t)m[j]->dtype;
        }
        x->bad = !mat_ok(m[0], t->I, t->Lw) || !mat_ok(m[1], t->I, t->Lw) ||
                 !mat_ok(m[2], t->Lw, t->I) || t->I < 1 || t->Lw < 1;
    }
    t->d_first = t->e_first >= 0 ? expert_mat(t->w1, t->e_stride, t->e_first)->data : NULL;
    t->d_last = t->e_last >= 0 ? expert_mat(t->w1, t->e_stride, t->e_last)->data : NULL;
    t->lo = UINTPTR_MAX, t->hi = 0;
    bool mma = t->e_first >= 0 && t->Lw % 32 == 0 && t->I % 32 == 0;
    for (int e = 0; e < t->E; e++) {
        const k3c_expert *x = &t->host[e];
        if (!x->data[0]) continue;
        mma = mma && !x->bad;
        for (int j = 0; j < 3; j++) {
            mma = mma && x->dt[j] == K3_DT_MXFP4;
            const uintptr_t a[2] = {(uintptr_t)x->data[j], (uintptr_t)x->scale[j]};
            for (int i = 0; i < 2; i++)
                if (a[i])
                    t->lo = a[i] < t->lo ? a[i] : t->lo, t->hi = a[i] >= t->hi ? a[i] + 1 : t->hi;
        }
    }
    /* a new buffer no kernel uses yet, or (rebuild) the stream drained: a plain copy is ordered */
    CU_TRY(cudaMemcpy(t->dev, t->host, (size_t)t->E * sizeof(k3c_expert), cudaMemcpyHostToDevice));
    if (mma) K3_TRY(tab_repack(t));
    return K3_OK;
}
static k3_status tab_alloc(moe_tab *t) {
    K3_TRY(k3_calloc((void **)&t->host, (size_t)t->E * sizeof(k3c_expert), "cuda expert table"));
    CU_TRY(cudaMalloc((void **)&t->dev, (size_t)t->E * sizeof(k3c_expert)));
    return K3_OK;
}
/* The cached device table of (w1, w3, w2, e_stride, E), built on first use. */
static k3_status tab_get(k3_backend *be, const k3_tensor *w1, const k3_tensor *w3,
                         const k3_tensor *w2, size_t e_stride, int E, moe_tab **out) {
    cu_ctx *c = CTX(be);
    (void)cu_stream(be);
    for (int i = 0; i < c->n_tabs; i++) {
        moe_tab *t = &c->tabs[i];
        if (t->w1 != w1 || t->w3 != w3 || t->w2 != w2 || t->e_stride != e_stride || t->E != E)
            continue;
        const void *df = t->e_first >= 0 ? expert_mat(w1, e_stride, t->e_first)->data : NULL;
        const void *dl = t->e_last >= 0 ? expert_mat(w1, e_stride, t->e_last)->data : NULL;
        if (df != t->d_first || dl != t->d_last) { /* the table moved under its address */
            CU_TRY(cudaStreamSynchronize(c->stream));
            moe_tab keep = *t; /* the same key and host / device tables, a fresh repack */
            tab_free(t);
            memset(t, 0, sizeof *t);
            t->w1 = keep.w1, t->w3 = keep.w3, t->w2 = keep.w2, t->e_stride = keep.e_stride;
            t->E = keep.E;
            K3_TRY(tab_alloc(t));
            K3_TRY(tab_build(t));
        }
        *out = t;
        return K3_OK;
    }
    if (c->n_tabs == c->cap_tabs) { /* grows on the first step (one table per MoE layer) */
        int cap = c->cap_tabs ? 2 * c->cap_tabs : 16;
        moe_tab *nt;
        K3_TRY(k3_calloc((void **)&nt, (size_t)cap * sizeof *nt, "cuda expert tables"));
        if (c->n_tabs) memcpy(nt, c->tabs, (size_t)c->n_tabs * sizeof *nt);
        k3_free(c->tabs);
        c->tabs = nt;
        c->cap_tabs = cap;
    }
    moe_tab *t = &c->tabs[c->n_tabs];
    memset(t, 0, sizeof *t);
    t->w1 = w1, t->w3 = w3, t->w2 = w2, t->e_stride = e_stride, t->E = E;
    k3_status st = tab_alloc(t);
    if (st == K3_OK) st = tab_build(t);
    if (st != K3_OK) {
        tab_free(t);
        return st;
    }
    c->n_tabs++;
    *out = t;
    return K3_OK;
}

/* The activation terms of the W4A16 expert GEMMs (moe_mma.cu, k3c_split_bf16): K3_CUDA_MOE_TERMS by
   default; K3_CUDA_MMA_TERMS=1, 2 or 3 (environment) picks another (1: plain bf16 activations, the
   fastest prefill and the least faithful: docs/DESIGN.md §3b's table). Anything else is an error
   naming the variable. */
static k3_status moe_terms(int *terms) {
    const char *v = getenv("K3_CUDA_MMA_TERMS");
    *terms = K3_CUDA_MOE_TERMS;
    if (!v || !*v) return K3_OK;
    if ((v[0] < '1' || v[0] > '0' + K3C_W4_MAX_TERMS) || v[1])
        return K3_ERR(K3_ERR_ARG, "K3_CUDA_MMA_TERMS=%s: want 1, 2 or 3 (bf16 activation terms)",
                      v);
    *terms = v[0] - '0';
    return K3_OK;
}
/* The verdict of moe_experts' device route (k3c_moe_route's key, ~0: none): the row with a bad
   id or an expert not on this rank, else the first expert over its capacity (K3_ERR_STATE). n:
   the call's rows; cap: the capacity of a tile (per_tok: a token's slots name distinct experts,
   so an expert takes at most one item of each token of the tile); layer: the step's layer (< 0:
   unknown); deferred: read at the end of the step. */
static k3_status route_error(unsigned long long key, int64_t n, int E, int64_t cap, bool per_tok,
                             int layer, bool deferred) {
    if (key == ~0ull) return K3_OK;
    char at[48] = "", late[64] = "";
    if (layer >= 0) snprintf(at, sizeof at, "layer %d: ", layer);
    if (deferred) snprintf(late, sizeof late, " (a deferred check, read at the end of the step)");
    const int64_t hi = (int64_t)(key >> 32);
    const int32_t lo = (int32_t)(uint32_t)key;
    if (hi < n && (lo < 0 || lo >= E))
        return K3_ERR(K3_ERR_ARG, "%smoe_experts: row %lld has expert id %d outside [0, %d)%s", at,
                      (long long)hi, lo, E, late);
    if (hi < n)
        return K3_ERR(K3_ERR_MISSING,
                      "%smoe_experts: row %lld needs expert %d, which is not loaded on this rank%s",
                      at, (long long)hi, lo, late);
    return K3_ERR(K3_ERR_STATE,
                  "%smoe_experts: expert %lld received %d rows, over its capacity of %lld rows%s "
                  "(never dropped: the step fails)%s",
                  at, (long long)(hi - n), lo, (long long)cap,
                  per_tok ? " (one per token: a token's slots must name distinct experts)" : "",
                  late);
}
/* The tensor-core form of moe_experts (the table's experts are MXFP4: t->mma), routed on the
   device with no host read: per tile of m slot rows (whole tokens when w sums them) one route
   kernel (k3c_moe_route: per-expert counts, the contiguous layout's offsets and the gather /
   scatter rows, stable: slot order within an expert; ids and presence checked, and each expert's
   rows against the tile's capacity) and two grouped W4A16 GEMMs (moe_mma.cu): W1 / W3 fused with
   the activation into h [m, I] (work; x rows gathered by the kernel), then W2, whose epilogue
   writes each item to its slot row (out, or with w the items part of work, which one
   k3c_rows_wsum then sums per token in slot order: deterministic). The capacity (the grid's
   max_rows): with w the tile's tokens (a token's K slots name distinct experts, as the router's
   top-k gives them), else its rows. The check's word is deferred while errors are
   (k3_backend_errors_defer: read at the end of the step), else read here (a host sync). */
static k3_status moe_mma(k3_backend *be, const moe_tab *t, const float *src, int64_t row_div,
                         const int32_t *row_of, const int32_t *ids, const float *w, int64_t n,
                         float beta, float lin_beta, float *out, float *work) {
    cu_ctx *c = CTX(be);
    const int E = t->E;
    const int64_t Lw = t->Lw, I = t->I, per = w ? row_div : 1;
    /* work: h [m, I] | items [m, Lw] (w) | off int64 [E + 1] | src_row, dst_row int32 [m] */
    const size_t avail = k3_moe_experts_work_floats(Lw, I, n, E), fixed = 2 * (size_t)E + 2 + 64;
    int64_t m = avail > fixed ? (int64_t)((avail - fixed) / (size_t)(I + (w ? Lw : 0) + 2)) : 0;
    m = (m < n ? m : n) / per * per;
    if (m > 65535 * 16) m = 65535 * 16 / per * per; /* grid.y of the GEMM */
    if (m < per) return K3_ERR(K3_ERR_INTERNAL, "moe_experts: work holds no whole token");
    float *h = work, *items = work + ((size_t)(m * I) + 15) / 16 * 16;
    float *rt = items + (w ? ((size_t)(m * Lw) + 15) / 16 * 16 : 0);
    int64_t *doff = (int64_t *)(void *)rt;
    int32_t *dsrc = (int32_t *)(void *)(rt + ((size_t)(2 * (E + 1)) + 15) / 16 * 16),
            *ddst = dsrc + m;
    int terms;
    K3_TRY(moe_terms(&terms));
    unsigned long long *word;
    bool deferred;
    K3_TRY(err_word(be, &word, &deferred));
    const int64_t cap = w ? m / row_div : m; /* of a tile */
    for (int64_t r0 = 0; r0 < n; r0 += m) {
        const int64_t mt = n - r0 < m ? n - r0 : m, mcap = w ? mt / row_div : mt;
        CU_TRY(k3c_moe_route(c->stream, ids, r0, mt, n, row_div, row_of, E, t->slot_dev, mcap, doff,
                             dsrc, ddst, w ? 0 : r0, word));
        k3c_w4_rows rows = {doff, NULL, 0, mcap, t->slot_dev, dsrc, NULL};
        CU_TRY(k3c_w4a16_grouped(c->stream, t->words[0], t->scales[0], t->words[1], t->scales[1], E,
                                 I, Lw, rows, beta, lin_beta, terms, src, h));
        rows.src_row = NULL, rows.dst_row = ddst;
        CU_TRY(k3c_w4a16_grouped(c->stream, t->words[2], t->scales[2], NULL, NULL, E, Lw, I, rows,
                                 beta, lin_beta, terms, h, w ? items : out));
        if (w)
            CU_TRY(k3c_rows_wsum(c->stream, items, w + r0, NULL, row_div, mt / row_div, Lw,
                                 out + r0 / row_div * Lw));
    }
    /* the tensor-core kernels (the emulation counts their mma; test_cuda_ops checks them) */
    count_flops(be, K3_OP_moe_experts, 6.0 * (double)n * (double)I * (double)Lw, true);
    if (deferred) {
        err_defer(c, K3_OP_moe_experts, NULL, n);
        c->defer_what[c->defer_n - 1].E = E;
        c->defer_what[c->defer_n - 1].cap = cap;
        c->defer_what[c->defer_n - 1].per_tok = w != NULL;
        return K3_OK;
    }
    unsigned long long bad;
    K3_TRY(err_read(be, &bad));
    return route_error(bad, n, E, cap, w != NULL, -1, false);
}

/* The ids are device memory: one check kernel names the first bad row (a host sync, as
   embed_rows), then per tile of rows two launches (moe.cu): W1/W3 + act into h [tile, I] (work),
   then W2 (and with w the slot sum). The tile is as many rows as the caller's work holds
   (k3_moe_experts_work_floats), whole tokens when w sums them. */
static k3_status cu_moe_experts(k3_backend *be, const float *src, int64_t row_div,
                                const int32_t *row_of, const int32_t *ids, const float *w,
                                int64_t n, int E, const k3_tensor *w1, const k3_tensor *w3,
                                const k3_tensor *w2, size_t e_stride, float beta, float lin_beta,
                                float *out, float *work) {
    if (n <= 0) return K3_OK;
    K3_TRY(k3_kernels_check_moe(row_div, w, n, E));
    if (!w1 || !w3 || !w2)
        return K3_ERR(K3_ERR_MISSING, "moe_experts: no expert table (no expert on this rank)");
    moe_tab *t = NULL;
    K3_TRY(tab_get(be, w1, w3, w2, e_stride, E, &t));
    if (t->mma) return moe_mma(be, t, src, row_div, row_of, ids, w, n, beta, lin_beta, out, work);
    K3_TRY(err_reset(be));
    CU_TRY(k3c_moe_check(STREAM(be), ids, n, E, t->dev, CTX(be)->err_dev));
    unsigned long long bad;
    K3_TRY(err_read(be, &bad));
    if (bad != ~0ull) { /* key: row (id or presence), else n + row (the expert's shapes) */
        const int64_t row = (int64_t)(bad < (unsigned long long)n ? bad : bad - (uint64_t)n);
        int32_t id = 0;
        CU_TRY(cudaMemcpy(&id, ids + row, sizeof id, cudaMemcpyDeviceToHost));
        if (id < 0 || id >= E)
            return K3_ERR(K3_ERR_ARG, "moe_experts: row %lld has expert id %d outside [0, %d)",
                          (long long)row, id, E);
        if (!t->host[id].data[0])
            return K3_ERR(K3_ERR_MISSING,
                          "moe_experts: row %lld needs expert %d, which is not loaded on this rank",
                          (long long)row, id);
        return expert_error(t, id);
    }
    const int64_t Lw = t->Lw, I = t->I, per = w ? row_div : 1;
    count_flops(be, K3_OP_moe_experts, 6.0 * (double)n * (double)I * (double)Lw, false);
    int64_t tile = (int64_t)(k3_moe_experts_work_floats(Lw, I, n, E) / (size_t)I);
    if (tile > 65535) tile = 65535; /* grid.y */
    tile = tile / per * per;
    const bool x_vec = (uintptr_t)src % 16 == 0 && Lw % 4 == 0;
    const bool h_vec = (uintptr_t)work % 16 == 0 && I % 4 == 0;
    for (int64_t r0 = 0; r0 < n; r0 += tile) {
        const int64_t m = n - r0 < tile ? n - r0 : tile;
        CU_TRY(k3c_moe_up(STREAM(be), src, row_div, row_of, ids, t->dev, r0, m, Lw, I, x_vec, beta,
                          lin_beta, work));
        CU_TRY(k3c_moe_down(STREAM(be), work, ids, w, row_div, t->dev, r0, m, Lw, I, h_vec, out));
    }
    return K3_OK;
}

/* ---- the masked layout (k3_cuda_moe.h) ------------------------------------------------------ */
static k3_status moe_masked_tab(k3_backend *be, const k3_tensor *w1, const k3_tensor *w3,
                                const k3_tensor *w2, size_t e_stride, int E, moe_tab **t) {
    if (!be || !be->name || strcmp(be->name, "cuda") != 0)
        return K3_ERR(K3_ERR_ARG, "k3_cuda_moe: backend %s is not cuda",
                      be && be->name ? be->name : "(none)");
    if (E < 1 || !w1 || !w3 || !w2)
        return K3_ERR(K3_ERR_ARG, "k3_cuda_moe: %d experts, table %s", E,
                      w1 && w3 && w2 ? "given" : "missing");
    K3_TRY(tab_get(be, w1, w3, w2, e_stride, E, t));
    if ((*t)->mma) return K3_OK;
    for (int e = 0; e < E; e++)
        if ((*t)->host[e].data[0] && (*t)->host[e].bad) return expert_error(*t, e);
    return K3_ERR(K3_ERR_ARG,
                  "k3_cuda_moe: the experts must be MXFP4 with Lw (%lld) and I (%lld) multiples of "
                  "32, and one at least on this rank",
                  (long long)(*t)->Lw, (long long)(*t)->I);
}
k3_status k3_cuda_moe_prepare(k3_backend *be, const k3_tensor *w1, const k3_tensor *w3,
                              const k3_tensor *w2, size_t e_stride, int E) {
    moe_tab *t = NULL;
    return moe_masked_tab(be, w1, w3, w2, e_stride, E, &t);
}
k3_status k3_cuda_moe_experts_masked(k3_backend *be, const float *x, const int32_t *count,
                                     int64_t cap, int E, const k3_tensor *w1, const k3_tensor *w3,
                                     const k3_tensor *w2, size_t e_stride, float beta,
                                     float lin_beta, float *h, float *y) {
    moe_tab *t = NULL;
    K3_TRY(moe_masked_tab(be, w1, w3, w2, e_stride, E, &t));
    if (cap < 1 || cap > 65535 * 16 || !x || !count || !h || !y)
        return K3_ERR(K3_ERR_ARG, "k3_cuda_moe_experts_masked: capacity %lld (1 .. %d), buffers %s",
                      (long long)cap, 65535 * 16, x && count && h && y ? "given" : "missing");
    const k3c_w4_rows rows = {NULL, count, cap, cap, t->slot_dev, NULL, NULL};
    int terms;
    K3_TRY(moe_terms(&terms));
    CU_TRY(k3c_w4a16_grouped(STREAM(be), t->words[0], t->scales[0], t->words[1], t->scales[1], E,
                             t->I, t->Lw, rows, beta, lin_beta, terms, x, h));
    CU_TRY(k3c_w4a16_grouped(STREAM(be), t->words[2], t->scales[2], NULL, NULL, E, t->Lw, t->I,
                             rows, beta, lin_beta, terms, h, y));
    return K3_OK;
}
k3_status k3_cuda_moe_combine(k3_backend *be, const float *y, const int32_t *pos, const float *w,
                              int64_t T, int K, int64_t width, float *out) {
    if (!be || !be->name || strcmp(be->name, "cuda") != 0)
        return K3_ERR(K3_ERR_ARG, "k3_cuda_moe_combine: backend %s is not cuda",
                      be && be->name ? be->name : "(none)");
    if (T < 0 || K < 1 || width < 0 || (T > 0 && (!y || !pos || !w || !out)))
        return K3_ERR(K3_ERR_ARG, "k3_cuda_moe_combine: %lld tokens of %d slots, width %lld",
                      (long long)T, K, (long long)width);
    CU_TRY(k3c_moe_combine(STREAM(be), y, pos, w, T, K, width, out));
    return K3_OK;
}

/* ---- the expert-parallel dispatch's device halves (k3_kernels.h moe_ep_*; moe_ep.cu) -------- */
static k3_status cu_moe_ep_pack(k3_backend *be, const k3_moe_ep *ep, const int32_t *ids, int64_t T,
                                const float *x, float *send, int32_t *pos) {
    if (T < 0 || !ep->dest || ep->L < 1 || ep->EL < 1 || ep->cap < 1 || ep->hdr * ep->Lw < ep->EL)
        return K3_ERR(K3_ERR_ARG, "moe_ep_pack: %lld tokens, %d lanes of %d experts, cap %lld",
                      (long long)T, ep->L, ep->EL, (long long)ep->cap);
    cu_ctx *c = CTX(be);
    const int64_t n = T * ep->K;
    unsigned long long *word;
    bool deferred;
    K3_TRY(err_word(be, &word, &deferred));
    CU_TRY(k3c_ep_pack(STREAM(be), ids, n, ep->K, x, ep->Lw, ep->dest, ep->E, ep->L, ep->EL,
                       ep->cap, ep->hdr, ep->blk_rows, send, pos, word));
    if (deferred) {
        err_defer(c, K3_OP_moe_experts, NULL, n);
        struct cu_deferred *d = &c->defer_what[c->defer_n - 1];
        d->E = ep->E, d->cap = ep->cap, d->per_tok = false;
        return K3_OK;
    }
    unsigned long long bad;
    K3_TRY(err_read(be, &bad));
    return route_error(bad, n, ep->E, ep->cap, false, c->layer, false);
}
static k3_status cu_moe_ep_experts(k3_backend *be, const k3_moe_ep *ep, const float *recv,
                                   const int32_t *glob, const k3_tensor *w1, const k3_tensor *w3,
                                   const k3_tensor *w2, size_t e_stride, float beta, float lin_beta,
                                   float *h, int32_t *iwork, float *ret) {
    moe_tab *t = NULL;
    K3_TRY(moe_masked_tab(be, w1, w3, w2, e_stride, ep->E, &t));
    const int64_t C = (int64_t)ep->L * ep->cap;
    if (t->Lw != ep->Lw || C > 65535 * 16)
        return K3_ERR(K3_ERR_ARG, "moe_ep_experts: rows of %lld (experts: %lld), capacity %lld",
                      (long long)ep->Lw, (long long)t->Lw, (long long)C);
    int32_t *cnt = iwork, *wslot = iwork + ep->EL, *srow = iwork + 2 * ep->EL;
    CU_TRY(k3c_ep_map(STREAM(be), recv, ep->L, ep->EL, ep->cap, ep->hdr, ep->blk_rows, ep->Lw, glob,
                      t->slot_dev, cnt, wslot, srow));
    int terms;
    K3_TRY(moe_terms(&terms));
    k3c_w4_rows rows = {NULL, cnt, C, C, wslot, srow, NULL};
    CU_TRY(k3c_w4a16_grouped(STREAM(be), t->words[0], t->scales[0], t->words[1], t->scales[1],
                             ep->EL, t->I, t->Lw, rows, beta, lin_beta, terms, recv, h));
    rows.src_row = NULL, rows.dst_row = srow;
    CU_TRY(k3c_w4a16_grouped(STREAM(be), t->words[2], t->scales[2], NULL, NULL, ep->EL, t->Lw, t->I,
                             rows, beta, lin_beta, terms, h, ret));
    return K3_OK;
}
static k3_status cu_moe_combine_iface(k3_backend *be, const float *y, const int32_t *pos,
                                      const float *w, int64_t T, int K, int64_t width, float *out) {
    return k3_cuda_moe_combine(be, y, pos, w, T, K, width, out);
}

/* The op table: each entry counts its call, then runs cu_<name>. */
#define CU_COUNTED(name, params, args)                                                             \
    static k3_status cuc_##name params {                                                           \
        count(&CTX(be)->stats.calls[K3_OP_##name], 1);                                             \
        return cu_##name args;                                                                     \
    }
K3_OP_LIST(CU_COUNTED)
#undef CU_COUNTED
#define CU_FIELD(name, params, args) .name = cuc_##name,
static const k3_ops k_cuda_ops = {K3_OP_LIST(CU_FIELD)};
#undef CU_FIELD

int k3_backend_cuda_devices(char *why, size_t n) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count < 1) {
        snprintf(why, n, "no CUDA device visible (%s)",
                 e != cudaSuccess ? cudaGetErrorString(e) : "count 0");
        return 0;
    }
    return count;
}

/* 0 until scripts/device-check.sh has passed on a device with these kernels: they were written
 * and checked on host math only (no GPU was lent to the session that wrote them). */
#define K3_CUDA_DEVICE_VERIFIED 0
bool k3_backend_cuda_verified(void) {
    return K3_CUDA_DEVICE_VERIFIED != 0;
}

int k3_backend_cuda_ops_done(void) {
    int n = 0;
    for (int op = 0; op < K3_OP_COUNT; op++) n += cu_supports(NULL, op, K3_DT_COUNT);
    return n;
}

static k3_status cu_ctx_init(cu_ctx *c, int n_devices) {
    c->device = k3_local_rank() % n_devices;
    c->layer = -1;
    const char *mma = getenv("K3_CUDA_MMA"), *kst = getenv("K3_CUDA_KDA_STATE");
    c->mma = mma && strcmp(mma, "1") == 0;
    /* the MLA: split operands (3 products) by default, bf16 with K3_CUDA_MMA=1, the fp32 kernel
       with K3_CUDA_MMA=0; K3_CUDA_MLA_TERMS=1|3|4 picks the products (measurements, §3b) */
    c->mla_terms = mma && strcmp(mma, "0") == 0 ? 0 : c->mma ? 1 : 3;
    const char *terms = getenv("K3_CUDA_MLA_TERMS");
    if (c->mla_terms && terms) {
        if (strcmp(terms, "1") && strcmp(terms, "3") && strcmp(terms, "4"))
            return K3_ERR(K3_ERR_ARG, "K3_CUDA_MLA_TERMS=%s: want 1, 3 or 4", terms);
        c->mla_terms = atoi(terms);
    }
    c->kda_bf16 = kst && strcmp(kst, "bf16") == 0;
    CU_TRY(cudaSetDevice(c->device));
    if (c->mla_terms) { /* the tensor-core MLA's split scratch (cu_attn_mla) */
        CU_TRY(cudaMalloc((void **)&c->mla_part, (size_t)MLA_PART_CAP * sizeof(float)));
        c->mla_part_cap = MLA_PART_CAP;
    }
    CU_TRY(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    CU_TRY(cudaMalloc((void **)&c->err_dev, sizeof *c->err_dev));
    CU_TRY(cudaMallocHost((void **)&c->err_host, sizeof *c->err_host));
    CU_TRY(cudaMalloc((void **)&c->defer_dev, CU_DEFER_MAX * sizeof *c->defer_dev));
    CU_TRY(cudaMallocHost((void **)&c->defer_host, CU_DEFER_MAX * sizeof *c->defer_host));
    CU_TRY(cudaEventCreateWithFlags(&c->stage_done, cudaEventDisableTiming));
    CU_TRY(cudaEventRecord(c->stage_done, c->stream));
    return K3_OK;
}

k3_status k3_backend_create_cuda(const k3_backend_params *p, k3_backend **out) {
    *out = NULL;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n < 1)
        return K3_ERR(K3_ERR_DEVICE, "cuda backend: no CUDA device (%s)",
                      e != cudaSuccess ? cudaGetErrorString(e) : "count 0");
    k3_backend *be;
    K3_TRY(k3_calloc((void **)&be, sizeof *be, "cuda backend"));
    be->name = "cuda";
    be->mem = K3_MEM_DEVICE;
    be->ops = &k_cuda_ops;
    be->mem_ = &k_cuda_iface;
    k3_status st = k3_calloc(&be->ctx, sizeof(cu_ctx), "cuda backend context");
    if (st == K3_OK) st = cu_ctx_init(CTX(be), n);
    if (st != K3_OK) {
        cu_destroy(be);
        return st;
    }
    *out = be;
    return K3_OK;
}
