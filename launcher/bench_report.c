/* bench_report.c — the report of `k3 bench` (bench.h): rows of named values, the metadata of the
 * machine and the build, summary statistics, and the three outputs (markdown on stdout, JSON,
 * CSV).
 * Nested rows (BENCH_ROWS, e.g. the ranks of one load) go to JSON as objects and to the markdown
 * as tables of their own below the main table; CSV leaves them out, like arrays.
 *
 * Owns: how a value prints in each output. Numbers go to JSON as numbers (cJSON), to CSV with
 * %.17g (round-trips), to the table with the field's own decimals. Strings are escaped for CSV
 * ("" doubling) and for markdown (| escaped).
 * The git commit and version are compiled in (k3_build_commit, k3_build_version: bench.h). */
#include "bench.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* ---- rows ------------------------------------------------------------------------------------ */
static k3_status next_field(bench_row *r, const char *key, const char *label, bench_kind kind,
                            bench_field **out) {
    if (r->n >= BENCH_MAX_FIELDS)
        return K3_ERR(K3_ERR_INTERNAL, "bench: more than %d fields in a row (at '%s')",
                      BENCH_MAX_FIELDS, key);
    bench_field *f = &r->f[r->n++];
    memset(f, 0, sizeof *f);
    f->key = key, f->label = label, f->kind = kind;
    *out = f;
    return K3_OK;
}

k3_status bench_put_num(bench_row *r, const char *key, const char *label, int prec, double v) {
    bench_field *f = NULL;
    K3_TRY(next_field(r, key, label, BENCH_NUM, &f));
    f->num = v, f->prec = prec;
    return K3_OK;
}

k3_status bench_put_str(bench_row *r, const char *key, const char *label, const char *s) {
    bench_field *f = NULL;
    K3_TRY(next_field(r, key, label, BENCH_STR, &f));
    size_t n = strlen(s);
    K3_TRY(k3_alloc((void **)&f->str, n + 1, "bench field"));
    memcpy(f->str, s, n + 1);
    return K3_OK;
}

k3_status bench_put_arr(bench_row *r, const char *key, const double *v, int64_t n) {
    bench_field *f = NULL;
    K3_TRY(next_field(r, key, NULL, BENCH_ARR, &f));
    K3_TRY(k3_alloc((void **)&f->arr, (size_t)K3_MAX(n, 1) * sizeof(double), "bench field"));
    if (n > 0) memcpy(f->arr, v, (size_t)n * sizeof(double));
    f->n_arr = n;
    return K3_OK;
}

k3_status bench_put_null(bench_row *r, const char *key, const char *label) {
    bench_field *f = NULL;
    return next_field(r, key, label, BENCH_NULL, &f);
}

k3_status bench_put_rows(bench_row *r, const char *key, const char *label, bench_row **rows, int n,
                         bool object) {
    bench_field *f = NULL;
    k3_status st = object && n != 1
                       ? K3_ERR(K3_ERR_INTERNAL, "bench: '%s' as an object needs one row", key)
                       : next_field(r, key, label, BENCH_ROWS, &f);
    if (st != K3_OK) {
        for (int i = 0; *rows && i < n; i++) bench_row_free(&(*rows)[i]);
        k3_free(*rows);
    } else
        f->rows = *rows, f->n_rows = n, f->object = object;
    *rows = NULL;
    return st;
}

k3_status bench_add_row(bench_report *rep, bench_row **out) {
    if (rep->n_rows == rep->cap_rows) {
        int cap = rep->cap_rows ? 2 * rep->cap_rows : 8;
        bench_row *p = NULL;
        K3_TRY(k3_calloc((void **)&p, (size_t)cap * sizeof *p, "bench rows"));
        if (rep->n_rows) memcpy(p, rep->rows, (size_t)rep->n_rows * sizeof *p);
        k3_free(rep->rows);
        rep->rows = p, rep->cap_rows = cap;
    }
    *out = &rep->rows[rep->n_rows++];
    memset(*out, 0, sizeof **out);
    return K3_OK;
}

