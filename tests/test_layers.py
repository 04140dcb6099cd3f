"""DESIGN.md's layer table, checked on the import graph of every file of the package.

``package_imports(root)`` parses every ``*.py`` under a package folder and resolves each import
of the package to the module it loads (the package's name is the folder's name):

* ``import fbtriton_dist.x.y``  -> ``fbtriton_dist.x.y``
* ``from fbtriton_dist import x``  -> ``fbtriton_dist.x`` when x is a module; a name the
  package's ``__init__`` exports lazily (a module-level ``{"name": "module"}`` table, as the root's
  ``_NAMES`` and ``train``'s ``_HOMES``) -> the module it comes from; any other name -> the
  package. ``from fbtriton_dist.x import y`` likewise (``fbtriton_dist.x.y`` when y is a
  submodule).
* relative ``from . import x``, ``from .y import z``, ``from ..x import y``: the same, counted
  from the importing file's package.
* ``import fbtriton_dist`` and then ``fbtriton_dist.shard``: the attribute, as
  ``from fbtriton_dist import shard`` (the root loads its subpackages lazily, so the attribute
  is the import).
* imports inside functions and under ``if TYPE_CHECKING:`` count like any other (``ast.walk``
  sees them).
* string imports: ``importlib.import_module("fbtriton_dist.x.y")`` (or ``import_module`` imported
  from importlib, or ``__import__("...")``) -> ``fbtriton_dist.x.y``; a relative name
  (``import_module(".y", __package__)``) counted from the importing file's package; an f-string
  with a constant head (``f"fbtriton_dist.kernels.{name}"``) -> the package the head names
  (``fbtriton_dist.kernels``). A name computed at run time (``import_module(_NAMES[name])``)
  cannot be resolved and is not an edge.

A module's layer is its first name below the package (``kernels``, ``planner``, ``optim``, ...;
the package's own ``__init__`` is ``__init__``). ``ALLOWED`` is DESIGN.md's table, layer by
layer: a module may import its own layer, the package root (which imports nothing itself) and
the layers of its row; every top-level module or folder needs a row.

Inside a layer the same, one level down: ``SUBLAYERS`` gives ``sharding``'s sub-layers (a
module's second name below the package: ``comm``, ``dist``, ``modules``, ``managed``, ``shard``,
``pipeline``, ``dmp``) and what each may import of the rest of ``sharding``; every module or
folder of ``sharding/`` needs a row, and only its ``__init__`` may import the package itself.

Cycles: one graph of module -> module edges over every file, *with* function-local and
TYPE_CHECKING imports. A lazy or type-only import still means the two modules need each other
(both circles the layering refactor found were hidden that way: ``plan.py`` imported ``cost`` inside a method
and ``TableSpec`` under TYPE_CHECKING; ``loop.py`` imported ``job.Env`` under TYPE_CHECKING), and
it is one edit away from an ImportError at start-up. Two kinds of import are not edges:
the imports inside a package ``__init__``'s module-level ``__getattr__`` (a lazy re-export
table: it loads a submodule only when a caller asks for one of its names; as edges they would
make the package depend on every submodule it exports, and a submodule that imports its own
package would close a cycle that never runs), and the parent packages whose ``__init__``
Python runs before ``a.b.c`` (``import a.b.c`` is an edge to ``a.b.c`` only, for the same
reason).
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "fbtriton_dist"

TORCH_FREE_LEAVES = {"optim", "optim_configs", "optim_counter", "optim_ensemble",
                     "optim_fused_params", "optim_gwd", "pooling", "knobs", "id_manager", "storage"}
"""Top-level modules every layer may read, the torch-free planner included."""
ALLOWED: dict[str, set[str]] = {
    # top-level leaves
    "__init__": set(),  # the lazy table: importlib only
    "optim": {"optim_configs", "optim_counter", "optim_ensemble", "optim_gwd"},  # the registry
    "optim_configs": {"optim_counter", "optim_gwd"},  # the plain optimizers' configs
    "optim_counter": set(),  # rowwise Adagrad with counter's config (optim registers it)
    "optim_ensemble": set(),  # ensemble rowwise Adagrad's config (optim registers it)
    "optim_fused_params": {"optim", "optim_ensemble", "optim_gwd"},  # TorchRec's fused_params -> our optimizer
    "optim_gwd": {"optim_counter"},  # global weight decay's config (optim registers it)
    "pooling": set(),  # PoolingMode: kernels, reference, ops and modules read it
    "knobs": set(),  # the one module that reads FBTD_* environment variables
    "id_manager": set(),  # managed tables' config (dynamic ids): planner, modules, ops read it
    "storage": set(),  # tables' storage tiers (Storage): planner and modules read it
    "graphs": set(),  # GraphedStep: serves every layer
    "host_flags": set(),  # device flags read on the host late (deferred input checks)
    "sparse": set(),  # TorchRec's KJT / KeyedTensor <-> our jagged batch
    # `fbtriton-dist plan | train`; an entry point, not the library: it may hand `plan
    # --simulate` to bench (lazily), bench never imports it (the shared options are planner's)
    "cli": {"planner", "train", "bench", *TORCH_FREE_LEAVES},
    # DESIGN.md's table, top to bottom
    "kernels": {*TORCH_FREE_LEAVES},  # optim: the kernels' per-optimizer update codes
    "reference": {"optim", "pooling"},
    "ops": {"kernels", "reference", "graphs", "host_flags", *TORCH_FREE_LEAVES},
    "modules": {"ops", "sparse", "graphs", "host_flags", *TORCH_FREE_LEAVES},
    "planner": {*TORCH_FREE_LEAVES},
    # sharding must not contain kernel code or pick a backend: no kernels, no reference
    "sharding": {"ops", "modules", "planner", "sparse", "graphs", "host_flags",
                 *TORCH_FREE_LEAVES},
    # train must not reach into kernels
    "train": {"sharding", "modules", "ops", "planner", "sparse", "graphs", "host_flags",
              *TORCH_FREE_LEAVES},
}
ALLOWED["bench"] = set(ALLOWED) - {"cli"}  # anything below the command line

SUBLAYERS: dict[str, dict[str, set[str]]] = {
    # inside sharding/, DEVELOPERS.md's order: collectives, dists, sharded collections, then
    # managed resharding, shard(), the pipeline and the DMP adapter on top
    "sharding": {
        "__init__": {"comm", "dist", "modules", "managed", "shard", "pipeline", "dmp"},
        "comm": set(),  # collectives, CommOptions, comm_report: nothing else of sharding
        "dist": {"comm"},  # layout, input / fixed / output / sequence dists
        "modules": {"dist", "comm"},  # the sharded collections and their state dicts
        "managed": {"modules", "dist", "comm"},  # managed tables sharded, resharding
        "shard": {"managed", "modules", "dist", "comm"},  # shard(): picks managed collections
        "pipeline": {"modules", "dist", "comm"},  # TrainPipeline, the CUDA-graph step
        "dmp": {"shard", "modules", "dist", "comm"},  # TorchRec's DMP shards ours via shard()
    },
}
"""Layer -> its sub-layers (a folder or module right below it; the layer's own ``__init__`` is
``__init__``) -> the sub-layers each may import besides its own. Only the layer's ``__init__``
may import the layer's package itself (it imports everything)."""
ENTRY_POINTS = {"cli", "bench"}
"""Layers that are not the library: only they may import bench."""

