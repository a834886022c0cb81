/* k3_gpu_test.h — what the C tests of tests/gpu share: the skip without a device. */
#ifndef K3_GPU_TEST_H
#define K3_GPU_TEST_H

#include <stdio.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_kernels_internal.h" /* k3_backend_cuda_devices */

/* true (after printing "SKIP: no CUDA device visible: reason") when no device is visible: the
 * test then exits 77, which CTest reports as skipped. */
static inline bool k3_gpu_skip(void) {
    char why[256] = "";
    if (k3_backend_cuda_devices(why, sizeof why) >= 1) return false;
    /* why = "no CUDA device visible (reason)" */
    char *r = strchr(why, '(');
    size_t n = strlen(why);
    if (r && n && why[n - 1] == ')') why[n - 1] = '\0';
    printf("SKIP: no CUDA device visible: %s\n", r ? r + 1 : why);
    return true;
}

#endif /* K3_GPU_TEST_H */
