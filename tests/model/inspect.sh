#!/bin/bash
# inspect.sh — `k3 make-tiny` + `k3 inspect` end to end: a good checkpoint passes (text and
# --json), corrupt copies exit non-zero with a message naming the file/tensor, usage errors exit 2,
# and the embedded tokenizer corpus equals model/data/tiny_corpus.txt.
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
"$K3_BIN" inspect "$T/m" --json | python3 -c "import json,sys; d=json.load(sys.stdin); c=d['config']; assert c['n_layers']==8 and len(d['shards'])>=3 and c['active_bytes_per_token']>0, d" \
  && echo "ok   json-parses" || { echo "FAIL json-parses"; fail=1; }
check preset-k3 0 "params   2779484478208 total" -- "$K3_BIN" inspect --preset k3
check usage 2 "" -- "$K3_BIN" inspect "$T/m" "$T/m"
check bad-preset 2 "--preset" -- "$K3_BIN" make-tiny "$T/x" --preset huge
check no-dir 1 "config.json: cannot read" -- "$K3_BIN" inspect "$T/nothing"

cp -r "$T/m" "$T/trunc"; truncate -s 100000 "$T/trunc/model-00003-of-00003.safetensors"
check truncated 1 "model-00003-of-00003.safetensors: tensor language_model." -- "$K3_BIN" inspect "$T/trunc"
cp -r "$T/m" "$T/noshard"; rm "$T/noshard/model-00001-of-00003.safetensors"
check missing-shard 1 "model-00001-of-00003.safetensors: cannot open shard" -- "$K3_BIN" inspect "$T/noshard"
cp -r "$T/m" "$T/hdr"; printf '\xff\xff\xff\x00\x00\x00\x00\x00' | dd of="$T/hdr/model-00002-of-00003.safetensors" conv=notrunc 2>/dev/null
check header-len 1 "header length 16777215 runs past the end" -- "$K3_BIN" inspect "$T/hdr"
cp -r "$T/m" "$T/json"; printf '[' | dd of="$T/json/model-00002-of-00003.safetensors" bs=1 seek=8 conv=notrunc 2>/dev/null
check bad-json 1 "model-00002-of-00003.safetensors: the header is not valid JSON" -- "$K3_BIN" inspect "$T/json"
cp -r "$T/m" "$T/cfg"; sed -i 's/"num_experts_per_token":\s*4/"num_experts_per_token": 40/' "$T/cfg/config.json"
check bad-config 1 "num_experts_per_token" -- "$K3_BIN" inspect "$T/cfg"
cp -r "$T/m" "$T/extra"; sed -i 's/"num_shared_experts":\s*1/"num_shared_experts": 2/' "$T/extra/config.json"
check wrong-shape 1 "shared_experts.gate_proj.weight is BF16 [64, 128], expected BF16 [128, 128]" -- "$K3_BIN" inspect "$T/extra"

# the corpus embedded in the binary == the file in the repo (tiny_corpus.c is generated)
if python3 - "$K3_SRC" <<'PY'
import re, sys, ast
src = sys.argv[1]
txt = open(src + "/model/data/tiny_corpus.txt", "rb").read()
c = open(src + "/model/tiny_corpus.c").read()
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
then echo "ok   corpus-embedded"; else echo "FAIL corpus-embedded: model/tiny_corpus.c is stale (python3 model/data/embed_corpus.py)"; fail=1; fi
exit $fail