NO_TENSORS = ("torch", "triton", "torchrec", "fbgemm_gpu")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "planner/": NO_TENSORS,  # pure Python: plans without a GPU or torch
    "optim.py": NO_TENSORS,  # the planner reads it
    "optim_counter.py": NO_TENSORS,  # optim.py imports it
    "optim_ensemble.py": NO_TENSORS,  # optim.py imports it
    "optim_fused_params.py": NO_TENSORS,  # a torch-free leaf beside optim.py
    "optim_gwd.py": NO_TENSORS,
    "optim_configs.py": NO_TENSORS,  # optim.py imports it
    "pooling.py": NO_TENSORS,  # a leaf every layer reads
    "knobs.py": NO_TENSORS,  # the planner may read it
    "id_manager.py": NO_TENSORS,  # the planner's table sets read it
    "train/config.py": NO_TENSORS,  # the CLI parses job arguments without torch
    "kernels/": ("torch.distributed",),  # kernels know no process groups
}
"""Path (a file, or a folder ending in /) -> external modules it must not import."""

TORCHREC = ("torchrec", "fbgemm_gpu")
TORCHREC_FILES = (
    "sparse.py",  # the converter: KJT / KeyedTensor <-> JaggedBatch
    "sharding/shard.py",  # shard() accepts a torchrec.EmbeddingBagCollection / EmbeddingCollection too
    "sharding/pipeline.py",  # the CUDA-graph pipeline rebuilds the batch's KJT on static buffers
    "sharding/dmp.py",  # a ModuleSharder: TorchRec's DMP shards ours via shard()
    "modules/ir.py",  # TorchRec's IR counterpart: EmbeddingBagConfigs to and from JSON
    "modules/torchrec_ir.py",  # registers our collections with torchrec.ir where it exists
    "train/data.py",  # batches carry KJTs; RandomRecDataset is the random source
    "train/job.py",  # the model: torchrec's DLRM, EmbeddingBagConfig, optimizer-in-backward
    "bench/",  # TorchRec and FBGEMM are the peers we measure against
)
"""The only files that import torchrec or fbgemm_gpu (the drop-in modules go through sparse.py)."""


