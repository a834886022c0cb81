/* metrics.c — the server's Prometheus metrics (GET /metrics, text format 0.0.4).
 *
 * Owns: the histogram buckets, the per-status request counts, a request's end into the counters
 * (srv_metrics_done) and the exposition text. The counters live in the server
 * (server_internal.h: srv_metrics, under its mutex); this file adds to them and prints a
 * snapshot. Every series carries model_name (the served name), so a vLLM dashboard reads it.
 * Names and meanings are vLLM's (docs/SERVING.md maps them), where vLLM has the quantity:
 *   vllm:num_requests_running, vllm:num_requests_waiting (gauges: in an engine slot / admitted
 *   and waiting for one), vllm:kv_cache_usage_perc (the paged cache's blocks reserved, 0..1),
 *   vllm:prompt_tokens_total, vllm:generation_tokens_total (counters over completed requests,
 *   as their usage counts them: a prompt once for its n choices), vllm:request_success_total
 *   {finished_reason = stop | length | abort}, histograms vllm:time_to_first_token_seconds,
 *   vllm:time_per_output_token_seconds (a request's mean gap after its first token),
 *   vllm:inter_token_latency_seconds (every gap), vllm:e2e_request_latency_seconds,
 *   vllm:request_queue_time_seconds (arrival to an engine slot), vllm:request_prefill_time_seconds
 *   (slot to first token), vllm:request_decode_time_seconds (first to last token),
 *   vllm:request_inference_time_seconds (slot to last token); vllm:gpu_cache_usage_perc (the
 *   older name of kv_cache_usage_perc, which vLLM's Grafana dashboard reads), and count histograms
 *   (bounds 1, 2, 5, 10, ... 1e6) vllm:request_prompt_tokens (a prompt once for its n choices, as
 *   the usage), vllm:request_generation_tokens (each completed choice),
 *   vllm:request_max_num_generation_tokens (per request: its longest choice) and
 *   vllm:request_params_n (per request: its n), the last two once every choice has ended.
 * k3's own: k3_requests_total{endpoint,status} (HTTP answers), k3_requests_failed_total,
 * k3_cancelled_prompt_tokens_total and k3_cancelled_generation_tokens_total (requests a client
 * or the shutdown cancelled: apart from the vLLM token counters), k3_engine_prompt_tokens_total
 * (prompt tokens the engine actually ran: prefix-cache hits and the forks of n > 1 not again),
 * k3_forks_total (choices that forked their prompt's prefill), vllm:num_preemptions_total,
 * k3_step_seconds{rank="0"} (histogram: rank 0's engine steps),
 * k3_rank_step_seconds{rank,stage,lane} (a summary: every worker rank's time in its forward steps,
 * from the LOGITS messages). The prefix cache (when on; docs/DESIGN.md §3c), in prompt tokens as
 * vLLM counts them: vllm:prefix_cache_queries_total (of the requests that started),
 * vllm:prefix_cache_hits_total (of those, found cached), and k3's k3_prefix_cache_usage_ratio
 * (blocks the cache holds / its budget, all lanes). */
#include "server_internal.h"

#include <stddef.h>
#include <stdio.h>

const double srv_hist_bounds[SRV_N_BUCKETS] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                               0.5,   1,     2.5,  5,     10,   30,  60};

void srv_hist_add(srv_hist *h, double seconds) {
    int b = 0;
    while (b < SRV_N_BUCKETS && seconds > srv_hist_bounds[b]) b++;
    h->count[b]++;
    h->sum += seconds;
    h->n++;
}

static void chist_add(srv_chist *h, double v) {
    int b = 0;
    for (double bound = 1; b < SRV_N_CBUCKETS && v > bound; b++)
        bound *= (b % 3 == 1) ? 2.5 : 2; /* 1, 2, 5, 10, 20, 50, ... */
    h->count[b]++;
    h->sum += v;
    h->n++;
}

void srv_metrics_request(srv_metrics *m, const sreq *head) {
    int64_t most = 0, n = 0;
    for (const sreq *c = head; c; c = c->sib) {
        if (!c->done) return;
        most = K3_MAX(most, c->n_gen);
        n += c->prompt_i == 0;
    }
    chist_add(&m->max_gen, (double)most);
    chist_add(&m->params_n, (double)n);
}

