/* kernels.c — the backend object: creation by name, the host memory functions of the ref and
 * cpu backends, the helpers every caller goes through (errors name the buffer), the process-wide
 * host backend; and the small tensor helpers shared by every backend: the row view of a weight,
 * element decode (F32, BF16, F16, MXFP4 through k3_mxfp4.h — the one definition of the format).
 * No compute loops live here: they are in ref/ and cpu/. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "k3_mxfp4.h"

static const char *const k_op_names[] = {
#define OP_NAME(name, params, args) #name,
    K3_OP_LIST(OP_NAME)
#undef OP_NAME
};
const char *k3_op_name(int op) {
    return op >= 0 && op < K3_OP_COUNT ? k_op_names[op] : "?";
}

/* ---- host memory (ref, cpu) ------------------------------------------------------------------ */
static k3_status host_alloc(k3_backend *be, size_t n, void **out) {
    return k3_calloc_large(out, n ? n : 1, be->name); /* weights: 2 MB pages (base.c) */
}
static void host_free(k3_backend *be, void *p) {
    k3_free(p);
}
static k3_status host_copy(k3_backend *be, void *dst, const void *src, size_t n) {
    if (n) memcpy(dst, src, n);
    return K3_OK;
}
static k3_status host_sync(k3_backend *be) {
    return K3_OK;
}
bool k3_op_takes(int op, k3_dtype wt) {
    if (op < 0 || op >= K3_OP_COUNT) return false;
    if (wt == K3_DT_COUNT) return true; /* the op at all */
    switch (op) {
    case K3_OP_matmul:
    case K3_OP_matmul_group:
    case K3_OP_matmul_tn:
        return wt == K3_DT_F32 || wt == K3_DT_BF16 || wt == K3_DT_MXFP4;
    case K3_OP_to_f32:
    case K3_OP_embed_rows:
        return wt == K3_DT_F32 || wt == K3_DT_BF16 || wt == K3_DT_F16;
    default:
        return false; /* the other ops take no weight tensor */
    }
}
static bool host_supports(const k3_backend *be, int op, k3_dtype wt) {
    (void)be;
    return k3_op_takes(op, wt);
}
k3_status k3_host_memory(size_t *free_bytes, size_t *total_bytes) {
    *free_bytes = *total_bytes = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return K3_ERR(K3_ERR_IO, "cannot read /proc/meminfo");
    char line[256];
    unsigned long long v;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %llu kB", &v) == 1) *total_bytes = (size_t)v * 1024;
        if (sscanf(line, "MemAvailable: %llu kB", &v) == 1) *free_bytes = (size_t)v * 1024;
    }
    fclose(f);
    if (!*total_bytes) return K3_ERR(K3_ERR_IO, "/proc/meminfo has no MemTotal");
    return K3_OK;
}
static uint64_t proc_kb(const char *path, const char *key) {
    FILE *f = fopen(path, "r");
    char line[256];
    unsigned long long v = 0;
    const size_t n = strlen(key);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, key, n) == 0 && sscanf(line + n, " %llu", &v) == 1) break;
    if (f) fclose(f);
    return (uint64_t)v * 1024;
}
void k3_proc_memory(uint64_t *rss, uint64_t *hwm, uint64_t *pss) {
    if (rss) *rss = proc_kb("/proc/self/status", "VmRSS:");
    if (hwm) *hwm = proc_kb("/proc/self/status", "VmHWM:");
    if (pss) *pss = proc_kb("/proc/self/smaps_rollup", "Pss:");
}
static k3_status host_memory(const k3_backend *be, size_t *fr, size_t *tot) {
    return k3_host_memory(fr, tot);
}
static void cpu_destroy(k3_backend *be) {
    if (be->ctx) {
        k3_pool_destroy(((k3_cpu_ctx *)be->ctx)->pool);
        k3_free(((k3_cpu_ctx *)be->ctx)->xpk);
    }
    k3_free(be->ctx);
    k3_free(be);
}
const k3_backend_iface k3_host_mem_iface = {
    .alloc = host_alloc,
    .free = host_free,
    .upload = host_copy,
    .download = host_copy,
    .synchronize = host_sync,
    .supports_op = host_supports,
    .memory = host_memory,
    .destroy = cpu_destroy,
};

