"""Managed tables (dynamic ids): the per-table id manager's config, torch-free.

A managed table takes raw int64 ids of any value (no fixed vocabulary) and maps each to a slot
of its ``capacity`` rows, without collisions while the live ids fit; when it is full, the
eviction policy frees slots for new ids. The table has ``capacity + 1`` rows: the last one,
row ``capacity``, is the shared *default row* of every id that has no slot (not yet admitted,
or nothing could be evicted for it). Declared in Python::

    managed = {"t_user": IdManagerConfig(capacity=1_000_000, eviction="lru",
                                         admission=Admission(min_count=2))}
    ebc = EmbeddingBagCollection(tables, managed=managed)  # t_user: 1_000_001 rows

or in a table set's YAML (``planner/tables.py``)::

    tables:
      - name: t_user
        num_embeddings: 1000001
        id_manager: {capacity: 1000000, eviction: ttl, ttl_steps: 500, admission: {min_count: 2}}

The remap itself (its batched semantics, tie-breaks) is specified by ``reference/id_remap.py``.
The planner and the job config read this module, so it never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "EVICTIONS",
    "Admission",
    "IdManagerConfig",
    "IdManagerError",
    "config_from_dict",
    "managed_configs",
]

Eviction = Literal["lru", "lfu", "ttl", "none"]
EVICTIONS: tuple[str, ...] = ("lru", "lfu", "ttl", "none")
"""``lru``: the slot used longest ago; ``lfu``: the slot used least often (ties: longest ago);
``ttl``: slots not used for ``ttl_steps`` steps are freed, nothing else is evicted; ``none``:
a full table refuses new ids (a ValueError naming the table)."""
POLICY_CODE: dict[str, int] = {"none": 0, "lru": 1, "lfu": 2, "ttl": 3}
"""What the remap implementations receive."""


class IdManagerError(ValueError):
    """A bad value of one key of an id manager's config (``key`` is its path)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


