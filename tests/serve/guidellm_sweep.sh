#!/usr/bin/env bash
# guidellm_sweep.sh — issue 32's acceptance run: guidellm's default sweep (synchronous, throughput
# at its 512 concurrent requests, then 8 constant rates between them) against `k3 serve` on the
# tiny model, each benchmark bounded to --seconds (default 5), and the verdict: 0 errored requests
# (the queue is bounded by memory, so 512 at once are queued, not refused with 429).
# Not a CTest test: it takes about 5 minutes. Needs `pip install guidellm` (0.8.x CLI).
#   usage: [K3_SWEEP_PRESET=small] tests/serve/guidellm_sweep.sh [BUILD_DIR] [--seconds S]
# Prints guidellm's per-benchmark lines and one verdict line; exit 0 only with 0 errors.
set -euo pipefail
build=${1:-build}
secs=5
[[ ${2:-} == --seconds ]] && secs=$3
k3="$build/k3"
command -v guidellm >/dev/null || { echo "guidellm is not installed (pip install guidellm)"; exit 2; }
work=$(mktemp -d)
server_pid=
cleanup() {
    [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
"$k3" make-tiny "$work/tiny" --preset "${K3_SWEEP_PRESET:-tiny}" >/dev/null 2>&1  # K3_SWEEP_PRESET=small: the acceptance
python3 - "$work/prompts.jsonl" <<'EOF'
import json, sys
with open(sys.argv[1], "w") as f:  # more prompts than the 512 the throughput stage keeps in flight
    for i in range(2000):
        f.write(json.dumps({"prompt": "Tell me about the number %d and why it matters" % i,
                            "output_tokens_count": 8}) + "\n")
EOF
"$k3" serve --model "$work/tiny" --port 0 --threads 1 --max-seqs 8 2>"$work/serve.log" &
server_pid=$!
port=
for _ in $(seq 100); do
    port=$(grep -o 'listening on http://127.0.0.1:[0-9]*' "$work/serve.log" | grep -o '[0-9]*$' || true)
    [[ -n $port ]] && break
    sleep 0.2
done
[[ -n $port ]] || { echo "k3 serve did not start"; cat "$work/serve.log"; exit 1; }
guidellm run --backend kind=openai_http,target="http://127.0.0.1:$port" --profile kind=sweep \
    --constraint kind=max_duration,seconds="$secs" \
    --data kind=json_file,path="$work/prompts.jsonl" \
    --output kind=json,path="$work/sweep.json" --disable-console-interactive \
    >"$work/guidellm.log" 2>&1 || { tail -30 "$work/guidellm.log"; exit 1; }
grep -E 'Benchmark [0-9]+ .*completed' "$work/guidellm.log" | sed 's/.*Benchmark/Benchmark/'
errored=$(grep -E 'Benchmark [0-9]+ .*completed' "$work/guidellm.log" |
          sed -E 's/.*errored=([0-9]+).*/\1/' | paste -sd+ | bc)
n=$(grep -cE 'Benchmark [0-9]+ .*completed' "$work/guidellm.log")
if [[ $errored -ne 0 ]]; then  # what the errored requests got, from guidellm's JSON
    python3 - "$work/sweep.json" <<'PYEOF'
import collections, json, sys
seen = collections.Counter()
def walk(x):
    if isinstance(x, dict):
        e = x.get("error")
        if isinstance(e, str) and e:
            seen[e[:300]] += 1
        for v in x.values():
            walk(v)
    elif isinstance(x, list):
        for v in x:
            walk(v)
walk(json.load(open(sys.argv[1])))
for e, k in seen.most_common(5):
    print("   error x%d: %s" % (k, e))
PYEOF
    grep -vE 'status=(200) ' "$work/serve.log" | grep -E 'status=' | head -5 || true
fi
echo "guidellm sweep: $n benchmarks, $errored errored requests, 429s in the server log:" \
     "$(grep -c 'status=429' "$work/serve.log" || true)"
[[ $n -ge 10 && $errored -eq 0 ]]
