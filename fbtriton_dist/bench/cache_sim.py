"""A row cache's hit rate measured: the runtime's own slot map on ids drawn from a table's
distribution, against the planner's estimate (``planner/cache_model.py``).

Each step draws ``ids_per_step`` ids independently with the shares the planner assumes
(``cdf(r + 1) - cdf(r)`` for row r of the block), takes the distinct rows (as
``modules/tiers.py``'s ``TieredTables.remap`` does) and maps them with ``ops.id_remap`` on an
``IdTable`` of the cache's slots and policy: the map ``RowCache.assign`` uses, so the victims
(least recent / least used not in this step, ties the least recent) and the counting (a miss
is a row given a fresh slot) are the runtime's, without loading any row. The clock advances
every step, as in training where each step's backward runs before the next forward.
Steps before ``warmup`` are not counted. Usage::

    python -m fbtriton_dist.bench cache_sim [--rows 100000] [--ids 512] [--steps 1500]
        [--out FILE.json]

prints estimate vs measurement for uniform and Zipf 0.8 / 1.1 / 1.4 ids, caches of 1 %, 10 %
and 50 % of the rows, LRU and LFU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from fbtriton_dist.id_manager import IdManagerConfig
from fbtriton_dist.ops.id_remap import IdTable, id_remap
from fbtriton_dist.planner import IdDistribution, ShardingPlan, TableSpec, cdf_array
from fbtriton_dist.planner.cache_model import estimate_hit_rates, fill_steps, hit_rate

__all__ = ["CacheRun", "compare", "main", "measure_hit_rate", "miss_error", "plan_comparison",
           "warmup_steps"]

MIN_WARMUP = {"lru": 100, "lfu": 1000}
WARMUP_FILLS = {"lru": 3, "lfu": 10}
"""Uncounted steps by default, per policy: ``WARMUP_FILLS`` times the steps an empty cache
takes to fill (``cache_model.fill_steps``), at least ``MIN_WARMUP``. LFU settles slowly (its
kept set forms as counts build): Zipf 0.8 with a 10 % cache of 20,000 rows, 128 ids a step,
measured 0.4765 after 100 warm-up steps, 0.5010 after 1,000, 0.5018 after 4,000."""


def warmup_steps(fill: float, policy: str, fills: float | None = None,
                 least: int | None = None) -> int:
    """The default warm-up of a cache that fills in ``fill`` steps."""
    fills = WARMUP_FILLS[policy] if fills is None else fills
    least = MIN_WARMUP[policy] if least is None else least
    return least if math.isinf(fill) else max(least, math.ceil(fills * fill))


@dataclass(frozen=True)
class CacheRun:
    """One measured cache: hits over the counted steps."""

    hit_rate: float
    distinct_per_step: float
    misses_per_step: float
    steps: int
    warmup: int


def _sampler(dist: IdDistribution, num_rows: int, row_start: int, row_end: int):
    """A function drawing ``n`` rows of ``[row_start, row_end)`` with the table's shares."""
    edges = cdf_array(dist, num_rows, np.arange(row_start, row_end + 1))
    cum = edges - edges[0]
    total = float(cum[-1])

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        u = rng.random(n) * total
        r = np.searchsorted(cum, u, side="right") - 1
        return row_start + np.clip(r, 0, row_end - row_start - 1)

    return draw


