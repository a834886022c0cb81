/* setup.c — what a rank does before the first step: config, capacity, the plan and the agreement
 * on it, the memory check, and partial loading with an aggregate progress bar. */
#include "rank_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* ---- set-up ------------------------------------------------------------------------------- */
/* The memory rule (issue 11 item 5): the plan's need of every rank (weights + caches + buffers),
 * summed over the ranks that share a node (an MPI shared-memory split), must fit in that node's
 * MemAvailable (read by the node's lowest rank at open) less a margin of 10%, at least 256 MiB,
 * left for MPI's buffers, the tokenizer, the allocator's slack and the OS. */
#define MEM_MARGIN_FRAC  0.10
#define MEM_MARGIN_FLOOR (256ull << 20)

static uint64_t rank_need(const rank_ctx *r, int i) {
    return k3_rank_mem_total(&r->plan.mem[i]); /* what `k3 plan` prints */
}

/* ---- node sharing: who shares ------------------------------------------------------------- */
/* A backend whose weights are plain process memory (node sharing maps them in node memory). */
static bool host_weights(const rank_ctx *r) {
    const char *be = r->o->backend ? r->o->backend : "cpu";
    return strcmp(be, "cpu") == 0 || strcmp(be, "ref") == 0;
}

/* The ranks of rank's stage on rank's node (ascending): *reader the lowest, *size how many,
 * members (may be NULL) the first cap of them. */
static void dense_group(const rank_ctx *r, int rank, int *reader, int *size, int *members,
                        int cap) {
    int stage = -1;
    *reader = -1, *size = 0;
    if (!k3_plan_coords(&r->plan, rank, &stage, NULL)) return;
    for (int i = 0; i < r->world; i++) {
        int s = -1;
        if (r->where[i].node != r->where[rank].node || !k3_plan_coords(&r->plan, i, &s, NULL) ||
            s != stage)
            continue;
        if (*reader < 0) *reader = i;
        if (members && *size < cap) members[*size] = i;
        (*size)++;
    }
}

/* Stage s's dense region (k3_weights_dense_bytes) and the checkpoint bytes in it. */
static k3_status stage_dense(const rank_ctx *r, int s, uint64_t *region, uint64_t *stored) {
    k3_load_sel sel = {.layer_begin = r->plan.stage_begin[s],
                       .layer_end = r->plan.stage_begin[s + 1],
                       .embed = s == 0,
                       .head = s == r->plan.n_stages - 1};
    return k3_weights_dense_bytes(&r->cfg, &sel, region, stored);
}

/* Refuse a plan a node cannot hold before allocating anything: a huge --n or prompt sizes every
 * sequence's caches for its whole context up front, and an OOM kill names nobody. With node
 * sharing (rank_share_dense) the host ranks of one stage on one node hold its dense weights once:
 * the node's need drops by what k3_plan_node_shared counts (the rule `k3 plan` prints). Every rank
 * decides the same for every node (same plan, same gathered readings), so the error is identical
 * on every rank. */
static k3_status check_memory(const rank_ctx *r, const k3_plan_req *req) {
    int *on = NULL; /* the ranks of one node */
    K3_TRY(k3_alloc((void **)&on, (size_t)r->world * sizeof *on, "node ranks"));
    const bool share = host_weights(r) && !r->o->load_private;
    for (int n = 0; n < r->world; n++) {
        if (r->where[n].node != n) continue; /* n is not the lowest rank of a node */
        uint64_t avail = r->where[n].v, need = 0;
        if (avail == 0) continue; /* unknown: nothing to compare against */
        uint64_t margin = K3_MAX((uint64_t)(avail * MEM_MARGIN_FRAC), MEM_MARGIN_FLOOR);
        uint64_t usable = avail > margin ? avail - margin : 0;
        int n_ranks = 0;
        for (int i = 0; i < r->world; i++)
            if (r->where[i].node == n) need += rank_need(r, i), on[n_ranks++] = i;
        const uint64_t once = share ? k3_plan_node_shared(&r->plan, on, n_ranks) : 0;
        need -= K3_MIN(once, need);
        if (need <= usable) continue;
        char list[2048];
        size_t at = 0;
        for (int i = 0; i < r->world && at < sizeof list - 64; i++) {
            if (r->where[i].node != n) continue;
            const k3_rank_mem *m = &r->plan.mem[i];
            int s = -1, e = -1;
            k3_plan_coords(&r->plan, i, &s, &e);
            at += (size_t)snprintf(list + at, sizeof list - at,
                                   "%s rank %d (stage %d, lane %d) %.2f GB = weights %.2f + caches "
                                   "%.2f + buffers %.2f + workspace %.2f",
                                   at ? ";" : "", i, s, e, rank_need(r, i) / 1e9, m->weights / 1e9,
                                   m->caches / 1e9, m->buffers / 1e9, m->workspace / 1e9);
        }
        k3_free(on);
        return K3_ERR(K3_ERR_NOMEM,
                      "memory: the %d rank%s on host %s need %.2f GB together%s but the node can "
                      "give %.2f GB (MemAvailable %.2f GB less a margin of %.2f GB: 10%%, at "
                      "least 256 MiB); caches are %d sequence slots of %lld tokens per lane "
                      "(--max-seqs, --max-ctx) and buffers hold %lld tokens per step "
                      "(--max-batch-tokens, or --chunk for a long prompt): lower them or spread "
                      "the ranks over more nodes;%s",
                      n_ranks, n_ranks == 1 ? "" : "s", r->where[n].host, need / 1e9,
                      once ? " (their shared dense weights counted once)" : "", usable / 1e9,
                      avail / 1e9, margin / 1e9, req->max_seqs_per_lane, (long long)req->max_ctx,
                      (long long)req->max_tokens, list);
    }
    k3_free(on);
    return K3_OK;
}

/* --bind (host/bind.c): this rank's share of its node's cores; local rank = its order among the
 * ranks on its node (r->where). The cpu pool then takes one thread per core of the binding. */
