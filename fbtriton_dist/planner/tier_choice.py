"""The planner's storage tiers: which tables go on ``device``, ``cached`` or ``file``, and
how large their caches are (``docs/storage.md``, "How the planner chooses a tier").

A table whose spec says ``storage: auto`` (``TableSpec.auto_storage``), or has no storage
when the planner is asked to choose (``ShardingPlanner(auto_tiers=True)``), gets the fastest
tier that fits, counted over the world (``R`` ranks):

1. ``device`` while the device budget holds it with its optimizer state: the tables with the
   most lookups per byte first, up to ``DEVICE_FILL`` of ``R x budget`` less what the
   tables with a fixed tier take there;
2. else ``cached``: one ``cache_load_factor`` for all such tables, the largest whose caches
   (slots x (row + state) and the slot map on the device, ``Storage.device_map_bytes``) fill
   the device room left, each table's at least what holds a step's distinct rows
   ``CACHE_MARGIN`` times over (``cache_model``); its backing store (every row + state)
   counts against ``R x host budget`` (None: not checked);
3. else ``file`` (the host budget is short): the same cache, the rows in files under
   ``file_dir`` within ``R x disk budget`` (None: not checked), the slot map in host memory
   (``SLOT_MAP_BYTES`` per row).

A table that fits nowhere raises ``ValueError`` naming the table, the tier and the bound.
Tables with an explicit ``storage:`` keep it and are checked the same way. The per-rank
checks come after the search (``host_memory_problems`` and :func:`disk_problems`), and
:func:`cache_shortfalls` finds shards whose cache cannot hold a step's rows (a hot row block
of a skewed table): the planner raises those tables' factors and plans again.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from fbtriton_dist.storage import SLOT_MAP_BYTES, Storage

from .cache_model import STEP_MARGIN, estimate_hit_rates, hit_rate
from .memory import block_bytes, fmt_bytes, host_block_bytes, shard_spec, table_state_bytes
from .plan import ShardingPlan
from .stats import IdDistribution
from .tables import TableSpec

__all__ = ["CACHE_MARGIN", "DEVICE_FILL", "TierBudgets", "auto_tables", "cache_shortfalls",
           "choose_tiers", "disk_block_bytes", "disk_problems", "floor_factor",
           "min_load_factor"]

DEVICE_FILL = 0.95
"""Share of the world's device budget the chosen ``device`` tables may take: the search packs
shards rank by rank and needs some slack (a table that would fill the last 5 % is cached)."""
CACHE_MARGIN = STEP_MARGIN
"""A cache holds at least this many times a step's expected distinct rows
(``cache_model.STEP_MARGIN``)."""
UNIFORM = IdDistribution()


@dataclass(frozen=True)
class TierBudgets:
    """Per rank: device bytes for embeddings, host bytes for backing stores, disk bytes for
    ``file`` tables (None: not checked); ``file_dir`` the directory of ``file`` tables."""

    world_size: int
    device_bytes: float
    host_bytes: float | None = None
    disk_bytes: float | None = None
    file_dir: str | None = None


def auto_tables(specs: Sequence[TableSpec], all_unset: bool) -> set[str]:
    """Names of the tables whose tier the planner chooses: ``storage: auto``, and every table
    without storage when ``all_unset``."""
    return {t.name for t in specs
            if t.auto_storage or (all_unset and t.storage is None)}


def _row_bytes(spec: TableSpec, optimizer: str) -> int:
    """Bytes of one whole row: weights + its optimizer state."""
    return (spec.embedding_dim * spec.dtype_bytes
            + table_state_bytes(spec, 1, spec.embedding_dim, optimizer))


def disk_block_bytes(spec: TableSpec, rows: int, cols: int, optimizer: str) -> int:
    """Disk bytes of a rows x cols block: every row and state of a ``file`` table, else 0."""
    if spec.tier != "file":
        return 0
    return rows * cols * spec.dtype_bytes + table_state_bytes(spec, rows, cols, optimizer)


def min_load_factor(spec: TableSpec, dist: IdDistribution, ids_per_step: float) -> float:
    """The smallest load factor whose cache holds ``CACHE_MARGIN`` steps' distinct rows."""
    E = spec.num_embeddings
    U = hit_rate(dist, E, ids_per_step, E).distinct_rows
    return min(1.0, CACHE_MARGIN * U / E)


def floor_factor(f: float) -> float:
    """``f`` rounded down to 4 significant digits (written in the plan), in (0, 1]."""
    if f >= 1.0:
        return 1.0
    scale = 10 ** (3 - math.floor(math.log10(f)))
    return max(math.floor(f * scale) / scale, 1e-12)


