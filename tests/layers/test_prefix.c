/* test_prefix.c — the stage's side of the prefix cache (k3_layers.h "Prefix cache") on the tiny
 * checkpoint, on the backend named by argv[1] (default cpu; the gpuemu tier runs cuda):
 *  - KDA snapshot correctness: sequence A prefills p tokens (p a block boundary, in two uneven
 *    chunks) and is snapshotted; sequence B restores that snapshot with A's blocks below p. B's
 *    states equal A's at p, and after both prefill the rest and decode, their KDA + short-conv
 *    states and every logit are equal bit for bit, and equal to a sequence R that prefilled the
 *    whole prompt in one chunk without any snapshot;
 *  - block holders: B's shared blocks have two holders; a block the cache holds survives the
 *    end of every sequence that used it (not on the free list, not overwritten by a sequence that
 *    takes every free block), and a third sequence restored from it later still gets the same
 *    logits; the cache's drop returns it to the pool;
 *  - fork: two sequences forked mid-block share the full block, each copies the partial one and
 *    the states; one writes other tokens, the parent's logits stay those of R (copy-on-write),
 *    the other fork's too; every block is free again at the end;
 *  - misuse is refused: a restore off a block boundary or into a started sequence, a snapshot off
 *    a boundary, a hold of a free block.
 * Inputs come from a printed seed; logits are checked finite and not degenerate. */
#include "k3_layers.h"
#include "k3_test.h"
#include "layers/tiny_model.h"

#include <math.h>
#include <string.h>

/* sizes: the cpu run; the emulated cuda run (slow: every block of every kernel in turn, under
   ASan, its time by the token rows fed) takes the smaller ones of main (one restored block, a
   cache of 5 blocks: R, A and B at once). R stays until the filler D is done, so D fills only
   the blocks neither R nor the cache holds (cuda: 2 blocks, 128 tokens) */
enum { L_MAX = 200, N_DEC = 3, MAX_SEQS = 4, P_OFF = 6 /* a position off a block boundary */ };
static int L = 200, P_SNAP = 128, MAX_CTX = 512, KV = 640; /* KV: R, A and B at once */
static tiny_model g_m;
static k3_backend *g_be;
static k3_stage *g_s;
static k3_activ g_act;
static float *g_logits, *g_host; /* [L, V] backend, [V] host */
static const uint64_t k_seed = 4242;

/* nt tokens of ids from off through sequence st; its last-token logits into out [V]. */
static void feed(k3_seq_state *st, const int32_t *ids, int off, int nt, float *out) {
    const int64_t V = g_m.cfg.vocab_size;
    k3_seq_state *sts[1] = {st};
    int32_t n[1] = {nt};
    k3_batch b = {.n_seqs = 1, .states = sts, .n_tokens = n, .token_ids = ids + off};
    K3_CHECK_OK(k3_stage_forward(g_s, &b, &g_act, false, g_logits));
    K3_CHECK_OK(k3_backend_download(g_be, g_host, g_logits, (size_t)V * sizeof(float)));
    if (out) memcpy(out, g_host, (size_t)V * sizeof(float));
}

/* The rest of the prompt from `from`, then N_DEC decode steps: logits [1 + N_DEC, V]. */
static void finish(k3_seq_state *st, const int32_t *ids, int from, float *out) {
    const int64_t V = g_m.cfg.vocab_size;
    feed(st, ids, from, L - from, out);
    for (int d = 0; d < N_DEC; d++) feed(st, ids, L + d, 1, out + (d + 1) * V);
}

static void check_same(const float *a, const float *b, int64_t n, const char *what) {
    k3_check_same_bits(a, b, n, 1e-6, what);
}

