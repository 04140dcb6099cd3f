"""The row cache's C helpers (``ops/tier_native.py``) against their torch twins: victims in
the order of ``ops.id_remap.pick_victims`` (spans that take several radix passes), and the
one-call map of a table (``assign``) against the per-step helpers it replaces."""

import pytest
import torch

from fbtriton_dist.modules import tiers
from fbtriton_dist.ops import tier_native
from fbtriton_dist.ops.id_remap import pick_victims
from fbtriton_dist.storage import Storage

LIB = tier_native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler: the torch ops run instead")


@pytest.mark.parametrize("lfu", [False, True], ids=["lru", "lfu"])
@pytest.mark.parametrize("span", [3, 1 << 20], ids=["one_pass", "three_passes"])
def test_victims_order_as_pick_victims(lfu, span):
    """Free slots (-1) and slots used now (``clock``) are never victims; ties of counts and
    of last use break by slot; asking for more than the candidates gives them all."""
    g = torch.Generator().manual_seed(span + lfu)
    slots, clock = 300, span + 5
    last_seen = torch.randint(0, span, (slots,), generator=g)
    last_seen[torch.randperm(slots, generator=g)[:40]] = -1
    last_seen[torch.randperm(slots, generator=g)[:30]] = clock
    counts = torch.randint(1, span + 1, (slots,), generator=g) if lfu else None
    cand = ((last_seen >= 0) & (last_seen < clock)).nonzero().squeeze(1)
    scratch = torch.empty(tier_native.scratch_size(slots, 0), dtype=torch.int64)
    for need in (1, 57, cand.numel(), cand.numel() + 9):
        got = tier_native.victims(LIB, last_seen, counts, clock, need, scratch)
        want = pick_victims(cand, last_seen, counts, min(need, cand.numel()))
        assert torch.equal(got, want), need


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_one_call_map_equals_the_step_helpers(monkeypatch, policy):
    """Two caches of one table fed the same batches (rows trained in between, so every victim
    is dirty): one through ``tier_native.assign``, one through the per-step helpers (map,
    touch, victims, swap, install, slots; taken when rows are read ahead). Same slots, map,
    stats, cache rows and backing store after every batch, with evictions."""
    rows, dim = 50, 3
    caches, slots_seen = [], []
    for one_call in (True, False):
        cache = tiers.RowCache("t", Storage(tier="cached", cache_slots=12, policy=policy), rows,
                               dim, torch.float32, pin=False)
        cache.backing.weight.copy_(torch.arange(rows * dim, dtype=torch.float32).view(rows, dim))
        state = torch.zeros(12)
        weight = torch.zeros(12, dim)
        caches.append((cache, weight, state, one_call))
    g = torch.Generator().manual_seed(2)
    for step in range(8):
        ids = torch.randint(0, rows, (11,), generator=g)
        ids[:4] = torch.randint(0, 3, (4,), generator=g)  # hot rows
        outs = []
        for cache, weight, state, one_call in caches:
            cache.backing.states = {"momentum1": cache.backing.states.get(
                "momentum1", torch.zeros(rows))}
            views = (weight, {"momentum1": state})
            if not one_call:
                cache.written = []  # as while rows are read ahead: the step helpers run
            slots = cache.assign(ids, step + 1, views, train=True, pinned=False)
            cache.written = None
            outs.append(slots)
            weight[slots] += 1.0  # training: the rows change in the cache
            state[slots] += 0.5
        assert torch.equal(outs[0], outs[1]), step
        slots_seen.append(outs[0])
    (a, wa, sa, _), (b, wb, sb, _) = caches
    for name in ("row_of_slot", "last_seen", "counts", "dirty", "slot_of_row"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.stats == b.stats and a.stats["evictions"] > 0 and a.stats["writebacks"] > 0
    assert torch.equal(wa, wb) and torch.equal(sa, sb)
    assert torch.equal(a.backing.weight, b.backing.weight)
    assert torch.equal(a.backing.states["momentum1"], b.backing.states["momentum1"])
