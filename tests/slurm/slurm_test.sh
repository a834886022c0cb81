#!/bin/bash
# slurm_test.sh — the slurm/ scripts under a real Slurm: starts munged, slurmctld and slurmd
# (Debian's packages, installed here when missing; root needed) on this machine with a private
# config, socket, ports and state under one temporary directory, submits each sbatch script on
# the tiny model with a cpu site (2 stages x 2 lanes, 4 ranks), checks outputs and job states,
# and stops every daemon by its PID (trap: also on failure). A job whose k3 fails (K3_TEST_FAIL)
# must show FAILED with the failing rank named in its output.
#   usage: slurm_test.sh   (K3_BIN = the k3 binary, K3_SRC = the repository)
set -euo pipefail
K3_BIN=${K3_BIN:?K3_BIN is the k3 binary}
K3_SRC=${K3_SRC:?K3_SRC is the repository}
if [ "$(id -u)" != 0 ]; then echo "SKIP: needs root (Slurm daemons)"; exit 77; fi
need=""
for p in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need="$need $p"
done
if [ -n "$need" ]; then
  echo "installing$need"
  # wait (up to 10 min) for the dpkg lock that unattended-upgrades may hold
  apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q $need >/dev/null
fi

S=$(mktemp -d /tmp/k3-slurm.XXXXXX)
pids=()
fail=0
teardown() {
  rc=$?
  for pf in "$S/slurmd.pid" "$S/slurmctld.pid" "$S/munge/munged.pid"; do
    [ -s "$pf" ] || continue
    pid=$(cat "$pf")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ "$rc" != 0 ] || [ "$fail" != 0 ]; then
    echo "---- slurmctld.log (tail)"; tail -n 20 "$S/log/slurmctld.log" 2>/dev/null || true
    echo "---- slurmd.log (tail)"; tail -n 20 "$S/log/slurmd.log" 2>/dev/null || true
  fi
  if [ -n "${K3_SLURM_KEEP:-}" ]; then echo "kept $S"; else rm -rf "$S"; fi
}
trap teardown EXIT
chmod 755 "$S"  # munged (user munge) must reach $S/munge
mkdir -p "$S/state" "$S/spool" "$S/log" "$S/munge" "$S/work"
chown munge:munge "$S/munge" && chmod 711 "$S/munge"  # others may reach the socket

# munged: its own socket, key copy, seed and pid file (never the system's)
key=/etc/munge/munge.key
[ -s "$key" ] || { echo "no $key (the munge package makes it)"; exit 1; }
install -o munge -g munge -m 600 "$key" "$S/munge/munge.key"
runuser -u munge -- /usr/sbin/munged --socket="$S/munge/munge.sock" --key-file="$S/munge/munge.key" \
  --pid-file="$S/munge/munged.pid" --log-file="$S/munge/munged.log" --seed-file="$S/munge/seed"