def measure_hit_rate(dist: IdDistribution, num_rows: int, ids_per_step: int, cache_rows: int,
                     policy: str = "lru", *, steps: int = 1500, warmup: int | None = None,
                     row_start: int = 0, row_end: int | None = None,
                     seed: int = 0, warmup_fills: float | None = None,
                     min_warmup: int | None = None) -> CacheRun:
    """The hit rate of a cache of ``cache_rows`` slots in front of rows ``[row_start,
    row_end)`` of a table of ``num_rows`` rows, ``ids_per_step`` ids per step over the whole
    table (those in the block reach its cache), counted over ``steps`` steps after
    ``warmup`` (default ``warmup_fills`` x the fill time, at least ``min_warmup``; None:
    the policy's ``WARMUP_FILLS`` and ``MIN_WARMUP``)."""
    row_end = num_rows if row_end is None else row_end
    draw = _sampler(dist, num_rows, row_start, row_end)
    share = float(dist.fraction(num_rows, row_start, row_end))
    rng = np.random.default_rng(seed)
    table = IdTable(IdManagerConfig(capacity=int(cache_rows), eviction=policy), "sim")
    n = max(0, round(ids_per_step * share))
    if warmup is None:
        fill = fill_steps(dist, num_rows, ids_per_step, cache_rows, row_start, row_end)
        warmup = warmup_steps(fill, policy, warmup_fills, min_warmup)
    looked = missed = 0
    for step in range(warmup + steps):
        rows = torch.from_numpy(np.unique(draw(rng, n)))
        if rows.numel() > cache_rows:
            raise ValueError(f"cache_rows: a step reads {rows.numel()} distinct rows, expected "
                             f"a cache of at least that many slots, got {cache_rows}")
        _, fresh = id_remap(table, rows, step=step + 1, update=True)
        if step >= warmup:
            looked += int(rows.numel())
            missed += int(fresh.numel())
    hit = 1.0 - missed / looked if looked else 1.0
    return CacheRun(hit, looked / steps, missed / steps, steps, warmup)


def miss_error(estimate: float, measured: float) -> float:
    """The estimate's error on the miss rate: relative (``|m_est - m_sim| / m_sim``) where
    the measured miss rate is at least 0.05, else absolute divided by 0.05 (so 0.1 means a
    miss rate off by 0.005)."""
    m_est, m_sim = 1.0 - estimate, 1.0 - measured
    return abs(m_est - m_sim) / max(m_sim, 0.05)


def compare(num_rows: int, ids_per_step: int, dists: Sequence[IdDistribution],
            fractions: Sequence[float], policies: Sequence[str], steps: int,
            seed: int = 0, warmup_fills: float | None = None,
            min_warmup: int | None = None) -> list[dict]:
    """Estimate vs measurement for every combination (one dict each)."""
    out = []
    for dist in dists:
        for frac in fractions:
            C = max(1, math.ceil(frac * num_rows))
            for policy in policies:
                est = hit_rate(dist, num_rows, ids_per_step, C, policy)
                t0 = time.perf_counter()
                run = measure_hit_rate(dist, num_rows, ids_per_step, C, policy, steps=steps,
                                       seed=seed, warmup_fills=warmup_fills,
                                       min_warmup=min_warmup)
                out.append({"ids": dist.describe(), "cache_fraction": frac, "cache_rows": C,
                            "policy": policy, "estimate": est.hit_rate,
                            "estimate_distinct": est.distinct_rows, **asdict(run),
                            "miss_error": miss_error(est.hit_rate, run.hit_rate),
                            "seconds": time.perf_counter() - t0})
    return out


def format_table(rows: Sequence[dict]) -> str:
    lines = ["| ids | cache | policy | estimate | measured | miss rate est / sim | error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['ids']} | {r['cache_fraction']:.0%} | {r['policy']} | {r['estimate']:.4f} | "
            f"{r['hit_rate']:.4f} | {1 - r['estimate']:.4f} / {1 - r['hit_rate']:.4f} | "
            f"{r['miss_error']:.3f} |")
    return "\n".join(lines)


PLAN_MAX_ROWS = 1_000_000
PLAN_MAX_SLOTS = 100_000
"""``plan --simulate`` simulates a shard of at most this many rows and cache slots (a cdf
table per row, the map's work per step grows with the slots)."""
PLAN_MAX_WARMUP = 3000
"""... and warms its cache up for at most this many steps (the report says when capped)."""


