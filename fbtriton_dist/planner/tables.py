"""Table specs, per-table planner constraints, and the YAML table-set format.

A table set file (``configs/tables/*.yaml``)::

    defaults:                     # optional; merged under every table entry
      embedding_dim: 128
      dtype: fp32
    tables:
      - name: t_cat_0             # TableSpec fields
        num_embeddings: 39884406
        features: [cat_0]
        pooling: sum
        pooling_factors: 3        # one number for all features, a list, or {feature: L}
        optimizer: adam           # optional, else the planner's
        state_dtype: bf16         # optional: its optimizer states' storage (default fp32)
        id_distribution: {kind: zipf, alpha: 1.1}   # optional, else uniform
        sharding: [row_wise, table_row_wise]        # optional constraints (TableConstraints)
        ranks: [0, 1, 2, 3]
        min_shards: 2
        max_shards: 4
        id_manager:               # optional: a managed table (dynamic ids, id_manager.py):
          capacity: 39884405      #   slots; num_embeddings must be capacity + 1
          eviction: lru           #   lru | lfu | ttl (with ttl_steps) | none
          admission: {min_count: 2}

See docs/planner.md for every key.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fbtriton_dist import optim
from fbtriton_dist.id_manager import IdManagerConfig, IdManagerError, config_from_dict
from fbtriton_dist.storage import Storage, storage_of

from ._yaml import (
    ConfigError,
    FieldError,
    build,
    check_choice,
    check_int,
    check_name,
    check_number,
    choices_text,
    expect_list,
    expect_mapping,
    read_yaml,
)
from .shards import SHARDING_TYPES, ShardingType
from .stats import IdDistribution

__all__ = [
    "DTYPE_BYTES",
    "OPTIMIZERS",
    "TableConstraints",
    "TableSet",
    "TableSpec",
    "load_tables",
    "to_table_specs",
]

AUTO_STORAGE = "auto"
"""``storage: auto``: the planner chooses the table's tier (``TableSpec.auto_storage``)."""
DType = Literal["fp32", "fp16", "bf16"]
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
Pooling = Literal["sum", "mean", "none"]
OPTIMIZERS: tuple[str, ...] = ("none", *optim.NAMES)
"""A table's fused optimizer: ``none`` (no state) or a name of ``optim.REGISTRY``."""
Optimizer = str  # one of OPTIMIZERS


