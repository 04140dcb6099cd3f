"""What one training step of ``cached`` tables with their slot maps on the device issues
(``modules/tier_device_map.py``), counted on the CPU: aten ops under a ``TorchDispatchMode``
(the same torch ops a CUDA step runs; a view or an allocation is no kernel) and Triton
launches (through ``kernels/launch.py``), split by where they come from: ``map`` (the pass
over the batch), ``finish`` (stamps, placement, the map's updates), ``rows`` (ops on the rows
themselves: weights and optimizer state moved between the cache and the backing store),
``kernels`` (Triton launches, wherever they come from), ``other`` (the rest of the step).

``python -m fbtriton_dist.bench.slot_map_ops [--kernels auto|0|1]`` (``FBTD_SLOT_MAP=device``
is set here; ``--kernels`` sets ``FBTD_SLOT_MAP_KERNELS``; ``1`` on the CPU needs
``TRITON_INTERPRET=1``). The bench shape scaled down: 8 tables x 20k rows x D 16, B 64, bag
5, Zipf 1.1, 10 % caches, rowwise Adagrad; the steps after the caches fill (with evictions)
are averaged."""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCS = ("empty",)  # allocations: no kernel on CUDA
VIEWS = ("slice", "select", "view", "detach", "alias", "lift_fresh", "_unsafe_view", "unbind",
         "unsqueeze", "squeeze", "expand", "as_strided", "t.", "permute")


class Counter(TorchDispatchMode):
    """Aten ops and launches (ops that are not views) per part of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.quiet = 0  # inside a Triton launch (the interpreter's own copies)
        self.ops: dict[str, int] = {}
        self.launches: dict[str, int] = {}

    def part(self, args) -> str:
        where = self.stack[-1] if self.stack else "other"
        if where in ("finish", "place", "write"):
            floats = any(isinstance(a, torch.Tensor) and a.is_floating_point()
                         for a in args)
            return "rows" if floats else "finish"
        return where

    def add(self, part: str, launch: bool) -> None:
        self.ops[part] = self.ops.get(part, 0) + 1
        if launch:
            self.launches[part] = self.launches.get(part, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.quiet:
            self.add(self.part(args), not func.__name__.startswith(VIEWS + ALLOCS))
        return func(*args, **(kwargs or {}))


def _tagged(counter: Counter, name: str, fn):
    def run(*args, **kwargs):
        counter.stack.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            counter.stack.pop()
    return run


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", choices=["auto", "0", "1"], default="auto")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rows", type=int, default=20_000, help="rows per table")
    p.add_argument("--optimizer", choices=["sgd", "rowwise_adagrad", "adam"],
                   default="rowwise_adagrad")
    args = p.parse_args(argv)
    saved_env = {k: os.environ.get(k) for k in ("FBTD_SLOT_MAP", "FBTD_SLOT_MAP_KERNELS")}
    os.environ["FBTD_SLOT_MAP"] = "device"
    os.environ["FBTD_SLOT_MAP_KERNELS"] = args.kernels
    from fbtriton_dist import optim
    from fbtriton_dist.kernels import launch
    from fbtriton_dist.modules import tier_device_map, tiers
    from fbtriton_dist.modules.tbe import TableBatchedEmbedding
    from fbtriton_dist.storage import Storage

    T, E, D, B, L, zipf = 8, args.rows, 16, 64, 5, 1.1
    opt = {"sgd": optim.SGD(lr=0.1), "rowwise_adagrad": optim.RowWiseAdagrad(lr=0.1),
           "adam": optim.Adam(lr=0.1)}[args.optimizer]
    try:
        m = TableBatchedEmbedding([(E, D)] * T, optimizer=opt, backend="cpu",
                                  storage=[Storage(tier="cached", cache_load_factor=0.1)] * T)
    finally:  # read when the module is built
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    g = torch.Generator().manual_seed(0)
    cdf = torch.cumsum(torch.arange(1, E + 1, dtype=torch.float64).pow(-zipf), 0)
    cdf /= cdf[-1].clone()
    perms = [torch.randperm(E, generator=g) for _ in range(T)]
    offsets = torch.arange(T * B + 1) * L
    counter = Counter()
    patches = [(tier_device_map.DeviceMaps, "map", "map"),
               (tier_device_map.DeviceMaps, "finish", "finish"),
               (tier_device_map.DeviceMaps, "_place", "place"),
               (tier_device_map, "_write", "write")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in patches]
    for obj, attr, name in patches:
        setattr(obj, attr, _tagged(counter, name, getattr(obj, attr)))
    call = launch.Launcher.__call__

    def launched(self, *a, **k):
        counter.launches["kernels"] = counter.launches.get("kernels", 0) + 1
        counter.quiet += 1
        try:
            return call(self, *a, **k)
        finally:
            counter.quiet -= 1

    launch.Launcher.__call__ = launched
    remap = tiers.TieredTables.remap
    rows = []
    try:
        for _ in range(args.steps):
            u = torch.rand(T, B * L, generator=g, dtype=torch.float64)
            rank = torch.searchsorted(cdf, u).clamp_(max=E - 1)
            indices = torch.cat([perms[t][rank[t]] for t in range(T)])
            before = sum(s["evictions"] for s in m.cache_stats().values())
            counter.ops, counter.launches = {}, {}
            with counter:
                (m(indices, offsets) * 1.0).sum().backward()
            evicted = sum(s["evictions"] for s in m.cache_stats().values()) - before
            if evicted:
                rows.append((dict(counter.ops), dict(counter.launches), evicted))
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
        launch.Launcher.__call__ = call
        tiers.TieredTables.remap = remap
    if not rows:
        raise SystemExit(f"none of {args.steps} steps evicts: raise --steps")
    print(f"{len(rows)} of {args.steps} steps evict (mean {statistics.mean(r[2] for r in rows):.0f}"
          f" rows); per step (mean over them), FBTD_SLOT_MAP_KERNELS={args.kernels}, "
          f"{args.optimizer}:")
    print("| part | aten ops | launches (ops not views or allocations; Triton kernels) |")
    print("| --- | --- | --- |")
    parts = ["map", "finish", "rows", "kernels", "other"]
    for part in parts:
        ops = statistics.mean(r[0].get(part, 0) for r in rows)
        n = statistics.mean(r[1].get(part, 0) for r in rows)
        print(f"| {part} | {ops:.1f} | {n:.1f} |")
    tier = [sum(r[1].get(p, 0) for p in parts[:4]) for r in rows]
    print(f"| map + finish + rows + kernels | | {statistics.mean(tier):.1f} "
          f"(min {min(tier)}, max {max(tier)}) |")
    return {"launches": statistics.mean(tier), "steps": len(rows)}


if __name__ == "__main__":
    main()