def plan_comparison(plan: ShardingPlan, specs: Sequence[TableSpec],
                    stats: dict[str, IdDistribution] | None, batch_size: int, *,
                    steps: int = 300, seed: int = 0) -> str:
    """Per cached table of ``plan``: the estimated and the measured hit rate of its busiest
    shard's cache (the most distinct rows per step), ids of R x ``batch_size`` samples per
    step. A text table for ``fbtriton-dist plan --simulate``."""
    by_name = {t.name: t for t in specs}
    lines = ["cache hit rates, estimate vs the runtime's slot map on drawn ids (busiest shard "
             "of each cached table; miss-rate error as cache_sim.miss_error):",
             "| table | shard rows | slots | policy | estimate | measured | error | steps |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for ts in plan.tables:
            spec = by_name[ts.name]
            st = ts.storage or spec.storage
            if st is None or not st.cached:
                continue
            dist = (stats or {}).get(ts.name, IdDistribution())
            E, n = spec.num_embeddings, plan.world_size * batch_size * spec.ids_per_sample
            shards = ts.shards
            est = estimate_hit_rates(dist, E, n, [s.row_start for s in shards],
                                     [s.row_end for s in shards],
                                     [st.slots(s.num_rows) for s in shards], st.policy)
            i = max(range(len(shards)), key=lambda k: est[k].distinct_rows)
            sh, slots = shards[i], st.slots(shards[i].num_rows)
            row = f"| {ts.name} | {sh.row_start}..{sh.row_end} | {slots} | {st.policy} | "
            if sh.num_rows > PLAN_MAX_ROWS or slots > PLAN_MAX_SLOTS:
                lines.append(row + f"{est[i].hit_rate:.4f} | not simulated (over "
                             f"{PLAN_MAX_ROWS} rows or {PLAN_MAX_SLOTS} slots) | | |")
                continue
            fill = fill_steps(dist, E, n, slots, sh.row_start, sh.row_end)
            warm = min(PLAN_MAX_WARMUP, warmup_steps(fill, st.policy))
            try:
                run = measure_hit_rate(dist, E, round(n), slots, st.policy, steps=steps,
                                       warmup=warm, row_start=sh.row_start, row_end=sh.row_end,
                                       seed=seed)
            except ValueError as e:
                lines.append(row + f"{est[i].hit_rate:.4f} | refused: {e} | | |")
                continue
            capped = " (warm-up capped)" if warm == PLAN_MAX_WARMUP else ""
            lines.append(row + f"{est[i].hit_rate:.4f} | {run.hit_rate:.4f} | "
                         f"{miss_error(est[i].hit_rate, run.hit_rate):.3f} | "
                         f"{run.warmup} + {run.steps}{capped} |")
    finally:
        torch.set_num_threads(torch_threads)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fbtriton_dist.bench cache_sim",
                                description="row cache hit rate: estimate vs the real map")
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--ids", type=int, default=512, help="ids per step (batch x pooling)")
    p.add_argument("--steps", type=int, default=1500, help="counted steps after the warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", choices=("lru", "lfu"), default=["lru", "lfu"])
    p.add_argument("--fractions", nargs="+", type=float, default=[0.01, 0.1, 0.5],
                   help="cache sizes as shares of the rows")
    p.add_argument("--warmup-fills", type=float, default=None,
                   help="uncounted steps: this many fill times of an empty cache (default: "
                        "3 for LRU, 10 for LFU)")
    p.add_argument("--min-warmup", type=int, default=None,
                   help="uncounted steps: at least this many (default: 100 for LRU, 1000 for "
                        "LFU)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small tensors: threads only add contention
    dists = [IdDistribution(), *(IdDistribution(kind="zipf", alpha=a) for a in (0.8, 1.1, 1.4))]
    rows = compare(args.rows, args.ids, dists, args.fractions, args.policies, args.steps,
                   args.seed, args.warmup_fills, args.min_warmup)
    print(f"{args.rows} rows, {args.ids} ids per step, {args.steps} counted steps after a "
          f"warm-up of {args.warmup_fills or WARMUP_FILLS} fill times (at least "
          f"{args.min_warmup or MIN_WARMUP} steps)")
    print(format_table(rows))
    print("warm-up steps: " + ", ".join(str(r["warmup"]) for r in rows))
    worst = max(r["miss_error"] for r in rows)
    print(f"largest miss-rate error: {worst:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
