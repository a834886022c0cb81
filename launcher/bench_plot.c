/* bench_plot.c — `k3 bench throughput|serve --plot FILE.svg`: the report's numbers as a plain SVG
 * image (no library, no script), two panels side by side.
 *
 *   throughput : tokens per second (total and output) against the concurrency: one pair of
 *                series per input x output length, a point per --max-concurrency (serve: one run
 *                without --max-concurrency is drawn at its --request-rate, else at its number of
 *                requests, all sent at once);
 *   latency    : TTFT, ITL and E2EL in ms at p50, p90 and p99 (one series per metric and sweep
 *                point, three points each).
 *
 * Each series is a <polyline class="series"> with a circle per point; its data-series attribute
 * names it and data-values holds the plotted numbers ("x,y x,y", x the concurrency or the
 * percentile) so that a reader (tests/bench_cli/plot_test.py) checks the picture against the
 * JSON. Axes start at 0 and end at a round number above the largest value, ticks at 1, 2 or 5
 * times a power of ten. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "bench.h"

#define W       1000 /* the image */
#define H       440
#define PANEL_W 470 /* each panel, its plot area inset by the margins below */
#define ML      64
#define MR      16
#define MT      40
#define MB      120 /* room for the x label and the legend */
#define MAX_SER 96

typedef struct plot_series {
    char name[96];
    double x[16], y[16];
    int n;
} plot_series;

typedef struct plot_panel {
    const char *id, *title, *xlabel, *ylabel;
    plot_series s[MAX_SER];
    int n;
    bool categorical; /* x = the percentiles 50, 90, 99, evenly spaced */
} plot_panel;

static bool row_num(const bench_row *r, const char *key, double *v) {
    for (int i = 0; i < r->n; i++)
        if (r->f[i].key && strcmp(r->f[i].key, key) == 0 && r->f[i].kind == BENCH_NUM) {
            *v = r->f[i].num;
            return true;
        }
    return false;
}

static plot_series *add_series(plot_panel *p, const char *name) {
    if (p->n == MAX_SER) return NULL;
    plot_series *s = &p->s[p->n++];
    memset(s, 0, sizeof *s);
    snprintf(s->name, sizeof s->name, "%s", name);
    return s;
}

static void add_point(plot_series *s, double x, double y) {
    if (s && s->n < (int)K3_ARRAY_LEN(s->x) && isfinite(x) && isfinite(y))
        s->x[s->n] = x, s->y[s->n++] = y;
}

/* A round axis end above v: 1, 2 or 5 x 10^k; and its tick step. */
static double nice_max(double v, double *step) {
    if (!(v > 0)) v = 1;
    const double p = pow(10, floor(log10(v)));
    const double m = v / p <= 1 ? 1 : v / p <= 2 ? 2 : v / p <= 5 ? 5 : 10;
    *step = m * p / (m == 2 ? 4 : 5);
    return m * p;
}

static const char *const colors[] = {"#2f6fdf", "#e07b00", "#1a7f37", "#c0262d",
                                     "#8a3ffc", "#007d79", "#a56eff", "#6f6f6f"};

static void text_esc(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '<')
            fputs("&lt;", f);
        else if (*s == '>')
            fputs("&gt;", f);
        else if (*s == '&')
            fputs("&amp;", f);
        else if (*s == '"')
            fputs("&quot;", f);
        else
            fputc(*s, f);
    }
}

