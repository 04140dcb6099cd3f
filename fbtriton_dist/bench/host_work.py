"""Count the host work of one call: the torch ops it dispatches, the Triton kernels it launches
and the points where the host waits for the device.

On CUDA every such wait (a device value read on the host: ``.item()``, ``.tolist()``,
``int(t)``, ``bool(t)``, an op whose output size depends on values: ``nonzero``,
``masked_select``, boolean indexing, ``unique``, ``repeat_interleave`` without
``output_size``; a device-to-host copy; a host-to-device copy of host data, which torch makes
synchronous unless ``non_blocking``) drains the GPU's queue, so the launch gaps of everything
queued after it add to the step. The counts do not depend on the device: they are taken on the
CPU with ``TRITON_INTERPRET=1`` (the Triton kernels interpreted, tiny shapes), where no wait
costs anything, and hold for the same code on CUDA. The interpreter's own tensor work inside
a launch is not counted.

    work = count_host_work(lambda: tbe(indices, offsets).backward(grad))
    work.ops, work.launches, work.syncs  # totals; work.sync_sites: where each sync was
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostWork", "count_host_work"]

_SIZE_FROM_VALUES = {
    "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive",
    "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero_static",
}
"""aten ops that read device values on the host (nonzero_static is not one: listed so that
it is never taken for one below; it is removed again in ``_sync_kind``)."""

_HOST_READ_METHODS = ("tolist", "numpy", "cpu")
"""Tensor methods that copy a device tensor to the host (on the CPU they dispatch nothing)."""


@dataclass
class HostWork:
    """What one call did on the host (``count_host_work``)."""

    op_names: collections.Counter = field(default_factory=collections.Counter)
    """aten op (overload packet) -> times dispatched, outside kernel launches."""
    kernel_names: collections.Counter = field(default_factory=collections.Counter)
    """Triton kernel -> launches."""
    sync_sites: list[str] = field(default_factory=list)
    """One ``"<what> at <file>:<line>"`` per host sync, in order (the first package frame)."""
    upload_sites: list[str] = field(default_factory=list)
    """One entry per tensor made from host data (``torch.tensor`` / ``torch.as_tensor``): on
    CUDA, one put on the device is a copy torch makes synchronous unless ``non_blocking``."""

    python_calls: int = 0
    """Python and builtin function calls made (``sys.setprofile``'s call events) outside
    kernel launches, counted in a second run of the call without the counting modes: a
    deterministic measure of the host interpreter's work (times vary with the machine)."""

    @property
    def ops(self) -> int:
        return sum(self.op_names.values())

    @property
    def launches(self) -> int:
        return sum(self.kernel_names.values())

    @property
    def syncs(self) -> int:
        return len(self.sync_sites)


class _State(threading.local):
    def __init__(self) -> None:
        self.in_launch = 0  # inside a kernel launch: the interpreter's tensor work
        self.in_read = 0  # inside a counted host read: its own ops are part of it
        self.in_launcher = 0  # inside our Launcher: the launch is counted there


_STATE = _State()


def _site(what: str) -> str:
    """``what`` and the innermost frame of the package outside this file."""
    here = __file__
    for frame in reversed(traceback.extract_stack()):
        if "fbtriton_dist" in frame.filename and frame.filename != here:
            path = frame.filename[frame.filename.rindex("fbtriton_dist"):]
            return f"{what} at {path}:{frame.lineno}"
    return what


def _sync_kind(func, args, kwargs) -> str | None:
    """Why the aten op ``func`` waits for the device on CUDA, or None."""
    name = func._schema.name
    if name in _SIZE_FROM_VALUES and name != "aten::nonzero_static":
        return name.removeprefix("aten::")
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None and (
        len(args) < 3 or args[2] is None) and isinstance(args[0], torch.Tensor) and (
            func.overloadpacket is torch.ops.aten.repeat_interleave
            and "Tensor" == func._overloadname):
        return "repeat_interleave without output_size"
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return "boolean indexing"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, work: HostWork) -> None:
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _STATE.in_launch:
            self.work.op_names[str(func.overloadpacket)] += 1
            kind = _sync_kind(func, args, kwargs)
            if kind is not None and not _STATE.in_read:
                self.work.sync_sites.append(_site(kind))
        return func(*args, **kwargs)


