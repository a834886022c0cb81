/* fuzz_driver.h — the plain driver's command line, for targets that use it (fuzz_grammar.c):
 * `--random N --seed S` and files to replay through the target first. */
#ifndef K3_FUZZ_DRIVER_H
#define K3_FUZZ_DRIVER_H

#include <stdio.h>
#include <stdlib.h>

#include "k3_base.h"

/* Replays every file argument through `one`; *n_random / *seed keep their defaults unless given.
 * False (after a message naming the file) when a file cannot be read. */
static inline bool fuzz_driver_args(int argc, char **argv, const char *name, long *n_random,
                                    uint64_t *seed, int (*one)(const uint8_t *, size_t)) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--random") && i + 1 < argc) {
            *n_random = atol(argv[++i]);
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            *seed = strtoull(argv[++i], NULL, 10);
        } else {
            char *buf = NULL;
            size_t n = 0;
            if (k3_read_file(argv[i], &buf, &n) != K3_OK) {
                fprintf(stderr, "%s: %s\n", name, k3_last_error());
                return false;
            }
            one((const uint8_t *)buf, n);
            k3_free(buf);
        }
    }
    printf("%s: seed %llu, %ld generated inputs\n", name, (unsigned long long)*seed, *n_random);
    return true;
}

#endif /* K3_FUZZ_DRIVER_H */
