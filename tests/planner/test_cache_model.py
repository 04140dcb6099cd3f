"""The row cache's hit-rate estimate (``planner/cache_model.py``) against the runtime's slot
map on drawn ids (``bench/cache_sim.py``), and its limits."""

import time

import pytest
import torch

from fbtriton_dist.bench.cache_sim import measure_hit_rate, miss_error
from fbtriton_dist.planner import IdDistribution
from fbtriton_dist.planner.cache_model import estimate_hit_rates, hit_rate

UNIFORM = IdDistribution()


def zipf(a):
    return IdDistribution(kind="zipf", alpha=a)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("dist, cache, policy", [
    (UNIFORM, 400, "lru"),
    (zipf(1.1), 400, "lru"),
    (zipf(0.8), 400, "lfu"),
    (zipf(1.4), 60, "lfu"),
])
def test_estimate_within_ten_percent_of_the_real_map(dist, cache, policy):
    E, n = 4000, 64
    est = hit_rate(dist, E, n, cache, policy)
    run = measure_hit_rate(dist, E, n, cache, policy, steps=400, seed=3)
    assert est.fits
    assert est.distinct_rows == pytest.approx(run.distinct_per_step, rel=0.05)
    assert miss_error(est.hit_rate, run.hit_rate) <= 0.10, (est, run)


def test_the_policies_differ_and_each_estimate_matches_its_own():
    # Zipf 0.8, a 10 % cache: LFU keeps the frequent rows, LRU the recent ones
    E, n, C = 4000, 64, 400
    lru, lfu = (hit_rate(zipf(0.8), E, n, C, p).hit_rate for p in ("lru", "lfu"))
    sim_lfu = measure_hit_rate(zipf(0.8), E, n, C, "lfu", steps=400, seed=5).hit_rate
    assert lfu > lru + 0.05
    assert miss_error(lfu, sim_lfu) <= 0.10
    assert miss_error(lru, sim_lfu) > 0.10  # the other policy's estimate would be wrong


def test_a_row_block_sees_only_its_rows():
    # rows 100..2100 of a Zipf table: a block's cache gets the ids that fall in it
    E, n, C = 4000, 256, 300
    est = estimate_hit_rates(zipf(1.1), E, n, [100], [2100], [C], "lru")[0]
    run = measure_hit_rate(zipf(1.1), E, n, C, "lru", steps=300, row_start=100, row_end=2100,
                           seed=1)
    assert est.distinct_rows == pytest.approx(run.distinct_per_step, rel=0.05)
    assert miss_error(est.hit_rate, run.hit_rate) <= 0.10


def test_uniform_lru_is_the_cache_fraction_and_limits():
    # uniform ids: Che's fill equation gives exactly C / E
    for C in (100, 2500):
        assert hit_rate(UNIFORM, 10_000, 50, C).hit_rate == pytest.approx(C / 10_000, rel=1e-6)
    assert hit_rate(zipf(1.1), 1000, 50, 1000).hit_rate == 1.0  # every row fits
    small = hit_rate(UNIFORM, 10_000, 500, 100)  # a step reads ~490 distinct rows
    big = hit_rate(UNIFORM, 10_000, 500, 1000)
    assert not small.fits and big.fits
    assert big.misses == pytest.approx(big.distinct_rows * (1 - big.hit_rate))
    with pytest.raises(ValueError, match="policy: expected one of"):
        hit_rate(UNIFORM, 10, 1, 5, "fifo")


def test_a_billion_rows_and_thousands_of_shards_are_fast():
    E, shards = 10**9, 4096
    cuts = [E * k // shards for k in range(shards + 1)]
    t0 = time.perf_counter()
    est = estimate_hit_rates(zipf(1.1), E, 4096 * 512 * 20, cuts[:-1], cuts[1:],
                             [E // shards // 10] * shards, "lfu")
    whole = [hit_rate(zipf(1.1), E, 512 * 20, C, "lru").hit_rate for C in (10**6, 10**7, 10**8)]
    assert time.perf_counter() - t0 < 5.0
    assert whole == sorted(whole) and 0 < whole[0] < whole[-1] < 1  # more cache, more hits
    assert est[0].hit_rate > est[-1].hit_rate  # the hot block's cache hits more
    assert est[-1].hit_rate == pytest.approx(0.1, abs=0.01)  # the coldest block: ~uniform


def test_plan_comparison_simulates_each_cached_table():
    from fbtriton_dist.bench.cache_sim import plan_comparison
    from fbtriton_dist.planner import CostModel, ShardingPlanner, TableSpec
    from fbtriton_dist.storage import Storage

    specs = [TableSpec(name="c", num_embeddings=4000, embedding_dim=8, features=("f",),
                       storage=Storage(tier="cached", cache_load_factor=0.1, policy="lfu")),
             TableSpec(name="d", num_embeddings=100, embedding_dim=8, features=("g",))]
    plan = ShardingPlanner(world_size=2, cost_model=CostModel(batch_size=32)).plan(specs)
    text = plan_comparison(plan, specs, {"c": zipf(1.1)}, 32, steps=200)
    rows = [line for line in text.splitlines() if line.startswith("| c |")]
    assert len(rows) == 1 and "| d |" not in text
    cells = [c.strip() for c in rows[0].split("|")]
    assert cells[4] == "lfu" and float(cells[7]) <= 0.10  # estimate vs measured miss rate


def test_block_traffic_charges_a_cache_that_cannot_hold_two_steps():
    import numpy as np

    from fbtriton_dist.planner import TableSpec
    from fbtriton_dist.planner.cache_model import block_traffic
    from fbtriton_dist.storage import Storage

    t = TableSpec(name="t", num_embeddings=10_000, embedding_dim=8, features=("f",),
                  storage=Storage(tier="file", path="/rows", cache_load_factor=0.1))
    row = 8 * 4 + 4  # weights + rowwise Adagrad's state
    # two row blocks: 0..100 (10 slots) gets ~all of the hot ids, 100..10000 (990 slots)
    moved, summary = block_traffic(t, zipf(1.2), 200.0, np.array([0, 100]),
                                   np.array([100, 10_000]), np.array([8, 8]), "rowwise_adagrad")
    assert moved[0] == 2 * 100 * row  # short: its whole rows both ways
    est = estimate_hit_rates(zipf(1.2), 10_000, 200.0, [100], [10_000], [990], "lru")[0]
    assert moved[1] == pytest.approx(2 * est.misses * row)
    assert summary.tier == "file" and not summary.fits
