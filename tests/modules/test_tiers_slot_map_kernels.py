"""The device slot map's Triton path (``kernels/slot_map.py``, ``FBTD_SLOT_MAP_KERNELS=1``;
under ``TRITON_INTERPRET=1`` on CPU tensors here) against its torch path (the CPU path and
the reference): the same passes over the batches, maps, rows moved and stats, bit for bit,
and a step's launches counted so that a regression fails."""

import os

import pytest
import torch

from fbtriton_dist import knobs, optim
from fbtriton_dist.kernels import launch
from fbtriton_dist.modules import tier_device_map, tiers
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.ops import slot_map
from fbtriton_dist.storage import Storage
from tests.conftest import requires_cuda
from tests.helpers import make_batch, upstream_grad
from tests.modules import test_tiers as base
from tests.modules import test_tiers_device_map as device_map
from tests.modules.test_tiers_device_map import on_device  # noqa: F401  (a fixture)

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernels on CPU tensors: TRITON_INTERPRET=1")

TABLES = [(64, 4), (40, 3), (30, 2)]  # two cached (D 4 and 3), one on the device: not mapped
MAP_FIELDS = ("rows", "live", "used", "free", "cand", "counts")
STATE = ("row_of_slot", "slot_of_row", "last_seen", "counts", "dirty", "written")


def build(opt, policy, ftm, backend="cpu"):
    storage = [Storage(tier="cached", cache_slots=s, policy=policy) for s in (12, 9)]
    return TableBatchedEmbedding(TABLES, feature_table_map=ftm, optimizer=opt, backend=backend,
                                 seed=7, storage=[*storage, Storage(tier="device")])


def paths(monkeypatch) -> list[bool]:
    """``DeviceMaps.kernels`` of each set of maps built from now on."""
    kernels = []
    init = tier_device_map.DeviceMaps.__init__

    def built(self, *args):
        init(self, *args)
        kernels.append(self.kernels)

    monkeypatch.setattr(tier_device_map.DeviceMaps, "__init__", built)
    return kernels


def recorded(monkeypatch):
    """Per ``map`` of either path (``DeviceMaps.kernels``): its ``Mapped`` (``new_rows`` cut
    to its valid part) and the map's tensors after the ``finish`` that follows."""
    seen = {False: [], True: []}
    map_, finish = tier_device_map.DeviceMaps.map, tier_device_map.DeviceMaps.finish

    def mapped(self, *args):
        out = map_(self, *args)
        fields = {f: getattr(out, f).clone() for f in MAP_FIELDS}
        fields["new_rows"] = out.new_rows[: int(out.counts[:, 1].sum())].clone()
        seen[self.kernels].append(fields)
        return out

    def finished(self, *args, **kwargs):
        try:
            return finish(self, *args, **kwargs)
        finally:
            seen[self.kernels][-1].update({n: getattr(self, n).clone() for n in STATE})

    monkeypatch.setattr(tier_device_map.DeviceMaps, "map", mapped)
    monkeypatch.setattr(tier_device_map.DeviceMaps, "finish", finished)
    return seen