@dataclass(kw_only=True, frozen=True)
class TableSpec:
    """What the planner needs to know about one embedding table."""

    name: str
    """Table name, as in ``EmbeddingBagConfig.name``."""
    num_embeddings: int
    """E, rows."""
    embedding_dim: int
    """D, columns."""
    features: tuple[str, ...]
    """Feature names looked up in this table (``EmbeddingBagConfig.feature_names``)."""
    pooling: Pooling = "sum"
    """Bag pooling, ``sum`` or ``mean`` (the same cost), or ``none``: a sequence table (an
    ``EmbeddingConfig``), whose output dist carries one row per id instead of one per bag."""
    dtype: DType = "fp32"
    """Weights dtype: ``fp32``, ``fp16`` or ``bf16``."""
    pooling_factors: tuple[float, ...] = ()
    """L, mean ids per bag, one per feature; empty means 1.0 for every feature."""
    optimizer: Optimizer | None = None
    """Fused optimizer of this table; None takes the planner's ``optimizer``."""
    storage: Storage | None = None
    """Where its shards live (``fbtriton_dist.storage.Storage``; YAML: a mapping of its fields
    or a tier name); None: ``device``. A ``cached`` / ``file`` shard holds a cache of
    ``Storage.slots(its rows)`` rows (+ their optimizer state) in device memory, every row in
    host memory (``cached``) or files (``file``)."""
    auto_storage: bool = False
    """``storage: auto``: the planner chooses the tier and cache (``planner/tier_choice.py``);
    ``storage`` is None until it has."""
    state_dtype: DType = "fp32"
    """Storage of its fused optimizer's states (every state: FBGEMM's
    ``optimizer_state_dtypes``), ``fp32``, ``fp16`` or ``bf16``: the memory model counts 4 or 2
    bytes per state value (``optim.OptimizerSpec.state_bytes``)."""

    def __post_init__(self) -> None:
        check_name("name", self.name)
        check_int("num_embeddings", self.num_embeddings, 1)
        check_int("embedding_dim", self.embedding_dim, 1)
        if not isinstance(self.features, tuple) or not self.features:
            raise FieldError(
                "features", f"expected a non-empty list of names, got {self.features!r}"
            )
        for i, f in enumerate(self.features):
            check_name(f"features[{i}]", f)
        check_choice("pooling", self.pooling, Pooling.__args__)  # type: ignore[attr-defined]
        check_choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        check_choice("state_dtype", self.state_dtype, tuple(optim.STATE_DTYPE_BYTES))
        if self.pooling_factors and len(self.pooling_factors) != len(self.features):
            raise FieldError(
                "pooling_factors",
                f"expected one per feature ({len(self.features)}), got {len(self.pooling_factors)}",
            )
        for i, L in enumerate(self.pooling_factors):
            check_number(f"pooling_factors[{i}]", L, 0.0)
        if self.optimizer is not None:
            check_choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.storage is not None and not isinstance(self.storage, Storage):
            raise FieldError("storage", f"expected a Storage or None, got {self.storage!r}")
        if not isinstance(self.auto_storage, bool):
            raise FieldError("auto_storage", f"expected a bool, got {self.auto_storage!r}")
        if self.auto_storage and self.storage is not None:
            raise FieldError("storage", "expected None with auto_storage (the planner chooses), "
                             f"got {self.storage!r}")

    @property
    def tier(self) -> str:
        """Its storage tier (``device`` without ``storage``)."""
        return self.storage.tier if self.storage is not None else "device"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def ids_per_sample(self) -> float:
        """Sum of L over the table's features: ids one sample looks up in this table."""
        return (
            float(sum(self.pooling_factors)) if self.pooling_factors else float(len(self.features))
        )


