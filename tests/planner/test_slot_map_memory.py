"""The slot map of a ``cached`` / ``file`` table (the runtime's ``[E]`` int32 row -> slot
array, ``storage.SLOT_MAP_BYTES`` per row) where the planner counts it: a ``file`` table's in
host memory, a ``cached`` table's on the device with its per-slot bookkeeping
(``storage.SLOT_BYTES_ON_DEVICE``), as the runtime keeps them on a CUDA rank: the block bytes,
the plan's budget checks and the tier choice."""

import dataclasses

import pytest
import torch

from fbtriton_dist.modules import tier_device_map
from fbtriton_dist.modules.tiers import RowCache
from fbtriton_dist.planner import CostModel, ShardingPlanner, TableSpec
from fbtriton_dist.planner.memory import block_bytes, host_block_bytes
from fbtriton_dist.storage import SLOT_BYTES_ON_DEVICE, SLOT_MAP_BYTES, Storage

E, D = 10_000, 16
ROW = D * 4 + 4  # fp32 weights + rowwise Adagrad's state
SPEC = TableSpec(name="t", num_embeddings=E, embedding_dim=D, features=("f",))


def on(tier, **kw):
    path = {"path": "/rows"} if tier == "file" else {}
    return dataclasses.replace(SPEC, storage=Storage(tier=tier, **path, **kw))


def test_the_runtime_map_is_what_the_planner_counts():
    cache = RowCache("t", Storage(tier="cached", cache_slots=8), 100, D, torch.float32, False)
    assert cache.slot_of_row.numel() * cache.slot_of_row.element_size() == 100 * SLOT_MAP_BYTES


def test_the_device_map_is_what_the_planner_counts():
    """Every ``[S]`` and ``[sum(E)]`` tensor of the device maps of two tables: their bytes are
    what ``Storage.device_map_bytes`` counts."""
    caches = {t: RowCache(f"t{t}", Storage(tier="cached", cache_slots=c), e, D, torch.float32,
                          False) for t, (e, c) in enumerate(((100, 8), (60, 5)))}
    maps = tier_device_map.DeviceMaps(caches, torch.device("cpu"))
    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()  # views: once
                for v in vars(maps).values()
                if isinstance(v, torch.Tensor) and v.dim() and v.shape[-1] in (13, 160)}
    held = sum(storages.values())
    st = Storage(tier="cached")
    assert held == st.device_map_bytes(160, 13) == 160 * SLOT_MAP_BYTES + 13 * SLOT_BYTES_ON_DEVICE


def test_each_map_counts_where_it_lives():
    """``cached``: the map and the slots' bookkeeping in device memory, none on the host;
    ``file``: the map on the host, nothing more on the device than its cache."""
    opt = "rowwise_adagrad"
    assert host_block_bytes(SPEC, 600, D, opt) == 0  # device
    assert block_bytes(SPEC, 600, D, opt) == 600 * ROW
    assert host_block_bytes(on("host"), 600, D, opt) == 600 * ROW  # no cache, no map
    assert block_bytes(on("host"), 600, D, opt) == 0
    assert host_block_bytes(on("cached"), 600, D, opt) == 600 * ROW  # rows, no map
    assert block_bytes(on("cached"), 600, D, opt) == 120 * ROW + 600 * SLOT_MAP_BYTES \
        + 120 * SLOT_BYTES_ON_DEVICE
    assert host_block_bytes(on("file"), 600, D, opt) == 600 * SLOT_MAP_BYTES  # rows on disk
    assert block_bytes(on("file"), 600, D, opt) == 120 * ROW


def test_budget_checks_count_each_map_where_it_lives():
    p = ShardingPlanner(world_size=1, hbm_bytes_per_rank=1e6, reserved_fraction=0.0)
    spec = on("file", cache_load_factor=0.1)
    plan = p.plan([spec])
    plan.validate([spec], host_budget_bytes=E * SLOT_MAP_BYTES, budget_bytes=1000 * ROW)
    with pytest.raises(ValueError, match=r"rank 0 needs 39.1 KiB of host memory, budget "
                                         r"39.1 KiB: 't' rows 0..10000"):
        plan.validate([spec], host_budget_bytes=E * SLOT_MAP_BYTES - 1)
    # the same table cached: the map and 1,000 slots' bookkeeping on the device, not the host
    spec = on("cached", cache_load_factor=0.1)
    plan = p.plan([spec])
    device = 1000 * ROW + E * SLOT_MAP_BYTES + 1000 * SLOT_BYTES_ON_DEVICE
    plan.validate([spec], host_budget_bytes=E * ROW, budget_bytes=device)
    with pytest.raises(ValueError, match=r"rank 0 needs 142.6 KiB, budget 142.6 KiB: table 't' "
                                         r".* \+ slot map 76.2 KiB \(4 B x 10000 rows \+ 38 B x "
                                         r"1000 slots\) = 142.6 KiB"):
        plan.validate([spec], budget_bytes=device - 1)


def test_tier_choice_counts_each_map_where_it_lives():
    # one rank; the table is 680,000 B with its state: 'cached' needs only that much host
    # memory (its map on the device), 'file' its map of 40,000 B there
    kw = {"world_size": 1, "hbm_bytes_per_rank": 100_000, "reserved_fraction": 0.0,
          "cost_model": CostModel(batch_size=64), "file_dir": "/rows"}
    auto = dataclasses.replace(SPEC, auto_storage=True)
    cached = ShardingPlanner(host_bytes_per_rank=E * ROW, **kw).plan([auto])
    assert cached.tables[0].storage.tier == "cached"
    short = ShardingPlanner(host_bytes_per_rank=E * ROW - 1, **kw).plan([auto])
    assert short.tables[0].storage.tier == "file"
    with pytest.raises(ValueError, match=r"fits no tier: .*and a slot map of 39.1 KiB in host "
                                         r"memory"):
        ShardingPlanner(host_bytes_per_rank=10_000, **kw).plan([auto])
    # the device side: the caches' room counts the map (4 B per row + 38 B per slot)
    f = cached.tables[0].storage.cache_load_factor
    assert f * E * (ROW + SLOT_BYTES_ON_DEVICE) + E * SLOT_MAP_BYTES <= 0.95 * 100_000