void srv_count_status(srv_metrics *m, const char *path, int status) {
    for (int i = 0; i < SRV_N_STATUS; i++) {
        if (m->status_code[i] == 0) m->status_code[i] = status, m->status_path[i] = path;
        if (m->status_code[i] == status && strcmp(m->status_path[i], path) == 0) {
            m->status_count[i]++;
            return;
        }
    }
}

static k3_status put(k3_chat_buf *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static k3_status put(k3_chat_buf *o, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    K3_ASSERT(n >= 0 && n < (int)sizeof line);
    return k3_chat_buf_put(o, line, (size_t)n);
}

static k3_status head(k3_chat_buf *o, const char *name, const char *type, const char *help) {
    K3_TRY(put(o, "# HELP %s %s\n", name, help));
    return put(o, "# TYPE %s %s\n", name, type);
}

static k3_status hist(k3_chat_buf *o, const char *name, const char *labels, const char *help,
                      const srv_hist *h) {
    K3_TRY(head(o, name, "histogram", help));
    uint64_t cum = 0;
    for (int b = 0; b <= SRV_N_BUCKETS; b++) {
        cum += h->count[b];
        char le[32];
        if (b < SRV_N_BUCKETS)
            snprintf(le, sizeof le, "%g", srv_hist_bounds[b]);
        else
            snprintf(le, sizeof le, "+Inf");
        K3_TRY(put(o, "%s_bucket{%s%sle=\"%s\"} %llu\n", name, labels, *labels ? "," : "", le,
                   (unsigned long long)cum));
    }
    const char *open = *labels ? "{" : "", *close = *labels ? "}" : "";
    K3_TRY(put(o, "%s_sum%s%s%s %.9g\n", name, open, labels, close, h->sum));
    return put(o, "%s_count%s%s%s %llu\n", name, open, labels, close, (unsigned long long)h->n);
}

/* A count histogram (1-2-5 bounds). */
static k3_status chist(k3_chat_buf *o, const char *name, const char *mn, const char *help,
                       const srv_chist *h) {
    K3_TRY(head(o, name, "histogram", help));
    uint64_t cum = 0;
    double bound = 1;
    for (int b = 0; b <= SRV_N_CBUCKETS; b++) {
        cum += h->count[b];
        char le[32];
        if (b < SRV_N_CBUCKETS)
            snprintf(le, sizeof le, "%.1f", bound);
        else
            snprintf(le, sizeof le, "+Inf");
        bound *= (b % 3 == 1) ? 2.5 : 2;
        K3_TRY(put(o, "%s_bucket{%s,le=\"%s\"} %llu\n", name, mn, le, (unsigned long long)cum));
    }
    K3_TRY(put(o, "%s_sum{%s} %.9g\n", name, mn, h->sum));
    return put(o, "%s_count{%s} %llu\n", name, mn, (unsigned long long)h->n);
}

void srv_metrics_done(srv_metrics *m, const sreq *q) {
    const uint64_t n_prompt = q->sib_copy ? 0 : (uint64_t)q->n_prompt; /* as the usage counts */
    if (q->failed) {
        m->n_failed++;
        return;
    }
    if (q->cancel && q->stop == K3_STOP_NONE) { /* a client went away, or the shutdown */
        m->n_cancelled++;
        m->cancelled_prompt_tokens += n_prompt;
        m->cancelled_gen_tokens += (uint64_t)q->n_gen;
        return;
    }
    m->prompt_tokens += n_prompt;
    m->generation_tokens += (uint64_t)q->n_gen;
    if (!q->sib_copy) chist_add(&m->prompt_len, (double)q->n_prompt);
    chist_add(&m->gen_len, (double)q->n_gen);
    *(q->stop == K3_STOP_NONE ? &m->n_length : &m->n_stop) += 1;
    const double t_slot = (q->t_submit > 0 ? q->t_submit : q->t_arrive) + q->queued_s;
    srv_hist_add(&m->e2e, q->t_done - q->t_arrive);
    srv_hist_add(&m->queue, t_slot - q->t_arrive);
    srv_hist_add(&m->inference, q->t_done - t_slot);
    if (q->n_gen > 0) {
        srv_hist_add(&m->ttft, q->t_first - q->t_arrive);
        srv_hist_add(&m->prefill, q->t_first - t_slot);
        srv_hist_add(&m->decode, q->t_done - q->t_first);
    }
    if (q->n_gen > 1) srv_hist_add(&m->tpot, (q->t_done - q->t_first) / (double)(q->n_gen - 1));
}

/* A label value in Prometheus' text format: backslash, quote and newline escaped. */
static void label_value(const char *v, char *out, size_t n) {
    size_t k = 0;
    for (; *v && k + 3 < n; v++) {
        if (*v == '\\' || *v == '"') out[k++] = '\\';
        if (*v == '\n') {
            out[k++] = '\\', out[k++] = 'n';
            continue;
        }
        out[k++] = *v;
    }
    out[k] = 0;
}

static k3_status gauge(k3_chat_buf *o, const char *mn, const char *name, const char *help,
                       double v) {
    K3_TRY(head(o, name, "gauge", help));
    return put(o, "%s{%s} %.9g\n", name, mn, v);
}

/* The prefix cache (docs/DESIGN.md §3c): vLLM's prefix_cache_queries / prefix_cache_hits. */
static k3_status prefix_text(const srv_metrics *m, const char *mn, k3_chat_buf *o) {
    if (!m->prefix_on) return K3_OK;
    K3_TRY(head(o, "vllm:prefix_cache_queries_total", "counter",
                "prompt tokens looked up in the prefix cache (requests that started)"));
    K3_TRY(put(o, "vllm:prefix_cache_queries_total{%s} %lld\n", mn, (long long)m->prefix_queries));
    K3_TRY(head(o, "vllm:prefix_cache_hits_total", "counter",
                "prompt tokens found in the prefix cache (not run again)"));
    K3_TRY(put(o, "vllm:prefix_cache_hits_total{%s} %lld\n", mn, (long long)m->prefix_hits));
    return gauge(o, mn, "k3_prefix_cache_usage_ratio",
                 "paged cache blocks the prefix cache holds / its budget (all lanes)",
                 m->prefix_blocks_max > 0 ? (double)m->prefix_blocks / m->prefix_blocks_max : 0.0);
}

k3_status srv_metrics_text(const srv_metrics *m, int slots, k3_chat_buf *o) {
    (void)slots;
    char esc[300], mn[320];
    label_value(m->model_name ? m->model_name : "", esc, sizeof esc);
    snprintf(mn, sizeof mn, "model_name=\"%s\"", esc);
    K3_TRY(gauge(o, mn, "vllm:num_requests_running", "requests in an engine slot", m->running));
    K3_TRY(gauge(o, mn, "vllm:num_requests_waiting",
                 "requests admitted and waiting for an engine slot",
                 m->waiting + K3_MAX(m->admitted - m->pending, 0)));
    K3_TRY(gauge(o, mn, "vllm:kv_cache_usage_perc",
                 "share of the paged cache's blocks reserved by running requests (0..1)",
                 m->cache_usage));
    K3_TRY(gauge(o, mn, "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc under its older name (vLLM's Grafana dashboard)",
                 m->cache_usage));
    const struct {
        const char *name, *help;
        uint64_t v;
    } counters[] = {
        {"vllm:prompt_tokens_total",
         "prompt tokens of completed requests (a prompt once for its n choices)", m->prompt_tokens},
        {"vllm:generation_tokens_total", "generated tokens of completed requests",
         m->generation_tokens},
        {"k3_requests_failed_total", "requests that ended with an error", m->n_failed},
        {"k3_cancelled_prompt_tokens_total",
         "prompt tokens of cancelled requests (not in vllm:prompt_tokens_total)",
         m->cancelled_prompt_tokens},
        {"k3_cancelled_generation_tokens_total",
         "tokens generated for cancelled requests (not in vllm:generation_tokens_total)",
         m->cancelled_gen_tokens},
        {"k3_engine_prompt_tokens_total",
         "prompt tokens the engine ran through the model (prefix-cache hits and the forked "
         "copies of n > 1 are not run again)",
         (uint64_t)m->engine_prompt_tokens},
        {"k3_forks_total", "choices of n > 1 that forked their prompt's prefill",
         (uint64_t)m->forks},
        {"vllm:num_preemptions_total",
         "running requests preempted: their cache blocks freed, recomputed later",
         (uint64_t)m->preemptions},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(counters); i++) {
        K3_TRY(head(o, counters[i].name, "counter", counters[i].help));
        K3_TRY(put(o, "%s{%s} %llu\n", counters[i].name, mn, (unsigned long long)counters[i].v));
    }
    K3_TRY(head(o, "vllm:request_success_total", "counter", "finished requests by how they ended"));
    const char *reason[3] = {"stop", "length", "abort"};
    const uint64_t by[3] = {m->n_stop, m->n_length, m->n_cancelled};
    for (int i = 0; i < 3; i++)
        K3_TRY(put(o, "vllm:request_success_total{%s,finished_reason=\"%s\"} %llu\n", mn, reason[i],
                   (unsigned long long)by[i]));
    static const struct {
        const char *name, *help;
        size_t off;
    } hists[] = {
        {"vllm:time_to_first_token_seconds", "arrival to first token", offsetof(srv_metrics, ttft)},
        {"vllm:time_per_output_token_seconds",
         "a request's mean gap between tokens after the first", offsetof(srv_metrics, tpot)},
        {"vllm:inter_token_latency_seconds", "each gap between two tokens of a request",
         offsetof(srv_metrics, itl)},
        {"vllm:e2e_request_latency_seconds", "arrival to the last token",
         offsetof(srv_metrics, e2e)},
        {"vllm:request_queue_time_seconds", "arrival to an engine slot",
         offsetof(srv_metrics, queue)},
        {"vllm:request_prefill_time_seconds", "engine slot to first token",
         offsetof(srv_metrics, prefill)},
        {"vllm:request_decode_time_seconds", "first token to last token",
         offsetof(srv_metrics, decode)},
        {"vllm:request_inference_time_seconds", "engine slot to last token",
         offsetof(srv_metrics, inference)},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(hists); i++)
        K3_TRY(hist(o, hists[i].name, mn, hists[i].help,
                    (const srv_hist *)(const void *)((const char *)m + hists[i].off)));
    static const struct {
        const char *name, *help;
        size_t off;
    } chists[] = {
        {"vllm:request_prompt_tokens", "prompt tokens of a completed request (a prompt once)",
         offsetof(srv_metrics, prompt_len)},
        {"vllm:request_generation_tokens", "tokens a completed choice generated",
         offsetof(srv_metrics, gen_len)},
        {"vllm:request_max_num_generation_tokens",
         "the most tokens one choice of a request generated", offsetof(srv_metrics, max_gen)},
        {"vllm:request_params_n", "a request's n (choices per prompt)",
         offsetof(srv_metrics, params_n)},
    };
    for (size_t i = 0; i < K3_ARRAY_LEN(chists); i++)
        K3_TRY(chist(o, chists[i].name, mn, chists[i].help,
                     (const srv_chist *)(const void *)((const char *)m + chists[i].off)));
    K3_TRY(
        head(o, "k3_requests_total", "counter", "HTTP requests answered, by endpoint and status"));
    for (int i = 0; i < SRV_N_STATUS && m->status_code[i]; i++)
        K3_TRY(put(o, "k3_requests_total{%s,endpoint=\"%s\",status=\"%d\"} %llu\n", mn,
                   m->status_path[i], m->status_code[i], (unsigned long long)m->status_count[i]));
    char lab[400];
    snprintf(lab, sizeof lab, "%s,rank=\"0\"", mn);
    K3_TRY(hist(o, "k3_step_seconds", lab, "one engine step as rank 0 runs it", &m->step));
    K3_TRY(head(o, "k3_rank_step_seconds", "summary",
                "each worker rank's time inside its forward steps (MoE exchanges included)"));
    for (int w = 0; w < m->n_ranks; w++) {
        if (!m->rank_ok[w]) continue;
        snprintf(lab, sizeof lab, "%s,rank=\"%d\",stage=\"%d\",lane=\"%d\"", mn, w,
                 m->rank_stage[w], m->rank_lane[w]);
        K3_TRY(put(o, "k3_rank_step_seconds_sum{%s} %.9g\n", lab, m->rank_busy_s[w]));
        K3_TRY(put(o, "k3_rank_step_seconds_count{%s} %llu\n", lab,
                   (unsigned long long)m->rank_steps[w]));
    }
    return prefix_text(m, mn, o);
}
