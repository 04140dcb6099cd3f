"""PNG bar chart of a ``python -m fbtriton_dist.bench tbe --out r.json`` result, made without a
GPU: ``python -m fbtriton_dist.bench tbe --plot r.json --png r.png``. Needs matplotlib (only
here: the benchmark itself never imports it)."""

import json

PHASE_ORDER = ("fwd", "fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad")


def plot(json_path: str, png_path: str) -> None:
    """Top row: GPU-busy ms (log scale) per shape and provider, one panel per phase; bottom row:
    effective bandwidth at GPU-busy as % of the device-to-device copy bandwidth."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(
            f"--plot needs matplotlib, which is not importable here ({e}); "
            "install it with `pip install matplotlib` (only the plotting machine needs it)"
        ) from None
    with open(json_path) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if r.get("busy_ms") is not None]
    if not rows:
        raise SystemExit(f"{json_path}: no measured rows to plot")
    shapes = [s for s in data["shapes"] if any(r["shape"] == s for r in rows)]
    providers = [p for p in data["providers"] if any(r["provider"] == p for r in rows)]
    phases = [p for p in PHASE_ORDER if any(r["phase"] == p for r in rows)]
    by_key = {(r["shape"], r["provider"], r["phase"]): r for r in rows}
    source = "GPU-busy (profiler)" if rows[0].get("busy_source") == "profiler" else "wall time"

    fig, axes = plt.subplots(
        2, len(phases), figsize=(5.5 * len(phases), 8), squeeze=False, constrained_layout=True
    )
    width = 0.8 / max(len(providers), 1)
    for col, phase in enumerate(phases):
        for row, (key, label) in enumerate(
            (("busy_ms", f"{source}, ms (log)"), ("pct_copy_busy", "% of copy bandwidth"))
        ):
            ax = axes[row][col]
            for k, provider in enumerate(providers):
                xs, ys = [], []
                for i, shape in enumerate(shapes):
                    r = by_key.get((shape, provider, phase))
                    if r is not None and r.get(key) is not None:
                        xs.append(i + (k - (len(providers) - 1) / 2) * width)
                        ys.append(r[key])
                if xs:  # one color per provider in every panel
                    ax.bar(xs, ys, width=width, color=f"C{k % 10}", label=provider)
            ax.set_xticks(range(len(shapes)), shapes)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_yscale("log")
                ax.set_title(phase)
            ax.grid(axis="y", alpha=0.3)
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(
        [handles[p] for p in providers if p in handles],
        [p for p in providers if p in handles],
        loc="outside lower center",
        ncols=min(len(providers), 8),
    )
    fig.suptitle(
        f"TBE benchmark on {data.get('device', '?')}; copy {data.get('copy_gbs', 0):.0f} GB/s; "
        f"torch {data.get('torch', '?')}"
    )
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")
