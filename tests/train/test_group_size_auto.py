"""``sharding.group_size: auto``: the job's plan picks the group size with the planner's
``propose_group_size`` (no process group: ``plan_job`` alone), and the plan it saves carries
it."""

import pytest
import yaml

from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.planner.groups import group_size_candidates
from fbtriton_dist.train.config import load_job
from fbtriton_dist.train.planning import group_size, plan_job
from tests.train.test_job import write_job


def test_auto_group_size_is_planned_saved_and_reloaded(tmp_path):
    cfg = load_job(write_job(tmp_path, sharding={"group_size": "auto", "replica_sync": 5}))
    assert cfg.sharding.group_size == "auto"
    with pytest.raises(ValueError, match="plan_job"):  # S is planned, not read off the config
        group_size(cfg, 4)
    # 4 ranks: one candidate (the world), planned once, flat
    small = plan_job(cfg, 4, 4)
    assert small.group_size == 4 and small.plan.group_size is None
    assert "sharding.group_size auto: 4 (the only candidate" in small.report
    # 16 ranks, 8 per host: S = 8 or 16 is proposed; the tiny tables' hot rows make 8 cheaper
    p = plan_job(cfg, 16, 8)
    assert group_size_candidates(16, 8) == [8, 16]
    assert p.group_size == 8 and 16 % p.group_size == 0
    assert (p.plan.world_size, p.plan.group_size, p.plan.replica_sync) == (16, 8, 5)
    assert "sharding.group_size auto: 8 (2 group(s) of 8 ranks)" in p.report
    assert "<- chosen" in p.report and "groups: 2 x 8 ranks" in p.report
    flat = plan_job(load_job(write_job(tmp_path, name="flat")), 16, 8)
    assert flat.group_size == 16 and p.cost.step_s < flat.cost.max()
    # the run's plan.yaml (what the job writes) holds S; the job reads it back as its plan
    path = tmp_path / "plan.yaml"
    p.plan.save_yaml(str(path), header="plan of job tiny")
    saved = yaml.safe_load(path.read_text())
    assert (saved["world_size"], saved["group_size"], saved["replica_sync"]) == (16, 8, 5)
    again = plan_job(cfg, 16, 8, plan_path=str(path))
    assert again.group_size == 8 and again.plan == ShardingPlan.load_yaml(str(path))
