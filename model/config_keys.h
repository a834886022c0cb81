/* config_keys.h — the config key table (model/config.c), read-only.
 *
 * Owns: one row per config.json key k3 reads or writes: its name, the object that holds it, its
 * type, the k3_config field it fills, its bounds and its default. The parser
 * (k3_config_parse), the writer (k3_config_to_json, k3_config_json) and k3_config_validate all
 * walk this one table, so a key's name, bounds and default are written once. The rows are in
 * the order the writer prints them. Internal to model/ and its tests; callers use k3_model.h.
 * Callers must not: spell a config key anywhere else. */
#ifndef K3_CONFIG_KEYS_H
#define K3_CONFIG_KEYS_H

#include <stdint.h>

typedef enum {
    K3_CK_INT,   /* an integer that fits `int` */
    K3_CK_I64,   /* an integer, |v| <= 9e15 (exact in a double) */
    K3_CK_FLOAT, /* a finite number, stored as a finite float */
    K3_CK_BOOL,
    K3_CK_STR,  /* a string; every STR row k3 reads is K3_CK_CONST or parsed by its own code */
    K3_CK_OBJ,  /* a nested object: the rows with the matching K3_CO_* live in it */
    K3_CK_LIST, /* a list of 1-based layer numbers (k3_config.mixer) */
} k3_ck_type;

/* which object holds the key */
typedef enum {
    K3_CO_TOP,      /* config.json's top level */
    K3_CO_TEXT,     /* text_config (or the top level of a flat Kimi-Linear config) */
    K3_CO_LINEAR,   /* text_config.linear_attn_config */
    K3_CO_QUANT,    /* quantization_config */
    K3_CO_QGROUP,   /* quantization_config.config_groups.<any name> */
    K3_CO_QWEIGHTS, /* quantization_config.config_groups.<any name>.weights */
} k3_ck_obj;

/* when the key applies: read and checked (and, for K3_CW_SITU/LB/LATENT, written) only then */
typedef enum {
    K3_CW_ALL,
    K3_CW_MOE,    /* num_experts > 0 (written always) */
    K3_CW_SITU,   /* hidden_act is situ */
    K3_CW_LB,     /* the KDA gate has a lower bound (the key is present) */
    K3_CW_LATENT, /* routed_expert_hidden_size > 0 (written; read under K3_CW_MOE) */
} k3_ck_when;

enum {
    K3_CK_REQ = 1 << 0,     /* absent or null: "KEY: missing" */
    K3_CK_CONST = 1 << 1,   /* k3 supports one value (def or str): another is an error */
    K3_CK_NOREAD = 1 << 2,  /* written for other tools; k3 does not read it */
    K3_CK_OMIT0 = 1 << 3,   /* field 0 = not given: not written, exempt from lo */
    K3_CK_NULL0 = 1 << 4,   /* field 0 is written as null */
    K3_CK_SPECIAL = 1 << 5, /* read (and maybe written) by its own code in config.c */
    K3_CK_LO_OPEN = 1 << 6, /* float bounds: lo itself is outside */
    K3_CK_HI_OPEN = 1 << 7, /* float bounds: hi itself is outside */
};

typedef struct k3_config_key {
    const char *key; /* the JSON key within its object */
    uint8_t obj;     /* k3_ck_obj */
    uint8_t type;    /* k3_ck_type */
    uint8_t when;    /* k3_ck_when */
    uint16_t flags;  /* K3_CK_* */
    int off, size;   /* offsetof / sizeof the k3_config field; -1, 0 when it has none */
    double lo, hi;   /* numeric bounds (inclusive unless K3_CK_*_OPEN); +-HUGE_VAL = none */
    double def;      /* the value when absent (optional keys), or the one value (CONST) */
    const char *str; /* STR CONST: the one value */
    const char *why; /* a reason, appended to bound and value errors */
} k3_config_key;

/* The table and its row count. */
const k3_config_key *k3_config_keys(int *n_rows);

#endif /* K3_CONFIG_KEYS_H */