k3_status k3_backend_create_cpu(const k3_backend_params *p, k3_backend **out) {
    *out = NULL;
    k3_backend *be;
    K3_TRY(k3_calloc((void **)&be, sizeof *be, "cpu backend"));
    k3_status st = k3_calloc(&be->ctx, sizeof(k3_cpu_ctx), "cpu backend context");
    if (st == K3_OK)
        st = k3_cpu_kern_select(&((k3_cpu_ctx *)be->ctx)->kern, &((k3_cpu_ctx *)be->ctx)->gemv_seq);
    if (st == K3_OK) st = k3_pool_create(p ? p->n_threads : 0, &((k3_cpu_ctx *)be->ctx)->pool);
    if (st != K3_OK) {
        k3_free(be->ctx);
        k3_free(be);
        return st;
    }
    be->name = "cpu";
    be->mem = K3_MEM_HOST;
    be->ops = &k3_cpu_ops;
    be->mem_ = &k3_host_mem_iface;
    *out = be;
    return K3_OK;
}

k3_status k3_backend_create_ref(k3_backend **out) {
    *out = NULL;
    k3_backend *be;
    K3_TRY(k3_calloc((void **)&be, sizeof *be, "ref backend"));
    be->name = "ref";
    be->mem = K3_MEM_HOST;
    be->ops = &k3_ref_ops;
    be->mem_ = &k3_host_mem_iface; /* ctx NULL: cpu_destroy frees just the object */
    *out = be;
    return K3_OK;
}

/* ---- creation and helpers -------------------------------------------------------------------- */
k3_status k3_backend_create(const char *name, const k3_backend_params *p, k3_backend **out) {
    *out = NULL;
    if (!name) name = "cpu";
    if (strcmp(name, "cpu") == 0) return k3_backend_create_cpu(p, out);
    if (strcmp(name, "ref") == 0) return k3_backend_create_ref(out);
    if (strcmp(name, "guard") == 0) return k3_backend_create_guard(p, out);
#ifdef K3_HAVE_CUDA
    if (strcmp(name, "cuda") == 0) return k3_backend_create_cuda(p, out);
#endif
    return K3_ERR(K3_ERR_ARG, "unknown backend '%s' (this build has: ref, cpu, guard%s)", name,
#ifdef K3_HAVE_CUDA
                  ", cuda"
#else
                  ""
#endif
    );
}

/* Why cuda cannot run a whole forward here ("" when it can: compiled in, a device, every op). */
static void cuda_unusable(char *why, size_t n) {
#ifdef K3_HAVE_CUDA
    why[0] = 0;
    if (k3_backend_cuda_devices(why, n) < 1) return;
    int done = k3_backend_cuda_ops_done();
    if (done < K3_OP_COUNT)
        snprintf(why, n, "the cuda backend implements %d of the %d ops so far", done, K3_OP_COUNT);

#else
    snprintf(why, n, "not compiled in (build with -DK3_CUDA=ON)");
#endif
}

const char *k3_backend_resolve(const char *name, char *why, size_t n) {
    if (n) why[0] = 0;
    if (!name || strcmp(name, "auto") != 0) return name;
    char w[160];
    cuda_unusable(w, sizeof w);
#ifdef K3_HAVE_CUDA
    if (!w[0] && !k3_backend_cuda_verified()) /* usable (--backend cuda), not yet trusted */
        snprintf(w, sizeof w,
                 "its kernels have not yet passed scripts/device-check.sh on a device "
                 "(--backend cuda runs them anyway)");
#endif
    if (!w[0]) return "cuda";
    snprintf(why, n, "cpu, since cuda: %s", w);
    return "cpu";
}

