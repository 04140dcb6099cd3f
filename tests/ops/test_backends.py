"""The backend registry (``ops/backends/``): every (backend, pooling, optimizer, dtype)
available on the CPU either builds a module whose forward + backward step matches the
reference backend's, or fails when the module is built with a ``ValueError`` naming the
backend; what a backend lacks (a fake backend, an optimizer the native CPU code lacks) fails
at construction, not at the first backward."""

import dataclasses

import pytest
import torch

from fbtriton_dist import EmbeddingBagCollection, TableBatchedEmbedding, optim
from fbtriton_dist.ops import backends, cpu_native
from fbtriton_dist.ops.backends import Backend, Capabilities
from fbtriton_dist.pooling import PoolingMode
from tests.conftest import TRITON_OK
from tests.helpers import device_for, make_batch, to, upstream_grad

TABLES, FTM, B = [(6, 3), (5, 4)], [0, 1, 0], 3
OPTIMIZERS = {"none": None, **{n: optim.spec(n).config(lr=0.1) for n in optim.NAMES}}
HALF = (torch.float16, torch.bfloat16)


def _step(backend, pooling, optimizer, dtype, batch):
    """One forward + backward on a fresh module (fixed seed): (output, weights, states, grad)."""
    dev = device_for(backend)
    tbe = TableBatchedEmbedding(
        TABLES, FTM, pooling=pooling, optimizer=optimizer, weights_dtype=dtype, backend=backend,
        device=dev, stochastic_rounding=False, seed=1,
    )
    with torch.no_grad():  # the same rows on every device (a seeded init differs on CUDA)
        init = torch.rand(tbe.weights.shape, generator=torch.Generator().manual_seed(0))
        tbe.weights.copy_(init.to(dtype) - 0.5)
    indices, offsets, psw = to(dev, *batch)
    out = tbe(indices, offsets, psw)
    out.backward(upstream_grad(out, 0).to(out.dtype))
    grad = tbe.weights.grad.cpu() if optimizer is None else None
    return out.detach().float().cpu(), tbe.weights.detach().float().cpu(), [
        s.cpu() for s in (tbe.momentum1, tbe.momentum2)], grad


def _combinations():
    for backend in backends.names():
        for pooling in PoolingMode:
            for opt in OPTIMIZERS:
                yield backend, pooling.label, opt, torch.float32
        for dtype in HALF:  # half weights: one pooling and optimizer each
            yield backend, "sum", "rowwise_adagrad", dtype


@pytest.mark.parametrize(
    ("backend", "pooling", "opt", "dtype"),
    list(_combinations()),
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_every_combination_builds_and_matches_the_reference(backend, pooling, opt, dtype):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    caps = backends.capabilities(backend)
    supported = not caps.problems(pooling=pooling, optimizer=opt if opt != "none" else None,
                                  dtypes=(dtype,))
    g = torch.Generator().manual_seed(7)
    batch = make_batch(TABLES, FTM, B, 3, weighted=pooling != "none", hot=True, generator=g)
    if not supported:
        with pytest.raises(ValueError, match=f"backend='{backend}'"):
            _step(backend, pooling, OPTIMIZERS[opt], dtype, batch)
        return
    out, weights, states, grad = _step(backend, pooling, OPTIMIZERS[opt], dtype, batch)
    r_out, r_weights, r_states, r_grad = _step("reference", pooling, OPTIMIZERS[opt], dtype,
                                               batch)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, r_out, **tol)
    torch.testing.assert_close(weights, r_weights, **tol)
    for a, b in zip(states, r_states, strict=True):
        torch.testing.assert_close(a, b, **tol)
    if grad is not None:
        torch.testing.assert_close(grad, r_grad, **tol)


def test_registry_names_and_auto():
    assert set(backends.names()) >= {"triton", "cpu", "reference"}
    assert backends.choices() == ("auto", *backends.names())
    assert backends.resolve("auto", "cpu") == "cpu"
    assert backends.resolve("auto", torch.device("meta")) == "cpu"
    with pytest.raises(ValueError, match="backend: expected one of"):
        backends.check_choice("cuda")
    with pytest.raises(ValueError, match="backend: expected one of"):
        TableBatchedEmbedding(TABLES, backend="fast")


def test_capabilities_match_the_implementations():
    """Each backend's optimizers are those its code implements (no static list drifts)."""
    from fbtriton_dist.ops import cpu
    from fbtriton_dist.reference.tbe import UPDATES

    assert backends.capabilities("reference").optimizers == tuple(
        n for n in optim.NAMES if n in UPDATES)
    # the CPU backend: every optimizer with a torch step; the native kernels where they have it
    assert backends.capabilities("cpu").optimizers == tuple(
        n for n in optim.NAMES if n in cpu.STEP_OPTIMIZERS)
    from fbtriton_dist.ops.backends import cpu as cpu_backend

    assert cpu_backend.NATIVE_OPTIMIZERS == tuple(
        n for n in optim.NAMES if n in cpu_native.NATIVE_OPTIMIZERS and n in cpu.STEP_OPTIMIZERS)
    if TRITON_OK:
        from fbtriton_dist.kernels import tbe_optim

        for name in backends.capabilities("triton").optimizers:
            assert getattr(tbe_optim, f"_{name.upper()}").value == optim.spec(name).kernel_code
    caps = {n: backends.capabilities(n) for n in backends.names()}
    assert [n for n, c in caps.items() if c.capturable] == ["triton"]
    assert [n for n, c in caps.items() if c.plan_ahead] == ["triton"]
    assert [n for n, c in caps.items() if c.bounds_check_in_kernel] == ["triton", "cpu"]
    assert [n for n, c in caps.items() if c.weights_check_in_kernel] == ["cpu"]
    assert [n for n, c in caps.items() if c.native_input_check] == ["cpu"]
    # storage tiers: those tests/modules/test_tiers.py trains exactly as device
    assert {n: c.tiers for n, c in caps.items()} == {
        "triton": ("device", "host", "cached", "file"),
        "cpu": ("device", "host", "cached", "file"),
        "reference": ("device", "host", "cached", "file"),
    }


