"""``fbtriton-dist plan --png FILE``: the per-rank numbers of the plan report as a picture.

Three panels from the same :class:`~.cost.PlanCost` terms that ``report.format_report``
prints: memory (weights + optimizer state, with the budget as a line), expected lookups per
step, and traffic per step (input dist, output dist, and the part of both that crosses
hosts). Up to :data:`BARS_UP_TO` ranks, one bar (group) per rank; past that, bars would be
thinner than a pixel, so each panel draws the distribution over ranks instead: every rank's
value sorted from the largest down against the share of ranks (the curve's left end is the
worst rank, its height at 50 % the median), with the p50 / p99 / max in the legend.
matplotlib is optional (``pip install matplotlib``):
without it :func:`draw_plan` raises :class:`PictureSkipped` and the command says so in one
line.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence

from .cost import PlanCost

__all__ = ["BARS_UP_TO", "PictureSkipped", "draw_plan", "figure_class", "layout",
           "save_figure"]

GiB = 1024**3
MB = 1e6
BARS_UP_TO = 48
"""Most ranks drawn as one bar each; more are drawn as sorted distributions."""


class PictureSkipped(RuntimeError):
    """No picture: matplotlib is not installed (the message says how to get it)."""


def figure_class():
    """matplotlib's ``Figure`` (no pyplot, no display, any thread), or PictureSkipped."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PictureSkipped("matplotlib is not installed (pip install matplotlib, or "
                             "pip install 'fbtriton_dist[plot]')") from e
    return Figure


def save_figure(fig, path: str, description: str | None = None) -> str:
    """Write ``fig`` to ``path`` as PNG, atomically (a reader never sees half a file);
    ``description``: the PNG's ``Description`` text."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    metadata = {"Description": description} if description is not None else None
    fig.savefig(tmp, format="png", dpi=110, metadata=metadata)
    os.replace(tmp, path)
    return path


def layout(num_ranks: int) -> str:
    """``"bars"`` (one bar per rank) up to :data:`BARS_UP_TO` ranks, else ``"sorted"``."""
    return "bars" if num_ranks <= BARS_UP_TO else "sorted"


def _percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile of ``values`` (0 < q <= 100)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * q // 100) - 1))]


def _sorted_curve(ax, values: Sequence[float], label: str, **kw) -> None:
    """``values`` from the largest down against the share of ranks, p50 / p99 / max labelled."""
    n = len(values)
    x = [100.0 * (i + 0.5) / n for i in range(n)]
    stats = ", ".join(f"{name} {_percentile(values, q):.3g}"
                      for name, q in (("p50", 50), ("p99", 99), ("max", 100)))
    ax.plot(x, sorted(values, reverse=True), label=f"{label} ({stats})", **kw)


def draw_plan(cost: PlanCost, path: str, title: str = "",
              budget_bytes: float | None = None) -> dict[str, Sequence[float] | str]:
    """Draw the plan's per-rank memory, lookups and traffic into the PNG ``path``; returns
    the drawn series (GiB, lookups, MB; each indexed by rank) and the ``layout``."""
    Figure = figure_class()
    ranks = [r.rank for r in cost.ranks]
    series = {
        "weights_gib": [r.weight_bytes / GiB for r in cost.ranks],
        "state_gib": [r.state_bytes / GiB for r in cost.ranks],
        "lookups": [float(r.lookups) for r in cost.ranks],
        "input_dist_mb": [r.input_dist_bytes / MB for r in cost.ranks],
        "output_dist_mb": [r.output_dist_bytes / MB for r in cost.ranks],
        "inter_host_mb": [r.inter_host_bytes / MB for r in cost.ranks],
    }
    kind = layout(len(ranks))
    width = max(10.0, min(24.0, 4.0 + 0.35 * len(ranks) * 3)) if kind == "bars" else 16.0
    fig = Figure(figsize=(width, 4.2), layout="constrained")
    mem, look, comm = fig.subplots(1, 3)
    if kind == "bars":
        _bars(mem, look, comm, cost, ranks, series, budget_bytes)
    else:
        _distributions(mem, look, comm, cost, series, budget_bytes)
    slowest = max(cost.ranks, key=lambda r: r.time_s)
    title = "\n".join(textwrap.wrap(title, int(width * 11))) if title else ""
    fig.suptitle(f"{title}\nstep estimate {slowest.time_s * 1e3:.3f} ms (rank {slowest.rank}), "
                 f"time imbalance {cost.imbalance():.3f}", fontsize="medium")
    save_figure(fig, path)
    return {**series, "layout": kind}


def _distributions(mem, look, comm, cost: PlanCost, series, budget_bytes) -> None:
    """Each term's values over ranks, sorted: the shape of the imbalance at any rank count."""
    memory = [w + s for w, s in zip(series["weights_gib"], series["state_gib"], strict=True)]
    _sorted_curve(mem, memory, "weights + state")
    _sorted_curve(mem, series["weights_gib"], "weights", linestyle=":")
    if budget_bytes is not None:
        mem.axhline(budget_bytes / GiB, color="black", linestyle="--", linewidth=1,
                    label="budget")
    mem.set(title=f"memory (max/mean {cost.imbalance('memory_bytes'):.2f})",
            xlabel="ranks, sorted largest first (%)", ylabel="GiB")
    _sorted_curve(look, series["lookups"], "lookups", color="tab:green")
    look.set(title=f"lookups per step (max/mean {cost.imbalance('lookups'):.2f})",
             xlabel="ranks, sorted largest first (%)", ylabel="ids")
    for key, label in (("input_dist_mb", "input dist"), ("output_dist_mb", "output dist"),
                       ("inter_host_mb", "across hosts")):
        _sorted_curve(comm, series[key], label)
    comm.set(title=f"traffic per step (max/mean {cost.imbalance('comm_bytes'):.2f})",
             xlabel="ranks, sorted largest first (%)", ylabel="MB received")
    for ax in (mem, look, comm):
        ax.set_xlim(0, 100)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="x-small")


