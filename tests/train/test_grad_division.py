"""The job's ``sharding.gradient_division``: read, checked, and passed to the sharded
collections (what it does to a step: tests/sharding/test_grad_scale.py)."""

import pytest
import torch

from tests.train.test_job import write_job


def test_gradient_division_key_defaults_on_and_is_checked(tmp_path):
    from fbtriton_dist.planner import ConfigError
    from fbtriton_dist.train.config import load_job

    assert load_job(write_job(tmp_path)).sharding.gradient_division is True
    off = load_job(write_job(tmp_path, sharding={"gradient_division": False}))
    assert off.sharding.gradient_division is False
    with pytest.raises(ConfigError, match="sharding.gradient_division"):
        load_job(write_job(tmp_path, sharding={"gradient_division": "yes"}))


@pytest.mark.parametrize("division", [True, False])
def test_the_sharded_job_passes_gradient_division(tmp_path, division):
    """A one-rank gloo group: every sharded collection of the job's model gets the key."""
    import torch.distributed as dist

    from fbtriton_dist.sharding.modules.collection import ShardedCollection
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.env import Env
    from fbtriton_dist.train.job import build, make_plan

    cfg = load_job(write_job(tmp_path, sharding={"gradient_division": division}))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        env = Env(rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  process_group=dist.group.WORLD)
        plan, _ = make_plan(cfg, 1, 1)
        built = build(cfg, env, plan)
        sharded = [m for m in built.model.modules() if isinstance(m, ShardedCollection)]
        assert sharded and {m.comm.gradient_division for m in sharded} == {division}
    finally:
        dist.destroy_process_group()
