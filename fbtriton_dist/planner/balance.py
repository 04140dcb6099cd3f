"""The memory pass: once the plan balances time, lower the fullest rank's memory.

The greedy search keeps memory under the budget and nothing more, so a skew-aware row cut
leaves the long cold block of a table on one rank (Criteo at 64 ranks, Zipf(1.1): 19 GiB on
one rank against a mean of 1.4 GiB) and a column slice of a 40M-row table sits next to ranks
that hold a few thousand rows. This pass lowers a memory *cap* step by step and, at each cap,
re-places the tables that put the most memory on the ranks above it with the planner's own
proposals (``ShardingPlanner._place``: every allowed sharding type, skew-aware or equal row
cuts, the same constraints) under that cap instead of the budget. The fastest proposal that
fits the cap wins, as in the search; it is kept only while the step time (the slowest rank's
estimated time) stays at or below ``limit``, which the planner sets to ``1 +
memory_tolerance`` times the time-balanced plan's step (and never above the plan with equal
row blocks). A cap that cannot be reached is undone and a cap halfway to the last reached
one (in log scale) is tried, so the caps converge on the lowest reachable one in a dozen
steps. Last, the slowest rank's tables are re-placed under the memory reached while that
lowers the step time: a cap reached by a slower placement, then lower caps undone, would
otherwise keep step time the final memory does not need (Criteo at 64 ranks, Zipf(1.1),
tolerance 0.2: 0.643 -> 0.590 ms at the same max/mean memory 1.97).

Cost: a cap re-places only the tables on ranks above it, each as one greedy step does
(numpy over the ranks), so the pass costs a few greedy steps per cap; per-table memory is
kept as a ``[T, R]`` array to find the table to move in O(T) per move.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .cost import TIME_QUANTUM, UNIFORM, Blocks, CostAccumulator
from .memory import block_bytes
from .stats import IdDistribution
from .tables import TableConstraints, TableSpec

__all__ = ["balance_memory", "blocks_bytes"]

FIRST_RATIO = 0.5
"""The first cap tried is this share of the largest rank's memory (never below the mean)."""
LAST_RATIO = 0.95
"""Stop once the step between caps is finer than this (5 % of the largest rank's memory)."""
MAX_CAPS = 16
"""Caps tried at most (each re-places the tables of the ranks above it)."""
TABLES_PER_RANK = 3
"""A rank above the cap tries its this-many largest tables (by memory on it), largest first."""
SWAP_TRIES = 4
"""Shard trades checked exactly per shard of the rank above the cap."""
TIGHTEN_MOVES = 8
"""After the caps: at most this many re-placements that lower the step time at the memory
reached."""
ONE_HOST = ("table_row_wise", "grid_shard")
"""Their shards (a grid's column slice's) stay on one host: traded only inside it."""


def blocks_bytes(spec: TableSpec, blocks: Blocks, optimizer: str) -> np.ndarray:
    """Device bytes of each of ``blocks`` (shards of ``spec``) as the search counts them
    (``memory.block_bytes``: weights + optimizer state in the table's ``state_dtype``, a
    ``cached`` / ``file`` shard's cache slots only); ``optimizer``: the planner's default."""
    rows = blocks.row_end - blocks.row_start
    cols = blocks.col_end - blocks.col_start
    return np.asarray(block_bytes(spec, rows, cols, optimizer), dtype=np.float64)


