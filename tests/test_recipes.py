"""DEVELOPERS.md's "Where a change goes" recipes for a backend and a fused optimizer, followed
literally in a temporary copy of the package: the edits touch only the files the recipe names
(counted against the original), and the result works (one subprocess per recipe, with the
copy first on ``PYTHONPATH``; the real tree is never modified).

Each edit is a small text insertion at an anchor of the file the recipe names; an anchor that
is gone fails the test: the recipe no longer matches the file, and one of them should change.
"""

import filecmp
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fbtriton_dist"
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")

BACKEND_FILES = 2
"""The backend recipe: "2 package files plus its kernels" (the dummy has none)."""
REFERENCE_OPTIMIZER_FILES = 3
"""The optimizer recipe: "Package files per backend that implements it: reference 3"."""


def _copy(tmp_path: Path) -> Path:
    """A copy of the package under ``tmp_path``; returns the copy's ``fbtriton_dist``."""
    shutil.copytree(PACKAGE, tmp_path / "fbtriton_dist", ignore=_IGNORE)
    return tmp_path / "fbtriton_dist"


def _insert(path: Path, anchor: str, text: str, *, before: bool = False) -> None:
    """Insert ``text`` after (or before) the one occurrence of ``anchor`` in ``path``."""
    source = path.read_text()
    count = source.count(anchor)
    assert count == 1, (
        f"the recipe no longer matches {path.name}: expected its anchor {anchor!r} once, "
        f"found it {count} times"
    )
    at = source.index(anchor) + (0 if before else len(anchor))
    path.write_text(source[:at] + text + source[at:])


