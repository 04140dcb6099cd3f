"""The job with tables on storage tiers: the table set's ``storage:`` key (checked, errors
naming the table and key), the planner's memory model of a cached table (its caches on the
device, its backing store against the host budget), and a short job on 2 gloo ranks with a
cached table, whose losses are those of the same job on ``device`` (its pipeline reads the
next batch's rows ahead) and whose metrics report the cache's hit rate, rows fetched / written
back per step and the prefetch's rows and hidden / exposed time; in one process, a ``file``
table whose rows the plain loop reads ahead, bit for bit as without."""

import json

import pytest
import yaml

from fbtriton_dist.planner import ConfigError, PlanError, ShardingPlanner, TableSpec
from fbtriton_dist.planner.memory import block_bytes, host_block_bytes
from fbtriton_dist.planner.tables import table_set_from_dict
from fbtriton_dist.storage import Storage
from tests.train.test_job import TINY, losses, records


def _tables(storage):
    return {"tables": [{"name": "t_a", "num_embeddings": 100, "embedding_dim": 8,
                        "features": ["a"], "storage": storage}]}


def test_table_set_reads_storage_and_names_the_table_and_key_in_errors():
    ts = table_set_from_dict(_tables({"tier": "cached", "cache_load_factor": 0.1,
                                      "policy": "lfu"}))
    assert ts.tables[0].storage == Storage(tier="cached", cache_load_factor=0.1, policy="lfu")
    assert table_set_from_dict(_tables("cached")).tables[0].tier == "cached"
    assert table_set_from_dict(_tables(None)).tables[0].tier == "device"
    with pytest.raises(ConfigError, match=r"tables\[0\]\.storage: table 't_a' storage\.tier: "
                                          r"expected one of \['device'"):
        table_set_from_dict(_tables({"tier": "cachd"}))
    with pytest.raises(ConfigError, match=r"tables\[0\]\.storage: table 't_a' storage: unknown "
                                          r"keys \['load_factor'\]"):
        table_set_from_dict(_tables({"tier": "cached", "load_factor": 0.1}))
    with pytest.raises(ConfigError, match=r"tables\[0\]\.storage: .*'file' needs the directory"):
        table_set_from_dict(_tables("file"))
    managed = _tables("cached")
    managed["tables"][0].update(num_embeddings=11, id_manager={"capacity": 10})
    with pytest.raises(ConfigError, match=r"tables\[0\]\.storage: table 't_a' is managed"):
        table_set_from_dict(managed)


def test_planner_counts_the_cache_on_the_device_and_the_rows_on_the_host():
    spec = TableSpec(name="t", num_embeddings=1000, embedding_dim=16, features=("f",),
                     storage=Storage(tier="cached", cache_load_factor=0.1))
    device = TableSpec(name="t", num_embeddings=1000, embedding_dim=16, features=("f",))
    # rowwise Adagrad: 16 x 4 B of weights + 4 B of state per row
    # + the slot map on the device: 4 B per row, 38 B per slot
    assert block_bytes(spec, 500, 16, "rowwise_adagrad") == 50 * 68 + 500 * 4 + 50 * 38
    assert host_block_bytes(spec, 500, 16, "rowwise_adagrad") == 500 * 68
    assert block_bytes(device, 500, 16, "rowwise_adagrad") == 500 * 68
    assert host_block_bytes(device, 500, 16, "rowwise_adagrad") == 0
    filed = TableSpec(name="t", num_embeddings=1000, embedding_dim=16, features=("f",),
                      storage=Storage(tier="file", path="/tmp", cache_slots=10))
    assert host_block_bytes(filed, 500, 16, "rowwise_adagrad") == 500 * 4  # rows on disk
    # 68,000 B: too big for a 20,000 B device budget on 2 ranks, fits as a 10% cache
    planner = ShardingPlanner(world_size=2, hbm_bytes_per_rank=20_000, reserved_fraction=0.0)
    with pytest.raises(PlanError):
        planner.plan([device])
    plan = planner.plan([spec])
    assert plan.tables[0].storage == spec.storage
    assert plan.tables[0].sharding != "data_parallel"
    small_host = ShardingPlanner(world_size=2, hbm_bytes_per_rank=20_000, reserved_fraction=0.0,
                                 host_bytes_per_rank=10_000)
    with pytest.raises(PlanError, match="host memory: rank . needs .* of host memory"):
        small_host.plan([spec])


PLAN_2 = {"version": 1, "world_size": 2, "local_world_size": 2, "tables": [
    {"name": "t_a", "sharding": "row_wise", "num_embeddings": 3000, "embedding_dim": 8,
     "shards": [{"rank": 0, "rows": [0, 1400], "cols": [0, 8]},
                {"rank": 1, "rows": [1400, 3000], "cols": [0, 8]}]},
    {"name": "t_b", "sharding": "table_wise", "num_embeddings": 40, "embedding_dim": 8,
     "shards": [{"rank": 1, "rows": [0, 40], "cols": [0, 8]}]},
]}


