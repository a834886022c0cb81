/* engine_args — the flags every client of the engine (rank/k3_engine.h) shares: the grid, the
 * transport (--comm), the kernels and the capacity, as entries of a command's flag table, and
 * their reading + validation into k3_engine_opts (launcher-internal). `k3 run`, `k3 batch`,
 * `k3 serve` and `k3 bench` take the same entries, so the flags mean the same, with the same
 * defaults and ranges, in every command. The capacity defaults are the engine's own
 * (K3_ENGINE_DEFAULT_*), stringified here, so the help text cannot drift from what the engine
 * does; the ranges are one table in engine_args.c (k3_engine_flag_range), which `k3 plan` uses
 * for its capacity flags too. */
#ifndef K3_ENGINE_ARGS_H
#define K3_ENGINE_ARGS_H

#include "k3_engine.h"
#include "k3_launcher.h"

#define K3_ENGINE_ARGS_STR_(x) #x
#define K3_ENGINE_ARGS_STR(x)  K3_ENGINE_ARGS_STR_(x)

/* --bind (k3_engine_bind_arg checks it). */
/* clang-format off */
#define K3_BIND_FLAG                                                                               \
    {"bind", K3_FLAG_STR, "MODE", "auto",                                                          \
     "auto: bind each rank to its share of its node's cores (hwloc; threads = its cores); none"}
/* clang-format on */

/* --comm (k3_engine_comm_arg resolves it). The help names what this build has. */
#if defined(K3_NCCL_EMULATE)
#define K3_COMM_BUILD_HAS "mpi, nccl (emulated: the NCCL stand-in over MPI)"
#elif defined(K3_HAVE_NCCL)
#define K3_COMM_BUILD_HAS "mpi, nccl (not yet run on a device)"
#else
#define K3_COMM_BUILD_HAS "mpi only"
#endif
/* clang-format off */
#define K3_COMM_FLAG                                                                               \
    {"comm", K3_FLAG_STR, "NAME", "auto",                                                          \
     "transport between ranks: auto (nccl when --backend is cuda and the build has it, else "     \
     "mpi), mpi, or nccl (MoE rows move as device buffers: needs --backend cuda and a K3_NCCL "   \
     "build); this build: " K3_COMM_BUILD_HAS}
/* clang-format on */

/* Entries of a k3_flag table (k3_engine_args reads them by name). */
/* clang-format off */
#define K3_ENGINE_FLAGS                                                                            \
    {"pp", K3_FLAG_INT, "S", "1", "pipeline stages (under mpirun; world = S x E [+1])"},           \
    {"ep", K3_FLAG_INT, "E", "1", "expert-parallel lanes per stage (under mpirun)"},               \
    {"coordinator", K3_FLAG_STR, "MODE", "shared",                                                 \
     "shared (rank 0 is also stage 0 lane 0) or dedicated"},                                       \
    {"expert-map", K3_FLAG_STR, "FILE", NULL,                                                      \
     "expert -> lane map (partition/k3_partition.h format)"},                                      \
    {"deterministic", K3_FLAG_BOOL, NULL, NULL,                                                    \
     "per-(token, expert) combine: logits bit-identical for every split"},                         \
    {"comm-timeout", K3_FLAG_FLOAT, "SEC", "600", "limit of every blocking wait between ranks"},   \
    {"load-timeout", K3_FLAG_FLOAT, "SEC", "0",                                                    \
     "limit of the whole load (0 = 60 s + the largest rank's planned bytes at 50 MB/s); a rank "   \
     "with no load progress for --comm-timeout is named sooner"},                                  \
    {"load-readers", K3_FLAG_INT, "N", "0",                                                        \
     "reads in flight per rank while loading, each a few MB (0 = " K3_ENGINE_ARGS_STR(            \
         K3_LOAD_READERS_DEFAULT) "; 1 = one read at a time)"},                                    \
    {"load-private", K3_FLAG_BOOL, NULL, NULL,                                                     \
     "every rank reads and holds its own copy of its stage's dense weights (default: the ranks "   \
     "of one stage on one node read them once: cpu ranks share one copy in node memory, cuda "     \
     "ranks on nccl get theirs from the reader)"},                                                 \
    {"load-direct", K3_FLAG_BOOL, NULL, NULL,                                                      \
     "read the checkpoint with O_DIRECT (no page cache) where the file system allows it; else "   \
     "buffered, said once"},                                                                       \
    {"load-mmap", K3_FLAG_BOOL, NULL, NULL,                                                        \
     "cpu: map the checkpoint's files instead of reading them (the weights are the page cache's "  \
     "own pages: a warm load copies nothing and one node holds them once; mapped by 2 MB "        \
     "entries where the file system's cache holds large folios, said at load)"},                  \
    {"threads", K3_FLAG_INT, "N", "0",                                                             \
     "cpu threads per rank (0 = the cores of its binding; --bind none: all alone, 1 under "        \
     "mpirun)"},                                                                                   \
    {"backend", K3_FLAG_STR, "NAME", "auto",                                                       \
     "kernel backend: auto (cuda when compiled in, a device is visible and every op is ported; "   \
     "else cpu, saying why), cpu, ref, guard (a test backend: cpu ops on memory host code cannot " \
     "touch) or cuda (builds with K3_CUDA)"},                                                      \
    K3_COMM_FLAG,                                                                                  \
    {"cuda-graphs", K3_FLAG_STR, "on|off", "on",                                                   \
     "cuda: run each decode step as a CUDA graph, captured once per padded batch size (1, 2, 4, " \
     "... up to --max-seqs) and replayed; off: every op launched on its own. Other backends: "    \
     "ignored (said once)"},                                                                       \
    {"kda-chunk", K3_FLAG_INT, "C", "0",                                                           \
     "KDA form: 0/1 = recurrent (bit-exact), C >= 2 = chunked, C tokens"},                         \
    {"max-seqs", K3_FLAG_INT, "N", K3_ENGINE_ARGS_STR(K3_ENGINE_DEFAULT_MAX_SEQS),                 \
     "sequence slots per lane: requests running at once on each lane"},                           \
    {"max-ctx", K3_FLAG_INT, "T", K3_ENGINE_ARGS_STR(K3_ENGINE_DEFAULT_MAX_CTX),                   \
     "tokens per sequence, prompt + generated; a longer request fails alone"},                     \
    {"kv-cache-tokens", K3_FLAG_INT, "N", "0",                                                     \
     "paged MLA cache per lane, in tokens (0 = max-seqs x max-ctx); requests wait for room"},      \
    {"no-prefix-cache", K3_FLAG_BOOL, NULL, NULL,                                                  \
     "turn the prefix cache off (on by default: a prompt that starts with a cached prefix shares " \
     "its MLA blocks and restores its KDA state snapshot instead of running it again)"},           \
    {"prefix-cache-tokens", K3_FLAG_INT, "N", "0",                                                 \
     "tokens of a lane's paged cache the prefix cache may hold (0 = all of --kv-cache-tokens; "    \
     "least recently used unused blocks are evicted first)"},                                      \
    {"max-batch-tokens", K3_FLAG_INT, "T", K3_ENGINE_ARGS_STR(K3_ENGINE_DEFAULT_MAX_BATCH_TOKENS), \
     "tokens per forward step of one lane (decode rows + prefill chunks)"},                        \
    {"chunk", K3_FLAG_INT, "C", "0",                                                               \
     "prefill tokens per sequence per step (0 = up to --max-batch-tokens)"},                       \
    {"micro-batches", K3_FLAG_INT, "M", "0",                                                       \
     "micro-batches in flight through the pipeline (0 = one per stage)"},                          \
    K3_BIND_FLAG,                                                                                  \
    {"verify", K3_FLAG_BOOL, NULL, NULL,                                                           \
     "after loading, check each rank's own tensors for NaN/Inf and E8M0 0xFF scales (cost shown)"}
