"""Managed tables: the id remap's throughput (ids/s) on the CPU against TorchRec's
``MCHManagedCollisionModule`` on the same drifting id stream, at the same rows.

    python -m fbtriton_dist.bench id_remap [--rows 100001] [--batch 65536] [--steps 30]
    python -m fbtriton_dist.bench id_remap --tiny          # CI: a few small steps

The stream (``drifting_ids``): each step draws ``batch`` ids from a window of ``window``
ids that moves ``drift`` ids a step through an open id space (new ids arrive, old ones
fade), skewed towards the window's newest ids by ``skew`` (rank = window * u**skew), spread
over int64 by an odd multiplier. Both sides get ``rows`` rows (ours: ``rows - 1`` slots and
the default row; TorchRec's ``zch_size = rows``, whose last row is its default too).

Providers, every step a training step (remap + the bookkeeping of its policy):

- ``ours_cpu`` / ``ours_reference``: ``ops.id_remap`` on the fast CPU path / the spec (the
  reference only with ``--tiny``: it is a Python loop);
- ``torchrec_mch_i<k>``: TorchRec's MCH module (``forward``: profile then remap) with its
  LRU or LFU eviction policy every ``k`` steps (``--intervals``, default 1 and 10). With
  ``k > 1`` new ids wait up to k steps for a slot (they read the default row meanwhile).

The providers run interleaved, step by step (each on its own state), so a loaded machine
slows them alike. Each row: policy, provider, ms/step (median over the timed steps, after
``--warmup``), ids/s, the share of ids that read the default row, and ours/this (the ids/s
ratio of ``ours_cpu`` to the row's provider).
"""

import argparse
import json
import statistics
import sys
import time

import torch

from fbtriton_dist.id_manager import IdManagerConfig
from fbtriton_dist.ops.id_remap import STATS, IdTable, id_remap

SPREAD = 0x9E3779B97F4A7C15 - (1 << 64)  # odd, as a signed int64


def drifting_ids(steps: int, batch: int, window: int, drift: int, skew: float = 2.0,
                 seed: int = 0):
    """Yield ``(step, ids [batch] int64)`` of the drifting stream (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        rank = (torch.rand(batch, generator=g, dtype=torch.float64) ** skew * window).long()
        yield step, (step * drift + window - rank) * SPREAD


def _ours(policy: str, rows: int, backend: str):
    table = IdTable(IdManagerConfig(capacity=rows - 1, eviction=policy), "bench")

    def step(s: int, ids: torch.Tensor) -> int:
        id_remap(table, ids, step=s, backend=backend)
        return int(table.stats[STATS.index("default_reads")])

    return step


def _torchrec(policy: str, rows: int, interval: int):
    from torchrec.modules.mc_modules import (  # noqa: PLC0415 (the peer, when importable)
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        MCHManagedCollisionModule,
    )
    from torchrec.sparse.jagged_tensor import JaggedTensor  # noqa: PLC0415

    evict = LRU_EvictionPolicy() if policy == "lru" else LFU_EvictionPolicy()
    mch = MCHManagedCollisionModule(zch_size=rows, device=torch.device("cpu"),
                                    eviction_policy=evict, eviction_interval=interval,
                                    name="bench")
    mch.train()

    def step(s: int, ids: torch.Tensor) -> int:
        jt = JaggedTensor(values=ids, lengths=torch.ones_like(ids, dtype=torch.int32))
        out = mch({"bench": jt})["bench"].values()
        return int((out == rows - 1).sum())

    return step


def run(args) -> list[dict]:
    stream = list(drifting_ids(args.steps, args.batch, args.window, args.drift, args.skew))
    providers = [("ours_cpu", lambda p: _ours(p, args.rows, "cpu"))]
    if args.tiny:
        providers.append(("ours_reference", lambda p: _ours(p, args.rows, "reference")))
    for k in args.intervals:
        providers.append((f"torchrec_mch_i{k}", lambda p, k=k: _torchrec(p, args.rows, k)))
    results = []
    for policy in args.policies:
        steppers = []
        for name, make in providers:
            try:
                steppers.append((name, make(policy)))
            except ImportError as e:
                print(f"# {name}: skipped ({e})", file=sys.stderr)
        times = {name: [] for name, _ in steppers}
        defaults = dict.fromkeys(times, 0)
        ids = 0
        for s, batch in stream:  # providers interleaved step by step: the same machine load
            for name, step in steppers[s % len(steppers):] + steppers[: s % len(steppers)]:
                t0 = time.perf_counter()
                misses = step(s, batch)
                if s >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                    defaults[name] += misses
            ids += batch.numel() if s >= args.warmup else 0
        ours = None
        for name, _ in steppers:
            ms = statistics.median(times[name]) * 1e3
            row = {"policy": policy, "provider": name, "ms_per_step": ms,
                   "ids_per_s": args.batch / (ms / 1e3),
                   "default_share": defaults[name] / max(ids, 1)}
            if name == "ours_cpu":
                ours = row["ids_per_s"]
            row["ours_over_this"] = ours / row["ids_per_s"] if ours else None
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fbtriton_dist.bench id_remap",
                                description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("--rows", type=int, default=100_001)
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--window", type=int, default=400_000)
    p.add_argument("--drift", type=int, default=2_000)
    p.add_argument("--skew", type=float, default=2.0)
    p.add_argument("--policies", type=lambda s: s.split(","), default=["lru", "lfu"])
    p.add_argument("--intervals", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 10])
    p.add_argument("--tiny", action="store_true", help="CI: small shapes, the reference too")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.tiny:
        args.rows, args.batch, args.steps, args.warmup = 65, 256, 6, 2
        args.window, args.drift = 400, 20
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    print(f"# rows={args.rows} batch={args.batch} steps={args.steps} window={args.window} "
          f"drift={args.drift} skew={args.skew} threads={torch.get_num_threads()} "
          f"torch {torch.__version__}")
    print(f"{'policy':6} {'provider':18} {'ms/step':>9} {'Mids/s':>8} {'default':>8} "
          f"{'ours/this':>9}")
    for r in rows:
        ratio = f"{r['ours_over_this']:.2f}" if r["ours_over_this"] else "-"
        print(f"{r['policy']:6} {r['provider']:18} {r['ms_per_step']:9.2f} "
              f"{r['ids_per_s'] / 1e6:8.2f} {r['default_share']:8.3f} {ratio:>9}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