# -- the checker ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    file: str
    """The importing file, relative to the package folder (``sharding/dist/fixed.py``)."""
    source: str
    """The importing module (``fbtriton_dist.sharding.dist.fixed``)."""
    target: str
    """The module it loads: one of ours, resolved, or the external dotted name."""
    line: int
    ours: bool
    """``target`` is in the package."""
    lazy_export: bool
    """Inside a package ``__init__``'s module-level ``__getattr__``."""


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every ``*.py`` under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _lazy_exports(tree: ast.Module, package: str, modules: Mapping[str, object]) -> dict[str, str]:
    """A package ``__init__``'s module-level ``{"name": "module"}`` tables: name -> module."""
    out = {}
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if not isinstance(value, ast.Dict):
            continue
        for k, v in zip(value.keys, value.values, strict=True):
            if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                for home in (str(v.value), f"{package}.{v.value}"):
                    if home in modules:
                        out[str(k.value)] = home
                        break
    return out


def package_imports(root: pathlib.Path) -> list[Import]:
    """Every import in every file under the package folder ``root`` (see the module docstring)."""
    modules = _modules(root)
    trees = {name: ast.parse(path.read_text(), str(path)) for name, path in modules.items()}
    lazy = {
        name: _lazy_exports(tree, name, modules)
        for name, tree in trees.items()
        if modules[name].name == "__init__.py"
    }

    def resolve(base: str, name: str) -> str:
        """What ``from base import name`` loads."""
        if f"{base}.{name}" in modules:
            return f"{base}.{name}"
        return lazy.get(base, {}).get(name, base)

    out: list[Import] = []
    for source, tree in trees.items():
        out += _file_imports(root, modules[source], source, tree, resolve)
    return out


