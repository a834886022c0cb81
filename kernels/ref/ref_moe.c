/* ref_moe.c — the ref backend's moe_experts op (placeholder until implemented). */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

k3_status k3_ref_moe_experts(k3_backend *be, const float *src, int64_t row_div, const int32_t *ids,
                             const float *w, int64_t n, int E, const k3_tensor *w1,
                             const k3_tensor *w3, const k3_tensor *w2, size_t e_stride,
                             float beta, float lin_beta, float *out, float *work) {
    return K3_ERR(K3_ERR_INTERNAL, "moe_experts: not implemented yet");
}
