"""How one table is cut: the sharding types, ``Shard`` and ``TableSharding``.

The building blocks of a :class:`~fbtriton_dist.planner.plan.ShardingPlan`, with the checks
that need only the table's own shards (ranks in range, the cut matches the sharding type,
every cell covered exactly once). They sit below the table specs, the cost model and the plan,
which all read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fbtriton_dist.storage import Storage

from ._yaml import FieldError, check_choice, check_int, check_name

__all__ = ["SHARDING_TYPES", "Shard", "ShardingType", "TableSharding"]

ShardingType = Literal[
    "row_wise", "table_wise", "column_wise", "table_row_wise", "grid_shard", "data_parallel"
]
SHARDING_TYPES: tuple[str, ...] = ShardingType.__args__  # type: ignore[attr-defined]


@dataclass(kw_only=True, frozen=True)
class Shard:
    """One block of a table on one rank: rows [row_start, row_end), cols [col_start, col_end).

    Ranges are half-open; a shard is never empty.
    """

    rank: int
    """The rank (global, ``0 <= rank < world_size``) that stores this block."""
    row_start: int
    """First row of the block (inclusive)."""
    row_end: int
    """One past the last row of the block."""
    col_start: int
    """First column (embedding dimension) of the block (inclusive)."""
    col_end: int
    """One past the last column of the block."""
    storage: Storage | None = None
    """Where this shard's rows live when not where its table's do (per-shard tiers, e.g. a
    row-wise table's hot block on ``device``, its cold blocks ``cached``); a ``cached`` /
    ``file`` shard has ``Storage.slots(its rows)`` cache slots. None: the table's storage
    (``TableSharding.storage``, else the module's own)."""

    def __post_init__(self) -> None:
        if self.storage is not None and not isinstance(self.storage, Storage):
            raise FieldError("storage", f"expected a Storage or None, got {self.storage!r}")
        check_int("rank", self.rank, 0)
        check_int("row_start", self.row_start, 0)
        check_int("row_end", self.row_end, self.row_start + 1)
        check_int("col_start", self.col_start, 0)
        check_int("col_end", self.col_end, self.col_start + 1)

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def num_cols(self) -> int:
        return self.col_end - self.col_start

    def describe(self) -> str:
        return (
            f"rank {self.rank}: rows {self.row_start}..{self.row_end}, "
            f"cols {self.col_start}..{self.col_end}"
        )


@dataclass(kw_only=True, frozen=True)
class TableSharding:
    """How one table is cut: its sharding type and its shards."""

    name: str
    """Table name, as in ``EmbeddingBagConfig.name``."""
    sharding: ShardingType
    """One of ``SHARDING_TYPES``."""
    num_embeddings: int
    """E, the table's rows (kept in the plan so it can be checked on its own)."""
    embedding_dim: int
    """D, the table's columns."""
    shards: tuple[Shard, ...]
    """The blocks; row-wise kinds in increasing row order, data-parallel one per rank."""
    storage: Storage | None = None
    """Where every shard of the table lives (``fbtriton_dist.storage.Storage``: a tier and,
    for ``cached`` / ``file``, a cache of ``cache_load_factor`` x the shard's rows), unless the
    shard names its own (``Shard.storage``). None: not said by the plan (the module's own
    storage; ``device`` unless it has one)."""

    def __post_init__(self) -> None:
        check_name("name", self.name)
        if self.storage is not None and not isinstance(self.storage, Storage):
            raise FieldError("storage", f"expected a Storage or None, got {self.storage!r}")
        check_choice("sharding", self.sharding, SHARDING_TYPES)
        check_int("num_embeddings", self.num_embeddings, 1)
        check_int("embedding_dim", self.embedding_dim, 1)
        if not isinstance(self.shards, tuple) or not self.shards:
            raise FieldError("shards", f"expected a non-empty tuple of Shard, got {self.shards!r}")

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that hold a shard, in shard order."""
        return tuple(s.rank for s in self.shards)

    @property
    def per_shard_storage(self) -> bool:
        """Some shard names a storage of its own (``Shard.storage``)."""
        return any(s.storage is not None for s in self.shards)

    def shard_storage(self, shard: Shard, default: Storage | None = None) -> Storage | None:
        """Where ``shard`` (one of this table's) lives: its own storage, else the table's,
        else ``default`` (the module's own; None: not said)."""
        if shard.storage is not None:
            return shard.storage
        return self.storage if self.storage is not None else default

    def storage_groups(self, default: Storage | None = None
                       ) -> list[tuple[Storage | None, tuple[int, ...]]]:
        """``(storage, shard indices)`` per distinct storage of the shards
        (``shard_storage``), in order of first appearance."""
        groups: dict[Storage | None, list[int]] = {}
        for i, s in enumerate(self.shards):
            groups.setdefault(self.shard_storage(s, default), []).append(i)
        return [(st, tuple(idx)) for st, idx in groups.items()]

    def row_boundaries(self) -> tuple[int, ...]:
        """Sorted distinct row cuts ``(0, ..., E)``; block k is rows ``[b[k], b[k+1])``.

        For table-wise, column-wise and data-parallel tables this is ``(0, E)``; a grid-shard
        table has one set per column slice (see ``column_slices``).
        """
        return tuple(sorted({0, self.num_embeddings, *(s.row_start for s in self.shards)}))

    def column_slices(self) -> tuple[tuple[int, int, tuple[Shard, ...]], ...]:
        """``(col_start, col_end, shards)`` per distinct column range, in column order; the
        shards of a slice keep their listed (row) order."""
        ranges = sorted({(s.col_start, s.col_end) for s in self.shards})
        return tuple(
            (a, b, tuple(s for s in self.shards if (s.col_start, s.col_end) == (a, b)))
            for a, b in ranges
        )

    def validate(self, world_size: int, local_world_size: int) -> list[str]:
        """Every problem of this table's shards, one message each (empty when valid)."""
        E, D, name = self.num_embeddings, self.embedding_dim, self.name
        where = f"table '{name}' ({self.sharding})"
        problems = []
        for i, s in enumerate(self.shards):
            if s.rank >= world_size:
                problems.append(
                    f"{where}: shards[{i}].rank: expected 0 <= rank < world_size={world_size}, "
                    f"got {s.rank}"
                )
            if s.row_end > E or s.col_end > D:
                problems.append(
                    f"{where}: shards[{i}] ({s.describe()}) is outside the table "
                    f"(rows 0..{E}, cols 0..{D})"
                )
            if (self.sharding == "data_parallel" and s.storage is not None
                    and s.storage.tier != "device"):
                problems.append(
                    f"{where}: shards[{i}] ({s.describe()}).storage: a data-parallel replica "
                    f"lives on 'device', got tier {s.storage.tier!r} (shard the table to put "
                    "a block of it on a tier)")
        if problems:
            return problems
        if self.sharding == "data_parallel":
            return _validate_replicas(self, world_size, where)
        problems += _validate_shape(self, local_world_size, where)
        problems += _validate_exact_cover(self, where)
        return problems


def _validate_replicas(t: TableSharding, world_size: int, where: str) -> list[str]:
    problems = [
        f"{where}: shards[{i}] ({s.describe()}) is not the whole table"
        for i, s in enumerate(t.shards)
        if (s.num_rows, s.num_cols) != (t.num_embeddings, t.embedding_dim)
    ]
    if sorted(t.ranks) != list(range(world_size)):
        problems.append(
            f"{where}: expected one replica on each of ranks 0..{world_size - 1}, "
            f"got ranks {sorted(t.ranks)}"
        )
    return problems


def _validate_shape(t: TableSharding, local_world_size: int, where: str) -> list[str]:
    """The cut must match the sharding type (whole rows, whole columns, one host, ...)."""
    full_cols = all(s.num_cols == t.embedding_dim for s in t.shards)
    full_rows = all(s.num_rows == t.num_embeddings for s in t.shards)
    if t.sharding == "table_wise" and len(t.shards) != 1:
        return [f"{where}: expected exactly 1 shard, got {len(t.shards)}"]
    if t.sharding in ("row_wise", "table_row_wise"):
        if not full_cols:
            return [f"{where}: every shard must span all {t.embedding_dim} columns"]
        starts = [s.row_start for s in t.shards]
        if starts != sorted(starts):
            return [f"{where}: shards must be listed in increasing row order, got starts {starts}"]
        hosts = {s.rank // local_world_size for s in t.shards}
        if t.sharding == "table_row_wise" and len(hosts) != 1:
            return [
                f"{where}: shards must stay on the ranks of one host "
                f"(local_world_size={local_world_size}), got ranks {list(t.ranks)}"
            ]
    if t.sharding == "column_wise" and not full_rows:
        return [f"{where}: every shard must span all {t.num_embeddings} rows"]
    if t.sharding == "grid_shard":
        return _validate_grid(t, local_world_size, where)
    return []


def _validate_grid(t: TableSharding, local_world_size: int, where: str) -> list[str]:
    """Column slices that do not overlap, listed slice by slice in row order, each on one host."""
    slices = t.column_slices()
    for (a, b, _), (c, d, _) in zip(slices, slices[1:], strict=False):
        if c < b:
            return [f"{where}: column slices overlap: cols {a}..{b} and cols {c}..{d}"]
    order = [(s.col_start, s.row_start) for s in t.shards]
    if order != sorted(order):
        return [
            f"{where}: shards must be listed slice by slice (by col_start), each in increasing "
            f"row order, got (col_start, row_start) {order}"
        ]
    for a, b, shards in slices:
        if len({s.rank // local_world_size for s in shards}) != 1:
            return [
                f"{where}: the shards of column slice {a}..{b} must stay on the ranks of one host "
                f"(local_world_size={local_world_size}), got ranks {[s.rank for s in shards]}"
            ]
    return []


def _validate_exact_cover(t: TableSharding, where: str) -> list[str]:
    """No two shards overlap and together they cover all E x D cells (so: exactly once)."""
    problems = []
    shards = t.shards
    for i, j in _overlapping_pairs(shards):
        a, b = shards[i], shards[j]
        problems.append(
            f"{where}: shards[{j}] ({b.describe()}) overlaps shards[{i}] ({a.describe()})"
        )
    if problems:
        return problems
    covered = sum(s.num_rows * s.num_cols for s in shards)
    total = t.num_embeddings * t.embedding_dim
    if covered != total:
        gaps = _row_gaps(t)
        detail = f"; uncovered rows {gaps}" if gaps else ""
        problems.append(
            f"{where}: shards cover {covered} of {t.num_embeddings} x {t.embedding_dim} = "
            f"{total} cells{detail}"
        )
    return problems


def _overlapping_pairs(shards: tuple[Shard, ...]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)``, ``i < j``, of shards that share a cell. A sweep over column
    edges: the shards whose columns overlap a sweep position are checked by rows in row order
    (a plan of 4,096 row shards takes milliseconds, not millions of pair checks)."""
    pairs: set[tuple[int, int]] = set()
    edges = sorted({s.col_start for s in shards})
    for c in edges:  # every overlap contains a cell in the column where one shard starts
        live = sorted((s.row_start, s.row_end, i) for i, s in enumerate(shards)
                      if s.col_start <= c < s.col_end)
        reach: list[tuple[int, int]] = []  # (row_end, index) of the live shards seen so far
        for start, end, i in live:
            reach = [(e, k) for e, k in reach if e > start]
            pairs.update((min(i, k), max(i, k)) for _, k in reach)
            reach.append((end, i))
    return sorted(pairs)


def _row_gaps(t: TableSharding, limit: int = 4) -> str:
    if any(s.num_cols != t.embedding_dim for s in t.shards):
        return ""
    gaps, pos = [], 0
    for s in sorted(t.shards, key=lambda s: s.row_start):
        if s.row_start > pos:
            gaps.append(f"{pos}..{s.row_start}")
        pos = max(pos, s.row_end)
    if pos < t.num_embeddings:
        gaps.append(f"{pos}..{t.num_embeddings}")
    more = f" (+{len(gaps) - limit} more)" if len(gaps) > limit else ""
    return ", ".join(gaps[:limit]) + more
