/* tiny_model.h — test helper (header-only): make a tiny/small checkpoint with the k3 binary
 * (`$K3_BIN make-tiny DIR --preset P --seed S`, exactly as a user would) into a fresh temp dir,
 * load all of it in one process, and remove the dir afterwards. Used by the layers, invariance
 * and golden tests and the forward benchmark. */
#ifndef K3_TEST_TINY_MODEL_H
#define K3_TEST_TINY_MODEL_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "k3_layers.h"
#include "k3_model.h"

typedef struct tiny_model {
    char dir[256];
    bool own_dir; /* made here: removed by tiny_close */
    k3_config cfg;
    k3_ckpt *ck;
    k3_weights *w;
    const k3_weights_view *view;
} tiny_model;

/* Load every tensor of the checkpoint in DIR into be's memory (NULL: host memory). */
static inline k3_status tiny_open_dir_on(tiny_model *m, const char *dir, k3_backend *be) {
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    K3_TRY(k3_config_load(m->dir, &m->cfg));
    K3_TRY(k3_ckpt_open(m->dir, &m->ck));
    k3_load_sel sel = {
        .be = be, .layer_begin = 0, .layer_end = m->cfg.n_layers, .embed = true, .head = true};
    K3_TRY(k3_weights_load(m->ck, &m->cfg, &sel, &m->w));
    m->view = k3_weights_get(m->w);
    return K3_OK;
}

static inline k3_status tiny_open_dir(tiny_model *m, const char *dir) {
    return tiny_open_dir_on(m, dir, NULL);
}

/* Make the checkpoint with the k3 binary ($K3_BIN) into a new temp dir and load it (into be's
 * memory; NULL: host memory). */
static inline k3_status tiny_make_on(tiny_model *m, const char *preset, uint64_t seed,
                                     k3_backend *be) {
    memset(m, 0, sizeof *m);
    const char *bin = getenv("K3_BIN");
    if (!bin) return K3_ERR(K3_ERR_ARG, "K3_BIN is not set (run through ctest)");
    char tmpl[] = "/tmp/k3-test-model-XXXXXX";
    if (!mkdtemp(tmpl)) return K3_ERR(K3_ERR_IO, "mkdtemp failed");
    snprintf(m->dir, sizeof m->dir, "%s", tmpl);
    m->own_dir = true;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' make-tiny '%s' --preset %s --seed %llu", bin, m->dir, preset,
             (unsigned long long)seed);
    if (system(cmd) != 0) return K3_ERR(K3_ERR_IO, "'%s' failed", cmd);
    char dir[256];
    snprintf(dir, sizeof dir, "%s", m->dir);
    return tiny_open_dir_on(m, dir, be);
}
static inline k3_status tiny_make(tiny_model *m, const char *preset, uint64_t seed) {
    return tiny_make_on(m, preset, seed, NULL);
}

/* The params of one stage that holds the whole model (embedding to head) on be, its pools sized
 * for max_seqs sequences of max_ctx tokens and a paged cache of kv_tokens (0: max_seqs x
 * max_ctx). */
static inline k3_stage_params tiny_whole_stage(const tiny_model *m, k3_backend *be,
                                               int64_t max_tokens, int max_seqs, int64_t max_ctx,
                                               int64_t kv_tokens) {
    return (k3_stage_params){.cfg = &m->cfg,
                             .w = m->view,
                             .be = be,
                             .layer_begin = 0,
                             .layer_end = m->cfg.n_layers,
                             .first = true,
                             .last = true,
                             .max_tokens = max_tokens,
                             .max_seqs = max_seqs,
                             .max_ctx = max_ctx,
                             .kv_cache_tokens = kv_tokens};
}

static inline void tiny_close(tiny_model *m) {
    k3_weights_destroy(m->w);
    k3_ckpt_destroy(m->ck);
    if (m->own_dir && m->dir[0]) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", m->dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", m->dir);
    }
    memset(m, 0, sizeof *m);
}

#endif /* K3_TEST_TINY_MODEL_H */
