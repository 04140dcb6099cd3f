"""The planner's storage tiers (``planner/tier_choice.py``): device when it fits, cached, file,
refusals; explicit storage kept; the chosen tiers in the plan YAML, the cost and the report."""

import pytest

from fbtriton_dist.cli import main
from fbtriton_dist.planner import (
    CostModel,
    PlanError,
    ShardingPlan,
    ShardingPlanner,
    TableSpec,
    table_set_from_dict,
)
from fbtriton_dist.planner.memory import block_bytes
from fbtriton_dist.planner.tier_choice import CACHE_MARGIN, DEVICE_FILL
from fbtriton_dist.storage import SLOT_BYTES_ON_DEVICE, SLOT_MAP_BYTES, Storage
from fbtriton_dist.train.config import ShardingConfig

ROW = 16 * 4 + 4  # D = 16 fp32 + rowwise Adagrad's state


def spec(name, rows, **kw):
    return TableSpec(name=name, num_embeddings=rows, embedding_dim=16, features=(f"{name}_f",),
                     **kw)


def planner(**kw):
    kw = {"world_size": 2, "hbm_bytes_per_rank": 100_000, "reserved_fraction": 0.0,
          "auto_tiers": True, "cost_model": CostModel(batch_size=64), **kw}
    return ShardingPlanner(**kw)


def tiers(plan):
    return {t.name: t.storage for t in plan.tables}


def test_device_when_it_fits_cached_when_not():
    small, big = spec("small", 1000), spec("big", 10_000)  # 68 KB; 680 KB > 2 x 100 KB
    p = planner()
    assert tiers(p.plan([small])) == {"small": None}  # device
    plan = p.plan([small, big])
    got = tiers(plan)
    assert got["small"] is None and got["big"].tier == "cached"
    # the cache fills the device room the device table leaves, within the fill share
    f = got["big"].cache_load_factor
    room = DEVICE_FILL * 2 * 100_000 - 1000 * ROW
    # each slot: its row + state and 38 B of bookkeeping; each row: 4 B of slot map (device)
    cache = (lambda f: f * 10_000 * (ROW + SLOT_BYTES_ON_DEVICE) + 10_000 * SLOT_MAP_BYTES)
    assert cache(f) <= room < cache(f + 0.002)
    assert f >= CACHE_MARGIN * 127 / 10_000  # holds two steps' distinct rows (128 ids)
    plan.validate([small, big], budget_bytes=p.budget_bytes)  # the plan's storage counts
    cost = p.cost(plan, [small, big])
    t = cost.tiers["big"]
    assert t.fits and 0 < t.hit_rate < 1
    assert t.bytes == pytest.approx(2 * t.misses * ROW)  # rows in, dirty rows out
    assert sum(r.host_tier_bytes for r in cost.ranks) == pytest.approx(t.bytes)
    # without auto_tiers the same table does not fit on device
    with pytest.raises(PlanError):
        planner(auto_tiers=False).plan([small, big])


def test_file_when_host_is_short_and_refusals():
    a, b = spec("a", 10_000), spec("b", 20_000)  # 680 KB, 1.36 MB
    p = planner(host_bytes_per_rank=400_000, disk_bytes_per_rank=1_000_000, file_dir="/rows")
    got = tiers(p.plan([a, b]))
    assert got["a"].tier == "cached"  # 680 KB in 800 KB of host memory
    assert got["b"].tier == "file" and got["b"].path == "/rows"
    with pytest.raises(ValueError, match="table 'b' needs storage tier 'file' .*expected a "
                                         "directory"):
        planner(host_bytes_per_rank=400_000).plan([a, b])
    with pytest.raises(ValueError, match=r"table 'b' \(20000 rows, 1.3 MiB with its state\) "
                                         r"fits no tier: .*disk for tier 'file' \(.* left of "
                                         r"2 x 488.3 KiB\)"):
        planner(host_bytes_per_rank=400_000, disk_bytes_per_rank=500_000,
                file_dir="/rows").plan([a, b])
    # a device budget too small even for the caches' minimum
    with pytest.raises(ValueError, match="table 'a' \\(storage tier 'cached'\\): its cache "
                                         "must hold"):
        planner(hbm_bytes_per_rank=300, cost_model=CostModel(batch_size=512)).plan([a])


