#!/usr/bin/env bash
# preflight.sh — scripts/test.sh says what it costs and checks what it needs in its first seconds
# (issue 48): as a user without root on a machine missing packages, and on a nearly full disk, it
# names what is missing and exits 1 before building or installing anything. dpkg-query, id and df
# are stand-ins on PATH; so are cmake and apt-get, which fail loudly if the script got past its
# checks (nothing real is built or installed).
set -u
SRC=${K3_SRC:?K3_SRC not set}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0; pass=0
check() { if eval "$2"; then pass=$((pass+1)); else echo "FAIL: $1" >&2; echo "$out" | head -20 >&2; fail=$((fail+1)); fi; }
mkdir "$T/bin"
stub() { printf '#!/bin/sh\n%s\n' "$2" > "$T/bin/$1"; chmod +x "$T/bin/$1"; }
stub cmake 'echo "STUB cmake ran: the checks let the run go on" >&2; exit 1'
stub apt-get 'echo "STUB apt-get ran" >&2; exit 1'
stub id 'if [ "$1" = -u ]; then echo 1000; else exec /usr/bin/id "$@"; fi'

# 1. not root, packages missing: named, exit 1, within seconds, before any build
stub dpkg-query 'exit 1'
t0=$SECONDS
out=$(PATH="$T/bin:$PATH" timeout 60 bash "$SRC/scripts/test.sh" --quick 2>&1); rc=$?
check "missing packages, not root: exit 1" "[ $rc = 1 ]"
check "the cost comes first" "echo \"\$out\" | head -1 | grep -q 'expect under 5 min'"
check "the missing packages are named, with what to do" \
  "echo \"\$out\" | grep -q 'cannot run: missing packages: build-essential cmake .* run as root'"
check "nothing was built" "! echo \"\$out\" | grep -q STUB"
check "in seconds ($((SECONDS - t0)) s)" "[ $((SECONDS - t0)) -lt 10 ]"

# 2. packages there, 1 GB free: the disk is named
stub dpkg-query 'echo "install ok installed"'
stub df 'printf "Filesystem 1024-blocks Used Available Capacity Mounted\n/dev/x 100000000 99000000 1048576 99%% /\n"'
out=$(PATH="$T/bin:$PATH" timeout 60 bash "$SRC/scripts/test.sh" 2>&1); rc=$?
check "a full disk: exit 1, naming the space" \
  "[ $rc = 1 ] && echo \"\$out\" | grep -q 'cannot run: 1 GB free here, and this run needs ~10 GB'"
check "the full run states its time and disk" "echo \"\$out\" | head -1 | grep -Eq 'expect ~[0-9]+ min'"
check "nothing was built" "! echo \"\$out\" | grep -q STUB"
out=$(bash "$SRC/scripts/test.sh" --frob 2>&1); rc=$?
check "an unknown option: exit 2 with the usage" "[ $rc = 2 ] && echo \"\$out\" | grep -q -- '--quick'"
echo "preflight: $pass passed, $fail failed"
[ $fail = 0 ]
