/* metrics.c — the server's Prometheus metrics (GET /metrics, text format 0.0.4).
 *
 * Owns: the histogram buckets, the per-status request counts and the exposition text. The
 * counters live in the server (server_internal.h: srv_metrics, under its mutex); this file only
 * adds to them and prints a snapshot.
 * Names: k3_requests_total{endpoint,status} (endpoint: a route, or "other"),
 * k3_prompt_tokens_total, k3_generation_tokens_total, k3_time_to_first_token_seconds,
 * k3_time_per_output_token_seconds, k3_e2e_request_latency_seconds, k3_step_seconds{rank="0"}
 * (histograms: rank 0's engine steps, the pipeline's pace as the coordinator sees it),
 * k3_rank_step_seconds{rank,stage,lane} (a summary, _sum and _count: every worker rank's time in
 * its forward steps, reported to rank 0 inside the LOGITS messages), k3_num_requests_running,
 * k3_num_requests_waiting, k3_slot_usage_ratio. */
#include "server_internal.h"

#include <stdio.h>

/* Bucket upper bounds in seconds; the last bucket (+Inf) is implicit. */
static const double bounds[SRV_N_BUCKETS] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                             0.5,   1,     2.5,  5,     10,   30,  60};

void srv_hist_add(srv_hist *h, double seconds) {
    int b = 0;
    while (b < SRV_N_BUCKETS && seconds > bounds[b]) b++;
    h->count[b]++;
    h->sum += seconds;
    h->n++;
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
            snprintf(le, sizeof le, "%g", bounds[b]);
        else
            snprintf(le, sizeof le, "+Inf");
        K3_TRY(put(o, "%s_bucket{%s%sle=\"%s\"} %llu\n", name, labels, *labels ? "," : "", le,
                   (unsigned long long)cum));
    }
    const char *open = *labels ? "{" : "", *close = *labels ? "}" : "";
    K3_TRY(put(o, "%s_sum%s%s%s %.9g\n", name, open, labels, close, h->sum));
    return put(o, "%s_count%s%s%s %llu\n", name, open, labels, close, (unsigned long long)h->n);
}

k3_status srv_metrics_text(const srv_metrics *m, int slots, k3_chat_buf *o) {
    K3_TRY(
        head(o, "k3_requests_total", "counter", "HTTP requests answered, by endpoint and status"));
    for (int i = 0; i < SRV_N_STATUS && m->status_code[i]; i++)
        K3_TRY(put(o, "k3_requests_total{endpoint=\"%s\",status=\"%d\"} %llu\n", m->status_path[i],
                   m->status_code[i], (unsigned long long)m->status_count[i]));
    K3_TRY(head(o, "k3_prompt_tokens_total", "counter", "prompt tokens of finished requests"));
    K3_TRY(put(o, "k3_prompt_tokens_total %llu\n", (unsigned long long)m->prompt_tokens));
    K3_TRY(head(o, "k3_generation_tokens_total", "counter", "generated tokens"));
    K3_TRY(put(o, "k3_generation_tokens_total %llu\n", (unsigned long long)m->generation_tokens));
    K3_TRY(hist(o, "k3_time_to_first_token_seconds", "", "arrival to first token", &m->ttft));
    K3_TRY(hist(o, "k3_time_per_output_token_seconds", "",
                "mean time between tokens after the first, per request", &m->tpot));
    K3_TRY(hist(o, "k3_e2e_request_latency_seconds", "", "arrival to the last event", &m->e2e));
    K3_TRY(hist(o, "k3_step_seconds", "rank=\"0\"", "one engine step as rank 0 runs it", &m->step));
    K3_TRY(head(o, "k3_rank_step_seconds", "summary",
                "each worker rank's time inside its forward steps (MoE exchanges included)"));
    for (int w = 0; w < m->n_ranks; w++) {
        if (!m->rank_ok[w]) continue;
        char lab[96];
        snprintf(lab, sizeof lab, "rank=\"%d\",stage=\"%d\",lane=\"%d\"", w, m->rank_stage[w],
                 m->rank_lane[w]);
        K3_TRY(put(o, "k3_rank_step_seconds_sum{%s} %.9g\n", lab, m->rank_busy_s[w]));
        K3_TRY(put(o, "k3_rank_step_seconds_count{%s} %llu\n", lab,
                   (unsigned long long)m->rank_steps[w]));
    }
    /* the engine places a request in a free slot at once, so at most `slots` run */
    const int running = K3_MIN(m->pending, slots), waiting = m->pending - running;
    K3_TRY(head(o, "k3_num_requests_running", "gauge", "sequences in a slot"));
    K3_TRY(put(o, "k3_num_requests_running %d\n", running));
    K3_TRY(head(o, "k3_num_requests_waiting", "gauge",
                "requests admitted but not yet in a slot (engine queue + admission queue)"));
    K3_TRY(put(o, "k3_num_requests_waiting %d\n", waiting + K3_MAX(m->admitted - m->pending, 0)));
    K3_TRY(head(o, "k3_slot_usage_ratio", "gauge", "busy sequence slots / all slots"));
    return put(o, "k3_slot_usage_ratio %.6g\n", slots > 0 ? (double)running / slots : 0.0);
}
