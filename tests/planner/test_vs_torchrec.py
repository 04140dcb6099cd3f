"""Our planner vs TorchRec's EmbeddingShardingPlanner on the Criteo set, scored by our model.

At R = 2, 8 and 64, with uniform and Zipf(1.1) ids: our slowest rank is never slower and our
imbalance (max/mean of per-rank time) is never worse; with Zipf(1.1) at 64 ranks ours is at
most 1.15 where equal row blocks are worse. Prints the table (run with -s to see it). Skips
only when TorchRec is not installed.
"""

import functools
import pathlib

import pytest

from fbtriton_dist.planner import IdDistribution, load_tables

CRITEO = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tables" / "criteo_terabyte.yaml"


@pytest.fixture(scope="module")
def bench():
    # only a missing TorchRec skips: an error of TorchRec's planner as installed, or of our
    # conversion of its plan (bench/planner_vs_torchrec.py), fails the tests
    pytest.importorskip("torchrec.distributed.planner")
    from fbtriton_dist.bench import planner_vs_torchrec

    tables = load_tables(CRITEO).tables

    @functools.cache
    def compare(R, zipf):  # each (R, ids) planned once for all the tests below
        stats = None
        if zipf is not None:
            stats = {t.name: IdDistribution(kind="zipf", alpha=zipf) for t in tables}
        c = planner_vs_torchrec.compare(tables, R, local_world_size=8, stats=stats)
        print("\n" + planner_vs_torchrec.format_rows([c]))
        return c

    return compare


@pytest.mark.parametrize("zipf", [None, 1.1], ids=["uniform", "zipf1.1"])
@pytest.mark.parametrize("R", [2, 8, 64])
def test_not_worse_than_torchrec(bench, R, zipf):
    c = bench(R, zipf)
    # the step time is the slowest rank's: ours is never slower
    assert c.ours.max() <= c.torchrec.max() * 1.0001
    assert c.ours.imbalance() <= c.torchrec.imbalance() + 1e-6


def test_zipf_64_ranks_balanced_where_equal_rows_are_not(bench):
    # 1.15, not 1.10, since the cost model was checked against the simulated traffic
    # (bench.simulate): a data-parallel replica costs what a table-wise owner does on every
    # rank, so the small tables are column slices now, ~0.1 ms each (ours 1.146 / 0.565 ms
    # after the memory pass, 1.125 before it: the same step, a lower mean rank time; equal
    # rows 2.43 / 1.27 ms, TorchRec 5.46 / 3.96 ms)
    c = bench(64, 1.1)
    assert c.equal_rows.imbalance() > 1.15
    assert c.ours.imbalance() <= 1.15
    assert c.ours.max() <= c.equal_rows.max()


def test_both_plans_scored_by_the_simulation(bench):
    """A plan our planner did not make (TorchRec's: its own cuts and types) is estimated as
    well as ours: both within 10% of the simulation on every simulated rank and term."""
    from fbtriton_dist.bench import planner_vs_torchrec

    tables = load_tables(CRITEO).tables
    stats = {t.name: IdDistribution(kind="zipf", alpha=1.1) for t in tables}
    c = planner_vs_torchrec.compare(tables, 8, local_world_size=4, stats=stats, simulate=True)
    print("\n" + planner_vs_torchrec.format_rows([c]))
    for name in planner_vs_torchrec.NAMES:
        score = c.scores[name]
        assert score.sim_error < 0.10, name
        assert score.seconds > 0
    # the simulated step of the slowest estimated rank is its estimate, within the tolerance
    assert c.scores["torchrec"].sim_step_s == pytest.approx(c.torchrec.max(), rel=0.10)
    assert c.scores["fbtriton_dist"].sim_step_s <= c.scores["torchrec"].sim_step_s * 1.0001
