# k3-common.sh — sourced by the sbatch scripts: the site knobs, checks, and the node-local
# checkpoint cache. Sets MODEL (the directory k3 reads) and K3_FLAGS (the flags every k3 command
# of the job takes). Not a job script itself.
K3_HOME=${K3_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
# shellcheck source=site.env
source "${K3_SITE_ENV:-$K3_HOME/slurm/site.env}"
K3_LOCAL="$K3_HOME/slurm/k3-local.sh"
[ -x "$K3_BIN" ] || { echo "k3 job: K3_BIN=$K3_BIN is not an executable" >&2; exit 1; }
[ -n "$K3_MODEL" ] && [ -f "$K3_MODEL/config.json" ] ||
  { echo "k3 job: K3_MODEL='$K3_MODEL' has no config.json" >&2; exit 1; }
tasks=${SLURM_NTASKS:?not inside a Slurm allocation}
if [ "$tasks" -ne $((K3_PP * K3_EP)) ]; then
  echo "k3 job: $tasks tasks but K3_PP x K3_EP = $K3_PP x $K3_EP (one task per rank)" >&2
  exit 1
fi
echo "k3 job ${SLURM_JOB_ID}: $tasks ranks on ${SLURM_JOB_NUM_NODES} node(s) ($SLURM_JOB_NODELIST)," \
     "pp $K3_PP x ep $K3_EP, backend $K3_BACKEND, restart ${SLURM_RESTART_COUNT:-0}"
MODEL=$K3_MODEL
if [ -n "$K3_CACHE_DIR" ]; then
  # one task per node fills the node's cache (cp to a temporary name, then rename: a job killed
  # half-way leaves no cache that looks complete)
  dst="$K3_CACHE_DIR/$(basename "$K3_MODEL")"
  srun --ntasks-per-node=1 --ntasks="$SLURM_JOB_NUM_NODES" --mpi=none bash -c '
    set -euo pipefail
    src=$1 dst=$2
    want=$(du -sb "$src" | cut -f1)
    if [ -d "$dst" ] && [ "$(du -sb "$dst" | cut -f1)" = "$want" ]; then
      echo "cache on $(hostname): $dst ($want bytes) reused"; exit 0
    fi
    mkdir -p "$(dirname "$dst")"; rm -rf "$dst.tmp.$$"; cp -a "$src" "$dst.tmp.$$"
    rm -rf "$dst"; mv "$dst.tmp.$$" "$dst"
    echo "cache on $(hostname): copied $want bytes to $dst"' _ "$K3_MODEL" "$dst"
  MODEL=$dst
fi
K3_FLAGS=(--model "$MODEL" --pp "$K3_PP" --ep "$K3_EP" --backend "$K3_BACKEND" --bind "$K3_BIND"
          --comm-timeout "$K3_COMM_TIMEOUT")
# shellcheck disable=SC2206
K3_EXTRA=($K3_ARGS)
