"""The optimizer registry (``optim.REGISTRY``) against everything that reads it: each entry's
torch class maps to its config and back, each config to its kernel code, the planner's and
the job's choices are the registry's names, the planner's state bytes are the module's state
tensors, and every entry has a reference update that descends, and the kernels of each backend
that implements it match it. Parametrized over the registry: a new entry is checked here
without editing this file, also one that only some backends implement."""

import dataclasses
import inspect

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import backends
from tests.conftest import DEVICE, TRITON_OK
from tests.helpers import make_batch, upstream_grad

NAMES = list(optim.REGISTRY)
TABLES, FTM, B, MAX_L = [(7, 3), (5, 4), (1, 8)], [0, 1, 0, 2], 3, 4


def _off_default(value):
    """A valid value other than a default: for the round trips."""
    if isinstance(value, tuple):
        return tuple(0.9 * v for v in value)
    return 0.9 * value if 0 < value < 1 else value + 0.05  # a fraction stays below 1


def _example(entry: optim.OptimizerSpec) -> optim.Optimizer:
    """A config with every field its torch class maps set away from the class's default."""
    kwargs = {k: _off_default(v) for k, v in entry.keywords.items()}
    return entry.config(**kwargs)


def test_registry_is_consistent():
    assert tuple(NAMES) == optim.NAMES and len(set(NAMES)) == len(NAMES)
    assert {e.config for e in optim.REGISTRY.values()} == set(optim.Optimizer.__args__)
    codes = [e.kernel_code for e in optim.REGISTRY.values()]
    assert len(set(codes)) == len(codes) and 0 not in codes
    for entry in optim.REGISTRY.values():
        names = [s.name for s in entry.states]  # momentum1, momentum2 first, in that order
        assert len(set(names)) == len(names) and set(names) <= set(optim.STATE_BUFFERS)
        moments = [n for n in names if n.startswith("momentum")]
        assert names[: len(moments)] == list(optim.STATE_BUFFERS[: len(moments)]), entry.name
        fields = {f.name for f in dataclasses.fields(entry.config)}
        assert set(entry.hyper) <= fields and "lr" in entry.hyper, entry.name
        assert set(entry.keywords) <= fields, entry.name
        assert optim.spec(entry.name) is entry and optim.spec_of(entry.config()) is entry
    with pytest.raises(ValueError, match=r"expected one of \[sgd, adagrad, "):
        optim.spec("lion")
    with pytest.raises(ValueError, match="expected None or fbtriton_dist.optim.SGD"):
        optim.spec_of(torch.optim.SGD)


SHIPPED_EVERYWHERE = {"sgd", "adagrad", "rowwise_adagrad", "adam"}
"""The optimizers every backend ships: the skips below for an entry a backend lacks must never
cover one of these."""


def test_every_backend_implements_the_shipped_optimizers():
    assert SHIPPED_EVERYWHERE <= set(NAMES)
    for name in ("reference", "cpu", "triton"):
        missing = SHIPPED_EVERYWHERE - set(backends.capabilities(name).optimizers)
        assert not missing, f"backend {name!r} lost {sorted(missing)}"


def test_fbgemm_names_exist():
    configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")
    for entry in optim.REGISTRY.values():
        assert entry.fbgemm is None or hasattr(configs.EmbOptimType, entry.fbgemm), entry.fbgemm


