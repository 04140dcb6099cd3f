"""``fbtriton-dist plan JOB.yaml`` previews the plan the job makes, and bad input to ``plan``
is bad input (exit 2, naming the flag or the constraint), never a traceback or "does not
fit"."""

import pathlib

import pytest
import yaml

from fbtriton_dist.cli import main
from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.train.config import load_job
from fbtriton_dist.train.planning import make_plan

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _job(tmp_path) -> pathlib.Path:
    """The quickstart job with its own memory, reserve, batch and Zipf settings, small enough
    that they decide the plan (table-wise everywhere at the plan command's defaults)."""
    data = yaml.safe_load((ROOT / "configs/jobs/quickstart.yaml").read_text())
    data["sharding"] = {"hbm_gb": 0.002, "reserved": 0.2}
    data["train"]["batch_size"] = 64
    data["data"]["synthetic"]["zipf"] = 1.3
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_of_a_job_file_is_the_jobs_plan(tmp_path, capsys):
    job = _job(tmp_path)
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(job), "--world-size", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    planned = ShardingPlan.load_yaml(out)
    expected, report = make_plan(load_job(job), 4, 4)
    assert planned.to_dict() == expected.to_dict()
    assert report in text and "batch 64/rank" in text
    # the job's settings matter here: at the command's defaults the plan is another one
    defaults = tmp_path / "defaults.yaml"
    assert main(["plan", str(job), "--world-size", "4", "--hbm-gb", "80", "--batch-size",
                 "512", "--reserved", "0.1", "--out", str(defaults)]) == 0
    assert ShardingPlan.load_yaml(defaults).to_dict() != expected.to_dict()
    # and an option is the job key it names
    overridden, _ = make_plan(load_job(job, ["sharding.hbm_gb=80", "train.batch_size=512",
                                             "sharding.reserved=0.1"]), 4, 4)
    assert ShardingPlan.load_yaml(defaults).to_dict() == overridden.to_dict()


def test_group_size_of_a_job_file_is_the_jobs_key(tmp_path, capsys):
    """``--group-size`` / ``--replica-sync`` override the job's replica-group keys: the plan
    written is the job's grouped plan for the world."""
    job = _job(tmp_path)
    out = tmp_path / "grouped.yaml"
    assert main(["plan", str(job), "--world-size", "4", "--group-size", "2", "--hbm-gb", "1",
                 "--replica-sync", "5", "--out", str(out)]) == 0
    planned = ShardingPlan.load_yaml(out)
    assert (planned.world_size, planned.group_size, planned.replica_sync) == (4, 2, 5)
    expected, _ = make_plan(load_job(job, ["sharding.group_size=2", "sharding.hbm_gb=1",
                                           "sharding.replica_sync=5"]), 4, 4)
    assert planned.to_dict() == expected.to_dict()


def test_plan_of_a_job_file_refuses_what_the_job_cannot_say(tmp_path, capsys):
    job = _job(tmp_path)
    assert main(["plan", str(job), "--world-size", "4", "--memory-tolerance", "0.05"]) == 2
    assert "--memory-tolerance: a job plans with the planner's default" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("flag,value,bound", [
    ("--hbm-gb", "inf", "> 0"), ("--hbm-gb", "nan", "> 0"), ("--hbm-gb", "-8", "> 0"),
    ("--hbm-gb", "0", "> 0"), ("--reserved", "1", ">= 0 and < 1"),
    ("--reserved", "nan", ">= 0 and < 1"), ("--zipf", "inf", ">= 0"),
    ("--memory-tolerance", "nan", ">= 0"),
])
def test_bad_numbers_are_usage_errors_naming_the_flag(flag, value, bound, capsys):
    tables = str(ROOT / "configs/tables/criteo_terabyte.yaml")
    with pytest.raises(SystemExit) as e:
        main(["plan", tables, "--world-size", "8", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a finite number {bound}, got {value}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("constraint,why", [
    ("embedding_dim: 4, sharding: [column_wise], min_shards: 8", "[8, 8]"),
    ("embedding_dim: 64, sharding: [column_wise], min_shards: 16", "[16, 8]"),
    ("embedding_dim: 64, sharding: [column_wise], min_shards: 3, ranks: [0, 1]", "[3, 2]"),
])
def test_impossible_column_wise_constraint_is_bad_input(tmp_path, capsys, constraint, why):
    path = tmp_path / "t.yaml"
    path.write_text(f"tables:\n- {{name: a, num_embeddings: 1000, {constraint}, features: [f]}}\n"
                    "- {name: b, num_embeddings: 1000, embedding_dim: 64, features: [g]}\n")
    assert main(["plan", str(path), "--world-size", "8"]) == 2
    err = capsys.readouterr().err
    assert "does not fit" not in err
    assert "error: constraints['a']: ['column_wise'] cannot cut D=" in err and why in err


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_non_finite_number_in_a_job_file_is_bad_input(tmp_path, capsys, value):
    """YAML's .nan passed every bound check (it compares false) and .inf every lower one."""
    job = _job(tmp_path)
    job.write_text(job.read_text().replace("hbm_gb: 0.002", f"hbm_gb: {value}"))
    assert main(["plan", str(job), "--world-size", "4"]) == 2
    assert "sharding.hbm_gb: expected a finite number > 0" in capsys.readouterr().err


def test_impossible_grid_constraint_is_bad_input(tmp_path, capsys):
    path = tmp_path / "t.yaml"
    path.write_text("tables:\n- {name: a, num_embeddings: 1000, embedding_dim: 40, features: [f],"
                    " sharding: [grid_shard]}\n")
    assert main(["plan", str(path), "--world-size", "16", "--local-world-size", "8"]) == 2
    assert "['grid_shard'] cannot cut D=40: grid_shard one in [2, 2 hosts]" in (
        capsys.readouterr().err)
