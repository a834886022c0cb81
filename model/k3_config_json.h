/* k3_config_json.h — k3_config → JSON, written once (model/config.c).
 *
 * Owns: the one serialisation of a k3_config's fields, with the checkpoint's own key names (the
 * Kimi-Linear `text_config` of config.json). k3_config_to_json (k3_model.h) wraps it into the
 * whole config.json that make-tiny writes; `k3 inspect --json` prints it as its "config" object
 * with the derived counts added. Parsing the object (k3_config_parse) gives back the config
 * (kda_a_log_len comes from the checkpoint header; mla_norm_eps and kda_gate_rank are fixed or
 * derived, not keys).
 * Callers must not: add config fields under other names beside it (one writer, one spelling).
 * Kept apart from k3_model.h so that including the model header does not pull in cJSON. */
#ifndef K3_CONFIG_JSON_H
#define K3_CONFIG_JSON_H

#include <cjson/cJSON.h>

#include "k3_model.h"

/* A new cJSON object (the caller owns it: cJSON_Delete) holding `c` as the `text_config` of
 * config.json, key for key; NULL when out of memory. */
cJSON *k3_config_json(const k3_config *c);

#endif /* K3_CONFIG_JSON_H */
