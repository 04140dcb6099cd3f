"""The CPU backend checks ids inside its forward (``bounds_check_in_kernel``): no separate host
check runs before the lookup, and a bad batch is reported as the host check reported it."""

import dataclasses
import warnings

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding
from fbtriton_dist.ops import backends
from fbtriton_dist.ops import tbe as tbe_op


def _reports(tbe, indices, offsets, psw):
    """What a lookup of this batch tells the user, with each bounds_check: the error's type and
    text; the warnings, the output and the gradients of the weights and per-sample weights."""
    tbe.bounds_check = "error"
    with pytest.raises(IndexError) as raised:
        tbe(indices, offsets)
    tbe.bounds_check = "warn"
    tbe.weights.grad = None
    weights = psw.detach().clone().requires_grad_(True)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        out = tbe(indices, offsets, weights)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    return ((type(raised.value), str(raised.value)), [str(w.message) for w in warned], out,
            tbe.weights.grad, weights.grad)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_ops"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_cpu_forward_checks_ids_itself_and_reports_as_the_host_check(monkeypatch, index_dtype,
                                                                      native):
    """Native: the C forward counts; torch_ops (FBTD_CPU_NATIVE=0): its fallback does."""
    monkeypatch.setenv("FBTD_CPU_NATIVE", "1" if native else "0")
    cpu = backends.get("cpu")
    assert cpu.capabilities.bounds_check_in_kernel
    host_checked = dataclasses.replace(cpu.capabilities, bounds_check_in_kernel=False)
    tbe = TableBatchedEmbedding([(10, 4), (3, 2)], [0, 1], table_names=["ads", "geo"],
                                feature_names=["u", "v"], pooling="mean", backend="cpu")
    offsets = torch.tensor([0, 2, 2, 2, 4], dtype=index_dtype)  # B=2; indices[2:4]: v, sample 1
    psw = torch.tensor([1.0, 2.0, 3.0, 4.0])
    before = {}
    with monkeypatch.context() as patch:  # the host check, as before
        patch.setattr(cpu, "capabilities", host_checked)
        for bad in (3, -1):  # the last feature's row count, and -1, as the last id
            indices = torch.tensor([1, 2, 0, bad], dtype=index_dtype)
            before[bad] = _reports(tbe, indices, offsets, psw)
            error, warned = before[bad][:2]
            what = (f"id {bad} at indices[3] (feature 'v', sample 1) is out of range for table "
                    "'geo' with 3 rows: expected 0 <= id < 3")
            assert error == (IndexError, what)
            assert warned == [f"dropping 1 out-of-range ids; first: {what}"]

    def host_check(*args, **kwargs):
        raise AssertionError("the separate host check ran")

    monkeypatch.setattr(tbe_op, "check_inputs", host_check)
    good = tbe(torch.tensor([1, 2, 0, 2], dtype=index_dtype), offsets)  # no host check
    assert good.shape == (2, 6)
    for bad in (3, -1):
        now = _reports(tbe, torch.tensor([1, 2, 0, bad], dtype=index_dtype), offsets, psw)
        assert now[:2] == before[bad][:2]
        for got, want in zip(now[2:], before[bad][2:], strict=True):
            assert torch.equal(got, want)
        assert now[4][3] == 0  # the dropped id's weight gets no gradient
