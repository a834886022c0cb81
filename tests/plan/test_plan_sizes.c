/* test_plan_sizes.c — the plan's per-rank sizes against what the engine's allocations really take,
 * byte for byte, on the guard backend (a bump allocator whose used bytes we can read): for each
 * stage of 1 x 1 and 2 stages x 1 lane on the tiny and small presets, load the stage's weights
 * into a guard backend, create its k3_stage, its sequence slots (max_seqs of max_ctx) and its
 * hand-off activation, exactly as rank/worker.c does, and compare the bytes each step took with
 * the plan's weights, workspace, caches (MLA + KDA) and activation. The guard backend rounds every
 * buffer up to a 4 KiB page, so a step may exceed the plan by at most one page per buffer (the
 * count of buffers bounds that slack); nothing may be smaller than planned.
 * (Expert parallelism, E > 1, adds the comm buffers; its whole-rank check is plan_rss.py.) */
#include "k3_test.h"

#include "k3_layers.h"
#include "k3_partition.h"
#include "layers/tiny_model.h"

#define PAGE 4096ull

static uint64_t used(const k3_backend *be) {
    size_t fr = 0, tot = 0;
    K3_CHECK_OK(k3_backend_memory(be, &fr, &tot));
    return (uint64_t)(tot - fr);
}

/* got in [want, want + slack_pages pages] */
static void near(const char *what, int stage, uint64_t got, uint64_t want, int slack_pages) {
    printf("  stage %d %-10s planned %12llu  allocated %12llu  (+%lld)\n", stage, what,
           (unsigned long long)want, (unsigned long long)got, (long long)(got - want));
    K3_CHECK(got >= want && got <= want + (uint64_t)slack_pages * PAGE,
             "stage %d %s: allocated %llu bytes, planned %llu (slack %d pages)", stage, what,
             (unsigned long long)got, (unsigned long long)want, slack_pages);
}

static void check_split(const char *preset, int S, int64_t T, int seqs, int64_t ctx) {
    printf("%s, %d stage(s), max_tokens %lld, %d slots of %lld tokens\n", preset, S, (long long)T,
           seqs, (long long)ctx);
    tiny_model m;
    K3_CHECK_OK(tiny_make(&m, preset, 1)); /* the checkpoint (host copy unused below) */
    k3_plan_req req = {
        .world = S, .pp = S, .ep = 1, .max_ctx = ctx, .max_seqs_per_lane = seqs, .max_tokens = T};
    k3_plan p;
    K3_CHECK_OK(k3_plan_make(&m.cfg, &req, &p));
    for (int s = 0; s < S; s++) {
        const k3_rank_mem *pm = &p.mem[k3_plan_rank(&p, s, 0)];
        k3_backend *be = NULL;
        K3_CHECK_OK(k3_backend_create("guard", &(k3_backend_params){.n_threads = 1}, &be));
        const int lb = p.stage_begin[s], le = p.stage_begin[s + 1];
        k3_load_sel sel = {
            .be = be, .layer_begin = lb, .layer_end = le, .embed = s == 0, .head = s == S - 1};
        uint64_t u0 = used(be);
        k3_weights *w = NULL;
        K3_CHECK_OK(k3_weights_load(m.ck, &m.cfg, &sel, &w));
        uint64_t u1 = used(be);
        /* weights: one buffer per tensor; the tiny preset has up to ~40 per layer */
        near("weights", s, u1 - u0, pm->weights, 64 * (le - lb + 2) + 16);
        k3_stage_params sp = {.cfg = &m.cfg,
                              .w = k3_weights_get(w),
                              .be = be,
                              .layer_begin = lb,
                              .layer_end = le,
                              .first = s == 0,
                              .last = s == S - 1,
                              .max_tokens = T,
                              .n_lanes = 1,
                              .max_seqs = seqs,
                              .max_ctx = ctx};
        k3_stage *st = NULL;
        K3_CHECK_OK(k3_stage_create(&sp, &st));
        uint64_t u2 = used(be);
        k3_seq_state *ss[64];
        for (int i = 0; i < seqs; i++) K3_CHECK_OK(k3_seq_state_create(st, ctx, &ss[i]));
        K3_CHECK(used(be) == u2, "sequence states take their slots and blocks from the pools");
        /* the stage's scratch (+ the f32 copies of its small vectors, which the plan counts in
         * neither: bounded by the slack), its slot pool and paged cache, as the rank sizes them
         * (--max-seqs slots, --kv-cache-tokens = max_seqs x max_ctx) */
        uint64_t mla, kconv, krec;
        k3_plan_seq_bytes(&m.cfg, lb, le, ctx, &mla, &kconv, &krec);
        near("workspace + caches", s, u2 - u1, pm->workspace + pm->caches, 16 + 3 * seqs);
        const uint64_t kv_tokens =
            ((uint64_t)seqs * (uint64_t)ctx + K3_KV_BLOCK - 1) / K3_KV_BLOCK * K3_KV_BLOCK;
        K3_CHECK(pm->caches == pm->mla_cache + pm->kda_state &&
                     pm->mla_cache == mla / (uint64_t)ctx * kv_tokens &&
                     pm->kda_state == (uint64_t)seqs * (kconv + krec),
                 "caches = the paged cache's blocks + slots x KDA state");
        k3_activ act;
        K3_CHECK_OK(k3_activ_alloc(be, &act, &m.cfg, T));
        uint64_t u4 = used(be);
        const uint64_t act_plan = (uint64_t)T * (uint64_t)m.cfg.hidden_size *
                                  (uint64_t)(1 + k3_plan_max_bank(&m.cfg)) * 4;
        near("hand-off", s, u4 - u2, act_plan, 2);
        K3_CHECK(pm->buffers >= act_plan, "comm buffers hold at least the hand-off activation");
        k3_activ_free(be, &act);
        for (int i = 0; i < seqs; i++) k3_seq_state_destroy(ss[i]);
        k3_stage_destroy(st);
        k3_weights_destroy(w);
        k3_backend_destroy(be);
    }
    k3_plan_free(&p);
    tiny_close(&m);
}

int main(void) {
    /* sizes well above the page slack: T x D and slots x ctx of several MB */
    check_split("tiny", 1, 1024, 8, 2048);
    check_split("tiny", 2, 1024, 8, 2048);
    check_split("small", 2, 256, 4, 1024);
    return k3_test_done("plan_sizes");
}
