"""Where one table may go: the placements each sharding type proposes for it, given the load
earlier tables already put on every rank, and why a type has none.

``ShardingPlanner`` asks a :class:`Proposer` (its ranks, optimizer, row-cut policy and the
memory each rank may hold) for every allowed sharding type and scores what comes back:

* data_parallel: a replica on every rank;
* table_wise: the whole table on one of the ``TW_CANDIDATE_RANKS`` least-loaded ranks with room;
* column_wise: k equal slices of >= ``MIN_COLUMN_SLICE`` columns on the k least-loaded ranks;
* row_wise / table_row_wise: the rows cut over groups of the least-loaded ranks (whole hosts'
  worth, doubling; or one of the ``TWRW_CANDIDATE_HOSTS`` least-loaded hosts), skew-aware
  (:func:`stats.balanced_cuts`) or in equal blocks, whichever leaves the lower largest load;
* grid_shard: n column slices, each cut by rows over one of the n least-loaded hosts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .cost import TIME_QUANTUM, UNIFORM, Blocks, CostAccumulator
from .memory import block_bytes, fmt_bytes
from .stats import IdDistribution, balanced_cuts, cdf_array, equal_cuts
from .tables import TableConstraints, TableSpec

__all__ = ["MIN_COLUMN_SLICE", "Proposer", "RowCuts"]

RowCuts = Literal["balanced", "equal"]
MIN_COLUMN_SLICE = 32
"""Column-wise slices are at least this wide (narrower slices waste the TBE kernel's lanes)."""
TW_CANDIDATE_RANKS = 4
"""Table-wise tries this many of the least-loaded ranks that have room."""
TWRW_CANDIDATE_HOSTS = 4
"""Table-row-wise tries this many hosts: those whose ranks are the least loaded."""


def _row_cut_blocks(group: Sequence[int] | np.ndarray, cuts: Sequence[int], c0: int,
                    c1: int) -> Blocks:
    """Row block j ``[cuts[j], cuts[j+1])`` on ``group[j]``, empty blocks left out."""
    starts, ends = np.asarray(cuts[:-1], dtype=np.int64), np.asarray(cuts[1:], dtype=np.int64)
    keep = ends > starts
    return Blocks.make(np.asarray(group, dtype=np.int64)[keep], starts[keep], ends[keep], c0, c1)


@dataclass(frozen=True, kw_only=True)
class Proposer:
    """The placements a planner's search may try for one table (see the module docstring)."""

    world_size: int
    """R, the number of ranks."""
    local_world_size: int
    """Ranks per host."""
    optimizer: str
    """The fused optimizer whose state counts in a table's bytes."""
    row_cuts: RowCuts
    """``balanced`` (skew-aware) or ``equal`` row blocks."""
    room_bytes: float
    """What a rank may hold: the budget, or the memory pass's lower cap."""

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def table_bytes(self, spec: TableSpec, rows: int, cols: int) -> int:
        """Bytes of ``rows`` x ``cols`` of the table, optimizer state included."""
        return block_bytes(spec, rows, cols, self.optimizer)

    def candidate_ranks(self, c: TableConstraints) -> list[int]:
        return list(c.ranks) if c.ranks is not None else list(range(self.world_size))

    def _by_load(self, c: TableConstraints, acc: CostAccumulator) -> np.ndarray:
        """The table's allowed ranks, least loaded first (time, then memory, then rank)."""
        allowed = (np.asarray(c.ranks, dtype=np.int64) if c.ranks is not None
                   else np.arange(self.world_size))
        times, mem = acc.time_array()[allowed], acc.memories()[allowed]
        return allowed[np.lexsort((allowed, mem, times))]

    def proposals(
        self,
        spec: TableSpec,
        sharding: str,
        c: TableConstraints,
        dist: IdDistribution,
        acc: CostAccumulator,
    ) -> Iterator[Blocks]:
        """The placements ``sharding`` offers for the table, given the load already in ``acc``."""
        by_load = self._by_load(c, acc)
        lo, hi = c.min_shards or 1, c.max_shards or self.world_size
        if sharding == "data_parallel":
            cuts = self._replicas(spec, len(by_load))
        elif sharding == "table_wise":
            cuts = self._whole_tables(spec, lo, by_load, acc)
        elif sharding == "column_wise":
            cuts = self._column_slices(spec, c, len(by_load), by_load, acc)
        elif sharding == "grid_shard":
            cuts = self._grid(spec, by_load, lo, hi, dist, acc)
        else:
            cuts = self._row_blocks(spec, sharding, by_load, lo, hi, dist, acc)
        yield from cuts

    def _replicas(self, spec: TableSpec, num_ranks: int) -> Iterator[Blocks]:
        """Data-parallel: a full replica on every rank (never pinned to some ranks)."""
        E, D = spec.num_embeddings, spec.embedding_dim
        if num_ranks == self.world_size:
            yield Blocks.make(np.arange(self.world_size), 0, E, 0, D)

    def _whole_tables(
        self, spec: TableSpec, lo: int, by_load: np.ndarray, acc: CostAccumulator
    ) -> Iterator[Blocks]:
        """Table-wise: the whole table on one of the ``TW_CANDIDATE_RANKS`` least-loaded ranks
        that have room."""
        E, D = spec.num_embeddings, spec.embedding_dim
        if lo <= 1:
            fits = self._with_room(by_load, acc, self.table_bytes(spec, E, D))
            for r in fits[:TW_CANDIDATE_RANKS]:
                yield Blocks.make(r, 0, E, 0, D)

    def _column_slices(
        self,
        spec: TableSpec,
        c: TableConstraints,
        num_ranks: int,
        by_load: np.ndarray,
        acc: CostAccumulator,
    ) -> Iterator[Blocks]:
        """Column-wise: for each allowed slice count k, k equal slices on the k least-loaded
        ranks that have room for one (in rank order)."""
        E, D = spec.num_embeddings, spec.embedding_dim
        for k in self.column_splits(D, c, num_ranks):
            w = D // k
            fits = self._with_room(by_load, acc, self.table_bytes(spec, E, w))
            if len(fits) >= k:
                starts = np.arange(k) * w
                yield Blocks.make(np.sort(fits[:k]), 0, E, starts, starts + w)

    def _row_blocks(
        self,
        spec: TableSpec,
        sharding: str,
        by_load: np.ndarray,
        lo: int,
        hi: int,
        dist: IdDistribution,
        acc: CostAccumulator,
    ) -> Iterator[Blocks]:
        """Row-wise and table-row-wise: the rows cut over each candidate group of ranks
        (``_row_groups``), a rank left without rows holding no shard."""
        D = spec.embedding_dim
        # more members than rows leaves some without a block: never more than E
        hi = min(hi, max(lo, spec.num_embeddings))
        for group in self._row_groups(sharding, by_load, lo, hi):
            cuts = self._cut(spec, sharding, group, dist, acc)
            if cuts is not None:
                yield _row_cut_blocks(group, cuts, 0, D)

    def _with_room(self, by_load: np.ndarray, acc: CostAccumulator, need: float) -> np.ndarray:
        """The ranks of ``by_load`` (in its order) with ``need`` bytes of budget free."""
        return by_load[acc.memories()[by_load] + need <= self.room_bytes]

    def column_splits(self, D: int, c: TableConstraints, num_ranks: int) -> list[int]:
        """Slice counts k >= 2 that cut D into equal slices of >= MIN_COLUMN_SLICE columns
        (narrower only when the table's ``min_shards`` asks for it), within the constraints."""
        lo, hi = max(2, c.min_shards or 1), min(c.max_shards or num_ranks, num_ranks)
        return [
            k
            for k in range(lo, hi + 1)
            if D % k == 0 and (D // k >= MIN_COLUMN_SLICE or k == c.min_shards)
        ]

    def grid_splits(self, D: int, num_hosts: int) -> list[int]:
        """Column slice counts n in 2..hosts that cut D into equal slices >= MIN_COLUMN_SLICE."""
        return [n for n in range(2, num_hosts + 1) if D % n == 0 and D // n >= MIN_COLUMN_SLICE]

    def _grid(
        self,
        spec: TableSpec,
        by_load: np.ndarray,
        lo: int,
        hi: int,
        dist: IdDistribution,
        acc: CostAccumulator,
    ) -> Iterator[Blocks]:
        """Grid-shard placements: for each slice count n, slice i of D/n columns is cut by rows
        (balanced) over the allowed ranks of the i-th least-loaded host (at most hi/n each)."""
        D, H = spec.embedding_dim, self.local_world_size
        hosts: dict[int, list[int]] = {}
        times = acc.times()
        for r in by_load.tolist():
            hosts.setdefault(r // H, []).append(r)
        order = sorted(
            hosts, key=lambda h: (max(times[r] for r in hosts[h]), times[hosts[h][0]], h)
        )
        for n in self.grid_splits(D, len(order)):
            per_host, w = min(H, hi // n), D // n
            groups = [sorted(hosts[h][:per_host]) for h in order[:n]]
            if per_host < 1 or sum(len(g) for g in groups) < lo:
                continue
            work, parts = acc.copy(), []
            for i, group in enumerate(groups):
                cols = (i * w, (i + 1) * w)
                cuts = self._cut(spec, "grid_shard", group, dist, work, cols)
                if cuts is None:
                    break
                part = _row_cut_blocks(group, cuts, *cols)
                work.add_blocks(spec, "grid_shard", part, dist, self.optimizer)
                parts.append(part)
            else:
                yield Blocks.join(parts)

    def _row_groups(
        self, sharding: str, by_load: np.ndarray, lo: int, hi: int
    ) -> Iterator[np.ndarray]:
        """Rank groups a row-wise kind may use: the least loaded k allowed ranks for k = H, 2H,
        4H, ... up to all of them (at most ``hi``), or for table_row_wise each host's ranks."""
        if sharding == "row_wise":
            # all allowed ranks, or fewer (whole hosts' worth, doubling): fewer holders trade
            # lookup spreading for less output-dist traffic, which grows with the holders
            n = len(by_load)
            sizes = {min(hi, n)}
            k = self.local_world_size
            while k < min(hi, n):
                sizes.add(k)
                k *= 2
            for k in sorted(sizes):
                if k >= lo:
                    yield np.sort(by_load[:k])
            return
        # each host's ``hi`` least loaded allowed ranks; the TWRW_CANDIDATE_HOSTS hosts whose
        # such ranks are least loaded (the latest of them in the load order comes first)
        order = by_load
        host = order // self.local_world_size
        idx = np.argsort(host, kind="stable")  # by host, each host's ranks in load order
        hs = host[idx]
        first = np.flatnonzero(np.r_[True, hs[1:] != hs[:-1]])
        count = np.diff(np.r_[first, len(hs)])
        taken = np.minimum(count, hi)
        last = idx[first + taken - 1]  # load position of each host's last chosen rank
        usable = np.flatnonzero(taken >= max(lo, 1))
        best = usable[np.lexsort((hs[first[usable]], last[usable]))][:TWRW_CANDIDATE_HOSTS]
        for h in best.tolist():
            yield np.sort(order[idx[first[h]:first[h] + taken[h]]])

    def _cut(
        self,
        spec: TableSpec,
        sharding: str,
        group: np.ndarray | list[int],
        dist: IdDistribution,
        acc: CostAccumulator,
        cols: tuple[int, int] | None = None,
    ) -> list[int] | None:
        """Row cuts of the table (or of its column slice ``cols``) over ``group``: the
        skew-aware cut or equal blocks, whichever leaves the lower largest load on the group
        (so never worse than equal blocks, table by table)."""
        E, D = spec.num_embeddings, spec.embedding_dim
        c0, c1 = cols or (0, D)
        members = np.asarray(group, dtype=np.int64)
        caps = self._row_caps(spec, members, acc, c1 - c0)
        equal = self._equal_cut(spec, len(group), caps)
        if self.row_cuts == "equal":
            return equal
        # every rank's load before this table, plus the pooled slices it will receive
        probe = acc.copy()
        probe.add_blocks(spec, sharding, Blocks.make(members, 0, E, c0, c1), UNIFORM,
                         self.optimizer)
        # probe gave each holder the full table's share (p=1); undo that linear part per rank
        k = len(group)
        t0 = acc.terms_time(acc.row_holder_terms(spec, 0.0, k, sharding, c1 - c0))
        t1 = acc.terms_time(acc.row_holder_terms(spec, 1.0, k, sharding, c1 - c0))
        base = probe.time_array()[members] - t1 + t0  # a holder's load with no lookups
        slope = np.full(k, t1 - t0)
        cuts = balanced_cuts(E, dist, base, slope, caps)
        if cuts is None or equal is None:
            return cuts if cuts is not None else equal

        def largest(c: list[int]) -> int:
            ends = np.asarray(c, dtype=np.int64)
            share = cdf_array(dist, E, ends[1:]) - cdf_array(dist, E, ends[:-1])
            return round(float((base + slope * share).max()) / TIME_QUANTUM)

        return equal if largest(equal) < largest(cuts) else cuts

    def _row_caps(self, spec: TableSpec, members: np.ndarray, acc: CostAccumulator,
                  cols: int) -> np.ndarray:
        """Rows of ``cols`` columns each rank of ``members`` still has memory for."""
        per_row = self.table_bytes(spec, 1, cols)
        free = self.room_bytes - acc.memories()[members]
        st = spec.storage
        if st is not None and st.tier == "host":  # nothing on the device
            return np.full(len(members), spec.num_embeddings, dtype=np.int64)
        if st is not None and st.cached:  # a cache of a share of the rows (or of N slots)
            m = st.device_map_bytes(1, 0)  # a 'cached' slot map on the device: per row
            slot = per_row - m  # one slot (row + state, + its bookkeeping on the device)
            if st.cache_slots is not None:
                left = free - st.cache_slots * slot
                rows = np.floor(np.maximum(0, left) / m) if m else spec.num_embeddings
                return np.where(left >= 0, np.minimum(rows, spec.num_embeddings),
                                0).astype(np.int64)
            f = st.cache_load_factor
            if m:  # r rows cost ceil(f x r) slots + r map entries <= (f r + 1) slot + r m
                return np.floor(np.maximum(0, free - slot) / (f * slot + m)).astype(np.int64)
            # r rows take ceil(f x r) slots: at most floor(free / row) of them
            slots = np.maximum(0, free // per_row)
            return np.floor(slots / f).astype(np.int64)
        return np.maximum(0, free // per_row).astype(np.int64)

    def _equal_cut(self, spec: TableSpec, k: int, caps: np.ndarray) -> list[int] | None:
        """Equal row blocks over ``k`` ranks (TorchRec's cut), or None where one does not fit
        the ranks' ``caps`` (rows)."""
        cuts = equal_cuts(spec.num_embeddings, k)
        return cuts if (np.diff(cuts) <= caps).all() else None

    def why_not(
        self, spec: TableSpec, sharding: str, c: TableConstraints, acc: CostAccumulator
    ) -> str:
        """One line: why ``sharding`` cannot hold this table, with the numbers."""
        E, D = spec.num_embeddings, spec.embedding_dim
        ranks = self.candidate_ranks(c)
        mem = acc.memories().tolist()
        free = {r: max(0.0, self.room_bytes - mem[r]) for r in ranks}
        most = max(free, key=lambda r: free[r])
        full = self.table_bytes(spec, E, D)
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
            splits = self.column_splits(D, c, len(ranks))
            if not splits:
                return (
                    f"column_wise: no slice count in [{max(2, c.min_shards or 1)}, "
                    f"{min(c.max_shards or len(ranks), len(ranks))}] cuts D={D} into equal "
                    f"slices of >= {MIN_COLUMN_SLICE} columns"
                )
            k = max(splits)
            slice_bytes = self.table_bytes(spec, E, max(1, D // k))
            return (
                f"column_wise: {k} slices of {E} rows x {D // k} cols need "
                f"{fmt_bytes(slice_bytes)} each, most free is {fmt_bytes(free[most])} (rank {most})"
            )
        per_row = self.table_bytes(spec, 1, D)
        H = self.local_world_size
        host_free = max(
            sum(v for r, v in free.items() if r // H == h) for h in range(self.num_hosts)
        )
        if sharding == "grid_shard":
            splits = self.grid_splits(D, self.num_hosts)
            if not splits:
                return (
                    f"grid_shard: no slice count in [2, {self.num_hosts} hosts] cuts D={D} into "
                    f"equal slices of >= {MIN_COLUMN_SLICE} columns"
                )
            n = max(splits)
            slice_bytes = self.table_bytes(spec, E, D // n)
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