def _touched(copy: Path) -> list[str]:
    """Package files of the copy that differ from the original or are new."""
    out = []
    for path in sorted(copy.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts or path.suffix in (".pyc", ".so"):
            continue
        rel = path.relative_to(copy)
        original = PACKAGE / rel
        if not original.exists() or not filecmp.cmp(path, original, shallow=False):
            out.append(str(Path("fbtriton_dist") / rel))
    gone = [
        p for p in PACKAGE.rglob("*.py")
        if "__pycache__" not in p.parts and not (copy / p.relative_to(PACKAGE)).exists()
    ]
    assert not gone, f"the copy lost files: {gone}"
    return out


def _run(copy: Path, script: str) -> None:
    """Run ``script`` with the copy of the package first on the path; fail with its output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(copy.parent)
    env.setdefault("FBTD_CPU_NATIVE_CACHE", str(copy.parent / "native-cache"))
    prelude = textwrap.dedent(f"""
        import fbtriton_dist
        assert fbtriton_dist.__file__.startswith({str(copy)!r}), fbtriton_dist.__file__
    """)
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        cwd=copy.parent, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.stdout.strip().endswith("ok"), done.stdout


# -- a backend ------------------------------------------------------------------------------

DUMMY_BACKEND = '''\
"""A restricted backend: the reference's ops, sum pooling, SGD and fp32 on CPU only."""

from fbtriton_dist.ops.backends.base import Capabilities
from fbtriton_dist.ops.backends.reference import ReferenceBackend
from fbtriton_dist.pooling import PoolingMode


class DummyBackend(ReferenceBackend):
    pass


BACKEND = DummyBackend(
    "dummy",
    Capabilities(
        devices=("cpu",),
        poolings=(PoolingMode.SUM,),
        optimizers=("sgd",),
        dtypes=("float32",),
    ),
    "fbtriton_dist.reference",
)
'''

BACKEND_CHECKS = """
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from fbtriton_dist import EmbeddingBagCollection, TableBatchedEmbedding, optim
from fbtriton_dist.ops import backends
from fbtriton_dist.train.config import ConfigError, load_job

assert "dummy" in backends.names() and "dummy" in backends.choices(), backends.names()
assert backends.capabilities("dummy").optimizers == ("sgd",)

# a TableBatchedEmbedding trains one step as the reference does
tables, ftm = [(7, 3), (5, 4)], [0, 1, 0]
indices = torch.tensor([1, 6, 6, 0, 4, 4, 2, 3, 5])
offsets = torch.tensor([0, 2, 3, 3, 6, 7, 9])  # T=3 features, B=2, one empty bag
w0 = torch.randn(7 * 3 + 5 * 4, generator=torch.Generator().manual_seed(0))
mods = {}
for name in ("reference", "dummy"):
    m = mods[name] = TableBatchedEmbedding(tables, ftm, optimizer=optim.SGD(lr=0.5),
                                           backend=name, stochastic_rounding=False)
    with torch.no_grad():
        m.weights.copy_(w0)
    out = m(indices, offsets)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / 10)
    m.out = out.detach()
assert torch.equal(mods["dummy"].out, mods["reference"].out)
assert torch.equal(mods["dummy"].weights.detach(), mods["reference"].weights.detach())
assert not torch.equal(mods["dummy"].weights.detach(), w0)  # it did step

# what it lacks is refused when a module is built, naming it
for kwargs, what in [
    (dict(pooling="mean"), "pooling 'mean'"),
    (dict(optimizer=optim.Adagrad()), "optimizer 'adagrad'"),
    (dict(weights_dtype=torch.float16), "dtype float16"),
    (dict(output_dtype=torch.bfloat16), "dtype bfloat16"),
]:
    with pytest.raises(ValueError, match=f"backend='dummy' does not support {what}"):
        TableBatchedEmbedding(tables, ftm, backend="dummy", **kwargs)

# an EmbeddingBagCollection too
configs = [
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
    EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=6, feature_names=["f2", "f3"]),
]
kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 9, 9, 0, 5, 2, 3]),
                        lengths=torch.tensor([2, 1, 0, 2, 1, 1]))
ebcs = {}
for name in ("reference", "dummy"):
    torch.manual_seed(1)
    ebc = ebcs[name] = EmbeddingBagCollection(tables=configs, backend=name)
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    values = ebc(kjt).values()
    values.backward(torch.ones_like(values))
    ebc.out = values.detach()
assert torch.equal(ebcs["dummy"].out, ebcs["reference"].out)
ref_state = ebcs["reference"].state_dict()
for key, value in ebcs["dummy"].state_dict().items():
    assert torch.equal(value, ref_state[key]), key
assert ebcs["dummy"]._tbes[0].optimizer is not None  # the fused step ran
mean = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=3, feature_names=["f"],
                           pooling=PoolingType.MEAN)]
with pytest.raises(ValueError, match="backend='dummy' does not support pooling 'mean'"):
    EmbeddingBagCollection(tables=mean, backend="dummy")

# the job config's choices come from the registry
job = "configs/jobs/quickstart.yaml"
assert load_job(ROOT + job, ["backend=dummy"]).backend == "dummy"
with pytest.raises(ConfigError, match="backend: expected one of .*dummy"):
    load_job(ROOT + job, ["backend=nope"])
print("ok")
"""


def test_backend_recipe(tmp_path):
    copy = _copy(tmp_path)
    # 1. ops/backends/<name>.py: its BACKEND, a subclass reusing an existing backend's ops
    (copy / "ops" / "backends" / "dummy.py").write_text(DUMMY_BACKEND)
    # 2. ops/backends/__init__.py: its line in MODULES
    _insert(copy / "ops" / "backends" / "__init__.py",
            'MODULES: dict[str, str] = {\n',
            '    "dummy": "fbtriton_dist.ops.backends.dummy",\n')
    # 3. its kernels: none (the reference's)
    touched = _touched(copy)
    assert len(touched) <= BACKEND_FILES, touched
    _run(copy, f"ROOT = {str(ROOT) + os.sep!r}\n" + BACKEND_CHECKS)


# -- a fused optimizer, on the reference backend only ---------------------------------------

ADAMAX_CONFIG = '''

@dataclass(kw_only=True, frozen=True)
class Adamax:
    """torch.optim.Adamax on the rows of the batch: ``m = b1 m + (1 - b1) g``,
    ``u = max(b2 u, |g| + eps)``, ``w -= lr / (1 - b1^t) * m / u``."""

    lr: float = 0.002
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay of the first moment and of the infinity norm."""
    eps: float = 1e-8
    """Added to |g|."""

    def __post_init__(self) -> None:
        _check_positive("Adamax", lr=self.lr, eps=self.eps)
'''

ADAMAX_ENTRY = '''\
        OptimizerSpec(
            name="adamax",
            fbgemm=None,  # FBGEMM has no Adamax
            config=Adamax,
            states=(State("momentum1", per_row=False), State("momentum2", per_row=False)),
            hyper=("lr", "eps", "betas"),
            torch=(
                TorchClass(
                    "torch.optim.Adamax",
                    kwargs={"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8},
                    fixed={"weight_decay": 0},
                ),
            ),
            kernel_code=50,
        ),
'''

ADAMAX_UPDATE = '''

def _adamax_update(opt: optim.Adamax, w, g, t, momentum1, momentum2, state_rows, elems):
    b1, b2 = opt.betas
    m = b1 * momentum1[elems] + (1.0 - b1) * g
    u = torch.maximum(b2 * momentum2[elems], g.abs() + opt.eps)
    momentum1[elems] = m
    momentum2[elems] = u
    return w - opt.lr / (1.0 - b1**t) * m / u
'''

OPTIMIZER_CHECKS = """
import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.cli import build_parser
from fbtriton_dist.planner import OPTIMIZERS, ShardingPlanner, TableSpec, state_bytes
from fbtriton_dist.train.config import EmbeddingOptimizerConfig
from fbtriton_dist.train.job import _embedding_optimizer

assert "adamax" in optim.NAMES and optim.KERNEL_CODES["adamax"] == 50
assert len(set(optim.KERNEL_CODES.values())) == len(optim.KERNEL_CODES)

# the registry entry gives the planner, the job config and the torch-class mapping
assert "adamax" in OPTIMIZERS
assert state_bytes("adamax", 10, 8) == 2 * 4 * 10 * 8
TableSpec(name="t", num_embeddings=4, embedding_dim=2, features=("f",), optimizer="adamax")
ShardingPlanner(world_size=1, hbm_bytes_per_rank=2**30, optimizer="adamax")
assert build_parser().parse_args(
    ["plan", "t.yaml", "--world-size", "1", "--optimizer", "adamax"]).optimizer == "adamax"
fused = _embedding_optimizer(EmbeddingOptimizerConfig(type="adamax", lr=0.3, eps=1e-6))
assert fused == optim.Adamax(lr=0.3, eps=1e-6), fused
cls, kwargs = optim.torch_equivalent(fused)
assert cls is torch.optim.Adamax
assert optim.from_torch(cls, kwargs, "t") == fused

# one reference step is the hand-computed one (t=1: w - lr * g / (|g| + eps)), as torch's
tables, ftm = [(7, 3), (5, 4)], [0, 1, 0]
indices = torch.tensor([1, 6, 6, 0, 4, 4, 2, 3, 5])
offsets = torch.tensor([0, 2, 3, 3, 6, 7, 9])
w0 = torch.randn(7 * 3 + 5 * 4, generator=torch.Generator().manual_seed(0))


def step(optimizer):
    m = TableBatchedEmbedding(tables, ftm, optimizer=optimizer, backend="reference",
                              stochastic_rounding=False)
    with torch.no_grad():
        m.weights.copy_(w0)
    out = m(indices, offsets)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / 10 - 0.5)
    return m


