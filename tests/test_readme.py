"""The Python snippets of the README and of the docs pages it sends readers to run as written:
the single-process ones in one interpreter (the README's first, then each page's, in
``DOCS`` order, so a later snippet may use an earlier one's names), the ``torchrun`` ones
(first line ``# name.py: torchrun --nproc-per-node 2 name.py``) under torchrun with 2 gloo
ranks."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# every page whose snippets are run, with how many single-process and torchrun snippets it has
# (so that a snippet that stops matching the pattern fails here instead of going unrun)
DOCS = {"README.md": (3, 1), "docs/modules.md": (1, 0), "docs/sharding.md": (0, 2)}


def _blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _is_distributed(block: str) -> bool:
    return re.match(r"# \w+\.py: torchrun --nproc-per-node 2", block) is not None


def _run(cmd: list[str], cwd) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_snippet_counts():
    for page, (n_local, n_dist) in DOCS.items():
        blocks = _blocks(page)
        dist = [b for b in blocks if _is_distributed(b)]
        assert (len(blocks) - len(dist), len(dist)) == (n_local, n_dist), page


def test_every_snippet_runs(tmp_path):
    blocks = [b for page in DOCS for b in _blocks(page)]
    distributed = [b for b in blocks if _is_distributed(b)]
    local = [b for b in blocks if not _is_distributed(b)]
    (tmp_path / "local.py").write_text("\n\n".join(local))
    _run([sys.executable, "local.py"], tmp_path)
    for i, block in enumerate(distributed):  # a launch each: each starts its process group
        (tmp_path / f"dist{i}.py").write_text(block)
        _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              "2", f"dist{i}.py"], tmp_path)


def test_managed_tables_doc_declaring_snippet_runs(tmp_path):
    """``docs/managed_tables.md``'s first snippet (declaring a managed table) runs as written;
    its second needs a model and a checkpoint, so the page is not in ``DOCS``."""
    block = _blocks("docs/managed_tables.md")[0]
    assert "IdManagerConfig(" in block, block
    (tmp_path / "managed.py").write_text(block)
    _run([sys.executable, "managed.py"], tmp_path)
