"""``ShardingPlanner``: choose a sharding type and placement for every table.

The search is greedy and cost-driven (largest tables first, as in longest-processing-time
scheduling): for each table, every allowed sharding type proposes placements given what
earlier tables already put on each rank; among those that fit the memory budget, the one whose
per-rank ``time_s`` vector, sorted from the slowest rank down, is smallest wins (compared
element by element to ``TIME_QUANTUM``: first the step time, then the next-slowest rank, and
so on, which spreads work that does not change the step time onto idle ranks; ties: the
smallest total). Row-wise kinds cut rows with :func:`stats.balanced_cuts`, so a skewed table
gets short hot blocks and long cold ones, capped by each rank's free memory.

On two or more hosts the greedy pass is followed by a bottleneck search: each of the
``GRID_BRANCHES`` tables that add the most time to a plan's slowest rank is allowed
``grid_shard`` (n equal column slices, each table-row-wise on one of the n least-loaded hosts,
for every n that keeps slices >= ``MIN_COLUMN_SLICE`` wide) and the greedy pass is rerun; a
re-plan whose step time beats its parent's is searched further the same way, up to
``MAX_GRID_TABLES`` grid tables. Of every plan seen, the most balanced one (lowest max/mean
time) whose step time is within ``balance_tolerance`` (1 %) of the fastest is returned.
This is for a table whose lookups outweigh what one host can absorb (at 64 ranks, Criteo's
100-ids-per-sample table costs 0.64 ms on the host that holds it, while the rest of the set
averages 0.45 ms a rank). Each slice receives all the table's ids and sends its own pooled
slice, so it is offered only to bottleneck tables: offered to every table, the greedy spread
small tables over whole hosts and the mean rank time at 64 ranks rose from 0.45 to 0.65 ms.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ._yaml import check_choice, check_int, check_number
from .cost import UNIFORM, CostAccumulator, CostModel, PlanCost, evaluate
from .memory import block_bytes, fmt_bytes
from .plan import ShardingPlan
from .shards import SHARDING_TYPES, Shard, TableSharding
from .stats import IdDistribution, balanced_cuts, equal_cuts
from .tables import OPTIMIZERS, TableConstraints, TableSpec, table_constraints, to_table_specs

__all__ = ["PlanError", "ShardingPlanner"]

RowCuts = Literal["balanced", "equal"]
MIN_COLUMN_SLICE = 32
"""Column-wise slices are at least this wide (narrower slices waste the TBE kernel's lanes)."""
TIME_QUANTUM = 1e-8
"""Per-rank times closer than this (seconds) count as equal when comparing proposals."""
MAX_GRID_TABLES = 4
"""Grid-shard at most this many bottleneck tables in one plan."""
GRID_BRANCHES = 2
"""The bottleneck search tries the largest this-many contributors to a plan's slowest rank
(so at most 2 + 4 + 8 + 16 = 30 re-plans with ``MAX_GRID_TABLES`` = 4)."""
TW_CANDIDATE_RANKS = 4
"""Table-wise tries this many of the least-loaded ranks that have room."""


def _quanta(seconds: float) -> int:
    return round(seconds / TIME_QUANTUM)


def _table_sharding(spec: TableSpec, sharding: str, shards: Iterable[Shard]) -> TableSharding:
    return TableSharding(
        name=spec.name,
        sharding=sharding,  # type: ignore[arg-type]
        num_embeddings=spec.num_embeddings,
        embedding_dim=spec.embedding_dim,
        shards=tuple(shards),
    )



DEFAULT_HBM_BYTES = 80 * 2**30
"""A rank's device memory when none is given (an H100's 80 GiB)."""

class PlanError(ValueError):
    """The tables do not fit; the message explains which table and by how much."""


class ShardingPlanner:
    """Plans how ``tables`` are sharded over ``world_size`` ranks.

    Args:
        world_size: R, the number of ranks.
        local_world_size: ranks per host (default: all R on one host).
        hbm_bytes_per_rank: device memory of one rank (default 80 GiB, an H100's; the CLI's
            and the job's default too).
        reserved_fraction: share of ``hbm_bytes_per_rank`` kept for the dense model,
            activations and communication buffers; the rest is the embedding budget.
        cost_model: workload and machine numbers (batch size, bandwidths, ...).
        optimizer: fused optimizer of tables that do not name their own.
        row_cuts: ``balanced`` (skew-aware, equal cost per rank) or ``equal`` (TorchRec's
            equal row blocks, for comparison).
        balance_tolerance: among the plans the bottleneck loop finds (two or more hosts), the
            most balanced (lowest max/mean time) is kept among those whose step time is at
            most ``1 + balance_tolerance`` times the fastest one's. The cost model is an
            estimate, so a plan 0.2 % slower but far more even is the better bet; 0.01 is
            measured on Criteo at 64 ranks, Zipf(1.1): 0.501 ms / 1.063 instead of 0.500 ms /
            1.115, while 0.03 would already trade 3 % of step time for balance (0.515 ms /
            1.059). 0 keeps the fastest plan.
        progress: called with a line of text (which pass, how many tables placed, seconds so
            far) about once a second once a plan has taken ``progress_after_s``; None: quiet.
    """

    def __init__(
        self,
        *,
        world_size: int,
        hbm_bytes_per_rank: float = DEFAULT_HBM_BYTES,
        local_world_size: int | None = None,
        reserved_fraction: float = 0.1,
        cost_model: CostModel | None = None,
        optimizer: str = "rowwise_adagrad",
        row_cuts: RowCuts = "balanced",
        balance_tolerance: float = 0.01,
        progress: Callable[[str], None] | None = None,
        progress_after_s: float = 2.0,
    ) -> None:
        check_int("world_size", world_size, 1)
        local_world_size = world_size if local_world_size is None else local_world_size
        check_int("local_world_size", local_world_size, 1)
        if world_size % local_world_size:
            raise ValueError(
                f"local_world_size: expected a divisor of world_size={world_size}, "
                f"got {local_world_size}"
            )
        check_number("hbm_bytes_per_rank", hbm_bytes_per_rank, 0.0, strict=True)
        check_number("reserved_fraction", reserved_fraction, 0.0)
        if reserved_fraction >= 1.0:
            raise ValueError(f"reserved_fraction: expected a number < 1, got {reserved_fraction}")
        check_choice("optimizer", optimizer, OPTIMIZERS)
        check_choice("row_cuts", row_cuts, ("balanced", "equal"))
        check_number("balance_tolerance", balance_tolerance, 0.0)
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.hbm_bytes_per_rank = hbm_bytes_per_rank
        self.reserved_fraction = reserved_fraction
        self.cost_model = cost_model or CostModel()
        self.optimizer = optimizer
        self.row_cuts = row_cuts
        self.balance_tolerance = balance_tolerance
        self.progress, self.progress_after_s = progress, progress_after_s
        self._clock = (0.0, 0.0)  # (start of the plan, last progress line)

    @property
    def budget_bytes(self) -> float:
        """Embedding memory per rank: ``hbm_bytes_per_rank x (1 - reserved_fraction)``."""
        return self.hbm_bytes_per_rank * (1.0 - self.reserved_fraction)

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def describe(self) -> str:
        return (
            f"{self.world_size} ranks ({self.num_hosts} host(s) x {self.local_world_size}), "
            f"budget {fmt_bytes(self.budget_bytes)}/rank "
            f"({fmt_bytes(self.hbm_bytes_per_rank)} HBM - {self.reserved_fraction:.0%} reserved), "
            f"batch {self.cost_model.batch_size}/rank, optimizer {self.optimizer}"
        )

    # -- public API -----------------------------------------------------------------------
    def plan(
        self,
        tables: Iterable[Any],
        constraints: Mapping[str, TableConstraints] | None = None,
        stats: Mapping[str, IdDistribution] | None = None,
    ) -> ShardingPlan:
        """A plan for ``tables`` (TableSpecs or EmbeddingBagConfigs); raises :class:`PlanError`.

        ``constraints`` and ``stats`` (id distributions) are keyed by table name; tables
        without stats are taken as uniform.
        """
        self._clock = (time.monotonic(), -math.inf)
        return self._plan(tables, constraints, stats)

    def _plan(self, tables, constraints, stats) -> ShardingPlan:
        """``plan`` without restarting the progress clock."""
        specs = to_table_specs(tables)
        cons = table_constraints(constraints, specs)
        for name in stats or {}:
            if name not in cons:
                raise ValueError(f"stats: unknown table {name!r}, expected one of {list(cons)}")
        for spec in specs:
            self._check_constraints(spec, cons[spec.name])
        self._check_total_memory(specs)
        stats = stats or {}
        best = self._greedy(specs, cons, stats, frozenset())
        if self.num_hosts < 2:
            return self._no_worse_than_equal_cuts(best, specs, cons, stats)
        # grid-shard a table that dominates the slowest rank, re-plan; a re-plan whose step time
        # beats its parent's is explored further (a small tree: GRID_BRANCHES contributors per
        # plan, MAX_GRID_TABLES deep); every plan seen is a candidate for _choose
        candidates = [(best, self._plan_cost(best, specs, stats))]
        frontier = [(frozenset[str](), candidates[0])]
        seen: set[frozenset[str]] = set()
        for _ in range(MAX_GRID_TABLES):
            grown = []
            for grid, (plan, cost) in frontier:
                names = self._bottlenecks(plan, cost, specs, stats, grid)
                for name in names[:GRID_BRANCHES]:
                    if "grid_shard" not in self._allowed_types(cons[name], grid=True):
                        continue
                    wider = grid | {name}
                    if wider in seen:
                        continue
                    seen.add(wider)
                    try:
                        new = self._greedy(specs, cons, stats, wider)
                    except PlanError:
                        continue
                    new_cost = self._plan_cost(new, specs, stats)
                    candidates.append((new, new_cost))
                    if _quanta(new_cost.max()) < _quanta(cost.max()):
                        grown.append((wider, (new, new_cost)))
            frontier = grown
        return self._no_worse_than_equal_cuts(self._choose(candidates), specs, cons, stats)

    def _no_worse_than_equal_cuts(
        self,
        plan: ShardingPlan,
        specs: Sequence[TableSpec],
        cons: Mapping[str, TableConstraints],
        stats: Mapping[str, IdDistribution],
    ) -> ShardingPlan:
        """``plan``, or the plan made with equal row blocks if that one's step time is lower
        (skew-aware cuts balance each table as it is placed; greedily, that can leave a plan
        slower than equal blocks, e.g. Criteo at 8 ranks). Only with ``row_cuts="balanced"``."""
        if self.row_cuts != "balanced":
            return plan
        equal = copy.copy(self)  # the same clock: its progress lines continue ours
        equal.row_cuts = "equal"
        try:
            other = equal._plan(specs, cons, stats)
        except PlanError:  # equal blocks do not fit where balanced cuts do
            return plan
        mine = self._plan_cost(plan, specs, stats).max()
        theirs = self._plan_cost(other, specs, stats).max()
        return other if _quanta(theirs) < _quanta(mine) else plan

    def _choose(self, candidates: Sequence[tuple[ShardingPlan, PlanCost]]) -> ShardingPlan:
        """The most balanced plan among those whose step time is within ``balance_tolerance``
        of the fastest (ties: the faster, then the earlier)."""
        fastest = min(_quanta(cost.max()) for _, cost in candidates)
        limit = fastest * (1.0 + self.balance_tolerance)
        near = [(plan, cost) for plan, cost in candidates if _quanta(cost.max()) <= limit]
        return min(near, key=lambda pc: (pc[1].imbalance(), _quanta(pc[1].max())))[0]

    def _greedy(
        self,
        specs: Sequence[TableSpec],
        cons: Mapping[str, TableConstraints],
        stats: Mapping[str, IdDistribution],
        grid: frozenset[str],
    ) -> ShardingPlan:
        """One greedy pass; tables named in ``grid`` may also be grid-sharded."""
        acc = CostAccumulator(self.world_size, self.local_world_size, self.cost_model)
        chosen: dict[str, TableSharding] = {}
        for i, spec in enumerate(self._order(specs)):
            self._report(f"{'equal row blocks' if self.row_cuts == 'equal' else 'skew-aware'}"
                         f"{f', grid {sorted(grid)}' if grid else ''}: table {i + 1}/"
                         f"{len(specs)}")
            dist = stats.get(spec.name, UNIFORM)
            chosen[spec.name] = self._place(spec, cons[spec.name], dist, acc, spec.name in grid)
        return ShardingPlan(
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            tables=tuple(chosen[s.name] for s in specs),
        )

    def _report(self, where: str) -> None:
        """A progress line, once the plan has taken ``progress_after_s``, at most once a
        second."""
        if self.progress is None:
            return
        start, last = self._clock
        now = time.monotonic()
        if now - start >= self.progress_after_s and now - last >= 1.0:
            self._clock = (start, now)
            self.progress(f"planning {self.world_size} ranks: {where} ({now - start:.0f} s)")

    def _plan_cost(
        self,
        plan: ShardingPlan,
        specs: Sequence[TableSpec],
        stats: Mapping[str, IdDistribution],
    ) -> PlanCost:
        return evaluate(plan, specs, stats, self.cost_model, self.optimizer)

    def _bottlenecks(
        self,
        plan: ShardingPlan,
        cost: PlanCost,
        specs: Sequence[TableSpec],
        stats: Mapping[str, IdDistribution],
        skip: frozenset[str],
    ) -> list[str]:
        """Tables not in ``skip``, by the time each adds to the plan's slowest rank, most first."""
        slowest = max(cost.ranks, key=lambda r: r.time_s).rank
        by_name = {t.name: t for t in specs}

        def share(ts: TableSharding) -> float:
            one = CostAccumulator(self.world_size, self.local_world_size, self.cost_model)
            one.add_table(by_name[ts.name], ts, stats.get(ts.name, UNIFORM), self.optimizer)
            return one.time(slowest)

        rest = [ts for ts in plan.tables if ts.name not in skip]
        return [ts.name for ts in sorted(rest, key=share, reverse=True)]

    def cost(
        self,
        plan: ShardingPlan,
        tables: Iterable[Any],
        stats: Mapping[str, IdDistribution] | None = None,
    ) -> PlanCost:
        """This planner's cost model applied to any plan of ``tables``."""
        return evaluate(plan, to_table_specs(tables), stats, self.cost_model, self.optimizer)

    # -- checks ---------------------------------------------------------------------------
    def _check_constraints(self, spec: TableSpec, c: TableConstraints) -> None:
        bad = [r for r in c.ranks or () if r >= self.world_size]
        if bad:
            raise ValueError(
                f"constraints['{spec.name}'].ranks: expected ranks < world_size="
                f"{self.world_size}, got {bad}"
            )
        if not self._allowed_types(c):
            raise ValueError(
                f"constraints['{spec.name}'].sharding: {list(c.sharding or ())} leaves no usable "
                f"sharding type on {self.num_hosts} host(s) (table_row_wise needs 2 or more)"
            )

    def _table_bytes(self, spec: TableSpec, rows: int, cols: int) -> int:
        return block_bytes(spec, rows, cols, self.optimizer)

    def _check_total_memory(self, specs: Sequence[TableSpec]) -> None:
        need = sum(self._table_bytes(t, t.num_embeddings, t.embedding_dim) for t in specs)
        weights = sum(t.num_embeddings * t.embedding_dim * t.dtype_bytes for t in specs)
        have = self.world_size * self.budget_bytes
        if need <= have:
            return
        per_rank = self.budget_bytes
        size = {t.name: self._table_bytes(t, t.num_embeddings, t.embedding_dim) for t in specs}
        biggest = max(specs, key=lambda t: size[t.name])
        raise PlanError(
            f"the {len(specs)} tables need {fmt_bytes(need)} (weights {fmt_bytes(weights)} + "
            f"optimizer state {fmt_bytes(need - weights)}, {self.optimizer}), but "
            f"{self.world_size} ranks x {fmt_bytes(per_rank)} budget = {fmt_bytes(have)}; "
            f"short by {fmt_bytes(need - have)}. At this budget it takes at least "
            f"{math.ceil(need / per_rank)} ranks (or more HBM, a smaller dtype, a lighter "
            f"optimizer). Largest table: '{biggest.name}' {biggest.num_embeddings} rows x "
            f"{biggest.embedding_dim} x {biggest.dtype_bytes} B + state = "
            f"{fmt_bytes(size[biggest.name])}"
        )

    def _allowed_types(self, c: TableConstraints, grid: bool = True) -> list[str]:
        """Usable types under ``c``; ``grid=False`` leaves grid_shard out unless ``c`` asks."""
        types = list(c.sharding or SHARDING_TYPES)
        if not grid and c.sharding is None:
            types.remove("grid_shard")
        one_host = ("table_row_wise", "grid_shard")  # both are row_wise on one host
        if self.num_hosts < 2 and c.sharding is None:
            types = [t for t in types if t not in one_host]
        if self.num_hosts < 2 and c.sharding is not None:
            types = [t if t not in one_host else "row_wise" for t in types]
        return list(dict.fromkeys(types))

    # -- search ---------------------------------------------------------------------------
    def _order(self, specs: Sequence[TableSpec]) -> list[TableSpec]:
        """Largest first, by the larger of its share of all memory and of all lookup bytes."""
        mem = [self._table_bytes(t, t.num_embeddings, t.embedding_dim) for t in specs]
        work = [t.ids_per_sample * t.embedding_dim * t.dtype_bytes for t in specs]
        tm, tw = sum(mem) or 1, sum(work) or 1
        key = {t.name: max(m / tm, w / tw) for t, m, w in zip(specs, mem, work, strict=True)}
        return sorted(specs, key=lambda t: -key[t.name])

    def _place(
        self,
        spec: TableSpec,
        c: TableConstraints,
        dist: IdDistribution,
        acc: CostAccumulator,
        grid: bool,
    ) -> TableSharding:
        best, best_score, failures = None, None, []
        base = acc.time_array()
        for sharding in self._allowed_types(c, grid):
            proposals = list(self._proposals(spec, sharding, c, dist, acc))
            if not proposals:
                failures.append(self._why_not(spec, sharding, c, acc))
            for ts in proposals:
                add = CostAccumulator(self.world_size, self.local_world_size, self.cost_model)
                add.add_table(spec, ts, dist, self.optimizer)
                if (acc.memories() + add.memories() > self.budget_bytes).any():
                    failures.append(self._why_not(spec, sharding, c, acc))
                    continue
                extra = add.time_array()
                new = np.sort(base + extra)[::-1]
                score = (tuple(np.round(new / TIME_QUANTUM).astype(np.int64).tolist()),
                         float(extra.sum()))
                if best_score is None or score < best_score:
                    best, best_score, best_add = ts, score, add
        if best is None:
            full = self._table_bytes(spec, spec.num_embeddings, spec.embedding_dim)
            reasons = "\n  ".join(dict.fromkeys(failures))
            raise PlanError(
                f"table '{spec.name}' ({spec.num_embeddings} rows x {spec.embedding_dim} x "
                f"{spec.dtype_bytes} B + state = {fmt_bytes(full)}) does not fit in a budget of "
                f"{fmt_bytes(self.budget_bytes)} per rank after the larger tables were placed:\n"
                f"  {reasons}"
            )
        acc.merge(best_add)
        return best

    def _candidate_ranks(self, c: TableConstraints) -> list[int]:
        return list(c.ranks) if c.ranks is not None else list(range(self.world_size))

    def _proposals(
        self,
        spec: TableSpec,
        sharding: str,
        c: TableConstraints,
        dist: IdDistribution,
        acc: CostAccumulator,
    ) -> Iterator[TableSharding]:
        """The placements ``sharding`` offers for the table, given the load already in ``acc``."""
        ranks = self._candidate_ranks(c)
        lo, hi = c.min_shards or 1, c.max_shards or self.world_size
        times, mem = acc.times(), acc.memories().tolist()
        by_load = sorted(ranks, key=lambda r: (times[r], mem[r], r))
        if sharding == "data_parallel":
            cuts = self._replicas(spec, ranks)
        elif sharding == "table_wise":
            cuts = self._whole_tables(spec, lo, by_load, acc)
        elif sharding == "column_wise":
            cuts = self._column_slices(spec, c, len(ranks), by_load, acc)
        elif sharding == "grid_shard":
            cuts = self._grid(spec, ranks, lo, hi, dist, acc)
        else:
            cuts = self._row_blocks(spec, sharding, ranks, by_load, lo, hi, dist, acc)
        for shards in cuts:
            yield _table_sharding(spec, sharding, shards)

    def _replicas(self, spec: TableSpec, ranks: list[int]) -> Iterator[list[Shard]]:
        """Data-parallel: a full replica on every rank (never pinned to some ranks)."""
        E, D = spec.num_embeddings, spec.embedding_dim
        if len(ranks) == self.world_size:
            yield [
                Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D)
                for r in range(self.world_size)
            ]

    def _whole_tables(
        self, spec: TableSpec, lo: int, by_load: list[int], acc: CostAccumulator
    ) -> Iterator[list[Shard]]:
        """Table-wise: the whole table on one of the ``TW_CANDIDATE_RANKS`` least-loaded ranks
        that have room."""
        E, D = spec.num_embeddings, spec.embedding_dim
        if lo <= 1:
            need = self._table_bytes(spec, E, D)
            mem = acc.memories().tolist()
            fits = [r for r in by_load if mem[r] + need <= self.budget_bytes]
            for r in fits[:TW_CANDIDATE_RANKS]:
                yield [Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D)]

    def _column_slices(
        self,
        spec: TableSpec,
        c: TableConstraints,
        num_ranks: int,
        by_load: list[int],
        acc: CostAccumulator,
    ) -> Iterator[list[Shard]]:
        """Column-wise: for each allowed slice count k, k equal slices on the k least-loaded
        ranks that have room for one (in rank order)."""
        E, D = spec.num_embeddings, spec.embedding_dim
        for k in self._column_splits(D, c, num_ranks):
            w = D // k
            need = self._table_bytes(spec, E, w)
            mem = acc.memories().tolist()
            fits = [r for r in by_load if mem[r] + need <= self.budget_bytes]
            if len(fits) >= k:
                yield [
                    Shard(rank=r, row_start=0, row_end=E, col_start=i * w, col_end=(i + 1) * w)
                    for i, r in enumerate(sorted(fits[:k]))
                ]

    def _row_blocks(
        self,
        spec: TableSpec,
        sharding: str,
        ranks: list[int],
        by_load: list[int],
        lo: int,
        hi: int,
        dist: IdDistribution,
        acc: CostAccumulator,
    ) -> Iterator[list[Shard]]:
        """Row-wise and table-row-wise: the rows cut over each candidate group of ranks
        (``_row_groups``), a rank left without rows holding no shard."""
        D = spec.embedding_dim
        for group in self._row_groups(sharding, ranks, by_load, lo, hi):
            cuts = self._cut(spec, sharding, group, dist, acc)
            if cuts is not None:
                yield [
                    Shard(rank=r, row_start=a, row_end=b, col_start=0, col_end=D)
                    for r, a, b in zip(group, cuts, cuts[1:], strict=False)
                    if b > a
                ]

    def _column_splits(self, D: int, c: TableConstraints, num_ranks: int) -> list[int]:
        """Slice counts k >= 2 that cut D into equal slices of >= MIN_COLUMN_SLICE columns
        (narrower only when the table's ``min_shards`` asks for it), within the constraints."""
        lo, hi = max(2, c.min_shards or 1), min(c.max_shards or num_ranks, num_ranks)
        return [
            k
            for k in range(lo, hi + 1)
            if D % k == 0 and (D // k >= MIN_COLUMN_SLICE or k == c.min_shards)
        ]

    def _grid_splits(self, D: int, num_hosts: int) -> list[int]:
        """Column slice counts n in 2..hosts that cut D into equal slices >= MIN_COLUMN_SLICE."""
        return [n for n in range(2, num_hosts + 1) if D % n == 0 and D // n >= MIN_COLUMN_SLICE]

    def _grid(
        self,
        spec: TableSpec,
        ranks: list[int],
        lo: int,
        hi: int,
        dist: IdDistribution,
        acc: CostAccumulator,
    ) -> Iterator[list[Shard]]:
        """Grid-shard placements: for each slice count n, slice i of D/n columns is cut by rows
        (balanced) over the allowed ranks of the i-th least-loaded host (at most hi/n each)."""
        D, H = spec.embedding_dim, self.local_world_size
        hosts: dict[int, list[int]] = {}
        times, mem = acc.times(), acc.memories().tolist()
        for r in sorted(ranks, key=lambda r: (times[r], mem[r], r)):
            hosts.setdefault(r // H, []).append(r)
        order = sorted(
            hosts, key=lambda h: (max(times[r] for r in hosts[h]), times[hosts[h][0]], h)
        )
        for n in self._grid_splits(D, len(order)):
            per_host, w = min(H, hi // n), D // n
            groups = [sorted(hosts[h][:per_host]) for h in order[:n]]
            if per_host < 1 or sum(len(g) for g in groups) < lo:
                continue
            work, shards = acc.copy(), []
            for i, group in enumerate(groups):
                cols = (i * w, (i + 1) * w)
                cuts = self._cut(spec, "grid_shard", group, dist, work, cols)
                if cuts is None:
                    break
                part = [
                    Shard(rank=r, row_start=a, row_end=b, col_start=cols[0], col_end=cols[1])
                    for r, a, b in zip(group, cuts, cuts[1:], strict=False)
                    if b > a
                ]
                work.add_table(
                    spec, _table_sharding(spec, "grid_shard", part), dist, self.optimizer
                )
                shards += part
            else:
                yield shards

    def _row_groups(
        self, sharding: str, ranks: list[int], by_load: list[int], lo: int, hi: int
    ) -> Iterator[list[int]]:
        """Rank groups a row-wise kind may use: the least loaded k allowed ranks for k = H, 2H,
        4H, ... up to all of them (at most ``hi``), or for table_row_wise each host's ranks."""
        if sharding == "row_wise":
            # all allowed ranks, or fewer (whole hosts' worth, doubling): fewer holders trade
            # lookup spreading for less output-dist traffic, which grows with the holders
            sizes = {min(hi, len(ranks))}
            k = self.local_world_size
            while k < min(hi, len(ranks)):
                sizes.add(k)
                k *= 2
            for k in sorted(sizes):
                if k >= lo:
                    yield sorted(by_load[:k])
            return
        H = self.local_world_size
        for h in range(self.num_hosts):
            group = sorted([r for r in by_load if r // H == h][:hi])
            if len(group) >= max(lo, 1):
                yield group

    def _cut(
        self,
        spec: TableSpec,
        sharding: str,
        group: list[int],
        dist: IdDistribution,
        acc: CostAccumulator,
        cols: tuple[int, int] | None = None,
    ) -> list[int] | None:
        """Row cuts of the table (or of its column slice ``cols``) over ``group``."""
        E, D = spec.num_embeddings, spec.embedding_dim
        c0, c1 = cols or (0, D)
        caps = self._row_caps(spec, group, acc, c1 - c0)
        if self.row_cuts == "equal":
            return self._equal_cut(spec, group, acc, c1 - c0)
        # every rank's load before this table, plus the pooled slices it will receive
        probe = acc.copy()
        whole = [Shard(rank=r, row_start=0, row_end=E, col_start=c0, col_end=c1) for r in group]
        probe.add_table(spec, _table_sharding(spec, sharding, whole), UNIFORM, self.optimizer)
        # probe gave each holder the full table's share (p=1); undo that linear part per rank
        k = len(group)
        t0 = acc.terms_time(acc.row_holder_terms(spec, 0.0, k, sharding, c1 - c0))
        t1 = acc.terms_time(acc.row_holder_terms(spec, 1.0, k, sharding, c1 - c0))
        probe_times = probe.times()
        base = [probe_times[r] - t1 for r in group]

        def load(j: int, share: float) -> float:
            return base[j] + t0 + (t1 - t0) * share

        return balanced_cuts(E, dist, load, caps)

    def _row_caps(self, spec: TableSpec, group: list[int], acc: CostAccumulator,
                  cols: int) -> list[int]:
        """Rows of ``cols`` columns each rank of ``group`` still has memory for."""
        per_row = self._table_bytes(spec, 1, cols)
        mem = acc.memories().tolist()
        return [max(0, int((self.budget_bytes - mem[r]) // per_row)) for r in group]

    def _equal_cut(self, spec: TableSpec, group: list[int], acc: CostAccumulator,
                   cols: int | None = None) -> list[int] | None:
        """Equal row blocks over ``group`` (TorchRec's cut), or None where one does not fit."""
        cuts = equal_cuts(spec.num_embeddings, len(group))
        caps = self._row_caps(spec, group, acc, spec.embedding_dim if cols is None else cols)
        ok = all(b - a <= cap for a, b, cap in zip(cuts, cuts[1:], caps, strict=False))
        return cuts if ok else None

    def _why_not(
        self, spec: TableSpec, sharding: str, c: TableConstraints, acc: CostAccumulator
    ) -> str:
        """One line: why ``sharding`` cannot hold this table, with the numbers."""
        E, D = spec.num_embeddings, spec.embedding_dim
        ranks = self._candidate_ranks(c)
        mem = acc.memories().tolist()
        free = {r: max(0.0, self.budget_bytes - mem[r]) for r in ranks}
        most = max(free, key=lambda r: free[r])
        full = self._table_bytes(spec, E, D)
        if sharding == "data_parallel":
            return (
                f"data_parallel: needs {fmt_bytes(full)} on every rank, "
                f"least free is {fmt_bytes(min(free.values()))}"
                + ("" if len(ranks) == self.world_size else " (and it cannot be pinned to ranks)")
            )
        if sharding == "table_wise":
            return (
                f"table_wise: needs {fmt_bytes(full)} on one rank, "
                f"most free is {fmt_bytes(free[most])} (rank {most})"
            )
        if sharding == "column_wise":
            splits = self._column_splits(D, c, len(ranks))
            if not splits:
                return (
                    f"column_wise: no slice count in [{max(2, c.min_shards or 1)}, "
                    f"{min(c.max_shards or len(ranks), len(ranks))}] cuts D={D} into equal "
                    f"slices of >= {MIN_COLUMN_SLICE} columns"
                )
            k = max(splits)
            slice_bytes = self._table_bytes(spec, E, max(1, D // k))
            return (
                f"column_wise: {k} slices of {E} rows x {D // k} cols need "
                f"{fmt_bytes(slice_bytes)} each, most free is {fmt_bytes(free[most])} (rank {most})"
            )
        per_row = self._table_bytes(spec, 1, D)
        H = self.local_world_size
        host_free = max(
            sum(v for r, v in free.items() if r // H == h) for h in range(self.num_hosts)
        )
        if sharding == "grid_shard":
            splits = self._grid_splits(D, self.num_hosts)
            if not splits:
                return (
                    f"grid_shard: no slice count in [2, {self.num_hosts} hosts] cuts D={D} into "
                    f"equal slices of >= {MIN_COLUMN_SLICE} columns"
                )
            n = max(splits)
            slice_bytes = self._table_bytes(spec, E, D // n)
            return (
                f"grid_shard: {n} slices of {E} rows x {D // n} cols need {fmt_bytes(slice_bytes)} "
                f"each on one host, most free on a host is {fmt_bytes(host_free)}"
            )
        if sharding == "table_row_wise":
            return (
                f"table_row_wise: needs {E} rows x {fmt_bytes(per_row)}/row = {fmt_bytes(full)} on "
                f"one host, most free on a host is {fmt_bytes(host_free)}; short by "
                f"{fmt_bytes(full - host_free)}"
            )
        total_free = sum(free.values())
        short = f"; short by {fmt_bytes(full - total_free)}" if full > total_free else ""
        return (
            f"row_wise: needs {E} rows x {fmt_bytes(per_row)}/row (= {D} x {spec.dtype_bytes} B "
            f"+ state) = {fmt_bytes(full)} over {len(ranks)} rank(s) with "
            f"{fmt_bytes(total_free)} free{short}"
            + ("" if self.row_cuts == "balanced" else " (equal row blocks)")
        )
