"""Where a table's rows live: its storage tier (``Storage``), torch-free.

A table lives on one tier (``docs/storage.md``):

* ``device``: every row in the compute device's memory (HBM; RAM on the CPU). The default.
* ``host``: every row (and its optimizer state) in host memory, read and updated by the
  kernels directly, no cache (TorchRec's ``fused_uvm``). On CUDA: pinned host memory the GPU
  addresses over PCIe (zero-copy, ``ops/host_mapped.py``; such tables get TableBatchedEmbeddings
  of their own, ``modules/host_tier.py``). On the CPU there is no separate device memory: the
  same as ``device``.
* ``cached``: a cache of ``cache slots`` rows on the compute device in front of every row in
  host memory (TorchRec's ``fused_uvm_caching``).
* ``file``: as ``cached``, the rows behind the cache in a memory-mapped file under ``path``
  (tables bigger than RAM).

Declared per table name::

    ebc = EmbeddingBagCollection(tables, storage={"t_user": Storage(tier="cached",
                                                                    cache_load_factor=0.1)})

or as a mapping (``{"tier": "file", "path": "/nvme/rows", "cache_load_factor": 0.05}``).
The planner and job config will read this module, so it never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["COMPUTE_KERNELS", "POLICIES", "SLOT_BYTES_ON_DEVICE", "SLOT_MAP_BYTES", "TIERS",
           "Storage", "storage_dict", "storage_of", "storage_of_kernel"]

Tier = Literal["device", "host", "cached", "file"]
TIERS: tuple[str, ...] = ("device", "host", "cached", "file")
CACHED_TIERS: tuple[str, ...] = ("cached", "file")
"""The tiers with a row cache in front of their rows."""
POLICIES: tuple[str, ...] = ("lru", "lfu")
"""``lru``: a miss takes the slot used longest ago; ``lfu``: the slot used in the fewest
batches (ties: longest ago). Never a slot used by the current batch."""
COMPUTE_KERNELS: dict[str, str] = {
    "fused": "device",
    "fused_uvm": "host",
    "fused_uvm_caching": "cached",
}
"""TorchRec's ``EmbeddingComputeKernel`` values -> our tiers."""
SLOT_MAP_BYTES = 4
"""Host bytes per row of a ``cached`` / ``file`` table (or shard) for its slot map, the
runtime's ``[E]`` int32 row -> slot array (``modules/tiers.py`` ``RowCache.slot_of_row``);
the planner counts it where it lives (``Storage.map_on_device``): device memory for ``cached``
(``planner/memory.py`` ``block_bytes``), host memory for ``file`` (``host_block_bytes``)."""
SLOT_BYTES_ON_DEVICE = 38
"""Device bytes per cache slot of a ``cached`` table whose slot map is on the device
(``modules/tier_device_map.py`` ``DeviceMaps``): ``row_of_slot``, ``last_seen``, ``counts``
(int64), ``dirty`` (bool), and the slot's table, number there and capacity (int32) and policy
(bool)."""


