"""The steady-state hit rate of a row cache (the ``cached`` / ``file`` tiers), from the table's
id distribution: torch-free, fast for a billion rows.

**What a hit is** (as ``modules/tiers.py`` counts it, ``cache_stats()`` and the job's
``caches.<table>.hit_rate``): each step the cache maps the batch's *distinct* rows; a row
found resident is a hit, one not found is a miss (loaded, evicting a row that the batch does
not use). ``hit rate = 1 - misses / distinct rows looked up``. A step of ``n`` ids drawn
independently with per-row shares ``p_i`` uses row i with probability
``q_i = 1 - (1 - p_i)^n`` and reads ``U = sum_i q_i`` distinct rows on average; the cache
must hold them all (``C >= U``, else the runtime refuses the batch).

**LRU** (Che's approximation, counted in steps): a resident row is one used in the last
``T`` steps, ``T`` the characteristic time that fills the cache,
``sum_i (1 - (1 - q_i)^T) = C``; a step's row i hits when it was used in the ``T`` steps
before: ``hit = sum_i q_i (1 - (1 - q_i)^T) / U``. (The current step's rows are never
evicted, so ``T >= 1`` whenever the cache holds a step's rows.)

**LFU** (the runtime's: a row's count is the number of steps that used it *since it was
loaded*, a miss evicts the smallest count, ties the least recent). Rows used often build
counts no newcomer reaches, so the cache splits into a *kept* set of ``k`` rows and a *churn*
pool of the other rows the last step used (a newcomer starts at count 1 and is the first
victim of the next step unless used again): the pool holds ``sum_{i not kept} q_i`` rows, so
``k + sum_{i not kept} q_i = C`` and ``hit = (sum_{kept} q_i + sum_{not kept} q_i^2) / U``.
Which rows are kept depends on the history: the counts diverge, so the kept set freezes
among the rows the cache held when it first filled. Two bounds: *upper*, the kept rows are
the ``k`` most likely of all (a perfect frequency ranking); *lower*, they are the most likely
of the rows present when the cache first filled (row i with odds ``1 - (1 - q_i)^T``, T as
for LRU: an empty cache fills in T steps), never a later newcomer. The estimate lies between
them, nearer the upper bound when the cache fills in a few steps (its contents turn over
fast, and the frequent rows win): ``LFU_MID`` / ``LFU_FAST`` / ``LFU_STEPS``, fitted on the
real map (an empirical rule, not a derivation).

**Speed.** Rows are grouped in buckets of equal share: each row on its own below
``EXACT_ROWS``, then geometric buckets ``GROWTH`` wide (a Zipf share changes by
``GROWTH^alpha`` across one), histogram buckets as given, uniform as one bucket; every shard
of a table is solved at once (a bisection on ``log T`` over all shards, sums per shard with
``bincount``). A billion-row Zipf table is about 1,000 + 1,300 buckets.

The measured error against the real cache map (``bench/cache_sim.py``) is in
``docs/results/storage-hit-rate-model-2026-12-05.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .memory import table_state_bytes
from .stats import IdDistribution, cdf_array
from .tables import TableSpec

__all__ = ["EXACT_ROWS", "GROWTH", "STEP_MARGIN", "CacheEstimate", "TierTraffic", "block_traffic",
           "distinct_rows", "estimate_hit_rates", "fill_steps", "hit_rate", "row_buckets",
           "staged_traffic"]

EXACT_ROWS = 1024
"""Rows ``[0, EXACT_ROWS)`` of a Zipf table are buckets of one row each."""
GROWTH = 1.01
"""Beyond, a bucket ends where its first row times ``GROWTH`` is."""
_BISECTIONS = 64
STEP_MARGIN = 2.0
"""A cache should hold this many times a step's expected distinct rows (two training batches
in flight pin both, and a step varies); the runtime refuses a step that does not fit."""
LFU_MID, LFU_FAST, LFU_STEPS = 0.5, 0.4, 30.0
"""LFU's estimate is ``lower + w (upper - lower)`` with ``w = LFU_MID + LFU_FAST x
exp(-T / LFU_STEPS)``, T the fill time in steps: fitted to the real map on 20,000 rows
(uniform and Zipf 0.8 / 1.1 / 1.4, caches of 1 / 10 / 50 %: where the measurement falls
between the bounds, from about 0.85 for T of 2-9 steps to 0.5 for T of 300) and checked on
other sizes (``docs/results/storage-hit-rate-model-2026-12-05.md``)."""


@dataclass(frozen=True)
class CacheEstimate:
    """One cache's steady state per step, as the runtime counts it."""

    hit_rate: float
    """Hits / distinct rows looked up (1.0: every row fits)."""
    distinct_rows: float
    """U, the expected distinct rows of one step."""
    misses: float
    """Rows loaded per step, ``U x (1 - hit_rate)``; in training each evicts a dirty row that
    is written back."""
    fits: bool
    """The cache holds one step's distinct rows (``C >= U``); False: the runtime refuses such
    a step (the estimate is then for ``C = U``)."""


