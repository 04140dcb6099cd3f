"""The backward's sort made ahead (``ops.tbe_ahead.plan_ahead``): on CUDA, on a side stream right
after the forward; on the CPU here, in order (``plan_ahead=True``). Either way the results must be
bit-identical to the backward that sorts by itself: outputs, gradients, updated rows, optimizer
state and the step counter, over several steps."""

import warnings

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import tbe_ahead
from tests.conftest import DEVICE, HAS_CUDA, TRITON_OK, requires_cuda

pytestmark = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")

TABLES, FTM, B = [(9, 8), (1, 4), (5, 16)], [0, 2, 1, 0], 6
OPTIMIZERS = {
    "plain": lambda: None,
    "sgd": lambda: optim.SGD(lr=0.1),
    "rowwise": lambda: optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: optim.Adam(lr=0.1),
}


def _batches(steps: int, id_dtype, pad: int, bad: bool = False):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 6, (len(FTM) * B,), generator=g)
        lengths[::4] = 0  # empty bags
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        n = int(offsets[-1])
        f = torch.repeat_interleave(torch.arange(len(FTM)).repeat_interleave(B), lengths)
        rows = torch.tensor([TABLES[t][0] for t in FTM])[f]
        ids = (torch.rand(n, generator=g) * rows).long()
        ids[::3] = 0  # a hot id in every table
        if bad:  # out of range: dropped and counted by bounds_check="warn"
            ids[1::5] = 10**4
        ids = torch.cat([ids, torch.full((pad,), 10**6)])  # padding after the last bag
        psw = torch.rand(ids.numel(), generator=g)
        out.append((ids.to(id_dtype), offsets, psw, torch.randn(B, 36, generator=g)))
    return out


