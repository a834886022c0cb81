/* tokenizer_internal.h — the k3_tokenizer struct, shared by tokenizer.c (load, encode) and
 * tokenizer_decode.c (decode, streaming). Private to coordinator/tokenizer*.c: no other file may
 * include it (use k3_tokenizer.h). */
#ifndef K3_TOKENIZER_INTERNAL_H
#define K3_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "k3_tokenizer.h"
#include "k3_utf8.h"

typedef struct tok_trie_node {
    int32_t first_child;  /* index into trie, -1 = none */
    int32_t next_sibling; /* index into trie, -1 = none */
    int32_t special;      /* index into specials of the token ending here, -1 = none */
    uint8_t byte;         /* the edge byte leading to this node */
} tok_trie_node;

struct k3_tokenizer {
    /* ordinary tokens: rank == id */
    char *arena; /* (n_arena) all token bytes, concatenated */
    size_t n_arena;
    uint32_t *rank_off;     /* (n_ranks) offset of rank r's bytes in arena */
    int32_t *rank_len;      /* (n_ranks) length of rank r's bytes; -1 = no token has rank r */
    int64_t n_ranks;        /* max rank + 1 */
    int32_t *map;           /* (map_cap) open addressing bytes -> rank; -1 = empty slot */
    size_t map_cap;         /* power of two, >= 2 * number of tokens */
    int32_t byte_rank[256]; /* rank of each single byte (all 256 must exist) */
    /* special tokens */
    k3_tok_special *specials; /* (n_specials) content owned (strdup) */
    size_t *special_len;      /* (n_specials) strlen(content) */
    size_t n_specials;
    int32_t *id_special; /* (n_vocab) index into specials, -1 for ordinary / unused ids */
    int64_t n_vocab;     /* max id + 1 */
    tok_trie_node *trie; /* (n_trie) node 0 = root */
    size_t n_trie;
    k3_tok_ctrl ctrl;
    /* pre-tokenizer */
    /* Two compiled spellings of the pattern (tokenizer.c "PCRE2 spellings"): `re` for text
     * without a code point of K3_UC_DIFF_RANGES, `re_added` for text with one. In EXPLICIT mode
     * re_added is NULL and `re` is exact for all text. */
    pcre2_code *re, *re_added;
    bool jit, jit_added;   /* pcre2_jit_compile succeeded */
    bool explicit_classes; /* EXPLICIT mode */
    bool kimi_chunking;
};

/* Make room for `extra` more bytes + NUL (K3_ERR_NOMEM with a message). */
k3_status k3_tok_bytes_reserve(k3_tok_bytes *b, size_t extra);

#endif /* K3_TOKENIZER_INTERNAL_H */