@interpreted
@pytest.mark.parametrize("policy,opt,ftm,sort", [
    ("lru", "adam", [0, 2, 0, 1], "joint"), ("lfu", "rowwise_adagrad", [1, 0, 2, 1], "joint"),
    ("lfu", "adam", [0, 1, 2], "lfu_sort"), ("lru", "rowwise_adagrad", [0, 1, 2], "two_sorts"),
])
def test_the_kernels_map_as_torch_bit_for_bit(policy, opt, ftm, sort, monkeypatch):
    """Two cached tables of different dims (Adam: two states; rowwise Adagrad: one per row)
    and a device table whose ids the map leaves alone (``live`` False), a table's features
    contiguous or not, and a batch refused for ids out of range (counted in the pass, nothing
    changed): every pass (slots used, free, candidates, counts, misses in order),
    the map after every placement, the outputs, rows moved (weights and states), resident
    rows and stats are the torch path's, over steps that evict dirty rows. ``sort``: every
    table's slots ordered by one sort of the joint keys (table, key); by two stable sorts
    (keys too large to share an int64 with the table); the LFU victims by two stable sorts
    per table (LFU keys too large for an int64: very long runs)."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    if sort == "lfu_sort":
        monkeypatch.setattr(tier_device_map, "_LFU_KEY_LIMIT", 0)
    if sort == "two_sorts":
        monkeypatch.setattr(tier_device_map, "_joint_shift", lambda tables, bound: 0)
    seen = recorded(monkeypatch)
    g = torch.Generator().manual_seed(3)
    data = [make_batch(TABLES, ftm, 4, 3, hot=True, generator=g)[:2] for _ in range(6)]
    models = {}
    for k in ("0", "1"):
        monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", k)
        models[k] = build(base.OPTIMIZERS[opt], policy, ftm)
    models["1"].load_state_dict(models["0"].state_dict())
    runs = {}
    for k, m in models.items():
        outs, rows = [], []
        for step, batch in enumerate(data):
            out = m(*batch)
            (out * upstream_grad(out, step)).sum().backward()
            outs.append(out.detach())
            rows.append(m.resident_rows())
        indices, offsets = data[0]
        bad = indices.clone()
        bad[0], bad[-1] = 1000, -1  # out of range in the first and the last feature
        with pytest.raises(ValueError, match="out of range"):  # refused, nothing changed
            m(bad, offsets)
        rows.append(m.resident_rows())
        runs[k] = (outs, rows, m.cache_stats(), m.state_dict())
    assert len(seen[True]) == len(seen[False]) == len(data) + 1  # the refused batch's pass
    assert int(seen[True][-1]["counts"][:, 5].sum()) > 0
    for a, b in zip(seen[False], seen[True], strict=True):
        for name, value in a.items():
            assert torch.equal(value, b[name]), name
    (o0, r0, s0, d0), (o1, r1, s1, d1) = runs["0"], runs["1"]
    assert all(torch.equal(x, y) for x, y in zip(o0, o1, strict=True)) and r0 == r1
    assert s0 == s1 and all(s["evictions"] > 0 and s["writebacks"] > 0
                            for s in list(s1.values())[:2]), s1
    assert all(torch.equal(d0[k], d1[k]) for k in d0 if isinstance(d0[k], torch.Tensor))


@interpreted
@pytest.mark.parametrize("check", [
    base.test_out_of_range_id, base.test_cache_smaller_than_a_batch,
    base.test_lfu_evicts_the_least_used_row, base.test_a_row_in_use_is_never_evicted,
    base.test_eval_does_not_change_state_and_writes_nothing_back, base.test_tier_vbe,
], ids=lambda f: f.__name__[5:])
def test_the_tier_rules_hold_on_the_kernels(check, monkeypatch):
    """Errors with their messages (raised before anything changes), LFU's order, pinned
    rows, eval (nothing changes, nothing written back), variable batch sizes."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", "1")
    kernels = paths(monkeypatch)
    check()
    assert kernels and all(kernels)


@interpreted
def test_a_half_cache_converts_rows_as_torch(monkeypatch):
    """fp16 slots, fp32 backing store: the kernels round rows in and widen them out as
    ``.to`` does (the device-map test's module, host map against the kernels)."""
    monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", "1")
    device_map.test_a_half_cache_never_rounds_a_clean_row_back(monkeypatch)


@interpreted
def test_prefetch_is_exact_on_the_kernels(on_device, monkeypatch):  # noqa: F811
    """A prefetch's placement (no stamps, counts 0, clean) on the kernels: training with
    prefetch equals ``device`` bit for bit."""
    monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", "1")
    device_map.test_prefetch_is_exact(on_device)