@pytest.mark.parametrize("name", NAMES)
def test_torch_class_maps_to_the_config_and_back(name):
    entry = optim.REGISTRY[name]
    for tc in entry.torch:
        cls = tc.resolve()
        if cls is None:
            pytest.skip(f"{tc.path} is not installed")
        # the recorded defaults are the class's own (TorchRec's placeholders for FBGEMM-only
        # optimizers take **kwargs: FBGEMM's defaults, checked against FBGEMM's TBE below)
        params = inspect.signature(cls).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for key, default in {**tc.kwargs, **tc.fixed}.items():
            if takes_any and key not in params:
                continue
            assert params[key].default == default, (tc.path, key)
        assert optim.from_torch(cls, {}, "t") == entry.config(**tc.kwargs)
        for key, allowed in tc.fixed.items():
            other = (not allowed) if isinstance(allowed, bool) else allowed + 0.5
            with pytest.raises(ValueError, match=rf"\({key}={other!r}\) has no fused equivalent"):
                optim.from_torch(cls, {key: other}, "t")
    example = _example(entry)
    cls, kwargs = optim.torch_equivalent(example)
    assert cls is entry.torch[0].resolve()
    assert optim.from_torch(cls, kwargs, "t") == example
    cls([torch.nn.Parameter(torch.zeros(3, 2))], **kwargs)  # the class takes them


def test_unknown_torch_class_and_field_without_equivalent():
    with pytest.raises(ValueError, match="RMSprop has no fused equivalent; use torch.optim.SGD"):
        optim.from_torch(torch.optim.RMSprop, {}, "t")
    with pytest.raises(ValueError, match="weight_decay=0.1 is not one of its"):
        optim.torch_equivalent(optim.Adam(weight_decay=0.1))


@pytest.mark.parametrize("name", NAMES)
def test_config_maps_to_its_kernel_code(name):
    from fbtriton_dist.kernels import tbe_optim

    entry = optim.REGISTRY[name]
    assert tbe_optim.optimizer_code(entry.config()) == entry.kernel_code
    if name in tbe_optim.OPTIMIZERS:  # else Triton's capabilities refuse it (test_backends)
        assert getattr(tbe_optim, f"_{name.upper()}").value == entry.kernel_code
    assert tbe_optim.optimizer_code(None) == tbe_optim.OPT_NONE == 0


def test_planner_and_job_choices_are_the_registry_names(tmp_path):
    from fbtriton_dist.cli import build_parser
    from fbtriton_dist.planner import OPTIMIZERS, FieldError, ShardingPlanner, TableSpec
    from fbtriton_dist.train.config import EmbeddingOptimizerConfig
    from fbtriton_dist.train.job import _embedding_optimizer

    assert OPTIMIZERS == ("none", *NAMES)
    listed = f"[{', '.join(NAMES)}]"
    with pytest.raises(FieldError, match=rf"expected one of \[none, {listed[1:-1]}\]"):
        TableSpec(name="t", num_embeddings=4, embedding_dim=2, features=("f",), optimizer="x")
    with pytest.raises(FieldError, match=rf"type: expected one of \[{listed[1:-1]}\]"):
        EmbeddingOptimizerConfig(type="x")
    for name in NAMES:
        args = build_parser().parse_args(["plan", "t.yaml", "--world-size", "1",
                                          "--optimizer", name])
        assert args.optimizer == name
        ShardingPlanner(world_size=1, hbm_bytes_per_rank=2**30, optimizer=name)
        fused = _embedding_optimizer(EmbeddingOptimizerConfig(type=name, lr=0.2))
        assert optim.spec_of(fused).name == name and fused.lr == 0.2


@pytest.mark.parametrize("name", NAMES)
def test_state_bytes_are_the_module_states(name):
    from fbtriton_dist.planner import state_bytes

    entry = optim.REGISTRY[name]
    tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=entry.config(), backend="reference")
    held = sum(getattr(tbe, b).numel() * getattr(tbe, b).element_size()
               for b in optim.STATE_BUFFERS)
    assert held == sum(state_bytes(name, E, D) for E, D in TABLES)
    assert state_bytes(name, 10, 8) == entry.state_bytes(10, 8)
    for (E, D), views in zip(TABLES, tbe.split_optimizer_states(), strict=True):
        assert [tuple(v.shape) for v in views] == [
            (E,) if s.per_row else (E, D) for s in entry.states
        ]


def _step(optimizer, backend, device, weights, batch, step=0):
    tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=optimizer, backend=backend,
                                stochastic_rounding=False, device=device)
    with torch.no_grad():
        tbe.weights.copy_(weights)
    out = tbe(*(t if t is None else t.to(device) for t in batch))
    out.backward(upstream_grad(out, step))
    return tbe


