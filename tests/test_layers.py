"""DESIGN.md's layering: imports point down only; planner/config code never imports triton or
torch.distributed; kernels never import torch.distributed."""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "fbtriton_dist"
# layer -> layers it may import (besides itself and top-level leaf modules)
ALLOWED = {
    "kernels": set(),
    "reference": set(),
    "ops": {"kernels", "reference"},
    "modules": {"ops", "kernels", "reference"},
    "planner": set(),
    "sharding": {"modules", "ops", "kernels", "reference", "planner"},
    "train": {"sharding", "modules", "ops", "planner"},
    "bench": {"sharding", "modules", "ops", "kernels", "reference", "planner", "train"},
}
LEAVES = {"optim", "sparse", "graphs", "__init__"}
FORBIDDEN = {"planner": {"triton", "torch.distributed"}, "kernels": {"torch.distributed"}}


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_down(layer):
    folder = PKG / layer
    if not folder.exists():
        pytest.skip(f"{layer}/ does not exist yet")
    for path in folder.rglob("*.py"):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "fbtriton_dist" and len(parts) > 1:
                target = parts[1]
                ok = target == layer or target in LEAVES or target in ALLOWED[layer]
                assert ok, (
                    f"{path.relative_to(PKG)} imports {name}: {layer}/ may not import {target}/"
                )
            for bad in FORBIDDEN.get(layer, ()):
                assert not (name == bad or name.startswith(bad + ".")), f"{path} imports {name}"


def test_graphs_is_a_leaf():
    """graphs.py (GraphedStep) serves every layer: it imports none of the package's."""
    names = list(_imports(PKG / "graphs.py"))
    assert not [n for n in names if n.startswith("fbtriton_dist")], names
