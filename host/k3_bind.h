/* host — this machine's cores as a rank sees them (libhwloc): each rank's share of its node's
 * cores, described (`k3 plan` shows it for this machine) or applied (k3_engine_open, unless
 * --bind none). Depends only on base/ and hwloc; owns nothing past a call (the topology is loaded
 * and destroyed inside each function). Callers must not assume a binding happened: `bound` and
 * `kept` say what was done.
 *
 * Local rank `local` of the `n_local` ranks on this node gets a contiguous share of the node's
 * cores (with gpu: of the cores near its GPU, device = local rank); k3_engine_open applies it
 * unless --bind none, and sizes the cpu thread pool by its cores. */
#ifndef K3_BIND_H
#define K3_BIND_H

#include "k3_base.h"

typedef struct k3_bind_info {
    int n_cores;    /* cores in the share (the cpu pool's threads) */
    int device;     /* the GPU found for this local rank, -1 none */
    int node_cores; /* cores this node lets the job use (more ranks than these: oversubscribed) */
    bool bound;     /* k3_bind_apply: the process is bound to `cores` */
    bool kept;      /* the launcher had already narrowed the process: its binding was kept */
    char cores[96]; /* OS indices of the PUs, hwloc list syntax ("0-3,8") */
    char numa[32];  /* NUMA nodes of those cores */
} k3_bind_info;
k3_status k3_bind_describe(int local, int n_local, bool gpu, k3_bind_info *out); /* no binding */
k3_status k3_bind_apply(int local, int n_local, bool gpu, k3_bind_info *out);    /* this process */

#endif /* K3_BIND_H */
