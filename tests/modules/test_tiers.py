"""Storage tiers of TableBatchedEmbedding (``storage=``, ``modules/tiers.py``): a ``cached`` or
``file`` table trains exactly as on ``device`` (weights, optimizer state and step, bit for bit
in fp32) while its cache evicts every step; the eviction rules; the bad inputs; the file tier's
files."""

import os

import pytest
import torch

from fbtriton_dist import optim
from fbtriton_dist.modules import tier_backing
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.ops.backends.base import Capabilities
from fbtriton_dist.storage import Storage, storage_of
from tests.conftest import TRITON_OK
from tests.helpers import device_for, make_batch, upstream_grad

TABLES = [(64, 4), (20, 3)]  # table 0 cached (16 slots), table 1 on device
FTM = [0, 0, 1]
OPTIMIZERS = {
    "sgd": optim.SGD(lr=0.3),
    "adagrad": optim.Adagrad(lr=0.3),
    "rowwise_adagrad": optim.RowWiseAdagrad(lr=0.3),
    "adam": optim.Adam(lr=0.3),
}
STEPS = 5


def storage_for(tier: str, policy: str, tmp_path, slots: int = 16) -> list:
    path = str(tmp_path / "rows") if tier == "file" else None
    return [Storage(tier=tier, cache_slots=slots, policy=policy, path=path), None]


def build(storage, backend, opt, pooling="sum", tables=TABLES, ftm=FTM):
    return TableBatchedEmbedding(tables, feature_table_map=ftm, pooling=pooling,
                                 optimizer=opt, backend=backend, seed=7, storage=storage)


def train_pair(device, tiered, *, weighted=False, hot=False, steps=STEPS, B=3, max_L=2):
    """The same batches through both; the tiered one's cache must evict along the way."""
    g = torch.Generator().manual_seed(3)
    tiered.load_state_dict(device.state_dict())
    for step in range(steps):
        indices, offsets, psw = make_batch(device.tables, device.feature_table_map, B, max_L,
                                           weighted=weighted, hot=hot, generator=g)
        for m in (device, tiered):
            out = m(indices, offsets, psw)
            (out * upstream_grad(out, step)).sum().backward()


def assert_same(device, tiered):
    a, b = device.state_dict(), tiered.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
    assert device.step == tiered.step == STEPS


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("tier,policy", [("cached", "lru"), ("file", "lfu")])
def test_tier_trains_as_device(backend, opt, tier, policy, tmp_path):
    device = build(None, backend, OPTIMIZERS[opt])
    tiered = build(storage_for(tier, policy, tmp_path), backend, OPTIMIZERS[opt])
    train_pair(device, tiered)
    assert_same(device, tiered)
    stats = tiered.cache_stats()["table_0"]
    assert stats["evictions"] >= STEPS and stats["writebacks"] > 0, stats


@pytest.mark.parametrize("opt,tier,policy", [("rowwise_adagrad", "cached", "lru"),
                                             ("adam", "file", "lfu")])
def test_triton_tier_trains_as_device(opt, tier, policy, tmp_path):
    """The Triton kernels (on the GPU, else interpreted: ``conftest.py``), mean pooling."""
    if not TRITON_OK:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    dev = device_for("triton")
    device = build(None, "triton", OPTIMIZERS[opt], pooling="mean").to(dev)
    tiered = build(storage_for(tier, policy, tmp_path, slots=12), "triton", OPTIMIZERS[opt],
                   pooling="mean").to(dev)
    g = torch.Generator().manual_seed(3)
    tiered.load_state_dict(device.state_dict())
    for step in range(STEPS):
        batch = make_batch(TABLES, FTM, 3, 2, weighted=True, hot=True, generator=g, device=dev)
        for m in (device, tiered):
            out = m(*batch)
            (out * upstream_grad(out, step)).sum().backward()
    assert_same(device, tiered)
    assert tiered.cache_stats()["table_0"]["evictions"] > 0