def _bars(mem, look, comm, cost: PlanCost, ranks, series, budget_bytes) -> None:
    """One bar (group) per rank."""
    mem.bar(ranks, series["weights_gib"], label="weights")
    mem.bar(ranks, series["state_gib"], bottom=series["weights_gib"], label="optimizer state")
    if budget_bytes is not None:
        mem.axhline(budget_bytes / GiB, color="black", linestyle="--", linewidth=1,
                    label="budget")
    mem.set(title=f"memory (max/mean {cost.imbalance('memory_bytes'):.2f})", xlabel="rank",
            ylabel="GiB")
    mem.legend(fontsize="small")
    look.bar(ranks, series["lookups"], color="tab:green")
    look.set(title=f"lookups per step (max/mean {cost.imbalance('lookups'):.2f})",
             xlabel="rank", ylabel="ids")
    w = 0.28
    for i, (key, label) in enumerate((("input_dist_mb", "input dist"),
                                      ("output_dist_mb", "output dist"),
                                      ("inter_host_mb", "of which across hosts"))):
        comm.bar([r + (i - 1) * w for r in ranks], series[key], width=w, label=label)
    comm.set(title=f"traffic per step (max/mean {cost.imbalance('comm_bytes'):.2f})",
             xlabel="rank", ylabel="MB received")
    top = max([*series["input_dist_mb"], *series["output_dist_mb"], 0.0])
    comm.set_ylim(0, 1.35 * top if top > 0 else 1.0)  # room for the legend above the bars
    comm.legend(fontsize="x-small", loc="upper center", ncols=3)
    for ax in (mem, look, comm):
        ax.set_xticks(ranks if len(ranks) <= 32 else ranks[:: max(1, len(ranks) // 16)])