static void bind_rank(rank_ctx *r) {
    int local = 0, n_local = 0;
    for (int i = 0; i < r->world; i++)
        if (r->where[i].node == r->where[r->rank].node) {
            local += i < r->rank;
            n_local++;
        }
    const char *mode = r->o->bind ? r->o->bind : "auto";
    /* a GPU rank binds near its device (cuda, or an unresolved auto; no GPU found: a plain
       share of the node) */
    const char *be = r->o->backend ? r->o->backend : "auto";
    const bool gpu = strcmp(be, "cpu") != 0 && strcmp(be, "ref") != 0 && strcmp(be, "guard") != 0;
    k3_bind_info b;
    if (strcmp(mode, "none") == 0) {
        /* unbound, but the waits still need to know whether the node is oversubscribed */
        if (k3_bind_describe(local, n_local, gpu, &b) == K3_OK) r->oversub = n_local > b.node_cores;
        K3_LOGI("bind: rank %d (local %d of %d on %s): none (--bind none)%s", r->rank, local,
                n_local, r->where[r->rank].host, r->oversub ? "; oversubscribed" : "");
        return;
    }
    k3_status st = k3_bind_apply(local, n_local, gpu, &b);
    if (st != K3_OK) { /* a machine without the rights or the topology: run unbound, say so */
        K3_LOGW("bind: rank %d: %s; running unbound", r->rank, k3_last_error());
        return;
    }
    r->oversub = n_local > b.node_cores;
    if (r->o_.n_threads <= 0) r->o_.n_threads = b.n_cores;
    K3_LOGI("bind: rank %d (local %d of %d on %s): cores %s, NUMA %s, %d thread%s, GPU %d%s%s",
            r->rank, local, n_local, r->where[r->rank].host, b.cores, b.numa, r->o_.n_threads,
            r->o_.n_threads == 1 ? "" : "s", b.device,
            b.kept ? " (the launcher's binding, kept)" : "",
            r->oversub ? "; oversubscribed: waits sleep at once" : "");
}

/* Usage-type problems are identical on every rank: all return K3_ERR_ARG, rank 0 prints. Others:
 * agree on the worst status so nobody hangs in the next collective. */
/* The prefix cache's sizes (docs/DESIGN.md §3c), the same on every rank: a budget of blocks
 * (--prefix-cache-tokens, by default the lane's whole paged cache: unused blocks cost nothing,
 * evicted when a request needs them), a snapshot every K3_PREFIX_SNAP_EVERY blocks, and the
 * snapshot pool the plan counts (k3_plan_prefix_snapshots). */
static k3_status prefix_cache_sizes(rank_ctx *r) {
    const k3_engine_opts *o = r->o;
    r->pc_on = !o->no_prefix_cache;
    r->pc.max_seqs = r->max_seqs;
    if (!r->pc_on) return K3_OK;
    if (o->prefix_cache_tokens < 0 || o->prefix_cache_tokens > (int64_t)r->kv_blocks * K3_KV_BLOCK)
        return K3_ERR(K3_ERR_ARG,
                      "--prefix-cache-tokens %lld: must be in [0, %lld], the lane's paged cache "
                      "(--kv-cache-tokens)",
                      (long long)o->prefix_cache_tokens, (long long)r->kv_blocks * K3_KV_BLOCK);
    const int64_t tokens =
        o->prefix_cache_tokens > 0 ? o->prefix_cache_tokens : (int64_t)r->kv_blocks * K3_KV_BLOCK;
    rank_pc_params *p = &r->pc;
    p->n_entries = (int)((tokens + K3_KV_BLOCK - 1) / K3_KV_BLOCK);
    p->snap_every = K3_PREFIX_SNAP_EVERY;
    p->n_snaps = k3_plan_prefix_snapshots(p->n_entries, r->max_seqs);
    p->max_seqs = r->max_seqs;
    p->max_blocks = (int)((r->max_ctx + K3_KV_BLOCK - 1) / K3_KV_BLOCK);
    p->max_tokens = r->max_tokens;
    return K3_OK;
}

