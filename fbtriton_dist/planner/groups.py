"""Replica groups (2D parallel): the cost of a grouped plan and the choice of its group size.

The world of R ranks splits into G = R/S groups of S consecutive ranks. Every group holds all
the tables, sharded over its S ranks by one plan for S ranks (``ShardingPlan.group_size``),
runs the input and output dists among its own ranks only, on its own share of the global batch
(B per rank, as flat), and so pays what a flat plan on S ranks pays. What grouping adds, per
rank and step (symbols of ``cost.py``; ``c`` a shard's columns, ``rows`` its rows, s the
weight bytes, i the id bytes):

* **replica sync**, the G replicas of each shard (the same local rank in every group) kept
  equal, for every non-data-parallel shard (``step``) or every shard (N: a data-parallel
  table's copies are averaged too):

  - ``replica_sync: step``: before each update the replicas exchange the shard's row
    gradients, fp32 (``SYNC_VALUE_BYTES``): a sparse all-gather, (G-1)·U·(c·4 + i) received,
    U the rows one group's step touches in the shard, or, where that is more, a ring
    all-reduce of the dense gradient, 2·(G-1)/G·rows·c·4. U is the expected number of
    distinct rows among the group's n = S·B·L ids of the table that fall in the shard,
    sum over its rows r of 1 - (1 - P(r))^n, P from the table's ``IdDistribution`` (the law
    the rest of the model uses): exact on the first ``EXACT_ROWS`` rows, beyond that over
    buckets of rows growing by ``BUCKET_RATIO`` (the mean P of a bucket, where P varies by
    1 %);
  - ``replica_sync: N``: every N steps a ring all-reduce of the shard's weights and optimizer
    state, 2·(G-1)/G·(rows·(c·v + w) + state) received, amortised: divided by N; v and w
    the bytes per value and per row of ``CostModel.replica_sync_dtype`` (fp32: 4 and 0, the
    weights all-reduced as fp32 whatever their dtype; int8 1 and 8, fp8 1 and 4: a
    reduce-scatter and an all-gather of the rows in the format, the same 2·(G-1)/G of them),
    the state fp32.

  Collectives ``replica_sync.sparse_all_gather``, ``replica_sync.all_reduce`` and
  ``replica_sync.average``. Replicas are S ranks apart: on other hosts when a group is whole
  hosts (S >= H), else (G - H/S) of the G-1 others are (that share of the bytes is
  inter-host);
* **data-parallel tables** with ``step`` still all-gather every rank's gradient rows over the
  whole world: the group plan's (S-1)·B·F·D·4 becomes (R-1)·B·F·D·4
  (``data_parallel.grad_all_gather``); with N, inside the group only (the group plan's).

Time: the group plan's time plus these bytes at the intra- and inter-host bandwidths. A flat
plan (S = R) costs exactly what ``cost.evaluate`` says. Not modelled: the HBM work of
applying the other replicas' gradients, the sync overlapping anything, tiers (a cached
table's sync counts all its rows).

``propose_group_size`` plans the candidate S (powers of two from ``MIN_AUTO_GROUP`` up to R
that divide R, and R; those ``hot_row_bound`` rules out are skipped) and returns the one with
the lowest estimated step that fits.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cost import REPLICA_GRAD_BYTES, UNIFORM, WIRE_FORMATS, CostModel, PlanCost, evaluate
from .memory import table_state_bytes
from .plan import ShardingPlan, check_group_size, check_replica_sync
from .planner import PlanError, ShardingPlanner
from .stats import IdDistribution, cdf_array
from .tables import TableConstraints, TableSpec, to_table_specs

__all__ = ["GroupCandidate", "GroupProposal", "GroupedCost", "ShardSync", "evaluate_grouped",
           "expected_unique_rows", "format_candidates", "format_grouped", "group_planner",
           "group_size_candidates", "hot_row_bound", "parse_group_size", "parse_replica_sync",
           "plan_grouped", "propose_group_size", "replica_syncs", "sync_inter_share"]

SYNC_VALUE_BYTES = 4
"""Bytes per gradient value of the ``step`` sync (fp32: every replica takes the same update)."""
EXACT_ROWS = 1024
"""Rows whose distinct-row odds ``expected_unique_rows`` sums one by one."""
BUCKET_RATIO = 1.01
"""Beyond ``EXACT_ROWS``, rows are summed in buckets each this much longer than the last."""
MIN_AUTO_GROUP = 8
"""The smallest group size ``auto`` proposes (one host of 8)."""
SYNC_KINDS = ("replica_sync.sparse_all_gather", "replica_sync.all_reduce",
              "replica_sync.average")


def parse_replica_sync(text: Any) -> str | int:
    """``step`` or an integer N >= 1 (also as text, ``"4"``); anything else a ValueError."""
    if isinstance(text, str) and text != "step":
        try:
            text = int(text)
        except ValueError:
            pass
    try:
        check_replica_sync(text)
    except ValueError as e:
        raise ValueError(str(e)) from None
    return text


def parse_group_size(text: Any) -> int | str:
    """``auto`` or an integer >= 1 (also as text)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except (TypeError, ValueError):
        value = None
    if value is None or value < 1 or (isinstance(text, float) and text != value):
        raise ValueError(f"group_size: expected 'auto' or an integer >= 1, got {text!r}")
    return value


