"""The job never loses a run, never reports a wrong number, and answers bad input with a clear
error (exit 2) instead of a traceback; each case failed on the code before it:

* data loss: ``--resume --overwrite`` together, abbreviated options (``--o``), a failed resume
  rewriting ``plan.yaml``, a resume with every checkpoint damaged restarting from step 0;
* silent wrong numbers: a window of skipped steps averaging to a loss of 0, a checkpoint of
  non-finite weights, an empty eval file, nan/inf in numeric fields, malformed Criteo ids,
  the dense stage of a sharded step reported as 0 ms;
* retention deletes the oldest checkpoints, the non-finite guards catch inf as well as nan."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from fbtriton_dist import cli
from fbtriton_dist.train import checkpoint as ckpt
from fbtriton_dist.train.config import load_job
from fbtriton_dist.train.data import SyntheticSource, parse_criteo_line
from fbtriton_dist.train.job import main
from tests.train.test_job import records, write_job

QUICK = {"train__steps": 8, "train__eval_batches": 0, "checkpoint__every": 4,
         "logging__log_every": 2}


def _exit_status(argv, entry=main):
    """The exit status of ``entry(argv)``, whether it returns it or exits with it."""
    try:
        return entry(argv)
    except SystemExit as e:
        return e.code


def _trained(tmp_path, **changes):
    path = write_job(tmp_path, **{**QUICK, **changes})
    assert main(["--config", str(path)]) == 0
    return path, tmp_path / "tiny"


def _snapshot(run):
    """Every file of the run folder and its bytes."""
    return {os.path.relpath(os.path.join(r, n), run): open(os.path.join(r, n), "rb").read()
            for r, _, names in os.walk(run) for n in names}


# -- data loss ---------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["job", "cli"])
def test_resume_and_overwrite_together_are_refused(tmp_path, capsys, entry):
    path, run = _trained(tmp_path)
    before = _snapshot(run)
    argv = ["--config", str(path), "--resume", "--overwrite"]
    if entry == "cli":
        status = _exit_status(["train", *argv], cli.main)
    else:
        status = _exit_status(argv)
    assert status == 2
    assert "--resume and --overwrite" in capsys.readouterr().err
    assert _snapshot(run) == before


@pytest.mark.parametrize("entry", ["job", "cli", "precheck"])
def test_abbreviated_options_are_not_expanded(tmp_path, entry):
    """``--o`` was taken for ``--overwrite`` and deleted the run it was meant to keep."""
    from fbtriton_dist.train.command import precheck

    path, run = _trained(tmp_path)
    before = _snapshot(run)
    argv = ["--config", str(path), "--o"]
    status = {"job": lambda: _exit_status(argv),
              "cli": lambda: _exit_status(["train", *argv], cli.main),
              "precheck": lambda: _exit_status(argv, precheck)}[entry]()
    assert status == 2
    assert _snapshot(run) == before
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["plan", "t.yaml", "--world", "2"])


def test_a_failed_resume_into_another_table_set_leaves_the_run_as_it_was(tmp_path, capsys):
    path, run = _trained(tmp_path)
    plan_before = (run / "plan.yaml").read_text()
    data = yaml.safe_load(path.read_text())
    data["tables"][1]["num_embeddings"] = 50  # another table set: another plan
    path.write_text(yaml.safe_dump(data))
    try:
        status = main(["--config", str(path), "--resume", "--steps", "12"])
    except BaseException as e:  # noqa: BLE001 - the old behaviour: DCP's traceback
        status = f"raised {type(e).__name__}"
    assert (run / "plan.yaml").read_text() == plan_before
    assert status == 2
    err = capsys.readouterr().err
    assert "holds job 'tiny' with tables [t_a 300x8, t_b 40x8]" in err
    assert "this job 'tiny' has tables [t_a 300x8, t_b 50x8] (differing: t_b)" in err


@pytest.mark.parametrize("change", ["tables", "optimizer"])
def test_a_checkpoint_that_cannot_load_is_a_clear_error_and_changes_nothing(tmp_path, capsys,
                                                                           change):
    """Another optimizer's state (or another table set) behind a checkpoint whose meta.json
    does not say what it holds (saved before that was recorded): DCP's error, summed up."""
    path, run = _trained(tmp_path)
    for step in ckpt.checkpoint_steps(str(run / "checkpoints")):
        meta_path = run / "checkpoints" / f"step_{step:08d}" / "meta.json"
        meta = json.loads(meta_path.read_text())
        assert meta.pop("job")["embedding_optimizer"] == "rowwise_adagrad"
        meta_path.write_text(json.dumps(meta))
    before = _snapshot(run)
    data = yaml.safe_load(path.read_text())
    if change == "tables":
        data["tables"][1]["num_embeddings"] = 50
    else:
        data["optimizer"]["embedding"]["type"] = "adam"
    path.write_text(yaml.safe_dump(data))
    assert main(["--config", str(path), "--resume", "--steps", "12"]) == 2
    err = capsys.readouterr().err
    assert "step_00000008 cannot be loaded into this job's model and plan" in err
    assert "Traceback" not in err
    assert _snapshot(run) == before


