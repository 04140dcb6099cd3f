"""The id remap: the reference against hand-worked cases (the spec), the fast CPU path against
the reference over long drifting id streams, the Triton hash-table kernels (interpreted on CPU,
small streams) against both: the same slots, fresh slots, evictions, state and stats."""

import pytest
import torch

from fbtriton_dist.id_manager import Admission, IdManagerConfig
from fbtriton_dist.ops.id_remap import STATS, IdTable, id_remap
from fbtriton_dist.reference.id_remap import sketch_buckets
from tests.conftest import TRITON_OK

I64_MAX = 2**63 - 1


def remap(table, ids, step, backend="reference", update=True):
    slots, fresh = id_remap(table, torch.tensor(ids, dtype=torch.int64), step=step,
                            update=update, backend=backend)
    return slots.tolist(), fresh.tolist()


def stats(table) -> dict:
    return dict(zip(STATS, table.stats.tolist(), strict=True))


# -- the spec, worked by hand -------------------------------------------------------------------
def test_lru_order_and_tie_break():
    t = IdTable(IdManagerConfig(capacity=3, eviction="lru"), "t")
    # first-occurrence order takes the empty slots in ascending order
    assert remap(t, [30, 10, 30, 20], 0) == ([0, 1, 0, 2], [0, 1, 2])
    assert remap(t, [10], 1) == ([1], [])  # a hit
    # 40 evicts the least recently used: 30 and 20 both last seen at step 0: lower slot first
    assert remap(t, [40], 2) == ([0], [0])
    assert stats(t)["evicted"] == 1 and stats(t)["admitted"] == 1
    # two new ids: slots 2 (id 20, step 0) then 1 (id 10, step 1); 40 (step 2) stays
    assert remap(t, [50, 60], 3) == ([2, 1], [2, 1])
    # slots used this step are never evicted: 4 new ids, one slot not used at step 4
    assert remap(t, [50, 70, 80, 90, 60], 4) == ([2, 0, 3, 3, 1], [0])
    assert stats(t) == {"lookups": 5, "hits": 2, "default_reads": 2, "admitted": 1,
                        "rejected": 0, "overflow": 2, "evicted": 1, "expired": 0}


def test_lfu_order_and_tie_breaks():
    t = IdTable(IdManagerConfig(capacity=3, eviction="lfu"), "t")
    remap(t, [1, 1, 1, 2, 3, 3], 0)  # counts 3, 1, 2
    assert remap(t, [4], 1) == ([1], [1])  # id 2: the least frequent
    assert t.counts.tolist() == [3, 1, 2]
    # id 4 (count 1) is less frequent than 3 (count 2) and 1 (count 3): it goes
    assert remap(t, [5], 2) == ([1], [1])
    t2 = IdTable(IdManagerConfig(capacity=3, eviction="lfu"), "t")
    remap(t2, [7, 8], 0)  # counts 1, 1 at step 0
    remap(t2, [9], 1)  # count 1 at step 1
    # every count 1: the older last_seen (step 0) first, then the lower slot
    assert remap(t2, [10, 11], 2) == ([0, 1], [0, 1])


def test_ttl_expiry_and_overflow():
    t = IdTable(IdManagerConfig(capacity=2, eviction="ttl", ttl_steps=2), "t")
    assert remap(t, [1, 2], 0) == ([0, 1], [0, 1])
    assert remap(t, [1], 1) == ([0], [])
    # id 2 (seen at 0) was seen in the last 2 steps (0, 1): kept; a full ttl table evicts
    # nothing live: 3 reads the default row
    assert remap(t, [3], 2) == ([2], [])
    assert stats(t)["expired"] == 0 and stats(t)["overflow"] == 1
    assert remap(t, [3], 3) == ([1], [1])  # id 2 (seen at 0) expired at step 3
    assert stats(t)["expired"] == 1 and stats(t)["evicted"] == 0
    assert remap(t, [4], 4) == ([0], [0])  # id 1 (seen at 1) expired at 4
    # id 3 (seen at 3) and 4 (seen at 4) are live: both overflow to the default row
    assert remap(t, [5, 6], 5) == ([2, 2], [])
    assert stats(t)["overflow"] == 2 and stats(t)["default_reads"] == 2
    # id 3 (seen at 3) expires at 6: 5 takes its slot; 4 (seen at 4) does not: 7 overflows
    assert remap(t, [5, 7], 6) == ([1, 2], [1])
    assert stats(t)["expired"] == 1 and stats(t)["overflow"] == 1