def choose_tiers(specs: Sequence[TableSpec], stats: Mapping[str, IdDistribution] | None,
                 budgets: TierBudgets, auto: Collection[str], optimizer: str,
                 batch_size: int, policy: str = "lru") -> tuple[TableSpec, ...]:
    """``specs`` with a storage for every table named in ``auto`` (the module docstring);
    the others keep theirs. ``batch_size``: samples per rank per step."""
    stats = stats or {}
    R = budgets.world_size
    ids = {t.name: R * batch_size * t.ids_per_sample for t in specs}
    whole = {t.name: t.num_embeddings * _row_bytes(t, optimizer) for t in specs}
    device_room = R * budgets.device_bytes
    host_room = math.inf if budgets.host_bytes is None else R * budgets.host_bytes
    disk_room = math.inf if budgets.disk_bytes is None else R * budgets.disk_bytes
    for t in specs:  # the fixed tiers first
        if t.name in auto:
            continue
        device_room -= block_bytes(t, t.num_embeddings, t.embedding_dim, optimizer)
        host_room -= host_block_bytes(t, t.num_embeddings, t.embedding_dim, optimizer)
        disk_room -= whole[t.name] if t.tier == "file" else 0
        if t.tier != "device" and host_room < 0:
            raise ValueError(_over(t, whole[t.name], -host_room, "host", R,
                                   budgets.host_bytes))
        if t.tier == "file" and disk_room < 0:
            raise ValueError(_over(t, whole[t.name], -disk_room, "disk", R,
                                   budgets.disk_bytes))
    # most lookups per byte first: they gain the most from device memory
    order = sorted((t for t in specs if t.name in auto),
                   key=lambda t: (-t.ids_per_sample / whole[t.name], t.name))
    fill = DEVICE_FILL * R * budgets.device_bytes - (R * budgets.device_bytes - device_room)
    chosen: dict[str, Storage | None] = {}
    behind = []
    for t in order:
        if whole[t.name] <= fill:
            chosen[t.name] = None  # device: the default
            fill -= whole[t.name]
        else:
            behind.append(t)
    if behind:
        chosen.update(_cached(behind, stats, ids, whole, fill, host_room, disk_room, budgets,
                              optimizer, policy))
    out = []
    for t in specs:
        if t.name not in auto:
            out.append(t)
        else:
            out.append(replace(t, storage=chosen[t.name], auto_storage=False))
    return tuple(out)


def _over(t: TableSpec, size: int, short: float, what: str, R: int,
          per_rank: float | None) -> str:
    maps = " and slot maps" if t.storage is not None and t.tier == "file" else ""
    return (f"table '{t.name}' (storage tier '{t.tier}', {fmt_bytes(size)} with its state): "
            f"the tables on that tier need {fmt_bytes(short)} more than the {what} budget of "
            f"{R} x {fmt_bytes(per_rank or 0)} (rows and state{maps})")


