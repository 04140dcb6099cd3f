"""What ``bench dist`` shows: the results table (rank 0 prints it) and the chart of a results
file (``--plot``: no torchrun, no GPU; matplotlib)."""

from __future__ import annotations

import json
from collections.abc import Sequence

PROVIDERS = ("torchrec", "ours_plain", "ours_lean", "ours_lean_bf16", "ours_dedup", "ours_fixed",
             "ours_graph", "ours_graph_overlap", "ours_graph_bf16")
"""Every provider, in the order of the table and the chart."""

# -- table -----------------------------------------------------------------------------------
COLUMNS = (
    ("plan", 10),
    ("model", 5),
    ("provider", 14),
    ("samples/s", 11),
    ("per rank", 10),
    ("ms/step", 8),
    ("x torchrec", 10),
    ("fwd", 7),
    ("in_dist", 7),
    ("lookup", 7),
    ("out_dist", 8),
    ("dense", 7),
    ("bwd", 7),
    ("busy ms", 8),
    ("nccl ms", 8),
    ("wall/busy", 9),
    ("MB/step", 8),
    ("peak GB", 7),
)


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _cells(r: dict) -> list[str]:
    vbe = "/vbe" if r.get("batch") == "vbe" else ""
    threads = f"@{r['threads_per_rank']}t" if r.get("threads_per_rank") else ""
    head = [r["plan"], r["model"], r["provider"] + vbe + threads]
    if r.get("status") != "ok":
        return head
    st, gpu = r.get("stages_ms", {}), r.get("gpu", {})
    sps, per_rank = r.get("samples_per_s"), r.get("samples_per_s_per_rank")
    return head + [
        f"{sps:,.0f}" if sps else "-",
        f"{per_rank:,.0f}" if per_rank else "-",
        _fmt(r["ms_per_step"]),
        _fmt(r.get("vs_torchrec")),
        *(
            _fmt(st.get(k))
            for k in ("forward", "input_dist", "lookup", "output_dist", "dense", "backward")
        ),
        _fmt(gpu.get("busy_ms")),
        _fmt(gpu.get("nccl_ms")),
        _fmt(gpu.get("wall_over_busy")),
        _fmt(r.get("bytes_sent_per_step", 0.0) / 1e6, 1),
        _fmt(r.get("peak_mem_gb")),
    ]


def line(r: dict) -> str:
    cells = _cells(r)
    if r.get("status") != "ok":
        return f"{' '.join(cells)}: {r.get('status')}: {r.get('note')}"
    return "  ".join(f"{name}={value}" for (name, _), value in zip(COLUMNS, cells, strict=False))


