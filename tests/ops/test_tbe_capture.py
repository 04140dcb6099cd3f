"""What the TBE op does under CUDA graph capture, checked without a GPU by making the op believe
a capture is underway: the options that need host reads are refused by name; bounds_check=
"warn" counts dropped ids in the monitor's device counter over "replays" and poll() reports
them. (The real capture is tests/test_graphs.py, on a GPU.)"""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import tbe as ops_tbe
from tests.conftest import DEVICE, TRITON_OK

pytestmark = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")

TABLES = [(10, 4), (6, 8)]


@pytest.fixture
def fake_capture(monkeypatch):
    """Turn the op's capture test on for every device (the kernels still run: interpreted)."""
    state = {"on": False}
    monkeypatch.setattr(ops_tbe, "capturing", lambda device: state["on"])
    return state


def _batch(bad: bool = False):
    indices = torch.tensor([1, 9 if not bad else 10, 3, 5, 0], device=DEVICE)
    offsets = torch.tensor([0, 2, 3, 4, 5], device=DEVICE)  # T=2, B=2
    return indices, offsets


def _module(**kw):
    kw.setdefault("optimizer", optim.SGD(lr=0.1))
    return TableBatchedEmbedding(TABLES, backend="triton", device=DEVICE, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(bounds_check="error"), "bounds_check='error'"),
        (dict(backend="reference", bounds_check="ignore"), "backend='reference'"),
    ],
    ids=["error", "reference"],
)
def test_capture_refuses_host_reads_by_name(fake_capture, kw, match):
    backend = kw.pop("backend", "triton")
    device = DEVICE if backend == "triton" else "cpu"
    tbe = TableBatchedEmbedding(
        TABLES, optimizer=optim.SGD(lr=0.1), backend=backend, device=device, **kw
    )
    fake_capture["on"] = True
    with pytest.raises(RuntimeError, match=match):
        tbe(*[t.to(device) for t in _batch()])


def test_capture_refuses_plain_gradients_in_backward(fake_capture):
    tbe = _module(optimizer=None, bounds_check="ignore")
    fake_capture["on"] = True
    out = tbe(*_batch())  # the forward alone is capturable
    with pytest.raises(RuntimeError, match="without a fused optimizer"):
        out.sum().backward()


def test_capture_refuses_per_sample_weight_gradient(fake_capture):
    tbe = _module(bounds_check="ignore")
    fake_capture["on"] = True
    psw = torch.ones(5, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="per_sample_weights"):
        tbe(*_batch(), psw).sum().backward()


def test_warn_needs_an_eager_lookup_before_capture(fake_capture):
    tbe = _module(bounds_check="warn")
    fake_capture["on"] = True
    with pytest.raises(RuntimeError, match="run one eager lookup"):
        tbe(*_batch())


def test_warn_counts_dropped_ids_over_replays_and_poll_reports_them(fake_capture):
    tbe = _module(bounds_check="warn")
    device = tbe.weights.device
    tbe._bounds_monitor.replay_counts(device)  # an eager CUDA lookup allocates it
    fake_capture["on"] = True
    for _ in range(3):  # three "replays" of a batch with one bad id: dropped, counted, silent
        tbe(*_batch(bad=True)).sum().backward()
    assert tbe.step == 3
    assert tbe._bounds_monitor.replay_counts(device)[0].item() == 3
    fake_capture["on"] = False
    with pytest.warns(UserWarning, match="dropped 3 out-of-range ids in CUDA graph replays"):
        tbe.poll_bounds_check()
    tbe.poll_bounds_check()  # reported once: nothing new since


def test_hyper_parameters_cannot_change_inside_a_capture(fake_capture, monkeypatch):
    from fbtriton_dist.modules import tbe as module_tbe

    tbe = _module(bounds_check="ignore")
    tbe(*_batch()).sum().backward()
    tbe.optimizer = optim.SGD(lr=0.5)  # changed, and not yet copied to the device
    monkeypatch.setattr(module_tbe, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="fused optimizer changed"):
        tbe(*_batch())
