"""Replica groups (``planner/groups.py``): the grouped plan's cost against hand counts, flat
as group size R, wire formats, the plan's YAML, ``auto``, the simulation, bad inputs."""

import dataclasses
import math
import pathlib

import pytest
import yaml

from fbtriton_dist.bench import simulate  # our own module: an import error fails, never skips
from fbtriton_dist.cli import main
from fbtriton_dist.planner import (
    CostModel,
    IdDistribution,
    PlanError,
    Shard,
    ShardingPlan,
    ShardingPlanner,
    TableSharding,
    TableSpec,
    evaluate,
    evaluate_grouped,
    plan_grouped,
    propose_group_size,
)
from fbtriton_dist.planner._yaml import ConfigError
from fbtriton_dist.planner.groups import (
    expected_unique_rows,
    group_planner,
    group_size_candidates,
    hot_row_bound,
)

CRITEO = str(pathlib.Path(__file__).resolve().parents[2] / "configs/tables/criteo_terabyte.yaml")


def tiny():
    """Table a (8 x 4, L=1) table-wise on local rank 0; b (6 x 4, L=2) row-wise 3 + 3 rows."""
    tables = [TableSpec(name="a", num_embeddings=8, embedding_dim=4, features=("fa",)),
              TableSpec(name="b", num_embeddings=6, embedding_dim=4, features=("fb",),
                        pooling_factors=(2.0,))]
    shardings = (
        TableSharding(name="a", sharding="table_wise", num_embeddings=8, embedding_dim=4,
                      shards=(Shard(rank=0, row_start=0, row_end=8, col_start=0, col_end=4),)),
        TableSharding(name="b", sharding="row_wise", num_embeddings=6, embedding_dim=4,
                      shards=(Shard(rank=0, row_start=0, row_end=3, col_start=0, col_end=4),
                              Shard(rank=1, row_start=3, row_end=6, col_start=0, col_end=4))))
    return tables, shardings


def grouped(shardings, world=4, group=2, hosts=2, sync="step"):
    return ShardingPlan(world_size=world, local_world_size=hosts, tables=shardings,
                        group_size=group, replica_sync=sync)


def test_grouped_collectives_equal_a_hand_count():
    tables, shardings = tiny()
    B = 2
    model = CostModel(batch_size=B)
    cost = evaluate_grouped(grouped(shardings), tables, model=model)
    G, c = 2, 4
    # in the group (2 ranks): rank 1 gets its pooled slice of a from rank 0 and of b's block
    # on rank 0; rank 0 the gradients of rank 1's samples of a and of b's block
    fwd, bwd = cost.collectives["output_dist.forward"], cost.collectives["output_dist.backward"]
    assert fwd == (B * c * 4, 2 * B * c * 4)  # rank 0: b's slice from 1; rank 1: a and b
    assert bwd == (2 * B * c * 4, B * c * 4)
    assert cost.collectives["input_dist.data"][1] == B * (2 * 0.5 * 4 + 4)  # b: p = 1/2
    # the sync: distinct rows of G-1 = 1 other replica, fp32 values + an int32 id each
    ua = 8 * (1 - (7 / 8) ** (2 * B * 1))  # 4 draws of table a, uniform
    ub = 3 * (1 - (5 / 6) ** (2 * B * 2))  # 8 draws of table b, 3 of its rows per block
    sparse = cost.collectives["replica_sync.sparse_all_gather"]
    assert sparse[0] == pytest.approx((G - 1) * (ua + ub) * (c * 4 + 4))
    assert sparse[1] == pytest.approx((G - 1) * ub * (c * 4 + 4))
    # whole hosts per group: every replica on another host, at the inter-host bandwidth
    group = evaluate(grouped(shardings).group_plan(), tables, model=model)
    for q in (0, 1):
        assert cost.sync_inter_host_bytes[q] == sparse[q]
        assert cost.time_s[q] == pytest.approx(group.ranks[q].time_s
                                               + sparse[q] / model.inter_host_bandwidth)
    # every N steps: the ring all-reduce of weights + rowwise state, divided by N
    every = evaluate_grouped(grouped(shardings, sync=5), tables, model=model)
    held = [8 * 4 * 4 + 8 * 4 + 3 * 4 * 4 + 3 * 4, 3 * 4 * 4 + 3 * 4]
    assert every.collectives["replica_sync.average"] == pytest.approx(
        tuple(2 * (G - 1) / G * h / 5 for h in held))
    # a group inside a host: of the 3 other replicas, one shares the host
    inside = evaluate_grouped(grouped(shardings, world=8, group=2, hosts=4), tables,
                              model=model)
    assert inside.sync_inter_host_bytes[1] == pytest.approx(inside.sync_bytes[1] * 2 / 3)


