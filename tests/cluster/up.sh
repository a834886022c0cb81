#!/usr/bin/env bash
# up.sh N [SLOTS] — make a cluster of N nodes (node1..nodeN, SLOTS ranks each, default 2) and a
# login node (node 0, where mpirun runs) from Linux namespaces on this machine; see README.md.
# Each node is one `unshare --net --uts --ipc --mount --pid --fork --mount-proc` process whose
# init (PID 1 of the node) reaps orphans (orted daemonizes); it mounts its own sysfs (UCX reads
# the interfaces there), /dev/shm and /tmp, and binds a hosts file with every node and an empty
# resolv.conf over /etc (no DNS: an unknown name would wait 10-20 s). A veth per node joins the
# bridge (fixed MAC). The login node has its own network, host name and /etc but shares the
# machine's pids, so the rsh agent (rsh.sh) can enter a node with nsenter. Prints the hostfile.
# Exit 2 (with a line that says why) where namespaces cannot be made here.
set -euo pipefail
. "$(dirname "$0")/common.sh"
N=${1:?usage: up.sh N [SLOTS]}
SLOTS=${2:-2}
[ "$N" -ge 1 ] && [ "$N" -le 32 ] || k3c_die "N must be 1..32 (got $N)"
[ -e "$K3C_DIR/hostfile" ] && k3c_die "a cluster is up at $K3C_DIR: run down.sh first"
for t in unshare nsenter ip mount python3; do
  command -v $t >/dev/null || { echo "k3 cluster: cannot make nodes: $t is missing" >&2; exit 2; }
done
if ! unshare --net --uts --ipc --mount --pid --fork --mount-proc true 2>/dev/null; then
  echo "k3 cluster: cannot make nodes: unshare of net/uts/ipc/mount/pid namespaces is refused here" \
       "(needs root or CAP_SYS_ADMIN)" >&2
  exit 2
fi
if ! ip link add "$K3C_BR" type bridge 2>/dev/null; then
  echo "k3 cluster: cannot make nodes: cannot add the bridge $K3C_BR (needs CAP_NET_ADMIN)" >&2
  exit 2
fi
mkdir -p "$K3C_DIR"
trap 'echo "k3 cluster: up failed; cleaning up" >&2; "$K3C_HERE/down.sh" >/dev/null 2>&1 || true' ERR
ip link set "$K3C_BR" address "$K3C_BR_MAC"
ip link set "$K3C_BR" up
{
  echo "127.0.0.1 localhost"
  echo "$(k3c_ip 0) login"
  for i in $(seq 1 "$N"); do echo "$(k3c_ip "$i") node$i"; done
} > "$K3C_DIR/hosts"
: > "$K3C_DIR/resolv.conf"
: > "$K3C_DIR/hostfile.tmp"
for i in $(seq 1 "$N"); do echo "node$i slots=$SLOTS" >> "$K3C_DIR/hostfile.tmp"; done
PY=$(command -v /usr/bin/python3 || command -v python3)
ROOT=$(cd "$K3C_HERE/../.." && pwd -P) # the checkout: the nodes run its build/k3
for i in $(seq 0 "$N"); do
  name=node$i; [ "$i" = 0 ] && name=login
  rm -f "$K3C_DIR/$name.ready"
  if [ "$i" = 0 ]; then ns="--net --uts --mount"; else ns="--net --uts --ipc --mount --pid --fork --mount-proc"; fi
  # the node's set-up, then its init: reap every child, orphans included, forever
  # shellcheck disable=SC2086
  setsid unshare $ns --propagation private -- /bin/bash -c '
    set -e
    d=$1 i=$2 name=$3 py=$4 root=$5
    if [ "$i" != 0 ]; then
      mount -t sysfs sysfs /sys
      mount -t tmpfs -o mode=1777 tmpfs /dev/shm
      # a checkout under /tmp (a CI clone may be there) stays visible under the node'"'"'s own /tmp:
      # held by a bind mount (private to this node'"'"'s mount namespace) across the new tmpfs
      case "$root/" in
        /tmp/*) mkdir -p "$d/keep-$name"; mount --bind "$root" "$d/keep-$name"
                mount -t tmpfs -o mode=1777 tmpfs /tmp
                mkdir -p "$root"; mount --bind "$d/keep-$name" "$root" ;;
        *) mount -t tmpfs -o mode=1777 tmpfs /tmp ;;
      esac
    fi
    mount --bind "$d/hosts" /etc/hosts
    mount --bind "$d/resolv.conf" /etc/resolv.conf
    hostname "$name"
    echo $$ > "$d/$name.ready"
    exec "$py" -c "
import os, signal, time
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
" k3-cluster-init' k3-cluster-node "$K3C_DIR" "$i" "$name" "$PY" "$ROOT" </dev/null >/dev/null 2>"$K3C_DIR/$name.log" &
  echo $! > "$K3C_DIR/node$i.unshare"
done
# wait for every node's init; the pid file holds its pid as seen from here
t_end=$((SECONDS + 20))
for i in $(seq 0 "$N"); do
  name=node$i; [ "$i" = 0 ] && name=login
  while [ ! -s "$K3C_DIR/$name.ready" ]; do
    [ $SECONDS -lt $t_end ] || k3c_die "$name did not come up: $(cat "$K3C_DIR/$name.log")"
    sleep 0.05
  done
  # the init: the unshare's one child (pid namespace), or the unshare itself (the login node)
  pid=$(cat "$K3C_DIR/node$i.unshare")
  if [ "$i" != 0 ]; then pid=$(pgrep -P "$pid"); fi
  echo "$pid" > "$K3C_DIR/node$i.pid"
  readlink "/proc/$pid/ns/net" > "$K3C_DIR/node$i.netns"
  ip link add "${K3C_NAME}$i" type veth peer name eth0 netns "$pid"
  ip link set "${K3C_NAME}$i" master "$K3C_BR" up
  # tcp_retries2 5: a TCP connection with data unacknowledged fails after ~13 s (default 15:
  # ~15 min); this is what lets mpirun give up on a daemon behind a cut link (docs/CLUSTER.md)
  nsenter -t "$pid" -n sh -c "ip link set lo up && ip addr add $(k3c_ip "$i")/24 dev eth0 &&
    ip link set eth0 up && sysctl -q -w net.ipv4.tcp_retries2=${K3_CLUSTER_TCP_RETRIES2:-5}"
done
mv "$K3C_DIR/hostfile.tmp" "$K3C_DIR/hostfile"
echo "$N" > "$K3C_DIR/n_nodes"
cat "$K3C_DIR/hostfile"
