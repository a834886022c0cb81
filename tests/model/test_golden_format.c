/* test_golden_format.c — k3's decode of a tiny checkpoint vs compressed-tensors/torch, bit for bit.
 * usage: test_model_golden MODEL_DIR GOLDEN_DIR
 * MODEL_DIR was made by `k3 make-tiny --seed 7` and its shard hashes already checked against the
 * manifest (golden_format.sh). Experts are decoded with k3_mxfp4_decode_row from the loaded
 * K3_DT_MXFP4 tensors, BF16 tensors with k3_bf16_to_f32, F32 as loaded; every value must have the
 * same bits as tests/reference/format_golden.py's output (both sides are exact: MXFP4 values are
 * E2M1 x 2^k, representable in bf16 and f32). Reports per tensor so a drift can be located. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>

#include "k3_model.h"
#include "k3_mxfp4.h"
#include "k3_test.h"

static const k3_tensor *find(const k3_weights_view *v, const char *name, int *kind) {
    int layer = -1, e = -1;
    char w[8] = "";
    *kind = 0;
    if (sscanf(name, "language_model.model.layers.%d.block_sparse_moe.experts.%d.%2s", &layer, &e,
               w) == 3) {
        const k3_expert_w *x = &v->layers[layer].experts[e];
        *kind = 1;
        return w[1] == '1' ? &x->w1 : w[1] == '2' ? &x->w2 : &x->w3;
    }
    if (strcmp(name, "language_model.model.norm.weight") == 0) return &v->final_norm;
    if (sscanf(name, "language_model.model.layers.%d.", &layer) != 1) return NULL;
    const k3_layer_w *L = &v->layers[layer];
    if (strstr(name, "mlp.gate_proj")) return &L->gate_proj;
    if (strstr(name, "q_a_proj")) return &L->q_a_proj;
    if (strstr(name, "dt_bias")) return &L->dt_bias;
    if (strstr(name, "q_conv1d")) return &L->q_conv;
    if (strstr(name, "e_score_correction_bias")) return &L->router_bias;
    if (strstr(name, "gate.weight")) return &L->router;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL_DIR GOLDEN_DIR\n", argv[0]);
        return 2;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/manifest.json", argv[2]);
    char *text = NULL;
    size_t n = 0;
    K3_CHECK_OK(k3_read_file(path, &text, &n));
    cJSON *man = text ? cJSON_Parse(text) : NULL;
    k3_free(text);
    K3_CHECK(man != NULL, "manifest");
    k3_config c;
    k3_ckpt *ck = NULL;
    k3_weights *w = NULL;
    K3_CHECK_OK(k3_config_load(argv[1], &c));
    K3_CHECK_OK(k3_ckpt_open(argv[1], &ck));
    k3_load_sel all = {.layer_begin = 0, .layer_end = c.n_layers, .embed = true, .head = true};
    if (ck) K3_CHECK_OK(k3_weights_load(ck, &c, &all, &w));
    if (!man || !w) return k3_test_done("model_golden_format");
    const k3_weights_view *v = k3_weights_get(w);
    const cJSON *t;
    int n_tensors = 0;
    cJSON_ArrayForEach(t, cJSON_GetObjectItem(man, "tensors")) {
        const char *name = cJSON_GetObjectItem(t, "name")->valuestring;
        int kind;
        const k3_tensor *x = find(v, name, &kind);
        K3_CHECK(x && x->data, "%s: not found in k3's loaded weights", name);
        if (!x || !x->data) continue;
        int64_t rows = x->shape[0], cols = x->ndim > 1 ? x->shape[1] : 1;
        if (x->ndim == 3) cols *= x->shape[2];
        int64_t ne = rows * cols;
        float *mine = malloc((size_t)ne * sizeof(float)), *ref = NULL;
        size_t nb = 0;
        snprintf(path, sizeof path, "%s/%s", argv[2], cJSON_GetObjectItem(t, "file")->valuestring);
        K3_CHECK_OK(k3_read_file(path, (char **)&ref, &nb));
        K3_CHECK(nb == (size_t)ne * 4, "%s: golden has %zu bytes, k3 %lld values", name, nb,
                 (long long)ne);
        if (ref && nb == (size_t)ne * 4) {
            if (kind == 1) {
                for (int64_t r = 0; r < rows; r++)
                    k3_mxfp4_decode_row((const uint8_t *)x->data + r * cols / 2,
                                        x->scale + r * cols / 32, cols, mine + r * cols);
            } else if (x->dtype == K3_DT_BF16) {
                for (int64_t i = 0; i < ne; i++)
                    mine[i] = k3_bf16_to_f32(((const uint16_t *)x->data)[i]);
            } else {
                memcpy(mine, x->data, (size_t)ne * 4);
            }
            int64_t diff = 0, first = -1;
            for (int64_t i = 0; i < ne; i++)
                if (memcmp(&mine[i], &ref[i], 4) != 0) {
                    diff++;
                    if (first < 0) first = i;
                }
            K3_CHECK(diff == 0,
                     "%s: %lld of %lld values differ (first at %lld: k3 %g, reference %g)", name,
                     (long long)diff, (long long)ne, (long long)first,
                     first >= 0 ? (double)mine[first] : 0.0, first >= 0 ? (double)ref[first] : 0.0);
            printf("  %-72s %6lld values  %s\n", name, (long long)ne,
                   diff ? "DIFFERS" : "bit-exact");
            n_tensors++;
        }
        free(mine);
        k3_free(ref);
    }
    K3_CHECK(n_tensors >= 20, "only %d tensors compared", n_tensors);
    k3_weights_destroy(w);
    k3_ckpt_destroy(ck);
    cJSON_Delete(man);
    return k3_test_done("model_golden_format");
}