def test_a_checkpoint_of_another_optimizer_names_both(tmp_path, capsys):
    path, run = _trained(tmp_path)
    assert main(["--config", str(path), "--resume", "--steps", "12",
                 "optimizer.dense.type=sgd"]) == 2
    err = capsys.readouterr().err
    assert "adagrad optimizer state; this job's optimizer.dense.type is sgd" in err


def test_resume_with_every_checkpoint_damaged_stops_instead_of_restarting(tmp_path, capsys):
    path, run = _trained(tmp_path)
    for step in ckpt.checkpoint_steps(str(run / "checkpoints")):
        (run / "checkpoints" / f"step_{step:08d}" / "meta.json").unlink()
    metrics = (run / "metrics.jsonl").read_text()
    status = main(["--config", str(path), "--resume", "--steps", "12"])
    assert (run / "metrics.jsonl").read_text() == metrics  # no second run appended
    assert status == 2
    err = capsys.readouterr().err
    assert "no usable checkpoint" in err and "step_00000008" in err and "--overwrite" in err


def test_resume_into_a_folder_with_metrics_but_no_checkpoint_stops(tmp_path, capsys):
    path, run = _trained(tmp_path, checkpoint__enabled=False)
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["--config", str(path), "--resume", "--steps", "12"]) == 2
    assert (run / "metrics.jsonl").read_text() == metrics
    assert "no usable checkpoint" in capsys.readouterr().err


# -- silent wrong numbers ------------------------------------------------------------------------
def _bad_loss_at(monkeypatch, steps, value):
    """The training loss becomes ``value`` (nan or inf) at the given 1-based steps; its
    gradients stay finite (a constant added)."""
    real = torch.nn.functional.binary_cross_entropy_with_logits
    calls = [0]

    def bce(*args, **kwargs):
        calls[0] += 1
        loss = real(*args, **kwargs)
        return loss + value if calls[0] in steps else loss

    monkeypatch.setattr(torch.nn.functional, "binary_cross_entropy_with_logits", bce)


def test_a_window_of_skipped_steps_is_not_a_loss_of_zero(tmp_path, monkeypatch, capsys):
    _bad_loss_at(monkeypatch, set(range(1, 100)), math.nan)
    path = write_job(tmp_path, **QUICK, train__nonfinite="skip")
    main(["--config", str(path)])
    run = tmp_path / "tiny"
    train = records(run, "train")
    assert train and all(math.isnan(r["loss"]) for r in train), train
    assert all(r["skipped"] == 2 for r in train)
    summary = records(run, "summary")[-1]
    assert math.isnan(summary["train_loss"]) and summary["skipped_steps"] == 8
    assert "train_loss: 0.0000" not in capsys.readouterr().out


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_checkpoint_of_non_finite_weights_is_never_written(tmp_path, monkeypatch, capsys,
                                                              value):
    from fbtriton_dist.train.loop import Trainer

    real_step, seen = Trainer.train_step, [0]

    def poisoned(self, batch):
        loss = real_step(self, batch)
        seen[0] += 1
        if seen[0] == 6:  # a table blows up after step 4's checkpoint
            weights = self.model.state_dict()
            key = next(k for k in weights if k.endswith("t_b.weight"))
            with torch.no_grad():
                weights[key][3, 1] = value
        return loss

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    path = write_job(tmp_path, **QUICK, train__nonfinite="skip")
    status = main(["--config", str(path)])
    assert ckpt.checkpoint_steps(str(tmp_path / "tiny" / "checkpoints")) == [4]
    assert status == 3
    err = capsys.readouterr().err
    assert "table t_b" in err and "not finite" in err and "step_00000004" in err


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_the_nonfinite_guard_catches_nan_and_inf_losses(tmp_path, monkeypatch, capsys, value):
    _bad_loss_at(monkeypatch, {6}, value)
    path = write_job(tmp_path, **{**QUICK, "logging__log_every": 4})
    assert main(["--config", str(path)]) == 3
    assert "step 6: the loss or a dense gradient is not finite" in capsys.readouterr().err
    assert ckpt.checkpoint_steps(str(tmp_path / "tiny" / "checkpoints")) == [4]


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_skip_drops_nan_and_inf_losses(tmp_path, monkeypatch, value):
    _bad_loss_at(monkeypatch, {3}, value)
    path = write_job(tmp_path, **QUICK, train__nonfinite="skip")
    assert main(["--config", str(path)]) == 0
    summary = records(tmp_path / "tiny", "summary")[-1]
    assert summary["skipped_steps"] == 1 and math.isfinite(summary["train_loss"])


