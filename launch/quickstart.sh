#!/usr/bin/env bash
# README's first command: install into .venv (launch/install.sh), then train the default job,
# configs/jobs/quickstart.yaml, under torchrun (launch/multinode.sh): without a GPU on 2 CPU
# processes (gloo, the fast CPU path), with GPUs on every local GPU (NCCL, Triton
# kernels). It prints the sharding plan (saved as runs/quickstart/plan.yaml), a progress bar
# and the final summary; metrics and checkpoints go to runs/quickstart/ in the current folder
# (a second run: runs/quickstart-2/, ...).
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
# A run folder never takes a second run (the job refuses one): without --resume, --overwrite
# or a logging.run_dir of the user's, a demo run that finds runs/<job> taken writes to the
# next free runs/<job>-N instead.
args=("$@")
own=0
for a in "$@"; do
  case $a in --resume|--overwrite|logging.run_dir=*) own=1 ;; esac
done
if [[ $own == 0 ]]; then
  name=$(basename "$job" .yaml)
  dir="runs/$name"
  n=2
  while [[ -e $dir/metrics.jsonl || -d $dir/checkpoints ]]; do
    dir="runs/$name-$n"
    n=$((n + 1))
  done
  if [[ $dir != "runs/$name" ]]; then
    echo "[quickstart] runs/$name holds an earlier run: this one writes to $dir" \
      "(--resume continues runs/$name; logging.run_dir=... picks another folder)"
    args+=("logging.run_dir=$dir")
  fi
fi
FBTD_VENV=$venv exec bash "$root/launch/multinode.sh" "$job" "${args[@]}"