@pytest.mark.parametrize("pooling,weighted", [("mean", False), ("sum", True), ("none", False)])
def test_tier_poolings_weighted_hot_ids(pooling, weighted, tmp_path):
    """Mean and weighted sums, the unpooled lookup; hot ids: a row summed many times per batch
    whose slot order differs from its id order."""
    opt = OPTIMIZERS["rowwise_adagrad"]
    device = build(None, "cpu", opt, pooling=pooling)
    tiered = build(storage_for("cached", "lru", tmp_path, slots=12), "cpu", opt,
                   pooling=pooling)
    train_pair(device, tiered, weighted=weighted, hot=True)
    assert_same(device, tiered)
    assert tiered.cache_stats()["table_0"]["evictions"] > 0


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_half_weights_round_to_nearest_as_device(backend):
    """fp16 weights: exact with round-to-nearest updates (stochastic rounding draws its noise
    in the batch's row order, which slots change: ``docs/storage.md``)."""
    def make(storage):
        torch.manual_seed(0)
        return TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend=backend,
                                     optimizer=optim.Adagrad(lr=0.3), seed=1, storage=storage,
                                     weights_dtype=torch.float16, stochastic_rounding=False)

    device, tiered = make(None), make([Storage(tier="cached", cache_slots=12), None])
    train_pair(device, tiered)
    assert_same(device, tiered)
    assert tiered.cache_stats()["table_0"]["evictions"] > 0


def test_tier_vbe():
    """A variable batch per feature (VBE) goes through the same remap."""
    sizes = [[2], [4], [3]]
    device = build(None, "cpu", optim.Adam(lr=0.2))
    tiered = build([Storage(tier="cached", cache_slots=14), "cached"], "cpu",
                   optim.Adam(lr=0.2))
    tiered.load_state_dict(device.state_dict())
    g = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        lengths = torch.randint(0, 3, (sum(b for (b,) in sizes),), generator=g)
        ids = []
        for f, (b,) in enumerate(sizes):
            start = sum(x for (x,) in sizes[:f])
            n = int(lengths[start : start + b].sum())
            ids.append(torch.randint(0, TABLES[FTM[f]][0], (n,), generator=g))
        indices = torch.cat(ids)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        for m in (device, tiered):
            out = m(indices, offsets, batch_size_per_feature_per_rank=sizes)
            (out * upstream_grad(out, step)).sum().backward()
    assert_same(device, tiered)


def test_two_batches_in_flight_train_as_device():
    """Two training forwards before their backwards: the second must not evict the first's
    rows (their updates are not applied yet), and both land as on device."""
    opt = optim.Adagrad(lr=0.5)
    tables, ftm = [(12, 2)], [0]
    device = build(None, "cpu", opt, tables=tables, ftm=ftm)
    tiered = build([Storage(tier="cached", cache_slots=6)], "cpu", opt, tables=tables, ftm=ftm)
    tiered.load_state_dict(device.state_dict())
    batches = [([0, 1, 2], [3, 4]), ([5, 6, 0], [7, 8]), ([9, 10, 11], [1, 2])]
    for a_ids, b_ids in batches:
        outs = {}
        for m in (device, tiered):
            a = m(torch.tensor(a_ids), torch.tensor([0, len(a_ids)]))
            b = m(torch.tensor(b_ids), torch.tensor([0, len(b_ids)]))
            outs[id(m)] = (a, b)
        for m in (device, tiered):
            a, b = outs[id(m)]
            (b * 3).sum().backward()
            (a * 2).sum().backward()
    a, b = device.state_dict(), tiered.state_dict()
    for k in ("weights", "momentum1"):
        assert torch.equal(a[k], b[k]), k


def one_table(slots=3, policy="lru", opt=None):
    return TableBatchedEmbedding([(10, 2)], optimizer=opt or optim.SGD(lr=0.1), backend="cpu",
                                 storage=[Storage(tier="cached", cache_slots=slots,
                                                  policy=policy)])


def step(tbe, ids, backward=True):
    out = tbe(torch.tensor(ids), torch.tensor([0, len(ids)]))
    if backward:
        out.sum().backward()
    return out


def test_lru_evicts_the_unused_oldest_row():
    tbe = one_table()
    step(tbe, [0, 1, 2])
    step(tbe, [2])
    step(tbe, [0, 3])  # full: the victim is the least recent row not in this batch: 1
    assert tbe.resident_rows() == {"table_0": [0, 2, 3]}
    step(tbe, [4, 3])  # 0 and 2 were seen before 3; 2 at step 2, 0 at step 3 -> 2 goes
    assert tbe.resident_rows() == {"table_0": [0, 3, 4]}