def _cached(behind: Sequence[TableSpec], stats, ids, whole, device_room: float,
            host_room: float, disk_room: float, budgets: TierBudgets, optimizer: str,
            policy: str) -> dict[str, Storage]:
    """Caches for the tables that are not on device: one load factor (at least each table's
    minimum) filling ``device_room``, then host memory or files for their rows."""
    R = budgets.world_size
    row = {t.name: _row_bytes(t, optimizer) for t in behind}
    least = {t.name: min_load_factor(t, stats.get(t.name, UNIFORM), ids[t.name]) for t in behind}

    def need(f: float) -> float:  # the slot maps counted on the device (``cached``)
        on = Storage(tier="cached")
        return sum(math.ceil(max(f, least[t.name]) * t.num_embeddings) * row[t.name]
                   + on.device_map_bytes(t.num_embeddings,
                                         math.ceil(max(f, least[t.name]) * t.num_embeddings))
                   for t in behind)

    if need(0.0) > device_room:
        t = max(behind, key=lambda t: least[t.name] * t.num_embeddings * row[t.name])
        raise ValueError(
            f"table '{t.name}' (storage tier 'cached'): its cache must hold {CACHE_MARGIN:g} x "
            f"a step's distinct rows ({math.ceil(least[t.name] * t.num_embeddings)} of "
            f"{t.num_embeddings} rows); the caches of the {len(behind)} table(s) not on device "
            f"need {fmt_bytes(need(0.0))}, the device budget leaves "
            f"{fmt_bytes(max(device_room, 0.0))} of {R} x {fmt_bytes(budgets.device_bytes)} "
            f"(x {DEVICE_FILL:g})")
    lo, hi = 0.0, 1.0
    if need(1.0) <= device_room:
        lo = 1.0
    else:
        for _ in range(50):
            mid = (lo + hi) / 2.0
            lo, hi = (mid, hi) if need(mid) <= device_room else (lo, mid)
    out = {}
    for t in behind:
        f = floor_factor(max(lo, least[t.name]))
        slot_map = SLOT_MAP_BYTES * t.num_embeddings  # host memory on 'file'
        if whole[t.name] <= host_room:  # 'cached': its slot map is on the device
            host_room -= whole[t.name]
            out[t.name] = Storage(tier="cached", cache_load_factor=f, policy=policy)
            continue
        if whole[t.name] > disk_room or slot_map > host_room:
            raise ValueError(
                f"table '{t.name}' ({t.num_embeddings} rows, {fmt_bytes(whole[t.name])} with "
                f"its state) fits no tier: device (budget {R} x "
                f"{fmt_bytes(budgets.device_bytes)}), host for tier 'cached' (rows and state; "
                f"{fmt_bytes(max(host_room, 0.0))} left "
                f"of {R} x {fmt_bytes(budgets.host_bytes or 0)}), disk for tier 'file' "
                f"(and a slot map of {fmt_bytes(slot_map)} in host memory; "
                f"{fmt_bytes(max(disk_room, 0.0))} left of {R} x "
                f"{fmt_bytes(budgets.disk_bytes) if budgets.disk_bytes else 'unbounded'})")
        if not budgets.file_dir:
            raise ValueError(
                f"table '{t.name}' needs storage tier 'file' (host budget {R} x "
                f"{fmt_bytes(budgets.host_bytes or 0)} is short by "
                f"{fmt_bytes(whole[t.name] - max(host_room, 0.0))}): expected a "
                "directory for its files (file_dir, --file-dir), got none")
        disk_room -= whole[t.name]
        host_room -= slot_map
        out[t.name] = Storage(tier="file", cache_load_factor=f, policy=policy,
                              path=budgets.file_dir)
    return out


def cache_shortfalls(plan: ShardingPlan, specs: Sequence[TableSpec],
                     stats: Mapping[str, IdDistribution] | None,
                     batch_size: int) -> dict[str, float]:
    """Tables of ``specs`` cached in ``plan`` with a shard whose cache holds fewer than
    ``CACHE_MARGIN`` steps' distinct rows of that shard: ``{table: the load factor that
    would}`` (at most 1)."""
    by_name = {t.name: t for t in specs}
    out = {}
    for ts in plan.tables:
        spec = by_name.get(ts.name)
        if spec is None:
            continue
        st = ts.storage or spec.storage
        # the shards on the table's storage (a shard with its own keeps its own cache)
        shards = [s for s in ts.shards if s.storage is None]
        if st is None or not st.cached or not shards:
            continue
        n = plan.world_size * batch_size * spec.ids_per_sample
        starts = [s.row_start for s in shards]
        ends = [s.row_end for s in shards]
        slots = [st.slots(s.num_rows) for s in shards]
        est = estimate_hit_rates((stats or {}).get(ts.name, UNIFORM), spec.num_embeddings, n,
                                 starts, ends, slots, st.policy)
        want = max(min(1.0, CACHE_MARGIN * e.distinct_rows / max(s.num_rows, 1))
                   for e, s in zip(est, shards, strict=True))
        have = min(st.slots(s.num_rows) / max(s.num_rows, 1) for s in shards)
        if st.cache_slots is None and want > st.cache_load_factor and want > have:
            out[ts.name] = min(1.0, want * 1.001)
    return out


def disk_problems(plan: ShardingPlan, specs: Sequence[TableSpec], budget_bytes: float,
                  optimizer: str) -> list[str]:
    """One message per rank whose ``file`` shards (every row and state) exceed
    ``budget_bytes`` of disk."""
    by_name = {t.name: t for t in specs}
    need: dict[int, list[tuple[int, str]]] = {}
    for t in plan.tables:
        spec = by_name.get(t.name)
        if spec is None:
            continue
        if t.storage is not None:
            spec = replace(spec, storage=t.storage)
        for s in t.shards:
            n = disk_block_bytes(shard_spec(spec, s), s.num_rows, s.num_cols, optimizer)
            if n:
                need.setdefault(s.rank, []).append(
                    (n, f"'{t.name}' rows {s.row_start}..{s.row_end} x {s.num_cols} cols "
                        f"{fmt_bytes(n)}"))
    return [f"rank {r} needs {fmt_bytes(sum(n for n, _ in items))} of disk, budget "
            f"{fmt_bytes(budget_bytes)}: " + " + ".join(text for _, text in items)
            for r, items in sorted(need.items()) if sum(n for n, _ in items) > budget_bytes]
