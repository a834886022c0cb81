/* bind.c — each rank's share of its node's cores (libhwloc), computed and applied at engine open
 * and described by `k3 plan` for this machine.
 *
 * The share: the ranks of a node split its cores in contiguous blocks by local rank (rank order
 * within the node). With a GPU per rank (device = local rank) the cores near the GPU come first:
 * the ranks whose GPUs hang off the same NUMA node (hwloc's non-I/O ancestor of the GPU's PCI
 * device) split that node's cores. More ranks than cores: every rank gets all of them (the pool),
 * one thread each, and the kernel's scheduler places them: pinning each rank to one core (as k3
 * did before) left a rank queued behind whatever else ran on its core while another core idled,
 * so 4 ranks on 2 cores beside 2 busy loops ran a batch 75 s instead of 8 s (issue 46). The
 * binding covers the whole process (threads made later inherit
 * it), and the cpu backend's pool takes as many threads as the binding has cores, so several
 * ranks on a node do not oversubscribe it.
 * A launcher that already narrowed the process keeps control where its binding does not contain
 * the share (taskset, mpirun --cpu-list: that binding is reported and sizes the pool); a binding
 * that contains it (mpirun's core or socket binding) is narrowed to the share.
 * Owns nothing past a call: the topology is loaded and destroyed inside each function. */
#include "k3_bind.h"

#include <hwloc.h>
#include <stdio.h>

/* NVIDIA display/3D controllers in PCI order (CUDA_DEVICE_ORDER=PCI_BUS_ID numbering). */
static hwloc_obj_t gpu_obj(hwloc_topology_t t, int device) {
    int i = 0;
    for (hwloc_obj_t o = hwloc_get_next_pcidev(t, NULL); o; o = hwloc_get_next_pcidev(t, o)) {
        unsigned cls = o->attr->pcidev.class_id;
        if (o->attr->pcidev.vendor_id == 0x10de && (cls == 0x0300 || cls == 0x0302) &&
            i++ == device)
            return o;
    }
    return NULL;
}

/* The cpuset of the CPU-side ancestor of local rank i's GPU; NULL without one. */
static hwloc_const_cpuset_t gpu_cpuset(hwloc_topology_t t, int device) {
    hwloc_obj_t g = device >= 0 ? gpu_obj(t, device) : NULL;
    hwloc_obj_t a = g ? hwloc_get_non_io_ancestor_obj(t, g) : NULL;
    return a ? a->cpuset : NULL;
}

/* Fill `set` with the share of local rank `local` of `n_local`; returns the core count. */
static int share(hwloc_topology_t t, int local, int n_local, bool gpu, hwloc_bitmap_t set) {
    hwloc_const_cpuset_t allowed = hwloc_topology_get_allowed_cpuset(t);
    hwloc_bitmap_t pool = hwloc_bitmap_dup(allowed);
    int idx = local, n_peers = n_local;
    hwloc_const_cpuset_t near = gpu ? gpu_cpuset(t, local) : NULL;
    if (near && hwloc_bitmap_intersects(near, allowed)) {
        hwloc_bitmap_and(pool, pool, near);
        idx = n_peers = 0; /* the local ranks whose GPUs share this NUMA locality */
        for (int j = 0; j < n_local; j++) {
            hwloc_const_cpuset_t nj = gpu_cpuset(t, j);
            if (nj && hwloc_bitmap_isequal(nj, near)) {
                if (j < local) idx++;
                n_peers++;
            }
        }
    }
    int n = hwloc_get_nbobjs_inside_cpuset_by_type(t, pool, HWLOC_OBJ_CORE);
    hwloc_bitmap_zero(set);
    int got = 0;
    if (n <= 0) { /* no core objects (odd topologies): the whole pool */
        hwloc_bitmap_copy(set, pool);
        got = 1;
    } else if (n >= n_peers) {
        int a = (int)((int64_t)idx * n / n_peers), b = (int)((int64_t)(idx + 1) * n / n_peers);
        for (int k = a; k < b; k++) {
            hwloc_obj_t c = hwloc_get_obj_inside_cpuset_by_type(t, pool, HWLOC_OBJ_CORE, k);
            hwloc_bitmap_or(set, set, c->cpuset);
            got++;
        }
    } else { /* oversubscribed: every rank may run on any core of the pool, one thread each */
        hwloc_bitmap_copy(set, pool);
        got = 1;
    }
    hwloc_bitmap_and(set, set, allowed);
    hwloc_bitmap_free(pool);
    return got;
}

