/* cmd_version.c — `k3 version`: the build's version and the backends compiled in.
 *
 * The backends compiled in (the build's K3_HAVE_* definitions: CMake options K3_CUDA, K3_NCCL)
 * and those usable on this machine (a visible device, ops ported), and what --backend auto picks,
 * so a user can tell what a job will run on before starting it. No flags; no MPI, no model. */
#include "k3_launcher.h"

#include <stdio.h>

#include "k3_kernels.h"

#define K3_VERSION "0.1.0"

static int run_version(const k3_args *a) {
    (void)a;
    char compiled[160], usable[320];
    k3_backend_inventory(compiled, sizeof compiled, usable, sizeof usable);
    printf("k3 %s\nbackends compiled: %s%s\nbackends usable here: %s\n", K3_VERSION, compiled,
#ifdef K3_HAVE_NCCL
           " (NCCL linked; the nccl comm transport is not written yet)",
#else
           "",
#endif
           usable);
    char why[200];
    const char *pick = k3_backend_resolve("auto", why, sizeof why);
    printf("--backend auto picks: %s\n", why[0] ? why : pick);
    return 0;
}

const k3_command k3_cmd_version = {
    .name = "version",
    .positional = "",
    .summary = "print the version and compiled-in backends",
    .run = run_version,
};
