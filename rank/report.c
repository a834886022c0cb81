/* report.c — the end of a run: the logits dump (.npy), the text lines and the JSON report
 * (timings, plan, bytes per rank, MoE traffic of both combine modes). */
#include "rank_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdlib.h>

/* ---- output ------------------------------------------------------------------------------- */
static k3_status write_npy(const char *path, const float *data, int64_t rows, int64_t cols) {
    char hdr[128];
    int n = snprintf(hdr, sizeof hdr,
                     "{'descr': '<f4', 'fortran_order': False, 'shape': (%lld, %lld), }",
                     (long long)rows, (long long)cols);
    int total = 10 + n + 1;
    int pad = (64 - total % 64) % 64;
    FILE *f = fopen(path, "wb");
    if (!f) return K3_ERR(K3_ERR_IO, "--dump-logits %s: %s", path, strerror(errno));
    uint16_t hl = (uint16_t)(n + pad + 1);
    unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
    bool ok = fwrite(magic, 1, 8, f) == 8 && fwrite(&hl, 2, 1, f) == 1 &&
              fwrite(hdr, 1, (size_t)n, f) == (size_t)n;
    for (int i = 0; i < pad && ok; i++) ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    ok = ok && fwrite(data, sizeof(float), (size_t)(rows * cols), f) == (size_t)(rows * cols);
    ok = (fclose(f) == 0) && ok;
    return ok ? K3_OK : K3_ERR(K3_ERR_IO, "--dump-logits %s: write failed", path);
}

static cJSON *ids_json(const int32_t *p, int64_t n) {
    cJSON *a = cJSON_CreateArray();
    for (int64_t i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(p[i]));
    return a;
}

static const char *seq_text(const seq_run *q) {
    return q->text.data ? q->text.data : "";
}

