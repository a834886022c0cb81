#!/usr/bin/env bash
# demo.sh — k3 end to end on a fresh machine: install, build, make the tiny model if missing,
# inspect it, and run it on 4 MPI ranks (2 pipeline stages x 2 expert-parallel lanes).
# Needs nothing outside this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
MODEL=${K3_DEMO_MODEL:-tiny-model}
if [ ! -f "$MODEL/config.json" ]; then
  build/k3 make-tiny "$MODEL" --preset tiny --seed 1
fi
build/k3 inspect "$MODEL"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1   # containers run as root
# Open MPI 4.1's mpirun may call a rank that finalized and exited 0 "exiting improperly" when its
# exit beats the finalize handshake (open-mpi/ompi#7833); 0 is then a normal end.
export OMPI_MCA_orte_allowed_exit_without_sync=1
echo
echo "== 4 ranks: 2 stages x 2 lanes, greedy, 24 new tokens =="
mpirun --oversubscribe -np 4 build/k3 run --model "$MODEL" --pp 2 --ep 2 \
  --prompt-ids "1,2,3,4,5;100,200,300" --n 24 --greedy
