/* cli.c — the flag parser and the help text, both driven by the command tables.
 *
 * Owns: parsing `--name value`, `--name=value`, boolean `--name`, `--` and positionals against a
 * command's k3_flag table; the generated `k3 --help` and `k3 <command> --help`.
 * Invariants: every value a handler reads was validated here (ints are ints, numbers finite);
 * unknown, repeated or value-less flags are usage errors (one line, a typo's nearest flag, and a
 * pointer to --help on stderr, exit 2);
 * a flag name that is not in the table asserts (a bug in the handler, not in the input). */
#include "k3_launcher.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int flag_index(const k3_command *cmd, const char *name, size_t len) {
    for (int i = 0; i < cmd->n_flags; i++)
        if (strlen(cmd->flags[i].name) == len && strncmp(cmd->flags[i].name, name, len) == 0)
            return i;
    return -1;
}

static int must_index(const k3_args *a, const char *name) {
    int i = flag_index(a->cmd, name, strlen(name));
    if (i < 0) {
        k3_log(K3_LOG_ERROR, "internal: command '%s' has no flag --%s", a->cmd->name, name);
        K3_ASSERT(i >= 0);
    }
    return i;
}

bool k3_args_has(const k3_args *a, const char *name) {
    return a->values[must_index(a, name)] != NULL;
}

const char *k3_args_str(const k3_args *a, const char *name) {
    int i = must_index(a, name);
    return a->values[i] ? a->values[i] : a->cmd->flags[i].def;
}