k3_status rank_setup(rank_ctx *r) {
    const k3_engine_opts *o = r->o;
    k3_status st = K3_OK;
    char *map = NULL;
    const double tmo = rank_comm_timeout(r);
    bool same = false; /* the error is the same on every rank (the memory verdict) */
    { /* where every rank runs (every rank takes part, whatever its own set-up does next) */
        size_t avail = 0, total = 0;
        if (k3_host_memory(&avail, &total) != K3_OK) avail = 0; /* unknown: no check */
        k3_status ws = k3_calloc((void **)&r->where, (size_t)r->world * sizeof *r->where, "hosts");
        if (ws == K3_OK) ws = k3_comm_world_where((uint64_t)avail, r->where, tmo);
        if (ws == K3_ERR_ARG) /* a node map that disagrees with reality: every rank refuses it */
            st = ws, same = true;
        else if (ws != K3_OK)
            return rank_fail(r, ws);
    }
    bind_rank(r);
    r->max_seqs = o->max_seqs > 0 ? o->max_seqs : K3_ENGINE_DEFAULT_MAX_SEQS;
    r->max_ctx = o->max_ctx > 0 ? o->max_ctx : K3_ENGINE_DEFAULT_MAX_CTX;
    r->max_tokens =
        o->max_batch_tokens > 0 ? o->max_batch_tokens : K3_ENGINE_DEFAULT_MAX_BATCH_TOKENS;
    r->chunk = o->chunk > 0 ? K3_MIN(o->chunk, r->max_tokens) : r->max_tokens;
    { /* the paged cache of a lane: --kv-cache-tokens, by default every slot at max_ctx */
        const int64_t kvt =
            o->kv_cache_tokens > 0 ? o->kv_cache_tokens : (int64_t)r->max_seqs * r->max_ctx;
        r->kv_blocks = (int)K3_MIN((kvt + K3_KV_BLOCK - 1) / K3_KV_BLOCK, (int64_t)INT32_MAX / 2);
    }
    if (st == K3_OK) st = prefix_cache_sizes(r);
    if (o->max_seqs < 0 || o->max_ctx < 0 || o->max_batch_tokens < 0 || o->chunk < 0 ||
        o->micro_batches < 0 || o->micro_batches > 1024)
        st = K3_ERR(K3_ERR_ARG, "--max-seqs, --max-ctx, --max-batch-tokens, --chunk and "
                                "--micro-batches (<= 1024) must be >= 0");
    if (st == K3_OK) st = k3_config_load(o->model_dir, &r->cfg);
    if (st == K3_OK && r->cfg.max_position_embeddings > 0 &&
        r->max_ctx > r->cfg.max_position_embeddings) { /* past it: no trained meaning */
        st = K3_ERR(K3_ERR_STATE,
                    "--max-ctx %lld (prompt + new tokens per sequence) exceeds the model's "
                    "max_position_embeddings %lld (%s/config.json)",
                    (long long)r->max_ctx, (long long)r->cfg.max_position_embeddings, o->model_dir);
        same = true; /* every rank has it: rank 0 says it once, exit 1 */
    }
    if (st == K3_OK && o->expert_map_path) {
        size_t nb;
        st = k3_read_file(o->expert_map_path, &map, &nb);
    }
    if (st == K3_OK) {
        k3_plan_req req = {
            .world = r->world,
            .pp = o->pp,
            .ep = o->ep,
            .coord = o->coord,
            .expert_map = map,
            .expert_map_name = o->expert_map_path,
            .max_ctx = r->max_ctx,
            .max_seqs_per_lane = r->max_seqs,
            .max_tokens = r->max_tokens,
            .kv_cache_tokens = (int64_t)r->kv_blocks * K3_KV_BLOCK,
            .prefix_snapshots = r->pc_on ? r->pc.n_snaps : 0,
            .moe_device = o->comm && strcmp(o->comm, "nccl") == 0 && o->backend &&
                          strcmp(o->backend, "cuda") == 0 && !getenv("K3_MOE_HOST_ROUTE"),
            .graphs = !o->no_cuda_graphs && o->backend && strcmp(o->backend, "cuda") == 0};
        st = k3_plan_make(&r->cfg, &req, &r->plan);
        if (st == K3_OK) st = check_memory(r, &req), same = st != K3_OK;
    }
    k3_free(map);
    /* agree before anything collective: 0 ok, 1 usage error, 2 an error every rank has (memory),
     * 3 another error */
    int local = st == K3_OK ? 0 : (st == K3_ERR_ARG ? 1 : (same ? 2 : 3)), worst = 0;
    k3_status st2 = k3_comm_world_max(local, &worst, tmo);
    if (st2 != K3_OK) return rank_fail(r, st2);
    /* errors that are the same on every rank: rank 0 prints them; other errors each rank prints */
    if (local == 3 || ((local == 1 || local == 2) && r->rank == 0))
        fprintf(stderr, "%s: %s\n", rank_cmd_name(r), k3_last_error());
    if (local == 3 && r->world > 1) K3_LOGE("rank %d failed during set-up (see above)", r->rank);
    if (worst == 1) return K3_ERR(K3_ERR_ARG, "set-up: a usage error (printed by rank 0)");
    if (worst) return K3_ERR(K3_ERR_STATE, "set-up failed (printed above)");
    return K3_OK;
}

/* ---- node sharing -----------------------------------------------------------------------------
 * The host ranks of one stage on one node (its lanes there) need the same dense weights
 * (attention, norms, shared experts, routers, embedding or head). The lowest of them creates a
 * POSIX shared-memory object of the stage's dense bytes (k3_weights_dense_bytes) and reads them
 * into it during its load; the others map it read-only and read only their routed experts. They
 * use it only after open's last barrier, when every rank has loaded. The object has a name in
 * /dev/shm only between its shm_open and shm_unlink, a few calls apart in the reader: the others
 * open it through the reader's descriptor (/proc/<pid>/fd/<fd>), so no kill at any moment leaves
 * it behind, and the kernel frees it with the last mapping. A /dev/shm whose free space is below
 * the stage's dense bytes is found at open (statvfs; the pages are reserved with fallocate):
 * private copies, with a warning naming /dev/shm. A group whose reader
 * cannot create the object (no /dev/shm, no room) loads as before, each rank its own copy; a
 * rank that cannot map it reads its own copy. Device ranks (cuda, with a transport that moves
 * device buffers: nccl) keep a copy each on their device, but only the reader reads it from the
 * files: once every rank has loaded, it sends its region to the others of the group over the
 * comm table (rank_spread_dense). --load-private: no sharing. */

/* This rank takes part in its group's sharing: p the node's region (host), or NULL (device: the
 * region is allocated with the backend). */
static void shared_set(rank_ctx *r, void *p, bool device, uint64_t nd, uint64_t stored, int reader,
                       int size) {
    r->dense = p;
    r->dense_device = device;
    r->dense_bytes = nd;
    r->dense_reader = reader == r->rank;
    r->dense_skipped = r->dense_reader ? 0 : stored;
    K3_LOGI("load: stage %d's dense weights (%.2f MB) read once for the %d %sranks of the stage on "
            "%s (%s)",
            r->stage, nd / 1e6, size, device ? "device " : "", r->where[r->rank].host,
            r->dense_reader ? (device ? "I read them and send them on" : "I read them")
            : device        ? "received from the reader"
                            : "shared, read by another rank");
}

/* The free bytes of /dev/shm (K3_TEST_SHM_FREE fakes them, for tests); -1: unknown. */
static int64_t shm_free_bytes(void) {
    const char *fake = getenv("K3_TEST_SHM_FREE");
    if (fake && *fake) return strtoll(fake, NULL, 10);
    struct statvfs v;
    if (statvfs("/dev/shm", &v) != 0) return -1;
    return (int64_t)v.f_bavail * (int64_t)v.f_frsize;
}

/* The reader's object of nd bytes, its pages reserved now (a tmpfs too small fails here, not
 * later as a fault or EFAULT in the middle of a read), or MAP_FAILED with a warning: the ranks of
 * the stage on this node then read their own copies. */