@pytest.fixture
def limited(monkeypatch):
    """A registered backend that runs the reference but supports little: sum pooling, SGD,
    fp32, CPU tensors."""
    caps = Capabilities(devices=("cpu",), poolings=(PoolingMode.SUM,), optimizers=("sgd",),
                        dtypes=("float32",))
    backend = Backend("limited", caps, "fbtriton_dist.reference")
    monkeypatch.setitem(backends.MODULES, "limited", "unused")
    monkeypatch.setitem(backends._LOADED, "limited", backend)
    return backend


def test_unsupported_combinations_fail_at_construction(limited):
    tbe = TableBatchedEmbedding(TABLES, FTM, backend="limited", optimizer=optim.SGD(lr=0.1))
    g = torch.Generator().manual_seed(3)
    indices, offsets, _ = make_batch(TABLES, FTM, B, 3, generator=g)
    tbe(indices, offsets).sum().backward()  # what it supports runs
    cases = [
        (dict(pooling="mean"), r"pooling 'mean' \(supported: \['sum'\]\)"),
        (dict(weights_dtype=torch.float16), r"dtype float16 \(supported: \['float32'\]\)"),
        (dict(output_dtype=torch.bfloat16), r"dtype bfloat16"),
        (dict(optimizer=optim.Adam()), r"optimizer 'adam' \(supported: \['sgd'\]\)"),
        (dict(storage=["cached", "device"]), r"storage tier 'cached' \(supported: \['device'\]\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=r"backend='limited' does not support " + message):
            TableBatchedEmbedding(TABLES, FTM, backend="limited", **kwargs)
    with pytest.raises(ValueError, match="backend='limited' does not support optimizer"):
        tbe.set_optimizer(optim.RowWiseAdagrad())


def test_auto_names_the_backend_it_picked(limited, monkeypatch):
    monkeypatch.setattr(backends, "AUTO_DEFAULT", "limited")
    with pytest.raises(ValueError, match=r"backend='limited' \(from 'auto'\) does not support"):
        TableBatchedEmbedding(TABLES, pooling="none")


def test_collections_fail_at_construction(limited):
    from torchrec import EmbeddingBagConfig, PoolingType

    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                 feature_names=["f"], pooling=PoolingType.MEAN)]
    with pytest.raises(ValueError, match="backend='limited' does not support pooling 'mean'"):
        EmbeddingBagCollection(tables, backend="limited")


@dataclasses.dataclass(kw_only=True, frozen=True)
class _Lion:
    """A registry optimizer no backend implements (yet)."""

    lr: float = 0.01


@pytest.fixture
def lion(monkeypatch):
    spec = optim.OptimizerSpec(name="lion", fbgemm="NONE", config=_Lion, states=(),
                               hyper=("lr",), torch=(), kernel_code=9)
    monkeypatch.setitem(optim.REGISTRY, "lion", spec)
    monkeypatch.setitem(optim._BY_CONFIG, _Lion, spec)
    monkeypatch.setitem(optim.KERNEL_CODES, "lion", 9)
    return _Lion(lr=0.1)


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_a_registry_optimizer_a_backend_lacks_fails_at_construction(backend, lion):
    """Not a KeyError at the first CPU backward (the native code has no code for it)."""
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    assert "lion" not in cpu_native.OPT_CODES
    with pytest.raises(ValueError, match=f"backend='{backend}' does not support optimizer "
                                         r"'lion' \(supported: \['sgd'"):
        TableBatchedEmbedding(TABLES, FTM, backend=backend, optimizer=lion,
                              device=device_for(backend))


def test_devices_are_checked_where_the_module_lives(monkeypatch):
    """A backend for CUDA tensors only: a module may be built on a staging device (cpu, meta)
    and moved; building or moving it onto a device the backend lacks is refused."""
    caps = Capabilities(devices=("cuda",))
    monkeypatch.setitem(backends.MODULES, "gpu_only", "unused")
    monkeypatch.setitem(backends._LOADED, "gpu_only", Backend("gpu_only", caps, "unused"))
    TableBatchedEmbedding(TABLES, backend="gpu_only", device="meta")
    tbe = TableBatchedEmbedding(TABLES, backend="gpu_only")  # cpu: staged, not refused
    with pytest.raises(ValueError, match=r"backend='gpu_only' does not support device 'xpu' "
                                         r"\(supported: \['cuda'\]\)"):
        backends.check_supported("gpu_only", device="xpu")
    with pytest.raises(RuntimeError, match="backend='gpu_only' runs on \\['cuda'\\] tensors"):
        tbe(torch.tensor([0]), torch.tensor([0, 1, 1]))  # the lookup checks the device