@dataclass(kw_only=True, frozen=True)
class Storage:
    """One table's storage tier and, for ``cached`` / ``file``, its row cache."""

    tier: Tier = "device"
    """``device``, ``host``, ``cached`` or ``file`` (the module docstring)."""
    cache_load_factor: float = 0.2
    """``cached`` / ``file``: cache slots / rows (TorchRec's name), in (0, 1]; the cache has
    ``ceil(cache_load_factor * E)`` slots."""
    cache_slots: int | None = None
    """``cached`` / ``file``: the number of cache slots, instead of ``cache_load_factor``."""
    policy: Literal["lru", "lfu"] = "lru"
    """``cached`` / ``file``: which resident row a miss evicts (``POLICIES``)."""
    path: str | None = None
    """``file``: the directory of the table's files (created there at construction)."""

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"storage.tier: expected one of {list(TIERS)}, got {self.tier!r}")
        if self.policy not in POLICIES:
            raise ValueError(
                f"storage.policy: expected one of {list(POLICIES)}, got {self.policy!r}"
            )
        f = self.cache_load_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"storage.cache_load_factor: expected a number in (0, 1], got {f!r}")
        n = self.cache_slots
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"storage.cache_slots: expected an integer >= 1 or None, got {n!r}")
        if self.tier == "file" and not self.path:
            raise ValueError("storage.path: tier 'file' needs the directory of its files, got "
                             f"{self.path!r}")
        if self.tier != "file" and self.path is not None:
            raise ValueError(f"storage.path: only tier 'file' has files, got path={self.path!r} "
                             f"with tier {self.tier!r}")

    @property
    def cached(self) -> bool:
        """The rows sit behind a row cache (``cached``, ``file``)."""
        return self.tier in CACHED_TIERS

    def slots(self, rows: int) -> int:
        """Cache slots of a table of ``rows`` rows (its rows without a cache)."""
        if not self.cached:
            return rows
        n = self.cache_slots if self.cache_slots is not None else math.ceil(
            self.cache_load_factor * rows)
        return max(1, min(rows, n))

    @property
    def map_on_device(self) -> bool:
        """The slot map lives in device memory: a ``cached`` table on a CUDA rank (what plans
        are for; ``FBTD_SLOT_MAP=auto``); a ``file`` table keeps its map on the host."""
        return self.tier == "cached"

    def slot_map_bytes(self, rows):
        """Host bytes of the slot map of a table of ``rows`` rows (an int or a numpy array):
        ``SLOT_MAP_BYTES`` per row on ``file``, else 0 (``cached``: ``device_map_bytes``)."""
        return rows * SLOT_MAP_BYTES if self.cached and not self.map_on_device else rows * 0

    def device_map_bytes(self, rows, slots):
        """Device bytes of the slot map of a ``cached`` table of ``rows`` rows with ``slots``
        cache slots (ints or numpy arrays): ``SLOT_MAP_BYTES`` per row and
        ``SLOT_BYTES_ON_DEVICE`` per slot, else 0."""
        if not self.map_on_device:
            return rows * 0
        return rows * SLOT_MAP_BYTES + slots * SLOT_BYTES_ON_DEVICE


def storage_of(value: Any, table: str) -> Storage:
    """A ``Storage`` from a ``Storage``, a mapping of its fields (YAML), a tier name or None
    (``device``); errors name the table."""
    if value is None:
        return Storage()
    if isinstance(value, Storage):
        return value
    if isinstance(value, str):
        value = {"tier": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"table '{table}' storage: expected a Storage, a mapping of its fields "
                         f"or a tier name, got {value!r}")
    known = {f.name for f in fields(Storage)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"table '{table}' storage: unknown keys {unknown}, expected some of "
                         f"{sorted(known)}")
    try:
        return Storage(**dict(value))
    except ValueError as e:
        raise ValueError(f"table '{table}' {e}") from None


def storage_dict(storage: Storage) -> dict[str, Any]:
    """``storage`` as the plan and job YAML write it: ``tier``, and for ``cached`` / ``file``
    the cache fields (``cache_slots`` only when set) and ``path``."""
    out: dict[str, Any] = {"tier": storage.tier}
    if storage.cached:
        if storage.cache_slots is not None:
            out["cache_slots"] = storage.cache_slots
        else:
            out["cache_load_factor"] = storage.cache_load_factor
        out["policy"] = storage.policy
    if storage.path is not None:
        out["path"] = storage.path
    return out


def storage_of_kernel(kernel: str, table: str, cache_load_factor: float | None = None) -> Storage:
    """The ``Storage`` of TorchRec's compute kernel ``kernel`` (``COMPUTE_KERNELS``; an
    imported plan's ``ParameterSharding.compute_kernel``), with ``cache_load_factor`` (its
    ``cache_params.load_factor``; None: ours) for ``fused_uvm_caching``; errors name the
    table."""
    if kernel not in COMPUTE_KERNELS:
        raise ValueError(f"table '{table}': compute kernel {kernel!r} has no storage tier here, "
                         f"expected one of {list(COMPUTE_KERNELS)}")
    tier = COMPUTE_KERNELS[kernel]
    if tier == "cached" and cache_load_factor is not None:
        return storage_of({"tier": tier, "cache_load_factor": cache_load_factor}, table)
    return Storage(tier=tier)
