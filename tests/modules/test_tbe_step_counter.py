"""The fused optimizer's per-step values live in device memory (what makes a CUDA graph of the
step replay correctly): the step counter advanced by the backward, Adam's bias corrections
and the stochastic-rounding seed derived from it, the hyper-parameters rewritten in place."""

import copy

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim, reference
from tests.conftest import DEVICE, TRITON_OK
from tests.helpers import make_batch, upstream_grad

TABLES, FTM = [(10, 3), (7, 8), (1, 5)], [0, 1, 0, 2]
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason=""))]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}


def _device(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


def _module(backend, opt, dtype=torch.float32, sr=True, seed=5):
    torch.manual_seed(7)
    return TableBatchedEmbedding(
        TABLES,
        FTM,
        optimizer=opt,
        weights_dtype=dtype,
        backend=backend,
        device=_device(backend),
        stochastic_rounding=sr,
        seed=seed,
    )


def _batches(n, B=4, max_L=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [make_batch(TABLES, FTM, B, max_L, hot=True, generator=g) for _ in range(n)]


def _train(module, batches, first_step=0):
    dev = module.weights.device
    for i, (indices, offsets, _) in enumerate(batches):
        out = module(indices.to(dev), offsets.to(dev))
        out.backward(upstream_grad(out, first_step + i).to(dev))


def _state(module):
    return [t.detach().float().cpu().clone() for t in (module.weights, module.momentum1)] + [
        module.momentum2.cpu().clone()
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_counter_lives_on_the_device_and_round_trips(backend):
    tbe = _module(backend, optim.Adam(lr=0.05))
    counter = tbe._step
    assert counter.dtype == torch.int64 and counter.shape == (1,)
    assert counter.device == tbe.weights.device and tbe.step == 0
    _train(tbe, _batches(3))
    assert tbe.step == 3 and int(counter[0]) == 3  # advanced in place, on the device
    with torch.no_grad():  # inference does not step
        tbe(*[t.to(tbe.weights.device) for t in _batches(1)[0][:2]])
    assert tbe.step == 3
    sd = tbe.state_dict()
    assert sd["_extra_state"] == {"step": 3} and "_step" not in sd
    other = _module(backend, optim.Adam(lr=0.05))
    ptr = other._step.data_ptr()
    other.load_state_dict(copy.deepcopy(sd))
    assert other.step == 3 and other._step.data_ptr() == ptr  # written in place
    other.step = 11
    assert int(other._step[0]) == 11
    other.reset_parameters()
    assert other.step == 0 and other._step.data_ptr() == ptr


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "opt_name, dtype",
    [
        ("adam", torch.float32),
        ("adam", torch.float16),
        ("sgd", torch.float16),
        ("rowwise_adagrad", torch.bfloat16),
    ],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_reference_and_triton_agree_step_by_step_with_stochastic_rounding(opt_name, dtype):
    """Five fused steps, stochastic rounding on for half weights: the two backends draw
    different noise (each within one ulp of the exact update), so they agree to the dtype's
    tolerance, with the same step count and optimizer state."""
    opt = {
        "adam": optim.Adam(lr=0.05, weight_decay=0.01),
        "sgd": optim.SGD(lr=0.1),
        "rowwise_adagrad": optim.RowWiseAdagrad(lr=0.1, weight_decay=0.01),
    }[opt_name]
    ref, tri = _module("reference", opt, dtype), _module("triton", opt, dtype)
    tri.load_state_dict(ref.state_dict())
    batches = _batches(5)
    _train(ref, batches)
    _train(tri, batches)
    assert ref.step == tri.step == 5
    atol, rtol = TOL[dtype]
    a, b = _state(ref), _state(tri)
    torch.testing.assert_close(b[0], a[0], atol=atol, rtol=rtol)
    for x, y in zip(a[1:], b[1:], strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16-sr", "fp32"])
def test_a_restored_step_replays_the_same_updates(backend, dtype):
    """Adam's t and the rounding seed are functions of (seed, step) alone: a module restored
    after 2 of 4 steps reproduces the last 2 bit for bit; restored with the wrong step, not."""
    opt = optim.Adam(lr=0.05)
    batches = _batches(4)
    a = _module(backend, opt, dtype)
    _train(a, batches[:2])
    snapshot = copy.deepcopy(a.state_dict())
    _train(a, batches[2:], first_step=2)
    for step, same in ((2, True), (0, False)):
        b = _module(backend, opt, dtype)
        b.load_state_dict(snapshot)
        b.step = step
        _train(b, batches[2:], first_step=2)
        equal = all(torch.equal(x, y) for x, y in zip(_state(a), _state(b), strict=True))
        assert equal == same, step
        assert b.step == step + 2


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("start", [0, 9, 999, 10**6])
def test_adam_bias_correction_on_the_device(start):
    """1 - beta^t computed in the kernel from the device step (series near t log(beta) = 0,
    1 - exp beyond) matches the reference's float64 value at small and large t."""
    opt = optim.Adam(lr=0.05, betas=(0.9, 0.999))
    ref, tri = _module("reference", opt), _module("triton", opt)
    tri.load_state_dict(ref.state_dict())
    ref.step = tri.step = start
    with torch.no_grad():  # moments as if trained: bias corrections matter
        for m in (ref, tri):
            m.momentum1.copy_(torch.linspace(-0.1, 0.1, m.momentum1.numel()))
            m.momentum2.copy_(torch.linspace(1e-4, 1e-2, m.momentum2.numel()))
    batches = _batches(1)
    _train(ref, batches)
    _train(tri, batches)
    a, b = _state(ref), _state(tri)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    assert ref.step == tri.step == start + 1


def test_step_seed_and_hyper_parameters():
    assert reference.step_seed(5, 1) == (5 * 1000003 + 1) % (2**31 - 1)
    assert reference.step_seed(5, 1) != reference.step_seed(5, 2)
    values = optim.hyper_parameters(optim.Adam(betas=(0.5, 0.0)))
    hp = dict(zip(optim.HYPER_FIELDS, values, strict=True))
    assert hp["log_beta1"] == pytest.approx(-0.6931471805599453) and hp["log_beta2"] < -1e300
    assert optim.hyper_parameters(None) == [0.0] * len(optim.HYPER_FIELDS)


def test_set_learning_rate_rewrites_the_device_copy_in_place():
    tbe = TableBatchedEmbedding([(5, 4)], optimizer=optim.SGD(lr=1.0))
    indices, offsets = torch.tensor([1, 1]), torch.tensor([0, 2])
    tbe(indices, offsets).sum().backward()
    hyper = tbe._hyper
    assert hyper is not None and float(hyper[0]) == 1.0
    ptr = hyper.data_ptr()
    tbe.set_learning_rate(0.25)
    assert tbe._hyper.data_ptr() == ptr and float(tbe._hyper[0]) == 0.25
    tbe.optimizer = optim.SGD(lr=0.5)  # assigned directly: picked up at the next lookup
    tbe(indices, offsets).sum().backward()
    assert tbe._hyper.data_ptr() == ptr and float(tbe._hyper[0]) == 0.5
