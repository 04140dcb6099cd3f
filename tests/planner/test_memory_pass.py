"""The memory pass (planner/balance.py): once time is balanced, the fullest rank's memory comes
down, the step time stays within ``memory_tolerance``, budgets and equal-cut guarantee hold."""

import pathlib

import numpy as np
import pytest

from fbtriton_dist.planner import (
    IdDistribution,
    ShardingPlanner,
    TableConstraints,
    TableSpec,
    load_tables,
)
from fbtriton_dist.planner.balance import balance_memory
from fbtriton_dist.planner.cost import Blocks, CostAccumulator
from fbtriton_dist.planner.planner import _Draft

GiB = 1024**3
CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tables"
ZIPF = IdDistribution(kind="zipf", alpha=1.1)


def criteo_zipf():
    ts = load_tables(CONFIGS / "criteo_terabyte.yaml")
    return ts, {t.name: ZIPF for t in ts.tables}


def plan_and_cost(p, ts, stats):
    plan = p.plan(ts.tables, ts.constraints, stats)
    plan.validate(ts.tables, budget_bytes=p.budget_bytes, optimizer=p.optimizer)
    return plan, p.cost(plan, ts.tables, stats)


@pytest.mark.parametrize(("R", "H", "at_most"), [(8, 8, 0.85), (64, 8, 0.4)])
def test_memory_comes_down_within_the_step_tolerance(R, H, at_most):
    """Criteo, Zipf(1.1): skew-aware cuts leave a table's long cold block on one rank (64
    ranks: 19 GiB against a mean of 1.4 GiB, max/mean 13.4); the pass cuts it to a fraction,
    the step time rises by at most the tolerance, the plan is valid and within budget."""
    ts, stats = criteo_zipf()
    before_plan, before = plan_and_cost(
        ShardingPlanner(world_size=R, local_world_size=H, balance_memory=False), ts, stats)
    p = ShardingPlanner(world_size=R, local_world_size=H)
    after_plan, after = plan_and_cost(p, ts, stats)
    assert after.imbalance("memory_bytes") < at_most * before.imbalance("memory_bytes")
    assert after.max() <= before.max() * (1 + p.memory_tolerance) + 1e-12
    assert after.max("memory_bytes") <= p.budget_bytes
    # where memory sits changed, hardly how much (a column slice more keeps its own rowwise
    # Adagrad state for every row: +0.7 % at 64 ranks)
    total = sum(r.memory_bytes for r in after.ranks)
    assert total == pytest.approx(sum(r.memory_bytes for r in before.ranks), rel=0.02)


def test_zero_tolerance_keeps_the_step_time():
    """``memory_tolerance=0`` takes only moves that leave the slowest rank where it was (Criteo
    at 64 ranks still comes down from 13.4: the cold block's rank is not the slowest)."""
    ts, stats = criteo_zipf()
    _, before = plan_and_cost(
        ShardingPlanner(world_size=64, local_world_size=8, balance_memory=False), ts, stats)
    _, after = plan_and_cost(
        ShardingPlanner(world_size=64, local_world_size=8, memory_tolerance=0.0), ts, stats)
    assert after.max() <= before.max() + 1e-8
    assert after.imbalance("memory_bytes") < 0.5 * before.imbalance("memory_bytes")


@pytest.mark.parametrize(("R", "H"), [(8, None), (64, 8)])
def test_still_never_worse_than_equal_blocks(R, H):
    """The pass may spend ``memory_tolerance`` of step time, but never past the plan with equal
    row blocks (which gets its own memory pass)."""
    ts, stats = criteo_zipf()
    ours = ShardingPlanner(world_size=R, local_world_size=H, memory_tolerance=0.5)
    equal = ShardingPlanner(world_size=R, local_world_size=H, row_cuts="equal",
                            memory_tolerance=0.5)
    mine = ours.cost(ours.plan(ts.tables, ts.constraints, stats), ts.tables, stats)
    theirs = ours.cost(equal.plan(ts.tables, ts.constraints, stats), ts.tables, stats)
    assert mine.max() <= theirs.max() * (1 + 1e-9), (mine.max(), theirs.max())


