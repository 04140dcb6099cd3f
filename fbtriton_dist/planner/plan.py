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

``Shard`` and ``TableSharding`` (with their own checks) live in ``shards.py``; this module adds
the whole-plan checks, the budget check (``memory_problems``) and the YAML form.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from fbtriton_dist.storage import Storage, storage_dict, storage_of

from ._yaml import (
    SAFE_DUMPER,
    ConfigError,
    FieldError,
    atomic_write_text,
    build,
    check_int,
    read_yaml,
)
from .memory import (
    as_planned,
    block_bytes,
    fmt_bytes,
    host_block_bytes,
    shard_equation,
    shard_spec,
)
from .shards import Shard, TableSharding
from .tables import TableSpec

__all__ = ["PlanValidationError", "ShardingPlan", "check_group_size", "check_replica_sync",
           "dmp_refusal", "host_memory_problems", "memory_problems"]

PLAN_VERSION = 1


def check_group_size(world_size: int, local_world_size: int, group_size: int) -> None:
    """Raise :class:`FieldError` unless ``group_size`` is an integer in [1, world_size] that
    divides ``world_size`` and either divides ``local_world_size`` or is a multiple of it (a
    group is whole hosts, or lies inside one)."""
    check_int("group_size", group_size, 1)
    if group_size > world_size or world_size % group_size:
        raise FieldError("group_size", f"expected a divisor of world_size={world_size} "
                                       f"(1 <= group_size <= {world_size}), got {group_size}")
    if group_size % local_world_size and local_world_size % group_size:
        raise FieldError("group_size", f"expected a multiple or a divisor of local_world_size="
                                       f"{local_world_size} (whole hosts, or inside one), got "
                                       f"{group_size}")


def check_replica_sync(value: Any) -> None:
    """Raise :class:`FieldError` unless ``value`` is ``"step"`` or an integer N >= 1."""
    if value == "step":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FieldError("replica_sync", f"expected 'step' or an integer >= 1 (every N steps), "
                                         f"got {value!r}")


