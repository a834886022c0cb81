/* test_partition.c — the pure plan: balanced stages (checked against an independent optimiser:
 * binary search on the bottleneck + greedy feasibility, and brute force for the tiny model),
 * invalid requests rejected with messages naming the flag, expert-map validity (contiguous and
 * custom), per-rank bytes against sums made here from the catalogue, and hash equality. */
#include "k3_partition.h"
#include "k3_test.h"

#include <stdio.h>

static uint64_t spec_bytes(const k3_tensor_spec *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return n * (uint64_t)k3_dtype_size(t->dtype);
}

/* Independent optimiser: smallest bottleneck B such that a greedy left-to-right packing with
 * stage capacity B uses at most S stages (each non-empty). Searched over all candidate sums. */
static bool feasible(const double *cost, int n, int S, double first, double last, double B) {
    /* Greedy: each stage takes layers while they fit under B (stage 0 pays `first`, the stage that
     * takes layer n-1 pays `last`). Using fewer than S stages is fine: splitting a stage further
     * never raises any stage's cost. */
    int used = 0, i = 0;
    const double lim = B * (1 + 1e-12);
    while (i < n) {
        double acc = used == 0 ? first : 0;
        used++;
        int start = i;
        while (i < n) {
            double c_if = acc + cost[i] + (i == n - 1 ? last : 0);
            if (c_if > lim) break;
            acc = c_if;
            i++;
        }
        if (i == start) return false;
    }
    return used <= S;
}

static double best_bottleneck(const double *cost, int n, int S, double first, double last) {
    double lo = 0, hi = first + last;
    for (int i = 0; i < n; i++) hi += cost[i];
    for (int it = 0; it < 200; it++) {
        double mid = 0.5 * (lo + hi);
        if (feasible(cost, n, S, first, last, mid))
            hi = mid;
        else
            lo = mid;
    }
    return hi;
}

static double brute(const double *cost, int n, int S, double first, double last, int start, int s) {
    /* best max for layers [start, n) into stages s..S-1 */
    if (s == S - 1) {
        double x = last + (s == 0 ? first : 0);
        for (int i = start; i < n; i++) x += cost[i];
        return x;
    }
    double best = INFINITY, acc = s == 0 ? first : 0;
    for (int end = start + 1; end <= n - (S - 1 - s); end++) {
        acc += cost[end - 1];
        double rest = brute(cost, n, S, first, last, end, s + 1);
        double m = acc > rest ? acc : rest;
        if (m < best) best = m;
    }
    return best;
}

static k3_plan_req req_of(int world, int pp, int ep, k3_coord_mode m) {
    k3_plan_req r = {.world = world,
                     .pp = pp,
                     .ep = ep,
                     .coord = m,
                     .max_ctx = 512,
                     .max_seqs_per_lane = 4,
                     .max_tokens = 64};
    return r;
}

static void check_stages(const k3_config *c, const k3_plan *p, int64_t ctx, bool brute_ok) {
    K3_CHECK(p->stage_begin[0] == 0 && p->stage_begin[p->n_stages] == c->n_layers,
             "stages cover the layers");
    for (int s = 0; s < p->n_stages; s++)
        K3_CHECK(p->stage_begin[s + 1] > p->stage_begin[s], "stage %d empty", s);
    double cost[K3_MAX_LAYERS], first, last;
    k3_plan_layer_costs(c, ctx, cost, &first, &last);
    double mx = 0;
    for (int s = 0; s < p->n_stages; s++) mx = p->stage_cost[s] > mx ? p->stage_cost[s] : mx;
    double opt = best_bottleneck(cost, c->n_layers, p->n_stages, first, last);
    K3_CHECK(fabs(mx - opt) <= 1e-9 * opt, "S=%d: plan bottleneck %.6g vs optimum %.6g",
             p->n_stages, mx, opt);
    if (brute_ok) {
        double b = brute(cost, c->n_layers, p->n_stages, first, last, 0, 0);
        K3_CHECK(fabs(mx - b) <= 1e-9 * b, "S=%d: plan bottleneck %.6g vs brute force %.6g",
                 p->n_stages, mx, b);
    }
}