void bench_row_free(bench_row *r) {
    for (int i = 0; i < r->n; i++) {
        for (int k = 0; k < r->f[i].n_rows; k++) bench_row_free(&r->f[i].rows[k]);
        k3_free(r->f[i].str), k3_free(r->f[i].arr), k3_free(r->f[i].rows);
    }
    r->n = 0;
}

void bench_report_free(bench_report *rep) {
    bench_row_free(&rep->meta);
    for (int i = 0; i < rep->n_rows; i++) bench_row_free(&rep->rows[i]);
    k3_free(rep->rows);
    rep->rows = NULL, rep->n_rows = rep->cap_rows = 0;
}

/* ---- the machine and the build ----------------------------------------------------------------
 */
/* The value of the first "key<spaces>: value" line of a /proc file, or "". */
static void proc_value(const char *path, const char *key, char *out, size_t n) {
    out[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[512];
    size_t kl = strlen(key);
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, kl) != 0) continue;
        const char *v = strchr(line + kl, ':');
        if (!v) continue;
        v++;
        while (*v == ' ' || *v == '\t') v++;
        snprintf(out, n, "%s", v);
        out[strcspn(out, "\n")] = 0;
        break;
    }
    fclose(f);
}

k3_status bench_meta_host(bench_row *m) {
    char date[32], buf[512];
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
    K3_TRY(bench_put_str(m, "date", "date", date));
    K3_TRY(bench_put_str(m, "k3_version", "k3", k3_build_version));
    K3_TRY(bench_put_str(m, "git_commit", "commit", k3_build_commit));
#if defined(__clang__)
    K3_TRY(bench_put_str(m, "compiler", "compiler", "clang " __clang_version__));
#elif defined(__GNUC__)
    K3_TRY(bench_put_str(m, "compiler", "compiler", "gcc " __VERSION__));
#else
    K3_TRY(bench_put_str(m, "compiler", "compiler", "unknown"));
#endif
    char mpi[MPI_MAX_LIBRARY_VERSION_STRING];
    int n_mpi = 0;
    if (MPI_Get_library_version(mpi, &n_mpi) != MPI_SUCCESS) snprintf(mpi, sizeof mpi, "unknown");
    mpi[strcspn(mpi, ",\n")] = 0; /* "Open MPI v4.1.4, package: ..." -> "Open MPI v4.1.4" */
    K3_TRY(bench_put_str(m, "mpi_version", "MPI", mpi));
    if (gethostname(buf, sizeof buf) != 0) snprintf(buf, sizeof buf, "unknown");
    buf[sizeof buf - 1] = 0;
    K3_TRY(bench_put_str(m, "host", "host", buf));
    proc_value("/proc/cpuinfo", "model name", buf, sizeof buf);
    K3_TRY(bench_put_str(m, "cpu_model", "CPU", buf[0] ? buf : "unknown"));
    K3_TRY(
        bench_put_num(m, "cpu_cores", "logical cores", -1, (double)sysconf(_SC_NPROCESSORS_ONLN)));
    proc_value("/proc/meminfo", "MemTotal", buf, sizeof buf); /* "131072 kB" */
    const double mem = atof(buf) * 1024.0;
    snprintf(buf, sizeof buf, "%.1f GiB", mem / (1 << 30));
    K3_TRY(bench_put_str(m, NULL, "memory", buf));
    return bench_put_num(m, "memory_bytes", NULL, -1, mem);
}

/* ---- statistics --------------------------------------------------------------------------------
 */
static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Linear interpolation between the order statistics around rank q (n - 1). */
static double quantile(const double *sorted, int64_t n, double q) {
    double pos = q * (double)(n - 1);
    int64_t lo = (int64_t)floor(pos), hi = K3_MIN(lo + 1, n - 1);
    return sorted[lo] + (pos - (double)lo) * (sorted[hi] - sorted[lo]);
}