g = step(None).weights.grad.to_dense()
opt = optim.Adamax(lr=0.25, eps=1e-3)
fused = step(opt)
assert (g != 0).any() and (g == 0).any()
torch.testing.assert_close(fused.weights.detach(), w0 - opt.lr * g / (g.abs() + opt.eps))
dense = torch.nn.Parameter(w0.clone())
theirs = torch.optim.Adamax([dense], lr=opt.lr, eps=opt.eps)
dense.grad = g
theirs.step()
torch.testing.assert_close(fused.weights.detach(), dense.detach())
assert fused.momentum1.numel() == fused.momentum2.numel() == w0.numel()
assert fused.step == 1

# the backends whose code lacks it refuse it when a module is built, naming themselves
for name in ("cpu", "triton"):
    with pytest.raises(ValueError, match=f"backend='{name}' does not support optimizer 'adamax'"):
        TableBatchedEmbedding(tables, ftm, optimizer=opt, backend=name)
print("ok")
"""


def test_optimizer_recipe_on_the_reference_backend(tmp_path):
    copy = _copy(tmp_path)
    # 1. optim_configs.py: its config class; optim.py: its import, in ``Optimizer``, and one
    # REGISTRY entry
    configs = copy / "optim_configs.py"
    configs.write_text(configs.read_text() + ADAMAX_CONFIG)
    opt = copy / "optim.py"
    _insert(opt, "    Adam,\n", "    Adamax,\n")
    _insert(opt, "\n\nOptimizer = SGD | Adagrad | RowWiseAdagrad | Adam", " | Adamax")
    _insert(opt, '    )\n}\n"""Every fused optimizer, by name."""', ADAMAX_ENTRY, before=True)
    # 2. reference/tbe.py: its twin in UPDATES
    ref = copy / "reference" / "tbe.py"
    _insert(ref, "\n\nUPDATES = {\n", ADAMAX_UPDATE, before=True)
    _insert(ref, "\n\nUPDATES = {\n", '    "adamax": _adamax_update,\n')
    touched = _touched(copy)
    assert len(touched) <= REFERENCE_OPTIMIZER_FILES, touched
    _run(copy, OPTIMIZER_CHECKS)