# two free TCP ports for slurmctld and slurmd
read -r P1 P2 < <(python3 -c 'import socket
s=[socket.socket() for _ in range(2)]
[x.bind(("127.0.0.1",0)) for x in s]; print(*[x.getsockname()[1] for x in s])')
MEM=$(( $(awk '/MemTotal/{print $2}' /proc/meminfo) / 1024 - 2048 ))
export SLURM_CONF=$S/slurm.conf
cat > "$SLURM_CONF" <<CONF
ClusterName=k3test
SlurmctldHost=localhost
SlurmctldPort=$P1
SlurmdPort=$P2
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$S/munge/munge.sock
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
ReturnToService=2
JobRequeue=1
MinJobAge=600
SchedulerParameters=defer_batch
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=localhost CPUs=$(nproc) RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
/usr/sbin/slurmctld -f "$SLURM_CONF"
/usr/sbin/slurmd -f "$SLURM_CONF" -N localhost
for _ in $(seq 1 100); do sinfo -h -o %T 2>/dev/null | grep -q idle && break; sleep 0.1; done
sinfo -h -o %T | grep -q idle || { echo "FAIL: the node did not come up idle"; fail=1; exit 1; }

# the tiny model and a batch file
cd "$S/work"
"$K3_BIN" make-tiny tiny >/dev/null 2>&1
printf '{"custom_id":"r%d","method":"POST","url":"/v1/chat/completions","body":{"messages":[{"role":"user","content":"hi %d"}],"max_tokens":4,"temperature":0}}\n' 1 1 2 2 3 3 > in.jsonl
# a result already there (as if a first run was requeued after r1): the job must keep it, skip r1
echo '{"id":"batch_req_prev","custom_id":"r1","response":{"status_code":200,"body":{"note":"from the first run"}},"error":null}' > out.jsonl

export K3_HOME=$K3_SRC K3_MODEL=$S/work/tiny K3_PP=2 K3_EP=2 K3_BACKEND=cpu K3_COMM_TIMEOUT=60
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_orte_allowed_exit_without_sync=1  # see tests/CMakeLists.txt (ompi#7833)
SB=(--ntasks=4 --overcommit --time=5)  # 4 ranks on this 2-core node
submit() { sbatch --parsable "${SB[@]}" "$@"; }
j_run=$(K3_CACHE_DIR=$S/cache submit -J k3run "$K3_SRC/slurm/k3.sbatch" run --prompt-ids "1,2,3;4,5" --n 4)
j_mpi=$(submit -J k3mpi "$K3_SRC/slurm/k3-mpirun.sbatch" run --prompt-ids "1,2,3;4,5" --n 4)
j_bat=$(K3_BATCH_INPUT=$S/work/in.jsonl K3_BATCH_OUTPUT=$S/work/out.jsonl submit -J k3batch "$K3_SRC/slurm/k3-batch.sbatch")
j_ben=$(K3_BENCH_MODE=throughput K3_BENCH_ARGS="--input-len 8 --output-len 4 --num-prompts 4 --num-warmups 0" K3_BENCH_ENGINE_ARGS="--requests 4 --prompt 8 --gen 4" K3_BENCH_JSON=$S/work/bench.json submit -J k3bench "$K3_SRC/slurm/k3-bench.sbatch")
j_bad=$(K3_TEST_FAIL=load:3 submit -J k3bad "$K3_SRC/slurm/k3.sbatch" run --prompt-ids "1,2,3" --n 4)
jobs=("$j_run" "$j_mpi" "$j_bat" "$j_ben" "$j_bad")
t0=$SECONDS
while [ $((SECONDS - t0)) -lt 150 ]; do
  left=$(squeue -h -j "$(IFS=,; echo "${jobs[*]}")" 2>/dev/null | wc -l)
  [ "$left" = 0 ] && break
  sleep 0.5
done
state() { scontrol show job "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
check() { # name job want-state [patterns that must be in its output]
  local name=$1 jid=$2 want=$3; shift 3
  local st out; st=$(state "$jid"); out=$(ls "$S"/work/*-"$jid".out 2>/dev/null | head -1)
  local ok=1
  [ "$st" = "$want" ] || ok=0
  for pat in "$@"; do grep -q -- "$pat" "$out" 2>/dev/null || { ok=0; echo "  $name: no '$pat' in its output"; }; done
  if [ $ok = 1 ]; then echo "ok   $name: job $jid $st"; else
    echo "FAIL $name: job $jid $st (want $want); output:"; sed 's/^/  | /' "$out" 2>/dev/null | tail -n 25; fail=1; fi
}
check "k3.sbatch (srun pmix, node-local cache)" "$j_run" COMPLETED "cache on" "bind: rank 3" "plan: world 4"
check "k3-mpirun.sbatch" "$j_mpi" COMPLETED "bind: rank 3" "plan: world 4"
check "k3-batch.sbatch (--requeue, resumed)" "$j_bat" COMPLETED "1 result line(s) already" "1 skipped" "3 result line(s) in"
check "k3-bench.sbatch" "$j_ben" COMPLETED "results in"
check "k3.sbatch with a failing rank" "$j_bad" FAILED "rank 3 (stage 1, lane 1) failed"
# outputs: generated ids of both prompts (2 lines of ids each run), 3 batch results, bench JSON
for j in "$j_run" "$j_mpi"; do
  n=$(grep -cE '^[0-9]+(,[0-9]+)*$' "$S"/work/*-"$j".out || true)
  [ "$n" -ge 2 ] || { echo "FAIL job $j: $n id lines, want 2"; fail=1; }
done
python3 - "$S/work/out.jsonl" "$S/work/bench.json" <<'PY' || fail=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ids = sorted(r["custom_id"] for r in rows)
assert ids == ["r1", "r2", "r3"], ids
assert rows[0]["response"]["body"] == {"note": "from the first run"}, rows[0]  # kept, not redone
assert all(r["response"]["status_code"] == 200 for r in rows[1:]), rows
json.load(open(sys.argv[2]))
print("ok   batch results r1..r3 and bench JSON")
PY
scontrol show job "$j_bat" | grep -q "Requeue=1" || { echo "FAIL: the batch job is not requeueable"; fail=1; }
echo "slurm: $((SECONDS - t0)) s for the jobs"
[ "$fail" = 0 ] && echo "slurm_test: PASS" || echo "slurm_test: FAIL"
exit "$fail"
