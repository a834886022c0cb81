#!/usr/bin/env bash
# bench-oldnew.sh — two builds of k3 against each other on this machine, interleaved (never
# pass/fail; STYLE.md §22): whether a change kept the CPU speed. In each of REPS rounds, for each
# thread count, the OLD build's bench_forward runs, then the NEW one's, on the same small
# checkpoint (--prompt 512, --decode 64), so both runs of a pair share the host's phase; then
# `k3 bench throughput` (16 random prompts of 128 tokens, 32 new each, 16 at once: the batched
# decode path) the same way. Prints, per line, the median over the rounds of each build and the
# median of the per-round new/old ratios with how many rounds new led; writes $OUT/oldnew.json.
#
# Usage: OLD=dir NEW=dir scripts/bench-oldnew.sh   (build dirs holding k3 and tests/bench_forward)
#        REPS=4 THREADS="1 2" OUT=dir (default $NEW/bench-oldnew)
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${OLD:?OLD=build dir of the old build}
NEW=${NEW:?NEW=build dir of the new build}
REPS=${REPS:-4}
THREADS=${THREADS:-1 2}
OUT=${OUT:-$NEW/bench-oldnew}
mkdir -p "$OUT"
MODEL="$OUT/small"
[ -f "$MODEL/config.json" ] || "$NEW/k3" make-tiny "$MODEL" --preset small >/dev/null 2>&1
for b in "$OLD" "$NEW"; do
  for f in k3 tests/bench_forward; do
    [ -x "$b/$f" ] || { echo "bench-oldnew: $b/$f is missing" >&2; exit 1; }
  done
done
for r in $(seq 1 "$REPS"); do
  for t in $THREADS; do
    for side in old new; do
      b=$OLD; [ $side = new ] && b=$NEW
      "$b/tests/bench_forward" --model "$MODEL" --threads "$t" --prompt 512 --decode 64 --reps 2 \
        --json "$OUT/fwd-$side-t$t-r$r.json" >"$OUT/fwd-$side-t$t-r$r.log" 2>&1 ||
        { echo "bench-oldnew: bench_forward ($side, $t threads) failed: $OUT/fwd-$side-t$t-r$r.log" >&2; exit 1; }
      "$b/k3" bench throughput --model "$MODEL" --threads "$t" --input-len 128 --output-len 32 \
        --num-prompts 16 --max-concurrency 16 --max-seqs 16 --output-json "$OUT/tp-$side-t$t-r$r.json" \
        >"$OUT/tp-$side-t$t-r$r.log" 2>&1 ||
        { echo "bench-oldnew: bench throughput ($side, $t threads) failed: $OUT/tp-$side-t$t-r$r.log" >&2; exit 1; }
    done
  done
done
python3 - "$OUT" "$REPS" "$THREADS" <<'EOF'
import json, statistics, sys, os
out, reps, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
def fwd(path, key):
    j = json.load(open(path))
    m = j["models"][0] if "models" in j else j
    return m[key]
def tp(path):
    j = json.load(open(path))
    r = j["results"][0] if "results" in j else j
    return r["output_tokens_per_second"]
rows, res = [], {}
for t in threads:
    for name, get in (("decode tok/s", lambda p: fwd(p, "decode_tok_s")),
                      ("prefill tok/s", lambda p: fwd(p, "prefill_tok_s")),
                      ("batched output tok/s (16 seqs)", tp)):
        kind = "tp" if name.startswith("batched") else "fwd"
        o = [get(f"{out}/{kind}-old-t{t}-r{r}.json") for r in range(1, reps + 1)]
        n = [get(f"{out}/{kind}-new-t{t}-r{r}.json") for r in range(1, reps + 1)]
        ratio = [b / a for a, b in zip(o, n)]
        led = sum(x >= 1 for x in ratio)
        rows.append((f"{name}, {t} thr", statistics.median(o), statistics.median(n),
                     statistics.median(ratio), led))
        res[f"{name}, {t} threads"] = {"old": o, "new": n, "new_over_old": ratio}
print(f"| line | old (median) | new (median) | new/old (median of rounds) | rounds new >= old |")
print(f"|---|---|---|---|---|")
for name, a, b, q, led in rows:
    print(f"| {name} | {a:.1f} | {b:.1f} | {q:.3f} | {led} of {reps} |")
json.dump(res, open(os.path.join(out, "oldnew.json"), "w"), indent=1)
EOF
