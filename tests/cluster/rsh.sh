#!/usr/bin/env bash
# rsh.sh HOST COMMAND... — the cluster's rsh agent (mpirun --mca plm_rsh_agent): runs COMMAND
# with /bin/sh on node HOST (node3, or its address) by entering the node's namespaces with
# nsenter, like `ssh HOST COMMAND`. Without COMMAND: an interactive shell on the node.
set -euo pipefail
. "$(dirname "$0")/common.sh"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done # ssh-style options are not for us
host=${1:?usage: rsh.sh HOST [COMMAND...]}
shift
i=$(k3c_index "$host") || k3c_die "unknown node '$host' (node1..nodeN, or login)"
pid=$(k3c_pid "$i")
[ -n "$pid" ] && [ -e "/proc/$pid" ] || k3c_die "node '$host' is not up (no init at $K3C_DIR)"
if [ "$i" = 0 ]; then ns="-n -u -m"; else ns="-n -u -i -m -p"; fi
# shellcheck disable=SC2086
if [ $# -eq 0 ]; then exec nsenter -t "$pid" $ns --wd="$PWD" -- /bin/bash -i; fi
# shellcheck disable=SC2086
exec nsenter -t "$pid" $ns --wd="$PWD" -- /bin/sh -c "$*"
