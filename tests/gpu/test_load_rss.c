/* test_load_rss.c — a device load holds the staging in host memory, not the weights (issue 30).
 * In the emulation build (K3_CUDA_EMULATE) device memory is host memory too, so the host's share
 * of the peak RSS is the peak RSS less the bytes allocated on the emulated device (its
 * cudaMemGetInfo: total - free). The `small` preset (~630 MB of weights) is loaded whole onto the
 * cuda backend with 8 readers; the host share must stay below the weights' size (the loader's
 * bound: 2 x 8 staging pieces of K3_LOAD_PIECE_BYTES = 64 MiB, plus the process itself). The old
 * loader staged every weight in host memory first (host share >= the weights), which fails this.
 * argv[1]: a scratch directory for the checkpoint. Label gpuemu. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "k3_kernels.h"
#include "k3_model.h"
#include "k3_test.h"
#include "k3_tiny.h"

/* VmHWM of this process, bytes (0 if unknown). */
static uint64_t peak_rss(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0) kb = strtoull(line + 6, NULL, 10);
    if (f) fclose(f);
    return kb * 1024;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_load_rss SCRATCH_DIR\n");
        return 2;
    }
    K3_CHECK_OK(k3_make_tiny(argv[1], K3_PRESET_SMALL, 1));
    k3_config cfg;
    k3_ckpt *ck = NULL;
    k3_backend *be = NULL;
    K3_CHECK_OK(k3_config_load(argv[1], &cfg));
    K3_CHECK_OK(k3_ckpt_open(argv[1], &ck));
    K3_CHECK_OK(k3_backend_create("cuda", &(k3_backend_params){0}, &be));
    if (!ck || !be) return k3_test_done("load_rss");
    size_t free0 = 0, total = 0, free1 = 0;
    K3_CHECK_OK(k3_backend_memory(be, &free0, &total));
    k3_load_sel sel = {.layer_begin = 0,
                       .layer_end = cfg.n_layers,
                       .embed = true,
                       .head = true,
                       .be = be,
                       .n_readers = 8};
    k3_weights *w = NULL;
    K3_CHECK_OK(k3_weights_load(ck, &cfg, &sel, &w));
    K3_CHECK_OK(k3_backend_memory(be, &free1, &total));
    const uint64_t hwm = peak_rss(), device = free0 - free1, weights = k3_weights_bytes(w);
    const uint64_t host = hwm > device ? hwm - device : 0;
    printf("weights %.1f MB on the device (%.1f MB allocated there); peak RSS %.1f MB, of which "
           "host %.1f MB (bound: the weights, %.1f MB; staging %.1f MB)\n",
           weights / 1e6, device / 1e6, hwm / 1e6, host / 1e6, weights / 1e6,
           2.0 * 8 * K3_LOAD_PIECE_BYTES / 1e6);
    K3_CHECK(weights > 400e6 && device >= weights, "the small preset on the device: %llu bytes",
             (unsigned long long)weights);
    K3_CHECK(hwm > 0 && host < weights, "host share of the peak RSS %.1f MB >= the weights %.1f MB",
             host / 1e6, weights / 1e6);
    k3_weights_destroy(w);
    k3_ckpt_destroy(ck);
    k3_backend_destroy(be);
    return k3_test_done("load_rss");
}
