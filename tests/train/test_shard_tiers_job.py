"""The job's ``sharding.shard_tiers``: the planner's tier per shard from a job file. A
``storage: auto`` table the planner caches gets its hot row block back on ``device``
(checked, the plan and ``fbtriton-dist plan JOB.yaml --shard-tiers`` alike), and the job on 2
gloo ranks builds each shard on its own tier and trains bit for bit as with the key off (the
same row cuts, the table ``cached`` on both shards)."""

import json

import pytest
import yaml

from fbtriton_dist.planner import ConfigError
from fbtriton_dist.storage import Storage
from fbtriton_dist.train.config import job_from_dict
from fbtriton_dist.train.planning import plan_job
from tests.train.test_job import TINY, losses, records

CACHED = Storage(tier="cached", cache_load_factor=0.3609, policy="lru")


def _data(tmp_path, name, shard_tiers=None):
    """t_a: 2,000 rows of Zipf(1.1) ids, 2,000 x (8 x 4 B + 4 B of rowwise Adagrad's state) =
    72,000 B, with t_b's 36,000 B over 2 x 51,300 B of device budget: the planner caches t_a
    (10 % of the budget left for the search) and cuts its rows at 336 (hot rows on rank 0)."""
    data = json.loads(json.dumps(TINY))
    data["tables"][0].update(num_embeddings=2000, storage="auto", pooling_factors=[1, 1])
    data["tables"][1].update(num_embeddings=1000)
    data["train"] = {"steps": 6, "batch_size": 32, "eval_every": 0, "eval_batches": 0}
    data["checkpoint"] = {"enabled": False}
    data["logging"] = {"log_every": 1, "progress_bar": False, "run_dir": str(tmp_path / name)}
    data["sharding"] = {"hbm_gb": 51_300 / 2**30, "reserved": 0.0}
    if shard_tiers is not None:
        data["sharding"]["shard_tiers"] = shard_tiers
    return data


def _write(tmp_path, name, shard_tiers=None):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_data(tmp_path, name, shard_tiers)))
    return path


def test_key_reaches_the_planner_and_is_checked(tmp_path, capsys):
    off = job_from_dict(_data(tmp_path, "off"), "x.yaml")
    assert off.sharding.shard_tiers is False  # the default
    plan = plan_job(off, 2, 2).plan.table("t_a")
    assert plan.storage == CACHED and not plan.per_shard_storage
    on = plan_job(job_from_dict(_data(tmp_path, "on", True), "x.yaml"), 2, 2).plan.table("t_a")
    assert on.storage == CACHED  # the cold shard's, the default of the shards
    assert [(s.rank, s.row_start, s.row_end, s.storage) for s in on.shards] == [
        (0, 0, 336, Storage(tier="device")), (1, 336, 2000, None)]
    assert [(s.row_start, s.row_end) for s in plan.shards] == [(0, 336), (336, 2000)]
    for bad in (1, "yes", None):
        data = _data(tmp_path, "bad")
        data["sharding"]["shard_tiers"] = bad
        with pytest.raises(ConfigError, match=r"x.yaml: sharding.shard_tiers: expected true or "
                                              rf"false, got {bad!r}"):
            job_from_dict(data, "x.yaml")
    # the plan command with a job file: --shard-tiers sets the key
    from fbtriton_dist.cli import main

    out = tmp_path / "plan.yaml"
    assert main(["plan", str(_write(tmp_path, "cli")), "--world-size", "2", "--shard-tiers",
                 "--out", str(out)]) == 0
    shards = yaml.safe_load(out.read_text())["tables"][0]["shards"]
    assert [s.get("storage") for s in shards] == [{"tier": "device"}, None]


def _two_jobs(rank, world, tmp_path):
    """Both jobs on this rank, one after the other in one start-up of the ranks (the job's
    ``train`` with the harness's process group; the run's picture is not drawn)."""
    import torch

    from fbtriton_dist.train import job

    job.picture_line = lambda *_: "picture skipped: not drawn in tests"
    env = job.Env(rank=rank, world_size=world, local_world_size=world,
                  device=torch.device("cpu"), process_group=torch.distributed.group.WORLD)
    for name, shard_tiers in (("off", None), ("on", True)):
        job.train(job_from_dict(_data(tmp_path, name, shard_tiers), f"{name}.yaml"), env)


def test_job_on_two_ranks_trains_its_shard_tiers_as_the_table_tier(tmp_path):
    from tests.sharding.harness import run_ranks

    run_ranks(_two_jobs, 2, tmp_path, timeout=240)
    plan = yaml.safe_load((tmp_path / "on" / "plan.yaml").read_text())["tables"][0]
    assert plan["storage"]["tier"] == "cached"
    assert [s.get("storage") for s in plan["shards"]] == [{"tier": "device"}, None]
    want, got = losses(tmp_path / "off"), losses(tmp_path / "on")
    assert sorted(got) == list(range(1, 7)) and got == want  # bit for bit
    # only the cold shard (rank 1) is behind a cache: fewer rows fetched per step
    (on,), (off,) = records(tmp_path / "on", "summary"), records(tmp_path / "off", "summary")
    c_on, c_off = on["caches"]["t_a"], off["caches"]["t_a"]
    assert 0 < c_on["fetched_per_step"] < c_off["fetched_per_step"]


def test_a_shard_on_file_gets_the_runs_own_folder_and_is_checked(tmp_path):
    """A plan file's shard on ``file`` (its own path): the run's folder in that path, as a
    table's; a path that cannot be written is refused naming the shard."""
    from fbtriton_dist.train.file_tier import check_file_dirs, run_folder, with_run_folders

    plan = plan_job(job_from_dict(_data(tmp_path, "on", True), "x.yaml"), 2, 2).plan
    rows = tmp_path / "rows"
    plan = plan.with_shard_storage({"t_a": {1: {"tier": "file", "path": str(rows)}}})
    run = with_run_folders(plan, str(tmp_path / "on"))
    folder = rows / run_folder(str(tmp_path / "on"))
    shards = run.table("t_a").shards
    assert shards[1].storage.path == str(folder) and shards[0].storage == plan.table(
        "t_a").shards[0].storage  # device: unchanged
    check_file_dirs(run, {})
    assert folder.is_dir()
    (tmp_path / "a_file").write_text("")
    bad = with_run_folders(plan.with_shard_storage({"t_a": {1: {
        "tier": "file", "path": str(tmp_path / "a_file" / "rows")}}}), str(tmp_path / "on"))
    with pytest.raises(ConfigError, match=r"<job>: sharding.plan: expected a writable directory "
                                          r"for the files of table 't_a' shard 1 \(rank 1: rows "
                                          r"336\.\.2000, cols 0\.\.8\) \(tier 'file'\)"):
        check_file_dirs(bad, {})
