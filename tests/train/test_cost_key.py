"""The job's ``sharding.cost`` (the planner's bandwidths): read, checked, given to the planner,
and overridden key by key by ``plan JOB.yaml --cost FILE.yaml``."""

import pytest
import yaml

from fbtriton_dist.cli import main
from fbtriton_dist.planner import ConfigError, CostModel
from fbtriton_dist.train.config import load_job
from fbtriton_dist.train.planning import plan_job

JOB = {"tables": [{"name": "c", "num_embeddings": 20000, "embedding_dim": 16, "features": ["c"],
                   "storage": {"tier": "cached", "cache_load_factor": 0.1}}],
       "model": {"dense_arch": [8, 16], "over_arch": [8, 1]}, "train": {"steps": 1},
       "sharding": {"cost": {"host_tier_bandwidth": 1.0e9, "hbm_bandwidth": "3e11"}}}


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_job_cost_key_round_trip_and_plan_override(tmp_path, capsys):
    job = _write(tmp_path / "job.yaml", JOB)
    cfg = load_job(job)
    assert cfg.sharding.cost == {"host_tier_bandwidth": 1e9, "hbm_bandwidth": 3e11}
    model = plan_job(cfg, 1, 1).planner.cost_model
    assert (model.host_tier_bandwidth, model.hbm_bandwidth) == (1e9, 3e11)
    assert model.disk_bandwidth == CostModel().disk_bandwidth  # not given: the default
    # plan JOB --cost FILE: the file's keys over the job's, the job's other keys kept
    cost = tmp_path / "cost.yaml"
    cost.write_text("cost: {host_tier_bandwidth: 4.0e+10}\n")
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(job), "--world-size", "1", "--cost", str(cost),
                 "--out", str(out)]) == 0
    capsys.readouterr()
    header = out.read_text()
    assert "host_tier_bandwidth 4e+10" in header and "hbm_bandwidth 3e+11" in header
    # bad values name the job file and the key path
    for bad, message in (({"pcie": 1.0}, "sharding.cost.pcie: unknown key, expected one of "
                                         r"\[hbm_bandwidth"),
                         ({"disk_bandwidth": -2.0}, "sharding.cost.disk_bandwidth: expected a "
                                                    "finite number of bytes/s > 0, got -2.0"),
                         ([1.0], "sharding.cost: expected a mapping")):
        data = {**JOB, "sharding": {"cost": bad}}
        with pytest.raises(ConfigError, match=message) as e:
            load_job(_write(tmp_path / "bad.yaml", data))
        assert "bad.yaml" in str(e.value)
