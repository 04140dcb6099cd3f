"""The slot map of a ``cached`` / ``file`` table (the runtime's ``[E]`` int32 row -> slot
array, ``storage.SLOT_MAP_BYTES`` per row) in the planner's host-memory model: the block
bytes, the plan's host budget check and the tier choice."""

import dataclasses

import pytest
import torch

from fbtriton_dist.modules.tiers import RowCache
from fbtriton_dist.planner import CostModel, ShardingPlanner, TableSpec
from fbtriton_dist.planner.memory import host_block_bytes
from fbtriton_dist.storage import SLOT_MAP_BYTES, Storage

E, D = 10_000, 16
ROW = D * 4 + 4  # fp32 weights + rowwise Adagrad's state
SPEC = TableSpec(name="t", num_embeddings=E, embedding_dim=D, features=("f",))


def on(tier, **kw):
    path = {"path": "/rows"} if tier == "file" else {}
    return dataclasses.replace(SPEC, storage=Storage(tier=tier, **path, **kw))


def test_the_runtime_map_is_what_the_planner_counts():
    cache = RowCache("t", Storage(tier="cached", cache_slots=8), 100, D, torch.float32, False)
    assert cache.slot_of_row.numel() * cache.slot_of_row.element_size() == 100 * SLOT_MAP_BYTES


def test_host_block_bytes_count_the_slot_map():
    opt = "rowwise_adagrad"
    assert host_block_bytes(SPEC, 600, D, opt) == 0  # device
    assert host_block_bytes(on("host"), 600, D, opt) == 600 * ROW  # no cache, no map
    assert host_block_bytes(on("cached"), 600, D, opt) == 600 * ROW + 600 * SLOT_MAP_BYTES
    assert host_block_bytes(on("file"), 600, D, opt) == 600 * SLOT_MAP_BYTES  # rows on disk


def test_host_budget_check_counts_the_slot_map():
    p = ShardingPlanner(world_size=1, hbm_bytes_per_rank=1e6, reserved_fraction=0.0)
    spec = on("file", cache_load_factor=0.1)
    plan = p.plan([spec])
    plan.validate([spec], host_budget_bytes=E * SLOT_MAP_BYTES)
    with pytest.raises(ValueError, match=r"rank 0 needs 39.1 KiB of host memory, budget "
                                         r"39.1 KiB: 't' rows 0..10000"):
        plan.validate([spec], host_budget_bytes=E * SLOT_MAP_BYTES - 1)


def test_tier_choice_counts_the_slot_map():
    # one rank; the table is 680,000 B with its state, + 40,000 B of slot map: 700,000 B of
    # host memory hold the rows but not the map as well, so it goes to a file
    kw = {"world_size": 1, "hbm_bytes_per_rank": 100_000, "reserved_fraction": 0.0,
          "cost_model": CostModel(batch_size=64), "file_dir": "/rows"}
    auto = dataclasses.replace(SPEC, auto_storage=True)
    both = E * ROW + E * SLOT_MAP_BYTES
    assert ShardingPlanner(host_bytes_per_rank=both, **kw).plan([auto]).tables[0].storage.tier \
        == "cached"
    short = ShardingPlanner(host_bytes_per_rank=both - 1, **kw).plan([auto])
    assert short.tables[0].storage.tier == "file"
    with pytest.raises(ValueError, match=r"fits no tier: .*a slot map of 39.1 KiB; 9.8 KiB left"):
        ShardingPlanner(host_bytes_per_rank=10_000, **kw).plan([auto])
