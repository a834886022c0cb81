/* kernels.c — backend choice and the small tensor helpers shared by every backend.
 *
 * Owns: k3_ops_default / k3_ops_by_name, the row view of a weight, element decode (F32, BF16,
 * F16, MXFP4 through model/k3_mxfp4.h — the one definition of the format). No compute loops live
 * here: they are in ref/ and cpu/. */
#include "k3_kernels.h"
#include "k3_kernels_internal.h"

#include <math.h>

#include "k3_mxfp4.h"

const k3_ops *k3_ops_default(void) {
    return k3_ops_cpu();
}

const k3_ops *k3_ops_by_name(const char *name) {
    if (!name) return NULL;
    if (strcmp(name, "ref") == 0) return k3_ops_ref();
    if (strcmp(name, "cpu") == 0) return k3_ops_cpu();
    return NULL;
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

/* The weight checks every backend's matmul makes (one definition for all backends). */
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
