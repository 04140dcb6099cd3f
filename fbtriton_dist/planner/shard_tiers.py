"""Storage tiers per shard: the hot shards of a cached table back on ``device``
(``docs/storage.md``, "Tiers per shard").

``choose_tiers`` picks one tier per table, counted over the whole world. Once the plan has
placed the shards, each rank's device budget may still have room (a rank whose other shards
are small, or a table cut so that its hot rows sit on a few ranks).
:func:`promote_hot_shards` fills that room: the shards of the tables whose tier the planner
chose (``auto``) that sit behind a cache, the most lookups per extra device byte first, move
to ``device`` (``Shard.storage``) while their rank's device memory stays within
``DEVICE_FILL`` x its budget. A skewed row-wise table ends with its hot row blocks on
``device`` and its cold ones ``cached`` / ``file``; every rank's shards fit that rank's
budget (the plan's ``validate(budget_bytes=...)`` holds as before). Host memory and disk only
shrink (a promoted shard needs no backing store or slot map).

``choose_tiers`` sizes the caches to fill the device room, so the planner
(``ShardingPlanner(shard_tiers=True)``) also plans with the caches at their least
(:func:`smallest_caches`), promotes there, and keeps whichever of the two plans the cost
model finds faster (the slowest rank's step time, each shard's misses priced on its own
tier).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from fbtriton_dist.storage import Storage

from .memory import as_planned, block_bytes, shard_spec
from .plan import ShardingPlan
from .stats import IdDistribution, cdf_array
from .tables import TableSpec
from .tier_choice import DEVICE_FILL, UNIFORM, floor_factor, min_load_factor

__all__ = ["promote_hot_shards", "smallest_caches"]

DEVICE = Storage(tier="device")


def smallest_caches(specs: Sequence[TableSpec], stats: Mapping[str, IdDistribution] | None,
                    auto: Collection[str], world_size: int,
                    batch_size: int) -> tuple[TableSpec, ...]:
    """``specs`` with the cache of every cached / file table named in ``auto`` at its least
    (``tier_choice.min_load_factor``: ``CACHE_MARGIN`` steps' distinct rows), so that the
    device room the caches would fill is left for :func:`promote_hot_shards`."""
    out = []
    for t in specs:
        st = t.storage
        if t.name not in auto or st is None or not st.cached or st.cache_slots is not None:
            out.append(t)
            continue
        ids = world_size * batch_size * t.ids_per_sample
        f = floor_factor(min_load_factor(t, (stats or {}).get(t.name, UNIFORM), ids))
        out.append(dataclasses.replace(t, storage=dataclasses.replace(
            st, cache_load_factor=min(f, st.cache_load_factor))))
    return tuple(out)


def promote_hot_shards(plan: ShardingPlan, specs: Sequence[TableSpec],
                       stats: Mapping[str, IdDistribution] | None, auto: Collection[str],
                       budget_bytes: float | Sequence[float], optimizer: str) -> ShardingPlan:
    """``plan`` with the hottest cached / file shards of the tables named in ``auto`` on
    ``device`` while each one's rank stays within ``DEVICE_FILL x budget_bytes`` (the module
    docstring; one budget for every rank, or one per rank: ranks with different device
    memory); a table whose every shard moves is on ``device`` as a whole."""
    if np.ndim(budget_bytes) and len(budget_bytes) != plan.world_size:
        raise ValueError(f"budget_bytes: expected one number or {plan.world_size} (one per "
                         f"rank), got {len(budget_bytes)}")
    budgets = np.broadcast_to(np.asarray(budget_bytes, dtype=np.float64), (plan.world_size,))
    specs = as_planned(list(specs), plan.tables)
    by_name = {t.name: t for t in specs}
    used = np.zeros(plan.world_size)
    for ts in plan.tables:
        spec = by_name[ts.name]
        for sh in ts.shards:
            used[sh.rank] += block_bytes(shard_spec(spec, sh), sh.num_rows, sh.num_cols,
                                         optimizer)
    candidates = []  # (-lookups per extra byte, table index, shard index, rank, extra bytes)
    for t, ts in enumerate(plan.tables):
        spec = by_name[ts.name]
        if ts.name not in auto or ts.sharding == "data_parallel":
            continue
        E = spec.num_embeddings
        dist = (stats or {}).get(ts.name, UNIFORM)
        share = (cdf_array(dist, E, np.array([s.row_end for s in ts.shards]))
                 - cdf_array(dist, E, np.array([s.row_start for s in ts.shards])))
        whole = dataclasses.replace(spec, storage=None, auto_storage=False)
        for i, sh in enumerate(ts.shards):
            here = shard_spec(spec, sh)
            if here.storage is None or not here.storage.cached:
                continue
            extra = (block_bytes(whole, sh.num_rows, sh.num_cols, optimizer)
                     - block_bytes(here, sh.num_rows, sh.num_cols, optimizer))
            lookups = float(share[i]) * sh.num_cols / spec.embedding_dim
            candidates.append((-lookups / max(extra, 1), t, i, sh.rank, extra))
    room = DEVICE_FILL * budgets
    promoted: dict[int, set[int]] = {}
    for _, t, i, rank, extra in sorted(candidates):
        if used[rank] + extra <= room[rank]:
            used[rank] += extra
            promoted.setdefault(t, set()).add(i)
    if not promoted:
        return plan
    tables = list(plan.tables)
    for t, idx in promoted.items():
        ts = tables[t]
        if len(idx) == len(ts.shards):  # all of it: the table is on device
            tables[t] = dataclasses.replace(ts, storage=None, shards=tuple(
                dataclasses.replace(s, storage=None) for s in ts.shards))
        else:
            tables[t] = dataclasses.replace(ts, shards=tuple(
                dataclasses.replace(s, storage=DEVICE) if i in idx else s
                for i, s in enumerate(ts.shards)))
    return dataclasses.replace(plan, tables=tuple(tables))