def _check_int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise IdManagerError(key, f"expected an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise IdManagerError(key, f"expected an integer >= {minimum}, got {value}")


@dataclass(kw_only=True, frozen=True)
class Admission:
    """Which new ids get a slot: an id not in the table is admitted once it has been seen
    ``min_count`` times (this batch's occurrences included); before that it reads the default
    row and takes no slot. Occurrences of ids without a slot are counted in a count-min
    sketch (``sketch_depth`` rows of ``sketch_width`` counters): a count is never too low and
    only too high where ids share every counter, so an id is at worst admitted early."""

    min_count: int = 1
    """Occurrences before an id gets a slot; 1 admits every new id at once."""
    sketch_width: int = 0
    """Counters per sketch row, a power of two; 0: the next power of two >= 4 * capacity
    (at least 1024)."""
    sketch_depth: int = 2
    """Sketch rows: one hash each (splitmix64 of the id plus a per-row seed, every bit of the
    id mixed; ``reference/id_remap.py`` ``sketch_buckets``)."""

    def __post_init__(self) -> None:
        _check_int("admission.min_count", self.min_count, 1)
        _check_int("admission.sketch_width", self.sketch_width, 0)
        if self.sketch_width and self.sketch_width & (self.sketch_width - 1):
            raise IdManagerError(
                "admission.sketch_width",
                f"expected 0 or a power of two, got {self.sketch_width}",
            )
        _check_int("admission.sketch_depth", self.sketch_depth, 1)
        if self.sketch_depth > 4:
            raise IdManagerError(
                "admission.sketch_depth", f"expected an integer in [1, 4], got {self.sketch_depth}"
            )


@dataclass(kw_only=True, frozen=True)
class IdManagerConfig:
    """One managed table: raw ids -> slots in ``[0, capacity)``, default row ``capacity``."""

    capacity: int
    """Slots (rows for admitted ids); the table has ``capacity + 1`` rows."""
    eviction: Eviction = "lru"
    """Which slot a new id takes when the table is full: ``lru``, ``lfu``, ``ttl`` (with
    ``ttl_steps``) or ``none`` (a full table is an error)."""
    ttl_steps: int | None = None
    """``ttl`` only: a slot whose id was not seen in the last ``ttl_steps`` training steps is
    freed at the start of the next one (its row re-initialised before reuse)."""
    admission: Admission = field(default_factory=Admission)
    """Which new ids get a slot (``min_count``)."""

    def __post_init__(self) -> None:
        _check_int("capacity", self.capacity, 1)
        if self.eviction not in EVICTIONS:
            raise IdManagerError(
                "eviction", f"expected one of [{', '.join(EVICTIONS)}], got {self.eviction!r}"
            )
        if self.eviction == "ttl":
            if self.ttl_steps is None:
                raise IdManagerError("ttl_steps", "missing: eviction 'ttl' needs ttl_steps >= 1")
            _check_int("ttl_steps", self.ttl_steps, 1)
        elif self.ttl_steps is not None:
            raise IdManagerError(
                "ttl_steps", f"only for eviction 'ttl', got {self.ttl_steps!r} with "
                f"eviction {self.eviction!r}"
            )
        if isinstance(self.admission, Mapping):  # a dict from user code: as from YAML
            object.__setattr__(self, "admission", _admission(self.admission))
        if not isinstance(self.admission, Admission):
            raise IdManagerError(
                "admission", f"expected an Admission or a mapping, got {self.admission!r}"
            )

    @property
    def num_embeddings(self) -> int:
        """The table's rows: the slots and the default row."""
        return self.capacity + 1

    @property
    def default_row(self) -> int:
        return self.capacity

    @property
    def sketch_width(self) -> int:
        """Counters per admission sketch row (0 when every id is admitted at once)."""
        if self.admission.min_count <= 1:
            return 0
        if self.admission.sketch_width:
            return self.admission.sketch_width
        return max(1024, 1 << (4 * self.capacity - 1).bit_length())


_KEYS = ("capacity", "eviction", "ttl_steps", "admission")
_ADMISSION_KEYS = ("min_count", "sketch_width", "sketch_depth")


def _admission(data: Any) -> Admission:
    if not isinstance(data, Mapping):
        raise IdManagerError("admission", f"expected a mapping, got {data!r}")
    unknown = [k for k in data if k not in _ADMISSION_KEYS]
    if unknown:
        raise IdManagerError(
            f"admission.{unknown[0]}",
            f"unknown key, expected one of [{', '.join(_ADMISSION_KEYS)}]",
        )
    return Admission(**dict(data))


def config_from_dict(data: Any) -> IdManagerConfig:
    """An ``IdManagerConfig`` from its YAML mapping; errors name the key
    (``IdManagerError``)."""
    if isinstance(data, IdManagerConfig):
        return data
    if not isinstance(data, Mapping):
        raise IdManagerError("id_manager", f"expected a mapping, got {data!r}")
    unknown = [k for k in data if k not in _KEYS]
    if unknown:
        raise IdManagerError(str(unknown[0]), f"unknown key, expected one of [{', '.join(_KEYS)}]")
    if "capacity" not in data:
        raise IdManagerError("capacity", "missing required key")
    kwargs = dict(data)
    if "admission" in kwargs:
        kwargs["admission"] = _admission(kwargs["admission"])
    return IdManagerConfig(**kwargs)


def managed_configs(
    managed: Mapping[str, Any] | None, tables: Sequence[tuple[str, int]]
) -> dict[str, IdManagerConfig]:
    """Check a module's ``managed`` argument (table name -> ``IdManagerConfig`` or its
    mapping) against its tables ``[(name, num_embeddings), ...]``; errors name the table."""
    rows = dict(tables)
    out: dict[str, IdManagerConfig] = {}
    for name, raw in (managed or {}).items():
        if name not in rows:
            raise ValueError(
                f"managed: unknown table {name!r}, expected one of {sorted(rows)}"
            )
        try:
            cfg = config_from_dict(raw)
        except IdManagerError as e:
            where = "id_manager" + ("" if e.key == "id_manager" else f".{e.key}")
            raise ValueError(f"table '{name}' {where}: {e.message}") from e
        if rows[name] != cfg.num_embeddings:
            raise ValueError(
                f"table '{name}' num_embeddings: expected capacity + 1 = {cfg.num_embeddings} "
                f"({cfg.capacity} slots and the default row), got {rows[name]}"
            )
        out[name] = cfg
    return out
