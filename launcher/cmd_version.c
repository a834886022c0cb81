/* cmd_version.c — `k3 version`: the build's version and the backends compiled in.
 *
 * The backends come from the build's K3_HAVE_* definitions (CMake options K3_CUDA, K3_NCCL), so
 * a user can tell which binary they are running before starting a job on a cluster.
 * No flags; never touches MPI or the model. */
#include "k3_launcher.h"

#include <stdio.h>

#define K3_VERSION "0.1.0"

static int run_version(const k3_args *a) {
    printf("k3 %s (backends: cpu%s%s)\n", K3_VERSION,
#ifdef K3_HAVE_CUDA
           ", cuda",
#else
           "",
#endif
#ifdef K3_HAVE_NCCL
           ", nccl"
#else
           ""
#endif
    );
    return 0;
}

const k3_command k3_cmd_version = {
    .name = "version",
    .positional = "",
    .summary = "print the version and compiled-in backends",
    .run = run_version,
};