void rank_report(rank_ctx *r, const uint64_t *bytes, const uint64_t *load_us, double t_end) {
    const k3_rank_opts *o = r->o;
    int64_t V = r->cfg.vocab_size;
    if (o->dump_logits) {
        int64_t rows = 0;
        for (int i = 0; i < o->n_prompts; i++) rows += r->seqs[i].dump_rows;
        float *all = NULL;
        RTRY(r, k3_alloc((void **)&all, (size_t)K3_MAX(rows, 1) * (size_t)V * sizeof(float),
                         "logits dump"));
        int64_t off = 0;
        for (int i = 0; i < o->n_prompts; i++) {
            memcpy(all + off * V, r->seqs[i].dump,
                   (size_t)(r->seqs[i].dump_rows * V) * sizeof(float));
            off += r->seqs[i].dump_rows;
        }
        k3_status s = write_npy(o->dump_logits, all, rows, V);
        k3_free(all);
        RTRY(r, s);
    }
    int64_t n_prompt_tok = 0, n_gen_tok = 0;
    for (int i = 0; i < o->n_prompts; i++)
        n_prompt_tok += r->seqs[i].P, n_gen_tok += r->seqs[i].n_gen;
    double load_s = 0;
    for (int i = 0; i < r->world; i++) load_s = K3_MAX(load_s, load_us[i] / 1e6);
    double pre = (r->t_prefill_done > 0 ? r->t_prefill_done : t_end) - r->t_gen0,
           dec = t_end - (r->t_prefill_done > 0 ? r->t_prefill_done : t_end);
    int64_t n_dec = n_gen_tok - o->n_prompts * (o->n_new > 0);
    if (o->result) {
        k3_rank_result *res = o->result;
        RTRY(r, k3_calloc((void **)&res->seqs, (size_t)o->n_prompts * sizeof *res->seqs,
                          "run results"));
        res->n_seqs = o->n_prompts;
        for (int i = 0; i < o->n_prompts; i++) {
            seq_run *q = &r->seqs[i];
            k3_rank_seq_result *d = &res->seqs[i];
            RTRY(r, k3_alloc((void **)&d->gen, (size_t)K3_MAX(q->n_gen, 1) * sizeof(int32_t),
                             "run results"));
            memcpy(d->gen, q->gen, (size_t)q->n_gen * sizeof(int32_t));
            d->n_gen = q->n_gen;
            d->stop = q->stop;
            d->stop_string = q->stop_string;
            if (o->tok) {
                RTRY(r, k3_alloc((void **)&d->text, q->text.n + 1, "run results"));
                if (q->text.n) memcpy(d->text, q->text.data, q->text.n);
                d->text[q->text.n] = 0;
                d->n_text = q->text.n;
            }
        }
    }
    if (o->quiet) {
        K3_LOGI("load %.2f s, prefill %.3f s, decode %.3f s", load_s, pre, dec);
        return;
    }
    if (!o->json) {
        /* per prompt: one line of ids, then (with a tokenizer) the decoded text */
        for (int i = 0; i < o->n_prompts; i++) {
            for (int k = 0; k < r->seqs[i].n_gen; k++)
                printf("%s%d", k ? "," : "", r->seqs[i].gen[k]);
            printf("\n");
            if (o->tok) printf("%s\n", r->seqs[i].text.data ? r->seqs[i].text.data : "");
        }
        K3_LOGI("load %.2f s, prefill %.3f s (%.1f tok/s), decode %.3f s (%.1f tok/s), logits %.2f "
                "MB in %d messages",
                load_s, pre, pre > 0 ? n_prompt_tok / pre : 0.0, dec, dec > 0 ? n_dec / dec : 0.0,
                r->logits_bytes / 1e6, r->n_logits_msgs);
        if (r->plan.n_lanes > 1)
            K3_LOGI("MoE exchange (%s combine): dispatch %llu B, combine %llu B, %.0f B per step "
                    "(%llu steps)",
                    o->deterministic ? "deterministic per-item" : "pre-summed",
                    (unsigned long long)r->moe_dispatch_bytes,
                    (unsigned long long)r->moe_combine_bytes,
                    r->n_steps ? (double)(r->moe_dispatch_bytes + r->moe_combine_bytes) /
                                     (double)r->n_steps
                               : 0.0,
                    (unsigned long long)r->n_steps);
        return;
    }
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "prompt_ids", ids_json(r->seqs[0].prompt, r->seqs[0].P));
    cJSON_AddItemToObject(root, "generated_ids", ids_json(r->seqs[0].gen, r->seqs[0].n_gen));
    if (o->tok) cJSON_AddStringToObject(root, "text", seq_text(&r->seqs[0]));
    cJSON_AddStringToObject(root, "finish_reason", k3_rank_finish_reason(r->seqs[0].stop));
    cJSON *res = cJSON_AddArrayToObject(root, "results");
    for (int i = 0; i < o->n_prompts; i++) {
        cJSON *it = cJSON_CreateObject();
        cJSON_AddItemToObject(it, "prompt_ids", ids_json(r->seqs[i].prompt, r->seqs[i].P));
        cJSON_AddItemToObject(it, "generated_ids", ids_json(r->seqs[i].gen, r->seqs[i].n_gen));
        if (o->tok) cJSON_AddStringToObject(it, "text", seq_text(&r->seqs[i]));
        cJSON_AddStringToObject(it, "finish_reason", k3_rank_finish_reason(r->seqs[i].stop));
        cJSON_AddItemToArray(res, it);
    }
    cJSON *tm = cJSON_AddObjectToObject(root, "timings");
    cJSON_AddNumberToObject(tm, "load_s", load_s);
    cJSON_AddNumberToObject(tm, "prefill_s", pre);
    cJSON_AddNumberToObject(tm, "decode_s", dec);
    cJSON_AddNumberToObject(tm, "prefill_tok_s", pre > 0 ? n_prompt_tok / pre : 0);
    cJSON_AddNumberToObject(tm, "decode_tok_s", dec > 0 ? n_dec / dec : 0);
    cJSON *d = cJSON_AddObjectToObject(root, "dist");
    cJSON_AddNumberToObject(d, "world", r->world);
    cJSON_AddNumberToObject(d, "pp", r->plan.n_stages);
    cJSON_AddNumberToObject(d, "ep", r->plan.n_lanes);
    cJSON_AddStringToObject(d, "coordinator",
                            r->plan.coord == K3_COORD_DEDICATED ? "dedicated" : "shared");
    cJSON_AddBoolToObject(d, "deterministic", o->deterministic);
    char hx[24];
    snprintf(hx, sizeof hx, "%016llx", (unsigned long long)r->plan.hash);
    cJSON_AddStringToObject(d, "plan_hash", hx);
    cJSON_AddNumberToObject(d, "micro_batches", r->n_groups);
    cJSON_AddNumberToObject(d, "logits_bytes", (double)r->logits_bytes);
    cJSON_AddNumberToObject(d, "logits_messages", r->n_logits_msgs);
    cJSON_AddStringToObject(d, "combine", o->deterministic ? "per-item" : "presum");
    cJSON_AddNumberToObject(d, "moe_dispatch_bytes", (double)r->moe_dispatch_bytes);
    cJSON_AddNumberToObject(d, "moe_combine_bytes", (double)r->moe_combine_bytes);
    cJSON_AddNumberToObject(d, "steps", (double)r->n_steps);
    cJSON_AddNumberToObject(d, "moe_bytes_per_step",
                            r->n_steps ? (double)(r->moe_dispatch_bytes + r->moe_combine_bytes) /
                                             (double)r->n_steps
                                       : 0.0);
    cJSON *st = cJSON_AddArrayToObject(d, "stages");
    for (int s = 0; s < r->plan.n_stages; s++) {
        cJSON *a = cJSON_CreateArray();
        cJSON_AddItemToArray(a, cJSON_CreateNumber(r->plan.stage_begin[s]));
        cJSON_AddItemToArray(a, cJSON_CreateNumber(r->plan.stage_begin[s + 1]));
        cJSON_AddItemToArray(st, a);
    }
    cJSON *rk = cJSON_AddArrayToObject(d, "ranks");
    for (int i = 0; i < r->world; i++) {
        int s, e;
        k3_plan_coords(&r->plan, i, &s, &e);
        cJSON *it = cJSON_CreateObject();
        cJSON_AddNumberToObject(it, "rank", i);
        cJSON_AddNumberToObject(it, "stage", s);
        cJSON_AddNumberToObject(it, "lane", e);
        cJSON_AddNumberToObject(it, "bytes_read", (double)bytes[i]);
        cJSON_AddNumberToObject(it, "plan_weight_bytes", (double)r->plan.mem[i].weights);
        cJSON_AddNumberToObject(it, "load_s", load_us[i] / 1e6);
        cJSON_AddItemToArray(rk, it);
    }
    char *txt = cJSON_PrintUnformatted(root);
    if (txt) printf("%s\n", txt);
    cJSON_free(txt);
    cJSON_Delete(root);
}
