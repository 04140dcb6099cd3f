"""How ``bench dist`` measures one provider on this rank: four phases on the same batch stream.

1. warm-up steps (compilation, autotuning, allocation): not counted (their losses kept: the
   first is the loss of the initial weights);
2. timed steps: step boundaries marked with CUDA events (CPU: ``perf_counter``), the whole
   phase between two synchronisations -> ms/step (median) and samples/s;
3. profiled steps: on CUDA, ``torch.profiler`` device activity -> GPU-busy time per step
   (union of kernel / memcpy / memset intervals), NCCL kernel time (union of kernels whose name
   has ``nccl``) and the rest; on the CPU, the operators' self time and gloo's
   (``dist_cpu.cpu_profile``);
4. split steps: stage timers (``fbtriton_dist.train.metrics.StageTimer``) around the sharded
   collection's ``input_dist`` / ``compute`` (lookup) / ``output_dist``, the model's forward and
   the whole step: dense = forward - embedding stages, backward = step - forward (optimizer
   and dense all-reduce included; a pipeline's input dist, which runs outside the forward,
   taken out of it). Last, because the timers stay installed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fbtriton_dist.train.loop import timed

from .dist_providers import Runner

DEVICE_KINDS = ("kernel", "memcpy", "memset")  # kineto activity kinds of device work


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Marks:
    """Step boundaries: CUDA events on the current stream, or host clock readings."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        m = self.marks
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(m, m[1:], strict=False)]
        return [1e3 * (b - a) for a, b in zip(m, m[1:], strict=False)]


