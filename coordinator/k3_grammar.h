/* k3_grammar — constrained decoding on the coordinator: JSON Schema / regex / choice -> a pushdown
 * automaton over bytes and K3 markers, matched against the vocabulary through a token trie.
 *
 * Owns: the vocabulary index (every ordinary token's byte string in a trie, the four K3 control
 * ids as single symbols), the compiler (JSON Schema subset, regex subset, literal choices, the K3
 * answer envelope: thinking, response, tool calls in K3's XTML syntax), the compiled grammar
 * (immutable, reference-counted, its per-state token masks precomputed at compile), the matcher
 * (one per sequence: the live stacks) and a cache of compiled grammars keyed by their spec text.
 * Callers must not: share a matcher between sequences or threads; mutate a grammar (it is shared:
 * retain/release, atomic, so HTTP threads may compile while the engine thread samples).
 *
 * Symbols: bytes 0..255, then <|open|> <|close|> <|sep|> <|end_of_msg|> (K3_GSYM_OPEN...). Every
 * other special id is never allowed. Supported schema keywords and what is refused: docs/DESIGN.md
 * "Structured outputs"; an unsupported keyword is K3_ERR_ARG naming it and where it sits. */
#ifndef K3_GRAMMAR_H
#define K3_GRAMMAR_H

#include "k3_chat.h"
#include "k3_tokenizer.h"

enum { K3_GSYM_OPEN = 256, K3_GSYM_CLOSE, K3_GSYM_SEP, K3_GSYM_EOM, K3_GSYM_N };

/* ---- vocabulary index ------------------------------------------------------------------- */
typedef struct k3_grammar_vocab k3_grammar_vocab;
/* Index the byte strings of ids [0, n_vocab) (ids past the tokenizer are never allowed). */
k3_status k3_grammar_vocab_create(const k3_tokenizer *t, int64_t n_vocab, k3_grammar_vocab **out);
void k3_grammar_vocab_destroy(k3_grammar_vocab *v); /* NULL-safe */
int64_t k3_grammar_vocab_size(const k3_grammar_vocab *v);

/* ---- what to compile -------------------------------------------------------------------- */
typedef enum k3_grammar_content {
    K3_GC_FREE = 0, /* any text */
    K3_GC_NONE,     /* empty: the answer is tool calls only */
    K3_GC_JSON,     /* JSON text of `schema` (NULL schema: any JSON object) */
    K3_GC_REGEX,    /* bytes matching `regex` */
    K3_GC_CHOICE,   /* one of `choices` (a JSON array of strings) */
} k3_grammar_content;

typedef enum k3_grammar_tools {
    K3_GT_ANY = 0, /* a tools section may follow (calls typed by their parameters) */
    K3_GT_NONE,    /* no tool call */
    K3_GT_REQUIRED /* one or more calls (one when single_call) */
} k3_grammar_tools;

typedef struct k3_grammar_spec {
    bool bare;     /* the content alone: no K3 envelope (tests, bench) */
    bool thinking; /* the completion starts in `think`: free text until <|close|> */
    k3_grammar_content content;
    const k3_chat_json *schema;  /* K3_GC_JSON: borrowed */
    const char *regex;           /* K3_GC_REGEX (NUL-terminated) */
    const k3_chat_json *choices; /* K3_GC_CHOICE */
    k3_grammar_tools tools_mode;
    const k3_chat_json *tools; /* the request's OpenAI tools list (NULL: none) */
    const char *tool_name;     /* only this function (named tool_choice); NULL: any */
    bool single_call;          /* parallel_tool_calls false or a named function: one call */
    const char *what;          /* the request key, for error messages */
    /* Not part of the spec's identity (the cache key): how the compile may be stopped. */
    bool (*cancelled)(void *arg); /* polled about every 50 ms of compile (NULL: never) */
    void *cancel_arg;
    double budget_s; /* the compile's time budget (0: K3_GRAMMAR_BUDGET_S; the cache sets it) */
} k3_grammar_spec;

/* The compile's bounds. Past one: K3_ERR_ARG naming the bound (and, for states, the schema
 * keyword being built); cancelled: K3_ERR_STATE. Nothing in the compiler recurses on the depth of
 * the input beyond the JSON parser's nesting limit ($ref targets are built from a worklist). */
