# common.sh — sourced by the cluster harness's scripts (tests/cluster/): the names and the state
# directory one cluster uses. K3_CLUSTER_NAME (default k3c, at most 6 characters) prefixes every
# link the harness makes (bridge NAMEbr, veths NAME0..NAMEN); K3_CLUSTER_DIR (default
# /run/k3-cluster-NAME) holds each node's pid, its hosts file and the hostfile. Node 0 is the
# login node (mpirun runs there, no ranks); nodes 1..N run ranks.
K3C_NAME=${K3_CLUSTER_NAME:-k3c}
K3C_DIR=${K3_CLUSTER_DIR:-/run/k3-cluster-$K3C_NAME}
K3C_BR=${K3C_NAME}br
K3C_NET=10.41.0
K3C_BR_MAC=02:6b:33:41:00:fe # fixed: a bridge takes its ports' lowest MAC otherwise (stale ARP)
K3C_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

k3c_die() { echo "k3 cluster: $*" >&2; exit 1; }
# node_pid I: the pid (in this pid namespace) of node I's init, or nothing
k3c_pid() { cat "$K3C_DIR/node$1.pid" 2>/dev/null; }
# node_ip I: node I's address (the login node, 0, is .100)
k3c_ip() { if [ "$1" = 0 ]; then echo "$K3C_NET.100"; else echo "$K3C_NET.$1"; fi; }
# the node index of a host name: node3 -> 3, login -> 0
k3c_index() {
  case $1 in
    login) echo 0 ;;
    node[0-9]*) echo "${1#node}" ;;
    "$K3C_NET".100) echo 0 ;;
    "$K3C_NET".*) echo "${1#"$K3C_NET".}" ;;
    *) return 1 ;;
  esac
}
