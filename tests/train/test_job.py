"""The job end to end in one process: loss goes down, metrics, plan and checkpoints are
written; N steps == N/2 steps + --resume for N/2; a crash while saving keeps the last
checkpoint; the ``fbtriton-dist train`` command."""

import json
import os

import pytest
import torch
import yaml

from fbtriton_dist import cli, optim
from fbtriton_dist.train import checkpoint as ckpt
from fbtriton_dist.train.job import main

TINY = {
    "seed": 3,
    "deterministic": True,
    "tables": [
        {
            "name": "t_a",
            "num_embeddings": 300,
            "embedding_dim": 8,
            "features": ["a", "a2"],
            "pooling_factors": [2, 3],
            "id_distribution": {"kind": "zipf", "alpha": 1.1},
        },
        {
            "name": "t_b",
            "num_embeddings": 40,
            "embedding_dim": 8,
            "features": ["b"],
            "pooling": "mean",
        },
    ],
    "model": {"dense_arch": [16, 8], "over_arch": [8, 1]},
    "data": {"num_dense": 4, "synthetic": {"noise": 0.1}},
    "optimizer": {
        "embedding": {"type": "rowwise_adagrad", "lr": 0.1},
        "dense": {"type": "adagrad", "lr": 0.1},
    },
    "train": {"steps": 40, "batch_size": 64, "eval_every": 20, "eval_batches": 2},
    "checkpoint": {"every": 20, "keep": 2},
    "logging": {"log_every": 10, "progress_bar": False},
}


