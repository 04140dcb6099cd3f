"""Cached storage tiers in a ``GraphedStep``: the slot map runs eagerly before each replay
(``graphs.before_each_replay``), the lookup and fused update on the slots are replayed; the
result equals the same steps of an all-in-device-memory module, bit for bit."""

import pytest
import torch

from fbtriton_dist import graphs, optim
from fbtriton_dist.graphs import GraphedStep
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.storage import Storage
from tests.conftest import requires_cuda
from tests.test_graphs import _step

TABLES, FTM = [(300, 8), (1, 16), (120, 4)], [0, 1, 0, 2]  # a one-row table too
B, L = 6, 3


def _build(opt, cached, policy="lru", slots=40, device="cuda"):
    storage = [Storage(tier="cached", cache_slots=min(slots, e), policy=policy)
               for e, _ in TABLES] if cached else None
    return TableBatchedEmbedding(TABLES, FTM, optimizer=opt, seed=5, storage=storage,
                                 device=device, bounds_check="warn")


def _batches(k, device, seed=0):
    """k batches of one signature (N = T * B * L): hot rows, the last row of each table."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ids = [torch.randint(0, TABLES[t][0], (B * L,), generator=g) for t in FTM]
        ids[0][:4] = 0
        ids[2][-1] = TABLES[0][0] - 1
        offsets = torch.arange(len(FTM) * B + 1) * L
        grad = torch.randn(B, sum(TABLES[t][1] for t in FTM), generator=g)
        out.append(tuple(x.to(device) for x in (torch.cat(ids), offsets, grad)))
    return out


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k


# ------------------------------------------------------------------------ anywhere


def test_before_each_replay_needs_a_graphed_step_and_its_arguments():
    with pytest.raises(RuntimeError, match="only fbtriton_dist.graphs.GraphedStep and TrainPipeline"):
        graphs.before_each_replay((torch.zeros(2),), lambda replay: None, "a lookup")
    a, b = torch.zeros(8, dtype=torch.int64), torch.arange(3)
    with graphs.prepared_before_replays([a, b, 5]) as prepares:
        graphs.before_each_replay((a[2:], b), lambda replay: None, "a lookup")  # views: fine
        assert len(prepares) == 1
        with pytest.raises(RuntimeError, match="a lookup: in a GraphedStep its ids must be the "
                           r"step's own tensor arguments .*\(6,\) torch.int64"):
            graphs.before_each_replay((a[2:] + 1,), lambda replay: None, "a lookup")
        assert len(prepares) == 1


# ------------------------------------------------------------------------ GPU only


@requires_cuda
@pytest.mark.parametrize("policy, opt, where", [
    ("lru", optim.RowWiseAdagrad(lr=0.1), "device"),
    ("lfu", optim.Adam(lr=0.05, weight_decay=0.01), "host"),
])
def test_graphed_cached_step_equals_device(policy, opt, where, monkeypatch):
    """1 eager warm-up, a capture, 8 replays with evictions: outputs, weights, optimizer state
    and step equal the device module's eager steps bit for bit."""
    monkeypatch.setenv("FBTD_SLOT_MAP", where)
    device, cached = _build(opt, False), _build(opt, True, policy)
    cached.load_state_dict(device.state_dict())
    step = GraphedStep(_step(cached), warmup=1)
    for batch in _batches(10, "cuda"):
        assert torch.equal(step(*batch), _step(device)(*batch))
    assert (step.eager_calls, step.captures, step.replays) == (1, 1, 9)
    assert cached.slot_maps_on_device()["table_0"] == (where == "device")
    stats = cached.cache_stats()["table_0"]
    assert stats["evictions"] > 0 and stats["writebacks"] > 0
    _same(device, cached)


@requires_cuda
def test_two_lookups_of_one_replay_keep_each_others_slots(monkeypatch):
    """Two lookups in one captured step: the second one's map holds the clock (as a pending
    batch does eagerly), so it evicts none of the first one's slots before the replay."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    opt = optim.RowWiseAdagrad(lr=0.1)
    device, cached = _build(opt, False), _build(opt, True, slots=60)
    cached.load_state_dict(device.state_dict())

    def two(module):
        def step(i1, o1, i2, o2, grad):
            out = module(i1, o1) + 2 * module(i2, o2)
            out.backward(grad)
            return out.detach()

        return step

    step = GraphedStep(two(cached), warmup=1)
    data = _batches(12, "cuda", seed=3)
    for a, b in zip(data[::2], data[1::2], strict=True):
        assert torch.equal(step(a[0], a[1], b[0], b[1], a[2]),
                           two(device)(a[0], a[1], b[0], b[1], a[2]))
    assert step.replays == 5
    assert cached.cache_stats()["table_0"]["evictions"] > 0
    _same(device, cached)


@requires_cuda
def test_ids_computed_in_the_step_are_refused():
    cached = _build(optim.SGD(lr=0.1), True)

    def step(indices, offsets, grad):
        cached(indices.clone(), offsets).backward(grad)

    graphed = GraphedStep(step, warmup=1)
    batches = _batches(2, "cuda")
    graphed(*batches[0])
    with pytest.raises(RuntimeError, match="step's own tensor arguments"):
        graphed(*batches[1])
