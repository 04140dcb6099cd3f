#!/usr/bin/env bash
# README's second command: install (with test tools) into .venv, lint, run the tests.
# Without a GPU the Triton kernels run in Triton's interpreter (tests/conftest.py sets
# TRITON_INTERPRET=1), on small shapes. Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${FBTD_VENV:-$root/.venv}
FBTD_DEV=1 bash "$root/launch/install.sh" "$venv"
cd "$root"
echo "[test] ruff"
"$venv/bin/ruff" check fbtriton_dist tests examples
echo "[test] pytest"
workers=${FBTD_TEST_WORKERS:-2}
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "$workers" --timeout 900 "$@"
