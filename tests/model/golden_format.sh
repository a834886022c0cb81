#!/bin/bash
# golden_format.sh — re-make the tiny checkpoint with the golden's seed, check its shard hashes
# against tests/golden/format/manifest.json, then compare k3's decode bit for bit
# (test_model_golden). Needs K3_BIN, K3_SRC (set by ctest) and the test binary as $1.
set -u
G="$K3_SRC/tests/golden/format"
T=$(mktemp -d /tmp/k3-golden-format-XXXXXX)
trap 'rm -rf "$T"' EXIT
seed=$(python3 -c "import json,sys; print(json.load(open('$G/manifest.json'))['seed'])" 2>/dev/null ||
       grep -o '"seed": *[0-9]*' "$G/manifest.json" | grep -o '[0-9]*$')
"$K3_BIN" make-tiny "$T/m" --preset tiny --seed "$seed" 2>/dev/null || { echo "make-tiny failed"; exit 1; }
stale=0
for s in "$T"/m/model-*.safetensors; do
  name=$(basename "$s")
  want=$(grep -o "\"$name\": *\"[0-9a-f]*\"" "$G/manifest.json" | grep -o '[0-9a-f]\{64\}')
  got=$(sha256sum "$s" | cut -d' ' -f1)
  if [ "$want" != "$got" ]; then
    echo "FAIL: $name sha256 $got != golden ${want:-<absent>}: make-tiny's output changed, the golden is stale."
    echo "      regenerate with: python3 tests/reference/format_golden.py --k3 BUILD/k3   (see tests/reference/README.md)"
    stale=1
  fi
done
[ $stale = 0 ] || exit 1
exec "$1" "$T/m" "$G"
