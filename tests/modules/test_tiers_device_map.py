"""The cached tier's slot map on the cache's device (``modules/tier_device_map.py``, the CUDA
path), run on the CPU with ``FBTD_SLOT_MAP=device``: it trains as ``device`` bit for bit and
as the host map (same slots, evictions and stats), the tier tests' rules and errors hold on
it, prefetch stays exact, and a lookup reads the host once per step whatever the number of
tables, with no other sync point."""

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fbtriton_dist import knobs, optim
from fbtriton_dist.modules import tier_device_map, tiers
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.storage import Storage
from tests.conftest import HAS_CUDA
from tests.helpers import make_batch, upstream_grad
from tests.modules import test_tiers as base
from tests.modules import test_tiers_prefetch as base_prefetch

TABLES, FTM = [(64, 4), (40, 3)], [0, 0, 1]  # both cached
SLOTS = 14


@pytest.fixture
def on_device(monkeypatch):
    """Maps on the device; records each pass over a batch there ("map") and each placement
    (True: a lookup's, False: a prefetch's)."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    calls = []
    map_, finish = tier_device_map.DeviceMaps.map, tier_device_map.DeviceMaps.finish

    def mapped(self, *args, **kwargs):
        calls.append("map")
        return map_(self, *args, **kwargs)

    def finished(self, *args, **kwargs):
        calls.append(kwargs["lookup"])
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(tier_device_map.DeviceMaps, "map", mapped)
    monkeypatch.setattr(tier_device_map.DeviceMaps, "finish", finished)
    return calls


def build(opt, policy="lru", storage=True, pooling="sum", ftm=FTM, backend="cpu", **kw):
    s = [Storage(tier="cached", cache_slots=SLOTS, policy=policy)] * 2 if storage else None
    return TableBatchedEmbedding(TABLES, feature_table_map=ftm, optimizer=opt, backend=backend,
                                 seed=7, storage=s, pooling=pooling, **kw)


def batches(n=6, seed=4, ftm=FTM):
    g = torch.Generator().manual_seed(seed)
    return [make_batch(TABLES, ftm, 4, 3, hot=True, generator=g)[:2] for _ in range(n)]


def train(m, data, prefetch=False):
    rows = []
    for step, batch in enumerate(data):
        out = m(*batch)
        if prefetch and step + 1 < len(data):
            m.prefetch(*data[step + 1])
        (out * upstream_grad(out, step)).sum().backward()
        rows.append(m.resident_rows())
    return rows


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))


def test_the_switch(monkeypatch, tmp_path):
    """CPU default: the host map (the C pass); ``device``: on the cache's device, except
    ``file`` tables; a bad value names the knob."""
    storage = [Storage(tier="cached", cache_slots=8),
               Storage(tier="file", cache_slots=8, path=str(tmp_path))]
    m = TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu", storage=storage)
    assert m.slot_maps_on_device() == {"table_0": False, "table_1": False}
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    m = TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu", storage=storage)
    assert m.slot_maps_on_device() == {"table_0": True, "table_1": False}
    monkeypatch.setenv("FBTD_SLOT_MAP", "host")
    assert not any(m.cpu().slot_maps_on_device().values())  # read again when moved
    monkeypatch.setenv("FBTD_SLOT_MAP", "gpu")
    with pytest.raises(ValueError, match=r"FBTD_SLOT_MAP: expected one of \['auto', "
                                         r"'device', 'host'\], got 'gpu'"):
        knobs.slot_map()


@pytest.mark.parametrize("policy,opt,lfu_sort,ftm", [
    ("lru", "adam", False, FTM), ("lru", "rowwise_adagrad", False, [0, 1, 0]),
    ("lfu", "adam", False, [0, 1, 0]), ("lfu", "rowwise_adagrad", True, FTM),
])
def test_trains_as_device_and_as_the_host_map(policy, opt, lfu_sort, ftm, on_device,
                                              monkeypatch):
    """Bit for bit with ``device`` (weights, states, step) after steps that evict, and the
    same resident rows after every step and the same stats as the host map. ``lfu_sort``: the
    LFU victims by two stable sorts (the fallback of very long runs) instead of one topk;
    ``ftm`` [0, 1, 0]: a table's ids not contiguous in the batch."""
    data = batches(ftm=ftm)
    device = build(base.OPTIMIZERS[opt], storage=False, ftm=ftm)
    monkeypatch.setenv("FBTD_SLOT_MAP", "host")
    host = build(base.OPTIMIZERS[opt], policy, ftm=ftm)
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    if lfu_sort:
        monkeypatch.setattr(tier_device_map, "_LFU_KEY_LIMIT", 0)
    mapped = build(base.OPTIMIZERS[opt], policy, ftm=ftm)
    for m in (host, mapped):
        m.load_state_dict(device.state_dict())
    train(device, data)
    rows_host, rows_mapped = train(host, data), train(mapped, data)
    assert "map" in on_device and False not in on_device
    assert rows_host == rows_mapped
    assert host.cache_stats() == mapped.cache_stats()
    stats = mapped.cache_stats()
    assert all(s["evictions"] > 0 and s["writebacks"] > 0 for s in stats.values()), stats
    assert same_state(device, mapped) and device.step == mapped.step == len(data)


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_padding_past_the_last_bag_is_no_lookup(kernels, on_device, monkeypatch):
    """A fixed-shape batch (the pipeline's graph step) carries zeros after its last bag: they
    are no lookup of the last feature's table (no slot, no hit, no miss), on the device map
    (torch ops and kernels: interpreted on CPU tensors, compiled on CUDA's where there is
    one) as on the host map; training stays exact."""
    monkeypatch.setenv("FBTD_SLOT_MAP_KERNELS", kernels)
    where = {"device": "cuda", "backend": "triton"} if kernels == "1" and HAS_CUDA else {}
    cpu_data = [(torch.cat([i, torch.zeros(7, dtype=i.dtype)]), o) for i, o in batches()]
    data = [tuple(t.to(where.get("device", "cpu")) for t in b) for b in cpu_data]
    device = build(optim.RowWiseAdagrad(lr=0.1), storage=False, bounds_check="ignore", **where)
    monkeypatch.setenv("FBTD_SLOT_MAP", "host")
    host = build(optim.RowWiseAdagrad(lr=0.1), bounds_check="ignore", **where)
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    mapped = build(optim.RowWiseAdagrad(lr=0.1), bounds_check="ignore", **where)
    for m in (host, mapped):
        m.load_state_dict(device.state_dict())
    train(device, data)
    assert train(host, data) == train(mapped, data)
    assert host.cache_stats() == mapped.cache_stats()
    distinct = 0  # "lookups" counts each batch's distinct rows of a table
    for i, o in cpu_data:
        bounds = o[:: (o.numel() - 1) // len(FTM)].tolist()
        pairs = {(FTM[f], int(x)) for f in range(len(FTM)) for x in i[bounds[f]:bounds[f + 1]]}
        distinct += len(pairs)
    assert sum(s["lookups"] for s in mapped.cache_stats().values()) == distinct
    assert same_state(device, mapped)


class SyncCounter(TorchDispatchMode):
    """Counts every aten op, those that launch work (``launches``: not a view, which on CUDA
    is no kernel), and those that read the device from the host (a sync on CUDA):
    ``.item()`` / ``int()`` / ``bool()`` (``_local_scalar_dense``), ``nonzero``,
    ``masked_select``, ``unique``, boolean-mask indexing."""

    SYNCS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")
    VIEWS = ("slice", "select", "view", "detach", "alias", "lift_fresh", "_unsafe_view", "unbind",
             "unsqueeze", "squeeze", "expand", "as_strided", "t.", "permute")

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.syncs = 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        self.ops += 1
        self.launches += not name.startswith(self.VIEWS)
        masks = [a for a in args if isinstance(a, (list, tuple))
                 for x in a if isinstance(x, torch.Tensor) and x.dtype == torch.bool]
        if any(s in name for s in self.SYNCS) or (name.startswith("index.") and masks):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_a_lookup_reads_the_host_once(on_device, monkeypatch):
    """Per training step with misses and evictions in both tables: one host read (every
    table's counts together), no other sync point, and a number of ops that does not grow
    with the batch."""
    reads = []
    host_values = tier_device_map.host_values
    monkeypatch.setattr(tier_device_map, "host_values",
                        lambda t: reads.append(t.numel()) or host_values(t))
    remap, seen = tiers.TieredTables.remap, []

    def counted(self, *args, **kwargs):
        reads.clear()
        with SyncCounter() as counter:
            out = remap(self, *args, **kwargs)
        seen.append((list(reads), counter.syncs, counter.ops))
        return out

    monkeypatch.setattr(tiers.TieredTables, "remap", counted)
    m = TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu",
                              optimizer=optim.RowWiseAdagrad(lr=0.1),
                              storage=[Storage(tier="cached", cache_slots=n) for n in (20, 6)])
    g = torch.Generator().manual_seed(1)
    for B in (2, 4, 4, 4, 4):
        indices, offsets, _ = make_batch(TABLES, FTM, B, 3, generator=g)
        (m(indices, offsets) * 1.0).sum().backward()
    stats = m.cache_stats()
    assert all(s["evictions"] > 0 for s in stats.values()), stats
    K = tier_device_map.Mapped.COUNTS
    for reads_of_step, syncs, _ in seen:
        assert reads_of_step == [2 * K] and syncs == []
    ops = [n for _, _, n in seen]
    assert max(ops) <= 175, ops  # one pass for all tables, ~25 per table with misses; any B


