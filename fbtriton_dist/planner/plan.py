"""``ShardingPlan``: which rank holds which rows and columns of every table, and its YAML form.

The data structure the sharded module consumes, deliberately plain::

    ShardingPlan(world_size=R, local_world_size=H, tables=(TableSharding, ...))
    TableSharding(name, sharding, num_embeddings=E, embedding_dim=D, shards=(Shard, ...))
    Shard(rank, row_start, row_end, col_start, col_end)     # half-open ranges

Row-wise and table-row-wise tables keep their shards in row order, so ``row_boundaries``
is what input dist bucketizes ids with. A grid-shard table is cut into column slices, each
table-row-wise on the ranks of one host (TorchRec's ``grid_shard``); its shards are listed
slice by slice, each slice in row order (``column_slices``). A data-parallel table has one
full shard per rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import yaml

from ._yaml import (
    ConfigError,
    FieldError,
    atomic_write_text,
    build,
    check_choice,
    check_int,
    check_name,
    read_yaml,
)

if TYPE_CHECKING:
    from .tables import TableSpec

__all__ = [
    "SHARDING_TYPES",
    "PlanValidationError",
    "Shard",
    "ShardingPlan",
    "ShardingType",
    "TableSharding",
]

ShardingType = Literal[
    "row_wise", "table_wise", "column_wise", "table_row_wise", "grid_shard", "data_parallel"
]
SHARDING_TYPES: tuple[str, ...] = ShardingType.__args__  # type: ignore[attr-defined]
PLAN_VERSION = 1
GiB = 1024**3


class PlanValidationError(ValueError):
    """A plan that breaks an invariant; ``problems`` lists every one found, one line each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(f"invalid sharding plan ({len(self.problems)} problem(s)):\n  {lines}")


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        check_name("name", self.name)
        check_choice("sharding", self.sharding, SHARDING_TYPES)
        check_int("num_embeddings", self.num_embeddings, 1)
        check_int("embedding_dim", self.embedding_dim, 1)
        if not isinstance(self.shards, tuple) or not self.shards:
            raise FieldError("shards", f"expected a non-empty tuple of Shard, got {self.shards!r}")

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that hold a shard, in shard order."""
        return tuple(s.rank for s in self.shards)

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
    for i in range(len(shards)):
        a = shards[i]
        for j in range(i + 1, len(shards)):
            b = shards[j]
            rows = a.row_start < b.row_end and b.row_start < a.row_end
            cols = a.col_start < b.col_end and b.col_start < a.col_end
            if rows and cols:
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


@dataclass(kw_only=True, frozen=True)
class ShardingPlan:
    """Per table its sharding type and shards, for a job of ``world_size`` ranks."""

    world_size: int
    """R, the number of ranks."""
    local_world_size: int
    """Ranks per host; ranks ``h*H .. h*H+H-1`` form host ``h``. ``R`` must divide by it."""
    tables: tuple[TableSharding, ...]
    """One entry per table, in the order of the table set."""

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_int("local_world_size", self.local_world_size, 1)
        if self.world_size % self.local_world_size:
            raise FieldError(
                "local_world_size",
                f"expected a divisor of world_size={self.world_size}, got {self.local_world_size}",
            )
        names = [t.name for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise FieldError("tables", f"table name(s) {dup} appear more than once")

    # -- queries the sharded module needs -------------------------------------------------
    def table(self, name: str) -> TableSharding:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"table {name!r} is not in the plan; known: {[t.name for t in self.tables]}")

    def shards_for_rank(self, rank: int) -> list[tuple[str, Shard]]:
        """``(table name, shard)`` for every shard stored on ``rank``, in table order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.world_size}, got {rank}")
        return [(t.name, s) for t in self.tables for s in t.shards if s.rank == rank]

    def row_boundaries(self, name: str) -> tuple[int, ...]:
        """Row cuts ``(0, ..., E)`` of table ``name`` (see ``TableSharding.row_boundaries``)."""
        return self.table(name).row_boundaries()

    # -- checks ---------------------------------------------------------------------------
    def validate(
        self,
        tables: Iterable[TableSpec] | None = None,
        *,
        budget_bytes: float | None = None,
        optimizer: str = "rowwise_adagrad",
    ) -> None:
        """Raise :class:`PlanValidationError` listing every problem found.

        Always: ranks in range, shards inside their table, the cut matches the sharding type,
        every cell covered exactly once (one full replica per rank for data-parallel). With
        ``tables``: the plan has exactly these tables with the same E and D. With
        ``budget_bytes`` as well: weights + optimizer state on each rank fit the budget.
        """
        problems = [
            p for t in self.tables for p in t.validate(self.world_size, self.local_world_size)
        ]
        specs = list(tables) if tables is not None else None
        if specs is not None:
            problems += self._match_tables(specs)
        if specs is not None and budget_bytes is not None and not problems:
            from .cost import memory_problems  # late: cost imports this module

            problems += memory_problems(self, specs, budget_bytes, optimizer)
        if problems:
            raise PlanValidationError(problems)

    def _match_tables(self, specs: Sequence[TableSpec]) -> list[str]:
        by_name = {s.name: s for s in specs}
        planned = {t.name for t in self.tables}
        problems = [
            f"table '{t.name}' is not in the table set; known: {sorted(by_name)}"
            for t in self.tables
            if t.name not in by_name
        ]
        problems += [f"table '{n}' has no entry in the plan" for n in by_name if n not in planned]
        for t in self.tables:
            s = by_name.get(t.name)
            if s and (s.num_embeddings, s.embedding_dim) != (t.num_embeddings, t.embedding_dim):
                problems.append(
                    f"table '{t.name}': plan is for {t.num_embeddings} x {t.embedding_dim}, "
                    f"table set says {s.num_embeddings} x {s.embedding_dim}"
                )
        return problems

    # -- YAML -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "tables": [
                {
                    "name": t.name,
                    "sharding": t.sharding,
                    "num_embeddings": t.num_embeddings,
                    "embedding_dim": t.embedding_dim,
                    "shards": [
                        {
                            "rank": s.rank,
                            "rows": [s.row_start, s.row_end],
                            "cols": [s.col_start, s.col_end],
                        }
                        for s in t.shards
                    ],
                }
                for t in self.tables
            ],
        }

    def to_yaml(self, header: str = "") -> str:
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        body = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=100)
        return comment + body

    def save_yaml(self, path: str | os.PathLike[str], header: str = "") -> None:
        """Write the plan atomically (temp file in the same folder, then ``os.replace``)."""
        atomic_write_text(path, self.to_yaml(header))

    @classmethod
    def from_dict(cls, data: Any, where: str = "<plan>") -> ShardingPlan:
        """Build a plan from its YAML mapping; errors name ``where`` and the key path."""

        def tables(value: Any, key: str) -> tuple[TableSharding, ...]:
            items = _list(value, key)
            return tuple(
                build(TableSharding, item, where, f"{key}[{i}]", convert={"shards": shards})
                for i, item in enumerate(items)
            )

        def shards(value: Any, key: str) -> tuple[Shard, ...]:
            return tuple(_shard(item, f"{key}[{i}]") for i, item in enumerate(_list(value, key)))

        def _shard(item: Any, key: str) -> Shard:
            keys = ("rank", "rows", "cols")
            if not isinstance(item, Mapping) or set(item) != set(keys):
                raise FieldError(
                    key, f"expected a mapping with keys [rank, rows, cols], got {item!r}"
                )
            rows, cols = _pair(item["rows"], f"{key}.rows"), _pair(item["cols"], f"{key}.cols")
            try:
                return Shard(
                    rank=item["rank"],
                    row_start=rows[0],
                    row_end=rows[1],
                    col_start=cols[0],
                    col_end=cols[1],
                )
            except FieldError as e:
                field = {"row_start": "rows", "row_end": "rows", "col_start": "cols"}.get(
                    e.field, "cols" if e.field == "col_end" else e.field
                )
                raise FieldError(f"{key}.{field}", e.message) from e

        return build(cls, _without_version(data, where), where, "", convert={"tables": tables})

    @classmethod
    def load_yaml(cls, path: str | os.PathLike[str]) -> ShardingPlan:
        """Read a plan written by :meth:`save_yaml` (or by hand); checks structure, not cover.

        Call :meth:`validate` with the table set to check coverage, names and memory.
        """
        where = os.fspath(path)
        return cls.from_dict(read_yaml(where), where)


def _without_version(data: Any, where: str) -> Any:
    """Check and drop the ``version`` key (it is not a dataclass field)."""
    if isinstance(data, Mapping) and "version" in data:
        if data["version"] != PLAN_VERSION:
            raise ConfigError(where, "version", f"expected {PLAN_VERSION}, got {data['version']!r}")
        return {k: v for k, v in data.items() if k != "version"}
    return data


def _list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list, got {type(value).__name__}")
    return value


def _pair(value: Any, key: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise FieldError(key, f"expected [start, end], got {value!r}")
    return value[0], value[1]