void bench_stats_of(double *v, int64_t n, bench_stats *s) {
    memset(s, 0, sizeof *s);
    if (n <= 0) return;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += v[i];
    s->mean = sum / (double)n;
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (v[i] - s->mean) * (v[i] - s->mean);
    s->stddev = n > 1 ? sqrt(ss / (double)(n - 1)) : 0;
    s->stddev_pop = sqrt(ss / (double)n);
    s->median = quantile(v, n, 0.5);
    s->p90 = quantile(v, n, 0.9);
    s->p99 = quantile(v, n, 0.99);
}

/* The latency metrics with their keys (vLLM's) and table labels, spelled out as literals so the
 * row can keep pointers to them. */
#define MS_KEYS(n, L)                                                                              \
    {                                                                                              \
        n, {"mean_" n "_ms", "median_" n "_ms", "std_" n "_ms", "p90_" n "_ms", "p99_" n "_ms"}, { \
            L " mean (ms)", L " median (ms)", L " std (ms)", L " p90 (ms)", L " p99 (ms)"          \
        }                                                                                          \
    }
static const struct {
    const char *name, *key[5], *label[5];
} ms_metrics[] = {MS_KEYS("ttft", "TTFT"), MS_KEYS("tpot", "TPOT"), MS_KEYS("itl", "ITL"),
                  MS_KEYS("e2el", "E2EL")};

k3_status bench_put_ms_stats(bench_row *r, const char *name, double *v_s, int64_t n) {
    bench_stats s;
    bench_stats_of(v_s, n, &s);
    const double val[5] = {s.mean, s.median, s.stddev_pop, s.p90, s.p99};
    for (size_t m = 0; m < K3_ARRAY_LEN(ms_metrics); m++) {
        if (strcmp(ms_metrics[m].name, name) != 0) continue;
        for (int k = 0; k < 5; k++)
            K3_TRY(bench_put_num(r, ms_metrics[m].key[k], ms_metrics[m].label[k], 2, 1e3 * val[k]));
        return K3_OK;
    }
    return K3_ERR(K3_ERR_INTERNAL, "bench: no latency metric '%s'", name);
}

/* ---- inputs ------------------------------------------------------------------------------------
 */
k3_status bench_parse_list(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out,
                           int cap, int *n) {
    *n = 0;
    const char *p = s;
    for (;;) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p || (*end && *end != ',') || v < lo || v > hi || *n == cap)
            return K3_ERR(K3_ERR_ARG,
                          "--%s: '%s' must be a comma list of at most %d integers in [%lld, %lld]",
                          flag, s, cap, (long long)lo, (long long)hi);
        out[(*n)++] = v;
        if (!*end) return K3_OK;
        p = end + 1;
    }
}

void bench_model_name(const char *dir, char *out, size_t n) {
    size_t e = strlen(dir);
    while (e > 1 && dir[e - 1] == '/') e--;
    size_t b = e;
    while (b > 0 && dir[b - 1] != '/') b--;
    snprintf(out, n, "%.*s", (int)(e - b), dir + b);
}

void bench_random_ids(k3_rng *rng, int64_t n_vocab, int32_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(k3_rng_u64(rng) % (uint64_t)n_vocab);
    /* never a constant prompt: a degenerate input would hide a broken generator */
    if (n > 1 && ids[0] == ids[n - 1]) ids[n - 1] = (int32_t)((ids[0] + 1) % n_vocab);
}

/* ---- outputs ------------------------------------------------------------------------------------
 */
/* " value" + `end` (" |" in a table, "" in a list). */
static void md_cell(FILE *f, const bench_field *x, const char *end) {
    if (x->kind == BENCH_NUM && x->prec < 0)
        fprintf(f, " %.0f", x->num);
    else if (x->kind == BENCH_NUM)
        fprintf(f, " %.*f", x->prec, x->num);
    else if (x->kind == BENCH_STR) {
        fputc(' ', f);
        for (const char *c = x->str; *c; c++) {
            if (*c == '|') fputc('\\', f);
            fputc(*c == '\n' ? ' ' : *c, f);
        }
    } else
        fputs(" -", f);
    fputs(end, f);
}