def format_table(rows: Sequence[dict]) -> str:
    """The results as a fixed-width table (samples/s: all ranks, and per rank; stage times: ms
    per step, rank 0; bytes: sent by
    all ranks per step); failed or skipped providers listed under it with the reason."""
    lines = ["  ".join(f"{name:>{w}}" for name, w in COLUMNS)]
    notes = []
    for r in rows:
        cells = _cells(r)
        if r.get("status") != "ok":
            notes.append(f"  {'/'.join(cells)}: {r.get('status')}: {r.get('note')}")
            continue
        lines.append("  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)))
    if notes:
        lines += ["not measured:", *notes]
    return "\n".join(lines)


def best_threads(rows: Sequence[dict]) -> list[dict]:
    """Per (plan, model, batch, provider): its fastest thread count per rank (most samples/s),
    that rate, and its ratio over ours_* and torchrec each at its own best count."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("status") != "ok" or not r.get("threads_per_rank"):
            continue
        key = (r["plan"], r["model"], r.get("batch"), r["provider"])
        if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
            best[key] = {"plan": r["plan"], "model": r["model"], "batch": r.get("batch"),
                         "provider": r["provider"], "threads_per_rank": r["threads_per_rank"],
                         "oversubscribed": r.get("oversubscribed"),
                         "samples_per_s": r["samples_per_s"], "ms_per_step": r["ms_per_step"]}
    for (plan, model, batch, _), b in best.items():
        peer = best.get((plan, model, batch, "torchrec"))
        b["vs_torchrec_best"] = peer and b["samples_per_s"] / peer["samples_per_s"]
    return list(best.values())


def best_table(best: Sequence[dict]) -> str:
    """``best_threads`` as lines: each provider at its best thread count per rank."""
    lines = ["each provider at its best thread count per rank:",
             f"{'plan':>10}  {'model':>5}  {'provider':>18}  {'threads':>7}  {'samples/s':>11}  "
             f"{'ms/step':>8}  {'x torchrec':>10}"]
    for b in best:
        lines.append(
            f"{b['plan']:>10}  {b['model']:>5}  {b['provider']:>18}  {b['threads_per_rank']:>7}  "
            f"{b['samples_per_s']:>11,.0f}  {b['ms_per_step']:>8.2f}  "
            f"{_fmt(b['vs_torchrec_best']):>10}")
    return "\n".join(lines)


def vbe_table(rows: Sequence[dict]) -> str:
    """Per (plan, model, provider) measured on both: ids and bytes sent by all ranks per step
    and ms per step, VBE batches against the same samples as fixed batches."""
    by = {(r["plan"], r["model"], r["provider"], r.get("batch")): r for r in rows
          if r.get("status") == "ok"}
    lines = ["VBE vs the same samples as fixed batches (all ranks, per step):",
             f"{'plan':>10}  {'model':>5}  {'provider':>14}  {'ids vbe':>10}  {'ids fixed':>10}  "
             f"{'MB vbe':>8}  {'MB fixed':>8}  {'ms vbe':>8}  {'ms fixed':>8}"]
    for (plan, model, provider, batch), v in by.items():
        f = by.get((plan, model, provider, "fixed"))
        if batch != "vbe" or f is None:
            continue
        lines.append(
            f"{plan:>10}  {model:>5}  {provider:>14}  {_fmt(v.get('ids_sent_per_step'), 0):>10}  "
            f"{_fmt(f.get('ids_sent_per_step'), 0):>10}  "
            f"{v['bytes_sent_per_step'] / 1e6:>8.2f}  {f['bytes_sent_per_step'] / 1e6:>8.2f}  "
            f"{v['ms_per_step']:>8.2f}  {f['ms_per_step']:>8.2f}")
    return "\n".join(lines)


def _stage(stages: dict, name: str) -> float:
    """A stage's ms for the chart; ``forward`` only where the forward was not split."""
    if name == "forward":
        return 0.0 if "dense" in stages else float(stages.get("forward") or 0.0)
    return float(stages.get(name) or 0.0)


def plot(path: str, png: str) -> None:
    """Bar charts of a results file: samples/s per provider in each (plan, model) group, with
    the ratio to TorchRec; and each provider's step split into stages."""
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); pip install matplotlib") from e
    rows = [r for r in results["rows"] if r.get("status") == "ok"]
    if not rows:
        raise SystemExit(f"{path}: no measured rows to plot")
    groups = list(dict.fromkeys((r["plan"], r["model"], r.get("batch", "fixed")) for r in rows))
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8, 2.6 * len(groups)), 9))
    width = 0.8 / max(len(providers), 1)
    for i, prov in enumerate(providers):
        xs, ys, labels = [], [], []
        for g, group in enumerate(groups):
            key = (*group, prov)
            r = next((r for r in rows
                      if (r["plan"], r["model"], r.get("batch", "fixed"), r["provider"]) == key),
                     None)
            if r is None or not r.get("samples_per_s"):
                continue
            xs.append(g + (i - (len(providers) - 1) / 2) * width)
            ys.append(r["samples_per_s"] / 1e6)
            labels.append(f"{r['vs_torchrec']:.2f}x" if r.get("vs_torchrec") else "")
        bars = ax1.bar(xs, ys, width, label=prov)
        for bar, label in zip(bars, labels, strict=True):
            if label:
                ax1.annotate(
                    label,
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax1.set_xticks(range(len(groups)),
                   [f"{p}\n{m}" + ("\nvbe" if b == "vbe" else "") for p, m, b in groups])
    ax1.set_ylabel("M samples/s (global)")
    setup = results.get("setup", {})
    ax1.set_title(
        f"{setup.get('world_size', '?')} x {setup.get('device', '?')}: "
        f"{setup.get('tables', '?')} tables, {setup.get('weights_gb', 0):.3g} GB, "
        f"B={setup.get('batch_size_per_rank', '?')}/rank (label: x TorchRec)"
    )
    ax1.legend(fontsize=8)
    names = [f"{r['plan'][:5]}/{r['model']}/{r['provider']}" + ("/vbe" if r.get("batch") == "vbe"
             else "") for r in rows]
    bottom = [0.0] * len(rows)
    for s in ("input_dist", "lookup", "output_dist", "dense", "forward", "backward"):
        vals = [_stage(r.get("stages_ms", {}), s) for r in rows]
        if s == "forward" and not any(vals):
            continue
        label = "forward (not split)" if s == "forward" else s
        ax2.bar(range(len(rows)), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    busy = [r.get("gpu", {}).get("busy_ms") for r in rows]
    if any(busy):
        ax2.scatter(
            [i for i, b in enumerate(busy) if b],
            [b for b in busy if b],
            color="black",
            marker="_",
            s=300,
            label="GPU busy",
            zorder=3,
        )
    ax2.scatter(range(len(rows)), [r["ms_per_step"] for r in rows], color="black", marker="o",
                s=12, label="ms/step, timed (no stage timers)", zorder=3)  # fmt: skip
    ax2.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
    ax2.set_ylabel("ms per step (stages: rank 0)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"chart written to {png}")
