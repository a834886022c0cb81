#!/usr/bin/env bash
# slow.sh NODE DELAY_MS [LOSS_PCT] — make node NODE's link slow: its frames go through delay.py
# (user space: this kernel has no netem), DELAY_MS later each way, LOSS_PCT % dropped. The node's
# veth leaves the bridge; a second veth pair (NAMEId / NAMEIb) joins it, and delay.py forwards
# between the two. Offloads are turned off on every node's eth0 (a frame read raw must be whole).
# down.sh stops the forwarder. Run `slow.sh NODE 0` to put the plain link back.
set -euo pipefail
. "$(dirname "$0")/common.sh"
node=${1:?usage: slow.sh NODE DELAY_MS [LOSS_PCT]}
i=$(k3c_index "$node") || k3c_die "unknown node '$node'"
ms=${2:?usage: slow.sh NODE DELAY_MS [LOSS_PCT]}
loss=${3:-0}
port=${K3C_NAME}$i
if [ -s "$K3C_DIR/$port.fwd" ]; then kill "$(cat "$K3C_DIR/$port.fwd")" 2>/dev/null || true; rm -f "$K3C_DIR/$port.fwd"; fi
ip link del "${port}d" 2>/dev/null || true
if [ "$ms" = 0 ] && [ "$loss" = 0 ]; then
  ip link set "$port" master "$K3C_BR" up
  exit 0
fi
n=$(cat "$K3C_DIR/n_nodes")
for j in $(seq 0 "$n"); do
  "$K3C_HERE/rsh.sh" "$(if [ "$j" = 0 ]; then echo login; else echo "node$j"; fi)" \
    python3 "$K3C_HERE/delay.py" --offload-off eth0
done
ip link set "$port" nomaster
ip link add "${port}d" type veth peer name "${port}b"
ip link set "${port}b" master "$K3C_BR" up
ip link set "${port}d" up
setsid python3 "$K3C_HERE/delay.py" "$port" "${port}d" "$ms" "$loss" </dev/null >/dev/null 2>&1 &
echo $! > "$K3C_DIR/$port.fwd"
