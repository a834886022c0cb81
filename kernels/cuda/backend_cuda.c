/* backend_cuda.c — the cuda backend object: device memory (alloc, free, upload, download,
 * synchronise, free/total memory through the CUDA runtime) and the op table. Built only with
 * K3_CUDA. So far one op runs on the device (fill, kernels/cuda/fill.cu); supports_op says which,
 * and k3_stage_create refuses a backend that lacks an op it needs, naming the op, so a run on
 * "cuda" fails up front instead of calling a missing kernel. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <cuda_runtime_api.h>
#include <stdio.h>

int k3_cuda_fill(float *y, int64_t n, float v); /* fill.cu */

static k3_status cu_err(cudaError_t e, const char *what) {
    return K3_ERR(K3_ERR_DEVICE, "cuda backend: %s: %s", what, cudaGetErrorString(e));
}

static k3_status cu_alloc(k3_backend *be, size_t n, void **out) {
    cudaError_t e = cudaMalloc(out, n ? n : 1);
    if (e != cudaSuccess) return cu_err(e, "cudaMalloc");
    e = cudaMemset(*out, 0, n ? n : 1);
    return e == cudaSuccess ? K3_OK : cu_err(e, "cudaMemset");
}
static void cu_free(k3_backend *be, void *p) {
    cudaFree(p);
}
static k3_status cu_upload(k3_backend *be, void *dst, const void *src, size_t n) {
    cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice);
    return e == cudaSuccess ? K3_OK : cu_err(e, "upload");
}
static k3_status cu_download(k3_backend *be, void *dst, const void *src, size_t n) {
    cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? K3_OK : cu_err(e, "download");
}
static k3_status cu_sync(k3_backend *be) {
    cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? K3_OK : cu_err(e, "synchronize");
}
static bool cu_supports(const k3_backend *be, int op, k3_dtype wt) {
    return op == K3_OP_fill;
}
static k3_status cu_memory(const k3_backend *be, size_t *fr, size_t *tot) {
    cudaError_t e = cudaMemGetInfo(fr, tot);
    return e == cudaSuccess ? K3_OK : cu_err(e, "cudaMemGetInfo");
}
static void cu_destroy(k3_backend *be) {
    k3_free(be);
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
};

static k3_status cu_fill(k3_backend *be, float *y, int64_t n, float v) {
    int e = k3_cuda_fill(y, n, v);
    return e == 0 ? K3_OK : cu_err((cudaError_t)e, "fill");
}
/* Every other op: not on the device yet (supports_op is false; the stage checks it first). */
#define CU_MISSING(name, params, args)                                                             \
    static k3_status cu_missing_##name params {                                                    \
        return K3_ERR(K3_ERR_DEVICE, "cuda backend: op %s is not implemented yet", #name);         \
    }
K3_OP_LIST(CU_MISSING)
#undef CU_MISSING
#define CU_FIELD(name, params, args) .name = cu_missing_##name,
static const k3_ops k_cuda_missing = {K3_OP_LIST(CU_FIELD)};
#undef CU_FIELD
static k3_ops k_cuda_ops;

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

int k3_backend_cuda_ops_done(void) {
    int n = 0;
    for (int op = 0; op < K3_OP_COUNT; op++) n += cu_supports(NULL, op, K3_DT_F32);
    return n;
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
    k_cuda_ops = k_cuda_missing;
    k_cuda_ops.fill = cu_fill;
    be->name = "cuda";
    be->mem = K3_MEM_DEVICE;
    be->ops = &k_cuda_ops;
    be->mem_ = &k_cuda_iface;
    *out = be;
    return K3_OK;
}