void k3_backend_inventory(char *compiled, size_t nc, char *usable, size_t nu) {
    char w[160];
    cuda_unusable(w, sizeof w);
#ifdef K3_HAVE_CUDA
    snprintf(compiled, nc, "ref cpu guard cuda");
    if (w[0])
        snprintf(usable, nu, "ref cpu guard; cuda: %s", w);
    else
        snprintf(usable, nu, "ref cpu guard cuda");
#else
    snprintf(compiled, nc, "ref cpu guard");
    snprintf(usable, nu, "ref cpu guard; cuda: %s", w);
#endif
}

void k3_backend_destroy(k3_backend *be) {
    if (be) be->mem_->destroy(be);
}

static pthread_once_t g_host_once = PTHREAD_ONCE_INIT;
static k3_backend *g_host;
static void host_init(void) {
    k3_backend_params p = {.n_threads = 1};
    if (k3_backend_create_cpu(&p, &g_host) != K3_OK) g_host = NULL;
}
k3_backend *k3_backend_host(void) {
    pthread_once(&g_host_once, host_init);
    K3_ASSERT(g_host != NULL);
    return g_host;
}

k3_status k3_backend_alloc(k3_backend *be, size_t n_bytes, const char *what, void **out) {
    *out = NULL;
    k3_status st = be->mem_->alloc(be, n_bytes, out);
    if (st != K3_OK)
        return K3_ERR(st, "%s backend: cannot allocate %zu bytes for %s: %s", be->name, n_bytes,
                      what, k3_last_error());
    return K3_OK;
}
void k3_backend_free(k3_backend *be, void *p) {
    if (p) be->mem_->free(be, p);
}
k3_status k3_backend_upload(k3_backend *be, void *dst, const void *src_host, size_t n_bytes) {
    return be->mem_->upload(be, dst, src_host, n_bytes);
}
k3_status k3_backend_download(k3_backend *be, void *dst_host, const void *src, size_t n_bytes) {
    return be->mem_->download(be, dst_host, src, n_bytes);
}
k3_status k3_backend_sync(k3_backend *be) {
    return be->mem_->synchronize(be);
}
k3_status k3_backend_upload_async(k3_backend *be, void *dst, const void *src_host, size_t n_bytes) {
    if (be->mem_->upload_async) return be->mem_->upload_async(be, dst, src_host, n_bytes);
    return be->mem_->upload(be, dst, src_host, n_bytes);
}
k3_status k3_backend_download_async(k3_backend *be, void *dst_host, const void *src,
                                    size_t n_bytes) {
    if (be->mem_->download_async) return be->mem_->download_async(be, dst_host, src, n_bytes);
    return be->mem_->download(be, dst_host, src, n_bytes);
}
k3_status k3_backend_event_create(k3_backend *be, k3_backend_event **out) {
    *out = NULL;
    return be->mem_->event_create ? be->mem_->event_create(be, out) : K3_OK;
}
k3_status k3_backend_event_record(k3_backend *be, k3_backend_event *ev) {
    return ev && be->mem_->event_record ? be->mem_->event_record(be, ev) : K3_OK;
}
k3_status k3_backend_event_sync(k3_backend *be, k3_backend_event *ev) {
    return ev && be->mem_->event_sync ? be->mem_->event_sync(be, ev) : K3_OK;
}
void k3_backend_event_destroy(k3_backend *be, k3_backend_event *ev) {
    if (ev && be->mem_->event_destroy) be->mem_->event_destroy(be, ev);
}
void *k3_backend_native_stream(k3_backend *be) {
    return be && be->mem_->native_stream ? be->mem_->native_stream(be) : NULL;
}
bool k3_backend_has_graphs(const k3_backend *be) {
    return be && be->mem_->capture_begin && be->mem_->capture_end && be->mem_->graph_launch &&
           be->mem_->graph_destroy;
}
k3_status k3_backend_capture_begin(k3_backend *be) {
    if (!k3_backend_has_graphs(be))
        return K3_ERR(K3_ERR_STATE, "backend %s captures no graphs", be ? be->name : "(none)");
    return be->mem_->capture_begin(be);
}
k3_status k3_backend_capture_end(k3_backend *be, k3_backend_graph **out) {
    *out = NULL;
    if (!k3_backend_has_graphs(be))
        return K3_ERR(K3_ERR_STATE, "backend %s captures no graphs", be ? be->name : "(none)");
    return be->mem_->capture_end(be, out);
}
k3_status k3_backend_graph_launch(k3_backend *be, k3_backend_graph *g) {
    if (!k3_backend_has_graphs(be) || !g)
        return K3_ERR(K3_ERR_STATE, "backend %s: no graph to launch", be ? be->name : "(none)");
    return be->mem_->graph_launch(be, g);
}
void k3_backend_graph_destroy(k3_backend *be, k3_backend_graph *g) {
    if (g && k3_backend_has_graphs(be)) be->mem_->graph_destroy(be, g);
}
k3_status k3_backend_errors_defer(k3_backend *be, bool on) {
    return be->mem_->errors_defer ? be->mem_->errors_defer(be, on) : K3_OK;
}
k3_status k3_backend_errors_fetch(k3_backend *be) {
    return be->mem_->errors_fetch ? be->mem_->errors_fetch(be) : K3_OK;
}
k3_status k3_backend_errors_verdict(k3_backend *be) {
    return be->mem_->errors_verdict ? be->mem_->errors_verdict(be) : K3_OK;
}
bool k3_backend_has_moe_ep(const k3_backend *be) {
    return be->mem_->moe_ep_pack && be->mem_->moe_ep_experts && be->mem_->moe_combine;
}
void k3_moe_ep_layout(k3_moe_ep *ep, int E, int K, int L, int EL, int64_t Lw, int64_t T_max,
                      double factor, int64_t decode_rows) {
    int64_t cap = (int64_t)ceil((double)T_max * (double)K * factor / (double)(E > 0 ? E : 1));
    cap = K3_MIN(K3_MAX(K3_MAX(cap, (int64_t)1), decode_rows), K3_MAX(T_max, (int64_t)1));
    *ep = (k3_moe_ep){.E = E, .K = K, .L = L, .EL = EL, .cap = cap, .Lw = Lw};
    ep->hdr = (EL + Lw - 1) / (Lw > 0 ? Lw : 1);
    ep->blk_rows = ep->hdr + (int64_t)EL * cap;
}
void k3_backend_errors_layer(k3_backend *be, int layer) {
    if (be->mem_->errors_layer) be->mem_->errors_layer(be, layer);
}
k3_status k3_backend_device_info(k3_backend *be, k3_device_info *out) {
    memset(out, 0, sizeof *out);
    if (!be->mem_->device_info) return K3_ERR(K3_ERR_ARG, "the %s backend has no device", be->name);
    return be->mem_->device_info(be, out);
}
k3_status k3_backend_op_stats(const k3_backend *be, k3_op_stats *out) {
    memset(out, 0, sizeof *out);
    if (!be->mem_->op_stats)
        return K3_ERR(K3_ERR_ARG, "the %s backend keeps no op counters (guard and cuda do)",
                      be->name);
    return be->mem_->op_stats(be, out);
}

