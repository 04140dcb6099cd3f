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

The placements each sharding type proposes for a table (and why a type has none) are
``proposals.py``'s :class:`~.proposals.Proposer`; this file searches over them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._yaml import check_choice, check_int, check_number
from .balance import balance_memory
from .cost import TIME_QUANTUM, UNIFORM, Blocks, CostAccumulator, CostModel, PlanCost, evaluate
from .memory import block_bytes, fmt_bytes
from .plan import ShardingPlan, host_memory_problems
from .proposals import MIN_COLUMN_SLICE, Proposer, RowCuts
from .shard_tiers import promote_hot_shards, smallest_caches
from .shards import SHARDING_TYPES, TableSharding
from .stats import IdDistribution
from .tables import OPTIMIZERS, TableConstraints, TableSpec, table_constraints, to_table_specs
from .tier_choice import TierBudgets, auto_tables, cache_shortfalls, choose_tiers, disk_problems

__all__ = ["PlanError", "ShardingPlanner"]

MAX_GRID_TABLES = 4
"""Grid-shard at most this many bottleneck tables in one plan."""
GRID_BRANCHES = 2
"""The bottleneck search tries the largest this-many contributors to a plan's slowest rank
(so at most 2 + 4 + 8 + 16 = 30 re-plans with ``MAX_GRID_TABLES`` = 4)."""


def _better(a: tuple[np.ndarray, float], b: tuple[np.ndarray, float]) -> bool:
    """``a < b`` for scores (rank times in quanta, slowest first; then the total added):
    the tuples' order, on arrays."""
    differ = np.flatnonzero(a[0] != b[0])
    if differ.size:
        return bool(a[0][differ[0]] < b[0][differ[0]])
    return a[1] < b[1]


def _quanta(seconds: float) -> int:
    return round(seconds / TIME_QUANTUM)


def _table_sharding(spec: TableSpec, sharding: str, blocks: Blocks) -> TableSharding:
    return TableSharding(
        name=spec.name,
        sharding=sharding,  # type: ignore[arg-type]
        num_embeddings=spec.num_embeddings,
        embedding_dim=spec.embedding_dim,
        shards=blocks.shards(),
        storage=spec.storage,
    )


def _placeable(spec: TableSpec, types: list[str]) -> list[str]:
    """``types`` the table may take: no data_parallel replica of a table on a tier other than
    device (the sharded collections refuse a replica behind a cache)."""
    return [t for t in types if t != "data_parallel" or spec.tier == "device"]



DEFAULT_HBM_BYTES = 80 * 2**30
"""A rank's device memory when none is given (an H100's 80 GiB)."""

class PlanError(ValueError):
    """The tables do not fit; the message explains which table and by how much."""


@dataclass(eq=False)
class _Draft:
    """One greedy pass: each table's choice in placement order, what each added to the
    per-rank sums (kept while a re-plan may start from it) and the sums."""

    grid: frozenset[str]
    order: list[str]
    choices: list[tuple[str, Blocks]]
    adds: list[np.ndarray] | None
    acc: CostAccumulator

    def times(self) -> np.ndarray:
        return self.acc.time_array()

    def step(self) -> float:
        return float(self.times().max())



