"""Where a job's tiered tables live: in one process the tables are built on the tier the plan
chose (``storage: auto``), not only the table set's."""

import json

import pytest
import yaml

from fbtriton_dist.planner import ConfigError
from fbtriton_dist.train import job
from fbtriton_dist.train.config import job_from_dict
from fbtriton_dist.train.job import main
from tests.train.test_job import TINY, records


@pytest.fixture(autouse=True)
def no_picture(monkeypatch):
    """The run's picture (matplotlib) is most of a tiny job's time, and not tested here."""
    monkeypatch.setattr(job, "picture_line", lambda *_: "picture skipped: not drawn in tests")


def _job(tmp_path, name, storage, **sharding):
    data = json.loads(json.dumps(TINY))
    data["tables"][0].update(num_embeddings=3000, storage=storage)
    data["train"] = {"steps": 2, "batch_size": 32, "eval_every": 0, "eval_batches": 0}
    data["checkpoint"] = {"enabled": False}
    data["logging"] = {"log_every": 2, "progress_bar": False, "run_dir": str(tmp_path / name)}
    data["sharding"] = sharding
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_one_process_builds_the_tier_the_plan_chose(tmp_path):
    # t_a: 3000 rows x (8 x 4 B + rowwise Adagrad's 4 B) = 108,000 B, over a 60,000 B budget
    path = _job(tmp_path, "auto", "auto", hbm_gb=60_000 / 2**30, reserved=0.0)
    assert main(["--config", str(path)]) == 0
    plan = yaml.safe_load((tmp_path / "auto" / "plan.yaml").read_text())
    assert plan["tables"][0]["storage"]["tier"] == "cached"
    (summary,) = records(tmp_path / "auto", "summary")
    assert set(summary["caches"]) == {"t_a"}  # built cached: its cache's counts
    assert summary["caches"]["t_a"]["fetched_per_step"] > 0


def _file_job(tmp_path, name, file_dir):
    # t_a (108,000 B with its state, + its 12,000 B slot map) fits neither the 60,000 B of
    # device nor the 50,000 B of host memory: the planner puts it on 'file'
    return _job(tmp_path, name, "auto", hbm_gb=60_000 / 2**30, reserved=0.0,
                host_budget_gb=50_000 / 2**30, file_dir=file_dir)


def test_file_dir_key_keeps_each_runs_files_apart(tmp_path):
    rows = tmp_path / "rows"
    assert main(["--config", str(_file_job(tmp_path, "one", "rows"))]) == 0  # job-relative
    (first,) = rows.iterdir()
    assert first.name.startswith("one-") and (first / "t_a.weight").exists()
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    assert main(["--config", str(_file_job(tmp_path, "two", str(rows)))]) == 0
    folders = sorted(p.name for p in rows.iterdir())
    assert len(folders) == 2 and folders[1].startswith("two-")
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before  # untouched
    # the run's plan names the directory the key gave, the tier the planner chose
    plan = yaml.safe_load((tmp_path / "two" / "plan.yaml").read_text())
    assert plan["tables"][0]["storage"]["tier"] == "file"
    assert plan["tables"][0]["storage"]["path"] == str(rows)


def test_file_dir_not_writable_is_refused(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert main(["--config", str(_file_job(tmp_path, "bad", "a_file/rows"))]) == 2
    err = capsys.readouterr().err
    assert "sharding.file_dir: expected a writable directory for the files of table 't_a'" in err
    assert "a_file/rows" in err and not (tmp_path / "bad" / "metrics.jsonl").exists()
    data = yaml.safe_load(_file_job(tmp_path, "empty", "").read_text())
    with pytest.raises(ConfigError, match=r"x.yaml: sharding.file_dir: expected a non-empty "
                                          r"string, got ''"):
        job_from_dict(data, "x.yaml")