/* ---- the batch descriptor ---------------------------------------------------------------- */
size_t k3_seqs_floats(int n_seqs, int max_blocks) {
    /* tok0 [n+1] | pos [n] | slot [n] | blocks [n, mb], int32 each (a float's size) */
    return (size_t)(n_seqs + 1) + 2 * (size_t)n_seqs + (size_t)n_seqs * (size_t)max_blocks;
}
k3_status k3_seqs_build(int n_seqs, const int32_t *n_tokens, const int32_t *pos,
                        const int32_t *slot, const int32_t *blocks_h, int max_blocks, void *h,
                        void *dev, k3_seqs *out) {
    memset(out, 0, sizeof *out);
    if (n_seqs < 0 || max_blocks < 0)
        return K3_ERR(K3_ERR_ARG, "batch descriptor: %d sequences, %d blocks", n_seqs, max_blocks);
    int32_t *ht = h, *hp = ht + n_seqs + 1, *hs = hp + n_seqs, *hb = hs + n_seqs;
    int32_t *dt = dev, *dp = dt + n_seqs + 1, *ds = dp + n_seqs, *db = ds + n_seqs;
    int64_t T = 0;
    ht[0] = 0;
    for (int i = 0; i < n_seqs; i++) {
        if (n_tokens[i] < 1 || pos[i] < 0)
            return K3_ERR(K3_ERR_ARG, "batch descriptor: sequence %d has %d tokens at position %d",
                          i, n_tokens[i], pos[i]);
        T += n_tokens[i];
        if (T > INT32_MAX) return K3_ERR(K3_ERR_ARG, "batch descriptor: over 2^31 tokens");
        ht[i + 1] = (int32_t)T;
        hp[i] = pos[i];
        hs[i] = slot[i];
        out->max_ctx = K3_MAX(out->max_ctx, (int64_t)pos[i] + n_tokens[i]);
        out->max_new = K3_MAX(out->max_new, (int64_t)n_tokens[i]);
    }
    if (blocks_h && max_blocks > 0)
        memcpy(hb, blocks_h, (size_t)n_seqs * (size_t)max_blocks * sizeof(int32_t));
    out->n_seqs = n_seqs;
    out->T = T;
    out->max_blocks = max_blocks;
    out->tok0 = dt;
    out->pos = dp;
    out->slot = ds;
    out->blocks = blocks_h && max_blocks > 0 ? db : NULL;
    return K3_OK;
}

