#!/usr/bin/env bash
# cli_md.sh — docs/CLI.md is `k3 help --markdown` byte for byte (the flag tables the parser reads),
# so the reference cannot drift from the binary. On a failure: build/k3 help --markdown > docs/CLI.md
set -u
K3=${K3_BIN:?K3_BIN not set}
SRC=${K3_SRC:?K3_SRC not set}
out=$("$K3" help --markdown) || { echo "FAIL: k3 help --markdown exited $?"; exit 1; }
if [ "$out" != "$(cat "$SRC/docs/CLI.md")" ]; then
  echo "FAIL: docs/CLI.md is out of date; regenerate it: build/k3 help --markdown > docs/CLI.md"
  diff <(echo "$out") "$SRC/docs/CLI.md" | head -20
  exit 1
fi
# it is the table the parser reads: every flag of every command's --help is in it
for cmd in $("$K3" --help | awk '/^commands:/{f=1;next} f&&NF{print $1}'); do
  for fl in $("$K3" "$cmd" --help | sed -n 's/^  \(-., \)\{0,1\}--\([a-z0-9-]*\).*/\2/p' | grep -v '^help$'); do
    echo "$out" | grep -q -- "\`--$fl" || { echo "FAIL: k3 $cmd --$fl is not in k3 help --markdown"; exit 1; }
  done
done
echo "cli_md: docs/CLI.md is current"