def _file_imports(
    root: pathlib.Path,
    path: pathlib.Path,
    source: str,
    tree: ast.Module,
    resolve: Callable[[str, str], str],
) -> list[Import]:
    pkg, file = root.name, path.relative_to(root).as_posix()
    is_init = path.name == "__init__.py"
    hidden: set[int] = set()  # inside a package __init__'s lazy __getattr__
    if is_init:
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                hidden.update(id(n) for n in ast.walk(node))
    out: list[Import] = []

    def add(target: str, node: ast.stmt | ast.expr, ours: bool) -> None:
        out.append(Import(file, source, target, node.lineno, ours, id(node) in hidden))

    def is_ours(name: str) -> bool:
        return name == pkg or name.startswith(pkg + ".")

    roots = set()  # local names bound to the package itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name, node, is_ours(a.name))
                if is_ours(a.name) and a.asname is None:
                    roots.add(pkg)  # `import pkg.x.y` binds `pkg`
                elif a.name == pkg:
                    roots.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = source.split(".") if is_init else source.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            if not is_ours(base):
                add(base, node, False)  # and `from torch import distributed`: torch.distributed
                for a in node.names:
                    add(f"{base}.{a.name}", node, False)
                continue
            for a in node.names:
                add(resolve(base, a.name), node, True)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            target = resolve(pkg, node.attr) if node.value.id in roots else pkg
            if target != pkg:
                add(target, node, True)
        elif isinstance(node, ast.Call):
            target = _string_import(node, source, is_init)
            if target is not None and target != pkg:
                add(target, node, is_ours(target))
    return out


def _string_import(call: ast.Call, source: str, is_init: bool) -> str | None:
    """The module ``importlib.import_module("...")`` / ``__import__("...")`` loads (relative
    names counted from ``source``'s package; an f-string: the package its constant head names),
    or None for any other call or a name only known at run time."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = arg.value
    elif (isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant)
          and "." in str(arg.values[0].value)):
        text = str(arg.values[0].value).rsplit(".", 1)[0]  # f"pkg.kernels.{x}" -> pkg.kernels
    else:
        return None
    level = len(text) - len(text.lstrip("."))
    if level:
        parts = source.split(".") if is_init else source.split(".")[:-1]
        parts = parts[: len(parts) - (level - 1)]
        text = ".".join([*parts, *([text[level:]] if text[level:] else [])])
    return text or None


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(
    imports: Iterable[Import], allowed: Mapping[str, set[str]]
) -> dict[tuple[str, str], str]:
    """``(file, imported module)`` -> message, for every import its layer's row does not allow
    (and every file whose layer has no row)."""
    out = {}
    for imp in imports:
        if not imp.ours:
            continue
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src not in allowed:
            out[(imp.file, "")] = f"{imp.file}: layer {src!r} has no row in the layer table"
        elif dst not in (src, "__init__") and dst not in allowed[src]:
            out.setdefault(
                (imp.file, imp.target),
                f"{imp.file}:{imp.line} imports {imp.target}: {src}/ may import "
                f"{sorted(allowed[src]) or 'nothing of ours'}",
            )
    return out


def sublayer_of(module: str) -> str:
    """The sub-layer of a module inside its layer: its second name below the package (the
    layer's own ``__init__`` is ``__init__``)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def sublayer_violations(
    imports: Iterable[Import], layer: str, allowed: Mapping[str, set[str]]
) -> dict[tuple[str, str], str]:
    """``(file, imported module)`` -> message, for every import inside ``layer`` that its
    sub-layer's row does not allow (and every file of the layer whose sub-layer has no row)."""
    out = {}
    for imp in imports:
        if not imp.ours or layer_of(imp.source) != layer or layer_of(imp.target) != layer:
            continue
        src, dst = sublayer_of(imp.source), sublayer_of(imp.target)
        if src not in allowed:
            out[(imp.file, "")] = f"{imp.file}: {layer}/{src} has no row in the sub-layer table"
        elif dst != src and dst not in allowed[src]:
            out.setdefault(
                (imp.file, imp.target),
                f"{imp.file}:{imp.line} imports {imp.target}: {layer}/{src} may import "
                f"{sorted(allowed[src]) or f'nothing else of {layer}'}",
            )
    return out