int main(int argc, char **argv) {
    const char *bname = argc > 1 ? argv[1] : "cpu";
    if (strcmp(bname, "cuda") == 0) L = 80, P_SNAP = 64, MAX_CTX = 256, KV = 320;
    printf("test_prefix seed %llu backend %s\n", (unsigned long long)k_seed, bname);
    k3_backend_params bp = {.n_threads = 2};
    k3_status bs = k3_backend_create(bname, &bp, &g_be);
    if (bs != K3_OK) {
        printf("skip: backend %s: %s\n", bname, k3_last_error());
        return 77;
    }
    K3_CHECK_OK(tiny_make_on(&g_m, "tiny", 7, g_be));
    if (k3_t_fail) return k3_test_done("prefix");
    const k3_config *c = &g_m.cfg;
    const int64_t V = c->vocab_size;
    k3_stage_params sp = tiny_whole_stage(&g_m, g_be, L, MAX_SEQS, MAX_CTX, KV);
    sp.n_snapshots = 2;
    K3_CHECK_OK(k3_stage_create(&sp, &g_s));
    K3_CHECK_OK(k3_activ_alloc(g_be, &g_act, c, L));
    K3_CHECK_OK(
        k3_backend_alloc(g_be, (size_t)L * V * sizeof(float), "logits", (void **)&g_logits));
    const size_t sn = k3_stage_snapshot_bytes(g_s) / sizeof(float);
    K3_CHECK(sn > 0 && k3_stage_n_snapshots(g_s) == 2, "snapshot of %zu floats", sn);
    float *out[4], *stA_p, *stB_p, *stA, *stB, *stR;
    for (int i = 0; i < 4; i++)
        K3_CHECK_OK(k3_alloc((void **)&out[i], (size_t)(1 + N_DEC) * V * sizeof(float), "out"));
    float **sts[] = {&stA_p, &stB_p, &stA, &stB, &stR};
    for (size_t i = 0; i < K3_ARRAY_LEN(sts); i++)
        K3_CHECK_OK(k3_alloc((void **)sts[i], sn * sizeof(float), "states"));
    K3_CHECK_OK(k3_alloc((void **)&g_host, (size_t)V * sizeof(float), "host row"));
    if (k3_t_fail) return k3_test_done("prefix");

    k3_rng rng;
    k3_rng_seed(&rng, k_seed);
    int32_t ids[L_MAX + N_DEC];
    int distinct = 0;
    for (int t = 0; t < L + N_DEC; t++) {
        ids[t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)(V - 256));
        distinct += t > 0 && ids[t] != ids[t - 1];
    }
    K3_CHECK(distinct > L / 2, "degenerate prompt (%d changes)", distinct);

    /* R: the whole prompt in one chunk, no snapshot */
    k3_seq_state *R, *A, *B, *C;
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &R));
    finish(R, ids, 0, out[0]);
    K3_CHECK_OK(k3_seq_state_read(R, stR));
    /* A: p tokens in two uneven chunks, snapshot 1, then the rest */
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &A));
    feed(A, ids, 0, 37, NULL);
    feed(A, ids, 37, P_SNAP - 37, NULL);
    K3_CHECK(k3_seq_state_pos(A) == P_SNAP, "A at %lld", (long long)k3_seq_state_pos(A));
    K3_CHECK_OK(k3_stage_snapshot(g_s, A, 1));
    K3_CHECK_OK(k3_seq_state_read(A, stA_p));
    int32_t blk[L_MAX / K3_KV_BLOCK];
    for (int j = 0; j < P_SNAP / K3_KV_BLOCK; j++) {
        blk[j] = k3_seq_state_block(A, j);
        K3_CHECK(blk[j] >= 0 && k3_stage_block_holders(g_s, blk[j]) == 1, "A block %d: %d", j,
                 blk[j]);
    }
    /* B: restored at p from A's blocks and the snapshot: the same states, bit for bit */
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &B));
    K3_CHECK_OK(k3_seq_state_restore(B, P_SNAP, blk, 1));
    K3_CHECK_OK(k3_seq_state_read(B, stB_p));
    check_same(stA_p, stB_p, (int64_t)sn, "states at p: A vs B restored");
    K3_CHECK(k3_stage_block_holders(g_s, blk[0]) == 2 && k3_seq_state_pos(B) == P_SNAP,
             "shared block holders %d", k3_stage_block_holders(g_s, blk[0]));
    finish(A, ids, P_SNAP, out[1]);
    finish(B, ids, P_SNAP, out[2]);
    K3_CHECK_OK(k3_seq_state_read(A, stA));
    K3_CHECK_OK(k3_seq_state_read(B, stB));
    check_same(stA, stB, (int64_t)sn, "states at the end: A vs B (restored)");
    check_same(stR, stB, (int64_t)sn, "states at the end: R (one chunk) vs B (restored)");
    check_same(out[1], out[2], (1 + N_DEC) * V, "logits: A vs B (restored)");
    check_same(out[0], out[2], (1 + N_DEC) * V, "logits: R (one chunk) vs B (restored)");

    /* the cache holds A's blocks below p; A and B end; a sequence that takes every free block
       must not get them; C restored later gets the same logits. (R, which never held them, ends
       after D: D's tokens are the blocks left free, fewer with R's.) */
    for (int j = 0; j < P_SNAP / K3_KV_BLOCK; j++) K3_CHECK_OK(k3_stage_block_hold(g_s, blk[j]));
    k3_seq_state_destroy(A), k3_seq_state_destroy(B);
    int free_b, total_b;
    const int r_blocks = (int)((k3_seq_state_pos(R) + K3_KV_BLOCK - 1) / K3_KV_BLOCK);
    k3_stage_cache_usage(g_s, &free_b, &total_b);
    K3_CHECK(free_b == total_b - P_SNAP / K3_KV_BLOCK - r_blocks &&
                 k3_stage_block_holders(g_s, blk[0]) == 1,
             "after the sequences ended: %d of %d free (R holds %d)", free_b, total_b, r_blocks);
    k3_seq_state *D;
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &D));
    int32_t noise[512];
    for (int t = 0; t < MAX_CTX; t++) noise[t] = (int32_t)(k3_rng_u64(&rng) % (uint64_t)V);
    const int fill = free_b * K3_KV_BLOCK; /* D's tokens: exactly the free blocks */
    K3_CHECK(fill > 0 && fill <= MAX_CTX, "the filler's %d tokens (max_ctx %d)", fill, MAX_CTX);
    for (int off = 0; off < fill && free_b > 0; off += L) {
        feed(D, noise, off, K3_MIN(L, fill - off), NULL);
        k3_stage_cache_usage(g_s, &free_b, NULL);
    }
    K3_CHECK(free_b == 0, "the filler left %d blocks free", free_b);
    for (int j = 0; j < (int)(k3_seq_state_pos(D) / K3_KV_BLOCK); j++)
        for (int i = 0; i < P_SNAP / K3_KV_BLOCK; i++)
            K3_CHECK(k3_seq_state_block(D, j) != blk[i], "block %d in use was handed out", blk[i]);
    k3_seq_state_destroy(D), k3_seq_state_destroy(R);
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &C));
    K3_CHECK_OK(k3_seq_state_restore(C, P_SNAP, blk, 1));
    finish(C, ids, P_SNAP, out[3]);
    check_same(out[0], out[3], (1 + N_DEC) * V, "logits: R vs C (restored after others ran)");
    /* misuse */
    K3_CHECK_ERR(k3_seq_state_restore(C, P_SNAP, blk, 1), K3_ERR_STATE, "restore into");
    k3_seq_state_destroy(C);
    for (int j = 0; j < P_SNAP / K3_KV_BLOCK; j++) K3_CHECK_OK(k3_stage_block_drop(g_s, blk[j]));
    k3_stage_cache_usage(g_s, &free_b, &total_b);
    K3_CHECK(free_b == total_b, "the cache's drop: %d of %d free", free_b, total_b);
    K3_CHECK_ERR(k3_stage_block_hold(g_s, blk[0]), K3_ERR_STATE, "not in use");
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &C));
    K3_CHECK_ERR(k3_seq_state_restore(C, 70, NULL, 0), K3_ERR_STATE, "position 70");
    feed(C, ids, 0, P_OFF, NULL);
    K3_CHECK_ERR(k3_stage_snapshot(g_s, C, 0), K3_ERR_STATE, "not a block boundary");
    k3_seq_state_destroy(C);

    /* fork (n > 1 choices): F prefills a block and 6 tokens; G and H fork it there. They share
       F's full block, each has a copy of the partial one, and the same states. G writes other
       tokens into its copy: F's decode must not see them (copy-on-write); H goes on like F. */
    enum { P_FORK = K3_KV_BLOCK + 6 };
    k3_seq_state *F, *G, *H;
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &F));
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &G));
    K3_CHECK_OK(k3_seq_state_create(g_s, MAX_CTX, &H));
    feed(F, ids, 0, P_FORK, NULL);
    K3_CHECK_OK(k3_seq_state_fork(G, F));
    K3_CHECK_OK(k3_seq_state_fork(H, F));
    K3_CHECK_OK(k3_seq_state_read(F, stA_p));
    K3_CHECK_OK(k3_seq_state_read(G, stB_p));
    check_same(stA_p, stB_p, (int64_t)sn, "states at the fork: F vs G");
    K3_CHECK(k3_seq_state_pos(G) == P_FORK &&
                 k3_seq_state_block(G, 0) == k3_seq_state_block(F, 0) &&
                 k3_stage_block_holders(g_s, k3_seq_state_block(F, 0)) == 3,
             "fork: position %lld, block 0 %d (F's %d), %d holders", (long long)k3_seq_state_pos(G),
             k3_seq_state_block(G, 0), k3_seq_state_block(F, 0),
             k3_stage_block_holders(g_s, k3_seq_state_block(F, 0)));
    K3_CHECK(k3_seq_state_block(G, 1) >= 0 &&
                 k3_seq_state_block(G, 1) != k3_seq_state_block(F, 1) &&
                 k3_seq_state_block(H, 1) != k3_seq_state_block(G, 1) &&
                 k3_stage_block_holders(g_s, k3_seq_state_block(G, 1)) == 1,
             "fork: the partial block %d is not a copy (F's %d)", k3_seq_state_block(G, 1),
             k3_seq_state_block(F, 1));
    feed(F, ids, P_FORK, L - P_FORK, out[1]);
    feed(G, noise, 0, 10, NULL); /* G's own tokens into its copy of block 1 */
    for (int d = 0; d < N_DEC; d++) feed(F, ids, L + d, 1, out[1] + (d + 1) * V);
    check_same(out[0], out[1], (1 + N_DEC) * V, "logits: R vs F (forked, its fork wrote on)");
    finish(H, ids, P_FORK, out[2]);
    check_same(out[0], out[2], (1 + N_DEC) * V, "logits: R vs H (a fork of F)");
    K3_CHECK_ERR(k3_seq_state_fork(F, F), K3_ERR_ARG, "itself");
    k3_seq_state_destroy(F), k3_seq_state_destroy(G), k3_seq_state_destroy(H);
    k3_stage_cache_usage(g_s, &free_b, &total_b);
    K3_CHECK(free_b == total_b, "after the forks ended: %d of %d free", free_b, total_b);

    for (int i = 0; i < 4; i++) k3_free(out[i]);
    for (size_t i = 0; i < K3_ARRAY_LEN(sts); i++) k3_free(*sts[i]);
    k3_free(g_host);
    k3_backend_free(g_be, g_logits);
    k3_activ_free(g_be, &g_act);
    k3_stage_destroy(g_s);
    tiny_close(&g_m);
    k3_backend_destroy(g_be);
    return k3_test_done("prefix");
}