static void *shm_create(const rank_ctx *r, const char *name, uint64_t nd, int *out_fd) {
    *out_fd = -1;
    const int64_t avail = shm_free_bytes();
    if (avail >= 0 && (uint64_t)avail < nd) {
        K3_LOGW("load: /dev/shm has %.2f MB free, less than stage %d's dense weights (%.2f MB): "
                "each rank of the stage on this node reads its own copy (enlarge /dev/shm, e.g. "
                "docker's --shm-size, to share them)",
                avail / 1e6, r->stage, nd / 1e6);
        return MAP_FAILED;
    }
    void *p = MAP_FAILED;
    int err = 0, fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) err = errno;
    if (fd >= 0 && (err = posix_fallocate(fd, 0, (off_t)nd)) == 0) {
        p = mmap(NULL, nd, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) err = errno;
    }
    if (p == MAP_FAILED)
        K3_LOGW("load: no shared memory for stage %d's dense weights (%.2f MB, /dev/shm%s: %s); "
                "each rank of the stage on this node reads its own copy",
                r->stage, nd / 1e6, name, strerror(err));
    if (fd >= 0) shm_unlink(name); /* at once: the object has no name that a kill could leave */
    if (fd >= 0 && p == MAP_FAILED) close(fd);
    if (p != MAP_FAILED) *out_fd = fd; /* the others open it as /proc/<my pid>/fd/<fd> */
    return p;
}

k3_status rank_share_dense(rank_ctx *r) {
    const char *be = r->o->backend ? r->o->backend : "cpu";
    const bool dev = strcmp(be, "cuda") == 0 && k3_comm_device_payloads(r->comm);
    const bool can =
        ((host_weights(r) && !r->o->load_mmap) || dev) && !r->o->load_private && r->worker;
    uint64_t *all = NULL;
    RTRY(r, k3_calloc((void **)&all, (size_t)r->world * sizeof *all, "node sharing"));
    k3_status st = K3_OK;
    int fd_mine = -1; /* the reader's descriptor of the (nameless) object, until all mapped it */
    char name[96] = "";
    /* a name unique to the job: rank 0's pid and clock, the same on every rank */
    const uint64_t mine =
        r->rank == 0 ? ((uint64_t)getpid() << 32) | ((uint64_t)(k3_now_s() * 1e6) & 0xffffffffu)
                     : 0;
    if ((st = k3_comm_allgather_u64(r->comm, mine, all)) != K3_OK) goto out;
    const uint64_t token = all[0];
    const int node = r->where[r->rank].node;
    int reader = -1, size = 0;
    if (can) dense_group(r, r->rank, &reader, &size, NULL, 0);
    uint64_t nd = 0, stored = 0;
    if (can && size > 1) {
        if ((st = stage_dense(r, r->stage, &nd, &stored)) != K3_OK) goto out;
    }
    const bool share = can && size > 1 && nd > 0;
    if (dev) { /* each device keeps a copy: no shared memory, the region comes with the backend */
        if (share) shared_set(r, NULL, true, nd, stored, reader, size);
        goto out;
    }
    /* the name starts with rank 0's pid ("k3-<pid>-..."), so a leftover can be traced to its job */
    snprintf(name, sizeof name, "/k3-%u-%08llx-n%d-s%d", (unsigned)(token >> 32),
             (unsigned long long)(token & 0xffffffffu), node, r->stage);
    void *p = MAP_FAILED;
    /* everyone at the same point first, so the object lives only while the group maps it */
    if ((st = k3_comm_barrier(r->comm)) != K3_OK) goto out;
    if (share && reader == r->rank) p = shm_create(r, name, nd, &fd_mine);
    /* every reader's verdict (its pid and descriptor, 0: none), then the others map what their
       reader made through /proc: the object's name is gone already */
    const uint64_t verdict = p != MAP_FAILED ? ((uint64_t)getpid() << 32) | (uint32_t)fd_mine : 0;
    if ((st = k3_comm_allgather_u64(r->comm, verdict, all)) != K3_OK) goto out;
    if (share && reader != r->rank && all[reader]) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%u/fd/%u", (unsigned)(all[reader] >> 32),
                 (unsigned)(all[reader] & 0xffffffffu));
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) p = mmap(NULL, nd, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            K3_LOGW(
                "load: cannot map stage %d's shared dense weights (%s: %s); reading my own copy",
                r->stage, path, strerror(errno));
        if (fd >= 0) close(fd);
    }
    if ((st = k3_comm_barrier(r->comm)) != K3_OK) goto out;
    if (p != MAP_FAILED) shared_set(r, p, false, nd, stored, reader, size);
out:
    if (fd_mine >= 0) close(fd_mine); /* the mappings keep the object; it has no name */
    k3_free(all);
    RTRY(r, st);
    return K3_OK;
}

#define SPREAD_FLOATS ((int64_t)1 << 28) /* floats per transfer (1 GiB) */

k3_status rank_spread_dense(rank_ctx *r) {
    if (!r->dense_device) return K3_OK;
    int reader = -1, size = 0, members[256];
    dense_group(r, r->rank, &reader, &size, members, (int)K3_ARRAY_LEN(members));
    if (size > (int)K3_ARRAY_LEN(members))
        RTRY(r, K3_ERR(K3_ERR_STATE, "node sharing: %d ranks of stage %d on one node (at most %d)",
                       size, r->stage, (int)K3_ARRAY_LEN(members)));
    k3_comm_set_doing(r->comm, "copying the stage's dense weights from the node's reader");
    const int64_t n = (int64_t)(r->dense_bytes / sizeof(float)); /* align64: whole floats */
    float *x = r->dense;
    for (int k = 0; k < size; k++) {
        const int peer = members[k];
        if (peer == reader || (r->rank != reader && r->rank != peer)) continue;
        for (int64_t at = 0; at < n; at += SPREAD_FLOATS) {
            const int64_t m = K3_MIN(SPREAD_FLOATS, n - at);
            if (r->rank == reader)
                RTRY(r, k3_comm_send_dev(r->comm, r->be, peer, x + at, m,
                                         "the stage's dense weights to a lane on the node"));
            else
                RTRY(r, k3_comm_recv_dev(r->comm, r->be, reader, x + at, m,
                                         "the stage's dense weights from the node's reader"));
        }
    }
    return K3_OK;
}

/* ---- loading ------------------------------------------------------------------------------
 * The load's own state: it lives from the start of rank_load to its end (the loader's callbacks
 * get it as their ctx). */
