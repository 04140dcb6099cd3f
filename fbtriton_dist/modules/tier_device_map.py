"""The row cache's slot map on the cache's device (``docs/storage.md``, "The slot map on the
device"): the ``cached`` tier on CUDA, and on the CPU when ``FBTD_SLOT_MAP=device`` (tests,
``bench tbe --storage --slot-map device``).

The map's tensors (``RowCache.row_of_slot``, ``slot_of_row``, ``last_seen``, ``counts``,
``dirty``) of all of a module's tables on the device are parts of one set (``DeviceMaps``);
a lookup maps its ids with device ops of fixed shapes, so that the only host read of a step
is one read of a few counts per table for all tables together (``host_values``):

1. ``DeviceMaps.map`` (all tables in one pass, no host read): each id's feature and table
   (a search of the offsets), the ids' slots (one gather),
   the slots the batch uses, its distinct misses in first-occurrence order (each miss writes
   a code of its position into its row's entry with ``scatter_reduce`` amax, the first
   occurrence keeps the largest, the entries are put back; compacted by a cumulative sum and
   a scatter), and per table the counts the host needs: distinct hits and misses, free
   slots, eviction candidates, whether a candidate is dirty, ids out of range;
2. one ``host_values`` of every table's counts (the step's one sync of the map);
3. ``DeviceMaps.finish`` (sizes known now; the caller checked ranges and sizes before
   anything changed): the hits stamped, then per table one ``topk`` over its part of a key
   per slot (free slots by number, then the candidates in LRU ``(last_seen, slot)`` or LFU
   ``(counts, last_seen, slot)`` order) gives the free slots and the victims at once; the
   victims go back to the backing store (all of them when any candidate is dirty: a clean
   slot holds its row's bytes, so writing it is a no-op; the dirty ones are counted on the
   device), the misses' rows are gathered into their slots, the map is updated, the ids
   become slots.

The rows move as device gathers and scatters through the backing store's device view
(``RowCache.backing_views``: on CUDA the pinned host tensors seen as CUDA tensors,
``ops/host_mapped.py``): a kernel reads or writes each row over PCIe once, no host staging.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

__all__ = ["DeviceMaps", "Mapped", "check", "check_codes", "flush", "host_values"]

_BIG = torch.iinfo(torch.int64).max
_CODE_LIMIT = torch.iinfo(torch.int32).max
_LFU_KEY_LIMIT = 2**62
"""The largest LFU key of one ``topk``; beyond it (a very long run) two stable sorts order
the candidates instead."""


def host_values(counts: torch.Tensor) -> list[int]:
    """The values of ``counts`` (int64, on the map's device) as Python ints: the one
    device-to-host read of a lookup (a sync on CUDA). Tests count its calls."""
    return counts.tolist()


@dataclass
class Mapped:
    """A batch after ``DeviceMaps.map``: per id ``[N]`` its joint row number (clamped into
    its table) and whether its table's map is here (``live``); the joint slots the batch uses
    ``[S]``; its distinct misses ``[N]`` (local row numbers, table by table in
    first-occurrence order, the first ``sum(M)`` valid); the free slots and the eviction
    candidates ``[S]``; and ``counts`` ``[T, COUNTS]`` for the host: per table distinct hits,
    distinct misses, free slots, candidates, any candidate dirty, ids out of range."""

    rows: torch.Tensor
    live: torch.Tensor
    used: torch.Tensor
    new_rows: torch.Tensor
    free: torch.Tensor
    cand: torch.Tensor
    counts: torch.Tensor
    COUNTS = 6


class DeviceMaps:
    """The slot maps of one module's cached tables that live on its device, in one set of
    tensors: ``slot_of_row`` ``[sum(E)]`` (each table's entries hold its own slot numbers, C:
    not cached) and ``row_of_slot``, ``last_seen``, ``counts``, ``dirty`` ``[S = sum(C)]``;
    each table's ``RowCache`` tensors are views of its part. A batch's ids of every table go
    through one pass (``map``); the placement is per table (``finish``)."""

    def __init__(self, caches: dict, device: torch.device) -> None:
        self.caches = caches
        self.tables = list(caches)
        rows = [c.rows for c in caches.values()]
        slots = [c.slots for c in caches.values()]
        self.row_base = [0, *accumulate(rows)]
        self.slot_base = [0, *accumulate(slots)]
        S = self.slot_base[-1]
        kw = {"device": device}
        self.slot_of_row = torch.empty(self.row_base[-1], dtype=torch.int32, **kw)
        self.row_of_slot = torch.empty(S, dtype=torch.int64, **kw)
        self.last_seen = torch.empty(S, dtype=torch.int64, **kw)
        self.counts = torch.empty(S, dtype=torch.int64, **kw)
        self.dirty = torch.empty(S, dtype=torch.bool, **kw)
        for i, cache in enumerate(caches.values()):
            r0, r1 = self.row_base[i], self.row_base[i + 1]
            self.slot_of_row[r0:r1].copy_(cache.slot_of_row)
            cache.slot_of_row = self.slot_of_row[r0:r1]
            s0, s1 = self.slot_base[i], self.slot_base[i + 1]
            for name in ("row_of_slot", "last_seen", "counts", "dirty"):
                part = getattr(self, name)[s0:s1]
                part.copy_(getattr(cache, name))
                setattr(cache, name, part)
        sizes = torch.tensor(slots)
        # per table: its C and first joint slot; per slot: its table, number there, C
        self.capacity = torch.tensor(slots, dtype=torch.int32, **kw)
        self.table_slot_base = torch.tensor(self.slot_base[:-1], dtype=torch.int32, **kw)
        as_int = {"device": device, "dtype": torch.int32}
        self.slot_table = torch.repeat_interleave(torch.arange(len(slots)), sizes).to(**as_int)
        self.slot_local = torch.cat([torch.arange(c) for c in slots]).to(**as_int)
        self.slot_capacity = torch.repeat_interleave(sizes, sizes).to(**as_int)
        self._features_of: tuple | None = None
        self.lfu = torch.tensor([c.lfu for c in caches.values()]).repeat_interleave(
            sizes).to(device)

    def _features(self, feature_table_map: list[int], device) -> None:
        """Per feature (made once per feature-table map): its table's index here (-1: its
        map is not here), the table's first joint row and its row count (1 where -1)."""
        key = tuple(feature_table_map)
        if self._features_of == key:
            return
        at = {t: i for i, t in enumerate(self.tables)}
        index = [at.get(t, -1) for t in feature_table_map]
        kw = {"dtype": torch.int64, "device": device}
        self.feature_index = torch.tensor(index, **kw)
        self.feature_base = torch.tensor([self.row_base[i] if i >= 0 else 0 for i in index], **kw)
        self.feature_rows = torch.tensor(
            [self.caches[self.tables[i]].rows if i >= 0 else 1 for i in index], **kw)
        live = [i for i in index if i >= 0]
        self.grouped = live == sorted(live)  # the ids come table by table
        self._features_of = key

    def map(self, indices: torch.Tensor, offsets: torch.Tensor, feature_table_map: list[int],
            clock: int) -> Mapped:
        """Step 1 for a batch (``indices`` ``[N]``, ``offsets`` ``[T*B+1]`` feature-major, N
        and B not 0): every id's table found on the device (its feature by a search of
        ``offsets``), then one pass for all tables; fixed-shape device ops only (ids out of
        range are counted and left out); the maps are as before when it returns."""
        T = len(feature_table_map)
        N, B, dev = indices.numel(), (offsets.numel() - 1) // T, indices.device
        S, Tm = self.slot_base[-1], len(self.tables)
        self._features(feature_table_map, dev)
        bounds = offsets[::B].contiguous().long()
        feature = torch.searchsorted(bounds, torch.arange(N, device=dev), right=True) - 1
        feature = feature.clamp_(0, T - 1)
        table = self.feature_index.index_select(0, feature)
        E = self.feature_rows.index_select(0, feature)
        ids = indices.long()
        in_range = (ids >= 0) & (ids < E)
        live = table >= 0
        take = live & in_range
        local = torch.minimum(ids.clamp(min=0), E - 1)
        rows = local + self.feature_base.index_select(0, feature)
        table = table.clamp_(min=0)
        raw = self.slot_of_row.index_select(0, rows)
        hit = take & (raw < self.capacity.index_select(0, table))
        joint = torch.where(hit, raw + self.table_slot_base.index_select(0, table), S)
        used = torch.zeros(S + 1, dtype=torch.bool, device=dev)
        used.index_fill_(0, joint.long(), True)
        used = used[:S]
        miss = take & ~hit
        # first occurrences of the misses: the largest code (the first position) wins
        C_max = max(c.slots for c in self.caches.values())
        check_codes(C_max, N)
        code = torch.where(miss, (C_max + 1 + N) - torch.arange(N, device=dev,
                                                                 dtype=torch.int32), 0)
        self.slot_of_row.scatter_reduce_(0, rows, code, "amax")
        first = miss & (self.slot_of_row.index_select(0, rows) == code)
        self.slot_of_row.index_copy_(0, rows, raw)  # put back (repeats write the same value)
        if self.grouped:  # compacted in id order, which is table by table
            new_rows = torch.zeros(N + 1, dtype=torch.int64, device=dev)
            new_rows.scatter_(0, torch.where(first, first.cumsum(0) - 1, N), local)
            new_rows = new_rows[:N]
        else:  # grouped by table, id order within each
            order = torch.argsort(torch.where(first, table, Tm), stable=True)
            new_rows = local.index_select(0, order)
        last = self.last_seen
        free = last < 0
        cand = (last >= 0) & (last < clock) & ~used
        per_slot = torch.stack([used, free, cand, cand & self.dirty]).long()
        sums = torch.zeros(4, Tm, dtype=torch.int64, device=dev).index_add_(
            1, self.slot_table, per_slot)
        per_id = torch.stack([first, live & ~in_range]).long()
        misses_bad = torch.zeros(2, Tm, dtype=torch.int64, device=dev).index_add_(
            1, table, per_id)
        counts = torch.stack([sums[0], misses_bad[0], sums[1], sums[2], (sums[3] > 0).long(),
                              misses_bad[1]], 1)
        return Mapped(rows=rows, live=live, used=used, new_rows=new_rows, free=free, cand=cand,
                      counts=counts)

    def split(self, values: list[int]) -> dict[int, list[int]]:
        """``host_values(mapped.counts)`` per table."""
        K = Mapped.COUNTS
        return {t: values[i * K : (i + 1) * K] for i, t in enumerate(self.tables)}

    def finish(self, mapped: Mapped, counts: dict[int, list[int]], clock: int, views,
               indices: torch.Tensor, *, lookup: bool, train: bool,
               pinned: bool) -> torch.Tensor | None:
        """Step 3 (for a lookup the caller checked ranges and sizes): place each table's
        misses (a prefetch places those that find a slot); for a lookup, stamp the hits and
        return ``indices`` with the ids of these tables replaced by their slots (dirty when
        ``train``)."""
        if lookup:
            if any(c[0] for c in counts.values()):
                self.last_seen.masked_fill_(mapped.used, clock)
                self.counts.add_(mapped.used)
            for t, c in counts.items():
                self.caches[t].stats["lookups"] += c[0] + c[1]
                self.caches[t].touches += 1
        key, lfu_ok = None, True
        start = 0  # each table's misses follow the previous table's in new_rows
        for i, t in enumerate(self.tables):
            cache, (H, M, free, cand, any_dirty) = self.caches[t], counts[t][:5]
            k = min(M, free + cand)
            if k:
                s0, s1 = self.slot_base[i], self.slot_base[i + 1]
                if key is None:
                    key, lfu_ok = self._keys(mapped, clock)
                if cache.lfu and not lfu_ok:
                    targets = _sorted_victims(cache, mapped.used[s0:s1], k, clock)
                else:
                    targets = torch.topk(key[s0:s1], k, largest=False, sorted=True).indices
                _place(cache, targets, min(M, free), mapped.new_rows[start : start + k],
                       clock, views(t), bool(any_dirty), lookup, train)
            start += M
            if lookup and k < M:  # the slots given stay consistent: placed above
                raise ValueError(
                    f"table '{cache.name}' (tier {cache.storage.tier!r}): {M - k} of the "
                    f"batch's {H + M} distinct rows found no slot of {cache.slots}: the others "
                    "hold rows of this batch"
                    + (" or rows pinned by training batches whose backward has not run"
                       if pinned else "") + "; raise cache_load_factor or cache_slots"
                )
            if not lookup:
                cache.stats["prefetched"] += k
                cache.stats["prefetch_used"] += k
        if not lookup:
            return None
        if train:
            self.dirty.logical_or_(mapped.used)
        slots = self.slot_of_row.index_select(0, mapped.rows).to(indices.dtype)
        return torch.where(mapped.live, slots, indices)

    def _keys(self, mapped: Mapped, clock: int) -> tuple[torch.Tensor, bool]:
        """Per slot ``[S]``: free slots first (by number), then the candidates in their
        table's eviction order, the others last; and whether the LFU tables' keys fit an
        int64 (else their slots are keyed LRU here and ``_sorted_victims`` orders them)."""
        last, at, C = self.last_seen, self.slot_local, self.slot_capacity
        lru = (last + 1) * C + at  # > every free slot's key
        order, lfu_ok = lru, True
        lfu = [c for c in self.caches.values() if c.lfu]
        if lfu:
            C_max = max(c.slots for c in lfu)
            lfu_ok = (max(c.touches for c in lfu) + 2) * (clock + 1) * C_max < _LFU_KEY_LIMIT
            if lfu_ok:
                order = torch.where(self.lfu, (self.counts + 1) * ((clock + 1) * C) + lru, lru)
        return torch.where(mapped.free, at, torch.where(mapped.cand, order, _BIG)), lfu_ok


