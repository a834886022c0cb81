#!/usr/bin/env bash
# messages.sh — the errors a new user meets first say the next step (issue 48):
#   --pp 2 without mpirun names the mpirun line; a folder that is not a checkpoint says so; a typo
#   of a flag names the flag meant, in two lines (no 50-line usage); a malformed --prompt-ids exits
#   2 with one line naming the prompt and id (as docs/USAGE.md says); `serve` on a busy port fails
#   before loading, in under 2 s; the help of batch and make-tiny is current.
set -u
K3=${K3_BIN:?K3_BIN not set}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0; pass=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1" >&2; echo "  stderr: $err" >&2; fail=$((fail+1)); fi; }
"$K3" make-tiny "$T/m" >/dev/null 2>&1 || { echo "FAIL: make-tiny"; exit 1; }
mkdir "$T/notmodel"

err=$("$K3" run --model "$T/m" --pp 2 --prompt-ids 1,2 --n 2 2>&1 >/dev/null); rc=$?
check "--pp 2 alone: exit 2, says to run it under mpirun -np 2" \
  "[ $rc = 2 ] && echo \"\$err\" | grep -q 'run it under mpirun -np 2'"
err=$("$K3" run --model "$T/m" --pp 2 --ep 2 --coordinator dedicated --prompt-ids 1 2>&1 >/dev/null)
check "--pp 2 --ep 2 dedicated alone: mpirun -np 5" "echo \"\$err\" | grep -q 'mpirun -np 5'"

for c in "run --prompt hi" "run --prompt-ids 1,2" "serve --port 0" "inspect" "bench"; do
  set -- $c
  if [ "$1" = inspect ]; then args=("$T/notmodel"); else args=(--model "$T/notmodel"); fi
  err=$(timeout 60 "$K3" "$@" "${args[@]}" 2>&1 >/dev/null); rc=$?
  check "k3 $c on a folder without config.json: one line, exit 1" \
    "[ $rc = 1 ] && echo \"\$err\" | grep -v '^\[k3' | grep -q -x \"k3 $1: not a K3 checkpoint: no config.json in $T/notmodel (.*)\""
done
err=$("$K3" batch --model "$T/notmodel" --input "$K3_SRC/examples/in.jsonl" --output "$T/o.jsonl" 2>&1 >/dev/null); rc=$?
check "k3 batch on a folder without config.json" "[ $rc = 1 ] && echo \"\$err\" | grep -q 'not a K3 checkpoint: no config.json in'"

err=$("$K3" run --model "$T/m" --max-ctxx 64 2>&1 >/dev/null); rc=$?
check "a typo: exit 2, did you mean --max-ctx?, a pointer to --help, two lines" \
  "[ $rc = 2 ] && [ \"\$(echo \"\$err\" | wc -l)\" = 2 ] &&
   echo \"\$err\" | head -1 | grep -q -x \"k3 run: unknown flag '--max-ctxx'; did you mean --max-ctx?\" &&
   echo \"\$err\" | tail -1 | grep -q -x \"run 'k3 run --help' for its flags\""
err=$("$K3" serve --prot=8000 2>&1 >/dev/null); rc=$?
check "a typo with =VALUE names the flag alone" "[ $rc = 2 ] && echo \"\$err\" | head -1 | grep -q \"unknown flag '--prot'; did you mean --port?\""
err=$("$K3" run --zzzzzz 2>&1 >/dev/null); rc=$?
check "no flag near: no suggestion, still two lines" \
  "[ $rc = 2 ] && [ \"\$(echo \"\$err\" | wc -l)\" = 2 ] && ! echo \"\$err\" | grep -q 'did you mean'"
err=$("$K3" serv 2>&1 >/dev/null); rc=$?
check "a typo of a command: did you mean serve?" "[ $rc = 2 ] && echo \"\$err\" | head -1 | grep -q 'did you mean serve?'"

err=$("$K3" run --model "$T/m" --prompt-ids "1,a" --n 2 2>&1 >/dev/null); rc=$?
check "a malformed --prompt-ids: exit 2, one line naming the prompt and the id" \
  "[ $rc = 2 ] && [ \"\$(echo \"\$err\" | wc -l)\" = 1 ] &&
   echo \"\$err\" | grep -q \"^k3 run: --prompt-ids: prompt 1, id 2: 'a' is not a token id\""

# a busy port: bound here, then k3 serve must fail on it before it loads anything
"${K3_PYTHON3:-python3}" - "$T/port" <<'PY' &
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
open(sys.argv[1] + ".tmp", "w").write(str(s.getsockname()[1]))
import os; os.rename(sys.argv[1] + ".tmp", sys.argv[1]); time.sleep(60)
PY
holder=$!
for _ in $(seq 100); do [ -s "$T/port" ] && break; sleep 0.1; done
port=$(cat "$T/port")
t0=${EPOCHREALTIME/./}
err=$(timeout 30 "$K3" serve --model "$T/m" --port "$port" 2>&1 >/dev/null); rc=$?
ms=$(( (${EPOCHREALTIME/./} - t0) / 1000 ))
check "serve on a busy port: exit 1 in under 2 s (took $ms ms)" "[ $rc = 1 ] && [ $ms -lt 2000 ]"
check "serve on a busy port: names the port, before loading" \
  "echo \"\$err\" | grep -q \"cannot bind 127.0.0.1:$port: Address already in use; nothing was loaded\" && ! echo \"\$err\" | grep '^\[k3' | grep -v -e '--backend auto' | grep -q ."
err=$(timeout 30 "$K3" serve --model "$T/notmodel" --port "$port" 2>&1 >/dev/null)
check "serve on a busy port checks the port first" "echo \"\$err\" | grep -q 'cannot bind' && ! echo \"\$err\" | grep -q 'config.json'"
kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null

err=$("$K3" batch --help 2>&1); rc=$?
check "batch --help: chat and completions, not chat-only" \
  "[ $rc = 0 ] && echo \"\$err\" | sed -n 3p | grep -q '/v1/chat/completions and /v1/completions' && ! echo \"\$err\" | grep -q 'file of chat requests'"
err=$("$K3" make-tiny --help 2>&1)
check "make-tiny --help names deep" "echo \"\$err\" | sed -n 3p | grep -q 'deep'"
echo "messages: $pass passed, $fail failed"
[ $fail = 0 ]
