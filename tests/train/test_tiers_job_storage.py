"""Where a job's tiered tables live: in one process the tables are built on the tier the plan
chose (``storage: auto``), not only the table set's."""

import json

import pytest
import yaml

from fbtriton_dist.train import job
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
