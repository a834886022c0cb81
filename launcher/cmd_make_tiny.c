/* cmd_make_tiny.c — `k3 make-tiny DIR [--preset tiny|small|deep] [--seed N] [--dense]`.
 *
 * Writes a deterministic random K3 checkpoint in the real layout (config.json, safetensors index
 * and shards, MXFP4 experts, tiktoken.model + tokenizer_config.json). tiny/make_tiny.c does the
 * work; this file is flags and messages. Same seed, same bytes; the demo and every test use it,
 * so nothing is ever downloaded. */
#include "k3_launcher.h"
#include "k3_model.h"
#include "k3_tiny.h"

#include <stdio.h>

static const k3_flag flags[] = {
    {"preset", K3_FLAG_STR, "NAME", "tiny",
     "tiny (tests, demo), small (CPU benchmarks) or deep (tiny widths, K3's 93 layers)"},
    {"seed", K3_FLAG_INT, "N", "1", "weights seed; same seed -> byte-identical files"},
    {"dense", K3_FLAG_BOOL, NULL, NULL,
     "every layer's FFN dense (first_k_dense_replace = the layer count): a model with no MoE "
     "layer, for tests of what MoE layers would change"},
};

static int run_make_tiny(const k3_args *a) {
    const char *dir = a->pos[0];
    k3_preset p;
    if (k3_preset_parse(k3_args_str(a, "preset"), &p) != K3_OK || p == K3_PRESET_K3) {
        fprintf(stderr, "k3 make-tiny: --preset: '%s' is not tiny, small or deep\n",
                k3_args_str(a, "preset"));
        return 2;
    }
    int64_t seed = k3_args_int(a, "seed");
    if (seed < 0) {
        fprintf(stderr, "k3 make-tiny: --seed: %lld must be >= 0\n", (long long)seed);
        return 2;
    }
    double t0 = k3_now_s();
    k3_status s = k3_make_tiny_dense(dir, p, (uint64_t)seed, k3_args_bool(a, "dense"));
    if (s != K3_OK) {
        fprintf(stderr, "k3 make-tiny: %s\n", k3_last_error());
        return 1;
    }
    K3_LOGI("wrote the %s checkpoint (seed %lld) to %s in %.2f s", k3_args_str(a, "preset"),
            (long long)seed, dir, k3_now_s() - t0);
    return 0;
}

const k3_command k3_cmd_make_tiny = {
    .name = "make-tiny",
    .positional = "DIR",
    .min_pos = 1,
    .max_pos = 1,
    .summary = "write a deterministic random K3 checkpoint (tiny, small or deep preset)",
    .flags = flags,
    .n_flags = (int)K3_ARRAY_LEN(flags),
    .run = run_make_tiny,
};