def test_lfu_evicts_the_least_used_row():
    tbe = one_table(policy="lfu")
    step(tbe, [0, 1, 2])
    step(tbe, [0, 2])
    step(tbe, [0, 3])  # row 1 was in one batch, 2 in two: 1 goes
    assert tbe.resident_rows() == {"table_0": [0, 2, 3]}


def test_a_row_in_use_is_never_evicted():
    """Rows of training batches whose backward has not run are never victims: a batch that
    would need their slots fails, naming the table and the slots, and their updates still
    land (the same weights as on device without that batch)."""
    opt = optim.Adagrad(lr=0.5)
    device = TableBatchedEmbedding([(10, 2)], optimizer=opt, backend="cpu", seed=2)
    tbe = one_table(opt=opt)
    tbe.load_state_dict(device.state_dict())
    for m in (device, tbe):
        step(m, [0, 1, 2])
        pending = step(m, [0, 1], backward=False)  # its update is not applied yet
        if m is tbe:
            with pytest.raises(ValueError, match=r"table 'table_0' \(tier 'cached'\): 1 of the "
                                                 r"batch's 2 distinct rows found no slot of 3.*"
                                                 r"pinned by training batches"):
                step(tbe, [5, 6])
            assert {0, 1} <= set(tbe.resident_rows()["table_0"])  # row 2 made room for 5
        pending.sum().backward()  # the update lands; 0 and 1 may go now
        step(m, [5, 6])
    assert tbe.resident_rows() == {"table_0": [1, 5, 6]}  # 0: the oldest unused slot
    a, b = device.state_dict(), tbe.state_dict()
    assert torch.equal(a["weights"], b["weights"]) and torch.equal(a["momentum1"], b["momentum1"])


def test_a_freed_graph_releases_its_rows():
    tbe = one_table()
    out = step(tbe, [0, 1, 2], backward=False)
    del out  # no backward will come
    step(tbe, [3, 4, 5])
    assert tbe.resident_rows() == {"table_0": [3, 4, 5]}


def test_eval_does_not_change_state_and_writes_nothing_back():
    tbe = one_table(opt=optim.Adam(lr=0.1))
    step(tbe, [0, 1])
    before = {k: v.clone() for k, v in tbe.state_dict().items() if isinstance(v, torch.Tensor)}
    written = tbe.cache_stats()["table_0"]["writebacks"]
    with torch.no_grad():
        for ids in ([3, 4, 5], [6, 7, 8], [0, 9]):
            step(tbe, ids, backward=False)
    after = tbe.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the state dict flushed the two trained rows: eval evictions write nothing back
    assert tbe.cache_stats()["table_0"]["writebacks"] == written == 2


def test_cache_smaller_than_a_batch():
    tbe = one_table()
    with pytest.raises(ValueError, match=r"table 'table_0' \(tier 'cached'\): a batch reads 4 "
                                         r"distinct rows, its cache has 3 slots"):
        step(tbe, [0, 1, 2, 3, 3])


def test_out_of_range_id():
    tbe = one_table()
    with pytest.raises(ValueError, match=r"feature 'feature_0' of table 'table_0' \(tier "
                                         r"'cached'\): id 10 out of range \[0, 10\)"):
        step(tbe, [1, 10])


def test_training_needs_a_fused_optimizer():
    tbe = TableBatchedEmbedding([(10, 2)], backend="cpu", storage=["cached"])
    with pytest.raises(ValueError, match=r"tables \['table_0'\] \(cached storage tiers\): "
                                         "training needs a fused optimizer"):
        step(tbe, [1], backward=False)
    with torch.no_grad():
        step(tbe, [1], backward=False)  # inference is fine


