#!/usr/bin/env bash
# mpirun.sh ARGS... — mpirun on the cluster's login node, over its hostfile and rsh agent, with
# the settings a namespace cluster needs (README.md): one daemon started per node (no tree
# spawn), the out-of-band and TCP traffic on the cluster's network only. ARGS go to mpirun
# (e.g. -np 4 --map-by ppr:2:node k3 run ...).
set -euo pipefail
. "$(dirname "$0")/common.sh"
pid=$(k3c_pid 0)
[ -n "$pid" ] && [ -e "/proc/$pid" ] || k3c_die "no cluster is up at $K3C_DIR (up.sh N)"
exec nsenter -t "$pid" -n -u -m --wd="$PWD" -- "${MPIRUN:-mpirun}" \
  --hostfile "$K3C_DIR/hostfile" --mca plm_rsh_agent "$K3C_HERE/rsh.sh" \
  --mca plm_rsh_no_tree_spawn 1 --mca oob_tcp_if_include "$K3C_NET.0/24" \
  --mca btl_tcp_if_include "$K3C_NET.0/24" "$@"
