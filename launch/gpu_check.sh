#!/usr/bin/env bash
# GPU checks and the distributed benchmark, on a machine whose Python already has a CUDA torch
# and triton (the lent H200 machines: DEVELOPERS.md, "GPU runs"). Results go under $OUT
# (default runs/gpu-out); each part fits one 10-minute device call.
#
#   bash launch/gpu_check.sh kernels   # Triton kernels, ops, modules and CUDA graphs on GPU 0
#   bash launch/gpu_check.sh train     # the job's GPU tests (tests/train -k gpu): the CUDA-graph
#                                      # loop at world size one, pinned batches
#   bash launch/gpu_check.sh dist [TESTS..]  # NCCL: the distributed tests (default: the lean
#                                      # path, fixed shapes, comm, the sharded collection; one
#                                      # GPU: the graphed pipeline at world size one)
#   bash launch/gpu_check.sh bench     # bench dist, TorchRec DMP vs ours, same launch: every GPU
#                                      # under torchrun, or --one-rank on a one-GPU machine
#   bash launch/gpu_check.sh link      # bench link --device cuda: HBM gathers and the cached
#                                      # tier's PCIe row traffic, $OUT/cost-cuda.yaml for plan --cost
#
# Dependencies the image lacks come from the repository, when present: .whl/ (torchrec and
# friends, from ../shared/tools/device-wheels.sh) and .devcarry/ (FBGEMM's CUDA TBE, from
# ../shared/tools/fbgemm-sm90/). Knobs: BENCH_ARGS (extra `bench dist` arguments, e.g.
# "--plans row_wise --models ebc"), PROVIDERS (default: torchrec ours_graph
# ours_graph_overlap ours_graph_bf16), LIMIT (seconds the part may run; default 540-560).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
part=${1:-kernels}
shift || true
OUT=${OUT:-$PWD/runs/gpu-out}  # runs/ is git-ignored
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
py=${PYTHON:-python3}

gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
echo "[gpu_check] $part on $gpus GPU(s), results in $OUT"
if [ "$gpus" -lt 1 ]; then
  echo "gpu_check: no GPU visible to $py (a CUDA build of torch is needed)" >&2
  exit 1
fi

paths=()
tarball=$(compgen -G ".devcarry/fbgemm_gpu-*.tar.zst" | head -1)
if [ -n "$tarball" ] && [ ! -d /tmp/fbgemm/fbgemm_gpu ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/zs .devcarry/zstandard-*.whl &&
    PYTHONPATH=/tmp/zs "$py" .devcarry/unpack_zst.py "$tarball" /tmp/fbgemm \
      >/dev/null || { echo "gpu_check: unpacking FBGEMM failed" >&2; exit 1; }
fi
[ -d /tmp/fbgemm/fbgemm_gpu ] && paths+=(/tmp/fbgemm)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "gpu_check: installing .whl/ failed" >&2; exit 1; }
  paths+=(/tmp/site)
fi
paths+=("$PWD")
PYTHONPATH=$(IFS=:; echo "${paths[*]}")${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH

case $part in
  kernels)
    timeout "${LIMIT:-540}" "$py" -m pytest -q -p no:cacheprovider tests/kernels tests/modules tests/ops \
      tests/test_graphs.py "$@" 2>&1 | tee "$OUT/kernels.txt" | tail -40
    ;;
  train)
    timeout "${LIMIT:-540}" "$py" -m pytest -q -p no:cacheprovider tests/train -k gpu \
      2>&1 | tee "$OUT/train.txt" | tail -40
    ;;
  dist)
    if [ $# -gt 0 ]; then
      tests=("$@")
    elif [ "$gpus" -ge 2 ]; then
      tests=(tests/sharding/test_lean.py tests/sharding/test_fixed.py tests/sharding/test_comm.py
             tests/sharding/test_sharded_ebc.py tests/sharding/test_sharded_vbe.py)
    else
      tests=(tests/sharding/test_lean.py -k graphed)
    fi
    FBTD_DIST_BACKEND=nccl timeout "${LIMIT:-560}" "$py" -m pytest -q -p no:cacheprovider -x "${tests[@]}" \
      2>&1 | tee "$OUT/dist.txt" | tail -40
    ;;
  bench)
    providers=${PROVIDERS:-torchrec ours_graph ours_graph_overlap ours_graph_bf16}
    extra=()
    [ "$gpus" -lt 2 ] && extra+=(--one-rank)
    # shellcheck disable=SC2086  # PROVIDERS and BENCH_ARGS are word lists
    timeout "${LIMIT:-560}" "$py" -m torch.distributed.run --standalone --nproc-per-node "$gpus" \
      -m fbtriton_dist.bench dist ${extra[@]+"${extra[@]}"} --providers $providers ${BENCH_ARGS:-} \
      --out "$OUT/dist.json" 2>&1 | grep -v "Warning\|warn(\|_warn_once\|compat_table\|\[0m\|^ *$" \
      | tail -40 | tee "$OUT/bench.txt"
    ;;
  link)
    # shellcheck disable=SC2086  # BENCH_ARGS is a word list
    timeout "${LIMIT:-540}" "$py" -m fbtriton_dist.bench link --device cuda ${BENCH_ARGS:-} \
      --out "$OUT/cost-cuda.yaml" 2>&1 | tee "$OUT/link.txt" | tail -40
    ;;
  *)
    echo "usage: $0 kernels|train|dist|bench|link" >&2
    exit 2
    ;;
esac
status=${PIPESTATUS[0]}
echo "[gpu_check] $part exit $status"
exit "$status"