def test_flat_is_group_size_r():
    tables = [TableSpec(name=f"t{i}", num_embeddings=10_000 * (i + 1), embedding_dim=64,
                        features=(f"f{i}",), pooling_factors=(float(i + 1),)) for i in range(5)]
    stats = {"t0": IdDistribution(kind="zipf", alpha=1.1)}
    model = CostModel.with_wire("bf16", batch_size=64)
    planner = ShardingPlanner(world_size=16, local_world_size=8, cost_model=model)
    plan = planner.plan(tables, None, stats)
    flat = evaluate(plan, tables, stats, model, collectives=True)
    as_groups = evaluate_grouped(dataclasses.replace(plan, group_size=16), tables, stats, model)
    assert as_groups.as_plan_cost() == flat
    assert as_groups.syncs == () and max(as_groups.sync_bytes) == 0.0
    with pytest.raises(ValueError, match="expected a flat plan"):
        evaluate(dataclasses.replace(plan, group_size=8), tables, stats, model)


@pytest.mark.parametrize("wire,per_value,per_row", [("fp32", 4, 0), ("bf16", 2, 0),
                                                     ("fp16", 2, 0), ("fp8", 1, 4),
                                                     ("int8", 1, 8)])
def test_wire_formats_scale_the_output_dist_not_the_sync(wire, per_value, per_row):
    tables, shardings = tiny()
    model = CostModel.with_wire(wire, batch_size=2)
    cost = evaluate_grouped(grouped(shardings), tables, model=model)
    base = evaluate_grouped(grouped(shardings), tables, model=CostModel(batch_size=2))
    assert cost.collectives["output_dist.forward"][1] == 2 * 2 * (4 * per_value + per_row)
    assert cost.collectives["output_dist.backward"][0] == 2 * 2 * (4 * per_value + per_row)
    assert cost.collectives["input_dist.data"] == base.collectives["input_dist.data"]
    assert cost.sync_bytes == base.sync_bytes  # ids and fp32 row gradients, whatever the wire


@pytest.mark.parametrize("fmt,per_value,per_row", [("fp32", 4, 0), ("bf16", 2, 0),
                                                    ("fp8", 1, 4), ("int8", 1, 8)])
def test_replica_sync_dtype_sets_the_bytes_of_the_average(fmt, per_value, per_row):
    """Every N steps: the weights' rows in the format (values + row scales), the rowwise
    state fp32, a data-parallel table's copies averaged too (its gradients stay in the
    group); ``step``: fp32 row gradients whatever the format."""
    tables, shardings = tiny()
    tables.append(TableSpec(name="d", num_embeddings=5, embedding_dim=2, features=("fd",)))
    shardings += (TableSharding(name="d", sharding="data_parallel", num_embeddings=5,
                                embedding_dim=2, shards=tuple(
                                    Shard(rank=r, row_start=0, row_end=5, col_start=0, col_end=2)
                                    for r in (0, 1))),)
    model = CostModel(batch_size=2, replica_sync_dtype=fmt)
    every = evaluate_grouped(grouped(shardings, sync=5), tables, model=model)
    G, row = 2, 4 * per_value + per_row  # a row of a and b: 4 values
    d = 5 * (2 * per_value + per_row) + 5 * 4
    held = [8 * row + 8 * 4 + 3 * row + 3 * 4 + d, 3 * row + 3 * 4 + d]
    assert every.collectives["replica_sync.average"] == pytest.approx(
        tuple(2 * (G - 1) / G * h / 5 for h in held))
    assert every.collectives["data_parallel.grad_all_gather"] == (2 * 2 * 4,) * 2  # S - 1 = 1
    sim = simulate.simulate_grouped(grouped(shardings, sync=5), tables, None, batch_size=2,
                                    estimate=every, replica_sync_dtype=fmt)
    errors = simulate.max_collective_errors(sim, every.as_plan_cost())
    assert errors["replica_sync.average"] == pytest.approx(0.0, abs=1e-9), errors
    fp32 = CostModel(batch_size=2)
    step = evaluate_grouped(grouped(shardings), tables, model=model)
    assert step.sync_bytes == evaluate_grouped(grouped(shardings), tables, model=fp32).sync_bytes
    assert step.collectives["data_parallel.grad_all_gather"] == (3 * 2 * 2 * 4,) * 2  # R - 1
    # the search charges a held weight byte the format's share of fp32's
    planner = ShardingPlanner(world_size=4, local_world_size=2, cost_model=model)
    sub = group_planner(planner, 2, 5).cost_model
    assert sub.held_weight_byte_seconds == pytest.approx(sub.held_byte_seconds * per_value / 4)
    assert sub.held_byte_seconds > 0
    with pytest.raises(ValueError, match=r"replica_sync_dtype: expected one of .*int8.*'fp4'"):
        CostModel(replica_sync_dtype="fp4")


