"""Bytes a block of a table occupies on its rank: weights plus fused-optimizer state.

Read by the plan's budget check, the cost model and the planner's search alike, so all three
count memory the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from fbtriton_dist import optim
from fbtriton_dist.storage import SLOT_BYTES_ON_DEVICE, SLOT_MAP_BYTES

from .shards import Shard, TableSharding
from .tables import TableSpec

__all__ = ["GiB", "as_planned", "block_bytes", "device_rows", "fmt_bytes", "host_block_bytes",
           "shard_equation", "shard_spec", "state_bytes", "table_state_bytes"]

GiB = 1024**3


def state_bytes(optimizer: str, rows: int, cols: int, state_dtype: str = "fp32") -> int:
    """Optimizer state of a rows x cols block (``optim.REGISTRY``'s state layout; ``none``:
    0), every state stored in ``state_dtype`` (``TableSpec.state_dtype``; default fp32, as
    FBGEMM keeps it; bf16 / fp16 halve it)."""
    if optimizer == "none":
        return 0
    entry = optim.spec(optimizer)
    return entry.state_bytes(rows, cols, {s.name: state_dtype for s in entry.states
                                          if not s.fp32_only})  # prev_iter, row_counter: fp32


def table_state_bytes(spec: TableSpec, rows, cols, optimizer: str):
    """Optimizer state of a rows x cols block of ``spec`` (ints or numpy arrays): its own
    optimizer, else ``optimizer`` (the planner's default), every state in the table's
    ``state_dtype``. The one price of a table's state: every part of the planner (budgets,
    cost model, balance, replica groups, tier choice, the caches' traffic) calls it."""
    return state_bytes(spec.optimizer or optimizer, rows, cols, spec.state_dtype)


def block_bytes(spec: TableSpec, rows: int, cols: int, optimizer: str) -> int:
    """Device memory of a rows x cols block of ``spec``: weights + optimizer state of its
    rows, or of its cache's slots on a ``cached`` / ``file`` tier (``Storage.slots(rows)``),
    none on ``host``; ``cached`` adds its slot map, which lives on the device
    (``Storage.device_map_bytes``: 4 B per row of the block, 38 B per slot); ``optimizer`` is
    the default for a table that does not name its own."""
    slots = device_rows(spec, rows)
    out = slots * cols * spec.dtype_bytes + table_state_bytes(spec, slots, cols, optimizer)
    if spec.storage is not None:
        out = out + spec.storage.device_map_bytes(rows, slots)
    return out


def device_rows(spec: TableSpec, rows):
    """Rows of a block (an int or a numpy array) that sit in device memory: all of them on
    ``device``, none on ``host``, the cache's slots on ``cached`` / ``file``
    (``Storage.slots``, elementwise)."""
    st = spec.storage
    if st is None or st.tier == "device":
        return rows
    if st.tier == "host":
        return rows * 0
    if np.ndim(rows) == 0:
        return st.slots(int(rows))
    r = np.asarray(rows, dtype=np.float64)
    n = np.full_like(r, st.cache_slots) if st.cache_slots is not None else np.ceil(
        st.cache_load_factor * r)
    return np.clip(n, np.minimum(1, r), r)


def host_block_bytes(spec: TableSpec, rows: int, cols: int, optimizer: str) -> int:
    """Host memory of a rows x cols block of ``spec``: every row and its optimizer state on
    the ``host`` and ``cached`` tiers (the backing store; ``file`` keeps them in files, on
    disk), and the slot map of ``file`` (``Storage.slot_map_bytes``: 4 B per row of the
    block, which has a cache of its own; a ``cached`` block's map is on the device,
    ``block_bytes``); none on ``device``."""
    if spec.storage is None:
        return 0
    slot_map = spec.storage.slot_map_bytes(rows)
    if spec.tier not in ("host", "cached"):
        return slot_map
    return (rows * cols * spec.dtype_bytes + table_state_bytes(spec, rows, cols, optimizer)
            + slot_map)


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def shard_equation(spec: TableSpec, sh: Shard, optimizer: str) -> str:
    """``rows 0..1000 x 128 cols x 4 B + state 4.0 KiB (rowwise_adagrad) = 504.0 KiB`` (a
    ``cached`` shard: ``+ slot map ...`` before the total)."""
    opt = spec.optimizer or optimizer
    rows = spec.storage.slots(sh.num_rows) if spec.storage is not None else sh.num_rows
    w = rows * sh.num_cols * spec.dtype_bytes
    st = table_state_bytes(spec, rows, sh.num_cols, optimizer)
    state = f", {spec.state_dtype}" if spec.state_dtype != "fp32" else ""
    cache = (f" ({spec.tier} tier: a cache of {rows} slots)"
             if spec.storage is not None and spec.storage.cached else "")
    smap = spec.storage.device_map_bytes(sh.num_rows, rows) if spec.storage is not None else 0
    on = (f" + slot map {fmt_bytes(smap)} ({SLOT_MAP_BYTES} B x {sh.num_rows} rows"
          f" + {SLOT_BYTES_ON_DEVICE} B x {rows} slots)" if smap else "")
    return (
        f"rows {sh.row_start}..{sh.row_end}{cache} x {sh.num_cols} cols x {spec.dtype_bytes} B"
        f" + state {fmt_bytes(st)} ({opt}{state}){on} = {fmt_bytes(w + st + smap)}"
    )


def shard_spec(spec: TableSpec, shard: Shard) -> TableSpec:
    """``spec`` with the storage ``shard`` lives on: its own (``Shard.storage``, a per-shard
    tier), else ``spec``'s (``as_planned``: the table's in the plan). Every per-shard count
    (budgets, the cost model's memory and misses, the report) prices a shard through it."""
    if shard.storage is None or shard.storage == spec.storage:
        return spec
    return dataclasses.replace(spec, storage=shard.storage, auto_storage=False)


def as_planned(specs: Sequence[TableSpec], planned: Iterable[TableSharding]) -> list[TableSpec]:
    """``specs`` with each table's storage as the plan says where it names one (the plan's
    storage is the one the shards get: a tier the planner chose, ``storage: auto``)."""
    storage = {t.name: t.storage for t in planned if t.storage is not None}
    return [dataclasses.replace(t, storage=storage[t.name], auto_storage=False)
            if t.name in storage and t.storage != storage[t.name] else t for t in specs]