def write_job(tmp_path, name="tiny", **changes):
    data = json.loads(json.dumps(TINY))
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            data.setdefault(section, {})[field] = value
        else:
            data[section] = value
    data.setdefault("logging", {})["run_dir"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_job_trains_and_writes_everything(tmp_path, capsys):
    assert main(["--config", str(write_job(tmp_path))]) == 0
    run = tmp_path / "tiny"
    train = records(run, "train")
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert train[-1]["loss"] < 0.8 * train[0]["loss"]
    assert set(train[-1]["ms"]) == {"lookup", "dense", "backward"}
    evals = records(run, "eval")
    assert [r["step"] for r in evals] == [20, 40] and evals[-1]["auc"] > 0.7
    (summary,) = records(run, "summary")
    assert summary["steps"] == 40 and summary["samples_per_s"] > 0
    assert yaml.safe_load((run / "plan.yaml").read_text())["world_size"] == 1
    assert sorted(os.listdir(run / "checkpoints")) == ["step_00000020", "step_00000040"]
    out = capsys.readouterr().out
    assert "t_a" in out and "training summary" in out and "eval_auc" in out


def losses(run_dir):
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


@pytest.mark.parametrize("embedding", optim.NAMES)  # every fused optimizer of the registry
def test_resume_repeats_the_uninterrupted_run(tmp_path, embedding):
    opt = {"embedding": {"type": embedding, "lr": 0.05}, "dense": {"type": "adam", "lr": 0.01}}
    common = {
        "logging__log_every": 1,
        "train__steps": 12,
        "train__eval_every": 0,
        "train__eval_batches": 0,
        "checkpoint__every": 6,
        "optimizer": opt,
    }
    full = write_job(tmp_path, "full", **common)
    half = write_job(tmp_path, "half", **common)
    assert main(["--config", str(full)]) == 0
    assert main(["--config", str(half), "--steps", "6"]) == 0
    assert main(["--config", str(half), "--resume"]) == 0
    want, got = losses(tmp_path / "full"), losses(tmp_path / "half")
    assert sorted(got) == list(range(1, 13))
    for step in range(7, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-6, rel=0), step
    assert [r["steps_this_run"] for r in records(tmp_path / "half", "summary")] == [6, 6]


def test_plan_counts_adagrad_state_per_element(tmp_path):
    """The job plans elementwise Adagrad with its own state (one fp32 per element, as much as
    the fp32 weights), not as Adam's two moments: a budget between the two fits it."""
    from fbtriton_dist.planner import PlanError
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.job import GiB, make_plan

    weights = (300 + 40) * 8 * 4  # TINY's tables, fp32
    budget = 2.5 * weights  # weights + adagrad's state fit, weights + adam's do not
    sharding = {"hbm_gb": budget / 0.9 / GiB, "reserved": 0.1}

    def job(kind):
        opt = {"embedding": {"type": kind, "lr": 0.1}, "dense": {"type": "adam", "lr": 0.1}}
        return load_job(write_job(tmp_path, kind, optimizer=opt, sharding=sharding))

    plan, report = make_plan(job("adagrad"), 1, 1)
    rank0 = next(line for line in report.splitlines() if line.startswith("0 "))
    assert rank0.split()[1:5] == ["21.2", "KiB", "10.6", "KiB"]  # memory, weights: state 10.6
    with pytest.raises(PlanError, match="optimizer state"):
        make_plan(job("adam"), 1, 1)


def test_resume_without_checkpoint_starts_fresh(tmp_path, capsys):
    path = write_job(tmp_path, train__steps=2, train__eval_batches=0)
    assert main(["--config", str(path), "--resume", "checkpoint.enabled=false"]) == 0
    assert "no complete checkpoint" in capsys.readouterr().out
    assert not (tmp_path / "tiny" / "checkpoints").exists()


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = write_job(tmp_path, train__steps=4, train__eval_batches=0, checkpoint__every=2)
    real_save = ckpt.dcp.save
    calls = []

    def crashing_save(state, **kw):
        calls.append(kw["checkpoint_id"])
        if len(calls) == 2:
            real_save(state, **kw)  # files written, then the process "dies" before the rename
            raise KeyboardInterrupt("killed while saving")
        return real_save(state, **kw)

    monkeypatch.setattr(ckpt.dcp, "save", crashing_save)
    with pytest.raises(KeyboardInterrupt):
        main(["--config", str(path)])
    folder = tmp_path / "tiny" / "checkpoints"
    assert sorted(os.listdir(folder)) == [".tmp-step_00000004", "step_00000002"]
    assert ckpt.latest_checkpoint(str(folder)).endswith("step_00000002")
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    assert main(["--config", str(path), "--resume"]) == 0
    assert sorted(os.listdir(folder)) == ["step_00000002", "step_00000004"]
    assert [r["steps_this_run"] for r in records(tmp_path / "tiny", "summary")] == [2]


def test_checkpoint_round_trip_restores_every_state(tmp_path):
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.job import _dense_optimizer, build_model

    cfg = load_job(write_job(tmp_path, optimizer={"embedding": {"type": "adam", "lr": 0.1}}))
    model = build_model(cfg, torch.device("cpu"))
    dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    opt = _dense_optimizer(cfg.optimizer.dense, dense)
    from fbtriton_dist.train.data import DataPosition, make_source

    src = make_source(cfg.tables, cfg.data, batch_size=8, seed=0, rank=0, world_size=1)
    for (b, _), _ in zip(src.train_batches(DataPosition()), range(2), strict=False):
        torch.nn.functional.binary_cross_entropy_with_logits(
            model(b.dense, b.sparse).squeeze(-1), b.labels
        ).backward()
        opt.step()
    fused = ckpt.fused_optimizer_state_dict(model)
    prefix = "sparse_arch.embedding_bag_collection."
    assert int(fused[f"{prefix}step"]) == 2
    assert fused[f"{prefix}embedding_bags.t_a.weight.1"].shape == (300, 8)  # Adam's 2nd moment
    path = ckpt.save_checkpoint(
        str(tmp_path / "c"), 2, model, opt, {"step": 2, "epoch": 0, "samples": 16}
    )
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_fused = {k: v.clone() if torch.is_tensor(v) else v for k, v in fused.items()}

    fresh = build_model(cfg, torch.device("cpu"))
    fresh_opt = _dense_optimizer(
        cfg.optimizer.dense, [p for n, p in fresh.named_parameters() if "embedding_bags" not in n]
    )
    state = ckpt.load_checkpoint(path, fresh, fresh_opt)
    assert state == {"step": 2, "epoch": 0, "samples": 16}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    got = ckpt.fused_optimizer_state_dict(fresh)
    for k, v in want_fused.items():
        assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v, k
    a, b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(a[i]["sum"], b[i]["sum"]) for i in a)


def test_cli_train_subcommand_and_errors(tmp_path, capsys):
    path = write_job(tmp_path, train__steps=2, train__eval_batches=0)
    argv = ["train", "--config", str(path), "--steps", "2", "checkpoint.enabled=false"]
    assert cli.main(argv) == 0
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", str(path), "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert cli.main(["train", "--config", str(path), "train.stepz=3"]) == 2
    assert "train.stepz: unknown key" in capsys.readouterr().err
    assert main(["--config", str(path), "optimizer.dense.type=lamb"]) == 2
    assert "optimizer.dense.type: expected one of [sgd, adagrad, adam, adamw]" in (
        capsys.readouterr().err
    )