static void panel_svg(FILE *f, const plot_panel *p, double x0) {
    double xmax = 0, ymax = 0, xstep, ystep;
    for (int i = 0; i < p->n; i++)
        for (int k = 0; k < p->s[i].n; k++)
            xmax = fmax(xmax, p->s[i].x[k]), ymax = fmax(ymax, p->s[i].y[k]);
    xmax = nice_max(xmax, &xstep);
    ymax = nice_max(ymax, &ystep);
    const double L = x0 + ML, R = x0 + PANEL_W - MR, T = MT, B = H - MB;
    static const double cats[3] = {50, 90, 99};
#define PX(v)                                                                                      \
    (p->categorical ? L + (R - L) * (0.15 + 0.35 * ((v) == 50   ? 0                                \
                                                    : (v) == 90 ? 1                                \
                                                                : 2))                              \
                    : L + (R - L) * (v) / xmax)
#define PY(v) (B - (B - T) * (v) / ymax)
    fprintf(f, "<g class=\"panel\" id=\"%s\">\n", p->id);
    fprintf(f, "<text x=\"%.1f\" y=\"24\" font-size=\"15\" font-weight=\"bold\">", L);
    text_esc(f, p->title);
    fputs("</text>\n", f);
    fprintf(
        f,
        "<line class=\"axis\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>\n",
        L, B, R, B);
    fprintf(
        f,
        "<line class=\"axis\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>\n",
        L, T, L, B);
    for (double v = 0; v <= ymax * (1 + 1e-9); v += ystep) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>", L,
                PY(v), R, PY(v));
        fprintf(f,
                "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" font-size=\"11\" "
                "text-anchor=\"end\">%g</text>\n",
                L - 4, PY(v) + 4, v);
    }
    if (p->categorical)
        for (int k = 0; k < 3; k++)
            fprintf(f,
                    "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" font-size=\"11\" "
                    "text-anchor=\"middle\">p%g</text>\n",
                    PX(cats[k]), B + 16, cats[k]);
    else
        for (double v = 0; v <= xmax * (1 + 1e-9); v += xstep)
            fprintf(f,
                    "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" font-size=\"11\" "
                    "text-anchor=\"middle\">%g</text>\n",
                    PX(v), B + 16, v);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"middle\">", (L + R) / 2,
            B + 34);
    text_esc(f, p->xlabel);
    fprintf(f,
            "</text>\n<text x=\"%.1f\" y=\"%.1f\" font-size=\"12\" text-anchor=\"middle\" "
            "transform=\"rotate(-90 %.1f %.1f)\">",
            x0 + 16, (T + B) / 2, x0 + 16, (T + B) / 2);
    text_esc(f, p->ylabel);
    fputs("</text>\n", f);
    for (int i = 0; i < p->n; i++) {
        const plot_series *s = &p->s[i];
        const char *c = colors[i % K3_ARRAY_LEN(colors)];
        fputs("<polyline class=\"series\" fill=\"none\" stroke-width=\"2\" data-series=\"", f);
        text_esc(f, s->name);
        fprintf(f, "\" stroke=\"%s\" data-values=\"", c);
        for (int k = 0; k < s->n; k++) fprintf(f, "%s%.17g,%.17g", k ? " " : "", s->x[k], s->y[k]);
        fputs("\" points=\"", f);
        for (int k = 0; k < s->n; k++)
            fprintf(f, "%s%.2f,%.2f", k ? " " : "", PX(s->x[k]), PY(s->y[k]));
        fputs("\"/>\n", f);
        for (int k = 0; k < s->n; k++)
            fprintf(f, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"3\" fill=\"%s\"/>\n", PX(s->x[k]),
                    PY(s->y[k]), c);
        /* the legend: two columns under the plot */
        const double lx = L + (i % 2) * (R - L) / 2, ly = B + 52 + 14 * (i / 2);
        if (ly < H - 4) {
            fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>", lx,
                    ly - 9, c);
            fprintf(f, "<text class=\"legend\" x=\"%.1f\" y=\"%.1f\" font-size=\"11\">", lx + 14,
                    ly);
            text_esc(f, s->name);
            fputs("</text>\n", f);
        }
    }
#undef PX
#undef PY
    fputs("</g>\n", f);
}

/* The x of a serve run: its concurrency, else (one run) its rate, else all its requests at once. */
static double serve_x(const bench_row *r, bool sweep, const char **label) {
    double v;
    if (row_num(r, "max_concurrency", &v)) return *label = "max concurrency", v;
    if (!sweep && row_num(r, "request_rate", &v)) return *label = "request rate (req/s)", v;
    row_num(r, "num_prompts", &v);
    return *label = "concurrency (all requests at once)", v;
}

