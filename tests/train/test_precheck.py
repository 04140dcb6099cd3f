"""The job's arguments checked once before torchrun starts workers (``launch/multinode.sh``
runs ``python -m fbtriton_dist.train.precheck``): a config error or a run folder holding
another run is said once, exit 2, as one process says it; nothing imports torch."""

import subprocess
import sys

from fbtriton_dist.train.command import precheck
from tests.train.test_job import write_job
from tests.train.test_multirank import ROOT


def test_precheck_says_a_config_error_once_with_exit_2(tmp_path, capsys):
    path = write_job(tmp_path)
    assert precheck(["--config", str(path)]) == 0
    assert precheck(["--config", str(path), "train.batch_size=-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("train: error:") == 1 and "train.batch_size: expected an integer >= 1" in err


def test_precheck_refuses_a_folder_holding_another_run(tmp_path, capsys):
    path = write_job(tmp_path)
    run = tmp_path / "tiny"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train"}\n')
    assert precheck(["--config", str(path)]) == 2
    assert f"run_dir {run} holds another run (metrics.jsonl)" in capsys.readouterr().err
    assert precheck(["--config", str(path), "--resume"]) == 0
    assert precheck(["--config", str(path), "--overwrite"]) == 0


def test_multinode_script_stops_before_torchrun_on_a_bad_config(tmp_path):
    path = write_job(tmp_path)
    done = subprocess.run(["bash", f"{ROOT}/launch/multinode.sh", str(path),
                           "train.batch_size=-1"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("train: error:") == 1 and "Traceback" not in done.stderr


def test_precheck_does_not_import_torch(tmp_path):
    path = write_job(tmp_path)
    code = ("import sys; from fbtriton_dist.train.command import precheck; "
            f"rc = precheck(['--config', {str(path)!r}]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_plan_reads_a_job_file_and_checks_the_plan_the_job_wrote(tmp_path):
    from fbtriton_dist import cli
    from fbtriton_dist.train.job import main

    path = write_job(tmp_path, train__steps=2, train__eval_batches=0)
    assert main(["--config", str(path)]) == 0
    plan = tmp_path / "tiny" / "plan.yaml"
    assert cli.main(["plan", str(path), "--world-size", "1"]) == 0
    assert cli.main(["plan", str(path), "--world-size", "1", "--check", str(plan)]) == 0


def test_progress_goes_to_plain_lines_without_a_terminal(tmp_path, capsys):
    from fbtriton_dist.train.job import main

    path = write_job(tmp_path, train__steps=4, train__eval_batches=0, logging__log_every=2,
                     logging__progress_bar=True)
    assert main(["--config", str(path)]) == 0
    out = capsys.readouterr()
    assert "tiny: step 2/4, loss" in out.out and "tiny: step 4/4, loss" in out.out
    assert "\r" not in out.err  # no bar redrawn into a log


def test_device_cuda_without_cuda_is_a_config_error(tmp_path, capsys):
    import pytest
    import torch

    from fbtriton_dist.train.job import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    path = write_job(tmp_path, device="cuda")
    assert main(["--config", str(path)]) == 2
    assert "device: cuda, but this torch" in capsys.readouterr().err


def test_bench_help_exits_0():
    done = subprocess.run([sys.executable, "-m", "fbtriton_dist.bench", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "tbe" in done.stdout and "dist" in done.stdout


def test_planner_default_budget_and_shard_without_a_process_group_says_what_to_do():
    import pytest
    import torch.distributed as dist
    import torchrec

    import fbtriton_dist
    from fbtriton_dist.planner import ShardingPlanner

    cfg = [torchrec.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                       feature_names=["f"])]
    plan = ShardingPlanner(world_size=1).plan(cfg)  # a default budget: 80 GiB per rank
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group"):
        fbtriton_dist.shard(fbtriton_dist.EmbeddingBagCollection(tables=cfg), plan,
                            optimizer=fbtriton_dist.optim.SGD())