@pytest.mark.parametrize("kwargs,message", [
    ({"tier": "disk"}, r"storage.tier: expected one of \['device', 'host', 'cached', 'file'\]"),
    ({"tier": "cached", "policy": "fifo"}, r"storage.policy: expected one of \['lru', 'lfu'\]"),
    ({"tier": "cached", "cache_load_factor": 0}, r"storage.cache_load_factor: expected a number in"),
    ({"tier": "cached", "cache_slots": 0}, r"storage.cache_slots: expected an integer >= 1"),
    ({"tier": "file"}, r"storage.path: tier 'file' needs the directory"),
    ({"tier": "cached", "path": "/tmp"}, r"storage.path: only tier 'file' has files"),
])
def test_bad_storage(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Storage(**kwargs)
    with pytest.raises(ValueError, match=r"table 't' " + message):
        storage_of(kwargs, "t")
    with pytest.raises(ValueError, match=r"table 't' storage: unknown keys \['tiers'\]"):
        storage_of({"tiers": "cached"}, "t")


def test_slots():
    assert Storage(tier="cached", cache_load_factor=0.1).slots(95) == 10
    assert Storage(tier="cached", cache_slots=500).slots(95) == 95
    assert Storage(tier="host").slots(95) == 95


def test_unsupported_tier_names_the_backend():
    """(A backend without a tier refuses it at construction: ``tests/ops/test_backends.py``.)"""
    caps = Capabilities(devices=("cpu",))
    assert caps.problems(tiers=["device", "cached", "cached"]) == [
        "storage tier 'cached' (supported: ['device'])"]


def test_file_tier_files(tmp_path):
    folder = tmp_path / "rows"
    tbe = TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu",
                                optimizer=optim.Adam(lr=0.1), seed=1,
                                storage=[Storage(tier="file", path=str(folder), cache_slots=16),
                                         None])
    assert sorted(os.listdir(folder)) == ["table_0.momentum1", "table_0.momentum2",
                                          "table_0.weight"]  # no temporary file left
    E, D = TABLES[0]
    assert os.path.getsize(folder / "table_0.weight") == E * D * 4
    assert os.path.getsize(folder / "table_0.momentum1") == E * D * 4
    indices, offsets, _ = make_batch(TABLES, FTM, 3, 2)
    tbe(indices, offsets).sum().backward()
    tbe.flush()
    on_disk = torch.from_file(str(folder / "table_0.weight"), size=E * D).view(E, D)
    assert torch.equal(on_disk, tbe.split_embedding_weights()[0])
    m1 = torch.from_file(str(folder / "table_0.momentum1"), size=E * D).view(E, D)
    assert torch.equal(m1, tbe.split_optimizer_states()[0][0])
    assert m1.abs().sum() > 0


def test_file_tier_bad_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"table 't' \(tier 'file'\) weight: cannot use "
                                         r"directory .*a_file/rows.* \(2560 bytes needed\)"):
        TableBatchedEmbedding([(64, 10)], backend="cpu", table_names=["t"],
                              storage=[{"tier": "file", "path": str(blocker / "rows")}])

    class Tiny:
        free = 100

    monkeypatch.setattr(tier_backing.shutil, "disk_usage", lambda _: Tiny)
    with pytest.raises(ValueError, match=r"table 't' \(tier 'file'\) weight: .*t.weight' needs "
                                         r"2560 bytes, 100 free on its disk"):
        TableBatchedEmbedding([(64, 10)], backend="cpu", table_names=["t"],
                              storage=[{"tier": "file", "path": str(tmp_path / "ok")}])
    assert not (tmp_path / "ok").exists() or os.listdir(tmp_path / "ok") == []


def test_without_storage_nothing_changes():
    torch.manual_seed(3)
    plain = TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu", seed=3)
    torch.manual_seed(3)
    same = TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu", seed=3,
                                 storage=["device", "host"])  # host: RAM on the CPU
    for m in (plain, same):
        assert not m.tiered and m.cache_stats() == {} and m.resident_rows() == {}
        assert m.slot_tables == m.tables
        assert m.weights.numel() == sum(E * D for E, D in TABLES)
    assert torch.equal(plain.weights, same.weights)


def test_state_dict_round_trips_across_tiers(tmp_path):
    opt = OPTIMIZERS["adam"]
    device = build(None, "cpu", opt)
    cached = build(storage_for("cached", "lru", tmp_path), "cpu", opt)
    train_pair(device, cached)
    filed = build(storage_for("file", "lru", tmp_path), "cpu", opt)
    filed.load_state_dict(cached.state_dict())
    again = build(None, "cpu", opt)
    again.load_state_dict(filed.state_dict())
    assert_same(device, again)
    assert_same(device, filed)
    with pytest.raises(ValueError, match=r"weights: expected 316 elements \(tables "
                                         r"\{'table_0': \(64, 4\), 'table_1': \(20, 3\)\}\), "
                                         r"got 300"):
        filed.load_state_dict({**device.state_dict(), "weights": torch.zeros(300)})
