#!/usr/bin/env bash
# Creates (or reuses) a virtual environment and installs fbtriton_dist with the right builds of
# its dependencies. Usage: bash launch/install.sh [VENV_DIR]   (default: .venv in the repo root)
#
# Why not plain `pip install torchrec`: torchrec depends on `fbgemm-gpu`, the CUDA build, which
# is huge and fails to load on a CPU-only torch. We install torchrec with --no-deps, then its own
# needs by hand, and the fbgemm build that matches the machine: fbgemm-gpu-cpu without a GPU,
# fbgemm-gpu with one. Versions are pinned to a set known to work together.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-${FBTD_VENV:-$root/.venv}}
python=${PYTHON:-python3}

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCHREC_VERSION=${TORCHREC_VERSION:-1.8.0}
FBGEMM_VERSION=${FBGEMM_VERSION:-1.8.0}
TRITON_VERSION=${TRITON_VERSION:-3.6.0}

if [ ! -x "$venv/bin/python" ]; then
  echo "[install] creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
# The fast path: this pinned set (and the dev tools when asked) was installed into this venv
# by this script and still imports: nothing to do (a few seconds instead of pip's ~40 s).
stamp="$venv/.fbtd-installed"
pins="torch=$TORCH_VERSION triton=$TRITON_VERSION torchrec=$TORCHREC_VERSION fbgemm=$FBGEMM_VERSION root=$root"
want="$pins dev=${FBTD_DEV:-0}"
have=$(cat "$stamp" 2>/dev/null || true)
if { [ "$have" = "$want" ] || [ "$have" = "$pins dev=1" ]; } &&  # dev tools: a superset
   "$venv/bin/python" -c "import torch, triton, torchrec, fbgemm_gpu, fbtriton_dist" 2>/dev/null; then
  echo "[install] ok: the pinned set is installed in $venv (delete $stamp to reinstall)"
  exit 0
fi
rm -f "$stamp"
# --no-warn-conflicts: pip's check after each install would flag torchrec's fbgemm-gpu (we
# install fbgemm-gpu-cpu without a GPU, on purpose) in red; the whole set is checked once, at
# the end, with pip check (every other conflict is still shown there).
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q --no-warn-conflicts)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=1; fbgemm_pkg=fbgemm-gpu
else
  gpu=0; fbgemm_pkg=fbgemm-gpu-cpu
fi
echo "[install] gpu=$gpu: torch==$TORCH_VERSION triton==$TRITON_VERSION $fbgemm_pkg==$FBGEMM_VERSION torchrec==$TORCHREC_VERSION"

if "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  :  # already there
elif [ "$gpu" = 0 ] && "$venv/bin/python" - <<'PY' 2>/dev/null
import urllib.request
urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=5)
PY
then
  # The CPU wheel: never pull the multi-GB CUDA build onto a machine without a GPU.
  "${pip[@]}" "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
    --extra-index-url https://pypi.org/simple
else
  "${pip[@]}" "torch==$TORCH_VERSION"
fi
# triton 3.6's interpreter (TRITON_INTERPRET=1, used by the CPU kernel tests) breaks on numpy 2.4.
"${pip[@]}" "triton==$TRITON_VERSION" "numpy<2.3" pyyaml
"${pip[@]}" --no-deps "$fbgemm_pkg==$FBGEMM_VERSION" "torchrec==$TORCHREC_VERSION"
# torchrec's own runtime needs at its own pins (what --no-deps skipped: torchmetrics==1.0.3
# for torchrec 1.8.0), minus fbgemm-gpu; iopath for torchrec.datasets; matplotlib for the
# run's picture and `plan --png` (optional: without it they are skipped with one line).
mapfile -t needs < <("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
for r in requires("torchrec") or []:
    name = r.split(";")[0].replace(" ", "").replace("(", "").replace(")", "")
    if "extra==" not in r.replace(" ", "") and not name.lower().startswith(("fbgemm-gpu", "fbgemm_gpu")):
        print(name)
PY
)
if [ "${#needs[@]}" -eq 0 ]; then
  echo "[install] error: could not read torchrec's requirements from its metadata" >&2
  exit 1
fi
"${pip[@]}" "${needs[@]}" iopath tqdm matplotlib "numpy<2.3"
"${pip[@]}" --no-deps -e "$root"
if [ "${FBTD_DEV:-0}" = 1 ]; then
  "${pip[@]}" pytest pytest-xdist pytest-timeout ruff
fi
# pip check, less the one conflict chosen above: torchrec names fbgemm-gpu, the CUDA build,
# which a machine without a GPU has as fbgemm-gpu-cpu. Anything else is said, not hidden.
conflicts=$("$venv/bin/python" -m pip check 2>&1 | grep -v "^No broken requirements" || true)
if [ "$fbgemm_pkg" = fbgemm-gpu-cpu ]; then
  conflicts=$(echo "$conflicts" | grep -v -i "^torchrec .*requires fbgemm-gpu, which is not installed" || true)
fi
if [ -n "$conflicts" ]; then
  echo "[install] warning: pip check reports conflicts in $venv:" >&2
  echo "$conflicts" >&2
fi
"$venv/bin/python" - <<'PY'
import torch, triton, torchrec, fbgemm_gpu  # noqa: F401
import fbtriton_dist
print(f"[install] ok: torch {torch.__version__}, triton {triton.__version__}, "
      f"torchrec {torchrec.__version__ if hasattr(torchrec, '__version__') else '?'}, "
      f"fbtriton_dist {fbtriton_dist.__version__}")
PY
echo "$want" > "$stamp"
