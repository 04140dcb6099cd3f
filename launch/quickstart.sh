#!/usr/bin/env bash
# README's first command: install into .venv (launch/install.sh) and run the main job.
# Until the torchrun training entry point exists, the main job is examples/train_tbe.py: a
# TableBatchedEmbedding trained on synthetic Zipf ids (GPU + Triton if present, else CPU).
# Extra arguments go to the example, e.g. `bash launch/quickstart.sh --steps 200`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FBTD_VENV:-$root/.venv}
bash "$root/launch/install.sh" "$venv"
exec "$venv/bin/python" "$root/examples/train_tbe.py" "$@"
