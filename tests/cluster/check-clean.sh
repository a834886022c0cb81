#!/usr/bin/env bash
# check-clean.sh — exit 0 if no cluster of this name is left on the machine: no link named
# NAME*, no process in a namespace of its nodes (k3-cluster-init), no state directory.
# Otherwise name each thing left and exit 1.
set -uo pipefail
. "$(dirname "$0")/common.sh"
bad=0
links=$(ip -o link show 2>/dev/null | sed -n "s/^[0-9]*: \(${K3C_NAME}[0-9]*[bd]\{0,1\}\|${K3C_BR}\)[@:].*/\1/p")
[ -n "$links" ] && { echo "k3 cluster: links left behind: $links" >&2; bad=1; }
procs=$(pgrep -f "k3-cluster-(init|node $K3C_DIR)|$K3C_HERE/delay.py" | tr '\n' ' ')
[ -n "$procs" ] && { echo "k3 cluster: processes left behind: $procs" >&2; bad=1; }
[ -e "$K3C_DIR" ] && { echo "k3 cluster: state directory left behind: $K3C_DIR" >&2; bad=1; }
exit $bad