struct rank_load {
    rank_ctx *r;
    int *pct; /* [world] load progress per rank (rank 0 hears every rank, workers rank 0) */
    /* the load heartbeat: what each peer last reported, and when */
    int *hb_state;              /* [world] K3_LOAD_* */
    uint64_t *hb_bytes;         /* [world] bytes read so far */
    double *seen;               /* [world] k3_now_s() of the last beat */
    uint64_t hb_done, hb_total; /* this rank's own load */
    double hb_sent, t_load0, load_timeout_s;
    double t_tick;   /* this rank's previous heartbeat turn */
    double t_logged; /* rank 0 without a terminal: when the last progress line was logged */
    int lines_drawn; /* rank 0 on a terminal: the lines of the last draw */
    const k3_ckpt_tensor **read_list; /* --verify: the tensors this rank read */
    int64_t n_read, cap_read;
};
typedef struct rank_load rank_load_t;

static bool expert_owned(void *ctx, int layer, int expert) {
    const rank_load_t *L = ctx;
    return k3_plan_owner_lane(&L->r->plan, layer, expert) == L->r->lane;
}

/* Rank 0's view of the load: one line per node (bytes, GB/s, ETA) and a total, redrawn in place
 * on a terminal (r->tty); without one (--progress on, no terminal), one log line every
 * LOG_EVERY_S seconds. Bytes are each rank's last reported fraction of its planned weights. */
#define LOG_EVERY_S 5.0
static void draw_progress(rank_load_t *L, bool final) {
    const rank_ctx *r = L->r;
    if (!r->tty && !(r->o->progress && r->rank == 0)) return;
    const double now = k3_now_s(), dt = K3_MAX(now - L->t_load0, 1e-6);
    if (!r->tty && !final && now - L->t_logged < LOG_EVERY_S) return;
    const char *pfx = r->tty ? "[k3] " : ""; /* a log line has its own prefix */
    char line[8192];
    size_t at = 0;
    int n_lines = 0;
    double have_all = 0, tot_all = 0;
    for (int n = 0; n <= r->world; n++) { /* each node by its lowest rank, then the total */
        if (n < r->world && r->where && r->where[n].node != n) continue;
        double have = 0, tot = 0;
        int ranks = 0, done = 0;
        for (int i = 0; i < r->world; i++) {
            if (n < r->world && r->where && r->where[i].node != n) continue;
            if (n < r->world && !r->where && i != n) continue;
            const double w = (double)r->plan.mem[i].weights;
            have += w * L->pct[i] / 100.0, tot += w, ranks++, done += L->pct[i] >= 100;
        }
        if (n == r->world)
            have = have_all, tot = tot_all;
        else
            have_all += have, tot_all += tot;
        if (n < r->world && r->world == 1) continue; /* one rank: the total says it all */
        const double gbs = have / dt / 1e9, eta = gbs > 0 ? (tot - have) / (gbs * 1e9) : -1;
        char eta_s[32] = "?";
        if (eta >= 0) snprintf(eta_s, sizeof eta_s, "%.0f s", eta);
        if (n < r->world)
            at += (size_t)snprintf(
                line + at, sizeof line - at,
                "%snode %s: %3.0f%%  %.2f of %.2f GB, %.2f GB/s, ETA %s, %d/%d ranks done\033[K\n",
                pfx, r->where ? r->where[n].host : "?", tot > 0 ? 100 * have / tot : 100.0,
                have / 1e9, tot / 1e9, gbs, eta_s, done, ranks);
        else
            at += (size_t)snprintf(line + at, sizeof line - at,
                                   "%sloading: %3.0f%%  %.2f of %.2f GB, %.2f GB/s, ETA %s\033[K\n",
                                   pfx, tot > 0 ? 100 * have / tot : 100.0, have / 1e9, tot / 1e9,
                                   gbs, eta_s);
        n_lines++;
        if (at >= sizeof line - 256) break;
    }
    if (r->tty) { /* back over the lines drawn last time, then the new ones */
        if (L->lines_drawn > 0) fprintf(r->tty, "\033[%dA", L->lines_drawn);
        fputs(line, r->tty);
        fflush(r->tty);
        L->lines_drawn = n_lines;
    } else { /* a log: no escapes, one line */
        for (char *e; (e = strstr(line, "\033[K"));) memmove(e, e + 3, strlen(e + 3) + 1);
        for (char *c = line; *c; c++)
            if (*c == '\n') *c = c[1] ? ';' : 0;
        K3_LOGI("%s", line);
        L->t_logged = now;
    }
}

/* ---- the load heartbeat ---------------------------------------------------------------------
 * Loading has no collective until every rank is done, so a rank that stops (SIGSTOP, a dead
 * file system) would otherwise hold the job until the next wait's timeout. Every worker beats to
 * rank 0 and rank 0 beats to every worker, at most every hb_interval, from the loader's progress
 * callback (so a beat means bytes moved) and, once a rank has loaded, from its wait loop. Rank 0
 * names a worker it has not heard from for --comm-timeout; a worker names rank 0 the same way.
 * Rank 0 declares the end (K3_LOAD_ALL) when every rank reported K3_LOAD_DONE, and enforces
 * --load-timeout on the whole phase, naming the ranks not done. */
static double hb_interval(const rank_ctx *r) {
    return K3_MIN(1.0, rank_comm_timeout(r) / 5);
}

static k3_status hb_send(rank_load_t *L, int state) {
    rank_ctx *r = L->r;
    k3_wire_progress wp = {.version = K3_WIRE_VERSION,
                           .pct = L->pct[r->rank],
                           .state = state,
                           .done_bytes = L->hb_done,
                           .total_bytes = L->hb_total};
    for (int w = r->rank == 0 ? 1 : 0; w < (r->rank == 0 ? r->world : 1); w++)
        RTRY(r, k3_comm_post(r->comm, w, K3_MSG_PROGRESS, &wp, sizeof wp, NULL, 0));
    L->hb_sent = k3_now_s();
    return K3_OK;
}