@interpreted
def test_the_knob(monkeypatch):
    """``auto``: the kernels on CUDA only; ``0`` / ``1`` force (``1`` on the CPU needs the
    interpreter); a bad value names the knob."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    kernels = paths(monkeypatch)
    for value in ("auto", "1", "0"):
        monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", value)
        m = build(optim.SGD(lr=0.1), "lru", [0, 1, 2])
        assert m.slot_maps_on_device() == {"table_0": True, "table_1": True}
    assert kernels == [False, True, False]
    monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", "1")
    monkeypatch.setattr(slot_map, "interpreted", lambda: False)  # compiled Triton, CPU maps
    with pytest.raises(ValueError, match=r"FBTD_SLOT_MAP_KERNELS=1 with the slot maps on cpu: "
                                         r"expected TRITON_INTERPRET=1"):
        build(optim.SGD(lr=0.1), "lru", [0, 1, 2])
    monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", "yes")
    with pytest.raises(ValueError, match=r"FBTD_SLOT_MAP_KERNELS: expected one of \['auto', "
                                         r"'0', '1'\], got 'yes'"):
        knobs.slot_map_kernels()


@interpreted
def test_a_fused_step_issues_few_launches(monkeypatch):
    """A training step whose every table misses and evicts dirty rows, on 2 and 4 cached
    tables (rowwise Adagrad: 2 tensors a table): the lookup issues 7 Triton kernels (map: 2,
    compact; stamp, keys, rows out and in, slots) and 3 torch launches (one zeroed buffer,
    the cumulative sum, one sort of the joint keys; the parts' table made on the host, on
    CUDA one copy more), no sync but the one read of the counts, whatever the number of
    tables (the torch path: about 110 launches, 8 more a table)."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", "1")
    remap, call = tiers.TieredTables.remap, launch.Launcher.__call__
    counted = []

    class Counter(device_map.SyncCounter):
        quiet = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.quiet or func.__name__.startswith("empty"):
                return func(*args, **(kwargs or {}))  # the interpreter's copies; allocations
            return super().__torch_dispatch__(func, types, args, kwargs)

    def launched(self, *args, **kwargs):
        Counter.quiet += 1
        try:
            counted[-1][1] += 1
            return call(self, *args, **kwargs)
        finally:
            Counter.quiet -= 1

    def remapped(self, *args, **kwargs):
        counted.append([None, 0, None])
        with Counter() as counter:
            out = remap(self, *args, **kwargs)
        counted[-1][0], counted[-1][2] = counter.launches, counter.syncs
        return out

    monkeypatch.setattr(tiers.TieredTables, "remap", remapped)
    monkeypatch.setattr(launch.Launcher, "__call__", launched)
    per_step = {}
    for T in (2, 4):
        tables = [(64, 4)] * T
        m = TableBatchedEmbedding(tables, feature_table_map=list(range(T)), backend="cpu",
                                  optimizer=optim.RowWiseAdagrad(lr=0.1),
                                  storage=[Storage(tier="cached", cache_slots=12)] * T)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            counted.clear()
            indices, offsets, _ = make_batch(tables, list(range(T)), 4, 3, generator=g)
            (m(indices, offsets) * 1.0).sum().backward()
        stats = m.cache_stats().values()
        assert all(s["evictions"] > 0 and s["writebacks"] > 0 for s in stats), stats
        (aten, kernels, syncs), = counted  # the last step: every table misses and evicts
        assert syncs == [], syncs
        per_step[T] = (aten, kernels)
    assert per_step[2] == per_step[4], per_step
    assert per_step[2] == (3, 7), per_step


@requires_cuda
def test_the_kernels_train_as_torch_on_cuda(monkeypatch):
    """On a GPU (the kernels compiled, the backing store mapped host memory): training with
    the kernels (``auto``) equals the torch ops (``FBTD_SLOT_MAP_KERNELS=0``) bit for bit,
    LRU and LFU, with evictions and write-backs."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "auto")
    ftm = [0, 2, 0, 1]
    g = torch.Generator().manual_seed(5)
    data = [tuple(x.cuda() for x in make_batch(TABLES, ftm, 4, 3, hot=True, generator=g)[:2])
            for _ in range(6)]
    for policy in ("lru", "lfu"):
        models, kernels = {}, paths(monkeypatch)
        for k in ("0", "auto"):
            monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", k)
            models[k] = build(optim.Adam(lr=0.1), policy, ftm, backend="auto").cuda()
        assert kernels == [False, True]
        models["auto"].load_state_dict(models["0"].state_dict())
        runs = {}
        for k, m in models.items():
            outs = []
            for step, batch in enumerate(data):
                out = m(*batch)
                (out * upstream_grad(out, step)).sum().backward()
                outs.append(out.detach())
            runs[k] = (outs, m.resident_rows(), m.cache_stats(), m.state_dict())
        (o0, r0, s0, d0), (o1, r1, s1, d1) = runs["0"], runs["auto"]
        assert all(torch.equal(x, y) for x, y in zip(o0, o1, strict=True))
        assert r0 == r1 and s0 == s1, (s0, s1)
        assert all(s["evictions"] > 0 for s in list(s1.values())[:2]), s1
        assert all(torch.equal(d0[k], d1[k]) for k in d0 if isinstance(d0[k], torch.Tensor))