def balance_memory(
    planner: Any,
    draft: Any,
    specs: Sequence[TableSpec],
    cons: Mapping[str, TableConstraints],
    stats: Mapping[str, IdDistribution],
    limit: float,
) -> Any:
    """``draft`` (a ``planner._Draft`` of the ``ShardingPlanner`` ``planner``) with its largest
    rank's memory lowered while every rank's estimated time stays <= ``limit`` seconds; a new
    draft, ``draft`` is unchanged."""

    by_name = {t.name: t for t in specs}
    order = draft.order
    acc = draft.acc.copy()
    choices = list(draft.choices)
    R, H, model = planner.world_size, planner.local_world_size, planner.cost_model
    limit_q = round(limit / TIME_QUANTUM)

    def table_add(i: int, sharding: str, blocks) -> CostAccumulator:
        add = CostAccumulator(R, H, model)
        spec = by_name[order[i]]
        add.add_blocks(spec, sharding, blocks, stats.get(spec.name, UNIFORM), planner.optimizer)
        return add

    held = [CostAccumulator.TERMS.index(t) for t in ("weight_bytes", "state_bytes",
                                                    "slot_map_bytes")]
    adds = [table_add(i, *choice).values for i, choice in enumerate(choices)]
    per_table = np.stack([v[held].sum(0) for v in adds])  # [T, R] memory of each table

    def replace(i: int, cap: float, most_q: int | None = None) -> bool:
        """Re-place table ``i`` under ``cap``; False (and nothing changed) if no proposal
        fits or the step time would pass ``limit`` (``most_q`` quanta if given)."""
        most_q = limit_q if most_q is None else most_q
        spec = by_name[order[i]]
        acc.values -= adds[i]
        placed = planner.place_under(spec, cons[spec.name], stats.get(spec.name, UNIFORM),
                                      acc, cap)
        if placed is None:
            acc.values += adds[i]
            return False
        sharding, blocks, add = placed
        if round(float(acc.time_array().max()) / TIME_QUANTUM) > most_q:
            acc.values += adds[i] - add.values
            return False
        choices[i], adds[i] = (sharding, blocks), add.values
        per_table[i] = add.values[held].sum(0)
        return True

    coef = acc.coefficients
    hosts = np.arange(R) // H
    allowed = np.ones((len(order), R), dtype=bool)  # [T, R] ranks each table may use
    for i, name in enumerate(order):
        if cons[name].ranks is not None:
            allowed[i] = False
            allowed[i, list(cons[name].ranks)] = True

    def flat_shards():
        """Every shard but data-parallel replicas: table, index in its blocks, rank,
        memory, the table's time on that rank."""
        parts = []
        for j, (sharding, blocks) in enumerate(choices):
            if sharding == "data_parallel":
                continue
            mem = blocks_bytes(by_name[order[j]], blocks, planner.optimizer)
            parts.append((np.full(len(blocks), j), np.arange(len(blocks)), blocks.rank, mem,
                          (coef @ adds[j])[blocks.rank]))
        return [np.concatenate(x) for x in zip(*parts, strict=True)]

    def moved(i: int, index: int, rank: int):
        sharding, b = choices[i]
        ranks = b.rank.copy()
        ranks[index] = rank
        blocks = Blocks(ranks, b.row_start, b.row_end, b.col_start, b.col_end)
        return (sharding, blocks), table_add(i, sharding, blocks).values

    def swap(r: int, cap: float) -> bool:
        """Trade a shard of one of ``r``'s largest tables for a smaller shard of another
        table on a rank with room and time to spare (when no table can move alone: every
        rank near the step time). The pairs are ranked by the estimated larger of the two
        ranks' times after the trade, the best ``SWAP_TRIES`` checked exactly."""
        table, index, rank, mem, t = flat_shards()
        times, mems = acc.time_array(), acc.memories()
        for k in np.flatnonzero(rank == r)[np.argsort(-mem[rank == r], kind="stable")]:
            i, m_b, t_b = int(table[k]), mem[k], t[k]
            kind_i = choices[i][0]
            # a trade frees at least a quarter of the rank's excess over the cap
            ok = ((table != i) & (mem <= m_b - 0.25 * (mems[r] - cap)) & (rank != r)
                  & (mems[rank] - mem + m_b <= cap) & allowed[i, rank] & allowed[table, r]
                  & (per_table[i, rank] == 0) & (per_table[table, r] == 0))
            if kind_i in ONE_HOST:
                ok &= hosts[rank] == hosts[r]
            ok &= ~np.isin(table, one_host) | (hosts[rank] == hosts[r])
            cand = np.flatnonzero(ok)
            if not cand.size:
                continue
            est = np.maximum(times[rank[cand]] - t[cand] + t_b, times[r] - t_b + t[cand])
            keep = est <= limit
            cand = cand[keep][np.argsort(est[keep], kind="stable")][:SWAP_TRIES]
            for q in cand.tolist():
                j, s_rank = int(table[q]), int(rank[q])
                new_i, add_i = moved(i, int(index[k]), s_rank)
                new_j, add_j = moved(j, int(index[q]), r)
                delta = add_i + add_j - adds[i] - adds[j]
                acc.values += delta
                m = acc.memories()
                if (round(float(acc.time_array().max()) / TIME_QUANTUM) <= limit_q
                        and m[s_rank] <= cap and m[r] < mems[r]):
                    choices[i], choices[j], adds[i], adds[j] = new_i, new_j, add_i, add_j
                    per_table[i], per_table[j] = add_i[0] + add_i[1], add_j[0] + add_j[1]
                    return True
                acc.values -= delta
        return False

    one_host = np.array([i for i, (sh, _) in enumerate(choices) if sh in ONE_HOST], dtype=np.int64)

    def drain(cap: float) -> bool:
        """Move tables off every rank above ``cap``; False if one cannot be brought under."""
        for _ in range(len(order) * TABLES_PER_RANK + R):
            mem = acc.memories()
            r = int(np.argmax(mem))
            if mem[r] <= cap:
                return True
            on_r = per_table[:, r]
            tables = [int(i) for i in np.argsort(-on_r, kind="stable")[:TABLES_PER_RANK]
                      if on_r[i] > 0]
            if not any(replace(i, cap) for i in tables) and not swap(r, cap):
                return False
        return False

    start_q = round(float(acc.time_array().max()) / TIME_QUANTUM)
    mean = float(acc.memories().mean())
    ratio, reached = FIRST_RATIO, float(acc.memories().max())
    for step in range(MAX_CAPS):
        cap = max(mean, reached * ratio)
        if cap >= reached * LAST_RATIO:
            break
        planner.note_progress(f"memory pass: cap {cap / 2**30:.2f} GiB (step {step + 1})")
        saved = acc.values.copy(), list(choices), list(adds), per_table.copy()
        if drain(cap):
            reached = float(acc.memories().max())
            if reached <= mean * (1 + 1e-9):
                break
        else:
            acc.values, choices[:], adds[:], per_table[:] = saved[0], saved[1], saved[2], saved[3]
            ratio = math.sqrt(ratio)
    # the caps on the way may have spent step time that the last one does not need (a cap
    # reached by a slower placement, then lower caps undone): re-place the slowest rank's
    # tables under the memory reached while that lowers the step time
    cap = float(acc.memories().max())
    for _ in range(TIGHTEN_MOVES):
        times = acc.time_array()
        r = int(np.argmax(times))
        step_q = round(float(times[r]) / TIME_QUANTUM)
        if step_q <= start_q:
            break
        on_r = np.array([float(coef @ a[:, r]) for a in adds])
        tables = [int(i) for i in np.argsort(-on_r, kind="stable")[:TABLES_PER_RANK]
                  if on_r[i] > 0]
        planner.note_progress("memory pass: lowering the step time at the memory reached")
        if not any(replace(i, cap, step_q - 1) for i in tables):
            break
    out = copy.copy(draft)
    out.choices, out.adds, out.acc = choices, None, acc
    return out