bool k3_backend_supports_op(const k3_backend *be, int op, k3_dtype wt) {
    return be->mem_->supports_op(be, op, wt);
}
k3_status k3_backend_memory(const k3_backend *be, size_t *free_bytes, size_t *total_bytes) {
    return be->mem_->memory(be, free_bytes, total_bytes);
}
int k3_backend_threads(const k3_backend *be) {
    return k3_pool_threads(k3_cpu_pool((k3_backend *)be));
}

k3_status k3_tensor_rows(const k3_tensor *W, int64_t r0, int64_t n, k3_tensor *out) {
    if (W->ndim != 2) return K3_ERR(K3_ERR_SHAPE, "row view of a %d-D tensor", W->ndim);
    if (r0 < 0 || n < 0 || r0 + n > W->shape[0])
        return K3_ERR(K3_ERR_SHAPE, "row view [%lld, %lld) outside [0, %lld)", (long long)r0,
                      (long long)(r0 + n), (long long)W->shape[0]);
    *out = *W;
    out->shape[0] = n;
    int64_t in = W->shape[1];
    switch (W->dtype) {
    case K3_DT_F32:
        out->data = (float *)W->data + r0 * in;
        break;
    case K3_DT_BF16:
    case K3_DT_F16:
        out->data = (uint16_t *)W->data + r0 * in;
        break;
    case K3_DT_MXFP4:
        out->data = (uint8_t *)W->data + r0 * (in / 2);
        out->scale = W->scale + r0 * (in / 32);
        break;
    default:
        return K3_ERR(K3_ERR_SHAPE, "row view of dtype %s", k3_dtype_name(W->dtype));
    }
    return K3_OK;
}

float k3_tensor_get(const k3_tensor *W, int64_t o, int64_t i) {
    int64_t in = W->ndim >= 2 ? W->shape[W->ndim - 1] : 0;
    int64_t idx = W->ndim >= 2 ? o * in + i : i;
    switch (W->dtype) {
    case K3_DT_F32:
        return ((const float *)W->data)[idx];
    case K3_DT_BF16:
        return k3_bf16_to_f32(((const uint16_t *)W->data)[idx]);
    case K3_DT_F16:
        return k3_f16_to_f32(((const uint16_t *)W->data)[idx]);
    case K3_DT_MXFP4: {
        return k3_mxfp4_get((const uint8_t *)W->data + o * (in / 2), W->scale + o * (in / 32), i);
    }
    default:
        return NAN;
    }
}

