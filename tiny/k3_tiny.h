/* tiny — `k3 make-tiny`: a deterministic random K3 checkpoint of a preset's shapes, for the demo,
 * the tests and the CPU benchmarks (nothing is ever downloaded).
 *
 * Owns: the checkpoint writer (make_tiny.c: config.json, the safetensors index and shards,
 * tiktoken.model + tokenizer_config.json), k3's own byte-level BPE trainer that makes the
 * tokenizer (bpe.c), and the training corpus it embeds (tiny_corpus.c, generated from
 * tiny/data/tiny_corpus.txt by tiny/data/embed_corpus.py).
 * Uses model/'s public API only: the presets and the config JSON (k3_preset_config,
 * k3_config_to_json), the catalogue (k3_catalog) and the safetensors shard writer
 * (k3_st_write_shard), so the files it writes are the ones the loader reads.
 * Callers must not: expect a tokenizer that encodes real text well (it is trained on ~200 KB),
 * or any preset but tiny, small and deep (K3_PRESET_K3 is refused). model/ never includes this. */
#ifndef K3_TINY_H
#define K3_TINY_H

#include "k3_base.h"
#include "k3_model.h"

/* ---- the tiny / small / deep checkpoint writer -------------------------------------------- */
/* Write a deterministic random checkpoint of preset `p` into `dir` (created if absent):
 * config.json, the index, >= 3 shards, the tokenizer files. Same (p, seed) -> byte-identical
 * files. K3_ERR_ARG for K3_PRESET_K3. */
k3_status k3_make_tiny(const char *dir, k3_preset p, uint64_t seed);
/* The same; dense: every layer's FFN dense (first_k_dense_replace = the layer count), a model
 * without MoE layers (`k3 make-tiny --dense`). */
k3_status k3_make_tiny_dense(const char *dir, k3_preset p, uint64_t seed, bool dense);

/* ---- tokenizer training ------------------------------------------------------------------ */
typedef struct k3_bpe_vocab {
    int n;          /* ranks 0..n-1 */
    uint8_t *bytes; /* all token bytes back to back */
    int64_t *off;   /* [n + 1]: token r = bytes[off[r] .. off[r+1]) */
} k3_bpe_vocab;
/* 256 single bytes in GPT-2 order (rank -> byte). */
void k3_bpe_byte_order(uint8_t rank_to_byte[256]);
/* Byte-level BPE on `text` pre-split with the K3 regex (K3-CHAT.md §4.2): ranks 0..255 are the
 * bytes in GPT-2 order, then merges by highest pair count (ties: lowest merged byte sequence)
 * until n_ranks. If the corpus runs out of pairs first, the rest is filled deterministically
 * with concatenations of existing tokens (documented in bpe.c). */
k3_status k3_bpe_train(const char *text, size_t n_bytes, int n_ranks, k3_bpe_vocab *out);
void k3_bpe_vocab_free(k3_bpe_vocab *v);

#endif /* K3_TINY_H */
