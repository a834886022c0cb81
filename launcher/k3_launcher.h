/* launcher — main(), the command table, the flag parser and the generated --help.
 *
 * Owns: the one table of commands (commands.c) and each command's flag table (beside its
 * handler in cmd_<name>.c). Usage text is generated from the same tables the parser reads, so
 * the two cannot drift. Commands appear in the table only once they work.
 * Callers must not: print usage by hand, exit() from a handler (return an exit code), or put
 * model math here. */
#ifndef K3_LAUNCHER_H
#define K3_LAUNCHER_H

#include "k3_base.h"

typedef enum { K3_FLAG_BOOL, K3_FLAG_INT, K3_FLAG_FLOAT, K3_FLAG_STR } k3_flag_kind;

typedef struct k3_flag {
    const char *name; /* long name without dashes: "model" for --model */
    k3_flag_kind kind;
    const char *metavar; /* "DIR", "N", ... (NULL for bool) */
    const char *def;     /* default shown in help and returned when absent (NULL = none) */
    const char *help;
} k3_flag;

#define K3_MAX_POSITIONAL 16
typedef struct k3_args {
    const struct k3_command *cmd;
    const char *values[64]; /* by flag index; NULL = not given */
    const char *pos[K3_MAX_POSITIONAL];
    int n_pos;
} k3_args;

/* A one-letter alias of a long flag ("-p" for "--n-prompt"), for commands that keep another
 * tool's short flags (`k3 bench` takes llama-bench's -p -n -r). */
typedef struct k3_flag_alias {
    char short_name;
    const char *name; /* the long flag it stands for */
} k3_flag_alias;

typedef struct k3_command {
    const char *name;
    const char *positional; /* usage of positional arguments, "" if none ("DIR", "[TEXT]") */
    int min_pos, max_pos;
    const char *summary; /* one line */
    const k3_flag *flags;
    int n_flags;
    int (*run)(const k3_args *a); /* returns the process exit code */
    const k3_flag_alias *aliases; /* (n_aliases) may be NULL */
    int n_aliases;
    /* may be NULL: a note for flag i's help line, shown as " [note]" (e.g. the modes of
       `k3 bench` a flag applies to); "" for none */
    void (*flag_note)(int i, char *buf, size_t n);
} k3_command;

/* Lookup of parsed values. A name not in the command's flag table is a bug (asserts). */
bool k3_args_has(const k3_args *a, const char *name);
const char *k3_args_str(const k3_args *a, const char *name); /* value or default (may be NULL) */
int64_t k3_args_int(const k3_args *a, const char *name);     /* validated at parse time */
double k3_args_float(const k3_args *a, const char *name);
bool k3_args_bool(const k3_args *a, const char *name);

/* Parse argv (after the command name). On error prints one line + usage to stderr and returns 2;
 * on --help prints the command's help to stdout and returns 0 with *done = true. */
int k3_args_parse(const k3_command *cmd, int argc, char **argv, k3_args *out, bool *done);
void k3_print_command_help(const k3_command *cmd, void *file /* FILE* */);
void k3_print_usage(void *file /* FILE* */);
/* Every command and its flags as markdown (`k3 help --markdown`, committed as docs/CLI.md). */
void k3_print_markdown(void *file /* FILE* */);
/* One line on stderr: where the flags of cmd (NULL: the commands) are listed. */
void k3_print_help_hint(const char *cmd);
/* The name of names[0..n) nearest to name[0..len) by edit distance, if close enough to be a typo
 * of it, else NULL. */
const char *k3_closest_name(const char *name, size_t len, const char *const *names, int n);

/* The command table (commands.c). */
extern const k3_command *const k3_commands[];
extern const int k3_n_commands;

#endif /* K3_LAUNCHER_H */