def test_explicit_storage_is_kept_and_checked():
    fixed = spec("fixed", 10_000, storage=Storage(tier="cached", cache_load_factor=0.1,
                                                  policy="lfu"))
    auto = spec("auto", 1000, auto_storage=True)
    plain = spec("plain", 500)
    # fixed: 1,000 slots x 68 B + its slot map 10,000 x 4 B + 1,000 x 38 B on the device
    plan = planner(auto_tiers=False, hbm_bytes_per_rank=150_000).plan([fixed, auto, plain])
    got = tiers(plan)
    assert got == {"fixed": fixed.storage, "auto": None, "plain": None}
    with pytest.raises(ValueError, match="table 'fixed' \\(storage tier 'cached', 664.1 KiB "
                                         "with its state\\): the tables on that tier need "
                                         ".* more than the host budget of 2 x 97.7 KiB"):
        planner(host_bytes_per_rank=100_000).plan([fixed, auto])
    with pytest.raises(PlanError, match="host memory: rank 0 needs .* 'fixed' rows 0.."):
        planner(host_bytes_per_rank=100_000).plan([fixed])  # no table to place: per rank


def test_yaml_auto_round_trip_and_report(tmp_path, capsys):
    ts = table_set_from_dict({"tables": [
        {"name": "u", "num_embeddings": 10_000, "embedding_dim": 16, "features": ["u"],
         "storage": "auto", "id_distribution": {"kind": "zipf", "alpha": 1.1}},
        {"name": "v", "num_embeddings": 100, "embedding_dim": 16, "features": ["v"]}]})
    u = ts.tables[0]
    assert u.auto_storage and u.storage is None and not ts.tables[1].auto_storage
    plan = planner(auto_tiers=False).plan(ts.tables, stats=ts.stats)
    assert tiers(plan)["u"].tier == "cached" and tiers(plan)["v"] is None
    path = tmp_path / "plan.yaml"
    plan.save_yaml(path)
    again = ShardingPlan.load_yaml(path)
    assert again == plan
    again.validate(ts.tables, budget_bytes=100_000)
    with pytest.raises(ValueError, match="managed tables live on 'device', got tier 'auto'"):
        table_set_from_dict({"tables": [
            {"name": "m", "num_embeddings": 11, "embedding_dim": 4, "features": ["m"],
             "storage": "auto", "id_manager": {"capacity": 10, "eviction": "lru"}}]})
    # the command line: the chosen tier in the report and the written plan
    tables = tmp_path / "tables.yaml"
    tables.write_text("tables:\n"
                      "  - {name: u, num_embeddings: 10000, embedding_dim: 16, features: [u]}\n")
    out = tmp_path / "cli_plan.yaml"
    assert main(["plan", str(tables), "--world-size", "2", "--hbm-gb", str(100_000 / 2**30),
                 "--reserved", "0", "--batch-size", "64", "--auto-tiers",
                 "--disk-budget-gb", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cached table  tier    cache" in text and "u             cached" in text
    assert ShardingPlan.load_yaml(out).tables[0].storage.tier == "cached"


def test_job_disk_budget_key():
    assert ShardingConfig(disk_budget_gb=2.0).disk_budget_gb == 2.0
    with pytest.raises(ValueError, match="disk_budget_gb"):
        ShardingConfig(disk_budget_gb=0)
    assert block_bytes(spec("x", 10), 10, 16, "rowwise_adagrad") == 10 * ROW


def test_a_hot_short_shard_asks_for_a_larger_cache():
    from fbtriton_dist.planner import IdDistribution, Shard, TableSharding
    from fbtriton_dist.planner.tier_choice import cache_shortfalls

    st = Storage(tier="cached", cache_load_factor=0.05)
    z = spec("z", 20_000, storage=st)

    def plan(cut):
        shards = (Shard(rank=0, row_start=0, row_end=cut, col_start=0, col_end=16),
                  Shard(rank=1, row_start=cut, row_end=20_000, col_start=0, col_end=16))
        return ShardingPlan(world_size=2, local_world_size=2, tables=(TableSharding(
            name="z", sharding="row_wise", num_embeddings=20_000, embedding_dim=16,
            shards=shards, storage=st),))

    stats = {"z": IdDistribution(kind="zipf", alpha=1.2)}
    assert cache_shortfalls(plan(10_000), [z], stats, batch_size=64) == {}
    # rows 0..50 get most lookups: a cache of ceil(0.05 x 50) = 3 slots holds no step
    grow = cache_shortfalls(plan(50), [z], stats, batch_size=64)
    assert set(grow) == {"z"} and grow["z"] > 0.5


def test_row_caps_count_whole_cache_slots():
    # 2 ranks of 100,000 B; a cache of 0.2793 x rows: at most 1470 slots (68 B) a rank, i.e.
    # 5263 rows (5265 rows would take ceil(1470.5) = 1471 slots, 100,028 B)
    t = spec("t", 10_000, storage=Storage(tier="file", cache_load_factor=0.2793, path="/rows"))
    p = planner(auto_tiers=False)
    plan = p.plan([t])
    assert all(t.storage.slots(s.num_rows) <= 1470 for s in plan.tables[0].shards)
    plan.validate([t], budget_bytes=p.budget_bytes)
