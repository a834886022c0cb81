/* cli.c — the flag parser and the help text, both driven by the command tables.
 *
 * Owns: parsing `--name value`, `--name=value`, boolean `--name`, `--` and positionals against a
 * command's k3_flag table; the generated `k3 --help` and `k3 <command> --help`.
 * Invariants: every value a handler reads was validated here (ints are ints, numbers finite);
 * unknown, repeated or value-less flags are usage errors (one line + usage on stderr, exit 2);
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

static int usage_error(const k3_command *cmd, const char *fmt, const char *what) {
    fprintf(stderr, "k3 %s: ", cmd->name);
    fprintf(stderr, fmt, what);
    fprintf(stderr, "\n");
    k3_print_command_help(cmd, stderr);
    return 2;
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
            if (fi < 0) return usage_error(cmd, "unknown flag '%s'", arg);
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