k3_status k3_tensor_to_f32(const k3_tensor *t, float *dst, int64_t n_elems) {
    if (k3_tensor_n_elems(t) != n_elems)
        return K3_ERR(K3_ERR_SHAPE, "tensor has %lld elements, expected %lld",
                      (long long)k3_tensor_n_elems(t), (long long)n_elems);
    switch (t->dtype) {
    case K3_DT_F32:
        memcpy(dst, t->data, (size_t)n_elems * sizeof(float));
        break;
    case K3_DT_BF16:
        for (int64_t i = 0; i < n_elems; i++)
            dst[i] = k3_bf16_to_f32(((const uint16_t *)t->data)[i]);
        break;
    case K3_DT_F16:
        for (int64_t i = 0; i < n_elems; i++)
            dst[i] = k3_f16_to_f32(((const uint16_t *)t->data)[i]);
        break;
    default:
        return K3_ERR(K3_ERR_SHAPE, "cannot decode dtype %s to f32", k3_dtype_name(t->dtype));
    }
    return K3_OK;
}

size_t k3_kda_chunk_work_floats(int C, int dk, int dv) {
    /* doubles: Γ, exp Γ, exp(Γ_last − Γ), W [C, dk]; U/V', O [C, dv]; A/T̃, Aqk [C, C] */
    return 2 * ((size_t)C * (size_t)(4 * dk + 2 * dv) + 2 * (size_t)C * (size_t)C);
}

size_t k3_attn_latent_causal_work_floats(int64_t n_ctx, int H) {
    return (size_t)(n_ctx > 0 ? n_ctx : 0) * (size_t)(H > 0 ? H : 0);
}

size_t k3_moe_experts_work_floats(int64_t Lw, int64_t I, int64_t n, int E) {
    const size_t tile = K3_MOE_EXPERTS_TILE, nn = (size_t)(n > 0 ? n : 0);
    /* xin [tile, Lw] | g, u [tile, I] | o [tile, Lw] | items [min(n, ITEMS), Lw] (the weighted
       form's token tile) | host int64: order [n], start [E + 1], idx [tile] (two floats each),
       every part 16-float aligned */
    size_t f = 0;
    f += (tile * (size_t)Lw + 15) / 16 * 16 * 2;
    f += (K3_MIN(nn, (size_t)K3_MOE_EXPERTS_ITEMS) * (size_t)Lw + 15) / 16 * 16;
    f += (tile * (size_t)I + 15) / 16 * 16 * 2;
    f += (2 * (nn + (size_t)(E > 0 ? E : 0) + 1 + tile) + 15) / 16 * 16;
    return f;
}

/* The weight checks every backend's matmul makes (one definition for all backends). */
k3_status k3_kernels_check_group(const k3_mm *mm, int n) {
    for (int i = 0; i < n; i++) {
        char what[48];
        snprintf(what, sizeof what, "matmul_group item %d", i);
        K3_TRY(k3_kernels_check_weight(mm[i].W, what));
    }
    return K3_OK;
}

k3_status k3_kernels_check_weight(const k3_tensor *W, const char *op) {
    if (W->ndim != 2)
        return K3_ERR(K3_ERR_SHAPE, "%s: weight is %d-D, want 2-D [out, in]", op, W->ndim);
    if (W->dtype != K3_DT_F32 && W->dtype != K3_DT_BF16 && W->dtype != K3_DT_MXFP4)
        return K3_ERR(K3_ERR_SHAPE, "%s: weight dtype %s unsupported (F32, BF16, MXFP4)", op,
                      k3_dtype_name(W->dtype));
    if (W->dtype == K3_DT_MXFP4 && (W->shape[1] % 32 != 0 || !W->scale))
        return K3_ERR(K3_ERR_SHAPE,
                      "%s: MXFP4 weight with in=%lld not a multiple of 32 or no scale", op,
                      (long long)W->shape[1]);
    return K3_OK;
}