def test_single_process_never_initialises_a_process_group(monkeypatch):
    from fbtriton_dist.train.job import distributed

    monkeypatch.setenv("WORLD_SIZE", "1")
    with distributed("cpu") as env:
        assert (env.rank, env.world_size, env.process_group) == (0, 1, None)
        assert not torch.distributed.is_initialized()


def test_sharded_stages_are_timed():
    """A module with input_dist / compute / output_dist (the sharded EBC) is timed per stage."""
    from fbtriton_dist.train.loop import time_embeddings
    from fbtriton_dist.train.metrics import StageTimer

    class Staged(torch.nn.Module):
        def input_dist(self, x):
            return x + 1

        def compute(self, x):
            return x * 2

        def output_dist(self, x):
            return x - 1

        def forward(self, x):
            return self.output_dist(self.compute(self.input_dist(x)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc, self.plain = Staged(), torch.nn.Identity()

        def forward(self, x):
            return self.plain(self.ebc(x))

    timer = StageTimer("cpu", warmup_steps=0)
    model = Model()
    time_embeddings(model, ["ebc", "plain"], timer)
    assert model(torch.ones(2)).tolist() == [3.0, 3.0]
    timer.step_done()
    assert list(timer.take()) == ["input_dist", "lookup", "output_dist"]


def test_criteo_job_runs_epochs_and_evaluates_on_files(tmp_path):
    import random

    from tests.train.test_data import criteo_line

    rng = random.Random(1)
    for name, n in (("train.tsv", 50), ("eval.tsv", 30)):
        (tmp_path / name).write_text("".join(criteo_line(rng) for _ in range(n)))
    tables = [
        {"name": f"t{j}", "num_embeddings": 20 + j, "embedding_dim": 4, "features": [f"c{j}"]}
        for j in range(26)
    ]
    path = write_job(
        tmp_path,
        tables=tables,
        model={"dense_arch": [8, 4], "over_arch": [4, 1]},
        data={"source": "criteo", "criteo": {"train": ["train.tsv"], "eval": ["eval.tsv"]}},
        train={"epochs": 2, "batch_size": 8, "eval_batches": 10},
        logging__log_every=1,
    )
    assert main(["--config", str(path)]) == 0
    train = records(tmp_path / "tiny", "train")
    assert [r["step"] for r in train] == list(range(1, 13))  # 50 // 8 = 6 steps per epoch
    assert [r["epoch"] for r in train] == [0] * 6 + [1] * 5 + [1]  # position after the step
    (ev,) = records(tmp_path / "tiny", "eval")
    assert ev["samples"] == 24


def test_random_rec_job(tmp_path):
    path = write_job(
        tmp_path,
        data={"source": "random_rec", "num_dense": 4},
        train__steps=3,
        checkpoint__enabled=False,
    )
    assert main(["--config", str(path)]) == 0
    assert [r["step"] for r in records(tmp_path / "tiny", "train")] == [3]


def test_build_model_puts_every_dense_tensor_on_the_device(tmp_path):
    """TorchRec's DLRM leaves its interaction's ``triu_indices`` on the CPU whatever
    ``dense_device`` says; on CUDA that buffer was copied from pageable memory every step and
    broke the CUDA graph capture (H200, 2026-12-03). The meta device shows it on a CPU."""
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.job import build_model

    cfg = load_job(write_job(tmp_path))
    model = build_model(cfg, torch.device("meta"))
    dense = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]
             if "embedding_bags" not in n}
    assert "inter_arch.triu_indices" in dense
    assert {n: t.device.type for n, t in dense.items() if t.device.type != "meta"} == {}


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_sharded_job_runs_the_configured_backend(tmp_path, backend):
    """``backend:`` reaches the sharded collections too (``fbtriton_dist.shard``), not only a
    single process's: a one-rank gloo group, every TBE of the sharded model on it."""
    import torch.distributed as dist

    from fbtriton_dist.sharding.modules.collection import ShardedCollection
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.env import Env
    from fbtriton_dist.train.job import build, make_plan

    cfg = load_job(write_job(tmp_path, backend=backend))
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        env = Env(rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  process_group=dist.group.WORLD)
        plan, _ = make_plan(cfg, 1, 1)
        built = build(cfg, env, plan)
        sharded = [m for m in built.model.modules() if isinstance(m, ShardedCollection)]
        tbes = [t for m in sharded for t in m.tbes]
        assert sharded and {m.backend for m in sharded} == {backend}
        assert tbes and {t.backend for t in tbes} == {backend}
    finally:
        dist.destroy_process_group()