class _Functions(TorchFunctionMode):
    """Host reads that dispatch nothing on the CPU (``tolist``, ``numpy``, ``cpu``)."""

    def __init__(self, work: HostWork) -> None:
        super().__init__()
        self.work = work
        self.methods = {getattr(torch.Tensor, m): m for m in _HOST_READ_METHODS}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        method = self.methods.get(func)
        if method is None or _STATE.in_launch or _STATE.in_read:
            return func(*args, **kwargs)
        self.work.sync_sites.append(_site(method))
        _STATE.in_read += 1
        try:
            return func(*args, **kwargs)
        finally:
            _STATE.in_read -= 1


def _launch_targets() -> list[tuple[object, str]]:
    """(class, method) pairs through which a Triton kernel is launched."""
    import triton.runtime.jit as jit  # noqa: PLC0415 (triton only when counting)

    from fbtriton_dist.kernels import launch  # noqa: PLC0415

    targets = [(jit.JITFunction, "run"), (launch.Launcher, "__call__")]
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is not None:
        targets.append((interpreter.InterpretedFunction, "run"))
    return targets


def _kernel_name(obj) -> str:
    kernel = getattr(obj, "kernel", obj)  # a Launcher holds its kernel
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", type(obj).__name__)


@contextlib.contextmanager
def _counting_launches(work: HostWork | None):
    """Count each outermost launch through any of ``_launch_targets`` into ``work`` (None:
    only mark where launches run). Our ``Launcher``'s own
    host work (its cache key, the arguments' order) counts as host work; what Triton does
    inside ``run`` (the interpreter executing the kernel) does not."""
    saved = []

    def wrap(original, is_launcher):
        def counted(self, *args, **kwargs):
            if work is not None and not _STATE.in_launch and not _STATE.in_launcher:
                work.kernel_names[_kernel_name(self)] += 1
            if is_launcher:
                _STATE.in_launcher += 1
            else:
                _STATE.in_launch += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                if is_launcher:
                    _STATE.in_launcher -= 1
                else:
                    _STATE.in_launch -= 1

        return counted

    try:
        for cls, name in _launch_targets():
            original = cls.__dict__[name]
            saved.append((cls, name, original))
            setattr(cls, name, wrap(original, name == "__call__"))
        yield
    finally:
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)


def _host_data(original, what: str, work: HostWork):
    """``torch.tensor`` / ``torch.as_tensor`` counted as an upload (``HostWork.upload_sites``):
    host data made a tensor, which on CUDA, put on the device, is a copy torch waits for."""

    def counted(*args, **kwargs):
        if not _STATE.in_launch:
            work.upload_sites.append(_site(what))
        return original(*args, **kwargs)

    return counted


def _count_calls(fn: Callable[[], object], work: HostWork) -> None:
    """``work.python_calls`` of one ``fn()`` (launch wrappers of this file and the kernels'
    interpretation left out)."""
    here = __file__

    def profile(frame, event, arg):
        if event in ("call", "c_call") and not _STATE.in_launch and (
                frame.f_code.co_filename != here):
            work.python_calls += 1

    with _counting_launches(None):  # marks the launches, counts nothing
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)


def count_host_work(fn: Callable[[], object], calls: bool = False) -> HostWork:
    """Run ``fn()`` once and count its host work (module docstring); ``calls``: run it a
    second time to count its Python calls (``HostWork.python_calls``)."""
    work = HostWork()
    originals = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}
    try:
        for name, original in originals.items():
            setattr(torch, name, _host_data(original, f"torch.{name}", work))
        with _counting_launches(work), _Functions(work), _Dispatch(work):
            fn()
    finally:
        for name, original in originals.items():
            setattr(torch, name, original)
    if calls:
        _count_calls(fn, work)
    return work


# ---------------------------------------------------------------- the TBE step's counts

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
"""The fused optimizers ``main`` counts by default (registry names)."""