static bool parse_int(const char *s, int64_t *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || *end) return false;
    *out = v;
    return true;
}
static bool parse_float(const char *s, double *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

int64_t k3_args_int(const k3_args *a, const char *name) {
    int64_t v = 0;
    const char *s = k3_args_str(a, name);
    return parse_int(s, &v) ? v : 0;
}
double k3_args_float(const k3_args *a, const char *name) {
    double v = 0;
    const char *s = k3_args_str(a, name);
    return parse_float(s, &v) ? v : 0;
}
bool k3_args_bool(const k3_args *a, const char *name) {
    const char *s = k3_args_str(a, name);
    return s && strcmp(s, "0") != 0 && strcmp(s, "false") != 0;
}

/* The long flag that -c stands for, or NULL. */
static const char *alias_of(const k3_command *cmd, char c) {
    for (int i = 0; i < cmd->n_aliases; i++)
        if (cmd->aliases[i].short_name == c) return cmd->aliases[i].name;
    return NULL;
}

static char short_of(const k3_command *cmd, const char *name) {
    for (int i = 0; i < cmd->n_aliases; i++)
        if (strcmp(cmd->aliases[i].name, name) == 0) return cmd->aliases[i].short_name;
    return 0;
}

void k3_print_command_help(const k3_command *cmd, void *file) {
    FILE *f = file;
    fprintf(f, "usage: k3 %s%s%s [flags]\n\n%s\n", cmd->name, *cmd->positional ? " " : "",
            cmd->positional, cmd->summary);
    if (cmd->n_flags) fprintf(f, "\nflags:\n");
    for (int i = 0; i < cmd->n_flags; i++) {
        const k3_flag *fl = &cmd->flags[i];
        char left[64], sh[8] = "";
        if (short_of(cmd, fl->name)) snprintf(sh, sizeof sh, "-%c, ", short_of(cmd, fl->name));
        snprintf(left, sizeof left, "%s--%s%s%s", sh, fl->name, fl->metavar ? " " : "",
                 fl->metavar ? fl->metavar : "");
        fprintf(f, "  %-26s %s", left, fl->help);
        if (fl->def && fl->kind != K3_FLAG_BOOL) fprintf(f, " (default %s)", fl->def);
        char note[128] = "";
        if (cmd->flag_note) cmd->flag_note(i, note, sizeof note);
        if (note[0]) fprintf(f, " [%s]", note);
        fprintf(f, "\n");
    }
    fprintf(f, "  %-26s %s\n", "--help", "show this help");
}

void k3_print_usage(void *file) {
    FILE *f = file;
    fprintf(f, "usage: k3 <command> [flags]   (k3 <command> --help for its flags)\n\ncommands:\n");
    for (int i = 0; i < k3_n_commands; i++)
        fprintf(f, "  %-11s %s\n", k3_commands[i]->name, k3_commands[i]->summary);
}

/* Levenshtein distance of a[0..na) and b[0..nb), or cap + 1 once it is past cap (names are short).
 */
static int edit_distance(const char *a, size_t na, const char *b, size_t nb, int cap) {
    int row[128];
    if (na >= K3_ARRAY_LEN(row) || nb >= K3_ARRAY_LEN(row)) return cap + 1;
    for (size_t j = 0; j <= nb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        int diag = row[0], best = row[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int up = row[j];
            row[j] = K3_MIN(K3_MIN(row[j] + 1, row[j - 1] + 1), diag + (a[i - 1] != b[j - 1]));
            diag = up;
            best = K3_MIN(best, row[j]);
        }
        if (best > cap) return cap + 1;
    }
    return row[nb];
}

const char *k3_closest_name(const char *name, size_t len, const char *const *names, int n) {
    /* close enough to be a typo: a third of the name's letters, at least 2 */
    int cap = K3_MAX(2, (int)len / 3), best = cap + 1;
    const char *pick = NULL;
    for (int i = 0; i < n; i++) {
        int d = edit_distance(name, len, names[i], strlen(names[i]), cap);
        if (d < best) best = d, pick = names[i];
    }
    return pick;
}

/* The flag of cmd nearest to --name (a typo), or NULL. */
static const char *closest_flag(const k3_command *cmd, const char *name, size_t len) {
    const char *names[K3_ARRAY_LEN(((k3_args *)0)->values)];
    int n = 0;
    for (int i = 0; i < cmd->n_flags && n < (int)K3_ARRAY_LEN(names); i++)
        names[n++] = cmd->flags[i].name;
    return k3_closest_name(name, len, names, n);
}

/* One line naming what is wrong (and the flag meant, for a typo), then one line saying where the
 * flags are: the whole usage after a typo buries the line that matters. */
static int usage_error(const k3_command *cmd, const char *fmt, const char *what) {
    fprintf(stderr, "k3 %s: ", cmd->name);
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n");
    k3_print_help_hint(cmd->name);
    return 2;
}

void k3_print_help_hint(const char *cmd) {
    if (cmd)
        fprintf(stderr, "run 'k3 %s --help' for its flags\n", cmd);
    else
        fprintf(stderr, "run 'k3 --help' for the commands\n");
}

/* s with the characters markdown tables give meaning to escaped ('|'), newlines as spaces. The
 * reference is one for every build: a help text's "; this build: ..." tail (what this binary has,
 * as `--help` and `k3 version` say) is left out. */
static void md_text(FILE *f, const char *s) {
    const char *end = s ? strstr(s, "; this build: ") : NULL;
    for (; s && *s && s != end; s++) {
        if (*s == '|')
            fputs("\\|", f);
        else if (*s == '\n')
            fputc(' ', f);
        else
            fputc(*s, f);
    }
}

void k3_print_markdown(void *file) {
    FILE *f = file;
    fprintf(f, "# k3 command line\n\n"
               "<!-- Generated by `k3 help --markdown` from the flag tables the parser reads "
               "(launcher/); do not edit by hand. tests/cli/cli_md.sh fails when this file is out "
               "of date: regenerate it with `build/k3 help --markdown > docs/CLI.md`. -->\n\n"
               "`k3 <command> --help` prints the same for one command. A usage error exits 2 with "
               "one line naming the flag and what is wrong with it (`--prompt-ids: prompt 1, id "
               "2: 'a' is not a token id`); the parser's own (an unknown flag, a missing or "
               "malformed value, a flag given twice) also name the flag meant, for a typo (`did "
               "you mean --max-ctx?`), and add one line pointing to `--help`. Any other failure "
               "prints one line naming the file, key, tensor or rank and exits 1.\n\n"
               "| command | what it does |\n|---|---|\n");
    for (int i = 0; i < k3_n_commands; i++) {
        fprintf(f, "| [`%s`](#k3-%s) | ", k3_commands[i]->name, k3_commands[i]->name);
        md_text(f, k3_commands[i]->summary);
        fprintf(f, " |\n");
    }
    for (int c = 0; c < k3_n_commands; c++) {
        const k3_command *cmd = k3_commands[c];
        fprintf(f, "\n## k3 %s\n\n`k3 %s%s%s [flags]`: ", cmd->name, cmd->name,
                *cmd->positional ? " " : "", cmd->positional);
        md_text(f, cmd->summary);
        fprintf(f, "\n");
        if (!cmd->n_flags) continue;
        fprintf(f, "\n| flag | default | what it does |\n|---|---|---|\n");
        for (int i = 0; i < cmd->n_flags; i++) {
            const k3_flag *fl = &cmd->flags[i];
            char sh = short_of(cmd, fl->name), note[128] = "";
            fprintf(f, "| ");
            if (sh) fprintf(f, "`-%c`, ", sh);
            fprintf(f, "`--%s%s%s` | ", fl->name, fl->metavar ? " " : "",
                    fl->metavar ? fl->metavar : "");
            if (fl->def && fl->kind != K3_FLAG_BOOL) {
                fputc('`', f);
                md_text(f, fl->def);
                fputc('`', f);
            }
            fprintf(f, " | ");
            md_text(f, fl->help);
            if (cmd->flag_note) cmd->flag_note(i, note, sizeof note);
            if (note[0]) {
                fprintf(f, " [");
                md_text(f, note);
                fprintf(f, "]");
            }
            fprintf(f, " |\n");
        }
    }
}

int k3_args_parse(const k3_command *cmd, int argc, char **argv, k3_args *out, bool *done) {
    K3_ASSERT(cmd->n_flags <= (int)K3_ARRAY_LEN(out->values));
    memset(out, 0, sizeof *out);
    out->cmd = cmd;
    *done = false;
    bool only_pos = false;
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        char alias[80]; /* "-p" -> "--n-prompt" */
        if (!only_pos && arg[0] == '-' && arg[1] && arg[1] != '-' && !arg[2] &&
            alias_of(cmd, arg[1])) {
            snprintf(alias, sizeof alias, "--%s", alias_of(cmd, arg[1]));
            arg = alias;
        }
        if (!only_pos && strcmp(arg, "--") == 0) {
            only_pos = true;
            continue;
        }
        if (!only_pos && strncmp(arg, "--", 2) == 0) {
            const char *name = arg + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            if (len == 4 && strncmp(name, "help", 4) == 0) {
                k3_print_command_help(cmd, stdout);
                *done = true;
                return 0;
            }
            int fi = flag_index(cmd, name, len);
            if (fi < 0) {
                const char *near = closest_flag(cmd, name, len);
                if (!near) return usage_error(cmd, "unknown flag '%s'", arg);
                fprintf(stderr, "k3 %s: unknown flag '%.*s'; did you mean --%s?\n", cmd->name,
                        (int)(eq ? eq - arg : (ptrdiff_t)strlen(arg)), arg, near);
                k3_print_help_hint(cmd->name);
                return 2;
            }
            const k3_flag *fl = &cmd->flags[fi];
            const char *val;
            if (fl->kind == K3_FLAG_BOOL) {
                if (eq) return usage_error(cmd, "flag '%s' takes no value", arg);
                val = "1";
            } else if (eq) {
                val = eq + 1;
            } else {
                if (i + 1 >= argc) return usage_error(cmd, "flag '%s' needs a value", arg);
                val = argv[++i];
            }
            int64_t iv;
            double dv;
            if (fl->kind == K3_FLAG_INT && !parse_int(val, &iv))
                return usage_error(cmd, "flag '%s' needs an integer", arg);
            if (fl->kind == K3_FLAG_FLOAT && !parse_float(val, &dv))
                return usage_error(cmd, "flag '%s' needs a number", arg);
            /* A repeated flag is an error, not "last one wins": silently dropping a value
             * (e.g. a second --prompt-ids) would run something other than what was asked. */
            if (out->values[fi]) return usage_error(cmd, "flag '%s' given twice", arg);
            out->values[fi] = val;
        } else if (!only_pos && arg[0] == '-' && arg[1] != 0) {
            return usage_error(cmd, "unknown flag '%s' (flags start with --)", arg);
        } else {
            if (out->n_pos >= cmd->max_pos || out->n_pos >= K3_MAX_POSITIONAL)
                return usage_error(cmd, "unexpected argument '%s'", arg);
            out->pos[out->n_pos++] = arg;
        }
    }
    if (out->n_pos < cmd->min_pos) return usage_error(cmd, "missing argument %s", cmd->positional);
    return 0;
}