#define K3_GRAMMAR_BUDGET_S   10.0   /* --grammar-budget: seconds of compile */
#define K3_GRAMMAR_MAX_STATES 200000 /* automaton states */
#define K3_GRAMMAR_MAX_CFG    4096   /* live configurations (anyOf branches that still agree) */
#define K3_GRAMMAR_MAX_NEST   1000   /* calls entered without consuming input ($ref/anyOf chains) */
#define K3_GRAMMAR_CACHE_MB   256    /* the cache's byte budget (compiled grammars kept) */
#define K3_GRAMMAR_NICE       10     /* a cache miss compiles at this nice: the steps come first */

/* A cheap structural pass (linear in the schema) to run before anything costly is done with a
 * request: K3_ERR_ARG, naming the keyword, the bound and `where`, for a $ref chain longer than
 * K3_GRAMMAR_MAX_NEST (or a cycle) or more reachable schema nodes than K3_GRAMMAR_MAX_STATES, which
 * the compile would refuse too. A schema it passes is still checked by the compile. */
k3_status k3_grammar_schema_check(const k3_chat_json *schema, const char *where);

/* The compiles this thread runs from now on poll cancelled(arg) (a spec's own callback wins);
 * NULL: none. `k3 serve` sets it around a request's parse: a compile stops when its client
 * leaves or the server stops. */
void k3_grammar_thread_cancel(bool (*cancelled)(void *arg), void *arg);

/* ---- compiled grammar ------------------------------------------------------------------- */
typedef struct k3_grammar k3_grammar;
k3_status k3_grammar_compile(const k3_grammar_vocab *v, const k3_grammar_spec *s, k3_grammar **out);
k3_grammar *k3_grammar_retain(k3_grammar *g);
void k3_grammar_release(k3_grammar *g); /* NULL-safe; frees at the last release */
typedef struct k3_grammar_info {
    int64_t n_states, n_rules, n_masked_states, mask_bytes, bytes; /* bytes: all it holds */
    double compile_s;
} k3_grammar_info;
int64_t k3_grammar_vocab_size_of(const k3_grammar *g);
void k3_grammar_get_info(const k3_grammar *g, k3_grammar_info *out);

/* ---- matcher (per sequence) -------------------------------------------------------------- */
typedef struct k3_matcher k3_matcher;
k3_status k3_matcher_create(k3_grammar *g, k3_matcher **out); /* retains g */
void k3_matcher_destroy(k3_matcher *m);                       /* NULL-safe */
/* The allowed ids as bits (bit i of words[i / 64]), (n_vocab + 63) / 64 words. */
k3_status k3_matcher_mask(k3_matcher *m, uint64_t *words);
/* Advance by one id; K3_ERR_ARG when the id is not allowed here (nothing changes then). */
k3_status k3_matcher_accept(k3_matcher *m, int32_t id);
/* Advance by symbols (bytes < 256, markers >= 256); false (and no change) when rejected. */
bool k3_matcher_accept_syms(k3_matcher *m, const uint16_t *syms, size_t n);
/* Would id be accepted here? (The matcher itself, without masks: tests compare the two.) */
bool k3_matcher_allows(k3_matcher *m, int32_t id);
bool k3_matcher_can_end(const k3_matcher *m); /* the whole grammar is complete here */
bool k3_matcher_done(const k3_matcher *m);    /* complete, and nothing more can follow */

/* ---- cache of compiled grammars (thread-safe) --------------------------------------------- */
typedef struct k3_grammar_cache k3_grammar_cache;
/* `vocab` is owned by the cache; at most max_entries compiled grammars and max_bytes of them are
 * kept (LRU; a grammar larger than max_bytes is compiled but not kept). budget_s: each compile's
 * time budget (0: K3_GRAMMAR_BUDGET_S). */
k3_status k3_grammar_cache_create(k3_grammar_vocab *vocab, int max_entries, k3_grammar_cache **out);
void k3_grammar_cache_limits(k3_grammar_cache *c, int64_t max_bytes, double budget_s);
void k3_grammar_cache_destroy(k3_grammar_cache *c); /* NULL-safe */
/* A retained grammar for `s`, compiled once per distinct spec; *hit says whether it was cached. */
k3_status k3_grammar_cache_get(k3_grammar_cache *c, const k3_grammar_spec *s, k3_grammar **out,
                               bool *hit);
const k3_grammar_vocab *k3_grammar_cache_vocab(const k3_grammar_cache *c);

#endif /* K3_GRAMMAR_H */