/* Rows as a markdown table, the columns of the first row's labelled cells. */
static void md_table(FILE *f, const bench_row *rows, int n) {
    const bench_row *h = &rows[0];
    fputc('|', f);
    for (int i = 0; i < h->n; i++)
        if (h->f[i].label && h->f[i].kind != BENCH_ROWS) fprintf(f, " %s |", h->f[i].label);
    fputs("\n|", f);
    for (int i = 0; i < h->n; i++)
        if (h->f[i].label && h->f[i].kind != BENCH_ROWS)
            fputs(h->f[i].kind == BENCH_STR ? "---|" : "---:|", f);
    fputc('\n', f);
    for (int r = 0; r < n; r++) {
        fputc('|', f);
        for (int i = 0; i < rows[r].n; i++)
            if (rows[r].f[i].label && rows[r].f[i].kind != BENCH_ROWS)
                md_cell(f, &rows[r].f[i], " |");
        fputc('\n', f);
    }
}

/* The labelled nested rows of each row, a table each, headed by the label and the row's first
 * string cell ("### ranks: serial warm"). */
static void md_nested(FILE *f, const bench_row *rows, int n) {
    for (int r = 0; r < n; r++) {
        const char *name = NULL;
        for (int i = 0; !name && i < rows[r].n; i++)
            if (rows[r].f[i].kind == BENCH_STR) name = rows[r].f[i].str;
        for (int i = 0; i < rows[r].n; i++) {
            const bench_field *x = &rows[r].f[i];
            if (x->kind != BENCH_ROWS || !x->label || x->n_rows == 0) continue;
            fprintf(f, "\n### %s%s%s\n\n", x->label, name ? ": " : "", name ? name : "");
            md_table(f, x->rows, x->n_rows);
        }
    }
}

static void write_md(const bench_report *rep, FILE *f) {
    const bench_row *m = &rep->meta;
    fprintf(f, "## k3 bench %s\n\n", rep->mode);
    for (int i = 0; i < m->n; i++) {
        if (!m->f[i].label || m->f[i].kind == BENCH_ROWS) continue;
        fprintf(f, "- %s:", m->f[i].label);
        md_cell(f, &m->f[i], "");
        fputc('\n', f);
    }
    fputc('\n', f);
    if (rep->n_rows == 0) return;
    if (rep->vertical) {
        fprintf(f, "| metric | value |\n|---|---:|\n");
        for (int r = 0; r < rep->n_rows; r++)
            for (int i = 0; i < rep->rows[r].n; i++) {
                const bench_field *x = &rep->rows[r].f[i];
                if (!x->label) continue;
                if (x->kind == BENCH_ROWS) continue;
                fprintf(f, "| %s |", x->label);
                md_cell(f, x, " |");
                fputc('\n', f);
            }
        return;
    }
    md_table(f, rep->rows, rep->n_rows);
    md_nested(f, rep->rows, rep->n_rows);
}

static bool json_add(cJSON *o, const bench_row *r);

/* A field's JSON value, NULL when out of memory (nothing left allocated). */
static cJSON *json_value(const bench_field *x) {
    if (x->kind == BENCH_NUM) return cJSON_CreateNumber(x->num);
    if (x->kind == BENCH_STR) return cJSON_CreateString(x->str);
    if (x->kind == BENCH_NULL) return cJSON_CreateNull();
    bool ok = true;
    cJSON *v = x->kind == BENCH_ROWS && x->object ? cJSON_CreateObject() : cJSON_CreateArray();
    if (!v) return NULL;
    if (x->kind == BENCH_ROWS && x->object)
        ok = json_add(v, &x->rows[0]);
    else if (x->kind == BENCH_ROWS)
        for (int k = 0; ok && k < x->n_rows; k++) {
            cJSON *row = cJSON_CreateObject();
            ok = row && cJSON_AddItemToArray(v, row) && json_add(row, &x->rows[k]);
        }
    else
        for (int64_t k = 0; ok && k < x->n_arr; k++)
            ok = cJSON_AddItemToArray(v, cJSON_CreateNumber(x->arr[k]));
    if (!ok) cJSON_Delete(v);
    return ok ? v : NULL;
}

