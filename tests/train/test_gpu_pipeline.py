"""The job's CUDA-graph step on one GPU (skipped without CUDA; ``pytest tests/train -k gpu``).

``torchrun --nproc-per-node 1`` on CUDA gives the job a process group of one, so its tables
are sharded and ``train.pipeline: graph`` (fixed-shape input dist, the whole step one CUDA
graph replay with the next batch's input dist inside it) can run; ``auto`` picks it there.
Its losses, evaluations and checkpoints must be the plain loop's (up to float reordering),
and its stage times come from CUDA events around each replay (``step``).
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests.conftest import requires_cuda
from tests.train.test_job import TINY, losses, records

pytestmark = [requires_cuda, pytest.mark.gpu]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 12


def gpu_job(tmp_path, name, pipeline, dense="sgd", deterministic=False, **train):
    data = json.loads(json.dumps(TINY))
    data["device"] = "cuda"
    data["deterministic"] = deterministic  # off: compared with a tolerance anyway
    data["optimizer"]["dense"] = {"type": dense, "lr": 0.1}
    data["train"] = {"steps": STEPS, "batch_size": 64, "eval_every": 6, "eval_batches": 2,
                     "pipeline": pipeline, **train}
    data["checkpoint"] = {"every": 6, "keep": 2}
    data["logging"] = {"log_every": 1, "progress_bar": False, "run_dir": str(tmp_path / name)}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def one_rank(path, *args):
    """The job under ``torchrun --standalone --nproc-per-node 1`` (a process group of one)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "--max-restarts", "0", "-m", "fbtriton_dist.train", "--config", str(path), *args]
    env = {**os.environ, "FBTD_PG_TIMEOUT_S": "120", "NCCL_NVLS_ENABLE": "0"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:]
    return out.stdout


def summary(run_dir):
    return records(run_dir, "summary")[-1]


def close(a, b, rel=1e-4):
    return abs(a - b) <= rel * max(1.0, abs(a))


def test_gpu_graph_pipeline_trains_like_the_plain_loop(tmp_path):
    one_rank(gpu_job(tmp_path, "plain", "plain"))
    one_rank(gpu_job(tmp_path, "graph", "graph"))
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "graph")
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    assert all(close(want[s], got[s]) for s in want), (want, got)
    evals = [[r["loss"] for r in records(tmp_path / n, "eval")] for n in ("plain", "graph")]
    assert len(evals[0]) == len(evals[1]) == 2
    assert all(close(a, b) for a, b in zip(*evals, strict=True)), evals
    s = summary(tmp_path / "graph")
    assert s["pipeline"] == "graph" and summary(tmp_path / "plain")["pipeline"] == "plain"
    assert s["world_size"] == 1 and int(s["checkpoint"].rsplit("_", 1)[1]) == STEPS
    # capture-safe timing: the replayed step timed as a whole by CUDA events, nothing else
    assert set(s["ms_per_step"]) == {"step"} and s["ms_per_step"]["step"] > 0
    train = records(tmp_path / "graph", "train")
    assert train[-1]["ms"]["step"] > 0


def test_gpu_graph_pipeline_with_cached_tables(tmp_path):
    """A table on the cached tier, its cache 60 % of its rows (evictions every step): the
    graph step maps its rows before each replay and trains as the plain loop; ``auto`` picks
    the graph; its checkpoint (the cached shard's backing store in host memory, placed on
    the CPU in the ShardedTensor under NCCL) saves and resumes."""
    def job(name, pipeline):
        path = gpu_job(tmp_path, name, pipeline)
        data = yaml.safe_load(path.read_text())
        data["tables"][0]["storage"] = {"tier": "cached", "cache_load_factor": 0.6}
        path.write_text(yaml.safe_dump(data))
        return path

    one_rank(job("plain", "plain"))
    path = job("graph", "auto")
    one_rank(path, "--steps", "6")
    assert "resumed from" in one_rank(path, "--resume")
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "graph")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(close(want[s], got[s]) for s in want), (want, got)
    s, p = summary(tmp_path / "graph"), summary(tmp_path / "plain")
    assert s["pipeline"] == "graph"
    for caches in (s["caches"]["t_a"], p["caches"]["t_a"]):  # the resumed run's cache cold
        assert 0 < caches["hit_rate"] < 1 and caches["evicted_per_step"] > 0, caches


def test_gpu_auto_picks_the_graph_and_resumes_into_it(tmp_path):
    """As the shipped jobs: dense Adagrad (``CapturableAdagrad`` in the graph) and
    ``deterministic: true``."""
    path = gpu_job(tmp_path, "auto", "auto", dense="adagrad", deterministic=True)
    one_rank(path, "--steps", "6")
    out = one_rank(path, "--resume")
    assert "resumed from" in out
    s = summary(tmp_path / "auto")
    assert s["pipeline"] == "graph" and s["steps"] == STEPS
    one_rank(gpu_job(tmp_path, "plain", "plain", dense="adagrad", deterministic=True))
    want, got = losses(tmp_path / "plain"), losses(tmp_path / "auto")
    assert all(close(want[s_], got[s_]) for s_ in want), (want, got)


def test_gpu_auto_in_one_process_without_torchrun_stays_plain(tmp_path):
    """Without torchrun there is no process group (house rule): unsharded tables, the plain
    loop, and a line saying why not the graph."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "fbtriton_dist.train", "--config",
           str(gpu_job(tmp_path, "alone", "auto", steps=4))]
    out = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:]
    assert "auto runs plain, not graph" in out.stdout and "torchrun" in out.stdout
    assert summary(tmp_path / "alone")["pipeline"] == "plain"


def test_gpu_capturable_adagrad_replays_like_torchs_adagrad():
    """The dense Adagrad of the graph loop, captured in a CUDA graph with its step and
    replayed, trains as torch's Adagrad does eagerly, and counts every replay."""
    from fbtriton_dist.train.dense_optim import CapturableAdagrad

    torch.manual_seed(0)
    ours = torch.nn.Linear(6, 1, device="cuda")
    theirs = copy.deepcopy(ours)
    opt = CapturableAdagrad(ours.parameters(), lr=0.1, weight_decay=0.01)
    ref = torch.optim.Adagrad(theirs.parameters(), lr=0.1, weight_decay=0.01)
    xs = [torch.randn(16, 6, device="cuda") for _ in range(8)]
    static = xs[0].clone()

    def step():
        opt.zero_grad(set_to_none=True)
        ours(static).square().mean().backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the eager warm-up step, on xs[0]
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for x in xs[1:]:
        static.copy_(x)
        graph.replay()
    for x in xs:
        ref.zero_grad(set_to_none=True)
        theirs(x).square().mean().backward()
        ref.step()
    torch.cuda.synchronize()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert float(opt.state[a]["step"]) == len(xs)
