/* main.c — k3's entry point: find the command, parse its flags, run it.
 *
 * Owns: the process exit code (0 ok, 1 failure, 2 usage error). MPI is started by the command
 * that needs it, through comm/ (run: under mpirun, or a world of one without it); the other
 * commands never touch MPI.
 * Must not: contain command logic; print anything but usage errors. */
#include "k3_launcher.h"

#include <stdio.h>

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        k3_print_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const k3_command *cmd = NULL;
    for (int i = 0; i < k3_n_commands; i++)
        if (strcmp(k3_commands[i]->name, argv[1]) == 0) cmd = k3_commands[i];
    if (!cmd) {
        fprintf(stderr, "k3: unknown command '%s'\n", argv[1]);
        k3_print_usage(stderr);
        return 2;
    }
    k3_args args;
    bool done;
    int rc = k3_args_parse(cmd, argc - 2, argv + 2, &args, &done);
    if (rc != 0 || done) return rc;
    return cmd->run(&args);
}