def test_yaml_round_trip_and_old_plans(tmp_path):
    tables, shardings = tiny()
    plan = grouped(shardings, world=8, group=2, sync=10)
    path = tmp_path / "p.yaml"
    plan.save_yaml(path, header="grouped")
    text = path.read_text()
    assert "group_size: 2\nreplica_sync: 10\n" in text
    assert yaml.safe_load(text) == plan.to_dict()
    loaded = ShardingPlan.load_yaml(path)
    assert loaded == plan and loaded.num_groups == 4
    assert loaded.shards_for_rank(7) == plan.shards_for_rank(1)
    loaded.validate(tables)
    old = tmp_path / "old.yaml"
    flat = ShardingPlan(world_size=2, local_world_size=2, tables=shardings)
    flat.save_yaml(old)
    assert "group_size" not in old.read_text()
    again = ShardingPlan.load_yaml(old)
    assert again.group_size is None and again.group_world == 2 and again.group_plan() is again
    for key, value, message in [
            ("group_size", 3, "group_size: expected a divisor of world_size=8 "
                              "(1 <= group_size <= 8), got 3"),
            ("group_size", 0, "group_size: expected an integer >= 1, got 0"),
            ("group_size", 16, "expected a divisor of world_size=8"),
            ("replica_sync", 0, "replica_sync: expected 'step' or an integer >= 1"),
            ("replica_sync", "often", "replica_sync: expected 'step' or an integer >= 1")]:
        data = plan.to_dict() | {key: value}
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ShardingPlan.from_dict(data, "x.yaml")


def small_set():
    return [TableSpec(name=f"t{i}", num_embeddings=200_000, embedding_dim=64,
                      features=(f"f{i}",), pooling_factors=(float(1 + 3 * i),))
            for i in range(4)]


def test_auto_picks_the_fastest_that_fits():
    tables = small_set()
    stats = {t.name: IdDistribution(kind="zipf", alpha=1.1) for t in tables}
    need = sum(t.num_embeddings * (64 * 4 + 4) for t in tables)  # weights + rowwise state
    # room for the tables on 16 ranks of a group, not on 8
    hbm = need / 12 / 0.9
    planner = ShardingPlanner(world_size=32, local_world_size=8, hbm_bytes_per_rank=hbm,
                              cost_model=CostModel(batch_size=64), balance_memory=False)
    assert group_size_candidates(32, 8) == [8, 16, 32]
    proposal = propose_group_size(planner, tables, None, stats, replica_sync=50)
    by_size = {c.group_size: c for c in proposal.candidates}
    assert by_size[8].step_s is None and "need" in by_size[8].reason
    fits = [c for c in proposal.candidates if c.step_s is not None]
    assert {c.group_size for c in fits} == {16, 32}
    best = min(fits, key=lambda c: c.step_s)
    assert proposal.group_size == best.group_size
    assert proposal.plan.group_size == best.group_size and proposal.plan.replica_sync == 50
    assert proposal.cost.step_s == pytest.approx(best.step_s)
    with pytest.raises(PlanError, match="no group size in \\[8\\] fits"):
        propose_group_size(planner, tables, None, stats, candidates=[8])


