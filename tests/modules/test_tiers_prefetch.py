"""Prefetch of cached tables (``TableBatchedEmbedding.prefetch``, ``modules/tiers.py``): the
next batch's missing rows are read on a worker thread; training with it is bit for bit the
training without it; a copy read before its row was written back is never used; a worker's
error is raised by the next lookup."""

import pytest
import torch

from fbtriton_dist import optim
from fbtriton_dist.modules import tiers
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.ops import tier_native
from fbtriton_dist.storage import Storage
from tests.helpers import make_batch, upstream_grad

TABLES, FTM = [(64, 4), (20, 3)], [0, 0, 1]


def build(storage, opt=None):
    return TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu", seed=7,
                                 optimizer=opt or optim.RowWiseAdagrad(lr=0.3), storage=storage)


@pytest.mark.parametrize("tier,policy", [("cached", "lru"), ("file", "lfu")])
def test_prefetched_training_equals_device(tier, policy, tmp_path):
    """Each step prefetches the next batch between its forward and its backward (the next
    lookup loads those rows from the worker's copies) while the cache evicts every step."""
    opt = optim.Adam(lr=0.3)
    device = build(None, opt)
    path = str(tmp_path / "rows") if tier == "file" else None
    tiered = build([Storage(tier=tier, cache_slots=16, policy=policy, path=path), None], opt)
    tiered.load_state_dict(device.state_dict())
    g = torch.Generator().manual_seed(3)
    batches = [make_batch(TABLES, FTM, 4, 3, generator=g)[:2] for _ in range(7)]
    for step in range(6):
        for m in (device, tiered):
            out = m(*batches[step])
            m.prefetch(*batches[step + 1])
            (out * upstream_grad(out, step)).sum().backward()
    a, b = device.state_dict(), tiered.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    stats = tiered.cache_stats()["table_0"]
    assert stats["evictions"] > 0 and stats["writebacks"] > 0, stats
    assert 0 < stats["prefetch_used"] <= stats["prefetched"], stats


def test_a_row_updated_in_flight_is_not_read_stale():
    """The next batch prefetched before this one's forward (a pipeline's order): rows both
    batches read are updated by this step; the next step must see the update."""
    opt = optim.Adagrad(lr=0.5)
    device = TableBatchedEmbedding([(12, 2)], optimizer=opt, backend="cpu", seed=2)
    tbe = TableBatchedEmbedding([(12, 2)], optimizer=opt, backend="cpu",
                                storage=[Storage(tier="cached", cache_slots=4)])
    tbe.load_state_dict(device.state_dict())
    batches = [[0, 1, 2], [2, 3, 0], [4, 5, 2], [6, 2, 7], [0, 8, 9]]
    for step, ids in enumerate(batches):
        for m in (device, tbe):
            if step + 1 < len(batches):
                nxt = batches[step + 1]
                m.prefetch(torch.tensor(nxt), torch.tensor([0, len(nxt)]))
            (m(torch.tensor(ids), torch.tensor([0, len(ids)])) * (step + 1)).sum().backward()
    a, b = device.state_dict(), tbe.state_dict()
    assert torch.equal(a["weights"], b["weights"]) and torch.equal(a["momentum1"], b["momentum1"])


@pytest.mark.parametrize("native", [True, False])
def test_a_copy_read_before_its_row_was_written_back_is_not_used(native, monkeypatch):
    """The rule itself, on one cache: row 5's copy is read, then row 5 is loaded, updated and
    written back (evicted); a later miss of row 5 must load the written-back row. With the C
    helpers and with the torch ops."""
    if not native:
        monkeypatch.setattr(tier_native, "library", lambda: None)
    cache = tiers.RowCache("t", Storage(tier="cached", cache_slots=2), 10, 3, torch.float32,
                           pin=False)
    cache.backing.weight.copy_(torch.arange(30.0).view(10, 3))
    weight = torch.zeros(2, 3)
    views = (weight, {})

    def lookup(ids, clock, staged=None):
        return cache.assign(torch.tensor(ids), clock, views, train=True, pinned=False,
                            staged=staged)

    staged = cache.stage(torch.tensor([5, 6]))  # copies of rows 5 and 6 as they are now
    cache.written = []  # from here on, what is written back is recorded (as prefetch does)
    slot = lookup([5], clock=1)
    weight[slot] += 100.0  # the step's update of row 5
    lookup([7, 8], clock=2)  # evicts row 5 (dirty): written back
    assert torch.equal(cache.backing.weight[5], torch.tensor([115.0, 116.0, 117.0]))
    used = cache.stats["prefetch_used"]
    slots = lookup([5, 6], clock=3, staged=staged)
    assert torch.equal(weight[slots[0]], torch.tensor([115.0, 116.0, 117.0]))  # not 15, 16, 17
    assert torch.equal(weight[slots[1]], torch.tensor([18.0, 19.0, 20.0]))  # row 6: its copy
    assert cache.stats["prefetch_used"] == used + 1