def import_cycles(imports: Iterable[Import]) -> list[str]:
    """One line per strongly connected group of modules: a shortest cycle through it."""
    graph: dict[str, dict[str, str]] = {}
    for imp in imports:
        if imp.ours and not imp.lazy_export and imp.target != imp.source:
            graph.setdefault(imp.source, {}).setdefault(imp.target, f"{imp.file}:{imp.line}")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    lines = []
    for group in groups:
        start, members = group[0], set(group)
        paths = {start: [start]}
        queue = [start]
        while queue:  # breadth first, back to start
            v = queue.pop(0)
            for w in sorted(graph.get(v, {})):
                if w == start:
                    cycle = [*paths[v], start]
                    queue = []
                    break
                if w in members and w not in paths:
                    paths[w] = [*paths[v], w]
                    queue.append(w)
        steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        lines.append("; ".join(steps))
    return lines


def _under(file: str, place: str) -> bool:
    return file == place or (place.endswith("/") and file.startswith(place))


def external_violations(
    imports: Iterable[Import], forbidden: Mapping[str, tuple[str, ...]]
) -> list[str]:
    """Imports of external modules that ``forbidden`` keeps out of a file or folder."""
    out = []
    for imp in imports:
        for place, bad in forbidden.items():
            hit = [b for b in bad if imp.target == b or imp.target.startswith(b + ".")]
            if not imp.ours and _under(imp.file, place) and hit:
                out.append(f"{imp.file}:{imp.line} imports {imp.target} ({place} must not)")
    return sorted(set(out))


def torchrec_violations(imports: Iterable[Import], places: Iterable[str]) -> list[str]:
    places = tuple(places)
    out = [
        f"{imp.file}:{imp.line} imports {imp.target}"
        for imp in imports
        if not imp.ours
        and imp.target.split(".")[0] in TORCHREC
        and not any(_under(imp.file, p) for p in places)
    ]
    return sorted(set(out))


# -- the package ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return package_imports(PKG)