/* clang-format on */

/* The K3_ENGINE_FLAGS of `a` into *o (model_dir, tok and progress are the caller's).
 * Returns 0, or 2 for a usage error, printed as one line "k3 <cmd>: --flag: ..." when `print`
 * (rank 0 under mpirun: every rank decides the same, one prints). */
int k3_engine_args(const k3_args *a, bool print, k3_engine_opts *o);
/* The valid range [lo, hi] of an integer flag of K3_ENGINE_FLAGS (the one table k3_engine_args
 * checks; `k3 plan` applies it to its capacity flags); false for a flag without one. */
bool k3_engine_flag_range(const char *flag, int64_t *lo, int64_t *hi);
/* Whether --backend NAME is one the flag takes (auto, cpu, ref, guard, cuda; a build without
 * K3_CUDA refuses cuda when the engine creates the backend). */
bool k3_engine_backend_ok(const char *name);
/* --backend NAME as the engine takes it: "auto" resolved (k3_backend_resolve); when `print`, one
 * log line says what auto chose and why. */
const char *k3_engine_backend_pick(const char *name, bool print);
/* The log line of --backend auto (what it chose and why; nothing for a named backend), once the
 * command's other flags are known to be good (k3_engine_args picks silently). */
void k3_engine_backend_say(const k3_args *a, bool print);
/* --comm NAME for the engine, given the backend it runs (already resolved from auto): "auto" is
 * "nccl" when backend is "cuda" and this build has the nccl transport, else "mpi" (silently: the
 * engine logs the transport it opened, and `k3 version` the rule). "nccl" needs that build and
 * the cuda backend (its MoE exchange moves device buffers). Returns 0 with *out set, or 2 for a
 * usage error, printed as "k3 <cmd>: --comm: ..." when `print`. */
int k3_engine_comm_arg(const k3_args *a, const char *backend, bool print, const char **out);
/* The transports this build has ("mpi" or "mpi nccl") and, for `k3 version`, how nccl is built:
 * "" (no nccl), "NCCL stand-in over MPI, emulated" or "libnccl, not yet run on a device". */
const char *k3_engine_transports(void);
const char *k3_engine_nccl_kind(void);
/* --bind MODE: "auto" or "none" into *mode; 2 (printed when `print`) otherwise, 0 ok. */
int k3_engine_bind_arg(const k3_args *a, bool print, const char **mode);

#endif /* K3_ENGINE_ARGS_H */
