/* k3_tensor.h — the tensor type of k3: dtypes, the weight/activation descriptor and the memory
 * space a tensor's bytes live in. kernels/ owns it because every layer above (model/ reads
 * checkpoints into it, layers/ and experts/ pass it to ops) depends on it, and kernels/ depends
 * on nothing but base/ (DESIGN.md §1).
 *
 * A k3_tensor never owns memory: data/scale point into a buffer that a k3_backend allocated
 * (or, for tests and host-side staging, into plain host memory, mem = K3_MEM_HOST). */
#ifndef K3_TENSOR_H
#define K3_TENSOR_H

#include "k3_base.h"

#define K3_MAX_DIMS 4

typedef enum {
    K3_DT_F32 = 0,
    K3_DT_BF16,
    K3_DT_F16,
    K3_DT_U8,
    K3_DT_I32,
    K3_DT_I64,
    K3_DT_MXFP4, /* in-memory only: data = weight_packed U8 [out, in/2], scale = E8M0 [out, in/32]
                  */
    K3_DT_COUNT
} k3_dtype;
const char *k3_dtype_name(k3_dtype t); /* safetensors spelling: "F32", "BF16", ... */
size_t k3_dtype_size(k3_dtype t);      /* bytes per element (0 for MXFP4) */

/* Where a buffer lives. Host code may read or write only K3_MEM_HOST bytes; anything else is
 * reached through its backend's ops and upload/download (kernels/k3_kernels.h). */
typedef enum {
    K3_MEM_HOST = 0, /* plain process memory (ref and cpu backends, host staging) */
    K3_MEM_GUARD,    /* the guard test backend: PROT_NONE outside its own ops */
    K3_MEM_DEVICE,   /* accelerator memory (cuda) */
} k3_mem_space;

/* A tensor in memory. shape is logical, PyTorch order ([out, in] for a weight). For MXFP4 the
 * logical shape is the dequantised one ([out, in]). */
typedef struct k3_tensor {
    k3_dtype dtype;
    int ndim;
    int64_t shape[K3_MAX_DIMS];
    void *data;
    uint8_t *scale;   /* MXFP4 only: E8M0 [shape[0], shape[1]/32] */
    k3_mem_space mem; /* where data/scale live */
} k3_tensor;
int64_t k3_tensor_n_elems(const k3_tensor *t);

/* Tokens per block of a paged cache (k3_kernels.h k3_seqs): a multiple of the cpu attention's key
 * block (64), so a key block is contiguous; the granule of the prefix cache. Here, beside the
 * tensor type, because the plan (partition/) sizes the cache with it too. */
#define K3_KV_BLOCK 64

#endif /* K3_TENSOR_H */
