#!/usr/bin/env bash
# down.sh — remove the cluster up.sh made, also after a killed run: every process in one of its
# network namespaces (nodes and login), its veths and bridge, its state directory. Idempotent.
# Exit 1 if anything is left afterwards (named). See README.md.
set -uo pipefail
. "$(dirname "$0")/common.sh"
netns=()
for f in "$K3C_DIR"/node*.netns; do [ -s "$f" ] && netns+=("$(cat "$f")"); done
# kill every process whose network namespace is a node's: the inits (a node's PID 1 takes its
# whole pid namespace with it), orted, ranks, and what the login node ran
for round in 1 2 3 4 5 6 7 8 9 10; do
  left=0
  for p in /proc/[0-9]*; do
    n=$(readlink "$p/ns/net" 2>/dev/null) || continue
    for want in "${netns[@]}"; do
      if [ "$n" = "$want" ]; then kill -9 "${p#/proc/}" 2>/dev/null; left=1; fi
    done
  done
  [ $left = 0 ] && break
  sleep 0.2
done
for f in "$K3C_DIR"/*.fwd; do [ -s "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done # slow.sh
for f in "$K3C_DIR"/node*.unshare; do [ -s "$f" ] && kill -9 "$(cat "$f")" 2>/dev/null; done
# the veths go with their namespaces; remove what is left by name
for l in $(ip -o link show 2>/dev/null | sed -n "s/^[0-9]*: \(${K3C_NAME}[0-9]*[bd]\{0,1\}\|${K3C_BR}\)[@:].*/\1/p"); do
  ip link del "$l" 2>/dev/null
done
# the nodes held a checkout under /tmp through keep-* (bind mounts private to their mount
# namespaces, gone with them): here those are empty folders; rmdir, never rm -r, in case one leaked
for k in "$K3C_DIR"/keep-*; do
  [ -e "$k" ] || continue
  rmdir "$k" || { echo "k3 cluster: $k is not empty (a node's bind mount of the checkout leaked): left in place" >&2; exit 1; }
done
rm -rf "$K3C_DIR"
"$K3C_HERE/check-clean.sh"
