"""``fbtriton-dist plan``: output, the plan file, exit codes and messages."""

import pathlib

import pytest

from fbtriton_dist.cli import main
from fbtriton_dist.planner import ShardingPlan, load_tables

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tables"
CRITEO = str(CONFIGS / "criteo_terabyte.yaml")


def test_plan_prints_and_writes(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    rc = main(["plan", CRITEO, "--world-size", "8", "--batch-size", "256", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "26 tables on 8 ranks (1 host(s) x 8), budget 72.0 GiB/rank" in text
    assert "batch 256/rank" in text
    assert "t_cat_20" in text and "max/mean" in text and "step estimate" in text
    assert f"wrote {out}" in text
    plan = ShardingPlan.load_yaml(out)
    tables = load_tables(CRITEO).tables
    plan.validate(tables, budget_bytes=72 * 1024**3)
    assert out.read_text().startswith("# fbtriton_dist sharding plan for")
    # the written plan can be checked again
    assert main(["plan", CRITEO, "--world-size", "8", "--check", str(out)]) == 0
    assert "step estimate" in capsys.readouterr().out


def test_zipf_and_equal_rows(capsys):
    assert main(["plan", CRITEO, "--world-size", "2", "--zipf", "1.1", "--row-cuts", "equal"]) == 0
    assert "zipf(1.1)" in capsys.readouterr().out


def test_does_not_fit(capsys):
    rc = main(["plan", str(CONFIGS / "ten_billion_rows.yaml"), "--world-size", "8"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("fbtriton-dist plan: does not fit: the 7 tables need 1.2 TiB")
    assert "short by 653.3 GiB" in err


def test_bad_yaml_and_bad_check(tmp_path, capsys):
    bad = tmp_path / "t.yaml"
    bad.write_text(
        "tables:\n- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f],"
        " sharding: rowwise}\n"
    )
    assert main(["plan", str(bad), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"error: {bad}: tables[0].sharding[0]: expected one of [row_wise" in err
    plan = tmp_path / "p.yaml"
    assert main(["plan", CRITEO, "--world-size", "2", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["plan", CRITEO, "--world-size", "4", "--check", str(plan)]) == 2
    assert "plan is for world_size=2" in capsys.readouterr().err


def test_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", CRITEO])
    assert e.value.code == 2
    assert "--world-size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


def test_plan_simulate_prints_estimate_and_simulation(tmp_path, capsys):
    pytest.importorskip("torch")
    tables = tmp_path / "t.yaml"
    tables.write_text(
        "tables:\n"
        "- {name: a, num_embeddings: 5000, embedding_dim: 64, features: [a], pooling_factors: 3,"
        " id_distribution: {kind: zipf, alpha: 1.1}}\n"
        "- {name: b, num_embeddings: 40, embedding_dim: 32, features: [b, c]}\n"
    )
    rc = main(["plan", str(tables), "--world-size", "4", "--local-world-size", "2",
               "--batch-size", "64", "--simulate", "--sim-ranks", "0", "3"])
    text = capsys.readouterr().out
    assert rc == 0
    assert "step estimate" in text  # the plan first
    assert "simulated 2 of 4 ranks from every rank's batch; B=64, seed 0" in text
    rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["3"])]
    assert len(rows[-2:]) == 2 and "max |error|:" in text
    errors = [float(c.rstrip("%")) for c in text.split("max |error|: ")[1].split("\n")[0]
              .replace(",", " ").split() if c.endswith("%")]
    assert len(errors) == 4 and max(errors) < 10.0


def test_memory_tolerance(capsys):
    """``--memory-tolerance`` reaches the memory pass: Criteo at 16 ranks, 4 per host, evens
    out memory at 3 % (max/mean 1.81 at the default 1 %); a negative value is refused."""
    args = ["plan", CRITEO, "--world-size", "16", "--local-world-size", "4", "--zipf", "1.1"]

    def memory_imbalance(extra):
        assert main(args + extra) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        return float(last.split("memory ")[1].split(",")[0])

    assert memory_imbalance([]) > 1.7
    assert memory_imbalance(["--memory-tolerance", "0.03"]) < 1.4
    with pytest.raises(SystemExit) as e:
        main(args + ["--memory-tolerance", "-1"])
    assert e.value.code == 2
    assert "argument --memory-tolerance: expected a finite number >= 0, got -1" in (
        capsys.readouterr().err)