/* Take every beat that arrived; *any true when one did. */
static k3_status hb_poll(rank_load_t *L, bool *any) {
    rank_ctx *r = L->r;
    *any = false;
    for (;;) {
        k3_comm_msg m;
        bool got = false;
        RTRY(r, k3_comm_poll(r->comm, K3_ANY_RANK, K3_MSG_PROGRESS, &m, &got));
        if (!got) return K3_OK;
        k3_wire_progress wp;
        if (m.n_meta_bytes != (int64_t)sizeof wp || m.src < 0 || m.src >= r->world) continue;
        memcpy(&wp, m.meta, sizeof wp);
        if (wp.version != K3_WIRE_VERSION) continue;
        L->seen[m.src] = k3_now_s();
        L->pct[m.src] = K3_MAX(L->pct[m.src], wp.pct);
        L->hb_state[m.src] = K3_MAX(L->hb_state[m.src], wp.state);
        L->hb_bytes[m.src] = wp.done_bytes;
        *any = true;
    }
}

static void describe(const rank_ctx *r, int i, char *buf, size_t cap) {
    int s = -1, e = -1;
    k3_plan_coords(&r->plan, i, &s, &e);
    const char *host = r->where ? r->where[i].host : "?";
    if (s >= 0)
        snprintf(buf, cap, "rank %d (stage %d, lane %d, host %s)", i, s, e, host);
    else
        snprintf(buf, cap, "rank %d (coordinator, host %s)", i, host);
}

/* A fault naming a silent peer or the ranks over --load-timeout. */
static k3_status hb_check(rank_load_t *L) {
    rank_ctx *r = L->r;
    double now = k3_now_s(), tmo = rank_comm_timeout(r);
    char who[160];
    for (int i = 0; i < r->world; i++) {
        if (i == r->rank || (r->rank != 0 && i != 0)) continue; /* rank 0 <-> workers */
        if (r->rank == 0 && !k3_plan_coords(&r->plan, i, NULL, NULL)) continue;
        if (now - L->seen[i] <= tmo) continue;
        describe(r, i, who, sizeof who);
        const k3_rank_mem *m = &r->plan.mem[i];
        return rank_blame(r,
                          "%s made no load progress for %.1f s (--comm-timeout %.0f s): it last "
                          "reported %s, %.2f of %.2f MB",
                          who, now - L->seen[i], tmo,
                          L->hb_state[i] >= K3_LOAD_DONE ? "done, waiting for the others"
                                                         : "loading",
                          L->hb_bytes[i] / 1e6, m->weights / 1e6);
    }
    if (now - L->t_load0 <= L->load_timeout_s) return K3_OK;
    if (r->rank != 0 && L->hb_state[r->rank] >= K3_LOAD_DONE) { /* rank 0 names the slow ones */
        if (now - L->t_load0 <= L->load_timeout_s + tmo) return K3_OK;
        describe(r, 0, who, sizeof who);
        return rank_blame(r, "%s did not end the load within --load-timeout %.0f s + %.0f s", who,
                          L->load_timeout_s, tmo);
    }
    char list[1024];
    size_t at = 0;
    for (int i = 0; i < r->world && at < sizeof list - 200; i++) {
        if (L->hb_state[i] >= K3_LOAD_DONE || (r->rank != 0 && i != r->rank)) continue;
        if (!k3_plan_coords(&r->plan, i, NULL, NULL)) continue;
        describe(r, i, who, sizeof who);
        at +=
            (size_t)snprintf(list + at, sizeof list - at, "%s%s at %.2f of %.2f MB", at ? "; " : "",
                             who, L->hb_bytes[i] / 1e6, r->plan.mem[i].weights / 1e6);
    }
    return rank_blame(r, "loading took longer than --load-timeout %.0f s; not done: %s",
                      L->load_timeout_s, list);
}

/* One turn of the heartbeat: take beats, beat when due (and redraw rank 0's bar), check. */
static k3_status hb_tick(rank_load_t *L, int state) {
    rank_ctx *r = L->r;
    bool got = false;
    const double now = k3_now_s();
    if (L->t_tick > 0 && now - L->t_tick > rank_comm_timeout(r)) {
        /* this rank itself did not run for a whole timeout (stopped, then resumed): its peers'
           silence is its own doing, and the job may already have blamed it. Never blame them for
           it (a resumed rank named a healthy rank 0): give each a fresh window instead. */
        for (int i = 0; i < r->world; i++) L->seen[i] = now;
    }
    L->t_tick = now;
    if (r->world > 1) K3_TRY(hb_poll(L, &got));
    bool due = k3_now_s() - L->hb_sent >= hb_interval(r);
    if (due && r->world > 1)
        K3_TRY(hb_send(L, state));
    else if (due)
        L->hb_sent = k3_now_s(); /* a world of one: only the bar and --load-timeout */
    if (r->rank == 0 && (got || due)) draw_progress(L, false);
    return hb_check(L);
}

static k3_status on_read(void *ctx, const k3_ckpt_tensor *t) {
    rank_load_t *L = ctx;
    if (L->n_read == L->cap_read) {
        int64_t cap = L->cap_read ? 2 * L->cap_read : 256;
        const k3_ckpt_tensor **a = realloc(L->read_list, (size_t)cap * sizeof *a);
        if (!a) return K3_ERR(K3_ERR_NOMEM, "--verify: read list");
        L->read_list = a, L->cap_read = cap;
    }
    L->read_list[L->n_read++] = t;
    return K3_OK;
}

static int ptr_cmp(const void *a, const void *b) {
    uintptr_t x = (uintptr_t) * (const void *const *)a, y = (uintptr_t) * (const void *const *)b;
    return x < y ? -1 : x > y;
}

static bool verify_select(void *ctx, const k3_ckpt_tensor *t) {
    const rank_load_t *L = ctx;
    return bsearch(&t, L->read_list, (size_t)L->n_read, sizeof *L->read_list, ptr_cmp) != NULL;
}

static void verify_report(void *ctx, const char *problem) {
    const rank_ctx *r = ((const rank_load_t *)ctx)->r;
    K3_LOGE("--verify: rank %d (stage %d, lane %d): %s", r->rank, r->stage, r->lane, problem);
}

static k3_status verify_progress(void *ctx, uint64_t done, uint64_t total) {
    (void)done, (void)total;
    return hb_tick(ctx, K3_LOAD_RUNNING); /* a long scan is progress, not a stall */
}

