#!/bin/bash
# k3-local.sh — run one k3 rank: local rank -> GPU, then exec the command. Used by the sbatch
# scripts under srun (SLURM_LOCALID) and mpirun (OMPI_COMM_WORLD_LOCAL_RANK). With GPUs in the
# allocation (CUDA_VISIBLE_DEVICES set by Slurm) the rank sees only the local-rank-th of them;
# without, nothing changes (cpu ranks). k3 itself binds the rank to the cores near its GPU.
set -euo pipefail
local_rank=${OMPI_COMM_WORLD_LOCAL_RANK:-${SLURM_LOCALID:-0}}
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ] && [ "${CUDA_VISIBLE_DEVICES}" != "NoDevFiles" ]; then
  IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
  if [ "$local_rank" -ge "${#gpus[@]}" ]; then
    echo "k3-local: local rank $local_rank but only ${#gpus[@]} GPUs ($CUDA_VISIBLE_DEVICES):" \
         "one rank per GPU" >&2
    exit 1
  fi
  export CUDA_VISIBLE_DEVICES=${gpus[$local_rank]}
fi
exec "$@"
