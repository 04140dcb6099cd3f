#!/usr/bin/env bash
# Multi-node (or single-node) training with torchrun and the c10d rendezvous.
# Run the same command on every node; only NODE_RANK differs. docs/training.md has the how-to.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/multinode.sh configs/jobs/dlrm_criteo.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/multinode.sh configs/jobs/dlrm_criteo.yaml
#
# Knobs (environment):
#   NNODES          nodes in the job (default 1)
#   NODE_RANK       this node, 0..NNODES-1 (default 0)
#   NPROC_PER_NODE  processes per node (default: the number of GPUs, else 2 CPU processes)
#   MASTER_ADDR     host name or IP of node 0, reachable from every node (default localhost)
#   MASTER_PORT     rendezvous port on node 0 (default 29500; on one node without MASTER_ADDR
#                   and MASTER_PORT, torchrun --standalone picks a free port)
#   RDZV_ID         job id shared by the nodes (default fbtd-$USER)
#   FBTD_VENV       virtual environment (default .venv of the repository)
#   FBTD_PG_TIMEOUT_S  collective timeout in seconds (default 600)
# Arguments after the job file go to the job: --resume, --steps N, KEY.PATH=VALUE overrides.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FBTD_VENV:-$root/.venv}
if [[ $# -lt 1 ]]; then
  echo "usage: [NNODES=..] [NODE_RANK=..] [MASTER_ADDR=..] $0 JOB.yaml [--resume] [KEY=VALUE ...]" >&2
  exit 2
fi
job=$1
shift
if [[ ! -f $job ]]; then
  echo "multinode.sh: job file $job not found (from $(pwd))" >&2
  exit 2
fi
job=$(cd "$(dirname "$job")" && pwd)/$(basename "$job")  # the job file, from any folder
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l || echo 0)
fi
nproc=${NPROC_PER_NODE:-$([[ $gpus -gt 0 ]] && echo "$gpus" || echo 2)}
nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
if [[ $gpus -gt 0 ]]; then
  backend="NCCL, one GPU per process"
else
  backend="gloo on the CPU"
fi
if [[ $nnodes == 1 && -z ${MASTER_ADDR:-} && -z ${MASTER_PORT:-} ]]; then
  # one node: a free port, so concurrent jobs on the machine do not meet at 29500
  rdzv=(--standalone)
  where="standalone rendezvous (a free local port)"
else
  addr=${MASTER_ADDR:-localhost}
  port=${MASTER_PORT:-29500}
  rdzv=(--nnodes "$nnodes" --node-rank "$node_rank" --rdzv-backend c10d
    --rdzv-endpoint "$addr:$port" --rdzv-id "${RDZV_ID:-fbtd-${USER:-job}}")
  where="rendezvous c10d at $addr:$port"
fi
echo "[multinode] node $node_rank/$nnodes, $nproc processes ($backend), $where"
# the job file and arguments checked once, before the workers start: a config error (or a
# run folder holding another run) is said once, exit 2, as one process says it
"$venv/bin/python" -m fbtriton_dist.train.precheck --config "$job" "$@" || exit $?
# CPU ranks share the host's cores: each its share (fbtriton_dist/ops/cpu_threads.py), not
# torchrun's 1 per process; OMP_NUM_THREADS of the caller wins; GPU ranks keep 1
if [[ -z ${OMP_NUM_THREADS:-} && $gpus -eq 0 ]]; then
  OMP_NUM_THREADS=$("$venv/bin/python" "$root/fbtriton_dist/ops/cpu_threads.py" "$nproc")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
echo "[multinode] $OMP_NUM_THREADS thread(s) per process (OMP_NUM_THREADS)"
# torchrun exits 1 whatever its workers' status, after 40+ lines of its own: the workers
# append "STATUS<tab>LINE" of an error here, and this script ends with that line and status
status_file=$(mktemp "${TMPDIR:-/tmp}/fbtd-status.XXXXXX")
trap 'rm -f "$status_file"' EXIT
export FBTD_STATUS_FILE=$status_file
# no cd: relative paths of the arguments, and runs/, are the caller's folder's
rc=0
"$venv/bin/torchrun" "${rdzv[@]}" \
  --nproc-per-node "$nproc" \
  --max-restarts 0 \
  -m fbtriton_dist.train --config "$job" "$@" || rc=$?
if [[ $rc -ne 0 && -s $status_file ]]; then
  IFS=$'\t' read -r status line < "$status_file"
  echo "[multinode] $line" >&2
  echo "[multinode] exit status $status (torchrun's own: $rc; docs/training.md)" >&2
  exit "$status"
fi
exit "$rc"