/* --verify: every byte this rank read, checked for non-finite values and 0xFF E8M0 scales. */
static k3_status verify_own(rank_load_t *L) {
    rank_ctx *r = L->r;
    qsort(L->read_list, (size_t)L->n_read, sizeof *L->read_list, ptr_cmp);
    k3_scan_opts so = {
        .select = verify_select, .progress = verify_progress, .report = verify_report, .ctx = L};
    k3_scan_result res;
    RTRY(r, k3_ckpt_scan(r->ck, &so, &res));
    K3_LOGI("--verify: checked %.2f MB of %lld tensors in %.2f s (%.2f GB/s), the cost on top of "
            "the load",
            res.n_bytes / 1e6, (long long)res.n_tensors, res.seconds,
            res.seconds > 0 ? res.n_bytes / 1e9 / res.seconds : 0.0);
    if (res.n_bad_values > 0)
        RTRY(r, K3_ERR(K3_ERR_FORMAT,
                       "--verify: %lld bad values in %lld of this rank's tensors (listed above by "
                       "tensor, row and file)",
                       (long long)res.n_bad_values, (long long)res.n_bad_tensors));
    return K3_OK;
}

static k3_status on_progress(void *ctx, uint64_t done, uint64_t total) {
    rank_load_t *L = ctx;
    rank_ctx *r = L->r;
    L->hb_done = done;
    L->hb_total = total;
    L->hb_bytes[r->rank] = done;
    L->pct[r->rank] = total ? (int)(100.0 * (double)done / (double)total) : 100;
    rank_hooks_load_progress(r, done, total); /* stall-load:R, kill-load:R */
    return hb_tick(L, K3_LOAD_RUNNING);
}

/* A device backend: the plan's need of this rank (weights + caches + buffers + workspace, what
 * `k3 plan` prints) against the device's free memory, before anything is allocated on it. */
static k3_status check_device_memory(rank_ctx *r) {
    if (k3_backend_host_visible(r->be)) return K3_OK; /* host memory: check_memory at set-up */
    size_t free_b = 0, total_b = 0;
    if (k3_backend_memory(r->be, &free_b, &total_b) != K3_OK) return K3_OK; /* unknown */
    const k3_rank_mem *m = &r->plan.mem[r->rank];
    const uint64_t need = k3_rank_mem_total(m);
    if (need <= free_b) return K3_OK;
    return K3_ERR(K3_ERR_NOMEM,
                  "device memory: the plan needs %.3f GB on this rank (weights %.3f + caches %.3f "
                  "+ buffers %.3f + workspace %.3f) but the %s device has %.3f GB free of %.3f GB: "
                  "short by %.3f GB; lower --max-seqs, --max-ctx or --max-batch-tokens, or spread "
                  "the weights over more ranks (--pp, --ep)",
                  need / 1e9, m->weights / 1e9, m->caches / 1e9, m->buffers / 1e9,
                  m->workspace / 1e9, r->be->name, free_b / 1e9, total_b / 1e9,
                  (need - free_b) / 1e9);
}

/* The checks of `k3 inspect` (k3_ckpt_verify: every tensor the config implies, with its dtype
 * and shape, and nothing else) before anything is read: a checkpoint inspect refuses is not
 * loaded. The extra tensors matter: attn_res_block_size 0 or tie_word_embeddings true beside
 * AttnRes tensors or an lm_head in the files means the config and the weights disagree, which
 * gave other tokens without a word. */
typedef struct first_problem {
    char msg[512];
} first_problem;

static void note_problem(void *ctx, const char *msg) {
    first_problem *p = ctx;
    if (!p->msg[0]) snprintf(p->msg, sizeof p->msg, "%s", msg);
}

static k3_status check_as_inspect(const rank_ctx *r) {
    first_problem p = {{0}};
    const int64_t n = k3_ckpt_verify(r->ck, &r->cfg, note_problem, &p);
    if (n == 0) return K3_OK;
    return K3_ERR(K3_ERR_FORMAT,
                  "%s: the checkpoint does not match its config.json (%lld problem%s; `k3 inspect` "
                  "lists them): %s",
                  r->o->model_dir, (long long)n, n == 1 ? "" : "s", p.msg);
}

/* --load-mmap: how much of the weights is the files' own pages, and how much of that is mapped
 * by 2 MB entries (a file system or cache that holds the files in small pages maps them by 4 KB
 * ones, and a decode step then misses the TLB about every 4 KB of weights it sweeps). */
static void log_mapped(const k3_weights *w) {
    uint64_t mapped, resident, pmd;
    const double t0 = k3_now_s();
    if (k3_weights_mapped(w, &mapped, &resident, &pmd) != K3_OK) {
        K3_LOGW("load: cannot tell how the weights are mapped: %s", k3_last_error());
        return;
    }
    const double pct = resident ? 100.0 * (double)pmd / (double)resident : 100.0;
    K3_LOGI("load: %.2f MB of weights mapped from the files, %.0f%% of the resident pages in 2 MB "
            "entries (checked in %.3f s, after the load)",
            mapped / 1e6, pct, k3_now_s() - t0);
    if (resident > ((uint64_t)64 << 20) && pct < 50)
        K3_LOGW("load: the page cache holds these files in small pages: decode sweeps the weights "
                "through 4 KB entries (slower); drop the files from the page cache (or copy them) "
                "and load again, or load without --load-mmap");
}

/* The worker's part: open the checkpoint, create the backend, read the stage's weights (and
 * --verify them), check the plan was honoured. */