def test_a_tight_budget_is_kept():
    """Near-full ranks: every cap the pass tries stays at or under the budget."""
    big = TableSpec(name="big", num_embeddings=40_000_000, embedding_dim=128,
                    features=("big_f",), pooling_factors=(20.0,))
    small = [TableSpec(name=f"s{i}", num_embeddings=100_000, embedding_dim=64,
                       features=(f"s{i}_f",), pooling_factors=(2.0,)) for i in range(6)]
    tables = [big, *small]
    need = 40_000_000 * (128 * 4 + 4) + 6 * 100_000 * (64 * 4 + 4)
    p = ShardingPlanner(world_size=4, hbm_bytes_per_rank=need / 4 * 1.05,
                        reserved_fraction=0.0)
    stats = {"big": ZIPF}
    plan = p.plan(tables, {"big": TableConstraints(sharding=("row_wise",))}, stats)
    plan.validate(tables, budget_bytes=p.budget_bytes, optimizer=p.optimizer)


def spec(name, E):
    return TableSpec(name=name, num_embeddings=E, embedding_dim=64, features=(f"{name}_f",),
                     pooling_factors=(1.0,))


def test_a_trade_when_no_table_can_move_alone():
    """Two ranks at the same time, one holding both big tables: moving either alone would make
    the other rank the slowest, trading a big table for a small one keeps both times."""
    tables = [spec("a", 10_000_000), spec("c", 10_000_000), spec("b", 1000), spec("d", 1000)]
    p = ShardingPlanner(world_size=2)
    acc = CostAccumulator(2, 2, p.cost_model)
    choices = []
    for t, r in zip(tables, (0, 0, 1, 1), strict=True):
        blocks = Blocks.make(r, 0, t.num_embeddings, 0, 64)
        acc.add_blocks(t, "table_wise", blocks, IdDistribution(), p.optimizer)
        choices.append(("table_wise", blocks))
    draft = _Draft(frozenset(), [t.name for t in tables], choices, None, acc)
    assert draft.times()[0] == pytest.approx(draft.times()[1])
    cons = {t.name: TableConstraints(sharding=("table_wise",)) for t in tables}
    out = balance_memory(p, draft, tables, cons, {}, draft.step())
    mem = out.acc.memories()
    assert mem.max() / mem.mean() < 1.01 < acc.memories().max() / acc.memories().mean()
    assert out.step() <= draft.step() + 1e-12
    assert sorted(int(b.rank[0]) for _, b in out.choices[:2]) == [0, 1]  # a and c apart
    assert np.array_equal(draft.acc.values, acc.values)  # the input draft is unchanged


def test_knob_errors():
    with pytest.raises(ValueError, match="memory_tolerance: expected a number >= 0"):
        ShardingPlanner(world_size=2, memory_tolerance=-0.1)
    with pytest.raises(ValueError, match="balance_memory: expected a bool, got 'yes'"):
        ShardingPlanner(world_size=2, balance_memory="yes")


def test_sixteen_ranks_four_per_host():
    """Criteo at 16 ranks, 4 per host, Zipf(1.1): the step time is set by the ranks of the
    hot rows of the 100-ids table, and moving a 4.7 GiB column slice of a 40M-row table onto
    them costs 4 % of the step, so the default 1 % keeps memory at 1.81 (the step does not
    move); a 3 % tolerance evens memory out (1.27) and, here, even finds a faster step."""
    ts, stats = criteo_zipf()
    _, before = plan_and_cost(
        ShardingPlanner(world_size=16, local_world_size=4, balance_memory=False), ts, stats)
    _, default = plan_and_cost(ShardingPlanner(world_size=16, local_world_size=4), ts, stats)
    p = ShardingPlanner(world_size=16, local_world_size=4, memory_tolerance=0.03)
    _, loose = plan_and_cost(p, ts, stats)
    assert default.max() <= before.max() * 1.01 + 1e-12
    assert default.imbalance("memory_bytes") <= before.imbalance("memory_bytes") + 1e-9
    assert loose.max() <= before.max() * 1.03 + 1e-12
    assert loose.imbalance("memory_bytes") < 1.4 < before.imbalance("memory_bytes")


def test_a_larger_tolerance_spends_no_step_time_for_nothing():
    """Criteo at 64 ranks: every cheaper-memory placement of the 4.9 GiB column slices costs
    over 5 % of the step, so tolerances of 2 % and 5 % reach the same memory as 1 % and must
    not be slower (the pass re-places the slowest rank's tables at the memory it reached)."""
    ts, stats = criteo_zipf()
    base = ShardingPlanner(world_size=64, local_world_size=8)
    _, ref = plan_and_cost(base, ts, stats)
    for tol in (0.02, 0.05):
        p = ShardingPlanner(world_size=64, local_world_size=8, memory_tolerance=tol)
        _, got = plan_and_cost(p, ts, stats)
        if got.max("memory_bytes") >= ref.max("memory_bytes") * (1 - 1e-9):
            assert got.max() <= ref.max() * (1 + 1e-9), (tol, got.max(), ref.max())