@dataclass(kw_only=True, frozen=True)
class TableConstraints:
    """Limits on how the planner may shard one table (all optional)."""

    sharding: tuple[ShardingType, ...] | None = None
    """Allowed sharding types; None lets the planner choose among all of them."""
    ranks: tuple[int, ...] | None = None
    """Ranks the table's shards may go to; None means any rank."""
    min_shards: int | None = None
    """At least this many shards (rows blocks or column slices)."""
    max_shards: int | None = None
    """At most this many shards."""

    def __post_init__(self) -> None:
        if self.sharding is not None:
            if not isinstance(self.sharding, tuple) or not self.sharding:
                raise FieldError("sharding", f"expected a non-empty list, got {self.sharding!r}")
            for i, s in enumerate(self.sharding):
                check_choice(f"sharding[{i}]", s, SHARDING_TYPES)
        if self.ranks is not None:
            if not isinstance(self.ranks, tuple) or not self.ranks:
                raise FieldError("ranks", f"expected a non-empty list of ranks, got {self.ranks!r}")
            for i, r in enumerate(self.ranks):
                check_int(f"ranks[{i}]", r, 0)
            if len(set(self.ranks)) != len(self.ranks):
                raise FieldError("ranks", f"expected distinct ranks, got {list(self.ranks)}")
        for name in ("min_shards", "max_shards"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.min_shards and self.max_shards and self.min_shards > self.max_shards:
            raise FieldError(
                "max_shards", f"expected >= min_shards={self.min_shards}, got {self.max_shards}"
            )


@dataclass(kw_only=True, frozen=True)
class TableSet:
    """A loaded table-set file: specs plus the optional per-table constraints and statistics."""

    tables: tuple[TableSpec, ...]
    """The tables, in file order."""
    constraints: Mapping[str, TableConstraints] = field(default_factory=dict)
    """Per table name, its constraints (only tables that have some)."""
    stats: Mapping[str, IdDistribution] = field(default_factory=dict)
    """Per table name, its id distribution (only tables that have one)."""
    id_managers: Mapping[str, IdManagerConfig] = field(default_factory=dict)
    """Per table name, its id manager (only managed tables): the ``managed=`` argument of
    the collections."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise FieldError("tables", f"table name(s) {dup} appear more than once")
        features = [f for t in self.tables for f in t.features]
        dup = sorted({f for f in features if features.count(f) > 1})
        if dup:
            raise FieldError("tables", f"feature(s) {dup} are looked up in more than one table")


_CONSTRAINT_KEYS = ("sharding", "ranks", "min_shards", "max_shards")
_TABLE_KEYS = (
    "name",
    "num_embeddings",
    "embedding_dim",
    "features",
    "pooling",
    "dtype",
    "pooling_factors",
    "optimizer",
    "storage",
    "state_dtype",
)


def _names(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise FieldError(key, f"expected a name or a list of names, got {value!r}")
    return tuple(value)


def _ints(value: Any, key: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list of integers, got {value!r}")
    return tuple(value)


def _storage(table: Any):
    """The converter of a table entry's ``storage`` (errors name the table)."""

    def convert(value: Any, key: str) -> Storage | None:
        if value is None:
            return None
        try:
            return storage_of(value, str(table))
        except ValueError as e:
            raise FieldError(key, str(e)) from None

    return convert


def load_tables(path: str | os.PathLike[str]) -> TableSet:
    """Read a table-set YAML file (``yaml.safe_load``); errors name the file and key path."""
    where = os.fspath(path)
    return table_set_from_dict(read_yaml(where), where)


def table_set_from_dict(data: Any, where: str = "<tables>") -> TableSet:
    top = expect_mapping(where, "", data)
    unknown = [k for k in top if k not in ("defaults", "tables")]
    if unknown:
        raise ConfigError(where, str(unknown[0]), "unknown key, expected one of [defaults, tables]")
    if "tables" not in top:
        raise ConfigError(where, "", "missing required key [tables]")
    defaults = dict(expect_mapping(where, "defaults", top.get("defaults") or {}))
    items = expect_list(where, "tables", top["tables"])
    if not items:
        raise ConfigError(where, "tables", "expected at least one table")
    valid = (*_TABLE_KEYS, "id_distribution", *_CONSTRAINT_KEYS, "id_manager")
    for k in defaults:
        if k not in valid or k == "name":
            raise ConfigError(
                where, f"defaults.{k}", f"unknown key, expected one of {choices_text(valid[1:])}"
            )
    tables, constraints, stats, managers = [], {}, {}, {}
    for i, raw in enumerate(items):
        key = f"tables[{i}]"
        entry = {**defaults, **expect_mapping(where, key, raw)}
        for k in entry:
            if k not in valid:
                raise ConfigError(
                    where, f"{key}.{k}", f"unknown key, expected one of {choices_text(valid)}"
                )
        spec_part = {k: v for k, v in entry.items() if k in _TABLE_KEYS}
        if spec_part.get("storage") == AUTO_STORAGE:  # the planner chooses (tier_choice.py)
            spec_part["storage"], spec_part["auto_storage"] = None, True
        if isinstance(spec_part.get("pooling_factors"), (Mapping, int, float)):
            spec_part["pooling_factors"] = _per_feature(entry, where, key)
        spec = build(
            TableSpec,
            spec_part,
            where,
            key,
            convert={"features": _names, "pooling_factors": _floats,
                     "storage": _storage(entry.get("name"))},
        )
        tables.append(spec)
        cons_part = {k: v for k, v in entry.items() if k in _CONSTRAINT_KEYS}
        if cons_part:
            constraints[spec.name] = build(
                TableConstraints,
                cons_part,
                where,
                key,
                convert={"sharding": _names, "ranks": _ints},
            )
        if entry.get("id_distribution") is not None:
            stats[spec.name] = build(
                IdDistribution,
                entry["id_distribution"],
                where,
                f"{key}.id_distribution",
                convert={"histogram": _floats},
            )
        if entry.get("id_manager") is not None:
            managers[spec.name] = _id_manager(entry["id_manager"], spec, where, key)
            if spec.tier != "device" or spec.auto_storage:
                raise ConfigError(where, f"{key}.storage",
                                  f"table '{spec.name}' is managed (id_manager): managed tables "
                                  f"live on 'device', got tier "
                                  f"'{'auto' if spec.auto_storage else spec.tier}'")
    try:
        return TableSet(tables=tuple(tables), constraints=constraints, stats=stats,
                        id_managers=managers)
    except FieldError as e:
        raise ConfigError(where, e.field, e.message) from e


def _id_manager(value: Any, spec: TableSpec, where: str, key: str) -> IdManagerConfig:
    """A table's ``id_manager`` mapping; its rows must be the capacity and the default row."""
    try:
        cfg = config_from_dict(value)
    except IdManagerError as e:
        raise ConfigError(
            where, f"{key}.id_manager" + ("" if e.key == "id_manager" else f".{e.key}"),
            f"(table '{spec.name}') {e.message}",
        ) from e
    except TypeError as e:  # a mapping with keys of the wrong kind
        raise ConfigError(where, f"{key}.id_manager", str(e)) from e
    if spec.num_embeddings != cfg.num_embeddings:
        raise ConfigError(
            where, f"{key}.num_embeddings",
            f"table '{spec.name}' is managed: expected capacity + 1 = {cfg.num_embeddings} "
            f"({cfg.capacity} slots and the default row), got {spec.num_embeddings}",
        )
    return cfg


def _floats(value: Any, key: str) -> tuple[float, ...]:
    if isinstance(value, tuple):
        return value
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list of numbers, got {value!r}")
    return tuple(value)


def _per_feature(entry: Mapping[str, Any], where: str, key: str) -> tuple[Any, ...]:
    """``pooling_factors`` given as one number or as ``{feature: L}`` -> one per feature."""
    value = entry["pooling_factors"]
    features = entry.get("features")
    names = [features] if isinstance(features, str) else list(features or [])
    if not isinstance(value, Mapping):
        return tuple(value for _ in names)
    unknown = [f for f in value if f not in names]
    if unknown:
        raise ConfigError(
            where,
            f"{key}.pooling_factors.{unknown[0]}",
            f"not a feature of this table, expected one of {choices_text(names)}",
        )
    return tuple(value.get(f, 1.0) for f in names)


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value)).lower()


