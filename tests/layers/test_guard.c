/* test_guard.c — the seam is real: the whole tiny model runs on the "guard" backend, whose
 * buffers (weights, sequence states, activations, scratch, logits) are PROT_NONE outside its own
 * ops and transfers. Any host code in layers/ or experts/ that touches one of them takes SIGSEGV
 * here. The logits must equal the cpu backend's bit for bit (guard runs the cpu ops), for a
 * prefill in chunks, a decode step, a batch of two sequences and a two-stage split.
 * The same check under mpirun (1 rank and 2x2, through `k3 run --backend guard`) is
 * tests/mpi/dist_run.py's guard case. */
#include "k3_layers.h"
#include "k3_test.h"
#include "layers/tiny_model.h"

typedef struct {
    k3_backend *be;
    tiny_model m;
} rig;

/* Prefill ids[0..n) in chunks of `chunk`, then one decode token per step up to n_all, for two
 * sequences sharing each step (seq B = the same ids shifted by 3). Logits of every step's last
 * rows -> host out [steps * 2, V]. Two stages split at `split` (0: one stage). */
static k3_status run(rig *g, const int32_t *ids, int n, int n_all, int chunk, int split, float *out,
                     int64_t *n_rows) {
    const k3_config *c = &g->m.cfg;
    k3_backend *be = g->be;
    const int64_t V = c->vocab_size;
    const int L = c->n_layers, n_st = split > 0 ? 2 : 1;
    k3_stage *st[2] = {NULL, NULL};
    k3_seq_state *ss[2][2] = {{NULL, NULL}, {NULL, NULL}};
    k3_activ act = {0};
    float *lg = NULL;
    k3_status e = K3_OK;
    for (int i = 0; i < n_st && e == K3_OK; i++) {
        k3_stage_params p = {.cfg = c,
                             .w = g->m.view,
                             .be = be,
                             .layer_begin = i == 0 ? 0 : split,
                             .layer_end = n_st == 1 || i == 1 ? L : split,
                             .first = i == 0,
                             .last = i == n_st - 1,
                             .max_tokens = 2 * chunk};
        e = k3_stage_create(&p, &st[i]);
        for (int q = 0; q < 2 && e == K3_OK; q++)
            e = k3_seq_state_create(st[i], n_all + 3, &ss[i][q]);
    }
    if (e == K3_OK) e = k3_activ_alloc(be, &act, c, 2 * chunk);
    if (e == K3_OK)
        e = k3_backend_alloc(be, (size_t)(2 * V) * sizeof(float), "logits", (void **)&lg);
    int64_t rows = 0;
    int32_t *cat = malloc(sizeof(int32_t) * 2 * (size_t)chunk);
    for (int p = 0; e == K3_OK && p < n_all;) {
        int32_t m = p < n ? K3_MIN(chunk, n - p) : 1;
        int32_t nt[2] = {m, m};
        memcpy(cat, ids + p, sizeof(int32_t) * (size_t)m);
        memcpy(cat + m, ids + p + 3, sizeof(int32_t) * (size_t)m);
        for (int i = 0; i < n_st && e == K3_OK; i++) {
            k3_seq_state *sq[2] = {ss[i][0], ss[i][1]};
            k3_batch b = {.n_seqs = 2, .states = sq, .n_tokens = nt, .token_ids = cat};
            e = k3_stage_forward(st[i], &b, &act, false, i == n_st - 1 ? lg : NULL);
        }
        if (e == K3_OK)
            e = k3_backend_download(be, out + rows * V, lg, (size_t)(2 * V) * sizeof(float));
        rows += 2;
        p += m;
    }
    free(cat);
    k3_backend_free(be, lg);
    k3_activ_free(be, &act);
    for (int i = 0; i < n_st; i++) {
        for (int q = 0; q < 2; q++) k3_seq_state_destroy(ss[i][q]);
        k3_stage_destroy(st[i]);
    }
    *n_rows = rows;
    return e;
}

int main(void) {
    rig cpu = {0}, guard = {0};
    K3_CHECK_OK(k3_backend_create("cpu", &(k3_backend_params){.n_threads = 2}, &cpu.be));
    K3_CHECK_OK(k3_backend_create("guard", &(k3_backend_params){.n_threads = 2}, &guard.be));
    if (!cpu.be || !guard.be) return k3_test_done("guard");
    K3_CHECK(!k3_backend_host_visible(guard.be) && k3_backend_host_visible(cpu.be),
             "guard memory must not be host-visible");
    k3_status st = tiny_make_on(&cpu.m, "tiny", 1, cpu.be);
    K3_CHECK_OK(st);
    if (st == K3_OK) K3_CHECK_OK(st = tiny_open_dir_on(&guard.m, cpu.m.dir, guard.be));
    if (st != K3_OK) return k3_test_done("guard");
    const k3_config *c = &cpu.m.cfg;
    const int64_t V = c->vocab_size;
    int32_t ids[64];
    k3_rng r;
    k3_rng_seed(&r, 777);
    for (int i = 0; i < 64; i++) ids[i] = (int32_t)(k3_rng_u64(&r) % (uint64_t)V);
    const int n = 23, n_all = 27, cases[2][2] = {{8, 0}, {5, c->n_layers / 2 + 1}};
    float *a = malloc(sizeof(float) * 64 * (size_t)V), *b = malloc(sizeof(float) * 64 * (size_t)V);
    for (int k = 0; k < 2; k++) {
        int64_t ra = 0, rb = 0;
        K3_CHECK_OK(run(&cpu, ids, n, n_all, cases[k][0], cases[k][1], a, &ra));
        K3_CHECK_OK(run(&guard, ids, n, n_all, cases[k][0], cases[k][1], b, &rb));
        bool same = ra == rb && ra > 0 && memcmp(a, b, sizeof(float) * (size_t)(ra * V)) == 0;
        bool finite = true;
        for (int64_t i = 0; i < ra * V; i++) finite = finite && isfinite(a[i]);
        K3_CHECK(same, "guard vs cpu (chunk %d, split %d): logits differ", cases[k][0],
                 cases[k][1]);
        K3_CHECK(finite && k3_rel_l2(a, a + V, (size_t)V) > 1e-3, "degenerate logits");
        printf("  guard backend, chunk %d, %s: %lld logits rows, bit-identical to cpu: %s\n",
               cases[k][0], cases[k][1] ? "2 stages" : "1 stage", (long long)ra,
               same ? "yes" : "NO");
    }
    free(a), free(b);
    k3_weights_destroy(guard.m.w);
    k3_ckpt_destroy(guard.m.ck);
    tiny_close(&cpu.m);
    k3_backend_destroy(guard.be);
    k3_backend_destroy(cpu.be);
    return k3_test_done("guard");
}
