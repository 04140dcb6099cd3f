"""``fbtriton-dist plan --png``: the per-rank numbers of the report as bars; without
matplotlib the plan still prints and one line says the picture was skipped."""

import pathlib
import sys

import pytest

from fbtriton_dist.cli import main
from fbtriton_dist.planner import CostModel, ShardingPlanner, load_tables

CRITEO = str(pathlib.Path(__file__).resolve().parents[2] / "configs" / "tables"
             / "criteo_terabyte.yaml")
PNG = b"\x89PNG\r\n\x1a\n"


def test_plan_png_draws_the_reports_per_rank_numbers(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from fbtriton_dist.planner.picture import draw_plan

    out = tmp_path / "plan.png"
    assert main(["plan", CRITEO, "--world-size", "4", "--png", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes().startswith(PNG)

    table_set = load_tables(CRITEO)
    planner = ShardingPlanner(world_size=4, local_world_size=4, hbm_bytes_per_rank=80 * 1024**3,
                              cost_model=CostModel(batch_size=512))
    plan = planner.plan(table_set.tables, table_set.constraints, dict(table_set.stats))
    cost = planner.cost(plan, table_set.tables, dict(table_set.stats))
    series = draw_plan(cost, str(tmp_path / "again.png"), budget_bytes=planner.budget_bytes)
    assert len(series["weights_gib"]) == 4
    for r, rank in enumerate(cost.ranks):
        assert series["weights_gib"][r] * 1024**3 == pytest.approx(rank.weight_bytes)
        assert series["lookups"][r] == pytest.approx(rank.lookups)
        assert series["output_dist_mb"][r] * 1e6 == pytest.approx(rank.output_dist_bytes)


def test_plan_png_without_matplotlib_prints_the_plan_and_one_line(tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = tmp_path / "plan.png"
    assert main(["plan", CRITEO, "--world-size", "2", "--png", str(out)]) == 0
    captured = capsys.readouterr()
    assert "step estimate" in captured.out and not out.exists()
    assert f"--png {out} skipped: matplotlib is not installed" in captured.err


def _cost(num_ranks):
    from fbtriton_dist.planner import PlanCost, RankCost

    return PlanCost(ranks=tuple(
        RankCost(rank=r, weight_bytes=(1 + r % 7) * 2**30, state_bytes=2**26, lookups=1e5 + r,
                 lookup_bytes=1e7, input_dist_bytes=1e6 * (1 + r % 3), output_dist_bytes=2e6,
                 inter_host_bytes=5e5, time_s=1e-3 * (1 + r % 5))
        for r in range(num_ranks)))


@pytest.mark.parametrize("num_ranks,kind", [(8, "bars"), (48, "bars"), (49, "sorted"),
                                            (4096, "sorted")])
def test_plan_png_draws_distributions_past_a_few_dozen_ranks(tmp_path, num_ranks, kind):
    """One bar per rank up to 48 ranks; at 4,096 a bar per rank is a strip where only a few
    hundred ranks show, so each panel draws the sorted values (p50 / p99 / max) instead."""
    pytest.importorskip("matplotlib")
    from fbtriton_dist.planner.picture import draw_plan, layout

    assert layout(num_ranks) == kind
    out = tmp_path / "plan.png"
    series = draw_plan(_cost(num_ranks), str(out), title="t", budget_bytes=8 * 1024**3)
    assert series["layout"] == kind and len(series["lookups"]) == num_ranks
    assert out.read_bytes().startswith(PNG)