def test_launches_do_not_grow_with_the_tables_but_for_their_rows(monkeypatch):
    """Per training step with misses, evictions and dirty victims in every table, on 2 and
    on 5 tables: the map's work is one pass and one placement for all tables (at most 112
    launches, whatever the number of tables; its per-table counts are running sums read at the
    tables' bounds, about 12 launches, not atomics onto a few counters); each table adds only its rows' moves (per
    tensor of its rows, weights and the optimizer state: a gather and a scatter in, the same
    out: 4 x 2 = 8 launches), not a placement of its own (a per-table loop of map ops: about
    20 launches a table)."""
    monkeypatch.setenv("FBTD_SLOT_MAP", "device")
    remap, launches = tiers.TieredTables.remap, []

    def counted(self, *args, **kwargs):
        with SyncCounter() as counter:
            out = remap(self, *args, **kwargs)
        launches.append(counter.launches)
        return out

    monkeypatch.setattr(tiers.TieredTables, "remap", counted)
    per_step = {}
    for T in (2, 5):
        tables = [(64, 4)] * T
        m = TableBatchedEmbedding(tables, feature_table_map=list(range(T)), backend="cpu",
                                  optimizer=optim.RowWiseAdagrad(lr=0.1),
                                  storage=[Storage(tier="cached", cache_slots=12)] * T)
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            launches.clear()
            indices, offsets, _ = make_batch(tables, list(range(T)), 4, 3, generator=g)
            (m(indices, offsets) * 1.0).sum().backward()
        stats = m.cache_stats().values()
        assert all(s["evictions"] > 0 and s["writebacks"] > 0 for s in stats), stats
        per_step[T] = launches[0]  # the last step's: every table misses and evicts
    assert per_step[2] <= 112 + 2 * 8, per_step
    assert per_step[5] - per_step[2] <= 3 * 8, per_step