def group_size_candidates(world_size: int, local_world_size: int) -> list[int]:
    """What ``auto`` tries: powers of two from ``MIN_AUTO_GROUP`` up to R that divide R and
    are whole hosts or inside one, and R itself (flat)."""
    out, s = [], MIN_AUTO_GROUP
    while s < world_size:
        if world_size % s == 0 and (s % local_world_size == 0 or local_world_size % s == 0):
            out.append(s)
        s *= 2
    return [*out, world_size]


def expected_unique_rows(dist: IdDistribution, num_rows: int, draws: float,
                         starts: Sequence[int] | np.ndarray,
                         ends: Sequence[int] | np.ndarray) -> np.ndarray:
    """Expected distinct rows in each ``[starts[j], ends[j])`` among ``draws`` independent
    ids of a table of ``num_rows`` rows drawn from ``dist``: sum over the rows of
    1 - (1 - P(r))^draws (module docstring: exact on ``EXACT_ROWS`` rows, then buckets)."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if draws <= 0:
        return np.zeros(starts.shape)
    E = num_rows
    if dist.kind == "uniform":
        return (ends - starts) * -np.expm1(draws * np.log1p(-1.0 / E)) if E > 1 else \
            (ends - starts).astype(np.float64)
    k = math.ceil(math.log(max(E / EXACT_ROWS, 1.0)) / math.log(BUCKET_RATIO)) + 1
    parts = [np.arange(min(E, EXACT_ROWS) + 1),
             np.round(EXACT_ROWS * BUCKET_RATIO ** np.arange(k)), starts, ends, [E]]
    if dist.kind == "histogram" and len(dist.histogram) <= 1 << 16:
        parts.append(np.round(np.arange(len(dist.histogram) + 1) * (E / len(dist.histogram))))
    edges = np.unique(np.clip(np.concatenate(parts), 0, E).astype(np.int64))
    mass = np.diff(cdf_array(dist, E, edges))
    count = np.diff(edges).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.clip(mass / count, 0.0, 1.0)
        touched = count * -np.expm1(draws * np.log1p(-p))
    touched = np.where(p >= 1.0, count, np.nan_to_num(touched))
    cum = np.concatenate([[0.0], np.cumsum(touched)])
    return cum[np.searchsorted(edges, ends)] - cum[np.searchsorted(edges, starts)]


@dataclass(frozen=True)
class ShardSync:
    """The replica sync of one shard, on its local rank, per step."""

    table: str
    rank: int
    """Local rank (in ``0 .. S-1``; every group's rank ``g*S + rank`` receives the same)."""
    row_start: int
    row_end: int
    cols: int
    collective: str
    """One of ``SYNC_KINDS``."""
    unique_rows: float
    """Expected distinct rows of the shard one group's step touches (``step``; else 0)."""
    row_bytes: float
    """Bytes of one synced row of the sparse all-gather: c·4 + i."""
    bytes: float
    """Bytes this rank receives per step (amortised over N for ``average``)."""


def sync_inter_share(S: int, G: int, H: int) -> float:
    """Share of a shard's G-1 other replicas on other hosts."""
    if G <= 1:
        return 0.0
    return 1.0 if S >= H else (G - H // S) / (G - 1)


def replica_syncs(plan: ShardingPlan, tables: Sequence[TableSpec],
                  stats: Mapping[str, IdDistribution] | None = None,
                  model: CostModel | None = None,
                  optimizer: str = "rowwise_adagrad") -> list[ShardSync]:
    """One :class:`ShardSync` per shard of a grouped plan (``step``: but data-parallel
    ones; none when flat)."""
    G, S = plan.num_groups, plan.group_world
    if G == 1:
        return []
    m = model or CostModel()
    by_name = {t.name: t for t in tables}
    ring = 2.0 * (G - 1) / G
    v, w = WIRE_FORMATS[m.replica_sync_dtype]  # the weights' bytes per value, per row
    out = []
    for ts in plan.tables:
        if ts.sharding == "data_parallel" and plan.replica_sync == "step":
            continue  # every replica takes the world's gradients (data_parallel_world_bytes)
        spec = by_name[ts.name]
        draws = S * m.batch_size * spec.ids_per_sample
        starts = [sh.row_start for sh in ts.shards]
        ends = [sh.row_end for sh in ts.shards]
        unique = (expected_unique_rows((stats or {}).get(ts.name, UNIFORM), spec.num_embeddings,
                                       draws, starts, ends)
                  if plan.replica_sync == "step" else np.zeros(len(starts)))
        for sh, u in zip(ts.shards, unique.tolist(), strict=True):
            rows, c = sh.num_rows, sh.num_cols
            row_bytes = c * SYNC_VALUE_BYTES + float(m.id_bytes(rows))
            if plan.replica_sync == "step":
                sparse, dense = (G - 1) * u * row_bytes, ring * rows * c * SYNC_VALUE_BYTES
                kind, nbytes = ((SYNC_KINDS[0], sparse) if sparse <= dense
                                else (SYNC_KINDS[1], dense))
            else:
                kind, u = SYNC_KINDS[2], 0.0
                held = rows * (c * v + w) + table_state_bytes(spec, rows, c, optimizer)
                nbytes = ring * held / plan.replica_sync
            out.append(ShardSync(table=ts.name, rank=sh.rank, row_start=sh.row_start,
                                 row_end=sh.row_end, cols=c, collective=kind, unique_rows=u,
                                 row_bytes=row_bytes, bytes=float(nbytes)))
    return out


def data_parallel_world_bytes(plan: ShardingPlan, tables: Sequence[TableSpec],
                              batch_size: int) -> float:
    """What a grouped plan's data-parallel tables add on every rank to the group plan's
    gradient all-gather: with ``step``, the other groups' R-S ranks' fp32 gradient rows
    (with N each group gathers its own, and the copies are averaged: ``replica_syncs``)."""
    if plan.replica_sync != "step":
        return 0.0
    extra = plan.world_size - plan.group_world
    by_name = {t.name: t for t in tables}
    total = 0.0
    for ts in plan.tables:
        if ts.sharding == "data_parallel":
            spec = by_name[ts.name]
            per_sample = (spec.ids_per_sample if spec.pooling == "none"
                          else float(len(spec.features)))
            total += extra * batch_size * per_sample * spec.embedding_dim * REPLICA_GRAD_BYTES
    return total


@dataclass(frozen=True)
class GroupedCost:
    """The cost of a (grouped or flat) plan per local rank of a group: every group's rank
    ``g*S + q`` costs what local rank q costs."""

    world_size: int
    group_size: int
    local_world_size: int
    replica_sync: str | int
    group: PlanCost
    """The group plan's terms per local rank (``cost.evaluate`` on S ranks; data-parallel
    tables' all-gather over the whole world), without the replica sync."""
    sync_bytes: tuple[float, ...]
    """Replica sync bytes received per step, per local rank."""
    sync_inter_host_bytes: tuple[float, ...]
    """The part of them that crosses hosts."""
    time_s: tuple[float, ...]
    """Estimated embedding seconds per step of each local rank, the sync included."""
    collectives: Mapping[str, tuple[float, ...]]
    """Bytes received per collective per local rank (the group plan's and the sync's)."""
    syncs: tuple[ShardSync, ...]

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    @property
    def step_s(self) -> float:
        """The slowest rank's estimated time."""
        return max(self.time_s)

    def comm_bytes(self) -> np.ndarray:
        """[S] bytes each local rank receives per step: input + output dist + replica sync."""
        return np.array([r.comm_bytes for r in self.group.ranks]) + np.array(self.sync_bytes)

    def as_plan_cost(self) -> PlanCost:
        """A :class:`PlanCost` over the S local ranks with the sync folded into
        ``output_dist_bytes`` and ``inter_host_bytes`` and ``time_s`` the whole step (what the
        simulation compares, collective by collective)."""
        ranks = tuple(dataclasses.replace(
            r, output_dist_bytes=r.output_dist_bytes + self.sync_bytes[q],
            inter_host_bytes=r.inter_host_bytes + self.sync_inter_host_bytes[q],
            time_s=self.time_s[q]) for q, r in enumerate(self.group.ranks))
        return PlanCost(ranks=ranks, collectives=self.collectives)


def evaluate_grouped(plan: ShardingPlan, tables: Iterable[Any],
                     stats: Mapping[str, IdDistribution] | None = None,
                     model: CostModel | None = None,
                     optimizer: str = "rowwise_adagrad") -> GroupedCost:
    """The per-rank cost of a grouped plan (module docstring); a flat plan's is
    ``cost.evaluate``'s, unchanged."""
    specs = to_table_specs(tables)
    m = dataclasses.replace(model or CostModel(), held_byte_seconds=0.0,  # the sync: below
                            held_weight_byte_seconds=None)
    R, S, H = plan.world_size, plan.group_world, plan.local_world_size
    G = plan.num_groups
    gcost = evaluate(plan.group_plan(), specs, stats, m, optimizer, collectives=True)
    ledger = {k: np.array(v) for k, v in gcost.collectives.items()}
    ranks = list(gcost.ranks)
    dp = data_parallel_world_bytes(plan, specs, m.batch_size)
    inv_intra, inv_inter = 1.0 / m.intra_host_bandwidth, 1.0 / m.inter_host_bandwidth
    if dp:
        same_host = max(H - S, 0)  # other groups' ranks on a rank's own host
        dp_far = dp * (R - S - same_host) / (R - S)
        ranks = [dataclasses.replace(
            r, output_dist_bytes=r.output_dist_bytes + dp,
            inter_host_bytes=r.inter_host_bytes + dp_far,
            time_s=r.time_s + (dp - dp_far) * inv_intra + dp_far * inv_inter) for r in ranks]
        ledger["data_parallel.grad_all_gather"] = (
            ledger.get("data_parallel.grad_all_gather", np.zeros(S)) + dp)
    syncs = replica_syncs(plan, specs, stats, m, optimizer)
    sync = np.zeros(S)
    for s in syncs:
        sync[s.rank] += s.bytes
        ledger.setdefault(s.collective, np.zeros(S))[s.rank] += s.bytes
    far = sync * sync_inter_share(S, G, H)
    times = np.array([r.time_s for r in ranks]) + (sync - far) * inv_intra + far * inv_inter
    return GroupedCost(world_size=R, group_size=S, local_world_size=H,
                       replica_sync=plan.replica_sync, group=PlanCost(ranks=tuple(ranks)),
                       sync_bytes=tuple(sync.tolist()), sync_inter_host_bytes=tuple(far.tolist()),
                       time_s=tuple(times.tolist()),
                       collectives={k: tuple(v.tolist()) for k, v in sorted(ledger.items())},
                       syncs=tuple(syncs))


# -- planning -----------------------------------------------------------------------------
def group_planner(planner: ShardingPlanner, group_size: int, replica_sync: str | int = "step",
                  balance_memory: bool | None = None) -> ShardingPlanner:
    """A planner with ``planner``'s settings for one group of ``group_size`` ranks of
    ``planner.world_size``. With ``replica_sync`` N its cost model charges every byte a rank
    holds the amortised all-reduce of the average (``CostModel.held_byte_seconds``; a weight
    byte scaled by ``replica_sync_dtype``'s bytes per value over fp32's, its row scales left
    out), so the search balances the sync with the rest; the ``step`` sync is not seen by the
    search."""
    S, H = group_size, planner.local_world_size
    G = planner.world_size // S
    m = planner.cost_model
    if replica_sync != "step" and G > 1:
        far = sync_inter_share(S, G, H)
        per_byte = 2.0 * (G - 1) / G / replica_sync
        per_s = per_byte * (far / m.inter_host_bandwidth + (1.0 - far) / m.intra_host_bandwidth)
        m = dataclasses.replace(m, held_byte_seconds=per_s, held_weight_byte_seconds=per_s * (
            WIRE_FORMATS[m.replica_sync_dtype][0] / WIRE_FORMATS["fp32"][0]))
    return ShardingPlanner(
        world_size=S, local_world_size=min(H, S),
        hbm_bytes_per_rank=planner.hbm_bytes_per_rank,
        reserved_fraction=planner.reserved_fraction, cost_model=m,
        optimizer=planner.optimizer, row_cuts=planner.row_cuts,
        balance_tolerance=planner.balance_tolerance,
        balance_memory=planner.balance_memory if balance_memory is None else balance_memory,
        memory_tolerance=planner.memory_tolerance, progress=planner.progress,
        progress_after_s=planner.progress_after_s,
        host_bytes_per_rank=planner.host_bytes_per_rank, auto_tiers=planner.auto_tiers,
        disk_bytes_per_rank=planner.disk_bytes_per_rank, file_dir=planner.file_dir)


def plan_grouped(planner: ShardingPlanner, tables: Iterable[Any],
                 constraints: Mapping[str, TableConstraints] | None = None,
                 stats: Mapping[str, IdDistribution] | None = None, *, group_size: int,
                 replica_sync: str | int = "step",
                 balance_memory: bool | None = None) -> ShardingPlan:
    """A grouped plan of ``planner.world_size`` ranks: ``tables`` planned for ``group_size``
    ranks (raises :class:`PlanError` when they do not fit a group)."""
    check_group_size(planner.world_size, planner.local_world_size, group_size)
    check_replica_sync(replica_sync)
    plan = group_planner(planner, group_size, replica_sync, balance_memory).plan(
        tables, constraints, stats)
    return dataclasses.replace(plan, world_size=planner.world_size,
                               local_world_size=planner.local_world_size,
                               group_size=group_size, replica_sync=replica_sync)


def hot_row_bound(tables: Sequence[TableSpec], stats: Mapping[str, IdDistribution] | None,
                  model: CostModel, group_size: int, local_world_size: int) -> float:
    """A lower bound on the step of any plan of ``tables`` on ``group_size`` ranks, without
    planning: whichever rank holds a table's row 0 (one row is never split) receives at least
    its share of the other ranks' ids of the table, (S-1)·B·L·P(0)·i, at the cost model's
    bandwidths (the largest over the tables)."""
    S, H = group_size, min(local_world_size, group_size)
    if S <= 1:
        return 0.0
    far = (S - H) / (S - 1)
    per_byte = (1.0 - far) / model.intra_host_bandwidth + far / model.inter_host_bandwidth
    i = float(np.min(model.id_bytes(np.array([1]))))
    best = 0.0
    for t in tables:
        p0 = float(cdf_array((stats or {}).get(t.name, UNIFORM), t.num_embeddings,
                             np.array([1]))[0])
        best = max(best, (S - 1) * model.batch_size * t.ids_per_sample * p0 * i * per_byte)
    return best


@dataclass(frozen=True)
class GroupCandidate:
    """One group size ``auto`` tried."""

    group_size: int
    step_s: float | None
    """Estimated step (None: the tables do not fit S ranks)."""
    max_comm_bytes: float
    mean_comm_bytes: float
    max_sync_bytes: float
    seconds: float
    """Wall seconds its plan took."""
    reason: str = ""
    """Why it does not fit (the planner's message), or why it was not planned (its
    ``hot_row_bound`` is above a step already found)."""


@dataclass(frozen=True)
class GroupProposal:
    """``propose_group_size``'s answer: the chosen plan, its cost and every candidate."""

    group_size: int
    plan: ShardingPlan
    cost: GroupedCost
    candidates: tuple[GroupCandidate, ...]


def propose_group_size(planner: ShardingPlanner, tables: Iterable[Any],
                       constraints: Mapping[str, TableConstraints] | None = None,
                       stats: Mapping[str, IdDistribution] | None = None, *,
                       replica_sync: str | int = "step",
                       candidates: Sequence[int] | None = None,
                       prune: bool = True) -> GroupProposal:
    """Plan ``tables`` for every candidate group size (default ``group_size_candidates``)
    and return the one with the lowest estimated step among those that fit (ties: the larger
    group). Candidates are planned without the memory pass, smallest first; with ``prune``,
    one whose ``hot_row_bound`` is above the best step found so far is not planned (it cannot
    win). The chosen size is planned again with ``planner``'s own setting. Raises
    :class:`PlanError` when no candidate fits, ValueError for a candidate that does not
    divide R."""
    check_replica_sync(replica_sync)
    R, H = planner.world_size, planner.local_world_size
    sizes = list(candidates) if candidates is not None else group_size_candidates(R, H)
    if not sizes:
        raise ValueError("candidates: expected at least one group size, got none")
    for s in sizes:
        check_group_size(R, H, s)
    specs = to_table_specs(tables)
    tried: list[GroupCandidate] = []
    for S in sorted(sizes):
        start = time.perf_counter()
        steps = [c.step_s for c in tried if c.step_s is not None]
        bound = hot_row_bound(specs, stats, planner.cost_model, S, H) if prune else 0.0
        if steps and bound > min(steps):
            tried.append(GroupCandidate(S, None, 0.0, 0.0, 0.0, time.perf_counter() - start,
                                        f"not planned: its hottest row's ids alone take "
                                        f"{bound * 1e3:.3f} ms"))
            continue
        try:
            plan = plan_grouped(planner, specs, constraints, stats, group_size=S,
                                replica_sync=replica_sync, balance_memory=False)
        except PlanError as e:
            tried.append(GroupCandidate(S, None, 0.0, 0.0, 0.0, time.perf_counter() - start,
                                        str(e).splitlines()[0]))
            continue
        cost = evaluate_grouped(plan, specs, stats, planner.cost_model, planner.optimizer)
        comm = cost.comm_bytes()
        tried.append(GroupCandidate(S, cost.step_s, float(comm.max()), float(comm.mean()),
                                    max(cost.sync_bytes), time.perf_counter() - start))
    fits = [c for c in tried if c.step_s is not None]
    if not fits:  # (nothing is pruned before a candidate fits)
        why = "; ".join(f"S={c.group_size}: {c.reason}" for c in tried)
        raise PlanError(f"no group size in {sizes} fits: {why}")
    best = min(fits, key=lambda c: (c.step_s, -c.group_size))
    plan = plan_grouped(planner, specs, constraints, stats, group_size=best.group_size,
                        replica_sync=replica_sync)
    cost = evaluate_grouped(plan, specs, stats, planner.cost_model, planner.optimizer)
    return GroupProposal(best.group_size, plan, cost, tuple(tried))


# -- text ---------------------------------------------------------------------------------
def _sync_text(replica_sync: str | int) -> str:
    return ("every step (row gradients)" if replica_sync == "step"
            else f"every {replica_sync} steps (weights + state averaged)")


def format_grouped(cost: GroupedCost) -> str:
    """The lines a grouped plan adds to the report: groups, sync, comm and step."""
    comm, sync = cost.comm_bytes(), np.array(cost.sync_bytes)
    t = np.array(cost.time_s)
    q = int(t.argmax())
    lines = [f"groups: {cost.num_groups} x {cost.group_size} ranks; replica sync "
             f"{_sync_text(cost.replica_sync)}"]
    kinds = {k: v for k, v in cost.collectives.items() if k.startswith("replica_sync.")}
    if kinds:
        lines.append("replica sync MB/rank (max / mean): " + ", ".join(
            f"{k.split('.', 1)[1]} {max(v) / 1e6:,.2f} / {np.mean(v) / 1e6:,.2f}"
            for k, v in kinds.items()))
    lines.append(f"comm per rank per step (in + out + sync) max {comm.max() / 1e6:,.2f} MB, "
                 f"mean {comm.mean() / 1e6:,.2f} MB (sync max {sync.max() / 1e6:,.2f} MB)")
    lines.append(f"step estimate with the sync {cost.step_s * 1e3:.3f} ms (local rank {q}; "
                 f"in the group alone {cost.group.ranks[q].time_s * 1e3:.3f} ms)")
    return "\n".join(lines)


def format_candidates(proposal: GroupProposal) -> str:
    """One line per group size tried, the chosen one marked."""
    lines = ["group size candidates (each planned without the memory pass):",
             f"{'S':>6} {'groups':>7} {'step ms':>9} {'max MB/rank':>12} {'mean MB/rank':>13} "
             f"{'sync MB':>9} {'plan s':>7}"]
    R = proposal.plan.world_size
    for c in proposal.candidates:
        mark = "  <- chosen" if c.group_size == proposal.group_size else ""
        if c.step_s is None:
            why = c.reason if c.reason.startswith("not planned") else f"does not fit: {c.reason}"
            lines.append(f"{c.group_size:>6} {R // c.group_size:>7}  {why}")
            continue
        lines.append(f"{c.group_size:>6} {R // c.group_size:>7} {c.step_s * 1e3:>9.3f} "
                     f"{c.max_comm_bytes / 1e6:>12,.2f} {c.mean_comm_bytes / 1e6:>13,.2f} "
                     f"{c.max_sync_bytes / 1e6:>9,.2f} {c.seconds:>7.2f}{mark}")
    return "\n".join(lines)
