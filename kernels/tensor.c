/* tensor.c — dtype names and sizes, element counts (kernels/k3_tensor.h). */
#include "k3_tensor.h"

static const char *const dtype_names[K3_DT_COUNT] = {"F32", "BF16", "F16",  "U8",
                                                     "I32", "I64",  "MXFP4"};
static const size_t dtype_sizes[K3_DT_COUNT] = {4, 2, 2, 1, 4, 8, 0};

const char *k3_dtype_name(k3_dtype t) {
    return (unsigned)t < K3_DT_COUNT ? dtype_names[t] : "?";
}
size_t k3_dtype_size(k3_dtype t) {
    return (unsigned)t < K3_DT_COUNT ? dtype_sizes[t] : 0;
}

int64_t k3_tensor_n_elems(const k3_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}
