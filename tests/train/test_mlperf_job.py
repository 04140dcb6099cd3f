"""The shipped MLPerf DLRM-dcnv2 jobs on 2 gloo ranks (CPU), each under a timeout:

* the synthetic variant from the command docs/mlperf.md gives (``launch/multinode.sh``), a few
  steps: samples/s per rank reported, the target not reached;
* the multi-hot reader under torchrun: each rank reads its own part, evaluation over the whole
  eval set of both ranks, the run stops at its target AUC.
"""

import json
import os
import signal
import subprocess

import pytest

from tests.train.test_multihot import write_day
from tests.train.test_multirank import ROOT, ok, torchrun

SYNTHETIC = "configs/jobs/mlperf_dlrm_dcnv2_synthetic.yaml"


def _summary(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records, records[-1]


def test_synthetic_mlperf_job_runs_on_2_ranks_from_the_documented_command(tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["bash", "launch/multinode.sh", SYNTHETIC, "--steps", "3", "device=cpu",
           "train.eval_every=3", "train.eval_batches=1", "checkpoint.enabled=false",
           f"logging.run_dir={run_dir}"]
    env = {**os.environ, "NPROC_PER_NODE": "2", "FBTD_PG_TIMEOUT_S": "60"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{' '.join(cmd)} did not finish within 150 s")
    assert proc.returncode == 0, out[-6000:]
    records, summary = _summary(run_dir)
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["samples_per_s_per_rank"] == pytest.approx(summary["samples_per_s"] / 2)
    assert summary["samples_per_s_per_rank"] > 0
    assert summary["target_auc"] == "0.80275" and summary["target_step"] == "not reached"
    assert "samples_per_s_per_rank" in out
    with open(run_dir / "plan.yaml", encoding="utf-8") as f:
        plan = f.read()
    assert "t_cat_20" in plan and "num_embeddings: 40000" in plan  # 40M rows x 1e-3


def test_multihot_job_on_2_ranks_evaluates_the_whole_set_and_stops_at_target(tmp_path):
    for day, n in [(0, 40), (1, 30), (2, 27)]:
        write_day(tmp_path, day, n, seed=day)
    tables = [{"name": f"t{i}", "num_embeddings": E, "embedding_dim": 4, "features": [f"f{i}"],
               "pooling_factors": L} for i, (E, L) in enumerate([(1000, 2), (5, 1), (64, 3)])]
    job = {"seed": 0, "tables": tables,
           "model": {"kind": "dcnv2", "dense_arch": [8, 4], "over_arch": [8, 1],
                     "cross_layers": 2, "low_rank": 3},
           "data": {"source": "multihot",
                    "multihot": {"dir": str(tmp_path), "train_days": "0-1", "eval_days": [2],
                                 "eval_part": "val"}},
           "train": {"epochs": 1, "batch_size": 5, "eval_every_epochs": 0.25,
                     "eval_batches": "all", "target_auc": 0.0},
           "checkpoint": {"enabled": False},
           "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    ok(torchrun(2, "fbtriton_dist.train", "--config", str(path)))
    records, summary = _summary(tmp_path / "run")
    # 70 rows, 2 ranks x 5: 7 steps an epoch, evaluated every 2; 14 validation rows: 1 batch
    # of 5 per rank
    assert summary["world_size"] == 2 and summary["target_step"] == 2 == summary["steps"]
    assert [r["samples"] for r in records if r["kind"] == "eval"] == [10]