static k3_status fill(const bench_report *rep, plot_panel *tp, plot_panel *lat) {
    const bool serve = strcmp(rep->mode, "serve") == 0;
    tp->xlabel = "concurrency (requests in flight at most)";
    for (int i = 0; i < rep->n_rows; i++) {
        const bench_row *r = &rep->rows[i];
        double in = 0, out = 0, x = 0;
        row_num(r, "input_len", &in), row_num(r, "output_len", &out);
        if (serve) x = serve_x(r, rep->n_rows > 1, &tp->xlabel);
        if (!serve) row_num(r, "max_concurrency", &x);
        /* the throughput series of this (input, output) pair: found or new */
        char nt[96], no[96];
        snprintf(nt, sizeof nt, "total tok/s (in %g, out %g)", in, out);
        snprintf(no, sizeof no, "output tok/s (in %g, out %g)", in, out);
        plot_series *st = NULL, *so = NULL;
        for (int k = 0; k < tp->n; k++) {
            if (strcmp(tp->s[k].name, nt) == 0) st = &tp->s[k];
            if (strcmp(tp->s[k].name, no) == 0) so = &tp->s[k];
        }
        if (!st) st = add_series(tp, nt);
        if (!so) so = add_series(tp, no);
        double vt = NAN, vo = NAN;
        row_num(r, serve ? "total_token_throughput" : "tokens_per_second", &vt);
        row_num(r, serve ? "output_throughput" : "output_tokens_per_second", &vo);
        add_point(st, x, vt), add_point(so, x, vo);
        static const char *const metric[3] = {"ttft", "itl", "e2el"}, *const up[3] = {"TTFT", "ITL",
                                                                                      "E2EL"};
        for (int m = 0; m < 3; m++) {
            char name[96], key[3][32];
            if (rep->n_rows == 1)
                snprintf(name, sizeof name, "%s", up[m]);
            else
                snprintf(name, sizeof name, "%s (c %g, in %g, out %g)", up[m], x, in, out);
            snprintf(key[0], sizeof key[0], "median_%s_ms", metric[m]);
            snprintf(key[1], sizeof key[1], "p90_%s_ms", metric[m]);
            snprintf(key[2], sizeof key[2], "p99_%s_ms", metric[m]);
            plot_series *s = add_series(lat, name);
            static const double pc[3] = {50, 90, 99};
            for (int k = 0; k < 3; k++) {
                double v;
                if (row_num(r, key[k], &v)) add_point(s, pc[k], v);
            }
        }
    }
    return K3_OK;
}

k3_status bench_plot_svg(const bench_report *rep, const char *path) {
    plot_panel *p = NULL;
    K3_TRY(k3_calloc((void **)&p, 2 * sizeof *p, "plot"));
    p[0] = (plot_panel){.id = "throughput", .title = "throughput", .ylabel = "tokens / s"};
    p[1] = (plot_panel){.id = "latency",
                        .title = "latency percentiles",
                        .xlabel = "percentile",
                        .ylabel = "ms",
                        .categorical = true};
    k3_status st = fill(rep, &p[0], &p[1]);
    FILE *f = st == K3_OK ? fopen(path, "w") : NULL;
    if (st == K3_OK && !f)
        st = K3_ERR(K3_ERR_IO, "--plot %s: cannot write: %s", path, strerror(errno));
    if (f) {
        fprintf(
            f,
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" "
            "width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n",
            W, H, W, H);
        fprintf(f, "<title>k3 bench %s</title>\n<rect width=\"%d\" height=\"%d\" fill=\"#fff\"/>\n",
                rep->mode, W, H);
        panel_svg(f, &p[0], 0);
        panel_svg(f, &p[1], PANEL_W + 30);
        fputs("</svg>\n", f);
        if (ferror(f) | fclose(f))
            st = K3_ERR(K3_ERR_IO, "--plot %s: write failed: %s", path, strerror(errno));
    }
    k3_free(p);
    return st;
}
