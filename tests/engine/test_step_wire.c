/* test_step_wire.c — the step message's one layout (rank/wire.h rank_step, issue 42): 2000 random
 * messages (every section with a random count, 0 included, and random words) encode to
 * rank_step_words words and decode to the same header (n_pad, graph_fell and moe_host too) and
 * sections, each a typed array that points into the encoded words; a cut message, one word too
 * many, and a negative count are refused (K3_ERR_FORMAT). Seeded from a printed seed. */
#include "k3_test.h"
#include "rank_internal.h"

#include <stdlib.h>
#include <string.h>

enum { MAXN = 24 };

/* Random words for a section of n elements of `words` int32 each. */
static int32_t *fill(k3_rng *g, int n, int words) {
    int32_t *a = malloc((size_t)K3_MAX(n * words, 1) * sizeof *a);
    for (int i = 0; i < n * words; i++) a[i] = (int32_t)k3_rng_u64(g);
    return a;
}

int main(void) {
    const uint64_t seed = 4210;
    printf("test_step_wire seed %llu\n", (unsigned long long)seed);
    k3_rng g;
    k3_rng_seed(&g, seed);
    int bad = 0;
    for (int it = 0; it < 2000 && !bad; it++) {
        rank_step m = {.group = (int32_t)k3_rng_u64(&g),
                       .step = (int32_t)k3_rng_u64(&g),
                       .all_logits = (int32_t)(k3_rng_u64(&g) % 2),
                       .n_pad = (int32_t)(k3_rng_u64(&g) % 65),
                       .graph_fell = (int32_t)(k3_rng_u64(&g) % 2),
                       .moe_host = (int32_t)(k3_rng_u64(&g) % 2)};
        int32_t *own[16];
        int n_own = 0;
#define FILL(name, type)                                                                           \
    m.n_##name = (int32_t)(k3_rng_u64(&g) % (MAXN + 1)) * (k3_rng_u64(&g) % 4 != 0);               \
    own[n_own] = fill(&g, m.n_##name, (int)(sizeof(type) / 4));                                    \
    m.name = (const type *)(const void *)own[n_own++];
        RANK_STEP_SECTIONS(FILL)
#undef FILL
        const int64_t n = rank_step_words(&m);
        int32_t *w = malloc((size_t)(n + 1) * sizeof *w);
        rank_step_encode(&m, w);
        rank_step d;
        K3_CHECK_OK(rank_step_decode(w, n, &d, "test"));
        bad |= d.group != m.group || d.step != m.step || d.all_logits != m.all_logits ||
               d.n_pad != m.n_pad || d.graph_fell != m.graph_fell || d.moe_host != m.moe_host;
#define SAME(name, type)                                                                           \
    bad |= d.n_##name != m.n_##name ||                                                             \
           (m.n_##name > 0 && (memcmp(d.name, m.name, (size_t)m.n_##name * sizeof(type)) != 0 ||   \
                               (const int32_t *)(const void *)d.name < w ||                        \
                               (const int32_t *)(const void *)(d.name + d.n_##name) > w + n));
        RANK_STEP_SECTIONS(SAME)
#undef SAME
        K3_CHECK(!bad, "message %d: decoded differently from what was encoded", it);
        K3_CHECK_ERR(rank_step_decode(w, n - 1, &d, "test"), K3_ERR_FORMAT, "words, not");
        w[n] = 0;
        K3_CHECK_ERR(rank_step_decode(w, n + 1, &d, "test"), K3_ERR_FORMAT, "words, not");
        w[6 + (int)(k3_rng_u64(&g) % 11)] = -1; /* a section count (after 6 header words) */
        K3_CHECK_ERR(rank_step_decode(w, n, &d, "test"), K3_ERR_FORMAT, "words, not");
        K3_CHECK_ERR(rank_step_decode(w, 4, &d, "test"), K3_ERR_FORMAT, "less than its header");
        for (int i = 0; i < n_own; i++) free(own[i]);
        free(w);
    }
    return k3_test_done("step_wire");
}
