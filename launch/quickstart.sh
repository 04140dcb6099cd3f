#!/usr/bin/env bash
# README's first command: install into .venv (launch/install.sh), then train the default job,
# configs/jobs/quickstart.yaml, under torchrun (launch/multinode.sh): without a GPU on 2 CPU
# processes (gloo, the fast CPU path), with GPUs on every local GPU (NCCL, Triton
# kernels). It prints the sharding plan (saved as runs/quickstart/plan.yaml), a progress bar
# and the final summary; metrics and checkpoints go to runs/quickstart/.
#
# Extra arguments go to the job, e.g. `bash launch/quickstart.sh --steps 600 train.batch_size=512`
# or `bash launch/quickstart.sh --resume`. Knobs: FBTD_JOB (another job file), NPROC_PER_NODE
# (another process count), FBTD_VENV (the virtual environment).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FBTD_VENV:-$root/.venv}
bash "$root/launch/install.sh" "$venv"
job=${FBTD_JOB:-$root/configs/jobs/quickstart.yaml}
echo "[quickstart] job $job"
FBTD_VENV=$venv exec bash "$root/launch/multinode.sh" "$job" "$@"