class PlanValidationError(ValueError):
    """A plan that breaks an invariant; ``problems`` lists every one found, one line each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n  ".join(self.problems)
        super().__init__(f"invalid sharding plan ({len(self.problems)} problem(s)):\n  {lines}")


@dataclass(kw_only=True, frozen=True)
class ShardingPlan:
    """Per table its sharding type and shards, for a job of ``world_size`` ranks."""

    world_size: int
    """R, the number of ranks."""
    local_world_size: int
    """Ranks per host; ranks ``h*H .. h*H+H-1`` form host ``h``. ``R`` must divide by it."""
    tables: tuple[TableSharding, ...]
    """One entry per table, in the order of the table set."""
    group_size: int | None = None
    """S, ranks per replica group (2D parallel, ``groups.py``): the world splits into R/S
    groups of S consecutive ranks, the shards are those of one group (ranks ``0 .. S-1``, a
    plan for S ranks; rank r holds the shards of local rank ``r % S``) and each group runs them
    on its own share of the batch. None (older plans): flat, the same as S = R."""
    replica_sync: str | int = "step"
    """How the R/S replicas of a shard stay equal: ``step`` (their row gradients exchanged
    before every update) or N (weights and optimizer state averaged every N steps)."""

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_int("local_world_size", self.local_world_size, 1)
        if self.world_size % self.local_world_size:
            raise FieldError(
                "local_world_size",
                f"expected a divisor of world_size={self.world_size}, got {self.local_world_size}",
            )
        if self.group_size is not None:
            check_group_size(self.world_size, self.local_world_size, self.group_size)
        check_replica_sync(self.replica_sync)
        names = [t.name for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise FieldError("tables", f"table name(s) {dup} appear more than once")

    # -- replica groups -------------------------------------------------------------------
    @property
    def group_world(self) -> int:
        """S, the ranks of one group (R for a flat plan): the shards' ranks are below it."""
        return self.world_size if self.group_size is None else self.group_size

    @property
    def num_groups(self) -> int:
        """R / S, the replicas of every shard."""
        return self.world_size // self.group_world

    @property
    def group_local_world_size(self) -> int:
        """Ranks per host inside one group (a group smaller than a host sits in one)."""
        return min(self.local_world_size, self.group_world)

    def group_plan(self) -> ShardingPlan:
        """The flat plan of one group: these tables on S ranks (itself when flat)."""
        if self.group_world == self.world_size:
            return self
        return ShardingPlan(world_size=self.group_world,
                            local_world_size=self.group_local_world_size, tables=self.tables)

    # -- queries the sharded module needs -------------------------------------------------
    def table(self, name: str) -> TableSharding:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"table {name!r} is not in the plan; known: {[t.name for t in self.tables]}")

    def shards_for_rank(self, rank: int) -> list[tuple[str, Shard]]:
        """``(table name, shard)`` for every shard stored on ``rank``, in table order (a
        grouped plan: the shards of its local rank ``rank % group_size``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < {self.world_size}, got {rank}")
        local = rank % self.group_world
        return [(t.name, s) for t in self.tables for s in t.shards if s.rank == local]

    def subset(self, names: Iterable[str]) -> ShardingPlan:
        """The plan of tables ``names`` only (one collection of a model the plan covers);
        raises KeyError naming a table the plan lacks."""
        wanted = list(names)
        by_name = {t.name: t for t in self.tables}
        missing = [n for n in wanted if n not in by_name]
        if missing:
            raise KeyError(f"tables {missing} are not in the plan; known: {list(by_name)}")
        return dataclasses.replace(self, tables=tuple(by_name[n] for n in wanted))

    def with_shard_storage(
        self, storage: Mapping[str, Mapping[int, Storage | Mapping | str | None]]
    ) -> ShardingPlan:
        """This plan with per-shard storage: ``{table: {shard index: storage}}`` (a
        ``Storage``, a mapping of its fields, a tier name; None: the table's again). Errors
        name the table, the shard and the bound."""
        known = {t.name: t for t in self.tables}
        unknown = sorted(set(storage) - set(known))
        if unknown:
            raise ValueError(f"storage: unknown table(s) {unknown}; the plan holds "
                             f"{list(known)}")
        tables = []
        for t in self.tables:
            given = dict(storage.get(t.name, {}))
            shards = list(t.shards)
            for i, value in given.items():
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(shards):
                    raise ValueError(f"table '{t.name}' storage: expected a shard index 0 <= i "
                                     f"< {len(shards)}, got {i!r}")
                try:
                    st = None if value is None else storage_of(value, t.name)
                except ValueError as e:
                    detail = str(e).removeprefix(f"table '{t.name}' ")
                    raise ValueError(f"table '{t.name}' shard {i} ({shards[i].describe()}): "
                                     f"{detail}") from None
                shards[i] = dataclasses.replace(shards[i], storage=st)
            tables.append(dataclasses.replace(t, shards=tuple(shards)) if given else t)
        return dataclasses.replace(self, tables=tuple(tables))

    def get_plan_for_module(self, module_path: str) -> None:
        """Refused with a ``ValueError`` that says why: TorchRec's
        ``DistributedModelParallel`` (and ``sharding.dmp.DMPCollection``) call this method of
        the plan they are given, which must be TorchRec's ``ShardingPlan``. Its
        ``ParameterSharding`` has one ``compute_kernel`` per table, so a tier per shard
        (``Shard.storage``) has no place in it and would become one tier; the message names
        every such shard. ``fbtriton_dist.shard(model, plan)`` takes this plan."""
        raise ValueError(dmp_refusal(self))

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
        host_budget_bytes: float | None = None,
    ) -> None:
        """Raise :class:`PlanValidationError` listing every problem found.

        Always: ranks in range, shards inside their table, the cut matches the sharding type,
        every cell covered exactly once (one full replica per rank for data-parallel). With
        ``tables``: the plan has exactly these tables with the same E and D. With
        ``budget_bytes`` as well: weights + optimizer state on each rank fit the budget
        (a ``cached`` / ``file`` table's shards: their caches; a ``cached`` one's slot map,
        on the device). With ``host_budget_bytes``: the backing stores of ``host`` /
        ``cached`` tables and the slot maps of ``file`` tables on each rank fit it.
        """
        problems = [
            p for t in self.tables
            for p in t.validate(self.group_world, self.group_local_world_size)
        ]
        specs = as_planned(list(tables), self.tables) if tables is not None else None
        if specs is not None:
            problems += self._match_tables(specs)
        if specs is not None and budget_bytes is not None and not problems:
            problems += memory_problems(self, specs, budget_bytes, optimizer)
        if specs is not None and host_budget_bytes is not None and not problems:
            problems += host_memory_problems(self, specs, host_budget_bytes, optimizer)
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
            **self._group_dict(),
            "tables": [
                {
                    "name": t.name,
                    "sharding": t.sharding,
                    "num_embeddings": t.num_embeddings,
                    "embedding_dim": t.embedding_dim,
                    **({"storage": storage_dict(t.storage)} if t.storage is not None else {}),
                    "shards": [
                        {
                            "rank": s.rank,
                            "rows": [s.row_start, s.row_end],
                            "cols": [s.col_start, s.col_end],
                            **({"storage": storage_dict(s.storage)}
                               if s.storage is not None else {}),
                        }
                        for s in t.shards
                    ],
                }
                for t in self.tables
            ],
        }

    def _group_dict(self) -> dict[str, Any]:
        """``group_size`` and ``replica_sync``, written only for a plan that has a group size
        (a flat plan's YAML stays as older versions wrote it)."""
        if self.group_size is None:
            return {}
        return {"group_size": self.group_size, "replica_sync": self.replica_sync}

    def to_yaml(self, header: str = "") -> str:
        """The plan as YAML: what ``yaml.safe_dump(self.to_dict(), sort_keys=False,
        default_flow_style=None)`` writes, line by line (PyYAML's representer takes seconds
        for the 30,000 shards of a 4,096-rank plan; a test keeps the two equal)."""
        lines = [f"# {line}" for line in header.splitlines()]
        lines += [f"version: {PLAN_VERSION}", f"world_size: {self.world_size}",
                  f"local_world_size: {self.local_world_size}"]
        lines += [f"{k}: {v}" for k, v in self._group_dict().items()]
        lines.append("tables:" if self.tables else "tables: []")
        for t in self.tables:
            lines += [f"- name: {_yaml_scalar(t.name)}", f"  sharding: {t.sharding}",
                      f"  num_embeddings: {t.num_embeddings}",
                      f"  embedding_dim: {t.embedding_dim}"]
            if t.storage is not None:
                lines.append(f"  storage: {_storage_flow(t.storage)}")
            lines.append("  shards:")
            for sh in t.shards:
                lines += [f"  - rank: {sh.rank}", f"    rows: [{sh.row_start}, {sh.row_end}]",
                          f"    cols: [{sh.col_start}, {sh.col_end}]"]
                if sh.storage is not None:
                    lines.append(f"    storage: {_storage_flow(sh.storage)}")
        return "\n".join(lines) + "\n"

    def save_yaml(self, path: str | os.PathLike[str], header: str = "") -> None:
        """Write the plan atomically (temp file in the same folder, then ``os.replace``)."""
        atomic_write_text(path, self.to_yaml(header))

    @classmethod
    def from_dict(cls, data: Any, where: str = "<plan>") -> ShardingPlan:
        """Build a plan from its YAML mapping; errors name ``where`` and the key path."""

        def tables(value: Any, key: str) -> tuple[TableSharding, ...]:
            items = _list(value, key)
            return tuple(
                build(TableSharding, item, where, f"{key}[{i}]",
                      convert={"shards": shards(item), "storage": _storage(item)})
                for i, item in enumerate(items)
            )

        def _storage(item: Any):
            name = item.get("name") if isinstance(item, Mapping) else None

            def convert(value: Any, key: str) -> Storage | None:
                if value is None:
                    return None
                try:
                    return storage_of(value, str(name))
                except ValueError as e:
                    raise FieldError(key, str(e)) from None

            return convert

        def shards(table: Any):
            name = table.get("name") if isinstance(table, Mapping) else None

            def convert(value: Any, key: str) -> tuple[Shard, ...]:
                return tuple(_shard(item, f"{key}[{i}]", str(name), i)
                             for i, item in enumerate(_list(value, key)))

            return convert

        def _shard(item: Any, key: str, name: str, index: int) -> Shard:
            keys = ("rank", "rows", "cols")
            if (not isinstance(item, Mapping) or not set(keys) <= set(item)
                    or set(item) - {*keys, "storage"}):
                raise FieldError(
                    key, f"expected a mapping with keys [rank, rows, cols] and optionally "
                         f"storage, got {item!r}"
                )
            rows, cols = _pair(item["rows"], f"{key}.rows"), _pair(item["cols"], f"{key}.cols")
            try:
                shard = Shard(
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
            if item.get("storage") is None:
                return shard
            try:
                storage = storage_of(item["storage"], name)
            except ValueError as e:
                detail = str(e).removeprefix(f"table '{name}' ")
                raise FieldError(f"{key}.storage", f"table '{name}' shard {index} "
                                                   f"({shard.describe()}): {detail}") from None
            return dataclasses.replace(shard, storage=storage)

        return build(cls, _without_version(data, where), where, "", convert={"tables": tables})

    @classmethod
    def load_yaml(cls, path: str | os.PathLike[str]) -> ShardingPlan:
        """Read a plan written by :meth:`save_yaml` (or by hand); checks structure, not cover.

        Call :meth:`validate` with the table set to check coverage, names and memory.
        """
        where = os.fspath(path)
        return cls.from_dict(read_yaml(where), where)


def _storage_flow(storage: Storage) -> str:
    """``storage_dict(storage)`` as a YAML flow mapping (one line)."""
    return yaml.dump(storage_dict(storage), Dumper=SAFE_DUMPER, sort_keys=False,
                     default_flow_style=True, width=10**6).strip()


def _yaml_scalar(value: str) -> str:
    """``value`` as YAML writes it in a block mapping (quoted only where YAML needs it)."""
    text = yaml.dump(value, Dumper=SAFE_DUMPER, width=100)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def memory_problems(
    plan: ShardingPlan, tables: Sequence[TableSpec], budget_bytes: float, optimizer: str
) -> list[str]:
    """One message per rank whose weights + optimizer state exceed ``budget_bytes``, naming
    the rank's largest shard with its equation (tables without their own optimizer use
    ``optimizer``)."""
    by_name = {t.name: t for t in tables}
    problems = []
    per_rank: dict[int, list[tuple[str, Shard]]] = {}
    for t in plan.tables:  # one pass (shards_for_rank per rank is R x shards)
        for s in t.shards:
            per_rank.setdefault(s.rank, []).append((t.name, s))
    for rank in range(plan.world_size):
        shards = per_rank.get(rank, [])
        sizes = [
            block_bytes(shard_spec(by_name[name], sh), sh.num_rows, sh.num_cols, optimizer)
            for name, sh in shards
        ]
        need = sum(sizes)
        if need <= budget_bytes:
            continue
        i = max(range(len(shards)), key=sizes.__getitem__)
        (name, big), rest = shards[i], need - sizes[i]
        others = f" + {fmt_bytes(rest)} of {len(shards) - 1} other shard(s)" if rest else ""
        problems.append(
            f"rank {rank} needs {fmt_bytes(need)}, budget {fmt_bytes(budget_bytes)}: "
            f"table '{name}' {shard_equation(shard_spec(by_name[name], big), big, optimizer)}"
            f"{others}"
        )
    return problems


def host_memory_problems(
    plan: ShardingPlan, tables: Sequence[TableSpec], budget_bytes: float, optimizer: str
) -> list[str]:
    """One message per rank whose host memory (every row and optimizer state of its ``host``
    / ``cached`` shards, the slot maps of its ``file`` shards:
    ``memory.host_block_bytes``) exceeds ``budget_bytes``."""
    by_name = {t.name: t for t in tables}
    need: dict[int, list[tuple[int, str]]] = {}
    for t in plan.tables:
        spec = by_name.get(t.name)
        if spec is None or (spec.tier == "device" and not t.per_shard_storage):
            continue
        for s in t.shards:
            n = host_block_bytes(shard_spec(spec, s), s.num_rows, s.num_cols, optimizer)
            if not n:
                continue
            need.setdefault(s.rank, []).append((n, f"'{t.name}' rows {s.row_start}..{s.row_end}"
                                                   f" x {s.num_cols} cols {fmt_bytes(n)}"))
    return [f"rank {r} needs {fmt_bytes(sum(n for n, _ in items))} of host memory, budget "
            f"{fmt_bytes(budget_bytes)}: " + " + ".join(text for _, text in items)
            for r, items in sorted(need.items()) if sum(n for n, _ in items) > budget_bytes]


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


def dmp_refusal(plan: ShardingPlan) -> str:
    """Why ``plan`` (ours) cannot be TorchRec's ``DistributedModelParallel``'s plan; with
    per-shard tiers, each shard that names its own (``docs/storage.md``, "Tiers per shard")."""
    text = ("DistributedModelParallel's plan: expected TorchRec's ShardingPlan (one "
            "ParameterSharding per table, one compute kernel: one storage tier for all its "
            "shards), got fbtriton_dist's ShardingPlan; shard the model with "
            "fbtriton_dist.shard(model, plan), which takes it")
    own = []
    for t in plan.tables:
        table_tier = repr(t.storage.tier) if t.storage is not None else "the module's own"
        own += [f"table '{t.name}' shard {i} ({s.describe()}) on '{s.storage.tier}' (its "
                f"table on {table_tier})"
                for i, s in enumerate(t.shards) if s.storage is not None]
    if own:
        text += (" and builds every shard on its own tier; TorchRec's plan cannot carry the "
                 f"tiers per shard of {'; '.join(own)}")
    return text