@pytest.mark.parametrize("check", [
    base.test_lru_evicts_the_unused_oldest_row, base.test_lfu_evicts_the_least_used_row,
    base.test_a_row_in_use_is_never_evicted, base.test_a_freed_graph_releases_its_rows,
    base.test_eval_does_not_change_state_and_writes_nothing_back,
    base.test_cache_smaller_than_a_batch, base.test_out_of_range_id,
    base.test_two_batches_in_flight_train_as_device, base.test_tier_vbe,
], ids=lambda f: f.__name__[5:])
def test_the_tier_rules_hold(check, on_device):
    """The tier tests' eviction rules, pinned rows, eval, errors (unchanged messages) and
    in-flight batches, on the device map."""
    check()
    assert "map" in on_device


def test_flush_and_checkpoint_round_trip(on_device, tmp_path):
    """``flush`` writes every dirty row back once; the state dict (whole tables) loads into a
    host-map module and a ``device`` one and training goes on alike."""
    opt = optim.Adam(lr=0.2)
    data = batches(8, seed=2)
    device, mapped = build(opt, storage=False), build(opt)
    mapped.load_state_dict(device.state_dict())
    train(device, data[:4])
    train(mapped, data[:4])
    mapped.flush()
    written = sum(s["writebacks"] for s in mapped.cache_stats().values())
    mapped.flush()
    assert sum(s["writebacks"] for s in mapped.cache_stats().values()) == written
    assert torch.equal(mapped.split_embedding_weights()[0], device.split_embedding_weights()[0])
    state = mapped.state_dict()
    restored = build(opt)
    restored.load_state_dict(state)
    assert restored.resident_rows() == {"table_0": [], "table_1": []}
    for m in (device, mapped, restored):
        train(m, data[4:])
    assert same_state(device, mapped) and same_state(device, restored)


