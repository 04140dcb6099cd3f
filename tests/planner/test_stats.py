"""Id distributions over arrays and the vectorised row cuts (the paths a plan of thousands of
ranks takes), checked against the scalar functions and against equal blocks."""

import numpy as np
import pytest

from fbtriton_dist.planner import (
    IdDistribution,
    ShardingPlanner,
    TableConstraints,
    TableSpec,
    balanced_cuts,
    cdf_array,
    equal_cuts,
    inverse_cdf_array,
)

DISTS = [
    IdDistribution(),
    IdDistribution(kind="zipf", alpha=0.8),
    IdDistribution(kind="zipf", alpha=1.0),
    IdDistribution(kind="zipf", alpha=1.1),
    IdDistribution(kind="zipf", alpha=2.5),
    IdDistribution(kind="histogram", histogram=(5.0, 1.0, 0.0, 3.0)),
]


@pytest.mark.parametrize("dist", DISTS, ids=lambda d: d.describe())
@pytest.mark.parametrize("E", [1, 3, 1000, 1025, 40_000_000, 5_000_000_000])
def test_arrays_match_the_scalar_functions(dist, E):
    rng = np.random.default_rng(E)
    rows = np.unique(np.concatenate([[0, 1, E - 1, E], rng.integers(0, E + 1, 50)]))
    # the same formula; numpy's vectorised pow/expm1 and libm's may differ in the last bit
    np.testing.assert_allclose(cdf_array(dist, E, rows), [dist.cdf(E, int(r)) for r in rows],
                               rtol=0, atol=1e-15)
    shares = np.concatenate([[0.0, 1e-15, 0.5, 1 - 1e-12, 1.0], rng.random(50)])
    got = inverse_cdf_array(dist, E, shares)
    assert got.tolist() == [dist.inverse_cdf(E, float(s)) for s in shares]


def _loads(E, dist, base, slope, cuts):
    c = np.asarray(cuts)
    return base + slope * (cdf_array(dist, E, c[1:]) - cdf_array(dist, E, c[:-1]))


@pytest.mark.parametrize("k", [8, 200])
def test_uniform_cuts_level_the_loads(k):
    """Members already loaded unevenly: the lighter ones get more rows, every load within one
    row's share of the others (both the one-member-at-a-time and the vectorised path)."""
    E, dist = 10_000_000, IdDistribution()
    rng = np.random.default_rng(k)
    base = rng.random(k) * 1e-4
    slope = np.full(k, 1e-2)
    cuts = balanced_cuts(E, dist, base, slope, [E] * k)
    assert cuts[0] == 0 and cuts[-1] == E and all(np.diff(cuts) >= 0)
    loads = _loads(E, dist, base, slope, cuts)
    assert loads.max() - loads.min() <= 2 * 1e-2 / E * k + 1e-3 * loads.max()
    rows = np.diff(cuts)
    assert rows[np.argmin(base)] > rows[np.argmax(base)]


@pytest.mark.parametrize("k", [16, 64, 512])
def test_zipf_cuts_beat_equal_blocks_and_respect_caps(k):
    E, dist = 50_000_000, IdDistribution(kind="zipf", alpha=1.1)
    base, slope = np.full(k, 1e-5), np.full(k, 1e-3)
    cuts = balanced_cuts(E, dist, base, slope, [E] * k)
    equal = equal_cuts(E, k)
    assert _loads(E, dist, base, slope, cuts).max() < _loads(E, dist, base, slope, equal).max()
    rows = np.diff(cuts)
    assert rows[: k // 4].sum() < rows.max() / 100  # hot blocks short, cold ones long
    caps = [3 * E // k] * k  # memory: no member may take more than 3 equal blocks
    capped = balanced_cuts(E, dist, base, slope, caps)
    assert capped[-1] == E and (np.diff(capped) <= caps).all()
    assert balanced_cuts(E, dist, base, slope, [E // k - 1] * k) is None  # cannot hold E rows


@pytest.mark.parametrize(("R", "zipf"), [(64, 1.1), (256, 1.05), (256, None)])
def test_every_row_cut_is_no_worse_than_equal_blocks(R, zipf):
    """One row-wise table over many ranks, ranks already loaded by other tables: the planner's
    cut is never slower than equal blocks on the same ranks."""
    def spec(name, E, L):
        return TableSpec(name=name, num_embeddings=E, embedding_dim=128,
                         features=(f"{name}_f",), pooling_factors=(L,))

    tables = [spec("other", 2_000_000, 5), spec("big", 30_000_000, 40)]
    stats = {"big": IdDistribution(kind="zipf", alpha=zipf)} if zipf else {}
    cons = {"big": TableConstraints(sharding=("row_wise",), min_shards=R, max_shards=R),
            "other": TableConstraints(sharding=("table_wise",))}
    ours = ShardingPlanner(world_size=R, local_world_size=8)
    equal = ShardingPlanner(world_size=R, local_world_size=8, row_cuts="equal")
    mine = ours.cost(ours.plan(tables, cons, stats), tables, stats)
    theirs = ours.cost(equal.plan(tables, cons, stats), tables, stats)
    assert mine.max() <= theirs.max() * (1 + 1e-9)