def _job(tmp_path, name, storage):
    data = json.loads(json.dumps(TINY))
    data["tables"][0].update(num_embeddings=3000, storage=storage)
    data["train"] = {"steps": 8, "batch_size": 32, "eval_every": 0, "eval_batches": 1}
    data["checkpoint"] = {"every": 8, "keep": 1}
    data["logging"] = {"log_every": 4, "progress_bar": False, "run_dir": str(tmp_path / name)}
    (tmp_path / "plan2.yaml").write_text(yaml.safe_dump(PLAN_2))
    data["sharding"] = {"plan": "plan2.yaml"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_job_on_two_ranks_with_a_cached_table(tmp_path):
    from tests.train.test_multirank import ok, torchrun

    args = ["fbtriton_dist.train", "--config"]
    ok(torchrun(2, *args, str(_job(tmp_path, "device", None))))
    cached = _job(tmp_path, "cached", {"tier": "cached", "cache_load_factor": 0.3,
                                       "policy": "lru"})
    data = yaml.safe_load(cached.read_text())
    data["train"]["prefetch_rows"] = True  # auto reads only file tables' rows ahead
    cached.write_text(yaml.safe_dump(data))
    out = ok(torchrun(2, *args, str(cached)))
    assert "caches.t_a: hit_rate" in out
    assert losses(tmp_path / "cached") == losses(tmp_path / "device")
    train = records(tmp_path / "cached", "train")
    assert [r["step"] for r in train] == [4, 8]
    for r in train:
        (name,) = r["caches"]
        c = r["caches"][name]
        assert name == "t_a" and 0 < c["hit_rate"] < 1 and c["steps"] == 4
        assert c["fetched_per_step"] > 0 and c["written_back_per_step"] >= 0
        # the overlap pipeline (auto on 2 ranks) read rows ahead and the lookups used them
        # (train.prefetch_rows: true)
        # (a step's prefetch is used by the next step, maybe in the next window)
        assert c["prefetched_per_step"] > 0
        assert 0 < c["prefetch_used_per_step"] <= c["fetched_per_step"]
        assert c["prefetch_hidden_ms"] >= 0 and c["prefetch_exposed_ms"] >= 0
        assert c["prefetch_hidden_ms"] + c["prefetch_exposed_ms"] > 0
    assert sum(r["caches"]["t_a"]["written_back_per_step"] for r in train) > 0
    (summary,) = records(tmp_path / "cached", "summary")
    whole = summary["caches"]["t_a"]
    assert 0 < whole["prefetch_used_per_step"] <= whole["prefetched_per_step"]
    plan = yaml.safe_load((tmp_path / "cached" / "plan.yaml").read_text())
    assert plan["tables"][0]["storage"] == {"tier": "cached", "cache_load_factor": 0.3,
                                            "policy": "lru"}
    assert "storage" not in plan["tables"][1]
    assert "caches" not in records(tmp_path / "device", "train")[0]


def _checkpoint_state(tmp_path, run, config):
    """The model state dict and fused optimizer state of ``run``'s last checkpoint, loaded
    into the model of job file ``config`` built on ``device`` (whole tables either way)."""
    import torch

    from fbtriton_dist.train import checkpoint as ckpt
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.job import _dense_optimizer, build_model

    cfg = load_job(config)
    model = build_model(cfg, torch.device("cpu"))
    opt = _dense_optimizer(cfg.optimizer.dense, [
        p for n, p in model.named_parameters() if "embedding_bags" not in n])
    path = sorted((tmp_path / run / "checkpoints").iterdir())[-1]
    ckpt.load_checkpoint(str(path), model, opt)
    return {**model.state_dict(), **ckpt.fused_optimizer_state_dict(model)}


def test_job_in_one_process_reads_file_rows_ahead_exactly(tmp_path):
    """One process (the plain loop) with a ``file`` table: ``train.prefetch_rows: auto`` (the
    default) reads each next batch's missing rows ahead, and trains bit for bit as ``false``
    and as ``device`` (losses, weights and optimizer state after 8 steps, with an evaluation
    and a checkpoint in between); its metrics show rows read ahead and used, ``false``'s none,
    and a ``cached`` table's none under ``auto``."""
    import torch

    from fbtriton_dist.train.job import main

    runs = {"device": (None, None),
            "ahead": ({"tier": "file", "cache_load_factor": 0.06,
                       "path": str(tmp_path / "rows")}, None),
            "not_ahead": ({"tier": "file", "cache_load_factor": 0.06,
                           "path": str(tmp_path / "rows")}, False),
            "cached": ({"tier": "cached", "cache_load_factor": 0.06}, None)}
    for name, (storage, prefetch_rows) in runs.items():
        path = _job(tmp_path, name, storage)
        data = yaml.safe_load(path.read_text())
        del data["sharding"]  # one process: no plan file for 2 ranks
        data["train"]["eval_every"] = 4
        data["checkpoint"] = {"every": 4, "keep": 1}
        if prefetch_rows is not None:
            data["train"]["prefetch_rows"] = prefetch_rows
        path.write_text(yaml.safe_dump(data))
        assert main(["--config", str(path)]) == 0
    assert losses(tmp_path / "ahead") == losses(tmp_path / "device")
    assert losses(tmp_path / "not_ahead") == losses(tmp_path / "device")
    assert losses(tmp_path / "cached") == losses(tmp_path / "device")
    want = _checkpoint_state(tmp_path, "device", tmp_path / "device.yaml")
    for name in ("ahead", "not_ahead"):
        got = _checkpoint_state(tmp_path, name, tmp_path / "device.yaml")
        assert want.keys() == got.keys()
        for k, v in want.items():
            assert torch.equal(v, got[k]) if torch.is_tensor(v) else v == got[k], (name, k)
    (summary,) = records(tmp_path / "ahead", "summary")
    c = summary["caches"]["t_a"]
    assert c["steps"] == 8 and c["evicted_per_step"] > 0
    assert c["prefetched_per_step"] > 0
    assert 0 < c["prefetch_used_per_step"] <= min(c["prefetched_per_step"],
                                                  c["fetched_per_step"])
    assert c["prefetch_hidden_ms"] + c["prefetch_exposed_ms"] > 0
    for r in records(tmp_path / "ahead", "train"):  # every window read rows ahead
        assert r["caches"]["t_a"]["prefetched_per_step"] > 0
    (off,) = records(tmp_path / "not_ahead", "summary")
    assert off["caches"]["t_a"]["prefetched_per_step"] == 0
    assert off["caches"]["t_a"]["fetched_per_step"] == c["fetched_per_step"]
    (cached,) = records(tmp_path / "cached", "summary")  # auto: a cached table is not read
    assert cached["caches"]["t_a"]["prefetched_per_step"] == 0  # ahead
    assert cached["caches"]["t_a"]["fetched_per_step"] == c["fetched_per_step"]
    (folder, _) = sorted((tmp_path / "rows").iterdir())  # each run's own folder
    assert folder.name.startswith(("ahead-", "not_ahead-")) and (folder / "t_a.weight").exists()


def test_plan_command_writes_storage_and_checks_the_host_budget(tmp_path, capsys):
    from fbtriton_dist.cli import main

    tables = tmp_path / "tables.yaml"
    tables.write_text(yaml.safe_dump({"tables": [
        {"name": "t_user", "num_embeddings": 1_000_000, "embedding_dim": 64,
         "features": ["user"], "storage": {"tier": "cached", "cache_load_factor": 0.1}},
        {"name": "t_item", "num_embeddings": 20_000, "embedding_dim": 64, "features": ["item"]},
    ]}))
    out = tmp_path / "plan.yaml"
    assert main(["plan", str(tables), "--world-size", "2", "--out", str(out)]) == 0
    plan = yaml.safe_load(out.read_text())
    assert plan["tables"][0]["storage"]["tier"] == "cached"
    assert main(["plan", str(tables), "--world-size", "2", "--host-budget-gb", "0.1"]) != 0
    assert "of host memory, budget 102.4 MiB: 't_user'" in capsys.readouterr().err


def test_job_with_a_cached_table_resumes_exactly_on_two_ranks(tmp_path):
    from tests.train.test_multirank import ok, torchrun

    storage = {"tier": "cached", "cache_load_factor": 0.3, "policy": "lfu"}
    paths = {}
    for name in ("full", "half"):
        path = _job(tmp_path, name, storage)
        data = yaml.safe_load(path.read_text())
        data["logging"]["log_every"] = 1
        data["checkpoint"] = {"every": 4, "keep": 2}
        path.write_text(yaml.safe_dump(data))
        paths[name] = str(path)
    args = ["fbtriton_dist.train", "--config"]
    ok(torchrun(2, *args, paths["full"]))
    ok(torchrun(2, *args, paths["half"], "--steps", "4"))
    ok(torchrun(2, *args, paths["half"], "--resume"))
    want, got = losses(tmp_path / "full"), losses(tmp_path / "half")
    assert sorted(got) == list(range(1, 9))
    assert all(got[s] == want[s] for s in range(5, 9))