def test_prefetch_is_exact(on_device):
    """Prefetch places the next batch's misses in the cache ahead of its lookup (the worker
    thread on the CPU): training equals ``device`` bit for bit, pipelined as in the tier
    tests too."""
    base_prefetch.test_prefetched_training_equals_device("cached", "lru", None)
    base_prefetch.test_a_row_updated_in_flight_is_not_read_stale()
    data = batches(7, seed=9)
    device, mapped = build(optim.Adam(lr=0.3), storage=False), build(optim.Adam(lr=0.3), "lfu")
    mapped.load_state_dict(device.state_dict())
    train(device, data)
    train(mapped, data, prefetch=True)
    assert same_state(device, mapped)
    stats = mapped.cache_stats()
    assert all(0 < s["prefetched"] == s["prefetch_used"] <= s["misses"] for s in stats.values())
    assert False in on_device  # placements of prefetches


def test_prefetch_error_is_raised_by_the_next_lookup(on_device, monkeypatch):
    m = build(optim.RowWiseAdagrad(lr=0.1))
    (indices, offsets), = batches(1)
    map_ = tier_device_map.DeviceMaps.map

    def broken(self, *args):
        if threading.current_thread().name.startswith("tier-prefetch"):
            raise OSError("device gone")
        return map_(self, *args)

    monkeypatch.setattr(tier_device_map.DeviceMaps, "map", broken)
    m.prefetch(indices, offsets)
    with pytest.raises(RuntimeError, match=r"table 'table_0', 'table_1': the prefetch of its "
                                           r"rows failed on the worker thread: OSError: device"):
        m(indices, offsets)
    m(indices, offsets).sum().backward()  # the module goes on
    assert m.cache_stats()["table_0"]["lookups"] > 0


def test_a_half_cache_never_rounds_a_clean_row_back(monkeypatch):
    """After ``.half()`` the slots are fp16 and the backing store fp32: the device map writes
    every victim back when one is dirty, and a clean one must keep its fp32 bytes (as the
    host map leaves them): the same backing store as the host map's after training and eval
    lookups that evict both kinds."""
    out = {}
    for where in ("host", "device"):
        monkeypatch.setenv("FBTD_SLOT_MAP", where)
        torch.manual_seed(0)
        m = TableBatchedEmbedding([(40, 3)], optimizer=optim.SGD(lr=0.1), backend="cpu",
                                  storage=[Storage(tier="cached", cache_slots=8)],
                                  stochastic_rounding=False).half()
        for step, ids in enumerate(([1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 1], [11, 12, 13, 14],
                                    [15, 16, 2])):
            x = (torch.tensor(ids), torch.tensor([0, len(ids)]))
            if step % 2:
                with torch.no_grad():
                    m(*x)
            else:
                m(*x).sum().backward()
        assert m.slot_maps_on_device() == {"table_0": where == "device"}
        out[where] = (m.split_embedding_weights()[0].clone(), m.cache_stats())
    assert out["host"][1] == out["device"][1] and out["host"][1]["table_0"]["evictions"] > 3
    assert out["host"][0].dtype == torch.float32
    assert torch.equal(out["host"][0], out["device"][0])


def test_int32_codes_refuse_to_overflow(on_device, monkeypatch):
    """The misses' codes are int32 (``slots + 1 + ids`` at most): a batch that would pass
    ``2**31 - 1`` is refused by name before anything changes; one at the bound passes (a
    lookup with the bound lowered to its own size, then one below it)."""
    tier_device_map.check_codes(2**31 - 1 - 1 - 1000, 1000)
    with pytest.raises(ValueError, match=r"a batch of 1001 ids with a cache of 2147482646 "
                                         r"slots: .* expected slots \+ ids \+ 1 <= 2147483647, "
                                         r"got 2147483648"):
        tier_device_map.check_codes(2**31 - 1 - 1 - 1000, 1001)
    m = build(optim.SGD(lr=0.1))
    (indices, offsets), = batches(1)
    monkeypatch.setattr(tier_device_map, "_CODE_LIMIT", SLOTS + 1 + indices.numel())
    m(indices, offsets)
    monkeypatch.setattr(tier_device_map, "_CODE_LIMIT", SLOTS + indices.numel())
    before = m.resident_rows()
    with pytest.raises(ValueError, match=rf"a batch of {indices.numel()} ids with a cache of "
                                         rf"{SLOTS} slots: the device slot map numbers"):
        m(indices, offsets)
    assert m.resident_rows() == before
