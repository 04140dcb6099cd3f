"""Every ``FBTD_*`` environment variable the package reads is read in ``knobs.py`` and listed
in the contributor guide (one place for the knobs)."""

import ast
import pathlib

from fbtriton_dist import knobs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "fbtriton_dist"


def _env_reads(path: pathlib.Path):
    """(line, name) of each ``os.environ.get("X")``, ``os.getenv("X")``, ``os.environ["X"]``
    read (not a store) with a string literal."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = ast.unparse(node.func)
            if f in ("os.environ.get", "os.getenv", "environ.get", "getenv"):
                yield node.lineno, node.args[0].value
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and ast.unparse(node.value) in ("os.environ", "environ")
              and isinstance(node.slice, ast.Constant)):
            yield node.lineno, node.slice.value


def test_fbtd_variables_are_read_in_knobs_only():
    bad = [
        f"{path.relative_to(ROOT)}:{line} reads {name}"
        for path in sorted(PKG.rglob("*.py"))
        if path.name != "knobs.py"
        for line, name in _env_reads(path)
        if str(name).startswith("FBTD_")
    ]
    assert bad == [], "read FBTD_* variables through fbtriton_dist/knobs.py"


def test_knobs_names_only_what_it_lists():
    """Every ``FBTD_*`` string in knobs.py (what its readers pass to ``os.environ``) is a key
    of ``KNOBS``, so the list is the whole story."""
    names = {
        node.value.split("=")[0].strip("'\" ").rstrip(":")
        for node in ast.walk(ast.parse((PKG / "knobs.py").read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and node.value.startswith("FBTD_")
    }
    names = {n.split(":")[0].split(" ")[0] for n in names}
    assert names and names <= set(knobs.KNOBS), names - set(knobs.KNOBS)


def test_every_knob_is_in_the_guide():
    guide = (ROOT / "DEVELOPERS.md").read_text()
    missing = [name for name in knobs.KNOBS if f"`{name}`" not in guide]
    assert missing == []


def test_the_checker_sees_a_read(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('import os\na = os.environ.get("FBTD_X")\nb = os.environ["FBTD_Y"]\n'
                 'os.environ["FBTD_Z"] = "1"\n')
    assert sorted(name for _, name in _env_reads(f)) == ["FBTD_X", "FBTD_Y"]
