"""``launch/install.sh`` ends without pip's red resolver ERROR on a good install: torchrec's
runtime needs are installed at torchrec's own pins (its metadata, read by the script), pip's
per-step conflict warning is off, and one ``pip check`` at the end reports every conflict but
the chosen one (torchrec's ``fbgemm-gpu`` next to ``fbgemm-gpu-cpu`` on a CPU machine)."""

import pathlib
import re
import subprocess
import sys
from importlib.metadata import requires

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "launch" / "install.sh"


def _needs_snippet() -> str:
    text = SCRIPT.read_text()
    m = re.search(r'mapfile -t needs < <\("\$venv/bin/python" - <<\'PY\'\n(.*?)\nPY\n\)', text,
                  re.S)
    assert m, "install.sh: the torchrec needs snippet moved"
    return m.group(1)


def test_torchrec_needs_come_at_torchrecs_own_pins():
    try:
        declared = requires("torchrec") or []
    except Exception:  # noqa: BLE001 - no torchrec metadata here
        pytest.skip("torchrec is not installed")
    out = subprocess.run([sys.executable, "-c", _needs_snippet()], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out and not any(n.lower().startswith("fbgemm") for n in out)
    pinned = [r.split(";")[0].replace(" ", "") for r in declared
              if "==" in r and "extra" not in r]
    assert all(p.replace("(", "").replace(")", "") in out for p in pinned), (pinned, out)


def test_every_pip_install_skips_the_per_step_warning_and_pip_check_runs_once():
    text = SCRIPT.read_text()
    assert 'pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q ' \
           '--no-warn-conflicts)' in text
    assert re.search(r'-m pip install(?! --disable-pip-version-check -q --no-warn-conflicts)',
                     text) is None
    assert text.count("-m pip check") == 1
    assert "requires fbgemm-gpu, which is not installed" in text