int main(void) {
    k3_config tiny, big;
    k3_preset_config(K3_PRESET_TINY, &tiny);
    k3_preset_config(K3_PRESET_K3, &big);

    /* the cost model distinguishes layer kinds */
    double cost[K3_MAX_LAYERS], first, last;
    k3_plan_layer_costs(&tiny, 512, cost, &first, &last);
    K3_CHECK(cost[1] != cost[3], "KDA (1) and MLA (3) MoE layers cost the same: %g", cost[1]);
    K3_CHECK(cost[0] != cost[1], "dense layer 0 costs like a MoE layer: %g", cost[0]);
    K3_CHECK(last > first && last > 0, "head cost %g vs embedding %g", last, first);
    for (int l = 0; l < tiny.n_layers; l++) K3_CHECK(cost[l] > 0, "layer %d cost %g", l, cost[l]);

    /* balanced stages for every S (tiny: also brute force), several E and both coordinator modes */
    int eps[] = {1, 2, 4, 8, 16};
    for (int S = 1; S <= tiny.n_layers; S++) {
        for (size_t k = 0; k < K3_ARRAY_LEN(eps); k++) {
            for (int m = 0; m < 2; m++) {
                k3_plan p;
                int world = S * eps[k] + m;
                K3_CHECK_OK(k3_plan_make(&tiny,
                                         &(k3_plan_req){.world = world,
                                                        .pp = S,
                                                        .ep = eps[k],
                                                        .coord = (k3_coord_mode)m,
                                                        .max_ctx = 512,
                                                        .max_seqs_per_lane = 2,
                                                        .max_tokens = 16},
                                         &p));
                if (p.n_stages != S) continue;
                if (k == 0 && m == 0) check_stages(&tiny, &p, 512, true);
                /* grid round trip */
                for (int r = 0; r < world; r++) {
                    int s, e;
                    bool w = k3_plan_coords(&p, r, &s, &e);
                    K3_CHECK(w == !(m == 1 && r == 0), "rank %d worker=%d", r, w);
                    if (w)
                        K3_CHECK(k3_plan_rank(&p, s, e) == r, "rank %d -> (%d,%d) -> %d", r, s, e,
                                 k3_plan_rank(&p, s, e));
                }
                if (m == 1)
                    K3_CHECK(p.mem[0].weights == 0, "dedicated coordinator holds %llu weight bytes",
                             (unsigned long long)p.mem[0].weights);
                k3_plan_free(&p);
            }
        }
    }
    for (int S = 1; S <= 16; S *= 2) {
        k3_plan p;
        K3_CHECK_OK(k3_plan_make(&big,
                                 &(k3_plan_req){.world = S * 8,
                                                .pp = S,
                                                .ep = 8,
                                                .max_ctx = 4096,
                                                .max_seqs_per_lane = 8,
                                                .max_tokens = 256},
                                 &p));
        check_stages(&big, &p, 4096, false);
        if (S == 4) {
            char buf[8192];
            k3_plan_format(&p, &big, buf, sizeof buf);
            K3_CHECK(strstr(buf, "hash") && strstr(buf, "weights MB"), "table:\n%s", buf);
            printf("%s", buf);
        }
        k3_plan_free(&p);
    }

    /* per-rank weight bytes vs sums made here from the catalogue */
    {
        k3_plan p;
        K3_CHECK_OK(k3_plan_make(&tiny,
                                 &(k3_plan_req){.world = 7,
                                                .pp = 3,
                                                .ep = 2,
                                                .coord = K3_COORD_DEDICATED,
                                                .max_ctx = 64,
                                                .max_seqs_per_lane = 1,
                                                .max_tokens = 8},
                                 &p));
        int64_t n = k3_catalog(&tiny, NULL, 0);
        k3_tensor_spec *specs = calloc((size_t)n, sizeof *specs);
        k3_catalog(&tiny, specs, n);
        uint64_t want[16] = {0}, total_experts = 0, total = 0;
        for (int64_t i = 0; i < n; i++) {
            const k3_tensor_spec *t = &specs[i];
            uint64_t b = spec_bytes(t);
            total += b;
            for (int r = 1; r < 7; r++) {
                int s = (r - 1) / 2, e = (r - 1) % 2;
                int lb = p.stage_begin[s], le = p.stage_begin[s + 1];
                bool mine = false;
                if (t->kind == K3_TK_GLOBAL)
                    mine = t->first_stage ? s == 0 : s == 2;
                else if (t->kind == K3_TK_LAYER)
                    mine = t->layer >= lb && t->layer < le;
                else
                    mine = t->layer >= lb && t->layer < le && t->expert / (tiny.n_experts / 2) == e;
                if (mine) want[r] += b;
            }
            if (t->kind == K3_TK_EXPERT) total_experts += b;
        }
        uint64_t sum = 0;
        for (int r = 0; r < 7; r++) {
            K3_CHECK(p.mem[r].weights == want[r], "rank %d: plan %llu bytes, catalogue %llu", r,
                     (unsigned long long)p.mem[r].weights, (unsigned long long)want[r]);
            sum += p.mem[r].weights;
        }
        /* experts are held once; everything else once per lane */
        K3_CHECK(sum == 2 * (total - total_experts) + total_experts, "sum %llu",
                 (unsigned long long)sum);
        K3_CHECK(p.mem[1].caches > 0 && p.mem[1].buffers > 0, "caches/buffers estimated");
        /* unique bytes of sets of ranks: one rank alone is its own weights; two lanes of one
           stage share the stage's non-expert bytes (each rank's weights less its experts); the
           coordinator reads nothing; every rank together reads each tensor once */
        uint64_t experts[16] = {0};
        for (int64_t i = 0; i < n; i++) {
            const k3_tensor_spec *t = &specs[i];
            for (int r = 1; t->kind == K3_TK_EXPERT && r < 7; r++) {
                int s = (r - 1) / 2, e = (r - 1) % 2;
                if (t->layer >= p.stage_begin[s] && t->layer < p.stage_begin[s + 1] &&
                    t->expert / (tiny.n_experts / 2) == e)
                    experts[r] += spec_bytes(t);
            }
        }
        for (int r = 0; r < 7; r++) {
            uint64_t u = 0;
            K3_CHECK_OK(k3_plan_unique_weights(&tiny, &p, &r, 1, &u));
            K3_CHECK(u == want[r], "rank %d alone: unique %llu, weights %llu", r,
                     (unsigned long long)u, (unsigned long long)want[r]);
        }
        for (int s = 0; s < 3; s++) {
            const int pair[2] = {1 + 2 * s, 2 + 2 * s};
            uint64_t u = 0;
            const uint64_t dense = want[pair[0]] - experts[pair[0]];
            K3_CHECK(dense == want[pair[1]] - experts[pair[1]] && experts[pair[0]] > 0,
                     "stage %d: the lanes' non-expert bytes differ", s);
            K3_CHECK_OK(k3_plan_unique_weights(&tiny, &p, pair, 2, &u));
            K3_CHECK(u == dense + experts[pair[0]] + experts[pair[1]] &&
                         u < want[pair[0]] + want[pair[1]],
                     "stage %d lanes: unique %llu", s, (unsigned long long)u);
            /* what a node holding the pair holds once (k3_plan_node_shared, from the plan's own
               sizes) is what the catalogue walk finds read twice */
            const uint64_t once = k3_plan_node_shared(&p, pair, 2);
            K3_CHECK(once == dense && want[pair[0]] + want[pair[1]] - once == u,
                     "stage %d lanes: held once %llu, dense %llu", s, (unsigned long long)once,
                     (unsigned long long)dense);
            const int twice[3] = {pair[0], pair[0], 0}; /* a rank twice, the coordinator */
            K3_CHECK(k3_plan_node_shared(&p, twice, 3) == 0, "one lane and the coordinator");
        }
        {
            const int node[7] = {0, 1, 2, 3, 4, 5, 6}, bad[2] = {6, 7};
            uint64_t held = 0, u = 0;
            for (int r = 0; r < 7; r++) held += want[r];
            K3_CHECK_OK(k3_plan_unique_weights(&tiny, &p, node, 7, &u));
            K3_CHECK(held - k3_plan_node_shared(&p, node, 7) == u, "one node of 7: %llu vs %llu",
                     (unsigned long long)(held - k3_plan_node_shared(&p, node, 7)),
                     (unsigned long long)u);
            K3_CHECK(k3_plan_node_shared(&p, bad, 2) == 0,
                     "a rank outside the world counts nothing");
        }
        {
            const int all[8] = {0, 1, 2, 3, 4, 5, 6, 6}; /* a rank twice counts once */
            uint64_t u = 0;
            K3_CHECK_OK(k3_plan_unique_weights(&tiny, &p, all, 8, &u));
            K3_CHECK(u == total, "all ranks: unique %llu, checkpoint %llu", (unsigned long long)u,
                     (unsigned long long)total);
            const int bad = 7;
            K3_CHECK(k3_plan_unique_weights(&tiny, &p, &bad, 1, &u) == K3_ERR_ARG,
                     "rank 7 of 7 refused");
        }
        free(specs);
        k3_plan_free(&p);
    }

    /* contiguous map: each lane owns n/E consecutive experts on MoE layers, -1 elsewhere */
    {
        k3_plan p;
        K3_CHECK_OK(k3_plan_make(&tiny,
                                 &(k3_plan_req){.world = 4,
                                                .pp = 1,
                                                .ep = 4,
                                                .max_ctx = 64,
                                                .max_seqs_per_lane = 1,
                                                .max_tokens = 8},
                                 &p));
        for (int l = 0; l < tiny.n_layers; l++)
            for (int x = 0; x < tiny.n_experts; x++) {
                int want = k3_config_is_moe(&tiny, l) ? x / 4 : -1;
                K3_CHECK(k3_plan_owner_lane(&p, l, x) == want, "layer %d expert %d lane %d", l, x,
                         k3_plan_owner_lane(&p, l, x));
            }
        k3_plan_free(&p);
    }

    /* custom map honoured, incl. a lane with no expert on one layer and E not dividing n_experts */
    {
        char map[2048];
        int o = snprintf(map, sizeof map, "# test map\n*");
        for (int x = 0; x < tiny.n_experts; x++)
            o += snprintf(map + o, sizeof map - (size_t)o, " %d", x % 3);
        o += snprintf(map + o, sizeof map - (size_t)o, "\n5");
        for (int x = 0; x < tiny.n_experts; x++)
            o += snprintf(map + o, sizeof map - (size_t)o, ",%d", x < 2 ? 2 : 0);
        snprintf(map + o, sizeof map - (size_t)o, "  # layer 5: lane 1 owns nothing\n");
        k3_plan_req r = req_of(6, 2, 3, K3_COORD_SHARED);
        r.expert_map = map;
        r.expert_map_name = "map.txt";
        k3_plan p, q;
        K3_CHECK_OK(k3_plan_make(&tiny, &r, &p));
        for (int l = 1; l < tiny.n_layers; l++)
            for (int x = 0; x < tiny.n_experts; x++) {
                int want = l == 5 ? (x < 2 ? 2 : 0) : x % 3;
                K3_CHECK(k3_plan_owner_lane(&p, l, x) == want,
                         "map: layer %d expert %d lane %d want %d", l, x,
                         k3_plan_owner_lane(&p, l, x), want);
            }
        K3_CHECK(k3_plan_owner_lane(&p, 0, 0) == -1, "dense layer has owners");
        /* hash: equal inputs -> equal hash; a different map / split / mode -> different */
        K3_CHECK_OK(k3_plan_make(&tiny, &r, &q));
        K3_CHECK(p.hash == q.hash && p.hash == k3_plan_hash(&p), "same inputs, hashes %llx %llx",
                 (unsigned long long)p.hash, (unsigned long long)q.hash);
        k3_plan_free(&q);
        map[strlen("# test map\n* ")] = '1'; /* expert 0 -> lane 1 */
        K3_CHECK_OK(k3_plan_make(&tiny, &r, &q));
        K3_CHECK(q.hash != p.hash, "a different map gives the same hash");
        k3_plan_free(&q);
        K3_CHECK_OK(k3_plan_make(&tiny,
                                 &(k3_plan_req){.world = 7,
                                                .pp = 2,
                                                .ep = 3,
                                                .coord = K3_COORD_DEDICATED,
                                                .expert_map = map,
                                                .max_ctx = 512,
                                                .max_seqs_per_lane = 4,
                                                .max_tokens = 64},
                                 &q));
        K3_CHECK(q.hash != p.hash, "dedicated vs shared give the same hash");
        k3_plan_free(&q);
        k3_plan_free(&p);
    }

    /* invalid requests: clear errors naming the flag / line */
    k3_plan p;
    K3_CHECK_ERR(k3_plan_make(&tiny, &(k3_plan_req){.world = 4, .pp = 2, .ep = 1}, &p), K3_ERR_ARG,
                 "world has 4");
    K3_CHECK_ERR(
        k3_plan_make(&tiny,
                     &(k3_plan_req){.world = 4, .pp = 2, .ep = 2, .coord = K3_COORD_DEDICATED}, &p),
        K3_ERR_ARG, "dedicated");
    K3_CHECK_ERR(k3_plan_make(&tiny, &(k3_plan_req){.world = 9, .pp = 9, .ep = 1}, &p), K3_ERR_ARG,
                 "more stages than the model's 8 layers");
    K3_CHECK_ERR(k3_plan_make(&tiny, &(k3_plan_req){.world = 3, .pp = 1, .ep = 3}, &p), K3_ERR_ARG,
                 "does not divide n_experts = 16");
    K3_CHECK_ERR(k3_plan_make(&tiny, &(k3_plan_req){.world = 0, .pp = 0, .ep = 1}, &p), K3_ERR_ARG,
                 "--pp 0");
    K3_CHECK(p.expert_lane == NULL && p.mem == NULL, "failed plan leaves nothing allocated");
    struct {
        const char *map, *needle;
    } bad[] = {
        {"* 0 1\n", "map.txt:1: 2 lanes given, n_experts = 16"},
        {"* 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 7\n", "lane '7' is not in [0, 2)"},
        {"0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n", "layer 0 is not a MoE layer"},
        {"1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n", "MoE layer 2 has no line"},
        {"\n\n1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n",
         "map.txt:4: layer 1 listed twice"},
        {"x 0\n", "'x' is not a layer index"},
        {"* 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n", "more than n_experts"},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(bad); i++) {
        k3_plan_req r = req_of(2, 1, 2, K3_COORD_SHARED);
        r.expert_map = bad[i].map;
        r.expert_map_name = "map.txt";
        K3_CHECK_ERR(k3_plan_make(&tiny, &r, &p), K3_ERR_ARG, bad[i].needle);
    }
    /* review: huge --max-ctx / --max-tokens wrapped the uint64 byte estimates to small numbers
     * and the plan "succeeded"; now a clear error naming the flag */
    {
        k3_plan_req r = req_of(1, 1, 1, K3_COORD_SHARED);
        r.max_ctx = INT64_MAX;
        K3_CHECK_ERR(k3_plan_make(&tiny, &r, &p), K3_ERR_ARG,
                     "cache bytes overflow 64 bits (--max-ctx 9223372036854775807");
        K3_CHECK(p.mem == NULL && p.expert_lane == NULL, "failed plan leaves nothing allocated");
        r = req_of(1, 1, 1, K3_COORD_SHARED);
        r.max_tokens = INT64_MAX / 2;
        K3_CHECK_ERR(k3_plan_make(&tiny, &r, &p), K3_ERR_ARG,
                     "buffer bytes overflow 64 bits (--max-tokens");
        r = req_of(1, 1, 1, K3_COORD_SHARED);
        r.max_ctx = (int64_t)1 << 40;
        r.max_seqs_per_lane = 1 << 20;
        K3_CHECK_ERR(k3_plan_make(&tiny, &r, &p), K3_ERR_ARG, "--max-seqs 1048576 is too large");
        /* big but representable: the exact fp32 cache size of the tiny model, worked by hand:
         * 5 KDA layers x (conv 3 x (4-1) x 128 x 4 + state 4 x 32 x 32 x 4 = 20992 B)
         * + 3 MLA layers x ctx x (32 + 8) x 4 B, ctx = 2^30, x 3 sequences */
        r = req_of(1, 1, 1, K3_COORD_SHARED);
        r.max_ctx = (int64_t)1 << 30;
        r.max_seqs_per_lane = 3;
        K3_CHECK_OK(k3_plan_make(&tiny, &r, &p));
        uint64_t want = 3 * (5 * 20992ull + 3 * (1ull << 30) * 40 * 4);
        K3_CHECK(p.mem && p.mem[0].caches == want, "caches %llu, want %llu",
                 p.mem ? (unsigned long long)p.mem[0].caches : 0ull, (unsigned long long)want);
        k3_plan_free(&p);
    }
    k3_coord_mode cm;
    K3_CHECK_ERR(k3_coord_mode_parse("both", &cm), K3_ERR_ARG, "--coordinator");
    return k3_test_done("partition");
}