def test_every_top_level_module_has_a_layer():
    names = {p.stem for p in PKG.glob("*.py")}
    names |= {p.name for p in PKG.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    assert names - set(ALLOWED) == set(), "add a row to ALLOWED (and to DESIGN.md's table)"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_down(imports, layer):
    found = layer_violations([i for i in imports if layer_of(i.source) == layer], ALLOWED)
    problems = [msg for _, msg in sorted(found.items())]
    assert problems == []


def test_every_sublayer_has_a_row():
    for layer, rows in SUBLAYERS.items():
        folder = PKG / layer
        names = {p.stem for p in folder.glob("*.py")}
        names |= {p.name for p in folder.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
        assert names - set(rows) == set(), f"add a row to SUBLAYERS[{layer!r}]"


@pytest.mark.parametrize("layer", sorted(SUBLAYERS))
def test_imports_point_down_inside_a_layer(imports, layer):
    found = sublayer_violations(imports, layer, SUBLAYERS[layer])
    problems = [msg for _, msg in sorted(found.items())]
    assert problems == []


def test_the_library_never_imports_bench():
    assert [layer for layer, row in ALLOWED.items()
            if "bench" in row and layer not in ENTRY_POINTS] == []


def test_no_import_cycles(imports):
    assert import_cycles(imports) == []


def test_no_tensor_libraries_where_forbidden(imports):
    assert external_violations(imports, FORBIDDEN) == []


def test_torchrec_only_where_its_api_is_implemented(imports):
    assert torchrec_violations(imports, TORCHREC_FILES) == []


# -- the checker on a planted package ------------------------------------------------------------
FAKE_ALLOWED = {"__init__": set(), "kernels": set(), "ops": {"kernels"}, "sharding": {"ops"}}
FAKE = {
    "__init__.py": """
        import importlib
        _NAMES = {"run": "fake.sharding.run"}
        def __getattr__(name):
            return importlib.import_module(_NAMES[name])
        """,
    "kernels/__init__.py": "",
    "kernels/tbe.py": "import torch\n",
    "ops/__init__.py": """
        def __getattr__(name):  # lazy re-export: not an edge
            from fake.ops.lookup import lookup
            return lookup
        """,
    "ops/lookup.py": """
        from fake import ops  # the package: its lazy __getattr__ closes no cycle
        from fake.kernels import tbe
        from .checks import check
        """,
    "ops/checks.py": "import fake.kernels.tbe\n",
    "sharding/__init__.py": "from .run import run\n",
    "sharding/run.py": """
        import fake.ops.lookup
        def run():
            pass
        """,
}


def _write(root: pathlib.Path, files: Mapping[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _planted(tmp_path: pathlib.Path, changes: Mapping[str, str] | None = None) -> list[Import]:
    """The imports of FAKE with ``changes`` (file -> new text) planted in it."""
    return package_imports(_write(tmp_path / "fake", {**FAKE, **(changes or {})}))


def test_checker_passes_the_clean_package(tmp_path):
    imports = _planted(tmp_path)
    assert layer_violations(imports, FAKE_ALLOWED) == {}
    assert import_cycles(imports) == []


def test_checker_reports_an_import_that_points_up(tmp_path):
    imports = _planted(tmp_path, {"kernels/tbe.py": "import torch\nfrom fake.ops import lookup\n"})
    assert set(layer_violations(imports, FAKE_ALLOWED)) == {("kernels/tbe.py", "fake.ops.lookup")}


FAKE_SUBLAYERS = {"__init__": {"run", "dist", "modules"}, "run": set(), "dist": set(),
                  "modules": {"dist"}}


def test_checker_reports_a_sublayer_import_that_points_up(tmp_path):
    planted = {"sharding/dist/__init__.py": "", "sharding/dist/input.py": "",
               "sharding/modules/__init__.py": "",
               "sharding/modules/ebc.py": "from fake.sharding.dist import input\n"}
    imports = _planted(tmp_path, planted)
    assert sublayer_violations(imports, "sharding", FAKE_SUBLAYERS) == {}
    up = {"sharding/dist/input.py": "def f():\n    from ..modules.ebc import x\n"}
    imports = _planted(tmp_path / "up", {**planted, **up})
    assert set(sublayer_violations(imports, "sharding", FAKE_SUBLAYERS)) == {
        ("sharding/dist/input.py", "fake.sharding.modules.ebc")}
    # the layer's package imports every sub-layer: only its own __init__ may import it
    pkg = {"sharding/dist/input.py": "from fake.sharding import run\nimport fake.sharding\n"}
    imports = _planted(tmp_path / "pkg", {**planted, **pkg})
    assert set(sublayer_violations(imports, "sharding", FAKE_SUBLAYERS)) == {
        ("sharding/dist/input.py", "fake.sharding.run"), ("sharding/dist/input.py", "fake.sharding")}


def test_checker_reports_a_relative_import_that_skips_a_layer(tmp_path):
    imports = _planted(tmp_path, {"sharding/run.py": "from ..kernels.tbe import x\n"})
    assert set(layer_violations(imports, FAKE_ALLOWED)) == {("sharding/run.py", "fake.kernels.tbe")}


def test_checker_reports_a_cycle_hidden_in_a_function(tmp_path):
    # inside one layer, so only the cycle check can see it
    imports = _planted(tmp_path, {"ops/checks.py": "def f():\n    from . import lookup\n"})
    assert layer_violations(imports, FAKE_ALLOWED) == {}
    (cycle,) = import_cycles(imports)
    assert cycle == (
        "fake.ops.checks -> fake.ops.lookup (ops/checks.py:2); "
        "fake.ops.lookup -> fake.ops.checks (ops/lookup.py:4)"
    )


def test_checker_reports_a_cycle_through_import_module(tmp_path):
    # the string import is the only edge back: an `import` statement would be seen anyway
    checks = 'import importlib\ndef f():\n    return importlib.import_module("fake.ops.lookup")\n'
    imports = _planted(tmp_path, {"ops/checks.py": checks})
    (cycle,) = import_cycles(imports)
    assert cycle == (
        "fake.ops.checks -> fake.ops.lookup (ops/checks.py:3); "
        "fake.ops.lookup -> fake.ops.checks (ops/lookup.py:4)"
    )


def test_checker_reports_a_cycle_through_dunder_import_across_layers(tmp_path):
    tbe = "import torch\ndef f():\n    return __import__('fake.sharding.run')\n"
    imports = _planted(tmp_path, {"kernels/tbe.py": tbe})
    assert set(layer_violations(imports, FAKE_ALLOWED)) == {("kernels/tbe.py", "fake.sharding.run")}
    assert len(import_cycles(imports)) == 1


def test_checker_reports_a_type_checking_cycle_across_packages(tmp_path):
    tbe = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fake import run\n"
    imports = _planted(tmp_path, {"kernels/tbe.py": tbe})
    assert set(layer_violations(imports, FAKE_ALLOWED)) == {("kernels/tbe.py", "fake.sharding.run")}
    assert len(import_cycles(imports)) == 1


def test_checker_reports_forbidden_and_torchrec_imports(tmp_path):
    imports = _planted(
        tmp_path,
        {"kernels/tbe.py": "from torch import distributed\n", "ops/checks.py": "import torchrec\n"},
    )
    assert external_violations(imports, {"kernels/": ("torch.distributed",)}) == [
        "kernels/tbe.py:1 imports torch.distributed (kernels/ must not)"
    ]
    assert torchrec_violations(imports, ["sharding/"]) == ["ops/checks.py:1 imports torchrec"]


@pytest.mark.parametrize(
    "file, code, target",
    [
        ("sharding/x.py", "import fake.kernels.tbe", "fake.kernels.tbe"),
        ("sharding/x.py", "import fake.kernels.tbe as t", "fake.kernels.tbe"),
        ("sharding/x.py", "from fake import kernels", "fake.kernels"),
        ("sharding/x.py", "from fake.kernels import tbe", "fake.kernels.tbe"),
        ("sharding/x.py", "from fake.kernels import some_name", "fake.kernels"),
        ("sharding/x.py", "from fake import run", "fake.sharding.run"),  # the lazy table
        ("sharding/x.py", "from . import run", "fake.sharding.run"),
        ("sharding/x.py", "from .run import run", "fake.sharding.run"),
        ("sharding/x.py", "from .. import kernels", "fake.kernels"),
        ("sharding/x.py", "from ..kernels import tbe", "fake.kernels.tbe"),
        ("sharding/x.py", "from ..kernels.tbe import x", "fake.kernels.tbe"),
        ("sharding/__init__.py", "from .run import run", "fake.sharding.run"),
        ("sharding/__init__.py", "from ..ops import lookup", "fake.ops.lookup"),
        ("sharding/x.py", "def f():\n    from fake.kernels import tbe", "fake.kernels.tbe"),
        ("sharding/x.py", "import fake\nfake.run()", "fake.sharding.run"),
        ("sharding/x.py", "import fake as f\nf.kernels", "fake.kernels"),
        ("sharding/x.py", "import importlib\nimportlib.import_module('fake.kernels.tbe')",
         "fake.kernels.tbe"),
        ("sharding/x.py", "from importlib import import_module\nimport_module('fake.ops')",
         "fake.ops"),
        ("sharding/x.py", "__import__('fake.kernels.tbe')", "fake.kernels.tbe"),
        ("sharding/x.py", "import importlib\nimportlib.import_module('.run', __package__)",
         "fake.sharding.run"),
        ("sharding/x.py", "import importlib\nimportlib.import_module('..kernels.tbe', 'x')",
         "fake.kernels.tbe"),
        ("sharding/x.py", "import importlib\nn = 'tbe'\nimportlib.import_module(f'fake.kernels.{n}')",
         "fake.kernels"),
    ],
)
def test_checker_resolves_every_import_form(tmp_path, file, code, target):
    imports = _planted(tmp_path, {file: code + "\n"})
    found = {i.target for i in imports if i.file == file and i.ours and i.target != "fake"}
    assert target in found
