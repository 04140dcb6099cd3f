"""The picture of a run (``<run_dir>/report.png``: loss/AUC curves, per-stage time split),
drawn by the job at its end and by ``fbtriton-dist report RUN_DIR``; without matplotlib one
line says it was skipped and nothing fails."""

import json
import sys

import pytest

from fbtriton_dist import cli
from fbtriton_dist.train.job import main
from fbtriton_dist.train.picture import read_run
from tests.train.test_job import write_job

PNG = b"\x89PNG\r\n\x1a\n"
SHORT = {"train__steps": 4, "train__eval_every": 2, "train__eval_batches": 1,
         "checkpoint__every": 0, "logging__log_every": 1}


def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)


def write_metrics(run_dir, records, torn=False):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run_dir / "metrics.jsonl").write_text(text + ('{"kind": "tra' if torn else ""))


def test_run_records_keep_the_latest_of_a_repeated_step_and_skip_a_torn_line(tmp_path):
    write_metrics(tmp_path, [
        {"kind": "train", "step": 1, "loss": 0.9, "ms": {"lookup": 2.0}},
        {"kind": "train", "step": 2, "loss": 0.8, "ms": {"lookup": 4.0}},
        {"kind": "eval", "step": 2, "loss": 0.7, "auc": 0.6},
        {"kind": "train", "step": 2, "loss": 0.5, "ms": {"lookup": 6.0}},  # resumed: again
    ], torn=True)
    run = read_run(str(tmp_path))
    assert [r["loss"] for r in run["train"]] == [0.9, 0.5] and run["summary"] is None
    pytest.importorskip("matplotlib")
    from fbtriton_dist.train.picture import draw_run

    path, series = draw_run(str(tmp_path))
    assert series["train_loss"] == [0.9, 0.5] and series["eval_auc"] == [0.6]
    assert series["stages"] == {"lookup": 4.0}  # no summary yet: the records' mean
    assert open(path, "rb").read().startswith(PNG)


def test_the_job_draws_its_picture_and_report_redraws_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["--config", str(write_job(tmp_path, "pic", **SHORT))]) == 0
    run = tmp_path / "pic"
    assert f"picture: {run / 'report.png'}" in capsys.readouterr().out
    assert (run / "report.png").read_bytes().startswith(PNG)
    (run / "report.png").unlink()
    assert cli.main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "training summary" in out and "pipeline: plain" in out and "eval_auc" in out
    assert (run / "report.png").read_bytes().startswith(PNG)
    other = tmp_path / "elsewhere.png"
    assert cli.main(["report", str(run), "--png", str(other)]) == 0 and other.exists()


def test_without_matplotlib_the_job_and_report_skip_the_picture_in_one_line(
        tmp_path, capsys, monkeypatch):
    no_matplotlib(monkeypatch)
    assert main(["--config", str(write_job(tmp_path, "bare", **SHORT))]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "picture" in line]
    assert lines == ["picture skipped: matplotlib is not installed (pip install matplotlib, "
                     "or pip install 'fbtriton_dist[plot]')"]
    assert not (tmp_path / "bare" / "report.png").exists()
    assert cli.main(["report", str(tmp_path / "bare")]) == 0
    captured = capsys.readouterr()
    assert "training summary" in captured.out and "picture skipped" in captured.err


def test_report_of_a_folder_without_a_run_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
