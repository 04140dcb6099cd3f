"""planner/ never imports torch, triton, torchrec or torch.distributed (checked on the source)."""

import ast
import pathlib

import fbtriton_dist.planner

FORBIDDEN = ("torch", "triton", "torchrec", "fbgemm_gpu")


def test_planner_imports_no_tensor_libraries():
    root = pathlib.Path(fbtriton_dist.planner.__file__).parent
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert bad == []
