"""The job never loses a run, each case failing on the code before it:

* a new run into a folder holding another run is refused (exit 2, naming it) unless
  ``--resume`` or ``--overwrite``; retention never deletes the checkpoint just written; the
  summary names only a checkpoint that exists;
* ``--resume`` takes the newest checkpoint that matches what its save recorded, skips a
  truncated or metadata-less one with a warning naming it, and cleans stale ``.tmp-*``
  folders; ``--steps`` at or below the checkpoint's step is an error; a full disk keeps the
  last good checkpoint and says "no space left" with the path;
* a non-finite loss stops the job naming the step, before any later checkpoint
  (``train.nonfinite: skip`` drops such steps); the Criteo reader refuses nan/inf."""

import errno
import os

import pytest
import torch

from fbtriton_dist.train import checkpoint as ckpt
from fbtriton_dist.train.data import SyntheticSource, parse_criteo_line
from fbtriton_dist.train.job import main
from tests.train.test_job import losses, records, write_job

QUICK = {"train__steps": 8, "train__eval_batches": 0, "checkpoint__every": 4,
         "logging__log_every": 1}


def test_a_second_run_into_the_same_folder_is_refused_unless_resume_or_overwrite(
        tmp_path, capsys):
    path = write_job(tmp_path, **QUICK)
    run = tmp_path / "tiny"
    assert main(["--config", str(path)]) == 0
    before = (run / "metrics.jsonl").read_text()
    assert main(["--config", str(path), "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert f"run_dir {run} holds another run (metrics.jsonl, checkpoints up to step 8)" in err
    assert "--resume" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_text() == before  # untouched
    assert ckpt.checkpoint_steps(str(run / "checkpoints")) == [4, 8]
    # --overwrite: the old run's files go, the new run is alone there
    assert main(["--config", str(path), "--steps", "4", "--overwrite"]) == 0
    assert [r["steps"] for r in records(run, "summary")] == [4]
    assert ckpt.checkpoint_steps(str(run / "checkpoints")) == [4]
    summary = records(run, "summary")[-1]
    assert os.path.isdir(summary["checkpoint"])  # the summary names a checkpoint that exists
    assert main(["--config", str(path), "--resume", "--steps", "6"]) == 0
    assert sorted(losses(run)) == list(range(1, 7))


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    folder = str(tmp_path)
    ckpt.save_checkpoint(folder, 20, model, opt, {"epoch": 0, "samples": 0}, keep=1)
    written = ckpt.save_checkpoint(folder, 10, model, opt, {"epoch": 0, "samples": 0}, keep=1)
    assert os.path.isdir(written) and ckpt.checkpoint_steps(folder) == [10]


def test_resume_with_steps_at_or_below_the_checkpoint_is_an_error(tmp_path, capsys):
    path = write_job(tmp_path, **QUICK)
    assert main(["--config", str(path)]) == 0
    assert main(["--config", str(path), "--resume", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "train.steps = 5, but the checkpoint" in err and "at step 8" in err


@pytest.mark.parametrize("damage", ["truncate", "drop_meta", "corrupt"])
def test_resume_skips_a_damaged_newest_checkpoint_and_says_why(tmp_path, capsys, damage):
    path = write_job(tmp_path, **QUICK)
    assert main(["--config", str(path)]) == 0
    folder = tmp_path / "tiny" / "checkpoints"
    newest = folder / "step_00000008"
    data = max((p for p in newest.iterdir() if p.name.endswith(".distcp")),
               key=lambda p: p.stat().st_size)
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif damage == "corrupt":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    else:
        (newest / "meta.json").unlink()
    (folder / ".tmp-step_00000012").mkdir()  # left by an interrupted save
    capsys.readouterr()
    assert main(["--config", str(path), "--resume", "--steps", "10"]) == 0
    out = capsys.readouterr()
    assert f"skipping checkpoint {newest}" in out.err
    why = {"truncate": "truncated", "corrupt": "CRC32", "drop_meta": "meta.json is missing"}
    assert why[damage] in out.err
    assert "resumed from" in out.out and "step_00000004: step 4" in out.out
    assert "removed 1 unfinished checkpoint save(s)" in out.out
    assert not (folder / ".tmp-step_00000012").exists()


def test_a_full_disk_keeps_the_last_good_checkpoint_and_names_the_path(tmp_path, monkeypatch):
    path = write_job(tmp_path, **QUICK)
    real_save, calls = ckpt.dcp.save, []

    def full_disk(state, **kw):
        calls.append(kw["checkpoint_id"])
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(state, **kw)

    monkeypatch.setattr(ckpt.dcp, "save", full_disk)
    with pytest.raises(OSError) as info:
        main(["--config", str(path)])
    text = str(info.value)
    folder = tmp_path / "tiny" / "checkpoints"
    assert "no space left on device" in text and str(folder / ".tmp-step_00000008") in text
    assert f"the last good checkpoint is kept: {folder / 'step_00000004'}" in text
    assert sorted(os.listdir(folder)) == ["step_00000004"]  # the unfinished save removed


def _nan_at(step_of_nan):
    """SyntheticSource whose batch ``step_of_nan - 1`` has a NaN dense value."""
    real = SyntheticSource.batch

    def batch(self, k, split=0):
        b = real(self, k, split)
        if split == 0 and k == step_of_nan - 1:
            b.dense[0, 0] = float("nan")
        return b

    return batch


def test_a_nan_loss_stops_the_job_naming_the_step_before_any_checkpoint(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.setattr(SyntheticSource, "batch", _nan_at(6))
    path = write_job(tmp_path, **{**QUICK, "logging__log_every": 4})
    assert main(["--config", str(path)]) == 3
    assert "step 6: the loss or a dense gradient is not finite" in capsys.readouterr().err
    # step 4's checkpoint is there, none after the nan (found at step 8, before its save)
    assert ckpt.checkpoint_steps(str(tmp_path / "tiny" / "checkpoints")) == [4]


def test_nonfinite_skip_drops_the_step_and_counts_it(tmp_path, monkeypatch):
    monkeypatch.setattr(SyntheticSource, "batch", _nan_at(3))
    path = write_job(tmp_path, **QUICK, train__nonfinite="skip")
    assert main(["--config", str(path)]) == 0
    summary = records(tmp_path / "tiny", "summary")[-1]
    assert summary["skipped_steps"] == 1 and summary["steps"] == 8
    # finite everywhere but at step 3, whose window (log_every: 1) trained no step: nan, not 0
    logged = losses(tmp_path / "tiny")
    assert logged[3] != logged[3] and all(v == v for s, v in logged.items() if s != 3)
    assert [r["skipped"] for r in records(tmp_path / "tiny", "train")] == [0, 0, 1, 0, 0, 0, 0, 0]


def test_criteo_reader_refuses_nan_and_inf_in_integer_columns():
    cols = ["1"] + ["3"] * 13 + ["a1"] * 26
    for bad in ("nan", "inf", "-inf"):
        line = "\t".join([*cols[:5], bad, *cols[6:]])
        with pytest.raises(ValueError, match=rf"day_0.tsv:7: integer column 5: '{bad}' is not"):
            parse_criteo_line(line, [100] * 26, "day_0.tsv:7")


def test_batches_made_ahead_by_a_thread_are_the_same_batches():
    import threading

    from fbtriton_dist.train.loop import ahead

    assert list(ahead(iter(range(50)), 3)) == list(range(50))
    assert list(ahead(iter(range(5)), 0)) == list(range(5))

    def broken():
        yield 1
        raise ValueError("data: bad line 7")

    got = []
    with pytest.raises(ValueError, match="bad line 7"):
        for x in ahead(broken(), 2):
            got.append(x)
    assert got == [1]
    before = threading.active_count()
    gen = ahead(iter(range(10**6)), 2)
    assert next(gen) == 0
    gen.close()  # a consumer that stops early stops the thread
    assert threading.active_count() <= before


def test_items_are_prepared_in_the_background_thread():
    """``prepare`` (the job's pinning of batches on CUDA) runs in the data thread, on every
    item, in order; without a thread (depth 0) nothing is prepared."""
    import threading

    from fbtriton_dist.train.loop import ahead

    where = set()

    def prepare(x):
        where.add(threading.current_thread().name)
        return -x

    assert list(ahead(iter(range(20)), 3, prepare=prepare)) == [-x for x in range(20)]
    assert where == {"fbtd-data"}
    assert list(ahead(iter(range(3)), 0, prepare=prepare)) == [0, 1, 2]


def test_a_job_with_data_made_ahead_trains_like_one_without(tmp_path):
    here = write_job(tmp_path, "here", **QUICK, data__prefetch=0)
    ahead_ = write_job(tmp_path, "ahead", **QUICK)
    assert main(["--config", str(here)]) == 0
    assert main(["--config", str(ahead_)]) == 0
    assert losses(tmp_path / "here") == losses(tmp_path / "ahead")
