/* grammar_internal.h — the automaton builder shared by grammar.c (automaton, vocabulary trie,
 * matcher, masks, cache) and grammar_schema.c (JSON Schema / regex / envelope -> automaton).
 *
 * A grammar is a set of rules (a recursive transition network = a pushdown automaton): each rule
 * is an NFA over symbols with epsilon edges and CALL edges (push the return state, enter another
 * rule's start). A rule ends in its `end` state; reaching it pops the stack. The builder works on
 * fragments: every emit function takes the state it starts from and returns the state it ends in.
 * Epsilon edges are removed at finish (each state takes the edges and finality of its closure). */
#ifndef K3_GRAMMAR_INTERNAL_H
#define K3_GRAMMAR_INTERNAL_H

#include "k3_grammar.h"

#define G_MAX_STATES K3_GRAMMAR_MAX_STATES /* a schema that needs more is refused (K3_ERR_ARG) */

/* The compile's clock: its time budget and the caller's cancel poll. */
typedef struct g_limit {
    double t0, budget_s, next_poll;
    bool (*cancelled)(void *arg);
    void *arg;
    uint32_t tick;
    const char *what; /* the spec's request key (messages) */
} g_limit;
/* False (and *err set once) when the budget is spent or the caller cancelled; checks the clock
 * about every `every` calls. */
bool g_limit_ok(g_limit *l, k3_status *err, uint32_t every);

typedef enum { GE_SYM = 0, GE_EPS, GE_CALL } g_edge_kind;
typedef struct g_edge {
    int32_t from, to; /* CALL: `to` is the return state */
    int32_t rule;     /* CALL: the rule entered */
    uint16_t lo, hi;  /* SYM: symbols [lo, hi] */
    uint8_t kind;
} g_edge;

typedef struct g_build {
    int32_t n_states, cap_states;
    uint8_t *is_end; /* (n_states) a rule's end state */
    g_edge *e;       /* (n_e) */
    int64_t n_e, cap_e;
    int32_t *rule_start, *rule_end; /* (n_rules) */
    int32_t n_rules, cap_rules;
    k3_status err; /* first error; every emit is a no-op after it */
    g_limit *lim;
    char where[256]; /* the schema keyword being built (the state budget's message) */
} g_build;

int32_t gb_state(g_build *b);
void gb_sym(g_build *b, int32_t from, uint16_t lo, uint16_t hi, int32_t to);
void gb_eps(g_build *b, int32_t from, int32_t to);
void gb_call(g_build *b, int32_t from, int32_t rule, int32_t ret);
/* A new rule (its start and end states); returns its index. */
int32_t gb_rule(g_build *b);
/* Literal bytes from `from`; returns the state after them. */
int32_t gb_lit(g_build *b, int32_t from, const char *s, size_t n);
/* One UTF-8 encoded character of any code point except the ASCII bytes not in `ascii_ok` (a
 * 128-entry table); returns the state after it. */
int32_t gb_utf8_char(g_build *b, int32_t from, const bool ascii_ok[128]);

/* grammar_bounds.c: a number (integer: no fraction) within JSON Schema's bounds, kw = the values
 * of minimum, exclusiveMinimum, maximum, exclusiveMaximum, multipleOf (each NULL when absent;
 * multipleOf for integers only); a JSON string of mn..mx code points (mx < 0: no limit). Both
 * return the state after the value; a bound no value meets, or a bad keyword value, sets b->err
 * naming `path`. */
int32_t gb_bounded_number(g_build *b, int32_t from, bool integer, const k3_chat_json *const kw[5],
                          const char *path);
int32_t gb_bounded_string(g_build *b, int32_t from, int mn, int mx);
/* grammar_tables.c: lookups that keep a compile linear in its schema (one set per compile). */
typedef struct g_tables g_tables;
g_tables *g_tables_new(void); /* NULL: out of memory */
void g_tables_free(g_tables *t);
/* The position of member k[0..n) in object o, or -1 (err set only when out of memory). */
int64_t g_member(g_tables *t, const k3_chat_json *o, const char *k, size_t n, k3_status *err);
/* grammar_check.c: the node a local "#/a/b" JSON pointer names in root, or NULL. */
const k3_chat_json *g_pointer(g_tables *t, const k3_chat_json *root, const char *ref,
                              k3_status *err);
/* The rule built for (node, kind), or -1; with rule >= 0 and none found, records it. */
int32_t g_node_rule_get(g_tables *t, const void *node, int kind, int32_t rule, k3_status *err);
/* A literal-trie step from `from` on sym (one edge per (state, sym): alternatives that share a
 * prefix share its states); g_trie_bytes: a byte string. Only trie states may be passed. */
int32_t g_trie_step(g_build *b, g_tables *t, int32_t from, uint16_t sym);
int32_t g_trie_bytes(g_build *b, g_tables *t, int32_t from, const char *p, size_t n);

/* grammar_schema.c: build the whole grammar for a spec; returns the root rule (< 0 on error,
 * with b->err set and the message naming the keyword). */
int32_t g_build_spec(g_build *b, const k3_grammar_spec *s);

#endif /* K3_GRAMMAR_INTERNAL_H */
