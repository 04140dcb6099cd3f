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


def panels(png):
    """The panel titles the picture recorded in its PNG's ``Description``."""
    from PIL import Image

    with Image.open(png) as image:
        text = image.text["Description"]
    assert text.startswith("panels: ")
    return text.removeprefix("panels: ").split("; ")


def test_the_job_draws_its_picture_and_report_redraws_it(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["--config", str(write_job(tmp_path, "pic", **SHORT))]) == 0
    run = tmp_path / "pic"
    assert f"picture: {run / 'report.png'}" in capsys.readouterr().out
    assert (run / "report.png").read_bytes().startswith(PNG)
    # no tiered (or managed) table: the one row of loss, AUC and stage split
    assert [t.split(" ")[0] for t in panels(run / "report.png")] == ["loss", "eval", "ms"]
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


def _records(aucs, managed=False):
    records = []
    for i, auc in enumerate(aucs):
        step = 10 * (i + 1)
        train = {"kind": "train", "step": step, "loss": 0.5, "samples_per_s": 1e4,
                 "ms": {"lookup": 1.0}}
        if managed:
            train["id_managers"] = {"t_user": {
                "occupancy": 0.2 * (i + 1), "hit_rate": 0.5 + 0.1 * i, "default_rate": 0.01,
                "lookups_per_step": 300.0, "admitted_per_step": 40.0 - i,
                "evicted_per_step": 5.0 * i, "expired_per_step": 0.0, "rejected_per_step": 1.0,
                "overflow_per_step": 0.0, "steps": 10}}
        records += [train, {"kind": "eval", "step": step, "loss": 0.5, "auc": auc,
                            "samples": 100}]
    return records


@pytest.mark.parametrize("aucs", [[0.700, 0.701, 0.703], [0.9985, 0.999], [0.5, 0.9],
                                  [0.001, 0.002]])
def test_the_auc_axis_spans_at_least_0_05(tmp_path, aucs):
    """An AUC moving by 0.003 is drawn flat-ish, not as a steep climb: the axis spans >= 0.05
    (inside [0, 1]) and holds every value; a wide range keeps its own span."""
    pytest.importorskip("matplotlib")
    from fbtriton_dist.train.picture import draw_run

    write_metrics(tmp_path / "run", _records(aucs))
    _, series = draw_run(str(tmp_path / "run"))
    lo, hi = series["auc_ylim"]
    assert hi - lo >= 0.05 - 1e-12 and 0.0 <= lo <= min(aucs) and max(aucs) <= hi <= 1.0
    if max(aucs) - min(aucs) > 0.05:
        assert hi - lo == pytest.approx(1.2 * (max(aucs) - min(aucs)))


def test_report_draws_the_managed_tables_metrics(tmp_path, capsys):
    """metrics.jsonl's id_managers numbers (occupancy, hit and default rates, ids admitted /
    evicted per step) are drawn when present, and only then."""
    pytest.importorskip("matplotlib")
    from fbtriton_dist.train.picture import draw_run

    write_metrics(tmp_path / "run", _records([0.7, 0.72, 0.74], managed=True))
    assert cli.main(["report", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "report.png").read_bytes().startswith(PNG)
    _, series = draw_run(str(tmp_path / "run"))
    table = series["managed"]["t_user"]
    assert series["tiers"] == {} and len(series["panels"]) == 5  # managed row, no tier row
    assert table["step"] == [10, 20, 30]
    assert table["occupancy"] == pytest.approx([0.2, 0.4, 0.6])
    assert table["evicted_per_step"] == [0.0, 5.0, 10.0]
    write_metrics(tmp_path / "plain", _records([0.7, 0.72]))
    assert draw_run(str(tmp_path / "plain"))[1]["managed"] == {}
    both = _records([0.7, 0.72], managed=True)  # managed and tiered tables: a row for each
    for r in both[::2]:
        r["caches"] = {"t_item": {"hit_rate": 0.5, "fetched_per_step": 3.0,
                                  "written_back_per_step": 2.0, "prefetch_hidden_ms": 0.0,
                                  "prefetch_exposed_ms": 0.0}}
    write_metrics(tmp_path / "both", both)
    titles = draw_run(str(tmp_path / "both"))[1]["panels"]
    assert len(titles) == 8 and titles[3].startswith("managed tables")
    assert all(t.startswith("tiered tables") for t in titles[5:])


def test_the_job_with_a_cached_table_draws_its_tier_panel(tmp_path, capsys):
    """A job with a ``cached`` table: its report.png has the tiered tables' row (hit rate, rows
    fetched / written back, prefetch hidden / exposed), drawn from the records' ``caches``."""
    pytest.importorskip("matplotlib")
    from fbtriton_dist.train.picture import draw_run
    from tests.train.test_job import TINY, records

    tables = json.loads(json.dumps(TINY["tables"]))
    tables[0].update(num_embeddings=3000, storage={"tier": "cached", "cache_load_factor": 0.06})
    path = write_job(tmp_path, "tier", tables=tables, **{**SHORT, "train__eval_every": 0,
                                                         "logging__log_every": 2})
    assert main(["--config", str(path)]) == 0
    run = tmp_path / "tier"
    assert f"picture: {run / 'report.png'}" in capsys.readouterr().out
    titles = panels(run / "report.png")
    assert len(titles) == 6 and [t for t in titles if t.startswith("tiered tables: ")] == [
        "tiered tables: hit rate (distinct rows)",
        "tiered tables: rows fetched (-), written back (--)",
        "tiered tables: prefetch hidden (-), exposed (--)"]
    _, series = draw_run(str(run))
    train = records(run, "train")
    drawn = series["tiers"]["t_a"]
    assert drawn["step"] == [2, 4] and list(series["tiers"]) == ["t_a"]
    for k in ("hit_rate", "fetched_per_step", "written_back_per_step", "prefetch_hidden_ms",
              "prefetch_exposed_ms"):
        assert drawn[k] == [r["caches"]["t_a"][k] for r in train]
    assert all(v > 0 for v in drawn["fetched_per_step"])
