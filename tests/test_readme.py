"""The README's Python snippets run as written: the single-process ones in one interpreter,
the ``torchrun`` ones (first line ``# name.py: torchrun --nproc-per-node 2 name.py``) under
torchrun with 2 gloo ranks; the first snippet of ``docs/managed_tables.md`` (declaring a
managed table) runs as written too."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
MANAGED_DOC = README.parent / "docs" / "managed_tables.md"


def _blocks(path: pathlib.Path = README) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _run(cmd: list[str], cwd) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_every_snippet_runs(tmp_path):
    blocks = _blocks()
    distributed = [b for b in blocks if re.match(r"# \w+\.py: torchrun --nproc-per-node 2", b)]
    local = [b for b in blocks if b not in distributed]
    assert len(local) >= 2 and len(distributed) >= 2, (len(local), len(distributed))
    (tmp_path / "local.py").write_text("\n\n".join(local))
    _run([sys.executable, "local.py"], tmp_path)
    for i, block in enumerate(distributed):  # a launch each: each starts its process group
        (tmp_path / f"dist{i}.py").write_text(block)
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2", f"dist{i}.py"], tmp_path)


def test_managed_tables_doc_declaring_snippet_runs(tmp_path):
    block = _blocks(MANAGED_DOC)[0]
    assert "IdManagerConfig(" in block, block
    (tmp_path / "managed.py").write_text(block)
    _run([sys.executable, "managed.py"], tmp_path)