def test_a_worker_error_is_raised_by_the_next_lookup(monkeypatch):
    def broken(self, ids):
        raise OSError("disk gone")

    tbe = build([Storage(tier="cached", cache_slots=16), None])
    indices, offsets, _ = make_batch(TABLES, FTM, 3, 2, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(tiers.RowCache, "stage", broken)
    tbe.prefetch(indices, offsets)
    with pytest.raises(RuntimeError, match=r"table 'table_0': the prefetch of its rows failed "
                                           r"on the worker thread: OSError: disk gone"):
        tbe(indices, offsets)
    monkeypatch.undo()
    tbe(indices, offsets).sum().backward()  # the module goes on
    assert tbe.cache_stats()["table_0"]["lookups"] > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_native_and_torch_paths_agree(monkeypatch, policy):
    """The row cache's C helpers (``ops/tier_native.py``) and its torch ops (no compiler, or
    ``FBTD_CPU_NATIVE=0``) give the same slots, evictions and weights: both train as device."""
    if tier_native.library() is None:
        pytest.skip("no C compiler here: only the torch ops run")
    g = torch.Generator().manual_seed(4)
    batches = [make_batch(TABLES, FTM, 4, 3, hot=True, generator=g)[:2] for _ in range(6)]
    device = build(None)
    runs = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(tier_native, "library", lambda: None)
        tiered = build([Storage(tier="cached", cache_slots=14, policy=policy), None])
        tiered.load_state_dict(device.state_dict())
        rows = []
        for step, batch in enumerate(batches):
            out = tiered(*batch)
            (out * upstream_grad(out, step)).sum().backward()
            rows.append(tiered.resident_rows())
        runs[native] = (rows, tiered.cache_stats(), tiered.state_dict())
    for step, batch in enumerate(batches):
        out = device(*batch)
        (out * upstream_grad(out, step)).sum().backward()
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    assert runs[True][1]["table_0"]["evictions"] > 0
    want = device.state_dict()
    for _, _, got in runs.values():
        assert all(torch.equal(want[k], got[k]) for k in want if isinstance(want[k], torch.Tensor))


def test_prefetch_of_some_tiers_reads_only_their_tables(tmp_path):
    """``prefetch(..., tiers=("file",))`` reads ahead the ``file`` table's rows only, the
    ``cached`` table's none (the job's ``train.prefetch_rows: auto``); ``tiers=None`` reads
    both; training stays bit for bit the device's either way."""
    opt = optim.RowWiseAdagrad(lr=0.3)
    device = build(None, opt)
    storage = [Storage(tier="file", cache_slots=16, path=str(tmp_path / "rows")),
               Storage(tier="cached", cache_slots=8)]
    some = build(storage, opt)
    every = build([Storage(tier="file", cache_slots=16, path=str(tmp_path / "rows2")),
                   storage[1]], opt)
    for m in (some, every):
        m.load_state_dict(device.state_dict())
    g = torch.Generator().manual_seed(5)
    batches = [make_batch(TABLES, FTM, 4, 3, generator=g)[:2] for _ in range(5)]
    for step in range(4):
        for m, tiers_ in ((device, None), (some, ("file",)), (every, None)):
            out = m(*batches[step])
            m.prefetch(*batches[step + 1], tiers=tiers_)
            (out * upstream_grad(out, step)).sum().backward()
    want = device.state_dict()
    for m in (some, every):
        got = m.state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want if torch.is_tensor(want[k]))
    s, e = some.cache_stats(), every.cache_stats()
    assert s["table_0"]["prefetched"] > 0 and s["table_1"]["prefetched"] == 0, s
    assert e["table_0"]["prefetched"] > 0 and e["table_1"]["prefetched"] > 0, e
