#!/bin/bash
# cli_limits.sh — k3's size limits end to end (review findings): config values past k3's bounds
# fail fast in `k3 inspect` with one line naming the key and the limit (they used to overflow
# int64 or spin for minutes in the catalogue); a config inside the bounds whose totals overflow
# is an error, not "verdict OK" with zero counts; `k3 plan` bounds --max-ctx/--max-seqs/
# --max-tokens (they wrapped the cache sizes and exited 0).
set -u
T=$(mktemp -d /tmp/k3-limits-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail=0
check() { # check NAME WANT_RC NEEDLE -- command...   (stderr: one line; at most 20 s)
  local name=$1 want=$2 needle=$3; shift 4
  local rc
  timeout 20 "$@" >"$T/out" 2>"$T/err"; rc=$?
  if [ "$rc" != "$want" ] || ! grep -qF -- "$needle" "$T/err" || [ "$(wc -l <"$T/err")" != 1 ]; then
    echo "FAIL $name: rc=$rc (want $want), stderr lacks '$needle' or is not one line:"
    head -3 "$T/err"; fail=1
  else
    echo "ok   $name"
  fi
}
# one config.json per mutation of the tiny preset's (python edits the JSON, no checkpoint needed)
"$K3_BIN" make-tiny "$T/m" >/dev/null 2>&1 || { echo "FAIL make-tiny"; exit 1; }
mut() { # mut NAME PYTHON-STATEMENT-ON-tc
  mkdir -p "$T/$1"; python3 - "$T/m/config.json" "$T/$1/config.json" "$2" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
tc = d["text_config"]
exec(sys.argv[3])
json.dump(d, open(sys.argv[2], "w"))
PY
}
mut hidden 'tc["hidden_size"] = 2**50'
check hidden-2p50 1 "text_config.hidden_size: 1125899906842624 exceeds k3's limit of 1048576" -- "$K3_BIN" inspect "$T/hidden"
mut headdim 'tc["linear_attn_config"]["head_dim"] = 10**9'
check kda-head-dim-1e9 1 "text_config.linear_attn_config.head_dim: 1000000000 exceeds k3's limit of 1048576" -- "$K3_BIN" inspect "$T/headdim"
mut experts 'tc["num_experts"] = 10**9'
check experts-1e9 1 "text_config.num_experts: 1000000000 exceeds k3's limit of 32767" -- "$K3_BIN" inspect "$T/experts"
mut vocab 'tc["vocab_size"] = 2**31'
check vocab-2p31 1 "text_config.vocab_size: 2147483648 exceeds k3's limit of 2147483647" -- "$K3_BIN" inspect "$T/vocab"
# inside every bound, but 2^20 KDA heads x 2^20 head dim x hidden 2^20 overflows the byte totals
mut totals 'tc.update(hidden_size=2**20); tc["linear_attn_config"].update(num_heads=2**20, head_dim=2**20)'
check totals-overflow 1 "overflows a 64-bit integer" -- "$K3_BIN" inspect "$T/totals"
if grep -q "verdict" "$T/out"; then echo "FAIL totals-overflow: printed a verdict"; fail=1; fi

check plan-max-ctx 2 "--max-ctx 9223372036854775807 is outside [1, 1073741824]" -- \
  "$K3_BIN" plan --preset tiny --max-ctx 9223372036854775807
check plan-max-tokens 2 "--max-tokens 4294967296 is outside [1, 16777216]" -- \
  "$K3_BIN" plan --preset tiny --max-tokens 4294967296
check plan-max-seqs 2 "--max-seqs 0 is outside" -- "$K3_BIN" plan --preset tiny --max-seqs 0
# inside the flag bounds but the product does not fit: the plan itself says so
check plan-cache-overflow 2 "cache bytes overflow 64 bits" -- \
  "$K3_BIN" plan --preset k3 --max-ctx 1073741824 --max-seqs 1048576
exit $fail