def test_simulation_agrees_per_collective():
    tables = small_set()[:3]
    stats = {t.name: IdDistribution(kind="zipf", alpha=1.1) for t in tables}
    model = CostModel.with_wire("fp8", batch_size=32)
    planner = ShardingPlanner(world_size=16, local_world_size=4, cost_model=model)
    plan = plan_grouped(planner, tables, None, stats, group_size=4)
    cost = evaluate_grouped(plan, tables, stats, model)
    assert cost.collectives["replica_sync.sparse_all_gather"][0] > 0
    sim = simulate.simulate_grouped(plan, tables, stats, batch_size=32, estimate=cost,
                                    wire=model.wire())
    errors = simulate.max_collective_errors(sim, cost.as_plan_cost())
    assert "replica_sync.sparse_all_gather" in errors
    assert max(errors.values()) < 0.10, errors
    # the estimate of distinct rows is what it says: a wrong count of draws is caught
    wrong = dataclasses.replace(cost, collectives={
        **cost.collectives, "replica_sync.sparse_all_gather": tuple(
            2 * x for x in cost.collectives["replica_sync.sparse_all_gather"])})
    assert simulate.max_collective_errors(sim, wrong.as_plan_cost())[
        "replica_sync.sparse_all_gather"] > 0.5


def test_simulation_of_a_table_with_both_step_collectives():
    """A hot block all-reduces its dense gradient (cheaper than its distinct rows from 3
    replicas), the cold block of the same table all-gathers its distinct rows."""
    table = TableSpec(name="c", num_embeddings=1000, embedding_dim=4, features=("fc",),
                      pooling_factors=(4.0,))
    stats = {"c": IdDistribution(kind="zipf", alpha=1.1)}
    shards = (Shard(rank=0, row_start=0, row_end=10, col_start=0, col_end=4),
              Shard(rank=1, row_start=10, row_end=1000, col_start=0, col_end=4))
    # and a data-parallel table: no replica sync, its gradients all-gathered over all 8 ranks
    replicated = TableSpec(name="d", num_embeddings=5, embedding_dim=4, features=("fd",))
    replicas = tuple(Shard(rank=r, row_start=0, row_end=5, col_start=0, col_end=4)
                     for r in (0, 1))
    plan = grouped((TableSharding(name="c", sharding="row_wise", num_embeddings=1000,
                                  embedding_dim=4, shards=shards),
                    TableSharding(name="d", sharding="data_parallel", num_embeddings=5,
                                  embedding_dim=4, shards=replicas)), world=8, group=2)
    model = CostModel(batch_size=64)
    cost = evaluate_grouped(plan, [table, replicated], stats, model)
    assert [x.collective for x in cost.syncs] == ["replica_sync.all_reduce",
                                                  "replica_sync.sparse_all_gather"]
    assert cost.collectives["replica_sync.all_reduce"] == (2 * 3 / 4 * 10 * 4 * 4, 0.0)
    assert cost.collectives["data_parallel.grad_all_gather"] == (7 * 64 * 4 * 4,) * 2
    sim = simulate.simulate_grouped(plan, [table, replicated], stats, batch_size=64,
                                    estimate=cost, sync_groups=4)
    errors = simulate.max_collective_errors(sim, cost.as_plan_cost())
    assert max(errors.values()) < 0.10, errors


def test_expected_unique_rows_buckets_match_the_exact_sum():
    dist = IdDistribution(kind="zipf", alpha=1.1)
    E, n = 20_000, 8_000
    got = expected_unique_rows(dist, E, n, [0, 100, 3000], [100, 3000, E])
    exact = []
    for a, b in [(0, 100), (100, 3000), (3000, E)]:
        exact.append(sum(1 - (1 - dist.fraction(E, r, r + 1)) ** n for r in range(a, b)))
    assert got == pytest.approx(exact, rel=1e-3)
    assert expected_unique_rows(IdDistribution(), 10, 5, [0], [10])[0] == pytest.approx(
        10 * (1 - 0.9 ** 5))
    assert not math.isnan(expected_unique_rows(dist, 1, 5, [0], [1])[0])


