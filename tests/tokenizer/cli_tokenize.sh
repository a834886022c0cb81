#!/bin/bash
# cli_tokenize.sh — `k3 tokenize` input and error handling end to end (review findings): a wrong
# --model is one clear line (no warning about its files first); --jsonl names invalid JSON and
# its line; a failed stdin read (stdin is a directory: read() fails with EISDIR) or an allocation
# failure while reading stdin (ulimit -v; not under ASan, which reserves terabytes of address
# space) is exit 1 with a message, never the ids of a prefix with exit 0.
set -u
V="$K3_TESTDATA/vocab/o200k_base.tiktoken"
T=$(mktemp -d /tmp/k3-tokcli-XXXXXX)
trap 'rm -rf "$T"' EXIT
fail=0
check() { # check NAME WANT_RC NEEDLE -- command...   (stderr must be exactly one line)
  local name=$1 want=$2 needle=$3; shift 4
  local out err rc
  out=$("$@" 2>"$T/err"); rc=$?
  err=$(cat "$T/err")
  if [ "$rc" != "$want" ] || ! grep -qF -- "$needle" "$T/err" || [ "$(wc -l <"$T/err")" != 1 ]; then
    echo "FAIL $name: rc=$rc (want $want), stderr lacks '$needle' or is not one line:"
    echo "$err" | head -5; echo "stdout: ${out:0:200}"; fail=1
  else
    echo "ok   $name"
  fi
}
check model-missing 1 "/nonexistent-k3: cannot open the model directory: No such file or directory" -- \
  "$K3_BIN" tokenize --model /nonexistent-k3 hello
check model-file 1 "not a directory" -- "$K3_BIN" tokenize --model "$V" hello
check jsonl-invalid 1 "stdin line 2: invalid JSON" -- \
  bash -c 'printf "%s\n" "\"ok\"" "{\"text\": \"unterminated" | "$0" tokenize --vocab "$1" --jsonl' "$K3_BIN" "$V"
check jsonl-not-string 1 "stdin line 1: expected a JSON string" -- \
  bash -c 'printf "%s\n" "[1]" | "$0" tokenize --vocab "$1" --jsonl' "$K3_BIN" "$V"
check stdin-dir 1 "reading stdin failed" -- bash -c '"$0" tokenize --vocab "$1" < "$2"' "$K3_BIN" "$V" "$T"
check stdin-dir-jsonl 1 "reading stdin failed" -- \
  bash -c '"$0" tokenize --vocab "$1" --jsonl < "$2"' "$K3_BIN" "$V" "$T"
# a good run still works (same ids as the TEXT argument)
a=$("$K3_BIN" tokenize --vocab "$V" "hello world" 2>/dev/null)
b=$(printf 'hello world' | "$K3_BIN" tokenize --vocab "$V" 2>/dev/null)
if [ -z "$a" ] || [ "$a" != "$b" ]; then echo "FAIL stdin-vs-arg: '$a' vs '$b'"; fail=1; else echo "ok   stdin-vs-arg"; fi
if ldd "$K3_BIN" 2>/dev/null | grep -q libasan; then
  echo "skip stdin-oom (ASan build)"
else
  # 120 MB of stdin under a 150 MB address-space limit: the buffer cannot grow to hold it
  check stdin-oom 1 "out of memory reading stdin" -- \
    bash -c 'ulimit -v 150000; head -c 120000000 /dev/zero | tr "\0" "a" | timeout 60 "$0" tokenize --vocab "$1"' "$K3_BIN" "$V"
fi
exit $fail
