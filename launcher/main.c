/* main.c — k3's entry point: find the command, parse its flags, run it.
 *
 * Owns: the process exit code (0 ok, 1 failure, 2 usage error). MPI is started by the command
 * that needs it, through comm/ (run: under mpirun, or a world of one without it); the other
 * commands never touch MPI.
 * Must not: contain command logic; print anything but usage errors. */
#include "k3_launcher.h"

#include <stdio.h>
#include <sys/resource.h>

/* The cpu kernels keep their tiles' scratch on the stack (prefill matmul ~0.7 MB; the pool's
 * workers get 16 MB stacks of their own, kernels/cpu/pool.c). The caller thread runs tasks too,
 * so a soft stack limit below K3_MAIN_STACK is raised to it (or to the hard limit): the main
 * thread's stack grows on demand up to the limit read at each fault. A hard limit below
 * K3_MIN_STACK is refused with a message rather than left to crash mid-forward. */
#define K3_MAIN_STACK ((rlim_t)16 << 20)
#define K3_MIN_STACK  ((rlim_t)2 << 20)
static bool stack_limit_ok(void) {
    struct rlimit r;
    if (getrlimit(RLIMIT_STACK, &r) != 0 || r.rlim_cur == RLIM_INFINITY ||
        r.rlim_cur >= K3_MAIN_STACK)
        return true;
    r.rlim_cur =
        r.rlim_max == RLIM_INFINITY || r.rlim_max > K3_MAIN_STACK ? K3_MAIN_STACK : r.rlim_max;
    if (setrlimit(RLIMIT_STACK, &r) == 0 && r.rlim_cur >= K3_MIN_STACK) return true;
    fprintf(stderr,
            "k3: the stack limit is %llu KB (ulimit -s) and cannot be raised; the cpu kernels "
            "need %llu KB: raise the hard limit (ulimit -Hs)\n",
            (unsigned long long)(r.rlim_cur / 1024), (unsigned long long)(K3_MIN_STACK / 1024));
    return false;
}

int main(int argc, char **argv) {
    if (!stack_limit_ok()) return 1;
    if (argc >= 2 && strcmp(argv[1], "help") == 0 && argc >= 3) {
        if (argc == 3 && strcmp(argv[2], "--markdown") == 0) {
            k3_print_markdown(stdout);
            return 0;
        }
        for (int i = 0; i < k3_n_commands && argc == 3; i++)
            if (strcmp(k3_commands[i]->name, argv[2]) == 0) {
                k3_print_command_help(k3_commands[i], stdout);
                return 0;
            }
        fprintf(stderr, "k3 help: '%s' is not --markdown or a command\n", argv[2]);
        k3_print_help_hint(NULL);
        return 2;
    }
    if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        k3_print_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const k3_command *cmd = NULL;
    for (int i = 0; i < k3_n_commands; i++)
        if (strcmp(k3_commands[i]->name, argv[1]) == 0) cmd = k3_commands[i];
    if (!cmd) {
        const char *names[64];
        int n = 0;
        for (int i = 0; i < k3_n_commands && n < (int)K3_ARRAY_LEN(names); i++)
            names[n++] = k3_commands[i]->name;
        const char *near = k3_closest_name(argv[1], strlen(argv[1]), names, n);
        if (near)
            fprintf(stderr, "k3: unknown command '%s'; did you mean %s?\n", argv[1], near);
        else
            fprintf(stderr, "k3: unknown command '%s'\n", argv[1]);
        k3_print_help_hint(NULL);
        return 2;
    }
    k3_args args;
    bool done;
    int rc = k3_args_parse(cmd, argc - 2, argv + 2, &args, &done);
    if (rc != 0 || done) return rc;
    return cmd->run(&args);
}
