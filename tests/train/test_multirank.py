"""The job on several real processes (torchrun, gloo, CPU), each run under a timeout:

* 2 ranks: one rank is SIGKILLed mid-run after a checkpoint; ``--resume`` on 2 ranks repeats
  the uninterrupted run's losses step for step (deterministic mode);
* a checkpoint saved on 2 ranks (row-wise + table-wise tables) loads on 3 ranks with another
  plan (column-wise, data-parallel, uneven row-wise) and in one process, and gives the same
  predictions, eval loss and AUC on the same batch.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml

from tests.train import rank_driver
from tests.train.test_job import TINY, losses, records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 150

TABLES = [
    *TINY["tables"],
    {"name": "t_c", "num_embeddings": 100, "embedding_dim": 8, "features": ["c"]},
]


def _shards(*shards):
    return [{"rank": r, "rows": list(rows), "cols": list(cols)} for r, rows, cols in shards]


PLAN_2 = {  # what the job trains with: a row-wise table, and each rank lacks one table
    "version": 1,
    "world_size": 2,
    "local_world_size": 2,
    "tables": [
        {"name": "t_a", "sharding": "row_wise", "num_embeddings": 300, "embedding_dim": 8,
         "shards": _shards((0, (0, 120), (0, 8)), (1, (120, 300), (0, 8)))},
        {"name": "t_b", "sharding": "table_wise", "num_embeddings": 40, "embedding_dim": 8,
         "shards": _shards((1, (0, 40), (0, 8)))},
        {"name": "t_c", "sharding": "table_wise", "num_embeddings": 100, "embedding_dim": 8,
         "shards": _shards((0, (0, 100), (0, 8)))},
    ],
}  # fmt: skip


def _plan_3(kind):
    """Where the checkpoint is loaded: every table cut another way than in PLAN_2."""
    if kind == "tw_rw":  # t_a whole on rank 2; t_b and t_c in uneven row blocks on all ranks
        t_a = {"sharding": "table_wise", "shards": _shards((2, (0, 300), (0, 8)))}
        t_b = {
            "sharding": "row_wise",
            "shards": _shards((0, (0, 5), (0, 8)), (1, (5, 30), (0, 8)), (2, (30, 40), (0, 8))),
        }
    else:  # t_a in two column slices of 3 and 5 columns; t_b a replica on every rank
        t_a = {
            "sharding": "column_wise",
            "shards": _shards((0, (0, 300), (0, 3)), (2, (0, 300), (3, 8))),
        }
        t_b = {
            "sharding": "data_parallel",
            "shards": _shards(*[(r, (0, 40), (0, 8)) for r in range(3)]),
        }
    return {
        "version": 1,
        "world_size": 3,
        "local_world_size": 3,
        "tables": [
            {"name": "t_a", "num_embeddings": 300, "embedding_dim": 8, **t_a},
            {"name": "t_b", "num_embeddings": 40, "embedding_dim": 8, **t_b},
            {"name": "t_c", "sharding": "row_wise", "num_embeddings": 100, "embedding_dim": 8,
             "shards": _shards((0, (0, 10), (0, 8)), (1, (10, 60), (0, 8)), (2, (60, 100), (0, 8)))},
        ],
    }  # fmt: skip


def write_job(tmp_path, name, embedding="rowwise_adagrad", plan_3="tw_rw", comm=None, **train):
    data = json.loads(json.dumps(TINY))
    data["optimizer"]["embedding"]["type"] = embedding
    data["tables"] = TABLES
    data["train"] = {"steps": 12, "batch_size": 32, "eval_every": 0, "eval_batches": 1, **train}
    data["checkpoint"] = {"every": 5, "keep": 3}
    data["logging"] = {"log_every": 1, "progress_bar": False, "run_dir": str(tmp_path / name)}
    (tmp_path / "plan2.yaml").write_text(yaml.safe_dump(PLAN_2))
    (tmp_path / "plan3.yaml").write_text(yaml.safe_dump(_plan_3(plan_3)))
    data["sharding"] = {"plan": "plan2.yaml", **({"comm": comm} if comm else {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` (a free port) with ``nproc`` CPU processes; killed with its
    workers if it outlives RUN_TIMEOUT_S."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", "0", "-m", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FBTD_PG_TIMEOUT_S": "60"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {RUN_TIMEOUT_S} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


def test_sigkill_one_rank_then_resume_repeats_the_uninterrupted_run(tmp_path):
    full, half = write_job(tmp_path, "full"), write_job(tmp_path, "half")
    out = ok(torchrun(2, "fbtriton_dist.train", "--config", str(full)))
    assert "training summary" in out and "world_size: 2" in out

    # rank 1 dies (SIGKILL) after step 7: the checkpoint of step 5 is the newest one
    killed = torchrun(2, "tests.train.rank_driver", "kill", "1", "7", "--", "--config", str(half))
    assert killed.returncode != 0, killed.stdout[-4000:]
    ckpts = tmp_path / "half" / "checkpoints"
    assert sorted(p for p in os.listdir(ckpts) if p.startswith("step_")) == ["step_00000005"]
    assert not records(tmp_path / "half", "summary")

    out = ok(torchrun(2, "fbtriton_dist.train", "--config", str(half), "--resume"))
    assert "resumed from" in out and "step_00000005" in out
    want, got = losses(tmp_path / "full"), losses(tmp_path / "half")  # the last record wins
    assert sorted(want) == sorted(got) == list(range(1, 13))
    for step in range(1, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-6, rel=0), step
    (summary,) = records(tmp_path / "half", "summary")
    assert summary["steps"] == 12 and summary["steps_this_run"] == 7
    assert summary["eval_loss"] == pytest.approx(
        records(tmp_path / "full", "summary")[0]["eval_loss"]
    )


# Not ("rowwise_adagrad", "cw_dp"): a rowwise Adagrad table keeps one accumulator per row and
# column slice ([E, slices]), so that state cannot move from other plans' [E, 1] into a
# column-wise table (DCP refuses the size mismatch). Data-parallel state moves: see
# tests/sharding/test_checkpoint.py.
@pytest.mark.parametrize(
    ("embedding", "plan_3"),
    [("rowwise_adagrad", "tw_rw"), ("adagrad", "cw_dp")],
)
def test_checkpoint_from_2_ranks_loads_on_3_ranks_with_another_plan(tmp_path, embedding, plan_3):
    job = write_job(tmp_path, "job", embedding, plan_3, steps=6)
    ok(torchrun(2, "fbtriton_dist.train", "--config", str(job)))
    ckpt = str(tmp_path / "job" / "checkpoints" / "step_00000006")
    results = {}
    out = str(tmp_path / "predict3.json")
    ok(torchrun(3, "tests.train.rank_driver", "predict", str(job), ckpt, out,
                "sharding.plan=plan3.yaml"))
    results[3] = json.loads((tmp_path / "predict3.json").read_text())
    shardings = [t["sharding"] for t in results[3]["plan"]["tables"]]
    assert shardings == [t["sharding"] for t in _plan_3(plan_3)["tables"]]
    # and in this process, unsharded (no process group)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        out = str(tmp_path / "predict1.json")
        rank_driver.predict(str(job), ckpt, out, ["sharding.plan=null"])
    finally:
        torch.use_deterministic_algorithms(was)
    results[1] = json.loads((tmp_path / "predict1.json").read_text())

    # the unsharded load is the reference (2 ranks loading a 2-rank checkpoint: the SIGKILL
    # resume test)
    want = torch.tensor(results[1]["logits"])
    assert want.numel() == 96 and want.std() > 0.1  # a trained model, not a constant
    got = torch.tensor(results[3]["logits"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg="world 3")
    assert results[3]["loss"] == pytest.approx(results[1]["loss"], abs=1e-6)
    assert results[3]["auc"] == pytest.approx(results[1]["auc"], abs=1e-6)


def test_job_with_fixed_shapes_trains_like_the_default(tmp_path):
    """``sharding.comm.fixed_shapes: true``: no host sync per step, the same losses bit for
    bit (train and eval batches go through the fixed-size input dist)."""
    default = write_job(tmp_path, "default", steps=6, eval_every=3)
    fixed = write_job(tmp_path, "fixed", comm={"fixed_shapes": True, "max_ids": 4096}, steps=6,
                      eval_every=3)
    ok(torchrun(2, "fbtriton_dist.train", "--config", str(default)))
    ok(torchrun(2, "fbtriton_dist.train", "--config", str(fixed)))
    want, got = losses(tmp_path / "default"), losses(tmp_path / "fixed")
    assert sorted(want) == sorted(got) == list(range(1, 7))
    assert all(got[s] == want[s] for s in want)
    evals = [[r["loss"] for r in records(tmp_path / n, "eval")] for n in ("default", "fixed")]
    assert evals[0] and evals[0] == evals[1]


def test_job_trains_on_vbe_batches_like_on_the_same_samples_as_fixed_batches(tmp_path):
    """``data.synthetic.candidates_per_user: 4``: the user features (t_a's, row-wise over both
    ranks) come once per user (VBE), the items per sample; the job trains on them, and its
    losses are those of the same samples sent as fixed batches (``vbe: false``), up to the
    order of float sums."""
    runs = {}
    for name, vbe in (("vbe", True), ("expanded", False)):
        path = write_job(tmp_path, name, steps=6, eval_every=3)
        data = yaml.safe_load(path.read_text())
        data["data"]["synthetic"] |= {"candidates_per_user": 4, "vbe": vbe}
        path.write_text(yaml.safe_dump(data))
        ok(torchrun(2, "fbtriton_dist.train", "--config", str(path)))
        runs[name] = losses(tmp_path / name)
    assert sorted(runs["vbe"]) == sorted(runs["expanded"]) == list(range(1, 7))
    for step, loss in runs["expanded"].items():
        assert abs(runs["vbe"][step] - loss) <= 1e-5 * max(1.0, abs(loss)), step
    evals = [[r["loss"] for r in records(tmp_path / n, "eval")] for n in ("vbe", "expanded")]
    assert evals[0] and all(abs(a - b) <= 1e-5 for a, b in zip(*evals, strict=True))


def test_pipeline_overlap_trains_like_the_plain_loop(tmp_path):
    """``train.pipeline: overlap`` (``auto`` on several ranks: TrainPipeline runs the next
    batch's input dist while this one trains) gives the plain loop's losses, eval and
    checkpoints bit for bit; a resume into it continues the same."""
    plain = write_job(tmp_path, "plain", steps=6, eval_every=3, pipeline="plain")
    overlap = write_job(tmp_path, "overlap", steps=6, eval_every=3, pipeline="overlap")
    ok(torchrun(2, "fbtriton_dist.train", "--config", str(plain)))
    ok(torchrun(2, "fbtriton_dist.train", "--config", str(overlap), "--steps", "3"))
    ok(torchrun(2, "fbtriton_dist.train", "--config", str(overlap), "--resume"))
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "overlap")
    assert sorted(want) == sorted(got) == list(range(1, 7))
    assert all(got[s] == want[s] for s in want), (want, got)
    evals = [[r["loss"] for r in records(tmp_path / n, "eval")] for n in ("plain", "overlap")]
    assert evals[0][-1] == evals[1][-1]
