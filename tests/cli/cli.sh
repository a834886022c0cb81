#!/usr/bin/env bash
# cli.sh — the command line contract: help from the table, unknown command/flag -> one line + a
# pointer to --help on stderr (not the whole usage) and exit 2, every listed command answers --help.
set -u
K3=${K3_BIN:?K3_BIN not set}
fail=0; pass=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1" >&2; fail=$((fail+1)); fi; }

out=$("$K3" --help); rc=$?
check "k3 --help exits 0" "[ $rc = 0 ]"
check "k3 --help lists commands" "echo \"\$out\" | grep -q '^commands:'"
"$K3" >/dev/null 2>&1; check "no command exits 2" "[ $? = 2 ]"
err=$("$K3" frobnicate 2>&1 >/dev/null); rc=$?
check "unknown command exits 2" "[ $rc = 2 ]"
check "unknown command is named" "echo \"\$err\" | head -1 | grep -q \"unknown command 'frobnicate'\""
check "a pointer to --help follows, not the usage" \
  "[ \"\$(echo \"\$err\" | wc -l)\" = 2 ] && echo \"\$err\" | tail -1 | grep -q \"^run 'k3 --help' for the commands\""
for cmd in $(echo "$out" | awk '/^commands:/{f=1;next} f&&NF{print $1}'); do
  "$K3" "$cmd" --help >/dev/null 2>&1; rc=$?
  check "k3 $cmd --help exits 0" "[ $rc = 0 ]"
  err=$("$K3" "$cmd" --no-such-flag 2>&1 >/dev/null); rc=$?
  check "k3 $cmd --no-such-flag exits 2" "[ $rc = 2 ]"
  check "k3 $cmd names the bad flag" "echo \"\$err\" | head -1 | grep -q -- \"unknown flag '--no-such-flag'\""
done
err=$("$K3" tokenize --vocab a --vocab b x 2>&1 >/dev/null); rc=$?
check "a repeated flag exits 2" "[ $rc = 2 ]"
check "a repeated flag is named" "echo \"\$err\" | head -1 | grep -q -- \"flag '--vocab' given twice\""
# backends: what this build has, what this machine can use, what --backend auto picks (and why)
out=$("$K3" version); rc=$?
check "k3 version exits 0" "[ $rc = 0 ]"
check "k3 version lists compiled backends" "echo \"\$out\" | grep -q '^backends compiled: ref cpu guard'"
check "k3 version lists usable backends" "echo \"\$out\" | grep -q '^backends usable here: ref cpu guard'"
if ! echo "$out" | grep -q '^backends usable here: ref cpu guard cuda$'; then
  check "without usable cuda, auto picks cpu and says why" \
    "echo \"\$out\" | grep -q '^--backend auto picks: cpu, since cuda: '"
fi
err=$("$K3" run --model /nonexistent --prompt-ids 1 --backend frob 2>&1 >/dev/null); rc=$?
check "an unknown --backend exits 2 naming the choices" \
  "[ $rc = 2 ] && echo \"\$err\" | grep -q 'is not auto, cpu, ref, guard or cuda'"
# the stack: a low soft limit is raised (the cpu kernels' tiles live on the stack); a hard limit
# too low for them is refused with one line and exit 1, before any work (never a crash mid-forward)
(ulimit -S -s 256 && "$K3" version >/dev/null 2>&1); rc=$?
check "a 256 KB soft stack limit is raised" "[ $rc = 0 ]"
err=$(ulimit -s 512 && "$K3" version 2>&1 >/dev/null); rc=$?
check "a 512 KB hard stack limit exits 1 naming ulimit" \
  "[ $rc = 1 ] && echo \"\$err\" | grep -q 'stack limit is 512 KB (ulimit -s)'"
echo "cli: $pass passed, $fail failed"
[ $fail = 0 ]