def _train(optimizer: str, pooling: str, weighted: bool, batches, bounds: str = "ignore",
           ahead: bool = False):
    tbe = TableBatchedEmbedding(TABLES, FTM, pooling=pooling, optimizer=OPTIMIZERS[optimizer](),
                                backend="triton", device=DEVICE, seed=2, bounds_check=bounds,
                                plan_ahead=ahead)
    with torch.no_grad():
        tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
    outs = []
    for ids, offsets, psw, grad in batches:
        w = psw.to(DEVICE) if weighted else None
        out = tbe(ids.to(DEVICE), offsets.to(DEVICE), w)
        out.backward(grad.to(DEVICE))
        outs.append(out.detach().cpu())
        if optimizer == "plain":
            outs.append(tbe.weights.grad.cpu().clone())
            tbe.weights.grad = None
    state = [tbe.weights.detach().cpu(), tbe.momentum1.cpu(), tbe.momentum2.cpu()]
    return outs, state, tbe.step


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize(("pooling", "weighted"), [("sum", False), ("sum", True), ("mean", False)])
def test_plan_made_ahead_equals_the_backward_sorting_itself(optimizer, pooling, weighted,
                                                            monkeypatch):
    batches = _batches(3, torch.int32 if weighted else torch.int64, pad=5)
    results, real = [], tbe_ahead.plan_ahead
    for on in (False, True):
        seen = []
        monkeypatch.setattr(tbe_ahead, "plan_ahead", lambda *a, seen=seen, **k: seen.append(1) or real(*a, **k))
        results.append(_train(optimizer, pooling, weighted, batches, ahead=on))
        assert len(seen) == (3 if on else 0)
    (outs0, state0, step0), (outs1, state1, step1) = results
    assert step0 == step1 == (3 if optimizer != "plain" else 0)
    for a, b in zip(outs0 + state0, outs1 + state1, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_plan_made_ahead_drops_the_ids_the_forward_drops(pooling):
    """bounds_check="warn": out-of-range ids are dropped by the forward and by the side
    stream's linearize alike (no gradient, not counted in a mean)."""
    batches = _batches(2, torch.int64, pad=0, bad=True)
    results = []
    for on in (False, True):
        with pytest.warns(UserWarning):
            results.append(_train("rowwise", pooling, False, batches, bounds="warn", ahead=on))
    (outs0, state0, _), (outs1, state1, _) = results
    for a, b in zip(outs0 + state0, outs1 + state1, strict=True):
        assert torch.equal(a, b)


def test_a_forward_without_backward_leaves_the_next_step_right():
    """A training forward whose backward never comes (its plan is dropped) neither counts a
    step nor disturbs the next one."""
    batches = _batches(2, torch.int64, pad=0)
    results = []
    for skip in (False, True):
        tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=optim.RowWiseAdagrad(lr=0.1),
                                    backend="triton", device=DEVICE, seed=2, plan_ahead=True)
        with torch.no_grad():
            tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
        if skip:
            ids, offsets, _, _ = batches[1]
            tbe(ids.to(DEVICE), offsets.to(DEVICE)).sum()  # graph dropped, no backward
        for ids, offsets, _, grad in batches:
            tbe(ids.to(DEVICE), offsets.to(DEVICE)).backward(grad.to(DEVICE))
        results.append((tbe.weights.detach().cpu(), tbe.momentum1.cpu(), tbe.step))
    assert results[0][2] == results[1][2] == 2
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("bounds", ["ignore", "warn"])
def test_a_retained_graph_backs_up_twice_with_the_same_plan(bounds):
    """``backward(retain_graph=True)`` then ``backward()`` (plain gradients): the second pass
    reuses the plan kept with the graph and equals the first, with dropped ids ("warn") or
    padding after the last bag ("ignore")."""
    ids = torch.tensor([1, 10, 2, 3, 4] + ([] if bounds == "warn" else [7, 7]))
    offsets = torch.tensor([0, 2, 3, 4, 5])  # T=2 (tables of 9 and 5 rows), B=2
    grads = []
    for on in (False, True):
        tbe = TableBatchedEmbedding([(9, 8), (5, 8)], backend="triton", device=DEVICE,
                                    bounds_check=bounds, plan_ahead=on)
        out = tbe(ids.to(DEVICE), offsets.to(DEVICE))
        g = torch.ones(2, 16, device=DEVICE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.backward(g, retain_graph=True)
            first = tbe.weights.grad.cpu().clone()
            assert out.grad_fn.plan is None  # freed by the backward, not kept with the graph
            out.backward(g)
        grads.append((first, tbe.weights.grad.cpu() - first))
    for a, b in grads:
        assert torch.equal(a, b)  # the second pass added what the first did
    assert torch.equal(grads[0][0], grads[1][0])


@requires_cuda
def test_the_side_stream_is_joined_before_the_backward_reads_the_plan():
    """On CUDA, with a long queue on the main stream before the lookup (so a missing join would
    read an unfinished sort), the result equals the plan-free backward."""
    assert HAS_CUDA
    batches = _batches(2, torch.int64, pad=3)
    results = []
    for on in (False, True):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of queued work
        results.append(_train("rowwise", "sum", False, batches, ahead=on))
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert torch.equal(a, b)


def test_plan_tensors_are_the_plan_s_own_not_copies():
    """``BackwardPlan.tensors()`` (what the backward marks as used on its stream) hands out
    the plan's tensors themselves: a copy would be a device copy per backward, captured into
    every replay of a graph (it was: six copies of the 5N workspace per step)."""
    import importlib

    bwd = importlib.import_module("fbtriton_dist.kernels.tbe_backward")
    ids = torch.tensor([3, 1, 1, 0, 2], device=DEVICE)
    offsets = torch.tensor([0, 2, 3, 5], device=DEVICE)
    plan = bwd.tbe_backward_plan(
        ids, offsets, None, torch.tensor([0, 4], device=DEVICE),
        torch.tensor([0], device=DEVICE), w_offsets=torch.tensor([0], device=DEVICE),
        dims=torch.tensor([4], device=DEVICE), pooling=0, grad_stride=4, num_rows=5)
    got = plan.tensors()
    assert len(got) == 10  # scales is None (sum pooling, no weights)
    fields = [plan.keys, plan.perm, plan.changes, plan.goffs, plan.run_starts, plan.run_keys,
              plan.run_elems, plan.run_dims, plan.run_goffs, plan.num_runs]
    assert all(any(t is f for t in got) for f in fields)
    assert int(plan.num_runs) == 4