@pytest.mark.parametrize("name", NAMES)
def test_reference_update_descends_and_is_lazy(name):
    """One fused step moves the rows against their gradient, and only the rows of the batch."""
    from fbtriton_dist.reference import tbe as ref

    assert set(ref.UPDATES) == set(NAMES)
    batch = make_batch(TABLES, FTM, B, MAX_L, weighted=True)
    w0 = TableBatchedEmbedding(TABLES, FTM).weights.detach().clone()
    plain = _step(None, "reference", "cpu", w0, batch)
    grad = plain.weights.grad.to_dense()
    fused = _step(optim.REGISTRY[name].config(lr=0.1), "reference", "cpu", w0, batch)
    delta = fused.weights.detach() - w0
    assert float((delta * grad).sum()) < 0
    assert torch.equal(delta[grad == 0], torch.zeros_like(delta[grad == 0]))


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", NAMES)
def test_kernels_match_the_reference(name):
    """Two steps of every entry Triton implements, non-default hyper-parameters: weights and
    states (one it lacks is refused by its capabilities: test_backends)."""
    if name not in backends.capabilities("triton").optimizers:
        pytest.skip(f"the Triton backend does not implement {name}")
    opt = _example(optim.REGISTRY[name])
    g = torch.Generator().manual_seed(5)
    batches = [make_batch(TABLES, FTM, B, MAX_L, hot=True, generator=g) for _ in range(2)]
    w0 = TableBatchedEmbedding(TABLES, FTM).weights.detach().clone()
    mods = [
        TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend, device=dev,
                              stochastic_rounding=False)
        for backend, dev in (("reference", "cpu"), ("triton", DEVICE))
    ]
    for m in mods:
        with torch.no_grad():
            m.weights.copy_(w0)
        for step, batch in enumerate(batches):
            out = m(*(t if t is None else t.to(m.weights.device) for t in batch))
            out.backward(upstream_grad(out, step))
    ref, tri = mods
    torch.testing.assert_close(tri.weights.detach().cpu(), ref.weights.detach(), atol=1e-5,
                               rtol=1e-5)
    for b in optim.STATE_BUFFERS:
        torch.testing.assert_close(getattr(tri, b).cpu(), getattr(ref, b), atol=1e-5, rtol=1e-4)
    assert tri.step == ref.step == 2


@pytest.mark.parametrize("name", NAMES)
def test_fast_cpu_path_matches_the_reference(name):
    """Every entry the CPU backend implements has a step on the fast CPU path that equals its
    reference update (two steps, non-default hyper-parameters: weights and states); one it
    lacks is refused by its capabilities (test_backends)."""
    from fbtriton_dist.ops import cpu

    assert set(cpu._STEPS) == set(cpu._NEEDS_ROWS) <= set(NAMES)
    if name not in backends.capabilities("cpu").optimizers:
        pytest.skip(f"the CPU backend does not implement {name}")
    opt = _example(optim.REGISTRY[name])
    g = torch.Generator().manual_seed(5)
    batches = [make_batch(TABLES, FTM, B, MAX_L, hot=True, weighted=True, generator=g)
               for _ in range(2)]
    w0 = TableBatchedEmbedding(TABLES, FTM).weights.detach().clone()
    mods = [TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend,
                                  stochastic_rounding=False) for backend in ("reference", "cpu")]
    for m in mods:
        with torch.no_grad():
            m.weights.copy_(w0)
        for step, batch in enumerate(batches):
            out = m(*batch)
            out.backward(upstream_grad(out, step))
    ref, fast = mods
    torch.testing.assert_close(fast.weights.detach(), ref.weights.detach(), atol=1e-5, rtol=1e-5)
    for b in optim.STATE_BUFFERS:
        torch.testing.assert_close(getattr(fast, b), getattr(ref, b), atol=1e-5, rtol=1e-4)
    assert fast.step == ref.step == 2
