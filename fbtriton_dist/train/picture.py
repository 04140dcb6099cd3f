"""The picture of a run: loss and AUC curves and the per-stage time split, from its
``metrics.jsonl``. The job draws ``<run_dir>/report.png`` at the end (rank 0);
``fbtriton-dist report RUN_DIR`` prints the summary and draws it again.

matplotlib is optional (``pip install matplotlib``; ``launch/install.sh`` installs it): without
it the picture is skipped with one line, and the run is not failed for a picture, ever.
Torch-free: only the JSON lines are read.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from fbtriton_dist.planner.picture import PictureSkipped, figure_class, save_figure

__all__ = ["PICTURE", "PictureSkipped", "draw_run", "picture_line", "read_run", "stage_split"]

PICTURE = "report.png"
"""The picture's name in the run folder."""


def read_run(run_dir: str, metrics: str = "metrics.jsonl") -> dict[str, Any]:
    """The run's records: ``train`` and ``eval`` (one per step, the latest when a resumed run
    repeated steps, in step order) and the last ``summary`` (None: the run has not finished).
    A torn last line (a run killed while writing) is left out."""
    path = os.path.join(run_dir, metrics)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no metrics file; expected the run folder of a job "
                         "(logging.run_dir, default runs/<name>)")
    by_kind: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    summary = None
    lines = records = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                lines += 1
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(record, dict):
                    continue
                records += 1
                kind = record.get("kind")
                if kind == "summary":
                    summary = record
                elif kind in by_kind:
                    by_kind[kind][int(record.get("step", 0))] = record
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: line {lines + 1}: not a metrics file (binary, not text: "
                         f"{e.reason}); expected the JSON lines a job writes") from e
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from e
    if lines and not records:
        raise ValueError(f"{path}: not a metrics file: none of its {lines} line(s) is a JSON "
                         "record of a job")
    return {"train": [by_kind["train"][s] for s in sorted(by_kind["train"])],
            "eval": [by_kind["eval"][s] for s in sorted(by_kind["eval"])],
            "summary": summary, "path": path}


def stage_split(run: Mapping[str, Any]) -> dict[str, float]:
    """Mean milliseconds per step of each stage: the summary's ``ms_per_step``, else the mean
    of the train records' ``ms`` (an unfinished run)."""
    summary = run.get("summary") or {}
    if summary.get("ms_per_step"):
        return dict(summary["ms_per_step"])
    sums: dict[str, list[float]] = {}
    for r in run["train"]:
        for stage, ms in (r.get("ms") or {}).items():
            sums.setdefault(stage, []).append(float(ms))
    return {s: sum(v) / len(v) for s, v in sums.items()}


def _finite(values):
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def draw_run(run_dir: str, metrics: str = "metrics.jsonl",
             out: str | None = None) -> tuple[str, dict[str, Any]]:
    """Draw the run's curves and stage split into ``out`` (default ``<run_dir>/report.png``);
    returns the path and the drawn series. PictureSkipped without matplotlib."""
    Figure = figure_class()
    run = read_run(run_dir, metrics)
    train, evals, summary = run["train"], run["eval"], run["summary"] or {}
    series = {
        "train_step": [r["step"] for r in train],
        "train_loss": [r.get("loss", math.nan) for r in train],
        "eval_step": [r["step"] for r in evals],
        "eval_loss": [r.get("loss", math.nan) for r in evals],
        "eval_auc": [r.get("auc", math.nan) for r in evals],
        "stages": stage_split(run),
    }
    fig = Figure(figsize=(14, 4.2), layout="constrained")
    loss, auc, stages = fig.subplots(1, 3)
    loss.plot(series["train_step"], series["train_loss"], label="train (window mean)")
    if evals:
        loss.plot(series["eval_step"], series["eval_loss"], "o--", label="eval")
    loss.set(title="loss", xlabel="step", ylabel="binary cross-entropy")
    loss.legend(fontsize="small")
    if _finite(series["eval_auc"]):
        auc.plot(series["eval_step"], series["eval_auc"], "o-", color="tab:purple")
        auc.set(title=f"eval AUC (last {_finite(series['eval_auc'])[-1]:.4f})")
    else:
        auc.text(0.5, 0.5, "no evaluation", ha="center", va="center", transform=auc.transAxes)
        auc.set(title="eval AUC")
    auc.set(xlabel="step", ylabel="AUC")
    split = series["stages"]
    names = list(split)
    stages.barh(names, [split[n] for n in names], color="tab:orange")
    for i, n in enumerate(names):
        stages.text(split[n], i, f" {split[n]:.2f}", va="center", fontsize="small")
    stages.invert_yaxis()
    if names:
        stages.set_xlim(0, 1.18 * max(max(split.values()), 1e-9))  # room for the labels
    pipeline = summary.get("pipeline")
    stages.set(title="ms per step" + (f" ({pipeline} loop)" if pipeline else ""),
               xlabel="ms (mean per step)")
    if not names:
        stages.text(0.5, 0.5, "no stage times", ha="center", va="center",
                    transform=stages.transAxes)
    head = summary.get("job") or os.path.basename(os.path.abspath(run_dir))
    facts = [f"{summary['steps']} steps"] if "steps" in summary else ["not finished"]
    if isinstance(summary.get("samples_per_s"), (int, float)):
        facts.append(f"{summary['samples_per_s']:,.0f} samples/s")
    if summary.get("world_size"):
        facts.append(f"{summary['world_size']} rank(s) on {summary.get('device', '?')}")
    fig.suptitle(f"{head}: " + ", ".join(facts), fontsize="medium")
    path = out or os.path.join(run_dir, PICTURE)
    save_figure(fig, path)
    return path, series


def picture_line(run_dir: str, metrics: str = "metrics.jsonl") -> str:
    """Draw the run's picture; one line saying where, or why not. Never raises: a run does
    not fail for its picture."""
    try:
        path, _ = draw_run(run_dir, metrics)
    except PictureSkipped as e:
        return f"picture skipped: {e}"
    except Exception as e:  # noqa: BLE001 - reported in the line, the run goes on
        return f"picture skipped: {type(e).__name__}: {e}"
    return f"picture: {path}"