static bool json_add(cJSON *o, const bench_row *r) {
    for (int i = 0; i < r->n; i++) {
        const bench_field *x = &r->f[i];
        if (!x->key) continue; /* a table-only cell */
        cJSON *v = json_value(x);
        if (!v || !cJSON_AddItemToObject(o, x->key, v)) return false;
    }
    return true;
}

static k3_status write_json(const bench_report *rep, const char *path) {
    cJSON *o = cJSON_CreateObject(), *res = NULL;
    bool ok = o && cJSON_AddStringToObject(o, "k3_bench", rep->mode) && json_add(o, &rep->meta);
    if (ok && rep->n_rows == 1) ok = json_add(o, &rep->rows[0]);
    ok = ok && (res = cJSON_AddArrayToObject(o, rep->rows_key ? rep->rows_key : "results")) != NULL;
    for (int r = 0; ok && r < rep->n_rows; r++) {
        cJSON *row = cJSON_CreateObject();
        ok = row && cJSON_AddItemToArray(res, row) && json_add(row, &rep->rows[r]);
    }
    char *text = ok ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    if (!text) return K3_ERR(K3_ERR_NOMEM, "bench: building the JSON of %s", path);
    FILE *f = fopen(path, "w");
    bool wrote = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f && fclose(f) != 0) wrote = false;
    free(text);
    if (!wrote) return K3_ERR(K3_ERR_IO, "--output-json %s: %s", path, strerror(errno));
    return K3_OK;
}

static void csv_cell(FILE *f, const bench_field *x) {
    if (x->kind == BENCH_NUM) {
        fprintf(f, "%.17g", x->num);
    } else if (x->kind == BENCH_STR) {
        fputc('"', f);
        for (const char *c = x->str; *c; c++) {
            if (*c == '"') fputc('"', f);
            fputc(*c, f);
        }
        fputc('"', f);
    }
}

static void csv_line(FILE *f, const bench_row *m, const bench_row *r, bool header) {
    bool first = true;
    const bench_row *parts[2] = {m, r};
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < parts[p]->n; i++) {
            const bench_field *x = &parts[p]->f[i];
            if (x->kind == BENCH_ARR || x->kind == BENCH_ROWS || !x->key) continue;
            if (!first) fputc(',', f);
            first = false;
            if (header)
                fputs(x->key, f);
            else
                csv_cell(f, x);
        }
    fputc('\n', f);
}

static k3_status write_csv(const bench_report *rep, const char *path) {
    FILE *f = fopen(path, "w");
    if (!f) return K3_ERR(K3_ERR_IO, "--output-csv %s: %s", path, strerror(errno));
    static const bench_row empty;
    csv_line(f, &rep->meta, rep->n_rows ? &rep->rows[0] : &empty, true);
    for (int r = 0; r < rep->n_rows; r++) csv_line(f, &rep->meta, &rep->rows[r], false);
    bool ok = !ferror(f);
    if (fclose(f) != 0) ok = false;
    if (!ok) return K3_ERR(K3_ERR_IO, "--output-csv %s: %s", path, strerror(errno));
    return K3_OK;
}

k3_status bench_report_write(const bench_report *rep, const char *json_path, const char *csv_path) {
    write_md(rep, stdout);
    fflush(stdout);
    if (json_path) K3_TRY(write_json(rep, json_path));
    if (csv_path) K3_TRY(write_csv(rep, csv_path));
    return K3_OK;
}