def check_codes(slots: int, ids: int) -> None:
    """Refuse a batch whose first-occurrence codes (``slots + 1 + ids`` down to
    ``slots + 2``, written into the int32 ``slot_of_row``) would pass ``2**31 - 1``."""
    if slots + 1 + ids > _CODE_LIMIT:
        raise ValueError(
            f"a batch of {ids} ids with a cache of {slots} slots: the device slot map numbers "
            f"the batch's misses in int32, expected slots + ids + 1 <= {_CODE_LIMIT}, got "
            f"{slots + 1 + ids}; split the batch or use FBTD_SLOT_MAP=host")


def check(cache, counts: list[int]) -> None:
    """Refuse a lookup whose distinct rows outnumber the slots (before anything changed)."""
    H, M = counts[0], counts[1]
    U, C = H + M, cache.slots
    if U > C:
        raise ValueError(
            f"table '{cache.name}' (tier {cache.storage.tier!r}): a batch reads {U} distinct "
            f"rows, its cache has {C} slots (of {cache.rows} rows); raise "
            f"cache_load_factor or cache_slots to at least {U} / {U / cache.rows:.3g}"
        )


def _sorted_victims(cache, used: torch.Tensor, k: int, clock: int) -> torch.Tensor:
    """The first ``k`` slots of ``cache`` (free ones ascending, then the candidates in LFU
    order) by two stable sorts: for LFU keys too big for one int64."""
    C = cache.slots
    last = cache.last_seen
    at = torch.arange(C, device=last.device)
    free = last < 0
    cand = (last >= 0) & (last < clock) & ~used
    lru = (last + 1) * C + at
    order = torch.argsort(torch.where(free, at, torch.where(cand, lru, _BIG)))
    rank = torch.where(free, -1, torch.where(cand, cache.counts, _BIG))
    order = order.index_select(0, torch.argsort(rank.index_select(0, order), stable=True))
    return order[:k]