def _imbalance(times: np.ndarray) -> float:
    """max / mean (1.0 when every value is 0)."""
    mean = float(times.mean())
    return float(times.max()) / mean if mean > 0 else 1.0


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
        balance_memory: after the time-balanced plan is found, lower the largest rank's
            memory (``balance.balance_memory``: re-place the tables of the fullest ranks under
            a lower memory cap) while the step time stays within ``memory_tolerance``.
        memory_tolerance: the memory pass may raise the step time (the slowest rank's) to at
            most ``1 + memory_tolerance`` times the time-balanced plan's (and never above the
            plan with equal row blocks); 0 only takes moves that keep the step time.
        host_bytes_per_rank: host memory of one rank for the backing stores of tables on the
            ``host`` and ``cached`` tiers (every row and its optimizer state; a ``cached`` /
            ``file`` table's cache counts against the device budget); None: not checked. The
            search does not balance it: a plan that exceeds it raises :class:`PlanError`.
        progress: called with a line of text (which pass, how many tables placed, seconds so
            far) about once a second once a plan has taken ``progress_after_s``; None: quiet.
        auto_tiers: choose the storage tier of every table without ``storage`` (tables with
            ``storage: auto`` always get one): ``tier_choice.choose_tiers``.
        disk_bytes_per_rank: disk of one rank for the files of ``file`` tables; None: not
            checked.
        file_dir: the directory of the ``file`` tables the planner chooses (None: it chooses
            none; a table that needs one is an error).
        shard_tiers: with tiers chosen (``auto_tiers`` / ``storage: auto``), a tier per shard:
            once the plan is made, the hottest cached / file shards of those tables go back on
            ``device`` while their rank's budget holds them (``shard_tiers.promote_hot_shards``).
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
        balance_memory: bool = True,
        memory_tolerance: float = 0.01,
        progress: Callable[[str], None] | None = None,
        progress_after_s: float = 2.0,
        host_bytes_per_rank: float | None = None,
        auto_tiers: bool = False,
        disk_bytes_per_rank: float | None = None,
        file_dir: str | None = None,
        shard_tiers: bool = False,
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
        if host_bytes_per_rank is not None:
            check_number("host_bytes_per_rank", host_bytes_per_rank, 0.0, strict=True)
        self.host_bytes_per_rank = host_bytes_per_rank
        if disk_bytes_per_rank is not None:
            check_number("disk_bytes_per_rank", disk_bytes_per_rank, 0.0, strict=True)
        if not isinstance(auto_tiers, bool):
            raise ValueError(f"auto_tiers: expected a bool, got {auto_tiers!r}")
        self.auto_tiers, self.disk_bytes_per_rank = auto_tiers, disk_bytes_per_rank
        if not isinstance(shard_tiers, bool):
            raise ValueError(f"shard_tiers: expected a bool, got {shard_tiers!r}")
        self.shard_tiers = shard_tiers
        self.file_dir = file_dir
        if reserved_fraction >= 1.0:
            raise ValueError(f"reserved_fraction: expected a number < 1, got {reserved_fraction}")
        check_choice("optimizer", optimizer, OPTIMIZERS)
        check_choice("row_cuts", row_cuts, ("balanced", "equal"))
        check_number("balance_tolerance", balance_tolerance, 0.0)
        if not isinstance(balance_memory, bool):
            raise ValueError(f"balance_memory: expected a bool, got {balance_memory!r}")
        check_number("memory_tolerance", memory_tolerance, 0.0)
        self.world_size = world_size
        self.local_world_size = local_world_size
        self.hbm_bytes_per_rank = hbm_bytes_per_rank
        self.reserved_fraction = reserved_fraction
        self.cost_model = cost_model or CostModel()
        self.optimizer = optimizer
        self.row_cuts = row_cuts
        self.balance_tolerance = balance_tolerance
        self.balance_memory, self.memory_tolerance = balance_memory, memory_tolerance
        self._cap_bytes: float | None = None  # the memory pass's cap while it re-places
        self.progress, self.progress_after_s = progress, progress_after_s
        self._clock = (0.0, 0.0)  # (start of the plan, last progress line)

    @property
    def budget_bytes(self) -> float:
        """Embedding memory per rank: ``hbm_bytes_per_rank x (1 - reserved_fraction)``."""
        return self.hbm_bytes_per_rank * (1.0 - self.reserved_fraction)

    @property
    def _room_bytes(self) -> float:
        """What the search lets a rank hold: the budget, or the memory pass's lower cap."""
        return self.budget_bytes if self._cap_bytes is None else self._cap_bytes

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
        specs = to_table_specs(tables)
        auto = auto_tables(specs, self.auto_tiers)
        if auto:  # storage tiers and cache sizes (tier_choice.py)
            specs = choose_tiers(specs, stats, self.tier_budgets(), auto, self.optimizer,
                                 self.cost_model.batch_size)
        plan = self._sharding_plan(specs, self._plan(specs, constraints, stats))
        small = cache_shortfalls(plan, [t for t in specs if t.name in auto], stats,
                                 self.cost_model.batch_size) if auto else {}
        if small:  # a shard's cache cannot hold a step's rows: larger caches, plan again
            specs = tuple(t if t.name not in small else dataclasses.replace(
                t, storage=dataclasses.replace(t.storage, cache_load_factor=small[t.name]))
                for t in specs)
            try:
                plan = self._sharding_plan(specs, self._plan(specs, constraints, stats))
            except PlanError as e:
                raise PlanError(f"tables {sorted(small)} (tier 'cached'): a shard's cache holds "
                                "fewer than two steps' distinct rows; with the load factors "
                                f"{small} the plan does not fit: {e}") from None
        if self.host_bytes_per_rank is not None:
            problems = host_memory_problems(plan, specs, self.host_bytes_per_rank,
                                            self.optimizer)
            if problems:
                raise PlanError("host memory: " + "; ".join(problems))
        if self.disk_bytes_per_rank is not None:
            problems = disk_problems(plan, specs, self.disk_bytes_per_rank, self.optimizer)
            if problems:
                raise PlanError("disk: " + "; ".join(problems))
        if auto and self.shard_tiers:  # hot shards of cached tables back on device
            plan = self._shard_tier_plan(plan, specs, constraints, stats, auto)
        return plan

    def _shard_tier_plan(self, plan, specs, constraints, stats, auto) -> ShardingPlan:
        """Tiers per shard (``shard_tiers.py``): ``plan`` with its hot shards promoted, or the
        plan made with the least caches and promoted, whichever the cost model finds faster."""
        def step(p: ShardingPlan, s) -> float:
            return max(r.time_s for r in evaluate(p, s, stats, self.cost_model,
                                                  self.optimizer).ranks)

        def promote(p: ShardingPlan, s) -> ShardingPlan:
            return promote_hot_shards(p, s, stats, auto, self.budget_bytes, self.optimizer)

        plan = promote(plan, specs)
        small = smallest_caches(specs, stats, auto, self.world_size, self.cost_model.batch_size)
        if small == tuple(specs):
            return plan
        other = promote(self._sharding_plan(small, self._plan(small, constraints, stats)), small)
        return other if step(other, small) < step(plan, specs) else plan

    def tier_budgets(self) -> TierBudgets:
        """What ``choose_tiers`` may use per rank."""
        return TierBudgets(self.world_size, self.budget_bytes, self.host_bytes_per_rank,
                           self.disk_bytes_per_rank, self.file_dir)

    def _sharding_plan(self, specs: Sequence[TableSpec], draft: _Draft) -> ShardingPlan:
        by_name = {t.name: t for t in specs}
        return ShardingPlan(
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            tables=tuple(_table_sharding(by_name[name], *draft.choices[draft.order.index(name)])
                         for name in (t.name for t in specs)),
        )

    def _plan(self, specs, constraints, stats) -> _Draft:
        """``plan`` without restarting the progress clock, as a draft."""
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
        # plan, MAX_GRID_TABLES deep); every plan seen is a candidate for _choose. A re-plan
        # repeats its parent's choices up to the newly allowed table (same state, same choice)
        candidates, frontier = [best], [best]
        seen: set[frozenset[str]] = set()
        for _ in range(MAX_GRID_TABLES):
            grown = []
            for parent in frontier:
                names = self._bottlenecks(parent, specs, parent.grid)
                for name in names[:GRID_BRANCHES]:
                    if "grid_shard" not in self._allowed_types(cons[name], grid=True):
                        continue
                    wider = parent.grid | {name}
                    if wider in seen:
                        continue
                    seen.add(wider)
                    try:
                        new = self._greedy(specs, cons, stats, wider, parent)
                    except PlanError:
                        continue
                    candidates.append(new)
                    if _quanta(new.step()) < _quanta(parent.step()):
                        grown.append(new)
                    else:
                        new.adds = None  # never extended: keep only its sums
            for draft in frontier:
                draft.adds = None  # no longer extended: keep only its sums
            frontier = grown
        chosen = self._choose([(d, d.times()) for d in candidates])
        return self._no_worse_than_equal_cuts(chosen, specs, cons, stats)

    def _no_worse_than_equal_cuts(
        self,
        draft: _Draft,
        specs: Sequence[TableSpec],
        cons: Mapping[str, TableConstraints],
        stats: Mapping[str, IdDistribution],
    ) -> _Draft:
        """``draft``, or the plan made with equal row blocks if that one's step time is lower
        (skew-aware cuts balance each table as it is placed; greedily, that can leave a plan
        slower than equal blocks, e.g. Criteo at 8 ranks). Only with ``row_cuts="balanced"``."""
        limit = draft.step() * (1.0 + self.memory_tolerance)
        if self.row_cuts == "balanced":
            equal = copy.copy(self)  # the same clock: its progress lines continue ours
            equal.row_cuts = "equal"
            try:
                other = equal._plan(specs, cons, stats)  # memory-balanced too
            except PlanError:  # equal blocks do not fit where balanced cuts do
                other = None
            self._clock = equal._clock  # its last line counts: at most one a second
            if other is not None:
                if _quanta(other.step()) < _quanta(draft.step()):
                    return other
                limit = min(limit, other.step())  # stays no slower than equal row blocks
        if not self.balance_memory:
            return draft
        return balance_memory(self, draft, specs, cons, stats, limit)

    def _choose(self, candidates: Sequence[tuple[Any, np.ndarray]]) -> Any:
        """Of ``(plan, per-rank times)`` pairs, the most balanced plan (max/mean time) among
        those whose step time is within ``balance_tolerance`` of the fastest (ties: the
        faster, then the earlier)."""
        def step(times: np.ndarray) -> int:
            return _quanta(float(times.max()))

        fastest = min(step(t) for _, t in candidates)
        limit = fastest * (1.0 + self.balance_tolerance)
        near = [(plan, t) for plan, t in candidates if step(t) <= limit]
        return min(near, key=lambda pt: (_imbalance(pt[1]), step(pt[1])))[0]

    def _greedy(
        self,
        specs: Sequence[TableSpec],
        cons: Mapping[str, TableConstraints],
        stats: Mapping[str, IdDistribution],
        grid: frozenset[str],
        parent: _Draft | None = None,
    ) -> _Draft:
        """One greedy pass; tables named in ``grid`` may also be grid-sharded. With a
        ``parent`` pass (whose grid set is ``grid`` less some tables) its choices are kept up to
        the first table placed that only this pass may grid-shard."""
        order = self._order(specs)
        draft = _Draft(grid, [t.name for t in order], [], [],
                       CostAccumulator(self.world_size, self.local_world_size, self.cost_model))
        if parent is not None and parent.adds is not None:
            start = min(i for i, name in enumerate(draft.order) if name in grid - parent.grid)
            draft.choices, draft.adds = parent.choices[:start], parent.adds[:start]
            for values in draft.adds:  # the same sums, in the same order, as the parent's
                draft.acc.values += values
        acc = draft.acc
        for i in range(len(draft.choices), len(order)):
            spec = order[i]
            self.note_progress(f"{'equal row blocks' if self.row_cuts == 'equal' else 'skew-aware'}"
                         f"{f', grid {sorted(grid)}' if grid else ''}: table {i + 1}/"
                         f"{len(specs)}")
            dist = stats.get(spec.name, UNIFORM)
            sharding, blocks, add = self._place(spec, cons[spec.name], dist, acc,
                                                spec.name in grid)
            draft.choices.append((sharding, blocks))
            draft.adds.append(add.values)
        return draft

    def note_progress(self, where: str) -> None:
        """A progress line, once the plan has taken ``progress_after_s``, at most once a
        second."""
        if self.progress is None:
            return
        start, last = self._clock
        now = time.monotonic()
        if now - start >= self.progress_after_s and now - last >= 1.0:
            self._clock = (start, now)
            self.progress(f"planning {self.world_size} ranks: {where} ({now - start:.0f} s)")

    def _bottlenecks(
        self, draft: _Draft, specs: Sequence[TableSpec], skip: frozenset[str]
    ) -> list[str]:
        """Tables not in ``skip``, by the time each adds to the plan's slowest rank, most first
        (ties in table order)."""
        slowest = int(np.argmax(draft.times()))
        coef = draft.acc.coefficients
        added = {name: float(coef @ values[:, slowest])
                 for name, values in zip(draft.order, draft.adds or (), strict=True)}
        rest = [t.name for t in specs if t.name not in skip]
        return sorted(rest, key=lambda name: -added[name])

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
        types = _placeable(spec, self._allowed_types(c))
        if not types:
            raise ValueError(
                f"constraints['{spec.name}'].sharding: {list(c.sharding or ())} leaves no usable "
                f"sharding type on {self.num_hosts} host(s) (table_row_wise needs 2 or more; "
                "a table on a tier other than device is never data_parallel)"
            )
        proposer = self._proposer()
        D, n = spec.embedding_dim, len(proposer.candidate_ranks(c))  # no cut of D: bad input
        cuts = {"column_wise": proposer.column_splits(D, c, n),
                "grid_shard": proposer.grid_splits(D, self.num_hosts)}
        if all(t in cuts and not cuts[t] for t in types):
            lo, hi = max(2, c.min_shards or 1), min(c.max_shards or n, n)
            why = {"column_wise": f"column_wise needs a slice count in [{lo}, {hi}] (min_shards .. "
                   f"max_shards, {n} allowed rank(s)) dividing D into slices of >= "
                   f"{MIN_COLUMN_SLICE} columns (or exactly min_shards)",
                   "grid_shard": f"grid_shard one in [2, {self.num_hosts} hosts] of >= "
                   f"{MIN_COLUMN_SLICE} columns"}
            raise ValueError(f"constraints['{spec.name}']: {types} cannot cut D={D}: "
                             + "; ".join(why[t] for t in types))

    def _table_bytes(self, spec: TableSpec, rows: int, cols: int) -> int:
        return block_bytes(spec, rows, cols, self.optimizer)

    def _check_total_memory(self, specs: Sequence[TableSpec]) -> None:
        need = sum(self._table_bytes(t, t.num_embeddings, t.embedding_dim) for t in specs)
        weights = sum(block_bytes(t, t.num_embeddings, t.embedding_dim, "none") for t in specs)
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

    def _proposer(self) -> Proposer:
        """The placements this planner may try, under its current room per rank."""
        return Proposer(world_size=self.world_size, local_world_size=self.local_world_size,
                        optimizer=self.optimizer, row_cuts=self.row_cuts,
                        room_bytes=self._room_bytes)

    def _place(
        self,
        spec: TableSpec,
        c: TableConstraints,
        dist: IdDistribution,
        acc: CostAccumulator,
        grid: bool,
    ) -> tuple[str, Blocks, CostAccumulator]:
        """The best placement of the table given ``acc`` (added to it): its sharding type,
        its blocks and what it adds per rank."""
        best, best_score, failures = None, None, []
        base = acc.time_array()
        proposer = self._proposer()
        for sharding in _placeable(spec, self._allowed_types(c, grid)):
            proposals = list(proposer.proposals(spec, sharding, c, dist, acc))
            if not proposals:
                failures.append(sharding)
            for blocks in proposals:
                add = CostAccumulator(self.world_size, self.local_world_size, self.cost_model)
                add.add_blocks(spec, sharding, blocks, dist, self.optimizer)
                touched = add.memories()
                if ((acc.memories() + touched > self._room_bytes) & (touched > 0)).any():
                    failures.append(sharding)
                    continue
                extra = add.time_array()
                new = np.sort(base + extra)[::-1]
                score = (np.round(new / TIME_QUANTUM).astype(np.int64), float(extra.sum()))
                if best_score is None or _better(score, best_score):
                    best, best_score, best_add = (sharding, blocks), score, add
        if best is None:
            full = self._table_bytes(spec, spec.num_embeddings, spec.embedding_dim)
            reasons = "\n  ".join(dict.fromkeys(
                proposer.why_not(spec, s, c, acc) for s in dict.fromkeys(failures)))
            raise PlanError(
                f"table '{spec.name}' ({spec.num_embeddings} rows x {spec.embedding_dim} x "
                f"{spec.dtype_bytes} B + state = {fmt_bytes(full)}) does not fit in a budget of "
                f"{fmt_bytes(self.budget_bytes)} per rank after the larger tables were placed:\n"
                f"  {reasons}"
            )
        acc.merge(best_add)
        return (*best, best_add)

    def place_under(
        self, spec: TableSpec, c: TableConstraints, dist: IdDistribution, acc: CostAccumulator,
        cap: float,
    ) -> tuple[str, Blocks, CostAccumulator] | None:
        """:meth:`_place` with every rank it touches held to ``cap`` bytes instead of the
        budget, any type (grid_shard too) allowed; None where nothing fits (for the memory
        pass, ``balance.balance_memory``)."""
        self._cap_bytes = cap
        try:
            return self._place(spec, c, dist, acc, True)
        except PlanError:
            return None
        finally:
            self._cap_bytes = None