@functools.lru_cache(maxsize=64)
def _grid(dist: IdDistribution, num_rows: int) -> np.ndarray:
    """Bucket edges over the whole table (int64, ``0 .. num_rows``)."""
    if dist.kind == "uniform":
        return np.array([0, num_rows], dtype=np.int64)
    if dist.kind == "histogram":
        k = len(dist.histogram)
        cuts = np.ceil(np.arange(k + 1) * (num_rows / k))
        return np.unique(np.clip(cuts, 0, num_rows).astype(np.int64))
    head = np.arange(min(EXACT_ROWS, num_rows) + 1, dtype=np.float64)
    n = max(0, math.ceil(math.log(max(num_rows / EXACT_ROWS, 1.0)) / math.log(GROWTH)) + 1)
    tail = np.floor(EXACT_ROWS * GROWTH ** np.arange(1, n + 1))
    edges = np.concatenate([head, tail, [num_rows]])
    return np.unique(np.clip(edges, 0, num_rows).astype(np.int64))


def row_buckets(dist: IdDistribution, num_rows: int, row_start: Sequence[int],
                row_end: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Buckets of rows ``[row_start[s], row_end[s])`` for each block s of a table of
    ``num_rows`` rows: ``(block, rows, share)`` arrays, one element per bucket: the block it
    belongs to, its rows and the share of the *table's* lookups that each of its rows gets."""
    grid = _grid(dist, num_rows)
    starts = np.asarray(row_start, dtype=np.int64)
    ends = np.asarray(row_end, dtype=np.int64)
    lo_i = np.searchsorted(grid, starts, side="right")
    hi_i = np.searchsorted(grid, ends, side="left")
    parts, owner = [], []
    for s, (a, b, i, j) in enumerate(zip(starts.tolist(), ends.tolist(), lo_i.tolist(),
                                         hi_i.tolist(), strict=True)):
        edges = np.concatenate([[a], grid[i:j], [b]]) if b > a else np.array([a, a])
        parts.append(edges)
        owner.append(np.full(len(edges) - 1, s, dtype=np.int64))
    lo = np.concatenate([e[:-1] for e in parts])
    hi = np.concatenate([e[1:] for e in parts])
    block = np.concatenate(owner)
    rows = (hi - lo).astype(np.float64)
    mass = cdf_array(dist, num_rows, hi) - cdf_array(dist, num_rows, lo)
    share = np.where(rows > 0, np.maximum(mass, 0.0) / np.maximum(rows, 1.0), 0.0)
    keep = rows > 0
    return block[keep], rows[keep], share[keep]


def estimate_hit_rates(dist: IdDistribution, num_rows: int, ids_per_step: float,
                       row_start: Sequence[int], row_end: Sequence[int],
                       cache_rows: Sequence[float], policy: str) -> list[CacheEstimate]:
    """The steady state of one cache per block ``[row_start[s], row_end[s])`` of a table of
    ``num_rows`` rows whose ids follow ``dist``, ``ids_per_step`` of them per step over the
    whole table (each block sees the ids that fall in its rows), block s's cache holding
    ``cache_rows[s]`` rows, ``policy`` ``lru`` or ``lfu`` (the module docstring)."""
    if policy not in ("lru", "lfu"):
        raise ValueError(f"policy: expected one of ['lru', 'lfu'], got {policy!r}")
    if not ids_per_step >= 0:
        raise ValueError(f"ids_per_step: expected a number >= 0, got {ids_per_step!r}")
    S = len(row_start)
    block, rows, share = row_buckets(dist, num_rows, row_start, row_end)
    # q: a row's odds of being used by a step; (1 - q)^T = exp(T * log1p(-q))
    log_miss = ids_per_step * np.log1p(-np.minimum(share, 1.0 - 1e-16))
    q = -np.expm1(log_miss)
    used = np.bincount(block, weights=rows * q, minlength=S)
    live = np.bincount(block, weights=rows * (q > 0), minlength=S)
    C = np.asarray(cache_rows, dtype=np.float64)
    fits = C >= used * (1.0 - 1e-9)
    cap = np.maximum(C, used)  # a cache smaller than a step is estimated at one step's rows
    full = cap >= live  # every row the step can use fits: all hits in steady state
    log1m = np.log1p(-np.minimum(q, 1.0 - 1e-16))
    t = _fill_time(block, rows, log1m, cap, S)[block]
    seen = -np.expm1(t * log1m)  # odds that row i was used in the last T steps
    if policy == "lru":
        hits = np.bincount(block, weights=rows * q * seen, minlength=S)
    else:  # between the two bounds, by the fill time (module docstring)
        upper = _lfu_kept(block, rows, q, np.ones_like(q), cap, used, S)
        lower = _lfu_kept(block, rows, q, seen, cap, used, S)
        fill = _fill_time(block, rows, log1m, cap, S)
        toward = LFU_MID + LFU_FAST * np.exp(-fill / LFU_STEPS)
        hits = lower + toward * (upper - lower)
    rate = np.where(full | (used <= 0), 1.0, np.clip(hits / np.maximum(used, 1e-300), 0.0, 1.0))
    return [CacheEstimate(float(h), float(u), float(u * (1.0 - h)), bool(f))
            for h, u, f in zip(rate, used, fits, strict=True)]


def distinct_rows(dist: IdDistribution, num_rows: int, ids_per_step: float,
                  row_start: Sequence[int], row_end: Sequence[int]) -> np.ndarray:
    """U per block ``[row_start[s], row_end[s])``: the expected distinct rows of one step of
    ``ids_per_step`` ids over the whole table (the module docstring's ``sum_i q_i``)."""
    block, rows, share = row_buckets(dist, num_rows, row_start, row_end)
    q = -np.expm1(ids_per_step * np.log1p(-np.minimum(share, 1.0 - 1e-16)))
    return np.bincount(block, weights=rows * q, minlength=len(row_start))


def _fill_time(block: np.ndarray, rows: np.ndarray, log1m: np.ndarray, cap: np.ndarray,
               S: int) -> np.ndarray:
    """Per block, the steps ``T`` whose distinct rows fill its cache,
    ``sum_i (1 - (1 - q_i)^T) = C`` (Che's characteristic time; also how long an empty cache
    takes to fill): a bisection on ``log2 T`` in [0, 200], all blocks at once."""
    lo, hi = np.zeros(S), np.full(S, 200.0)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2.0
        t = np.exp2(mid)[block]
        under = np.bincount(block, weights=rows * -np.expm1(t * log1m), minlength=S) < cap
        lo, hi = np.where(under, mid, lo), np.where(under, hi, mid)
    return np.exp2((lo + hi) / 2.0)


def _lfu_kept(block: np.ndarray, rows: np.ndarray, q: np.ndarray, weight: np.ndarray,
              cap: np.ndarray, used: np.ndarray, S: int) -> np.ndarray:
    """Hits per block when the cache keeps the most likely rows of a candidate set (row i a
    candidate with odds ``weight_i``), ``k`` of them, and a pool of the other rows the last
    step used: ``k + sum_rest q = C``, ``hits = sum_kept q + sum_rest q^2`` (buckets in
    falling ``q``, the last one kept in part)."""
    order = np.lexsort((-q, block))  # by block, most likely first
    b, r, qq, w = block[order], rows[order], q[order], weight[order]
    starts = np.searchsorted(b, np.arange(S))

    def running(x: np.ndarray) -> np.ndarray:  # inclusive running sums inside each block
        c = np.cumsum(x)
        return c - np.concatenate([[0.0], c])[starts][b]

    rw = r * w
    k_rows, kept_q, kept_q2 = running(rw), running(rw * qq), running(rw * qq * qq)
    total_q2 = np.bincount(b, weights=r * qq * qq, minlength=S)
    # g(k) = k + (U - kept_q(k)) grows with k (slope 1 - q >= 0); find where it reaches C
    g_end = k_rows + (used[b] - kept_q)
    g_start = g_end - rw * (1.0 - qq)
    inside = np.flatnonzero((g_start <= cap[b]) & (g_end >= cap[b]))
    first = np.full(S, len(b), dtype=np.int64)
    np.minimum.at(first, b[inside], inside)
    has = first < len(b)
    hits = used.copy()  # no crossing: the cache holds every candidate and the pool
    j = first[has]
    frac = np.clip((cap[b[j]] - g_start[j]) / np.maximum(rw[j] * (1.0 - qq[j]), 1e-300),
                   0.0, 1.0)
    part = frac * rw[j]  # candidate rows of bucket j kept
    kept = kept_q[j] - rw[j] * qq[j] + part * qq[j]
    kept2 = kept_q2[j] - rw[j] * qq[j] ** 2 + part * qq[j] ** 2
    hits[has] = kept + (total_q2[has] - kept2)
    return hits


def hit_rate(dist: IdDistribution, num_rows: int, ids_per_step: float, cache_rows: float,
             policy: str = "lru") -> CacheEstimate:
    """:func:`estimate_hit_rates` of one cache in front of the whole table."""
    return estimate_hit_rates(dist, num_rows, ids_per_step, [0], [num_rows], [cache_rows],
                              policy)[0]


def fill_steps(dist: IdDistribution, num_rows: int, ids_per_step: float, cache_rows: float,
               row_start: int = 0, row_end: int | None = None) -> float:
    """Steps an empty cache of ``cache_rows`` rows in front of rows ``[row_start, row_end)``
    (default: the whole table) takes to fill (LRU's characteristic time T; ``inf`` when every
    row it can see fits)."""
    row_end = num_rows if row_end is None else row_end
    block, rows, share = row_buckets(dist, num_rows, [row_start], [row_end])
    q = -np.expm1(ids_per_step * np.log1p(-np.minimum(share, 1.0 - 1e-16)))
    if cache_rows >= float(rows[q > 0].sum()):
        return math.inf
    cap = np.array([max(float(cache_rows), float((rows * q).sum()))])
    return float(_fill_time(block, rows, np.log1p(-np.minimum(q, 1.0 - 1e-16)), cap, 1)[0])


@dataclass(frozen=True)
class TierTraffic:
    """A cached table's misses and their traffic per training step, over its shards."""

    tier: str
    policy: str
    hit_rate: float
    """Hits / distinct rows looked up, over every shard's cache."""
    distinct_rows: float
    misses: float
    """Rows loaded per step (each evicts a dirty row, written back: training updates every
    row it looks up)."""
    bytes: float
    """Bytes moved per step: ``misses x 2 x (row + optimizer state) bytes``."""
    fits: bool
    """Every shard's cache holds ``STEP_MARGIN`` steps' distinct rows."""


def block_traffic(spec: TableSpec, dist: IdDistribution, ids_per_step: float,
                  row_start: np.ndarray, row_end: np.ndarray, cols: np.ndarray,
                  optimizer: str) -> tuple[np.ndarray, TierTraffic]:
    """Bytes each block (a ``cached`` / ``file`` shard: rows ``[row_start, row_end)`` x
    ``cols`` columns, its own cache of ``Storage.slots(rows)`` slots) moves per step between
    its cache and its backing store, and the table's summary. ``ids_per_step``: the table's
    lookups per step over all ranks (R x B x L). A block whose cache holds fewer than
    ``STEP_MARGIN`` steps' distinct rows is charged its whole rows both ways."""
    st = spec.storage
    rows = np.asarray(row_end, dtype=np.int64) - np.asarray(row_start, dtype=np.int64)
    slots = [st.slots(int(r)) if r > 0 else 0 for r in rows.tolist()]
    est = estimate_hit_rates(dist, spec.num_embeddings, ids_per_step, list(row_start),
                             list(row_end), slots, st.policy)
    misses = np.array([e.misses for e in est])
    distinct = np.array([e.distinct_rows for e in est])
    cols = np.asarray(cols, dtype=np.float64)
    row_bytes = cols * spec.dtype_bytes + np.array(
        [table_state_bytes(spec, 1, int(c), optimizer) for c in cols.tolist()], dtype=np.float64)
    moved = 2.0 * misses * row_bytes
    short = np.array(slots, dtype=np.float64) < STEP_MARGIN * distinct
    # a cache that may not hold a step is refused at run time: costed as if the shard's every
    # row moved both ways each step, so the search prefers cuts whose caches hold their rows
    moved = np.where(short, 2.0 * rows * row_bytes, moved)
    U = float(distinct.sum())
    summary = TierTraffic(st.tier, st.policy, 1.0 - float(misses.sum()) / U if U > 0 else 1.0,
                          U, float(misses.sum()), float(moved.sum()),
                          not bool(short.any()))
    return moved, summary


def staged_traffic(spec: TableSpec, dist: IdDistribution, ids_per_step: float,
                   row_start: np.ndarray, row_end: np.ndarray, cols: np.ndarray,
                   optimizer: str) -> np.ndarray:
    """Bytes each block of a ``host`` table (rows in host memory the device reads over the
    link) moves per training step: its batch's distinct rows and their optimizer state copied
    into device memory and back (``modules/host_stage.py``), ``2 x U x (row + state)``."""
    U = distinct_rows(dist, spec.num_embeddings, ids_per_step, list(row_start), list(row_end))
    cols = np.asarray(cols, dtype=np.float64)
    row_bytes = cols * spec.dtype_bytes + np.array(
        [table_state_bytes(spec, 1, int(c), optimizer) for c in cols.tolist()], dtype=np.float64)
    return 2.0 * U * row_bytes