def test_retention_deletes_the_oldest_checkpoints_and_keeps_the_newest(tmp_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = str(tmp_path)
    for step in (1, 2, 3, 4, 5):
        ckpt.save_checkpoint(folder, step, model, opt, {"epoch": 0, "samples": 0}, keep=3)
        assert ckpt.checkpoint_steps(folder) == list(range(max(1, step - 2), step + 1))
    ckpt.save_checkpoint(folder, 6, model, opt, {"epoch": 0, "samples": 0}, keep=2)
    assert ckpt.checkpoint_steps(folder) == [5, 6]


def _criteo_line(label="1", cat="68fd1e64"):
    return "\t".join([label, *["3"] * 13, cat, *["a1b2c3d4"] * 25]) + "\n"


def _criteo_job(tmp_path, train_lines, eval_lines):
    (tmp_path / "day_0.tsv").write_text("".join(train_lines))
    (tmp_path / "day_1.tsv").write_text("".join(eval_lines))
    tables = [{"name": f"t{i}", "num_embeddings": 50, "embedding_dim": 8, "features": [f"c{i}"]}
              for i in range(26)]
    return write_job(tmp_path, tables=tables,
                     data={"source": "criteo", "num_dense": 13,
                           "criteo": {"train": ["day_0.tsv"], "eval": ["day_1.tsv"]}},
                     train={"steps": 2, "batch_size": 4, "eval_every": 0, "eval_batches": 1},
                     checkpoint={"enabled": False})


def test_an_empty_eval_file_is_refused_naming_it(tmp_path, capsys):
    lines = [_criteo_line(label=str(i % 2)) for i in range(8)]
    path = _criteo_job(tmp_path, lines, [])
    status = main(["--config", str(path)])
    out = capsys.readouterr()
    assert "eval_auc: nan" not in out.out
    assert status == 2
    assert f"{tmp_path / 'day_1.tsv'}" in out.err and "no full batch" in out.err


@pytest.mark.parametrize("key, value", [("data.synthetic.zipf", ".nan"),
                                        ("data.synthetic.noise", ".inf"),
                                        ("optimizer.dense.lr", ".nan"),
                                        ("sharding.hbm_gb", ".inf")])
def test_nan_and_inf_in_numeric_fields_are_refused_naming_file_and_key(tmp_path, key, value):
    from fbtriton_dist.planner import ConfigError

    path = write_job(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_job(path, [f"{key}={value}"])
    assert f"{key}: expected a finite number" in str(info.value)
    assert str(path) in str(info.value) or "command line" in str(info.value)


@pytest.mark.parametrize("bad", ["-5f", "0x5f", " 5f", "5_f", "+5f", "12345678901234567"])
def test_a_malformed_criteo_id_is_refused_naming_file_and_line(bad):
    with pytest.raises(ValueError, match=re.escape(f"day_0.tsv:7: categorical column C1: '{bad}'")):
        parse_criteo_line(_criteo_line(cat=bad), [100] * 26, "day_0.tsv:7")
    assert parse_criteo_line(_criteo_line(cat="0000005F"), [100] * 26)[2][0] == 0x5F % 100


def test_a_sharded_overlap_step_measures_its_dense_part(tmp_path):
    """The overlap loop (a one-rank gloo group) reported every step's dense part as 0.00 ms:
    the embedding stages of the next batch fell inside this batch's forward timer."""
    import torch.distributed as dist

    from fbtriton_dist.train.env import Env
    from fbtriton_dist.train.job import train

    cfg = load_job(write_job(tmp_path, **{**QUICK, "train__pipeline": "overlap"}))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        env = Env(rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                  process_group=dist.group.WORLD)
        summary = train(cfg, env)
    finally:
        dist.destroy_process_group()
    assert summary["pipeline"] == "overlap"
    ms = summary["ms_per_step"]
    assert ms["dense"] > 0.0, ms
    for record in records(tmp_path / "tiny", "train"):
        assert record["ms"]["dense"] > 0.0, record


# -- a clear error where a traceback was ------------------------------------------------------
def test_a_missing_or_binary_criteo_file_is_a_clear_error(tmp_path, capsys):
    lines = [_criteo_line(label=str(i % 2)) for i in range(8)]
    path = _criteo_job(tmp_path, lines, lines)
    (tmp_path / "day_1.tsv").unlink()
    assert main(["--config", str(path)]) == 2
    assert f"data.criteo.eval[0]: {tmp_path / 'day_1.tsv'}: not found" in capsys.readouterr().err
    (tmp_path / "day_1.tsv").write_text("".join(lines))
    (tmp_path / "day_0.tsv").write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4)  # gzip
    assert main(["--config", str(path), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'day_0.tsv'}:1: not text" in err and "Traceback" not in err


def test_an_empty_job_file_says_so(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("")
    assert main(["--config", str(tmp_path / "empty.yaml")]) == 2
    assert f"{tmp_path / 'empty.yaml'}: the job file is empty" in capsys.readouterr().err


@pytest.mark.parametrize("content", [bytes(range(256)) * 8, b"\x00\x01 not json \x02\n" * 4])
def test_report_of_a_binary_metrics_file_is_a_clear_error(tmp_path, capsys, content):
    (tmp_path / "metrics.jsonl").write_bytes(content)
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'metrics.jsonl'}" in err and "not a metrics file" in err


def test_a_run_folder_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "tiny").write_text("not a folder")
    path = write_job(tmp_path, **QUICK)
    assert main(["--config", str(path)]) == 2
    assert f"logging.run_dir: {tmp_path / 'tiny'} is a file, not a folder" in (
        capsys.readouterr().err)


def test_triton_on_the_cpu_without_its_interpreter_is_a_config_error(tmp_path):
    # in a fresh process: Triton decides at a kernel's definition whether it is interpreted,
    # so unsetting TRITON_INTERPRET here would leave later tests' kernels compiled for CUDA
    path = write_job(tmp_path, **QUICK, backend="triton", device="cpu")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-m", "fbtriton_dist.train", "--config", str(path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr
    assert "job tiny: backend: backend='triton' on CPU tensors" in err and "TRITON_INTERPRET" in err


def test_tables_larger_than_the_hosts_memory_do_not_fit_with_the_numbers(tmp_path, monkeypatch,
                                                                        capsys):
    from fbtriton_dist.train import job

    monkeypatch.setattr(job, "available_host_bytes", lambda: 4096)
    path = write_job(tmp_path, **QUICK, device="cpu")
    assert main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    need = 300 * 8 * 4 + 300 * 4 + 40 * 8 * 4 + 40 * 4  # weights + rowwise state
    assert "do not fit in this host's memory" in err
    assert f"({need:,} bytes)" in err and "(4,096 bytes) of RAM available" in err


def test_a_negative_kjt_length_names_the_feature_and_the_length(tmp_path, monkeypatch, capsys):
    real = SyntheticSource.batch

    def batch(self, k, split=0):
        b = real(self, k, split)
        if split == 0 and k == 2:
            b.sparse.lengths()[64 + 5] = -1  # feature a2 (the second key), bag 5
        return b

    monkeypatch.setattr(SyntheticSource, "batch", batch)
    path = write_job(tmp_path, **QUICK, device="cpu")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "step 3: feature 'a2': lengths[5] = -1 (bag 5 of 64) is negative" in err
    assert "offsets" not in err


def test_an_error_under_torchrun_ends_the_output_and_gives_the_documented_status(tmp_path):
    """2 gloo ranks under launch/multinode.sh, an error found after its pre-check (every
    checkpoint damaged): torchrun exits 1 after 40+ lines of its own; the script's last lines
    name the error and it exits 2; torchrun's "Root Cause" names it too."""
    import signal

    path, run = _trained(tmp_path, device="cpu")
    for step in ckpt.checkpoint_steps(str(run / "checkpoints")):
        (run / "checkpoints" / f"step_{step:08d}" / "meta.json").unlink()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "FBTD_VENV": os.path.dirname(os.path.dirname(sys.executable)),
           "NPROC_PER_NODE": "2", "FBTD_PG_TIMEOUT_S": "60",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(["bash", os.path.join(root, "launch", "multinode.sh"), str(path),
                             "--resume"], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"multinode.sh did not finish in 180 s: {proc.communicate()[1][-3000:]}")
    last = err.strip().splitlines()[-2:]
    assert proc.returncode == 2, err[-3000:]
    assert last[0].startswith("[multinode] train: error: --resume: no usable checkpoint"), last
    assert last[1].startswith("[multinode] exit status 2 (torchrun's own: 1"), last
    assert "traceback : train: error: --resume: no usable checkpoint" in err


def test_a_run_folder_that_cannot_be_written_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """A read-only folder (simulated: these tests may run as root, who writes anywhere)."""
    import errno
    import tempfile

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    path = write_job(tmp_path, **QUICK)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"logging.run_dir: {tmp_path / 'tiny'} cannot be written: Read-only file system" in err
