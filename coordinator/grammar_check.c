/* grammar_check.c — a cheap structural pass over a JSON Schema, run before anything costly is done
 * with the request (rendering the prompt, tokenizing it, compiling the grammar): one visit of the
 * schema nodes reachable from the root, linear in the schema. It refuses what the compile would
 * refuse anyway, only sooner: a chain of more $ref -> $ref hops than K3_GRAMMAR_MAX_NEST (or a
 * cycle of them), and more reachable schema nodes than K3_GRAMMAR_MAX_STATES (each builds at
 * least one automaton state). Anything it lets through is still checked by the compile. */
#include "grammar_internal.h"

#include <stdio.h>
#include <stdlib.h>

enum { K_SEEN = 20, K_HOPS = 21 }; /* g_node_rule_get kinds of this pass (the compile: -1..6) */

const k3_chat_json *g_pointer(g_tables *t, const k3_chat_json *root, const char *ref,
                              k3_status *err) {
    if (!ref || ref[0] != '#') return NULL;
    const k3_chat_json *n = root;
    const char *p = ref + 1;
    while (*p == '/' && n) {
        p++;
        char key[256];
        size_t k = 0;
        while (*p && *p != '/' && k + 1 < sizeof key) {
            if (p[0] == '~' && p[1] == '1')
                key[k++] = '/', p += 2;
            else if (p[0] == '~' && p[1] == '0')
                key[k++] = '~', p += 2;
            else
                key[k++] = *p++;
        }
        key[k] = 0;
        int64_t at = g_member(t, n, key, k, err);
        n = at >= 0 ? n->items[at] : NULL;
    }
    return n && !*p ? n : NULL;
}

static const k3_chat_json *ref_of(const k3_chat_json *n) {
    const k3_chat_json *r = n && n->kind == K3_JSON_OBJECT ? k3_chat_json_get(n, "$ref") : NULL;
    return r && r->kind == K3_JSON_STRING ? r : NULL;
}

/* The $ref nodes of the chain from node n ($ref -> $ref -> ...), memoized per node so every
 * chain is walked once. The compile follows K3_GRAMMAR_MAX_NEST hops past the first: more than
 * CHAIN_MAX nodes is refused (a cycle counts as too many). */
#define CHAIN_MAX (K3_GRAMMAR_MAX_NEST + 1)
static int chain_len(g_tables *t, const k3_chat_json *root, const k3_chat_json *n, k3_status *err) {
    const k3_chat_json *path[CHAIN_MAX + 1];
    int len = 0, tail = 0;
    while (len <= CHAIN_MAX) {
        const k3_chat_json *r = ref_of(n);
        if (!r) break; /* the chain ends at a node that is not a $ref (or does not resolve) */
        int32_t known = g_node_rule_get(t, n, K_HOPS, -1, err);
        if (known >= 0) {
            tail = known;
            break;
        }
        path[len++] = n;
        n = g_pointer(t, root, r->s, err);
    }
    const int total = len + tail;
    if (total > CHAIN_MAX) return total; /* refused: nothing to remember */
    for (int i = 0; i < len; i++) g_node_rule_get(t, path[i], K_HOPS, total - i, err);
    return total;
}

/* The subschemas of node n that a compile may build (keywords it refuses are walked too: they
 * are refused anyway, and walking them costs no more than the schema's size). */
static bool push(const k3_chat_json ***st, int64_t *n, int64_t *cap, const k3_chat_json *v) {
    if (!v || (v->kind != K3_JSON_OBJECT && v->kind != K3_JSON_ARRAY)) return true;
    if (*n == *cap) {
        int64_t nc = *cap ? 2 * *cap : 256;
        const k3_chat_json **q = realloc((void *)*st, (size_t)nc * sizeof *q);
        if (!q) return false;
        *st = q, *cap = nc;
    }
    (*st)[(*n)++] = v;
    return true;
}

k3_status k3_grammar_schema_check(const k3_chat_json *schema, const char *where) {
    static const char *const ONE[] = {"additionalProperties",
                                      "items",
                                      "not",
                                      "contains",
                                      "propertyNames",
                                      "if",
                                      "then",
                                      "else",
                                      "unevaluatedItems",
                                      "unevaluatedProperties",
                                      "additionalItems",
                                      NULL};
    static const char *const MANY[] = {"anyOf", "oneOf", "allOf", "prefixItems", "items", NULL};
    static const char *const MAP[] = {"properties", "patternProperties", "dependentSchemas", NULL};
    if (!schema || schema->kind != K3_JSON_OBJECT) return K3_OK;
    g_tables *t = g_tables_new();
    if (!t) return K3_ERR(K3_ERR_NOMEM, "schema check");
    const k3_chat_json **st = NULL;
    int64_t n = 0, cap = 0, nodes = 0;
    k3_status err = K3_OK;
    bool ok = push(&st, &n, &cap, schema);
    while (ok && n && err == K3_OK) {
        const k3_chat_json *v = st[--n];
        if (v->kind == K3_JSON_ARRAY) { /* a list of subschemas */
            for (size_t i = 0; ok && i < v->n_items; i++)
                if (v->items[i]->kind == K3_JSON_OBJECT) ok = push(&st, &n, &cap, v->items[i]);
            continue;
        }
        if (g_node_rule_get(t, v, K_SEEN, 1, &err) >= 0) continue; /* visited */
        if (++nodes > K3_GRAMMAR_MAX_STATES) {
            err = K3_ERR(K3_ERR_ARG,
                         "more than %d schema nodes reachable: the state budget (%d states) at "
                         "%s",
                         K3_GRAMMAR_MAX_STATES, K3_GRAMMAR_MAX_STATES, where);
            break;
        }
        const k3_chat_json *r = ref_of(v);
        if (r) {
            if (chain_len(t, schema, v, &err) > CHAIN_MAX) {
                if (err == K3_OK)
                    err = K3_ERR(K3_ERR_ARG,
                                 "a chain of more than %d $ref (or a cycle of them) from '%.80s': "
                                 "the nesting budget at %s",
                                 K3_GRAMMAR_MAX_NEST, r->s, where);
                break;
            }
            const k3_chat_json *to = g_pointer(t, schema, r->s, &err);
            if (to && to->kind == K3_JSON_OBJECT) ok = push(&st, &n, &cap, to);
        }
        for (int i = 0; ok && ONE[i]; i++) {
            const k3_chat_json *s = k3_chat_json_get(v, ONE[i]);
            if (s && s->kind == K3_JSON_OBJECT) ok = push(&st, &n, &cap, s);
        }
        for (int i = 0; ok && MANY[i]; i++) {
            const k3_chat_json *s = k3_chat_json_get(v, MANY[i]);
            if (s && s->kind == K3_JSON_ARRAY) ok = push(&st, &n, &cap, s);
        }
        for (int i = 0; ok && MAP[i]; i++) {
            const k3_chat_json *m = k3_chat_json_get(v, MAP[i]);
            for (size_t k = 0; ok && m && m->kind == K3_JSON_OBJECT && k < m->n_items; k++)
                if (m->items[k]->kind == K3_JSON_OBJECT) ok = push(&st, &n, &cap, m->items[k]);
        }
    }
    if (!ok && err == K3_OK) err = K3_ERR(K3_ERR_NOMEM, "schema check");
    free((void *)st);
    g_tables_free(t);
    return err;
}
