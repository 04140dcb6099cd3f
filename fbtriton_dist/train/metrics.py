"""Metrics of the training job: AUC, a per-step time split, managed tables' id maps, a JSONL
writer, the final summary."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "STAGES",
    "IdManagerMetrics",
    "MetricsWriter",
    "StageTimer",
    "Throughput",
    "auc",
    "format_summary",
]

STAGES = ("input_dist", "lookup", "output_dist", "dense", "backward", "step")
"""Named parts of a step; the unsharded job reports lookup, dense and backward;
``train.pipeline: graph`` only ``step``, the whole replayed step."""


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the probability that a random positive scores above a random
    negative, ties counting one half (Mann-Whitney U from average ranks). NaN without both
    classes. ``scores`` and ``labels`` are ``[N]``; labels are 0/1."""
    scores = scores.detach().reshape(-1).double().cpu()
    pos = labels.detach().reshape(-1).cpu() > 0.5
    n_pos = int(pos.sum())
    n_neg = pos.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = torch.argsort(scores)
    _, inverse, counts = torch.unique_consecutive(
        scores[order], return_inverse=True, return_counts=True
    )
    ends = counts.cumsum(0).double()  # 1-based rank of the last element of each tie group
    average = ends - (counts.double() - 1.0) / 2.0
    ranks = torch.empty_like(scores)
    ranks[order] = average[inverse]
    u = ranks[pos].sum().item() - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


class StageTimer:
    """Accumulates seconds per named stage (:data:`STAGES`) over a logging window; the first
    ``warmup_steps`` steps are not counted.

    On CPU stages are ``time.perf_counter`` intervals (no synchronisation needed). On CUDA
    each stage records a pair of events and the window is resolved once in :meth:`take`, so
    the step itself never synchronises. Capture-safe: while the current CUDA stream is being
    captured into a graph nothing is recorded (time a replayed graph from outside it).
    """

    def __init__(self, device: torch.device | str = "cpu", warmup_steps: int = 1) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.warmup_steps = warmup_steps  # first steps (compilation, allocation): dropped
        self._open: dict[str, Any] = {}
        self._pending: list[tuple[str, Any, Any]] = []
        self._window: dict[str, float] = {}
        self._total: dict[str, float] = {}
        self._steps = 0
        self._total_steps = 0

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _capturing(self) -> bool:
        return self.cuda and torch.cuda.is_current_stream_capturing()

    def start(self, stage: str) -> None:
        if self._capturing():  # an event with timing cannot be recorded into a graph
            return
        self._open[stage] = self._now()

    def cancel(self, stage: str) -> None:
        """Forget a started stage (the step it timed did not happen)."""
        self._open.pop(stage, None)

    def stop(self, stage: str) -> None:
        if self._capturing():
            return
        begin = self._open.pop(stage, None)
        if begin is None:
            return
        end = self._now()
        if self.cuda:
            self._pending.append((stage, begin, end))
        else:
            self._window[stage] = self._window.get(stage, 0.0) + end - begin

    def step_done(self) -> None:
        if self.warmup_steps > 0:
            self.warmup_steps -= 1
            self._window.clear()
            self._pending.clear()
            return
        self._steps += 1

    def take(self) -> dict[str, float]:
        """Mean milliseconds per step of each stage since the last call (and reset)."""
        if self._pending:
            torch.cuda.synchronize()
            for stage, begin, end in self._pending:
                self._window[stage] = self._window.get(stage, 0.0) + begin.elapsed_time(end) / 1e3
            self._pending.clear()
        steps = max(self._steps, 1)
        out = {s: 1e3 * v / steps for s, v in self._window.items()}
        for s, v in self._window.items():
            self._total[s] = self._total.get(s, 0.0) + v
        self._total_steps += self._steps
        self._window, self._steps = {}, 0
        return _ordered(out)

    def totals(self) -> dict[str, float]:
        """Mean milliseconds per step of each stage over every window taken so far."""
        steps = max(self._total_steps, 1)
        return _ordered({s: 1e3 * v / steps for s, v in self._total.items()})


def _ordered(ms: dict[str, float]) -> dict[str, float]:
    """:data:`STAGES` first, in their order, then any other stage."""
    return {s: ms[s] for s in (*STAGES, *sorted(set(ms) - set(STAGES))) if s in ms}


class Throughput:
    """Samples/s over training time only: per logging window and over the whole run.

    :meth:`step` marks the end of each step; the first step (warm-up: compilation,
    allocation) is not counted, nor is time before :meth:`restart_clock` (evaluations,
    checkpoints). On a GPU, call :meth:`step` after the window's one synchronising read
    (the loss) so the queued work falls in the window it belongs to.
    """

    def __init__(self, samples_per_step: int) -> None:
        self.samples_per_step = samples_per_step
        self._mark = time.perf_counter()
        self._steps = 0
        self._window = [0, 0.0]  # steps, seconds
        self._run = [0, 0.0]

    def step(self) -> None:
        now = time.perf_counter()
        dt, self._mark = now - self._mark, now
        self._steps += 1
        if self._steps > 1:
            for acc in (self._window, self._run):
                acc[0] += 1
                acc[1] += dt

    def restart_clock(self) -> None:
        self._mark = time.perf_counter()

    def _rate(self, acc: list) -> float:
        return acc[0] * self.samples_per_step / acc[1] if acc[1] > 0 else math.nan

    def window(self) -> float:
        """Samples/s since the last call (and start a new window)."""
        rate = self._rate(self._window)
        self._window = [0, 0.0]
        return rate

    def run(self) -> float:
        """Samples/s over every timed step so far."""
        return self._rate(self._run)


