"""graphs.GraphedStep: without CUDA it is the function itself; on a GPU, a TBE training step
captured once and replayed k times equals k eager steps (weights, optimizer state, step)."""

import pytest
import torch
import torch.nn.functional as F

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.graphs import GraphedStep, _signature
from tests.conftest import requires_cuda

TABLES, FTM = [(50, 8), (20, 16), (7, 4)], [0, 1, 0, 2]
OPTIMIZERS = {
    "sgd": optim.SGD(lr=0.1),
    "rowwise_adagrad": optim.RowWiseAdagrad(lr=0.1, weight_decay=0.01),
    "adam": optim.Adam(lr=0.05, weight_decay=0.01),
}


def _module(device, opt="sgd", dtype=torch.float32, bounds_check="warn"):
    torch.manual_seed(7)
    return TableBatchedEmbedding(
        TABLES,
        FTM,
        optimizer=OPTIMIZERS[opt],
        weights_dtype=dtype,
        bounds_check=bounds_check,
        device=device,
        seed=11,
    )


def _batches(k, device, B=4, L=3, seed=0):
    """k batches of one signature: fixed bag length L, so N = T * B * L every time."""
    g = torch.Generator().manual_seed(seed)
    T = len(FTM)
    out = []
    for _ in range(k):
        ids = [torch.randint(0, TABLES[t][0], (B * L,), generator=g) for t in FTM]
        ids[0][: B * L // 2] = 0  # a hot row
        offsets = torch.arange(T * B + 1) * L
        grad = torch.randn(B, sum(TABLES[t][1] for t in FTM), generator=g)
        out.append(tuple(x.to(device) for x in (torch.cat(ids), offsets, grad)))
    return out


def _step(module):
    def step(indices, offsets, grad):
        out = module(indices, offsets)
        out.backward(grad)
        return out.detach()

    return step


def _state(module):
    return [module.weights.detach(), module.momentum1, module.momentum2, module._step]


# ------------------------------------------------------------------------ anywhere


def test_validation_and_signature():
    with pytest.raises(ValueError, match="warmup"):
        GraphedStep(lambda: None, warmup=0)
    with pytest.raises(ValueError, match="max_graphs"):
        GraphedStep(lambda: None, max_graphs=0)
    a, b = torch.zeros(3), torch.ones(3)
    assert _signature((a, 2)) == _signature((b, 2))
    assert _signature((a, 2)) != _signature((a, 3))
    assert _signature((a,)) != _signature((torch.zeros(4),))
    assert _signature((a,)) != _signature((a.double(),))


@pytest.mark.parametrize("enabled", [None, False])
def test_eager_fallback_is_the_function(enabled):
    """On CPU tensors (or enabled=False) every call is fn(*args): a TBE + dense model trained
    through GraphedStep equals the same model trained by calling the step directly."""
    results = []
    for wrap in (False, True):
        tbe = _module("cpu", "adam")
        torch.manual_seed(3)
        dense = torch.nn.Linear(sum(TABLES[t][1] for t in FTM), 1)
        opt = torch.optim.SGD(dense.parameters(), lr=0.1)

        def step(indices, offsets, labels, tbe=tbe, dense=dense, opt=opt):
            opt.zero_grad(set_to_none=True)
            logits = dense(tbe(indices, offsets)).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            loss.backward()
            opt.step()
            return loss.detach()

        fn = GraphedStep(step, warmup=1, enabled=enabled) if wrap else step
        losses = []
        for indices, offsets, grad in _batches(5, "cpu"):
            losses.append(fn(indices, offsets, (grad[:, 0] > 0).float()))
        if wrap:
            assert (fn.eager_calls, fn.captures, fn.replays, fn.num_graphs) == (5, 0, 0, 0)
        results.append([*losses, *_state(tbe), *[p.detach() for p in dense.parameters()]])
    for x, y in zip(*results, strict=True):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------ GPU only


@requires_cuda
@pytest.mark.parametrize(
    "opt, dtype",
    [
        ("sgd", torch.float32),
        ("rowwise_adagrad", torch.float32),
        ("adam", torch.float32),
        ("sgd", torch.float16),
        ("rowwise_adagrad", torch.float16),
        ("adam", torch.float16),
    ],
    ids=lambda v: str(v).removeprefix("torch."),
)
def test_captured_step_replayed_equals_eager_steps(opt, dtype):
    """k calls: 2 eager warm-ups, 1 capture (+ its replay), k - 3 replays. Each replay must
    advance the device step counter (Adam's t, the fp16 rounding seed) and read the new batch:
    bit-identical to k eager steps, outputs included."""
    k = 8
    eager, graphed = _module("cuda", opt, dtype), _module("cuda", opt, dtype)
    graphed.load_state_dict(eager.state_dict())
    step = GraphedStep(_step(graphed), warmup=2)
    for batch in _batches(k, "cuda"):
        assert torch.equal(step(*batch), _step(eager)(*batch))
    torch.cuda.synchronize()
    assert (step.eager_calls, step.captures, step.replays) == (2, 1, k - 2)
    assert eager.step == graphed.step == k
    for x, y in zip(_state(eager), _state(graphed), strict=True):
        assert torch.equal(x, y)
    eager.poll_bounds_check()
    graphed.poll_bounds_check()  # no ids dropped: no warning


@requires_cuda
def test_new_signatures_are_captured_and_the_oldest_evicted():
    eager, graphed = _module("cuda", "adam"), _module("cuda", "adam")
    graphed.load_state_dict(eager.state_dict())
    step = GraphedStep(_step(graphed), warmup=1, max_graphs=1)
    small, large = _batches(4, "cuda", B=4), _batches(4, "cuda", B=6, seed=1)
    order = [small[0], small[1], small[2], large[0], large[1], large[2], small[3], large[3]]
    for batch in order:
        assert torch.equal(step(*batch), _step(eager)(*batch))
    # small: eager, capture (+ replay), replay; large: eager, capture (evicts small's graph),
    # replay; small: eager (its warm-up starts over); large: replay
    assert (step.eager_calls, step.captures, step.replays, step.num_graphs) == (3, 2, 5, 1)
    for x, y in zip(_state(eager), _state(graphed), strict=True):
        assert torch.equal(x, y)


@requires_cuda
def test_whole_model_step_with_a_capturable_torch_optimizer():
    """TBE (fused rowwise Adagrad) + a dense layer with torch's Adam(capturable=True), the
    shape of a real training step: replayed equals eager (dense math may reorder: close)."""
    results = []
    for wrap in (False, True):
        tbe = _module("cuda", "rowwise_adagrad")
        torch.manual_seed(3)
        dense = torch.nn.Linear(sum(TABLES[t][1] for t in FTM), 1, device="cuda")
        opt = torch.optim.Adam(dense.parameters(), lr=1e-2, capturable=True)

        def step(indices, offsets, labels, tbe=tbe, dense=dense, opt=opt):
            opt.zero_grad(set_to_none=True)
            logits = dense(tbe(indices, offsets)).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            loss.backward()
            opt.step()
            return loss.detach()

        fn = GraphedStep(step, warmup=3) if wrap else step
        losses = [
            fn(i, o, (g[:, 0] > 0).float()).clone() for i, o, g in _batches(9, "cuda", seed=5)
        ]
        if wrap:
            assert fn.captures == 1 and fn.replays == 6
        results.append([*losses, *_state(tbe), *[p.detach() for p in dense.parameters()]])
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@requires_cuda
def test_set_learning_rate_reaches_the_captured_step():
    tbe = _module("cuda", "sgd")
    step = GraphedStep(_step(tbe), warmup=1)
    batches = _batches(4, "cuda")
    step(*batches[0])
    step(*batches[1])  # captured
    tbe.set_learning_rate(0.0)
    before = tbe.weights.detach().clone()
    step(*batches[2])  # replay with lr 0: nothing moves
    assert step.replays == 2 and torch.equal(tbe.weights.detach(), before)
    tbe.set_learning_rate(0.1)
    step(*batches[3])
    assert not torch.equal(tbe.weights.detach(), before)
    assert tbe.step == 4


@requires_cuda
def test_capture_refuses_bounds_check_error_by_name():
    step = GraphedStep(_step(_module("cuda", "sgd", bounds_check="error")), warmup=1)
    batches = _batches(2, "cuda")
    step(*batches[0])  # eager: fine
    with pytest.raises(RuntimeError, match="bounds_check='error'"):
        step(*batches[1])


@requires_cuda
def test_warn_counts_ids_dropped_in_replays():
    tbe = _module("cuda", "sgd", bounds_check="warn")
    step = GraphedStep(_step(tbe), warmup=1)
    batches = _batches(4, "cuda")
    step(*batches[0])
    step(*batches[1])  # captured
    bad = batches[2][0].clone()
    bad[0] = 10_000  # feature 0's table has 50 rows
    step(bad, *batches[2][1:])
    step(bad, *batches[3][1:])
    with pytest.warns(UserWarning, match="dropped 2 out-of-range ids in CUDA graph replays"):
        tbe.poll_bounds_check()


@requires_cuda
@pytest.mark.parametrize("how", ["graphed_step", "bare_graph"])
def test_a_captured_training_forward_without_its_backward(how):
    """A lookup that counts as training (a fused optimizer, grad enabled) forks its backward
    plan onto a side stream; captured without its backward, the capture must still end
    joined: inside ``GraphedStep`` (its scope joins at exit) and in a bare
    ``torch.cuda.graph`` (the forward joins at once). Replays equal eager forwards."""
    dev = torch.device("cuda")
    m = _module(dev)
    batches = [b[:2] for b in _batches(4, dev)]

    def forward(ids, offsets):
        return m(ids, offsets) * 1.0

    want = [forward(*b).detach().clone() for b in batches]
    if how == "graphed_step":
        step = GraphedStep(forward)
        got = [step(*b).detach().clone() for b in batches]
        assert step.captures == 1
    else:
        static = [t.clone() for t in batches[0]]
        forward(*static)  # warm-up (compiles, allocates the bounds counter)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(*static)
        got = []
        for b in batches:
            for s, t in zip(static, b, strict=True):
                s.copy_(t)
            graph.replay()
            got.append(out.detach().clone())
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
