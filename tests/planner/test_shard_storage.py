"""Storage per shard (``Shard.storage``): the plan's YAML round trip and its errors, the
budget checks and the cost model / report pricing each shard on its own tier."""

import pytest
import yaml

from fbtriton_dist.planner import (
    ConfigError,
    PlanValidationError,
    Shard,
    ShardingPlan,
    TableSharding,
    TableSpec,
    evaluate,
)
from fbtriton_dist.planner.memory import as_planned
from fbtriton_dist.planner.plan import host_memory_problems, memory_problems
from fbtriton_dist.planner.report import tier_lines
from fbtriton_dist.storage import Storage

E, D = 1000, 8
CACHED = Storage(tier="cached", cache_slots=100, policy="lfu")


def _plan(sharding="row_wise", table_storage=None, R=2):
    if sharding == "data_parallel":
        shards = tuple(Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D)
                       for r in range(R))
    else:
        cut = [E * r // R for r in range(R + 1)]
        shards = tuple(Shard(rank=r, row_start=cut[r], row_end=cut[r + 1], col_start=0,
                             col_end=D) for r in range(R))
    return ShardingPlan(world_size=R, local_world_size=R, tables=(
        TableSharding(name="t", sharding=sharding, num_embeddings=E, embedding_dim=D,
                      shards=shards, storage=table_storage),))


def _spec():
    return TableSpec(name="t", num_embeddings=E, embedding_dim=D, features=("f",))


def test_yaml_round_trip_keeps_each_shard_storage(tmp_path):
    plan = _plan(table_storage=Storage(tier="cached", cache_load_factor=0.25)).with_shard_storage(
        {"t": {0: "device", 1: {"tier": "file", "path": str(tmp_path / "rows"),
                                "cache_slots": 7}}})
    assert [s.storage.tier for s in plan.tables[0].shards] == ["device", "file"]
    plan.save_yaml(tmp_path / "plan.yaml")
    assert ShardingPlan.load_yaml(tmp_path / "plan.yaml") == plan
    text = plan.to_yaml()
    assert text == yaml.safe_dump(plan.to_dict(), sort_keys=False, default_flow_style=None)
    assert "    storage: {tier: device}\n" in text
    assert "storage" not in _plan().to_yaml()  # plans without one: written as before
    # None: the table's storage again
    back = plan.with_shard_storage({"t": {0: None, 1: None}})
    assert back == _plan(table_storage=Storage(tier="cached", cache_load_factor=0.25))


SHARD = "shards: [{rank: 0, rows: [0, 4], cols: [0, 2]}, {rank: 1, rows: [4, 8], cols: [0, 2]"
HEAD = ("world_size: 2\nlocal_world_size: 2\ntables:\n- {name: ads, sharding: row_wise, "
        "num_embeddings: 8, embedding_dim: 2, ")


@pytest.mark.parametrize("storage, message", [
    ("{tier: ssd}", "tables[0].shards[1].storage: table 'ads' shard 1 (rank 1: rows 4..8, "
                    "cols 0..2): storage.tier: expected one of ['device', 'host', 'cached', "
                    "'file'], got 'ssd'"),
    ("{tier: cached, cache_load_factor: 1.5}",
     "table 'ads' shard 1 (rank 1: rows 4..8, cols 0..2): storage.cache_load_factor: expected "
     "a number in (0, 1], got 1.5"),
    ("{tier: cached, slots: 3}", "table 'ads' shard 1 (rank 1: rows 4..8, cols 0..2): "
                                 "storage: unknown keys ['slots']"),
    ("{tier: file}", "shard 1 (rank 1: rows 4..8, cols 0..2): storage.path: tier 'file' needs "
                     "the directory of its files"),
])
def test_yaml_shard_storage_errors_name_table_shard_and_bound(tmp_path, storage, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"{HEAD}{SHARD}, storage: {storage}}}]}}\n")
    with pytest.raises(ConfigError) as e:
        ShardingPlan.load_yaml(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value), str(e.value)
    path.write_text(f"{HEAD}{SHARD}, store: {{tier: cached}}}}]}}\n")
    with pytest.raises(ConfigError, match=r"tables\[0\].shards\[1\]: expected a mapping with "
                                          r"keys \[rank, rows, cols\] and optionally storage"):
        ShardingPlan.load_yaml(path)
    path.write_text(f"{HEAD}{SHARD}, storage: {{tier: cached}}}}]}}\n")
    assert ShardingPlan.load_yaml(path).tables[0].shards[1].storage == Storage(tier="cached")


def test_with_shard_storage_and_validate_refuse_what_does_not_exist():
    plan = _plan()
    with pytest.raises(ValueError, match=r"table 't' storage: expected a shard index 0 <= i < "
                                         r"2, got 2"):
        plan.with_shard_storage({"t": {2: "cached"}})
    with pytest.raises(ValueError, match=r"storage: unknown table\(s\) \['u'\]; the plan "
                                         r"holds \['t'\]"):
        plan.with_shard_storage({"u": {0: "cached"}})
    with pytest.raises(ValueError, match=r"table 't' shard 0 \(rank 0: rows 0..500, cols "
                                         r"0..8\): storage.cache_slots: expected an integer >= "
                                         r"1 or None, got 0"):
        plan.with_shard_storage({"t": {0: {"tier": "cached", "cache_slots": 0}}})
    dp = _plan("data_parallel").with_shard_storage({"t": {1: "cached"}})
    with pytest.raises(PlanValidationError, match=r"shards\[1\] \(rank 1: rows 0..1000, cols "
                                                  r"0..8\).storage: a data-parallel replica "
                                                  r"lives on 'device', got tier 'cached'"):
        dp.validate()
    _plan("data_parallel").with_shard_storage({"t": {1: "device"}}).validate()


def test_budgets_count_each_shard_on_its_tier():
    """Rank 0's 500 rows on device: 500 x 8 x 4 B + 500 x 4 B state = 17.6 KiB; rank 1's
    shard cached in 100 slots: 3,600 B + its slot map (500 x 4 B + 100 x 38 B) = 9,400 B on
    device, its rows and state (18,000 B) on the host."""
    spec, plan = _spec(), _plan().with_shard_storage({"t": {1: CACHED}})
    plan.validate([spec], budget_bytes=18000, host_budget_bytes=18000)
    over = memory_problems(plan, [spec], 17999, "rowwise_adagrad")
    assert len(over) == 1 and over[0].startswith("rank 0 needs 17.6 KiB"), over
    assert memory_problems(plan, [spec], 9400, "rowwise_adagrad")[1:] == []
    assert "rows 500..1000 (cached tier: a cache of 100 slots)" in memory_problems(
        plan, [spec], 9399, "rowwise_adagrad")[1]
    host = host_memory_problems(plan, [spec], 17999, "rowwise_adagrad")
    assert len(host) == 1 and host[0].startswith("rank 1 needs 17.6 KiB of host memory"), host
    # the other side: the table's storage cached, rank 0's shard back on device
    flipped = _plan(table_storage=CACHED).with_shard_storage({"t": {0: "device"}})
    planned = as_planned([spec], flipped.tables)  # what validate passes: the plan's tiers
    assert memory_problems(flipped, planned, 17999, "rowwise_adagrad") == over


def test_cost_and_report_price_each_shard_on_its_tier():
    spec = _spec()
    plan = _plan().with_shard_storage({"t": {1: CACHED}})
    cost = evaluate(plan, [spec], optimizer="rowwise_adagrad")
    dev = evaluate(_plan(), [spec], optimizer="rowwise_adagrad")
    r0, r1 = cost.ranks
    assert (r0.weight_bytes, r0.host_tier_bytes) == (dev.ranks[0].weight_bytes, 0.0)
    assert r1.weight_bytes == 100 * D * 4 and r1.state_bytes == 100 * 4
    assert r1.host_tier_bytes > 0 and r0.lookups == dev.ranks[0].lookups
    assert set(cost.tiers) == {"t[1]"} and cost.tiers["t[1]"].tier == "cached"
    lines = "\n".join(tier_lines(plan, cost))
    assert "t[1]" in lines and "100 slots" in lines and "lfu" in lines
    # all shards on the table's tier: one line keyed by the table, as before
    whole = evaluate(_plan(table_storage=CACHED), [spec], optimizer="rowwise_adagrad")
    assert set(whole.tiers) == {"t"}
    assert whole.ranks[1].host_tier_bytes == pytest.approx(r1.host_tier_bytes)


def _hot_plan(R, table_wise_rows=0):
    """'t' cut row-wise in two blocks (both on rank 0 when R = 1), cached (auto), and on the
    last rank a device table 'o' of ``table_wise_rows`` rows."""
    cached = Storage(tier="cached", cache_load_factor=0.1)
    shards = tuple(Shard(rank=min(i, R - 1), row_start=500 * i, row_end=500 * (i + 1),
                         col_start=0, col_end=D) for i in range(2))
    tables = [TableSharding(name="t", sharding="row_wise", num_embeddings=E, embedding_dim=D,
                            shards=shards, storage=cached)]
    specs = [TableSpec(name="t", num_embeddings=E, embedding_dim=D, features=("f",),
                       storage=cached)]
    if table_wise_rows:
        tables.append(TableSharding(name="o", sharding="table_wise",
                                    num_embeddings=table_wise_rows, embedding_dim=D,
                                    shards=(Shard(rank=R - 1, row_start=0,
                                                  row_end=table_wise_rows, col_start=0,
                                                  col_end=D),)))
        specs.append(TableSpec(name="o", num_embeddings=table_wise_rows, embedding_dim=D,
                               features=("g",)))
    return ShardingPlan(world_size=R, local_world_size=R, tables=tuple(tables)), specs


def test_promote_hot_shards_fills_each_rank_budget_hottest_first():
    """A shard: 500 x (8 x 4 B + 4 B) = 18,000 B on device, 50 slots = 1,800 B cached + its
    slot map on the device (500 x 4 B + 50 x 38 B): 5,700 B."""
    from fbtriton_dist.planner.shard_tiers import promote_hot_shards
    from fbtriton_dist.planner.stats import IdDistribution

    # each rank its own budget: rank 1 also holds 'o' (400 rows, 14,400 B): its shard stays
    plan, specs = _hot_plan(2, table_wise_rows=400)
    out = promote_hot_shards(plan, specs, None, {"t"}, 21_000, "rowwise_adagrad")
    assert [s.storage for s in out.tables[0].shards] == [Storage(tier="device"), None]
    out.validate(specs, budget_bytes=21_000)
    with pytest.raises(PlanValidationError, match="rank 0 needs 17.6 KiB"):
        out.validate(specs, budget_bytes=17_999)
    assert promote_hot_shards(plan, specs, None, set(), 21_000, "rowwise_adagrad") == plan
    # ranks with different device memory: rank 1's larger budget holds its shard too
    out = promote_hot_shards(plan, specs, None, {"t"}, [20_000, 35_000], "rowwise_adagrad")
    assert [s.storage for s in out.tables[0].shards] == [None, None]  # all: the table
    assert out.tables[0].storage is None
    out = promote_hot_shards(plan, specs, None, {"t"}, [18_000, 35_000], "rowwise_adagrad")
    assert [s.storage for s in out.tables[0].shards] == [None, Storage(tier="device")]
    with pytest.raises(ValueError, match=r"budget_bytes: expected one number or 2 \(one per "
                                         r"rank\), got 3"):
        promote_hot_shards(plan, specs, None, {"t"}, [1, 2, 3], "rowwise_adagrad")
    # one rank, room for one more shard: the hotter one (rows at the end hot, then the start)
    plan, specs = _hot_plan(1)
    for hist, hot in (((1.0, 9.0), 1), ((9.0, 1.0), 0)):
        stats = {"t": IdDistribution(kind="histogram", histogram=hist)}
        out = promote_hot_shards(plan, specs, stats, {"t"}, 25_000, "rowwise_adagrad")
        assert [s.storage is not None for s in out.tables[0].shards] == [i == hot
                                                                        for i in range(2)]
    # room for both: the whole table on device
    out = promote_hot_shards(plan, specs, None, {"t"}, 40_000, "rowwise_adagrad")
    assert out.tables[0].storage is None and not out.tables[0].per_shard_storage


def test_planner_shard_tiers_keeps_the_faster_plan_within_budget():
    from fbtriton_dist.planner import CostModel, IdDistribution, ShardingPlanner

    specs = [TableSpec(name="small", num_embeddings=1000, embedding_dim=16, features=("a",)),
             TableSpec(name="big", num_embeddings=2000, embedding_dim=16, features=("b",))]
    stats = {"big": IdDistribution(kind="zipf", alpha=1.2)}
    kw = {"world_size": 2, "hbm_bytes_per_rank": 100_000, "reserved_fraction": 0.0,
          "auto_tiers": True, "cost_model": CostModel(batch_size=64)}
    plain = ShardingPlanner(**kw)
    base = plain.plan(specs, stats=stats)
    assert base.table("big").storage.tier == "cached" and not base.table("big").per_shard_storage
    p = ShardingPlanner(**kw, shard_tiers=True)
    plan = p.plan(specs, stats=stats)
    plan.validate(specs, budget_bytes=p.budget_bytes)

    def step(x):
        return max(r.time_s for r in evaluate(x, specs, stats, p.cost_model).ranks)

    # Zipf(1.2): big's hot first rows (its shard on rank 0, beside 'small') on device, the
    # cold rest cached; the misses priced per shard make it the faster plan
    shards = plan.table("big").shards
    assert [s.storage for s in shards] == [Storage(tier="device"), None]
    assert plan.table("big").storage.tier == "cached"
    assert step(plan) < step(base)
    with pytest.raises(ValueError, match="shard_tiers: expected a bool, got 1"):
        ShardingPlanner(**kw, shard_tiers=1)


def test_a_job_in_one_process_builds_a_table_on_its_shards_one_storage():
    from fbtriton_dist.train.planning import plan_storage

    one = _plan(R=1).with_shard_storage({"t": {0: CACHED}})
    assert plan_storage(one) == {"t": CACHED}
    assert plan_storage(_plan(R=1)) == {}
    assert plan_storage(_plan(table_storage=CACHED)) == {"t": CACHED}
    mixed = _plan(table_storage=CACHED).with_shard_storage({"t": {0: "device"}})
    with pytest.raises(ValueError, match=r"table 't': its shards name different storage tiers "
                                         r"\['device', 'cached'\]"):
        plan_storage(mixed)


def test_cli_shard_tiers_writes_the_shard_tier_and_reports_its_cache(tmp_path, capsys):
    from fbtriton_dist.cli import main

    tables = tmp_path / "tables.yaml"
    tables.write_text(
        "tables:\n"
        "  - {name: small, num_embeddings: 1000, embedding_dim: 16, features: [a]}\n"
        "  - {name: big, num_embeddings: 2000, embedding_dim: 16, features: [b],\n"
        "     id_distribution: {kind: zipf, alpha: 1.2}}\n")
    out = tmp_path / "plan.yaml"
    args = ["plan", str(tables), "--world-size", "2", "--hbm-gb", str(100_000 / 2**30),
            "--reserved", "0", "--batch-size", "64", "--auto-tiers", "--out", str(out)]
    assert main([*args, "--shard-tiers"]) == 0
    text = capsys.readouterr().out
    big = ShardingPlan.load_yaml(out).table("big")
    assert [s.storage for s in big.shards] == [Storage(tier="device"), None]
    assert "big[1]" in text and "cached" in text
    assert main(args) == 0  # without it: one tier for the table
    assert not ShardingPlan.load_yaml(out).table("big").per_shard_storage


def test_host_shards_cost_their_distinct_rows_both_ways():
    """A ``host`` shard's training step copies its batch's distinct rows and their state into
    device memory and back: 2 x U x (row + state) bytes on the host link, U the expected
    distinct rows of its R x B uniform ids (by hand), nothing for the device shard."""
    spec = _spec()
    plan = _plan().with_shard_storage({"t": {1: "host"}})
    cost = evaluate(plan, [spec], optimizer="rowwise_adagrad")
    r0, r1 = cost.ranks
    n = 2 * 512  # R x the cost model's batch, one id per sample
    rows = E // 2
    U = rows * (1 - (1 - 1 / E) ** n)  # rank 1's half of the table, uniform ids
    assert r0.host_tier_bytes == 0.0
    assert r1.host_tier_bytes == pytest.approx(2 * U * (D * 4 + 4), rel=1e-9)
    assert r1.weight_bytes == 0 and cost.ranks[1].time_s > evaluate(
        _plan(), [spec], optimizer="rowwise_adagrad").ranks[1].time_s