def to_table_specs(
    tables: Iterable[Any],
    pooling_factors: Mapping[str, float] | None = None,
) -> tuple[TableSpec, ...]:
    """TableSpecs from TableSpecs or ``torchrec.EmbeddingBagConfig``-like objects.

    Config objects are read by attribute (``name``, ``num_embeddings``, ``embedding_dim``,
    ``feature_names``, ``pooling``, ``data_type``), so torchrec is never imported here; one
    without ``pooling`` (``torchrec.EmbeddingConfig``) is a sequence table (``pooling: none``).
    ``pooling_factors`` maps feature name to L (default 1.0).
    """
    out = []
    for i, t in enumerate(tables):
        if isinstance(t, TableSpec):
            out.append(t)
            continue
        try:
            features = tuple(t.feature_names)
            dtype = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}.get(_enum_name(t.data_type))
            spec = TableSpec(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                features=features,
                # an EmbeddingConfig (a sequence table) has no pooling: one row per id
                pooling=_enum_name(getattr(t, "pooling", "none")),  # type: ignore[arg-type]
                dtype=dtype or _enum_name(t.data_type),  # type: ignore[arg-type]
                pooling_factors=tuple(float((pooling_factors or {}).get(f, 1.0)) for f in features),
            )
        except AttributeError as e:
            raise ValueError(
                f"tables[{i}]: expected a TableSpec or an EmbeddingBagConfig-like object, "
                f"got {type(t).__name__} ({e})"
            ) from e
        except FieldError as e:
            raise ValueError(f"tables[{i}] ('{getattr(t, 'name', '?')}'): {e}") from e
        out.append(spec)
    return tuple(out)


def table_constraints(
    constraints: Mapping[str, TableConstraints] | None, tables: Sequence[TableSpec]
) -> dict[str, TableConstraints]:
    """Check that every constrained table exists; return a dict with one entry per table."""
    names = [t.name for t in tables]
    for name in constraints or {}:
        if name not in names:
            raise ValueError(f"constraints: unknown table {name!r}, expected one of {names}")
    return {n: (constraints or {}).get(n, TableConstraints()) for n in names}