def _union_ns(intervals: Sequence[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def device_intervals(prof) -> list[tuple[int, int, str]]:
    """``(start_ns, end_ns, name)`` of every device activity (kernels, copies, sets) the
    profiler saw; annotations projected on the GPU timeline are left out. By the event's
    activity kind where torch reports it, else by its device type."""
    events = list(prof.profiler.kineto_results.events())
    by_kind, by_device = [], []
    for e in events:
        item = (e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
        try:
            kind = str(e.activity_type()).lower()
        except AttributeError:  # a torch without activity kinds on its events
            kind = ""
        if any(word in kind for word in DEVICE_KINDS) and "annotation" not in kind:
            by_kind.append(item)
        annotation = getattr(e, "is_user_annotation", lambda: False)()
        if e.device_type() == torch.autograd.DeviceType.CUDA and not annotation:
            if not e.name().startswith("ProfilerStep"):
                by_device.append(item)
    return by_kind or by_device


def busy_stats(intervals: Sequence[tuple[int, int, str]], steps: int) -> dict[str, float]:
    """Per step: ``busy_ms`` (union of all device activity), ``nccl_ms`` (union of NCCL
    kernels), ``compute_ms`` (union of the rest) and ``span_ms`` (first start to last end)."""
    if not intervals:
        return {}
    nccl = [(a, b) for a, b, n in intervals if "nccl" in n.lower()]
    rest = [(a, b) for a, b, n in intervals if "nccl" not in n.lower()]
    per = 1e6 * max(steps, 1)
    return {
        "busy_ms": _union_ns([(a, b) for a, b, _ in intervals]) / per,
        "nccl_ms": _union_ns(nccl) / per,
        "compute_ms": _union_ns(rest) / per,
        "span_ms": (max(b for _, b, _ in intervals) - min(a for a, _, _ in intervals)) / per,
        "kernels_per_step": len(intervals) / max(steps, 1),
        "top": top_kernels(intervals, steps),
        "last_step": last_step(intervals, steps),
    }


def top_kernels(intervals: Sequence[tuple[int, int, str]], steps: int, n: int = 15) -> list:
    """``[name, ms per step, launches per step]`` of the ``n`` device activities that took the
    most time (summed durations, names cut to 80 characters), longest first."""
    total: dict[str, list[float]] = {}
    for a, b, name in intervals:
        t = total.setdefault(name[:80], [0.0, 0])
        t[0] += (b - a) / 1e6
        t[1] += 1
    per = max(steps, 1)
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:n]
    return [[name, round(ms / per, 4), round(k / per, 2)] for name, (ms, k) in ranked]


def last_step(intervals: Sequence[tuple[int, int, str]], steps: int) -> list:
    """``[name, start µs from the step's first activity, µs]`` of the last step's device
    activities in start order (the last ``len / steps`` of them; names cut to 60 characters):
    where a step's time goes, kernel by kernel."""
    ordered = sorted(intervals)
    n = len(ordered) // max(steps, 1)
    tail = ordered[len(ordered) - n :] if n else []
    t0 = tail[0][0] if tail else 0
    return [[name[:60], round((a - t0) / 1e3, 1), round((b - a) / 1e3, 1)] for a, b, name in tail]


def split_steps(runner: Runner, steps: int, device: torch.device) -> dict[str, float]:
    """Mean ms per step of each stage over ``steps`` steps (see the module docstring)."""
    from fbtriton_dist.train.metrics import StageTimer

    timer = StageTimer(device, warmup_steps=0)
    if runner.sharded is not None:
        names = {"input_dist": "input_dist", "compute": "lookup", "output_dist": "output_dist"}
        for attr, stage in names.items():
            setattr(runner.sharded, attr, timed(getattr(runner.sharded, attr), timer, stage))
    runner.model.forward = timed(runner.model.forward, timer, "forward")
    for _ in range(steps):
        timer.start("step")
        runner.step()
        timer.stop("step")
        timer.step_done()
    ms = timer.take()
    out = {k: ms[k] for k in ("input_dist", "lookup", "output_dist") if k in ms}
    # a pipeline runs the next batch's input dist outside the forward: before it, or on a
    # worker thread during the step (then it overlaps the step: not taken out of backward)
    piped = runner.loop in ("pipeline", "pipeline_worker")
    outside = out.get("input_dist", 0.0) if piped else 0.0
    before = outside if runner.loop == "pipeline" else 0.0
    if "forward" in ms:
        if out:  # the embedding stages were seen: the rest of the forward is dense
            out["dense"] = max(ms["forward"] - (sum(out.values()) - outside), 0.0)
        out["backward"] = max(ms.get("step", 0.0) - ms["forward"] - before, 0.0)
    out["forward"] = ms.get("forward", 0.0)
    out["step"] = ms.get("step", 0.0)
    return {k: round(v, 4) for k, v in out.items()}


def measure(
    runner: Runner,
    *,
    warmup: int,
    steps: int,
    profile_steps: int,
    split: int,
    device: torch.device,
    group,
) -> dict[str, Any]:
    """This rank's numbers for ``runner`` (see the module docstring)."""
    out: dict[str, Any] = {}
    warm = [runner.step() for _ in range(warmup)]
    out["warmup_losses"] = [float(x) for x in torch.stack(warm).float().cpu()] if warm else []
    _sync(device)
    dist.barrier(group=group)
    marks, losses = _Marks(device), []
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        marks.mark()
        losses.append(runner.step())
    marks.mark()
    _sync(device)
    out["elapsed_s"] = time.perf_counter() - t0
    # this process's CPU time (every thread, gloo's included) per step: against the wall
    # time, how much of a step a rank works rather than waits
    out["cpu_ms_per_step"] = 1e3 * (time.process_time() - c0) / max(steps, 1)
    step_ms = marks.intervals_ms()
    out["step_ms"] = [round(x, 4) for x in step_ms]
    out["ms_per_step_median"] = statistics.median(step_ms) if step_ms else float("nan")
    out["losses"] = [float(x) for x in torch.stack(losses).float().cpu()] if losses else []
    if runner.sharded is not None and hasattr(runner.sharded, "comm_report"):
        try:
            out["comm_report"] = runner.sharded.comm_report()
        except Exception as e:  # noqa: BLE001 - a report is optional
            out["comm_report_error"] = f"{type(e).__name__}: {e}"
    if device.type == "cuda" and profile_steps > 0:
        try:
            out.update(_profile(runner, profile_steps, device, group))
        except Exception as e:  # noqa: BLE001 - the timed numbers stand without it
            out["gpu_error"] = f"{type(e).__name__}: {e}"[:500]
    elif profile_steps > 0:  # CPU ranks: the operators' self time (dist_cpu)
        from .dist_cpu import cpu_profile

        dist.barrier(group=group)
        out["cpu_profile"] = cpu_profile(runner, profile_steps)
    if split > 0:
        dist.barrier(group=group)
        out["stages_ms"] = split_steps(runner, split, device)
    if device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out


def _profile(runner: Runner, steps: int, device: torch.device, group) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    dist.barrier(group=group)
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step()
        _sync(device)
        wall = time.perf_counter() - t0
    stats = busy_stats(device_intervals(prof), steps)
    stats["profiled_wall_ms"] = 1e3 * wall / steps
    return {"gpu": stats}