def _place(cache, targets: torch.Tensor, nfree: int, got: torch.Tensor, clock: int, views,
           any_dirty: bool, lookup: bool, train: bool) -> None:
    """Rows ``got`` into slots ``targets`` (free ones, then victims), writing the victims
    back first; the map updated."""
    victims = targets[nfree:]
    pairs = cache.device_pairs(views)
    if victims.numel():
        cache.stats["evictions"] += victims.numel()
        vrows = cache.row_of_slot.index_select(0, victims)
        if any_dirty:
            vdirty = cache.dirty.index_select(0, victims)
            cache.written_on_device.add_(vdirty.sum())
            _write(pairs, victims, vrows, vdirty)
        cache.slot_of_row.index_fill_(0, vrows, cache.slots)
    cache.stats["misses"] += targets.numel()
    for backing, slots in pairs:
        slots.index_copy_(0, targets, backing.index_select(0, got).to(slots.dtype))
    cache.row_of_slot.index_copy_(0, targets, got)
    cache.slot_of_row.index_copy_(0, got, targets.to(torch.int32))
    cache.last_seen.index_fill_(0, targets, clock)
    cache.counts.index_fill_(0, targets, 1 if lookup else 0)  # a prefetched row: 1 at its lookup
    cache.dirty.index_fill_(0, targets, train)


def _write(pairs, slots: torch.Tensor, rows: torch.Tensor, dirty: torch.Tensor | None) -> None:
    """Rows of ``slots`` back to rows ``rows`` of each backing store. ``dirty`` given: the
    clean ones keep the backing store's bytes (written as they are where the dtypes match:
    a clean slot holds its row's bytes; blended where the cache has another dtype)."""
    for backing, cache in pairs:
        out = cache.index_select(0, slots)
        if out.dtype != backing.dtype:
            out = out.to(backing.dtype)
            if dirty is not None:
                keep = dirty.view(-1, *([1] * (out.dim() - 1)))
                out = torch.where(keep, out, backing.index_select(0, rows))
        backing.index_copy_(0, rows, out)


def flush(cache, views) -> None:
    """Write every dirty slot back (one host read: which ones); they are clean afterwards."""
    slots = (cache.dirty & (cache.row_of_slot >= 0)).nonzero().squeeze(1)
    if slots.numel():
        _write(cache.device_pairs(views), slots, cache.row_of_slot.index_select(0, slots), None)
        cache.stats["writebacks"] += slots.numel()
    cache.dirty.zero_()
