#!/bin/bash
# inspect.sh — `k3 make-tiny` + `k3 inspect` end to end: a good checkpoint passes (text and
# --json), corrupt copies exit non-zero with a message naming the file/tensor, usage errors exit 2,
# and the embedded tokenizer corpus equals tiny/data/tiny_corpus.txt.
set -u
T=$(mktemp -d /tmp/k3-inspect-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail=0
check() { # check NAME EXPECTED_RC NEEDLE -- command...
  local name=$1 want=$2 needle=$3; shift 4
  local out rc
  out=$("$@" 2>&1); rc=$?
  if [ "$rc" != "$want" ] || ! grep -qF -- "$needle" <<<"$out"; then
    echo "FAIL $name: rc=$rc (want $want), output lacks '$needle':"; echo "$out" | tail -5; fail=1
  else
    echo "ok   $name"
  fi
}
"$K3_BIN" make-tiny "$T/m" >/dev/null 2>&1 || { echo "FAIL make-tiny"; exit 1; }
check good 0 "layers   k K K M K K M M" -- "$K3_BIN" inspect "$T/m"
check good-verdict 0 "verdict  OK" -- "$K3_BIN" inspect "$T/m"
check json 0 '"ok":true' -- "$K3_BIN" inspect "$T/m" --json
"$K3_BIN" inspect "$T/m" --json | python3 -c "import json,sys; d=json.load(sys.stdin); c=d['config']; assert c['num_hidden_layers']==8 and len(d['shards'])>=3 and c['active_bytes_per_token']>0, d" \
  && echo "ok   json-parses" || { echo "FAIL json-parses"; fail=1; }
# one config -> JSON writer (model/k3_config_json.h): inspect's "config" holds config.json's
# text_config key for key, with the same values, plus only the derived keys
"$K3_BIN" inspect "$T/m" --json | python3 -c "
import json, sys
c = json.load(sys.stdin)['config']
tc = json.load(open(sys.argv[1]))['text_config']
diff = [k for k in tc if c.get(k) != tc[k]]
extra = set(c) - set(tc) - {'layers', 'n_kda', 'n_mla', 'n_dense', 'n_moe', 'experts', 'kda_gate',
    'n_tensors', 'params_total', 'params_active', 'bytes_total', 'active_bytes_per_token', 'bytes_by_dtype'}
assert not diff and not extra, (diff, extra)
" "$T/m/config.json" && echo "ok   json-config-is-config.json" || { echo "FAIL json-config-is-config.json"; fail=1; }
# The real K3 (--preset k3) against published figures, never against k3's own output. Each
# tolerance is the rounding half-width of the published number (its last printed digit):
#   params total   ≈2.78T         spec/K3-MODEL.md §0 table ("params")       ± 0.005e12
#   params active  ≈104B          spec/K3-MODEL.md §0; DISTRIBUTED.md [S5]   ± 0.5e9
#   layer kinds    93 layers = 69 KDA + 24 MLA, 1 dense + 92 MoE: the multipliers of the GGUF
#                  tensor-count derivation in spec/K3-MODEL.md §6.2 ("4 global + 4×93 + 14×69
#                  (KDA) + 9×24 (MLA) + 3 (dense) + 11×92 (MoE) = 2573"; the sum is re-checked
#                  below so a mistyped multiplier cannot pass)                     exact
#   experts        82,432 experts, 17.55 MB each, ≈1.45 TB: spec/DISTRIBUTED.md ("checkpoint"
#                  row); k3's MXFP4 expert bytes are its U8 bytes                ± 0.005e6 / ± 0.005e12
#   checkpoint     ≈1.56 TB: K3-MODEL.md §6.1 / DISTRIBUTED.md. That figure includes the vision
#                  shards (95-96) k3 does not count, so k3's text-only total may be lower by
#                  up to 10 GB more than the rounding:               [1.555e12 - 10e9, 1.565e12)
if "$K3_BIN" inspect --preset k3 --json | python3 -c '
import json, sys
c = json.load(sys.stdin)["config"]
bad = []
def near(name, got, want, tol):
    if not abs(got - want) <= tol:
        bad.append(f"{name}: k3 {got} vs published {want} +- {tol}")
near("params_total", c["params_total"], 2.78e12, 0.005e12)
near("params_active", c["params_active"], 104e9, 0.5e9)
gguf = {"layers": 93, "kda": 69, "mla": 24, "dense": 1, "moe": 92}
if 4 + 4 * 93 + 14 * 69 + 9 * 24 + 3 * 1 + 11 * 92 != 2573:
    bad.append("GGUF derivation multipliers do not sum to 2573")
for k, key in [("layers", "num_hidden_layers"), ("kda", "n_kda"), ("mla", "n_mla"), ("dense", "n_dense"), ("moe", "n_moe")]:
    if c[key] != gguf[k]:
        bad.append(f"{key}: k3 {c[key]} vs {gguf[k]} (GGUF derivation)")
n_exp = c["n_moe"] * c["num_experts"]
if n_exp != 82432:
    bad.append(f"experts: k3 {n_exp} vs 82432")
u8 = c["bytes_by_dtype"].get("U8", 0)
near("bytes per expert", u8 / max(n_exp, 1), 17.55e6, 0.005e6)
near("expert bytes", u8, 1.45e12, 0.005e12)
tot = c["bytes_total"]
if not (1.555e12 - 10e9 <= tot < 1.565e12):
    bad.append(f"bytes_total: k3 {tot} vs published 1.56e12")
for b in bad:
    print("  ", b)
sys.exit(1 if bad else 0)
'; then echo "ok   preset-k3-published-figures"; else echo "FAIL preset-k3-published-figures"; fail=1; fi
check usage 2 "" -- "$K3_BIN" inspect "$T/m" "$T/m"
check bad-preset 2 "--preset" -- "$K3_BIN" make-tiny "$T/x" --preset huge
check no-dir 1 "config.json: cannot read the model config: cannot open: No such file or directory" -- "$K3_BIN" inspect "$T/nothing"

cp -r "$T/m" "$T/trunc"; truncate -s 100000 "$T/trunc/model-00003-of-00003.safetensors"
check truncated 1 "model-00003-of-00003.safetensors: tensor language_model." -- "$K3_BIN" inspect "$T/trunc"
cp -r "$T/m" "$T/noshard"; rm "$T/noshard/model-00001-of-00003.safetensors"
check missing-shard 1 "model-00001-of-00003.safetensors: cannot open shard" -- "$K3_BIN" inspect "$T/noshard"
# a FIFO as a shard (or as config.json): refused at open, never a hang in open() (issue 34 finding
# 4: inspect and run sat blocked there past every timeout); `timeout` turns a hang into rc 124
cp -r "$T/m" "$T/fifo"; rm "$T/fifo/model-00002-of-00003.safetensors"; mkfifo "$T/fifo/model-00002-of-00003.safetensors"
check fifo-shard-inspect 1 "model-00002-of-00003.safetensors: cannot open shard listed in model.safetensors.index.json: not a regular file (it is a FIFO)" -- timeout 20 "$K3_BIN" inspect "$T/fifo"
check fifo-shard-run 1 "not a regular file (it is a FIFO)" -- timeout 20 "$K3_BIN" run --model "$T/fifo" --prompt-ids 1,2 --n 1 --load-timeout 5
cp -r "$T/m" "$T/fifocfg"; rm "$T/fifocfg/config.json"; mkfifo "$T/fifocfg/config.json"
check fifo-config 1 "config.json: cannot read the model config: not a regular file (it is a FIFO)" -- timeout 20 "$K3_BIN" inspect "$T/fifocfg"
cp -r "$T/m" "$T/hdr"; printf '\xff\xff\xff\x00\x00\x00\x00\x00' | dd of="$T/hdr/model-00002-of-00003.safetensors" conv=notrunc 2>/dev/null
check header-len 1 "header length 16777215 runs past the end" -- "$K3_BIN" inspect "$T/hdr"
cp -r "$T/m" "$T/json"; printf '[' | dd of="$T/json/model-00002-of-00003.safetensors" bs=1 seek=8 conv=notrunc 2>/dev/null
check bad-json 1 "model-00002-of-00003.safetensors: the header is not valid JSON" -- "$K3_BIN" inspect "$T/json"
cp -r "$T/m" "$T/cfg"; sed -i 's/"num_experts_per_token":\s*4/"num_experts_per_token": 40/' "$T/cfg/config.json"
check bad-config 1 "num_experts_per_token" -- "$K3_BIN" inspect "$T/cfg"
cp -r "$T/m" "$T/extra"; sed -i 's/"num_shared_experts":\s*1/"num_shared_experts": 2/' "$T/extra/config.json"
check wrong-shape 1 "shared_experts.gate_proj.weight is BF16 [64, 128], expected BF16 [128, 128]" -- "$K3_BIN" inspect "$T/extra"

# more problems than the 1000 listed: the count printed is the real one (review: it printed the
# list's size). 64 experts instead of 16: 48 experts x 6 tensors x 7 MoE layers = 2016 missing.
cp -r "$T/m" "$T/many"; sed -i 's/"num_experts":\s*16/"num_experts": 64/' "$T/many/config.json"
if "$K3_BIN" inspect "$T/many" --json 2>"$T/many.err" | python3 -c '
import json, re, sys
d = json.load(sys.stdin)
err = open(sys.argv[1]).read()
n = d["n_problems"]
missing = sum(p.startswith("missing tensor") and ".experts." in p for p in d["problems"])
ok = n > 2016 and len(d["problems"]) == 1000 and missing > 900 and not d["ok"] \
    and re.search(r"k3 inspect: %d problems \(the first 1000 listed\)" % n, err)
sys.exit(0 if ok else 1)
' "$T/many.err"; then echo "ok   problem-count"; else echo "FAIL problem-count: $(cat "$T/many.err")"; fail=1; fi

# the corpus embedded in the binary == the file in the repo (tiny_corpus.c is generated)
if python3 - "$K3_SRC" <<'PY'
import re, sys, ast
src = sys.argv[1]
txt = open(src + "/tiny/data/tiny_corpus.txt", "rb").read()
c = open(src + "/tiny/tiny_corpus.c").read()
body = c[c.index("k3_tiny_corpus[] =") + 18: c.index(";\nconst size_t")]
parts = re.findall(r'"((?:[^"\\]|\\.)*)"', body)
out = bytearray()
for p in parts:
    i = 0
    while i < len(p):
        if p[i] == "\\":
            out.append(int(p[i + 1:i + 4], 8)); i += 4
        else:
            out += p[i].encode(); i += 1
n = int(re.search(r"k3_tiny_corpus_len = (\d+);", c).group(1))
sys.exit(0 if bytes(out) == txt and n == len(txt) else 1)
PY
then echo "ok   corpus-embedded"; else echo "FAIL corpus-embedded: tiny/tiny_corpus.c is stale (python3 tiny/data/embed_corpus.py)"; fail=1; fi
exit $fail