static k3_status load_weights(rank_load_t *L) {
    rank_ctx *r = L->r;
    RTRY(r, rank_hooks_load_begin(r)); /* load:R */
    RTRY(r, hb_tick(L, K3_LOAD_RUNNING));
    RTRY(r, k3_ckpt_open(r->o->model_dir, &r->ck));
    RTRY(r, check_as_inspect(r));
    int S = r->plan.n_stages;
    k3_backend_params bp = {.n_threads =
                                r->o->n_threads > 0 ? r->o->n_threads : (r->world > 1 ? 1 : 0)};
    RTRY(r, k3_backend_create(r->o->backend ? r->o->backend : "cpu", &bp, &r->be));
    RTRY(r, check_device_memory(r));
    if (r->dense_device) /* this device's copy of the stage's dense weights (rank_share_dense) */
        RTRY(r, k3_backend_alloc(r->be, r->dense_bytes, "dense weights", &r->dense));
    k3_load_sel sel = {.be = r->be,
                       .layer_begin = r->plan.stage_begin[r->stage],
                       .layer_end = r->plan.stage_begin[r->stage + 1],
                       .embed = r->stage == 0,
                       .head = r->stage == S - 1,
                       .expert_owned = expert_owned,
                       .ctx = L,
                       .progress = on_progress,
                       .on_read = r->o->verify ? on_read : NULL,
                       .n_readers = r->o->load_readers,
                       .direct = r->o->load_direct,
                       .dense = r->dense,
                       .dense_bytes = r->dense_bytes,
                       .dense_reader = r->dense_reader,
                       .map = r->o->load_mmap && host_weights(r)};
    if (r->o->load_mmap && !sel.map)
        K3_LOGW("load: --load-mmap is for host backends (cpu, ref); reading the files");
    RTRY(r, k3_weights_load(r->ck, &r->cfg, &sel, &r->w));
    if (r->o->verify) RTRY(r, verify_own(L));
    r->view = k3_weights_get(r->w);
    r->bytes_read = k3_ckpt_bytes_read(r->ck);
    /* the loader must have honoured the plan: own experts present, others absent */
    for (int l = sel.layer_begin; l < sel.layer_end; l++) {
        const k3_layer_w *lw = &r->view->layers[l];
        if (!lw->present)
            RTRY(r, K3_ERR(K3_ERR_INTERNAL, "layer %d of my stage was not loaded", l));
        if (!k3_config_is_moe(&r->cfg, l)) continue;
        for (int x = 0; x < r->cfg.n_experts; x++) {
            bool own = k3_plan_owner_lane(&r->plan, l, x) == r->lane;
            const k3_expert_w *ew = &lw->experts[x];
            bool loaded = ew->w1.data && ew->w2.data && ew->w3.data;
            if (loaded != own || (ew->present && !loaded))
                RTRY(r, K3_ERR(K3_ERR_INTERNAL,
                               "layer %d expert %d: loaded=%d but the plan says owned=%d", l, x,
                               loaded, own));
        }
    }
    return K3_OK;
}

/* After this rank's own load: beat until every rank is done (rank 0) or rank 0 says so. */
static k3_status load_wait(rank_load_t *L) {
    rank_ctx *r = L->r;
    L->pct[r->rank] = 100;
    L->hb_state[r->rank] = K3_LOAD_DONE;
    L->hb_bytes[r->rank] = L->hb_done = r->bytes_read;
    if (r->world == 1) return K3_OK;
    if (r->rank != 0) RTRY(r, hb_send(L, K3_LOAD_DONE));
    int backoff = 0;
    for (;;) { /* rank 0: until every rank is done; workers: until rank 0 says so */
        RTRY(r, hb_tick(L, K3_LOAD_DONE));
        if (r->rank != 0 && L->hb_state[0] >= K3_LOAD_ALL) break;
        if (r->rank == 0) {
            int done = 0;
            for (int i = 0; i < r->world; i++)
                done += L->hb_state[i] >= K3_LOAD_DONE || !k3_plan_coords(&r->plan, i, NULL, NULL);
            if (done == r->world) break;
        }
        k3_comm_idle(r->comm, &backoff);
    }
    if (r->rank == 0) RTRY(r, hb_send(L, K3_LOAD_ALL));
    return K3_OK;
}

static k3_status load_run(rank_load_t *L) {
    rank_ctx *r = L->r;
    double t0 = k3_now_s();
    L->t_load0 = t0;
    /* --load-timeout: given, or 60 s + the largest rank's planned bytes at 50 MB/s */
    uint64_t most = 0;
    for (int i = 0; i < r->world; i++) most = K3_MAX(most, r->plan.mem[i].weights);
    L->load_timeout_s = r->o->load_timeout_s > 0
                            ? r->o->load_timeout_s
                            : K3_LOAD_TIMEOUT_FLOOR_S + (double)most / K3_LOAD_TIMEOUT_MIN_BPS;
    if (r->rank == 0 && r->world > 1)
        K3_LOGI("load: --load-timeout %.0f s%s; a rank with no load progress for %.0f s "
                "(--comm-timeout) is named",
                L->load_timeout_s,
                r->o->load_timeout_s > 0 ? "" : " (60 s + largest rank at 50 MB/s)",
                rank_comm_timeout(r));
    RTRY(r, k3_calloc((void **)&L->pct, (size_t)r->world * sizeof(int), "load progress"));
    RTRY(r, k3_calloc((void **)&L->hb_state, (size_t)r->world * sizeof(int), "load states"));
    RTRY(r, k3_calloc((void **)&L->hb_bytes, (size_t)r->world * sizeof(uint64_t), "load bytes"));
    RTRY(r, k3_calloc((void **)&L->seen, (size_t)r->world * sizeof(double), "load beats"));
    for (int i = 0; i < r->world; i++) L->seen[i] = t0;
    if (r->worker) RTRY(r, load_weights(L));
    r->load_s = k3_now_s() - t0;
    if (r->worker)
        K3_LOGI("loaded %.2f MB in %.2f s (%.2f GB/s); plan: %.2f MB", r->bytes_read / 1e6,
                r->load_s, r->load_s > 0 ? r->bytes_read / 1e9 / r->load_s : 0.0,
                r->plan.mem[r->rank].weights / 1e6);
    if (r->worker && r->o->load_mmap && host_weights(r)) log_mapped(r->w);
    RTRY(r, load_wait(L));
    if (r->rank == 0 && (r->tty || r->world > 1)) draw_progress(L, true);
    return K3_OK;
}

k3_status rank_load(rank_ctx *r) {
    k3_comm_set_doing(r->comm, "loading weights");
    rank_load_t L = {.r = r};
    k3_status st = load_run(&L);
    k3_free(L.pct), k3_free(L.hb_state), k3_free(L.hb_bytes), k3_free(L.seen);
    free(L.read_list);
    return st;
}

k3_status rank_load_drain(rank_ctx *r) {
    for (bool got = true; got && r->world > 1;) {
        k3_comm_msg m;
        got = false;
        RTRY(r, k3_comm_poll(r->comm, K3_ANY_RANK, K3_MSG_PROGRESS, &m, &got));
    }
    return K3_OK;
}
