"""The picture of a run: loss and AUC curves and the per-stage time split, from its
``metrics.jsonl``, and with managed tables (``id_manager``) a row more: each table's
occupancy, hit rate and default-row rate, and its admitted / evicted / expired / rejected ids
per step; with tables on a cached tier (``cached`` / ``file``) a row more: each table's hit
rate, rows fetched and written back per step, and the prefetch's hidden / exposed ms.
The job draws ``<run_dir>/report.png`` at the end (rank 0);
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

__all__ = ["AUC_MIN_SPAN", "PICTURE", "PictureSkipped", "auc_limits", "draw_run",
           "managed_series", "picture_line", "read_run", "stage_split", "tier_series"]

PICTURE = "report.png"
"""The picture's name in the run folder."""

AUC_MIN_SPAN = 0.05
"""The AUC axis spans at least this much, so that 0.003 of noise does not look like a trend."""

MANAGED_RATES = ("occupancy", "hit_rate", "default_rate")
MANAGED_COUNTS = ("admitted_per_step", "evicted_per_step", "expired_per_step",
                  "rejected_per_step")
TIER_ROWS = ("fetched_per_step", "written_back_per_step")
TIER_PREFETCH = ("prefetch_hidden_ms", "prefetch_exposed_ms")


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


def auc_limits(values, min_span: float = AUC_MIN_SPAN) -> tuple[float, float]:
    """The AUC axis: the values with a 10 % margin, widened about their middle to at least
    ``min_span``, kept inside [0, 1]."""
    finite = _finite(values) or [0.5]
    lo, hi = min(finite), max(finite)
    pad = 0.1 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    if hi - lo < min_span:
        mid = (lo + hi) / 2
        lo, hi = mid - min_span / 2, mid + min_span / 2
    if lo < 0:
        lo, hi = 0.0, min(1.0, hi - lo)
    if hi > 1:
        lo, hi = max(0.0, lo - (hi - 1)), 1.0
    return lo, hi


def managed_series(train: list[Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per managed table, its train records' ``id_managers`` numbers by step (``step`` plus
    :data:`MANAGED_RATES` and :data:`MANAGED_COUNTS`); empty without managed tables."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in train:
        for table, stats in (r.get("id_managers") or {}).items():
            s = out.setdefault(table, {k: [] for k in ("step", *MANAGED_RATES,
                                                       *MANAGED_COUNTS)})
            s["step"].append(r["step"])
            for k in (*MANAGED_RATES, *MANAGED_COUNTS):
                v = stats.get(k)
                s[k].append(float(v) if isinstance(v, (int, float)) else math.nan)
    return out


def tier_series(train: list[Mapping[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per table on a cached tier, its train records' ``caches`` numbers by logging window
    (``step``, ``hit_rate``, :data:`TIER_ROWS`, :data:`TIER_PREFETCH`); empty without such
    tables."""
    out: dict[str, dict[str, list[float]]] = {}
    keys = ("hit_rate", *TIER_ROWS, *TIER_PREFETCH)
    for r in train:
        for table, stats in (r.get("caches") or {}).items():
            s = out.setdefault(table, {k: [] for k in ("step", *keys)})
            s["step"].append(r["step"])
            for k in keys:
                v = stats.get(k)
                s[k].append(float(v) if isinstance(v, (int, float)) else math.nan)
    return out


def _draw_tiers(hits, rows, prefetch, tiers) -> None:
    """The tiered tables' row: hit rate, rows fetched (-) and written back (--) per step, the
    prefetch's hidden (-) and exposed (--) ms per step and rank; one colour per table."""
    for i, (table, s) in enumerate(tiers.items()):
        color = f"C{i % 10}"
        hits.plot(s["step"], s["hit_rate"], "o-", markersize=3, color=color, label=table)
        for k, style in zip(TIER_ROWS, ("o-", "s--"), strict=True):
            rows.plot(s["step"], s[k], style, markersize=3, color=color,
                      label=f"{table} {k.removesuffix('_per_step')}")
        for k, style in zip(TIER_PREFETCH, ("o-", "s--"), strict=True):
            prefetch.plot(s["step"], s[k], style, markersize=3, color=color,
                          label=f"{table} {k.removeprefix('prefetch_').removesuffix('_ms')}")
    hits.set(title="tiered tables: hit rate (distinct rows)", xlabel="step",
             ylabel="hits / distinct rows", ylim=(0, 1.05))
    rows.set(title="tiered tables: rows fetched (-), written back (--)", xlabel="step",
             ylabel="rows per step")
    prefetch.set(title="tiered tables: prefetch hidden (-), exposed (--)", xlabel="step",
                 ylabel="ms per step and rank")
    for ax in (rows, prefetch):
        ax.set_ylim(bottom=0)
    for ax in (hits, rows, prefetch):
        ax.legend(fontsize="x-small", ncols=2)


def _draw_managed(rates, counts, managed) -> None:
    """The managed tables' row: rates in [0, 1] and ids per step, one colour per table."""
    styles = {"occupancy": "-", "hit_rate": "--", "default_rate": ":"}
    for i, (table, s) in enumerate(managed.items()):
        color = f"C{i % 10}"
        for k, style in styles.items():
            rates.plot(s["step"], s[k], style, color=color, label=f"{table} {k}")
        for k, marker in zip(MANAGED_COUNTS, "o^sx", strict=True):
            counts.plot(s["step"], s[k], marker=marker, markersize=3, color=color,
                        label=f"{table} {k.removesuffix('_per_step')}")
    rates.set(title="managed tables: occupancy (-), hit rate (--), default rate (:)",
              xlabel="step", ylabel="share", ylim=(0, 1.05))
    counts.set(title="managed tables: ids per step", xlabel="step", ylabel="ids per step")
    counts.set_ylim(bottom=0)
    for ax in (rates, counts):
        ax.legend(fontsize="x-small", ncols=2)


def draw_run(run_dir: str, metrics: str = "metrics.jsonl",
             out: str | None = None) -> tuple[str, dict[str, Any]]:
    """Draw the run's curves and stage split into ``out`` (default ``<run_dir>/report.png``);
    returns the path and the drawn series (``panels``: the drawn axes' titles, also the
    PNG's ``Description``). PictureSkipped without matplotlib."""
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
        "managed": managed_series(train),
        "tiers": tier_series(train),
    }
    nrows = 1 + bool(series["managed"]) + bool(series["tiers"])
    fig = Figure(figsize=(14, 4.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, 3, squeeze=False)
    loss, auc, stages = axes[0]
    if series["managed"]:
        rates, counts, spare = axes[1]
        _draw_managed(rates, counts, series["managed"])
        spare.set_visible(False)
    if series["tiers"]:
        _draw_tiers(*axes[-1], series["tiers"])
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
    series["auc_ylim"] = auc_limits(series["eval_auc"])
    auc.set(xlabel="step", ylabel="AUC", ylim=series["auc_ylim"])
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
    series["panels"] = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    path = out or os.path.join(run_dir, PICTURE)
    save_figure(fig, path, description="panels: " + "; ".join(series["panels"]))
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
