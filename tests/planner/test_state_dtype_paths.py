"""Every part of the planner prices a table's optimizer state in its ``state_dtype``
(``memory.table_state_bytes``): the cost model, the memory pass, replica groups' averaging,
the tier choice and the caches' traffic. One test per path: a bf16-state table plans with the
smaller footprint (Adam, D = 16: a row is 64 B of weights + 128 B of fp32 moments, 64 B in
bf16)."""

import dataclasses

import numpy as np
import pytest

from fbtriton_dist.planner import (
    IdDistribution,
    Shard,
    ShardingPlan,
    TableSharding,
    TableSpec,
    evaluate,
    evaluate_grouped,
)
from fbtriton_dist.planner.balance import blocks_bytes
from fbtriton_dist.planner.cache_model import block_traffic
from fbtriton_dist.planner.cost import Blocks, CostModel
from fbtriton_dist.planner.tier_choice import TierBudgets, choose_tiers
from fbtriton_dist.storage import Storage

E, D = 1000, 16
WEIGHTS = E * D * 4
STATE = {"fp32": E * 2 * D * 4, "bf16": E * 2 * D * 2}  # Adam's two [E, D] moments
FP32 = TableSpec(name="t", num_embeddings=E, embedding_dim=D, features=("f",))
BF16 = dataclasses.replace(FP32, state_dtype="bf16")


def one_shard(world=1, group=None, sync="step"):
    shards = tuple(Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D)
                   for r in range(1 if group is None else world // group))
    ts = TableSharding(name="t", sharding="table_wise", num_embeddings=E, embedding_dim=D,
                       shards=shards[:1])
    if group is None:
        return ShardingPlan(world_size=world, local_world_size=world, tables=(ts,))
    return ShardingPlan(world_size=world, local_world_size=world, tables=(ts,),
                        group_size=group, replica_sync=sync)


def test_cost_model():
    for spec, dtype in ((FP32, "fp32"), (BF16, "bf16")):
        rank = evaluate(one_shard(), [spec], optimizer="adam").ranks[0]
        assert (rank.weight_bytes, rank.state_bytes) == (WEIGHTS, STATE[dtype])


def test_memory_pass():
    blocks = Blocks.make([0, 1], [0, 600], [600, E], 0, D)
    rows = np.array([600, 400])
    assert blocks_bytes(FP32, blocks, "adam").tolist() == (rows * D * 12).tolist()
    assert blocks_bytes(BF16, blocks, "adam").tolist() == (rows * D * 8).tolist()
    cached = dataclasses.replace(BF16, storage=Storage(tier="cached", cache_slots=100))
    # its slots, and its slot map on the device: 4 B per row, 38 B per slot
    assert blocks_bytes(cached, blocks, "adam").tolist() == (
        100 * D * 8 + rows * 4 + 100 * 38).tolist()


def test_replica_group_averaging():
    # 2 groups of 1 rank, weights and state averaged every 5 steps: a ring all-reduce of both
    for spec, dtype in ((FP32, "fp32"), (BF16, "bf16")):
        cost = evaluate_grouped(one_shard(world=2, group=1, sync=5), [spec],
                                model=CostModel(batch_size=4), optimizer="adam")
        want = 2 * (2 - 1) / 2 * (WEIGHTS + STATE[dtype]) / 5
        assert cost.collectives["replica_sync.average"][0] == pytest.approx(want)


def test_tier_choice():
    # one rank, 150,000 B of device: 0.95 x 150,000 holds 128,000 B (bf16 state), not 192,000
    budgets = TierBudgets(world_size=1, device_bytes=150_000)

    def chosen(spec):
        return choose_tiers([dataclasses.replace(spec, auto_storage=True)], None, budgets,
                            {"t"}, "adam", batch_size=4)[0].storage

    assert chosen(BF16) is None  # device
    fp32 = chosen(FP32)
    assert fp32.tier == "cached"
    assert fp32.cache_load_factor * E * 192 <= 0.95 * 150_000


def test_cache_traffic():
    def moved(spec):
        spec = dataclasses.replace(spec, storage=Storage(tier="cached", cache_slots=200))
        out, summary = block_traffic(spec, IdDistribution(kind="zipf", alpha=1.1), 64.0,
                                     np.array([0]), np.array([E]), np.array([D]), "adam")
        assert out[0] == pytest.approx(summary.bytes) and summary.fits
        return summary.bytes, summary.misses

    (fp32, misses), (bf16, misses_bf16) = moved(FP32), moved(BF16)
    assert misses == misses_bf16 > 0
    # every miss: its row and state in, a dirty row and state out
    assert fp32 == pytest.approx(2 * misses * (D * 4 + 2 * D * 4))
    assert bf16 == pytest.approx(2 * misses * (D * 4 + 2 * D * 2))