def tiny_step(optimizer: str, bounds_check: str, plan_ahead: bool = True, device="cpu",
              bag: int = 3):
    """(module, step callable) of one fused fwd+bwd on the Triton backend: 3 tables of mixed
    D (8, 8, 4), B 4, up to ``bag`` ids a bag, on ``device`` (the CPU: ``TRITON_INTERPRET=1``).
    ``plan_ahead=True`` takes the CUDA default's path (the backward plan made beside the
    forward; on the CPU in order)."""
    from fbtriton_dist.modules.tbe import TableBatchedEmbedding  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    tables, B = [(40, 8), (30, 8), (20, 4)], 4
    lengths = torch.randint(0, bag + 1, (len(tables) * B,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = [torch.randint(0, E, (int(lengths[f * B:(f + 1) * B].sum()),), generator=gen)
           for f, (E, _) in enumerate(tables)]
    indices, offsets = torch.cat(ids).to(device), offsets.to(device)
    grad = torch.randn(B, sum(D for _, D in tables), generator=gen).to(device)
    from fbtriton_dist.bench.tbe_optims import optimizer_of  # noqa: PLC0415

    config = optimizer_of(f"fwd_bwd_{optimizer}")
    module = TableBatchedEmbedding(tables, optimizer=config, backend="triton",
                                   bounds_check=bounds_check, device=device, seed=0,
                                   plan_ahead=plan_ahead)

    def step():
        module(indices, offsets).backward(grad)

    return module, step


@contextlib.contextmanager
def _launches_skipped():
    """Triton launches return at once (their outputs stay garbage): the host work alone."""
    saved = []
    try:
        for cls, name in _launch_targets()[:1] + _launch_targets()[2:]:
            saved.append((cls, name, cls.__dict__[name]))
            setattr(cls, name, lambda self, *args, **kwargs: None)
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


def host_us_per_step(step: Callable[[], object], steps: int = 200, repeats: int = 5) -> float:
    """Best of ``repeats`` means over ``steps`` calls of ``step`` with the Triton launches
    skipped: microseconds of host work per step outside the kernels (the torch ops run on
    the CPU tensors: on CUDA each would queue a kernel instead)."""
    import time  # noqa: PLC0415

    best = float("inf")
    with _launches_skipped():
        step()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e6


def main(argv: list[str] | None = None) -> None:
    """``python -m fbtriton_dist.bench.host_work``: the counts of one fused fwd+bwd step on
    the Triton path (interpreted), per optimizer and bounds check, as a Markdown table."""
    import argparse  # noqa: PLC0415
    import os  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python -m fbtriton_dist.bench.host_work",
                                     description=main.__doc__)
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--bounds", default="error,warn,ignore",
                        help="bounds_check values, comma-separated")
    parser.add_argument("--no-ahead", action="store_true",
                        help="plan_ahead=False (the backward plan made in the backward)")
    parser.add_argument("--time", action="store_true",
                        help="also host microseconds per step with the launches skipped")
    parser.add_argument("--sites", action="store_true", help="list each sync and the ops")
    parser.add_argument("--bag", type=int, default=3, help="the most ids in a bag (B = 4, T = 3)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("host_work: set TRITON_INTERPRET=1 before Python starts (the Triton "
                         "kernels run interpreted on the CPU)")
    print("| optimizer | bounds_check | torch ops | Triton launches | host syncs | uploads | "
          "Python calls |" + (" host µs/step |" if args.time else ""))
    print("| --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if args.time else ""))
    details = []
    for name in args.optimizers.split(","):
        for bounds in args.bounds.split(","):
            _, step = tiny_step(name, bounds, plan_ahead=not args.no_ahead, bag=args.bag)
            step()  # warm: compiles nothing here, but builds the lazy state
            work = count_host_work(step, calls=True)
            us = f" {host_us_per_step(step):.0f} |" if args.time else ""
            print(f"| {name} | {bounds} | {work.ops} | {work.launches} | {work.syncs} | "
                  f"{len(work.upload_sites)} | {work.python_calls} |{us}", flush=True)
            details.append((name, bounds, work))
    if args.sites:
        for name, bounds, work in details:
            print(f"\n{name} / {bounds}: ops {dict(work.op_names)}; kernels "
                  f"{dict(work.kernel_names)}")
            for site in work.sync_sites + work.upload_sites:
                print(f"  {site}")


if __name__ == "__main__":
    main()