def test_bad_inputs(capsys):
    tables = small_set()
    planner = ShardingPlanner(world_size=16, local_world_size=8)
    with pytest.raises(ValueError, match="group_size: expected a divisor of world_size=16"):
        plan_grouped(planner, tables, group_size=3)
    with pytest.raises(ValueError, match="group_size: expected an integer >= 1, got 0"):
        plan_grouped(planner, tables, group_size=0)
    with pytest.raises(ValueError, match="replica_sync: expected 'step' or an integer >= 1"):
        plan_grouped(planner, tables, group_size=8, replica_sync=0)
    assert main(["plan", CRITEO, "--world-size", "16", "--group-size", "3"]) == 2
    assert "group_size: expected a divisor of world_size=16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", CRITEO, "--world-size", "16", "--group-size", "0"])
    assert "expected 'auto' or an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", CRITEO, "--world-size", "16", "--replica-sync", "never"])
    assert "expected 'step' or an integer >= 1, got never" in capsys.readouterr().err
    assert main(["plan", CRITEO, "--world-size", "16", "--check", "p.yaml", "--group-size",
                 "8"]) == 2
    assert "--check evaluates the plan's own group_size" in capsys.readouterr().err
    # auto where no group size fits: exit 1, every candidate's reason
    assert main(["plan", CRITEO, "--world-size", "16", "--group-size", "auto",
                 "--hbm-gb", "4"]) == 1
    err = capsys.readouterr().err
    assert "does not fit: no group size in [8, 16] fits: S=8:" in err and "S=16:" in err


def test_cli_grouped_plan_out_and_check(tmp_path, capsys):
    out = tmp_path / "g.yaml"
    assert main(["plan", CRITEO, "--world-size", "16", "--group-size", "8", "--replica-sync",
                 "100", "--wire-dtype", "fp8", "--batch-size", "64", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "16 ranks, 2 group(s) of 8 ranks (1 host(s) x 8)" in text
    assert "replica sync every 100 steps" in text and "step estimate with the sync" in text
    plan = ShardingPlan.load_yaml(out)
    assert (plan.world_size, plan.group_size, plan.replica_sync) == (16, 8, 100)
    assert main(["plan", CRITEO, "--world-size", "16", "--check", str(out),
                 "--wire-dtype", "fp8", "--batch-size", "64"]) == 0
    again = capsys.readouterr().out
    line = [x for x in text.splitlines() if x.startswith("step estimate with the sync")]
    assert line and line == [x for x in again.splitlines()
                             if x.startswith("step estimate with the sync")]
    # the average's weights in int8: D = 128 values + 8 bytes of row scales instead of 4·128,
    # the rowwise state's 4 bytes a row as before
    assert main(["plan", CRITEO, "--world-size", "16", "--check", str(out), "--wire-dtype",
                 "fp8", "--batch-size", "64", "--replica-sync-dtype", "int8"]) == 0
    int8 = capsys.readouterr().out

    def average_mb(report):
        line = next(x for x in report.splitlines() if x.startswith("replica sync MB/rank"))
        return float(line.split("average ")[1].split(" / ")[0].replace(",", ""))

    assert average_mb(int8) / average_mb(text) == pytest.approx((128 + 8 + 4) / (4 * 128 + 4),
                                                                rel=1e-3)


def test_auto_skips_what_its_hottest_row_rules_out():
    """One table of 100 ids per sample with a hot row: in groups of 32 ranks or more, the
    holder of row 0 receives (S-1)·B·100·P(0)·4 bytes of ids, more than the group of 8's whole
    step, so auto does not plan them, and the choice is the one it makes planning all."""
    tables = [TableSpec(name="hot", num_embeddings=100_000, embedding_dim=32,
                        features=("h",), pooling_factors=(100.0,))]
    stats = {"hot": IdDistribution(kind="zipf", alpha=1.5)}
    planner = ShardingPlanner(world_size=128, local_world_size=8, balance_memory=False,
                              cost_model=CostModel(batch_size=512))
    pruned = propose_group_size(planner, tables, None, stats, replica_sync=10**6)
    full = propose_group_size(planner, tables, None, stats, replica_sync=10**6, prune=False)
    skipped = [c.group_size for c in pruned.candidates if c.reason.startswith("not planned")]
    assert skipped == [32, 64, 128]
    assert pruned.group_size == full.group_size == 8
    best = min(c.step_s for c in full.candidates)
    for c in full.candidates:  # the bound was right to skip them
        assert (c.group_size in skipped) == (c.step_s > hot_row_bound(
            tables, stats, planner.cost_model, c.group_size, 8) > best)
