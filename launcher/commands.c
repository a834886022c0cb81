/* commands.c — THE command table.
 *
 * A command is listed here only once it works; its flags and handler live in cmd_<name>.c next
 * to each other. The usage text (`k3 --help`) is generated from this table and the per-command
 * help from each command's flag table, so help and parser cannot drift apart.
 * Order here is the order in `k3 --help`. */
#include "k3_launcher.h"

extern const k3_command k3_cmd_version;
extern const k3_command k3_cmd_make_tiny;
extern const k3_command k3_cmd_inspect;
extern const k3_command k3_cmd_tokenize;
extern const k3_command k3_cmd_render;
extern const k3_command k3_cmd_parse;
extern const k3_command k3_cmd_run;
extern const k3_command k3_cmd_batch;
extern const k3_command k3_cmd_serve;
extern const k3_command k3_cmd_plan;
extern const k3_command k3_cmd_bench;

const k3_command *const k3_commands[] = {
    &k3_cmd_version, &k3_cmd_make_tiny, &k3_cmd_inspect, &k3_cmd_tokenize,
    &k3_cmd_render,  &k3_cmd_parse,     &k3_cmd_run,     &k3_cmd_batch,
    &k3_cmd_serve,   &k3_cmd_plan,      &k3_cmd_bench,
};
const int k3_n_commands = (int)K3_ARRAY_LEN(k3_commands);