BACKENDS = ["reference", "cpu", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ttl_one_never_frees_an_id_fed_every_step(backend):
    t = IdTable(IdManagerConfig(capacity=3, eviction="ttl", ttl_steps=1), "t")
    assert remap(t, [5, 6], 0, backend) == ([0, 1], [0, 1])
    for step in range(1, 8):
        # 5 and 6 every step; 7 every other step (freed at the start of each step after a gap)
        ids = [5, 6, 7] if step % 2 else [5, 6]
        slots, fresh = remap(t, ids, step, backend)
        assert slots[:2] == [0, 1], step
        assert fresh == ([2] if step % 2 else []), step
        assert stats(t)["expired"] == (1 if step % 2 and step > 1 else 0), step


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ttl", [1, 2, 3, 5])
def test_ttl_keeps_an_id_through_step_s_plus_ttl(backend, ttl):
    """The rule: an id last seen at step ``s`` is kept through step ``s + ttl`` (it was seen
    in the last ``ttl`` steps) and freed at the start of step ``s + ttl + 1``."""
    s = 2
    for gap, kept in ((ttl, True), (ttl + 1, False)):
        t = IdTable(IdManagerConfig(capacity=4, eviction="ttl", ttl_steps=ttl), "t")
        for step in range(s + gap):  # 9 every step, 7 at step s only
            remap(t, [9, 7] if step == s else [9], step, backend)
        slot7 = int((t.keys == 7).nonzero()[0, 0])
        slots, fresh = remap(t, [9, 7], s + gap, backend)
        assert slots[0] == 0 and t.last_seen[0] == s + gap  # 9: fed every step, never freed
        if kept:
            assert (slots[1], fresh) == (slot7, []), (ttl, gap)
            assert stats(t)["expired"] == 0
        else:  # freed at the start of the step, then 7 is a new id with a fresh slot
            assert (slots[1], fresh) == (slot7, [slot7]), (ttl, gap)
            assert stats(t)["expired"] == 1 and stats(t)["admitted"] == 1


def test_admission_min_count():
    cfg = IdManagerConfig(capacity=4, eviction="lru", admission=Admission(min_count=3))
    t = IdTable(cfg, "t")
    assert remap(t, [7, 8, 8, 8], 0) == ([4, 0, 0, 0], [0])  # 8: three times in one step
    assert stats(t)["rejected"] == 1 and stats(t)["admitted"] == 1
    assert remap(t, [7], 1) == ([4], [])  # seen twice
    assert remap(t, [7, 9], 2) == ([1, 4], [1])  # the third time
    assert t.sketch.sum().item() == (1 + 3 + 1 + 1 + 1) * cfg.admission.sketch_depth


@pytest.mark.parametrize("width", [16, 1024, 1 << 20])
def test_sketch_rows_mix_every_bit_of_an_id(width):
    """Ids that differ only in their high bits (equal modulo 2**32, 2**42, 2**47, 2**62, or in
    the sign bit) get other counters: before, any two ids equal modulo 2**42 shared every one
    at width 1024."""
    base = torch.tensor([5, -7, 123_456_789, 0, 2**41 + 3], dtype=torch.int64)
    for k in (32, 42, 47, 55, 62, 63):
        other = base + (1 << k) if k < 63 else base ^ torch.tensor(-(2**63))
        a, b = sketch_buckets(base, 4, width), sketch_buckets(other, 4, width)
        assert (a != b).any(0).all(), k  # every pair differs in some row
    # 256 ids equal modulo 2**42 spread over each row's counters as random ids would
    ids = 5 + torch.arange(1, 257, dtype=torch.int64) * 2**42
    buckets = sketch_buckets(ids, 4, 1024)
    assert all(row.unique().numel() > 180 for row in buckets)  # 256 would be 1 before
    assert all(len(set(buckets[:, j].tolist())) > 1 for j in range(8))  # rows independent


def test_sketch_counter_at_a_smaller_width_is_the_folded_one():
    """``fold_sketch`` (checkpoints onto other owners) relies on it."""
    ids = torch.randint(-(2**63), I64_MAX, (1000,), generator=torch.Generator().manual_seed(0))
    wide = sketch_buckets(ids, 3, 1 << 16)
    for w in (1, 16, 1024):
        assert torch.equal(sketch_buckets(ids, 3, w), wide % w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_admission_counts_high_bit_ids_apart(backend):
    cfg = IdManagerConfig(capacity=4, eviction="lru", admission=Admission(min_count=2))
    assert cfg.sketch_width == 1024
    t = IdTable(cfg, "t")
    x, y = 5, 5 + 2**47
    assert remap(t, [x], 0, backend) == ([4], [])
    assert remap(t, [y], 1, backend) == ([4], [])  # y's first time, not x's second
    assert stats(t)["rejected"] == 1
    assert remap(t, [-x, y ^ -(2**63)], 2, backend) == ([4, 4], [])
    assert remap(t, [x, y], 3, backend) == ([0, 1], [0, 1])  # both seen twice


def test_eval_only_looks_up():
    t = IdTable(IdManagerConfig(capacity=4), "t")
    remap(t, [5, 6], 0)
    before = [x.clone() for x in (t.keys, t.counts, t.last_seen)]
    assert remap(t, [6, 99, 5], 1, update=False) == ([1, 4, 0], [])
    assert all(torch.equal(a, b) for a, b in zip(before, (t.keys, t.counts, t.last_seen),
                                                 strict=True))
    assert stats(t)["hits"] == 2 and stats(t)["default_reads"] == 1


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_zero_collisions_until_full(backend):
    C = 500
    t = IdTable(IdManagerConfig(capacity=C, eviction="lru"), "t")
    g = torch.Generator().manual_seed(3)
    # raw ids from the whole int64 range, extremes included
    pool = torch.cat([torch.tensor([-(2**63), I64_MAX, 0, -1]),
                      torch.randint(-(2**63), I64_MAX, (C - 4,), generator=g)]).unique()
    assert pool.numel() == C
    slot_of = {}
    for step in range(30):
        ids = pool[torch.randint(0, C, (200,), generator=g)]
        slots, _ = id_remap(t, ids, step=step, backend=backend)
        for x, s in zip(ids.tolist(), slots.tolist(), strict=True):
            assert slot_of.setdefault(x, s) == s  # stable
        assert stats(t)["evicted"] == 0 and stats(t)["default_reads"] == 0
    assert sorted(slot_of.values()) == list(range(len(slot_of)))  # distinct: no collision
    assert len(slot_of) == C


# -- the fast paths against the spec ------------------------------------------------------------
def drifting(steps: int, batch: int, seed: int, span: int = 60, drift: int = 3):
    """Ids of a window of ``span`` that moves ``drift`` ids a step, skewed to its new end,
    spread over int64 by a multiplier (negative ids too)."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        n = int(torch.randint(1, batch + 1, (), generator=g))
        offset = (torch.rand(n, generator=g) ** 2 * span).long()
        yield step, (step * drift + span - offset) * 0x9E3779B1 - 2**40


POLICIES = [
    pytest.param({"eviction": "lru"}, id="lru"),
    pytest.param({"eviction": "lfu"}, id="lfu"),
    pytest.param({"eviction": "ttl", "ttl_steps": 4}, id="ttl"),
    pytest.param({"eviction": "lru", "admission": Admission(min_count=2, sketch_width=64)},
                 id="lru-admit2"),
    pytest.param({"eviction": "lfu", "admission": Admission(min_count=3, sketch_width=16,
                                                            sketch_depth=3)}, id="lfu-admit3-narrow"),
    pytest.param({"eviction": "ttl", "ttl_steps": 2, "admission": {"min_count": 2}},
                 id="ttl-admit2"),
]


def same_state(a: IdTable, b: IdTable) -> None:
    assert torch.equal(a.last_seen, b.last_seen)
    occupied = a.last_seen >= 0
    assert torch.equal(a.keys[occupied], b.keys[occupied])
    for name in ("counts", "sketch", "stats"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def run_against(kwargs, backends, steps, batch, capacity, seed=0, **stream):
    cfg = IdManagerConfig(capacity=capacity, **kwargs)
    tables = [IdTable(cfg, "t") for _ in backends]
    totals = torch.zeros(len(STATS), dtype=torch.int64)
    for step, ids in drifting(steps, batch, seed, **stream):
        update = step % 7 != 6  # now and then an eval step: lookups only
        outs = [id_remap(t, ids, step=step, backend=b, update=update)
                for t, b in zip(tables, backends, strict=True)]
        for (slots, fresh), t in zip(outs[1:], tables[1:], strict=True):
            assert torch.equal(slots, outs[0][0]), step
            assert torch.equal(fresh, outs[0][1]), step
            same_state(tables[0], t)
        totals += tables[0].stats
    return dict(zip(STATS, totals.tolist(), strict=True))


@pytest.mark.parametrize("kwargs", POLICIES)
def test_cpu_path_is_the_reference_over_long_streams(kwargs):
    totals = run_against(kwargs, ["reference", "cpu"], steps=300, batch=40, capacity=24)
    # the stream exercises what it should
    assert totals["admitted"] > 100 and totals["hits"] > 500
    if kwargs["eviction"] == "ttl":
        assert totals["expired"] > 50 and totals["evicted"] == 0
    else:
        assert totals["evicted"] > 50
    if "admission" in kwargs:
        assert totals["rejected"] > 20


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kwargs", POLICIES)
def test_triton_is_the_reference(kwargs):
    # C=8: H=16 buckets, so tombstones force rebuilds of the hash table too
    totals = run_against(kwargs, ["reference", "cpu", "triton"], steps=12, batch=12,
                         capacity=8, seed=1)
    assert totals["admitted"] > 8


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_index_survives_reload():
    """The index is derived state: rebuilt from keys/last_seen after a load or a backend
    switch, it answers as before."""
    cfg = IdManagerConfig(capacity=8, eviction="lfu")
    a, b = IdTable(cfg, "t"), IdTable(cfg, "t")
    for step, ids in drifting(6, 10, seed=2):
        id_remap(a, ids, step=step, backend="triton")
        id_remap(b, ids, step=step, backend="cpu" if step % 2 else "triton")
        same_state(a, b)
    a.reindex()
    for step, ids in drifting(10, 10, seed=2):
        if step >= 6:
            sa = id_remap(a, ids, step=step, backend="triton")
            sb = id_remap(b, ids, step=step, backend="reference")
            assert all(torch.equal(x, y) for x, y in zip(sa, sb, strict=True))


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_over_several_programs():
    # more ids than one program's BLOCK (128) in the lookups, inserts and erases
    totals = run_against({"eviction": "lru"}, ["reference", "triton"], steps=4, batch=600,
                         capacity=150, seed=4, span=1000, drift=200)
    assert totals["admitted"] >= 450 and totals["evicted"] >= 300 and totals["overflow"] > 0
