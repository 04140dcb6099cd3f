"""Timing for the benchmarks, as ../shared/tools/fbgemm-sm90/BASELINES.md measures FBGEMM:

- median: each timed iteration is preceded by rewriting a 256 MB buffer (L2 flush) and a
  device sync, and timed with CUDA events; host overhead is included;
- pipelined: N back-to-back iterations between two events, divided by N (launches overlap);
- GPU-busy: the torch profiler over a few more iterations, the union of all device activity
  intervals divided by the iteration count (launch gaps removed), plus per-kernel µs/iter.

On CPU there is no device timeline: every time is wall time (``busy_source="wall"``), and
``cpu_util`` is the process's CPU time over the wall time of the timed loop (every thread of the
process counted, spin-waiting included: about how many cores the step kept busy).

``spread`` is the benchmarks' measure of how much repeated measurements disagree:
(max - min) / median; the targets read it. ``iqr_spread`` ((q75 - q25) / median, the middle
half of the repeats) is printed beside it: one repeat that met another job's burst moves it
little, so the two together tell an outlier from a spread-out set. ``paired_ratio`` compares
two providers repeat by repeat (each repeat times them back to back, so both see the same
machine state) instead of median against median.
"""

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

FLUSH_BYTES = 256 << 20


@dataclass(kw_only=True, frozen=True)
class TimerConfig:
    """Iteration counts of one measurement."""

    warmup: int = 3
    """Untimed calls first (compilation, autotuning, allocator growth)."""
    iters: int = 10
    """At most this many L2-flushed, event-timed iterations for the median."""
    min_iters: int = 5
    """At least this many, even when ``budget_s`` is spent."""
    budget_s: float = 1.5
    """Stop the timed loop after ``min_iters`` once this much wall time is spent."""
    pipelined: int = 10
    """Back-to-back iterations for the pipelined time (0: skip)."""
    profiled: int = 5
    """Iterations under the profiler for GPU-busy time and the kernel table (0: skip)."""


SPREAD_FLAG = 0.20
"""A spread above this is flagged in the reports: the repeats disagree, the medians are noise."""


def spread(values: list[float]) -> float | None:
    """(max - min) / median of repeated measurements (``None`` for fewer than two)."""
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid > 0 else None


def iqr_spread(values: list[float]) -> float | None:
    """(q75 - q25) / median of repeated measurements (quartiles interpolated between the
    values, inclusive of the ends; ``None`` for fewer than three)."""
    if len(values) < 3:
        return None
    q25, mid, q75 = statistics.quantiles(values, n=4, method="inclusive")
    return (q75 - q25) / mid if mid > 0 else None


def paired_ratio(other: dict[int, list[float]], base: dict[int, list[float]]) -> dict | None:
    """``other``'s time over ``base``'s, repeat by repeat: in repeat r each one's best over the
    thread counts ({count: [ms of repeat 0, 1, ...]}), then their ratio; the ``median``,
    ``min`` and ``max`` of those ratios and their count ``n`` (> 1: ``base`` faster). ``None``
    unless both have the same number (>= 2) of repeats at every count."""
    n = {len(v) for v in (*other.values(), *base.values())}
    if len(n) != 1 or n.pop() < 2:
        return None
    reps = len(next(iter(base.values())))
    ratios = [min(v[r] for v in other.values()) / min(v[r] for v in base.values())
              for r in range(reps)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "n": reps}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``[(start, end), ...]`` (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _device_events(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every device activity (kernels, memcpy, memset), without
    the GPU ranges of record_function annotations (they span gaps between kernels)."""
    from torch.autograd import DeviceType

    out = []
    try:  # the raw kineto events: names are not shortened
        for e in prof.profiler.kineto_results.events():
            kind = e.activity_type() if hasattr(e, "activity_type") else ""
            if e.device_type() == DeviceType.CUDA and "annotation" not in kind:
                out.append((e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3))
        return out
    except AttributeError:
        out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def gpu_busy(fn: Callable[[], object], n: int) -> tuple[float, dict[str, float]]:
    """GPU-busy ms per iteration (union of device intervals / n) and µs/iter per kernel name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = _device_events(prof)
    per_kernel: dict[str, float] = defaultdict(float)
    for name, start, end in events:
        per_kernel[name] += (end - start) / n
    busy_ms = union_length([(s, e) for _, s, e in events]) / n / 1e3
    kernels = dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    return busy_ms, kernels


class Timer:
    """Measures one callable (one training iteration) on ``device``; see the module docstring."""

    def __init__(self, device: torch.device, config: TimerConfig) -> None:
        self.device = device
        self.config = config
        self.cuda = device.type == "cuda"
        self._flush = (
            torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device) if (self.cuda) else None
        )

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def measure(self, fn: Callable[[], object]) -> dict:
        """median_ms, pipelined_ms, busy_ms (+ busy_source), kernels {name: µs/iter}, peak_gb."""
        cfg = self.config
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(cfg.warmup):
            fn()
        self._sync()
        times, t_start, cpu_start = [], time.perf_counter(), time.process_time()
        for i in range(max(cfg.iters, 1)):
            if self.cuda:
                self._flush.add_(1)  # read + rewrite 256 MB: the L2 holds none of the inputs
                torch.cuda.synchronize()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            if i + 1 >= cfg.min_iters and time.perf_counter() - t_start > cfg.budget_s:
                break
        result = {"median_ms": statistics.median(times), "n_timed": len(times)}
        if not self.cuda:
            wall = time.perf_counter() - t_start
            result["cpu_util"] = (time.process_time() - cpu_start) / wall if wall > 0 else None
        result["pipelined_ms"] = None
        if cfg.pipelined > 0:
            self._sync()
            t0 = time.perf_counter()
            if self.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            for _ in range(cfg.pipelined):
                fn()
            if self.cuda:
                end.record()
                end.synchronize()
                result["pipelined_ms"] = start.elapsed_time(end) / cfg.pipelined
            else:
                result["pipelined_ms"] = (time.perf_counter() - t0) * 1e3 / cfg.pipelined
        if self.cuda and cfg.profiled > 0:
            result["busy_ms"], result["kernels"] = gpu_busy(fn, cfg.profiled)
            result["busy_source"] = "profiler"
        else:
            result["busy_ms"], result["kernels"] = result["median_ms"], {}
            result["busy_source"] = "wall"
        result["peak_gb"] = None
        if self.cuda:
            self._sync()
            peak = torch.cuda.max_memory_allocated(self.device) - FLUSH_BYTES
            result["peak_gb"] = peak / 1e9
        return result


def copy_bandwidth(device: torch.device) -> dict:
    """Device-to-device copy GB/s (bytes read + written): a 4 GB buffer on CUDA (CUDA-event
    median of 10), a 64 MB one on CPU (wall time)."""
    nbytes = (1 << 32) if device.type == "cuda" else (1 << 26)
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            y.copy_(x)
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            y.copy_(x)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= 3:
            times.append(ms)
    ms = statistics.median(times)
    del x, y
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_gbs": 2 * nbytes / ms / 1e6, "copy_bytes": nbytes, "copy_ms": ms}