PER_STEP = ("lookups", "admitted", "evicted", "expired", "rejected", "overflow")
"""The id managers' counts reported per step (``ops/id_remap.py`` ``STATS``)."""


def _window(now: Mapping[str, float], then: Mapping[str, float] | None) -> dict[str, float]:
    """One table's numbers between two reads of its ``metrics()`` (``then`` None: since the
    table's first step)."""
    then = then or {}
    d = {k: now[f"total_{k}"] - then.get(f"total_{k}", 0) for k in (*PER_STEP, "hits",
                                                                     "default_reads")}
    steps = now["step"] - then.get("step", 0)
    out = {"occupancy": round(now["occupancy"], 6),
           "hit_rate": round(d["hits"] / d["lookups"], 6) if d["lookups"] else math.nan,
           "default_rate": round(d["default_reads"] / d["lookups"], 6) if d["lookups"]
           else math.nan}
    out.update({f"{k}_per_step": round(d[k] / steps, 3) if steps else math.nan
                for k in PER_STEP})
    out["steps"] = int(steps)
    return out


class IdManagerMetrics:
    """The managed tables (``id_manager``) of the job's embedding modules, over each logging
    window: per table ``occupancy`` (occupied slots / capacity, now), ``hit_rate`` (ids that
    had a slot / ids looked up), ``default_rate`` (ids read from the default row / ids),
    ``<stat>_per_step`` (ids looked up, admitted, slots evicted, expired, ids rejected below
    ``min_count``, overflowed) and the training ``steps`` it covers.

    Read from the managers' cumulative ``totals`` and ``step`` (kept in checkpoints), so eval
    lookups are not counted and a window after a resume starts at the checkpoint. A sharded
    collection's ``metrics()`` is a collective: every rank calls :meth:`begin`, :meth:`take`
    and :meth:`run` at the same steps."""

    def __init__(self, modules: Sequence[Any]) -> None:
        self.modules = [m for m in modules if getattr(m, "id_managers", None) is not None]
        self._start: dict[str, dict[str, float]] = {}
        self._first: dict[str, dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.modules)

    def _read(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for m in self.modules:
            out.update(m.id_managers.metrics())
        return out

    def begin(self) -> None:
        """Mark the run's start (and the first window's)."""
        self._first = self._start = self._read()

    def take(self) -> dict[str, dict[str, float]]:
        """Per table, the numbers since the last call (or :meth:`begin`)."""
        now = self._read()
        out = {name: _window(v, self._start.get(name)) for name, v in now.items()}
        self._start = now
        return out

    def run(self) -> dict[str, dict[str, float]]:
        """Per table, the numbers since :meth:`begin`, and its ``total_admitted`` /
        ``total_evicted`` since its first step."""
        now = self._read()
        out = {}
        for name, v in now.items():
            out[name] = _window(v, self._first.get(name))
            out[name].update(total_admitted=v["total_admitted"],
                             total_evicted=v["total_evicted"])
        return out


class CacheMetrics:
    """The tables on a cached storage tier (``cached`` / ``file``) of the job's embedding
    modules, over each logging window: per table ``hit_rate`` (distinct rows of a lookup
    found in the cache / distinct rows looked up; eval lookups count too),
    ``fetched_per_step`` (rows loaded into the cache), ``written_back_per_step`` (dirty rows
    and their optimizer state written to the backing store) and ``evicted_per_step``, summed
    over the table's shards on every rank (``cache_stats()`` of the modules; an all-reduce
    when sharded: every rank calls :meth:`take` and :meth:`run` at the same steps).

    The prefetch (the step loop reads the next batch's missing rows on a worker thread while
    this step computes: the ``overlap`` pipeline, or the plain loop in one process):
    ``prefetched_per_step`` (rows read ahead), ``prefetch_used_per_step`` (rows loaded from
    them), ``prefetch_hidden_ms`` (the worker's time the step did not wait for) and
    ``prefetch_exposed_ms`` (the time lookups waited for it), per step and rank: summed over
    the table's shards, divided by the steps and the ranks. All 0 for a table whose rows are
    not read ahead (``train.prefetch_rows``: ``auto`` reads only ``file`` tables')."""

    KEYS = ("lookups", "misses", "evictions", "writebacks", "prefetched", "prefetch_used",
            "prefetch_us", "prefetch_wait_us")

    def __init__(self, modules: Sequence[Any], group: Any = None) -> None:
        self.modules = [m for m in modules if callable(getattr(m, "cache_stats", None))]
        self.group = group
        self.tables = sorted(self._local())
        self.ranks = 1
        if group is not None:  # every rank the same list: shards of a table may be elsewhere
            import torch.distributed as dist

            self.ranks = dist.get_world_size(group)
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, self.tables, group=group)
            self.tables = sorted({t for ts in everyone for t in ts})
        self._start: tuple[int, dict] | None = None
        self._first: tuple[int, dict] | None = None

    def __bool__(self) -> bool:
        return bool(self.tables)

    def _local(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for m in self.modules:
            for name, v in m.cache_stats().items():
                table = name.split("[", 1)[0]  # a shard: "table[rows, cols]"
                acc = out.setdefault(table, dict.fromkeys(self.KEYS, 0))
                for k in self.KEYS:
                    acc[k] += int(v[k])
        return out

    def _read(self) -> dict[str, dict[str, int]]:
        local = self._local()
        flat = torch.tensor([[local.get(t, {}).get(k, 0) for k in self.KEYS]
                             for t in self.tables], dtype=torch.int64)
        if self.group is not None:
            import torch.distributed as dist

            if dist.get_backend(self.group) == "nccl":  # NCCL reduces device tensors only
                flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(flat, group=self.group)
        return {t: dict(zip(self.KEYS, map(int, row), strict=True))
                for t, row in zip(self.tables, flat.tolist(), strict=True)}

    def begin(self, step: int) -> None:
        self._first = self._start = (step, self._read())

    def _window(self, now: dict, since: tuple[int, dict] | None, step: int) -> dict[str, dict]:
        s0, before = since if since is not None else (0, {})
        steps = step - s0
        ms = 1e-3 / (steps * self.ranks) if steps else math.nan  # us -> ms per step and rank
        out = {}
        for t, v in now.items():
            d = {k: v[k] - before.get(t, {}).get(k, 0) for k in v}
            hidden = max(d["prefetch_us"] - d["prefetch_wait_us"], 0)
            out[t] = {
                "hit_rate": round(1 - d["misses"] / d["lookups"], 4) if d["lookups"] else math.nan,
                "fetched_per_step": round(d["misses"] / steps, 3) if steps else math.nan,
                "written_back_per_step": round(d["writebacks"] / steps, 3) if steps else math.nan,
                "evicted_per_step": round(d["evictions"] / steps, 3) if steps else math.nan,
                "prefetched_per_step": round(d["prefetched"] / steps, 3) if steps else math.nan,
                "prefetch_used_per_step": (round(d["prefetch_used"] / steps, 3) if steps
                                           else math.nan),
                "prefetch_hidden_ms": round(hidden * ms, 4),
                "prefetch_exposed_ms": round(d["prefetch_wait_us"] * ms, 4),
                "steps": int(steps),
            }
        return out

    def take(self, step: int) -> dict[str, dict[str, float]]:
        """Per table, the numbers since the last call (or :meth:`begin`)."""
        now = self._read()
        out = self._window(now, self._start, step)
        self._start = (step, now)
        return out

    def run(self, step: int) -> dict[str, dict[str, float]]:
        """Per table, the numbers since :meth:`begin`."""
        return self._window(self._read(), self._first, step)


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (rank 0 only; others pass ``path=None``),
    and mirrors numbers to TensorBoard when ``tensorboard_dir`` is set and it is installed."""

    def __init__(self, path: str | None, tensorboard_dir: str | None = None) -> None:
        self.path = path
        self._file = None
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._tb = None
        if path is not None and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn(
                    "logging.tensorboard is set but tensorboard is not installed "
                    "(pip install tensorboard); metrics go to the JSONL file only"
                )
            else:
                self._tb = SummaryWriter(tensorboard_dir)

    def write(self, kind: str, step: int, **values: Any) -> None:
        if self._file is None:
            return
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, value in _flatten(values):
                self._tb.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _flatten(values: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    for k, v in values.items():
        if isinstance(v, Mapping):
            yield from _flatten(v, f"{prefix}{k}/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{prefix}{k}", float(v)


def format_summary(summary: Mapping[str, Any]) -> str:
    """The end-of-job summary, one ``key: value`` per line."""
    lines = ["training summary"]
    for k, v in summary.items():
        if k in ("id_managers", "caches"):  # per managed / cached table, its numbers
            for table, m in v.items():
                text = ", ".join(f"{s} {x:.4g}" if isinstance(x, float) else f"{s} {x}"
                                 for s, x in m.items())
                lines.append(f"  {k}.{table}: {text}")
            continue
        if isinstance(v, Mapping):
            v = ", ".join(f"{s} {ms:.2f} ms" for s, ms in v.items()) or "-"
        elif isinstance(v, float):
            v = f"{v:.4f}" if abs(v) < 1e4 else f"{v:,.0f}"
        lines.append(f"  {k}: {v}")
    return "\n".join(lines)