static void describe(hwloc_topology_t t, hwloc_const_cpuset_t set, int n_cores, k3_bind_info *o) {
    o->n_cores = n_cores;
    hwloc_bitmap_list_snprintf(o->cores, sizeof o->cores, set);
    hwloc_nodeset_t ns = hwloc_bitmap_alloc();
    hwloc_cpuset_to_nodeset(t, set, ns);
    hwloc_bitmap_list_snprintf(o->numa, sizeof o->numa, ns);
    hwloc_bitmap_free(ns);
}

static k3_status load(hwloc_topology_t *t) {
    if (hwloc_topology_init(t) != 0) return K3_ERR(K3_ERR_IO, "hwloc: topology init failed");
    /* PCI devices are needed to find a GPU's NUMA node; nothing else of the I/O tree */
    hwloc_topology_set_type_filter(*t, HWLOC_OBJ_PCI_DEVICE, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(*t) != 0) {
        hwloc_topology_destroy(*t);
        return K3_ERR(K3_ERR_IO, "hwloc: cannot load this machine's topology");
    }
    return K3_OK;
}

static k3_status run(int local, int n_local, bool gpu, bool apply, k3_bind_info *o) {
    memset(o, 0, sizeof *o);
    if (local < 0 || n_local < 1 || local >= n_local)
        return K3_ERR(K3_ERR_ARG, "bind: local rank %d of %d", local, n_local);
    hwloc_topology_t t;
    K3_TRY(load(&t));
    hwloc_bitmap_t set = hwloc_bitmap_alloc(), cur = hwloc_bitmap_alloc();
    k3_status st = K3_OK;
    int n = share(t, local, n_local, gpu, set);
    o->device = gpu && gpu_obj(t, local) ? local : -1;
    if (apply) {
        /* A launcher's narrower binding: our share inside it is applied (mpirun --bind-to
           socket with several ranks a socket: each still gets its own cores); a binding that
           does not contain our share (taskset, mpirun --cpu-list) is the user's choice: kept. */
        bool narrowed = hwloc_get_cpubind(t, cur, HWLOC_CPUBIND_PROCESS) == 0 &&
                        !hwloc_bitmap_isincluded(hwloc_topology_get_allowed_cpuset(t), cur) &&
                        !hwloc_bitmap_isincluded(set, cur);
        if (narrowed) {
            int nc = hwloc_get_nbobjs_inside_cpuset_by_type(t, cur, HWLOC_OBJ_CORE);
            hwloc_bitmap_copy(set, cur);
            n = nc > 0 ? nc : 1;
            o->kept = true;
        } else if (hwloc_set_cpubind(t, set, HWLOC_CPUBIND_PROCESS) != 0) {
            char buf[128];
            hwloc_bitmap_list_snprintf(buf, sizeof buf, set);
            st = K3_ERR(K3_ERR_IO, "bind: hwloc_set_cpubind to cores %s failed", buf);
        } else if (hwloc_get_cpubind(t, cur, HWLOC_CPUBIND_PROCESS) == 0) {
            hwloc_bitmap_copy(set, cur); /* report what the OS now holds, not what was asked */
        }
        o->bound = st == K3_OK;
    }
    describe(t, set, n, o);
    o->node_cores = hwloc_get_nbobjs_inside_cpuset_by_type(t, hwloc_topology_get_allowed_cpuset(t),
                                                           HWLOC_OBJ_CORE);
    hwloc_bitmap_free(set);
    hwloc_bitmap_free(cur);
    hwloc_topology_destroy(t);
    return st;
}

k3_status k3_bind_describe(int local, int n_local, bool gpu, k3_bind_info *out) {
    return run(local, n_local, gpu, false, out);
}

k3_status k3_bind_apply(int local, int n_local, bool gpu, k3_bind_info *out) {
    return run(local, n_local, gpu, true, out);
}
