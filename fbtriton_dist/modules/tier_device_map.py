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
   anything changed): the hits stamped, then one placement for all tables (``_place``): a
   key per slot (free slots by number, then the candidates in LRU ``(last_seen, slot)`` or
   LFU ``(counts, last_seen, slot)`` order) sorted by key then by table (one ``topk`` when
   one table has misses), one gather at positions known on the host gives every table's
   free slots and victims; the victims go back to the backing store (all of them when any
   candidate is dirty: a clean slot holds its row's bytes, so writing it is a no-op; the
   dirty ones are counted on the device), the misses' rows are gathered into their slots
   (per table: its rows are tensors of their own), the map is updated for all tables at
   once, the ids become slots.

On CUDA (``FBTD_SLOT_MAP_KERNELS``: ``auto``) the same steps run as Triton kernels
(``kernels/slot_map.py`` through ``ops/slot_map.py``; ``DeviceMaps.kernels``): the pass in two
launches, the stamps, the keys (joint with the table where they fit: one sort), every table's
and tensor's rows out and in (one launch: each target's victim out, then its miss in), the
slots; the torch ops here are the CPU path and the kernels' reference, bit for bit.

The rows move as device gathers and scatters through the backing store's device view
(``RowCache.backing_views``: on CUDA the pinned host tensors seen as CUDA tensors,
``ops/host_mapped.py``): a kernel reads or writes each row over PCIe once, no host staging.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from fbtriton_dist import knobs

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


def _flat_bounds(starts: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """``_segment_sums``' positions of ``starts`` in each of ``rows`` flattened rows of
    ``n``."""
    return (starts + torch.arange(0, rows * n, n, device=starts.device).unsqueeze(1)).view(-1)


def _segment_sums(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``[K, m]``: the sums of ``values`` ``[K, n]`` (int64) over the column ranges
    ``[starts[i], starts[i + 1])`` (``at = _flat_bounds(starts, K, n)``, ``starts`` ``[m + 1]``
    nondecreasing within [0, n]), read off one running sum of the flattened rows at the
    bounds. No atomics (an ``index_add_`` of a million ids onto a few per-table counters
    serialises on them on a GPU: 5.5 ms a step on an H100) and a 1-D scan (a scan along each
    of a few long rows takes 2 ms there)."""
    run = torch.nn.functional.pad(values.view(-1).cumsum(0), (1, 0))
    ends = run.index_select(0, at).view(values.shape[0], -1)
    return ends[:, 1:] - ends[:, :-1]


@dataclass
class Mapped:
    """A batch after ``DeviceMaps.map``: per id ``[N]`` its joint row number (clamped into
    its table) and whether its table's map is here (``live``); the joint slots the batch uses
    ``[S]``; its distinct misses ``[N]`` (local row numbers, table by table in
    first-occurrence order, the first ``sum(M)`` valid); the free slots and the eviction
    candidates ``[S]``; and ``counts`` ``[T, COUNTS]`` for the host: per table distinct hits,
    distinct misses, free slots, candidates, dirty candidates, ids out of range."""

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
    through one pass (``map``) and one placement (``finish``); only the rows move per table."""

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
        self.written = torch.zeros(len(slots), dtype=torch.int64, device=device)
        for i, cache in enumerate(caches.values()):  # write-backs not yet in stats, per table
            if cache.written_on_device is not None:
                self.written[i] = cache.written_on_device
            cache.written_on_device = self.written[i]
        sizes = torch.tensor(slots)
        # per table: its C and first joint slot, its first joint row; per slot (one [3, S]
        # tensor, gathered at once): its table, number there, C
        self.table_slots = torch.tensor([slots, self.slot_base[:-1]], dtype=torch.int32, **kw)
        self.table_row_base = torch.tensor(self.row_base[:-1], dtype=torch.int64, **kw)
        self.slot_info = torch.stack([
            torch.repeat_interleave(torch.arange(len(slots)), sizes),
            torch.cat([torch.arange(c) for c in slots]),
            torch.repeat_interleave(sizes, sizes)]).to(device=device, dtype=torch.int32)
        self.slot_table, self.slot_local, self.slot_capacity = self.slot_info.unbind()
        self.slot_bounds = _flat_bounds(torch.tensor(self.slot_base, dtype=torch.int64, **kw),
                                        4, S)  # ``map``'s per-slot sums: 4 rows of S
        self._features_of: tuple | None = None
        self.lfu = torch.tensor([c.lfu for c in caches.values()]).repeat_interleave(
            sizes).to(device)
        mode = knobs.slot_map_kernels()  # the fused path (``kernels/slot_map.py``) or torch
        self.kernels = mode == "1" or (mode == "auto" and torch.device(device).type == "cuda")
        if self.kernels and torch.device(device).type != "cuda" and not (
                self._fused().interpreted()):
            raise ValueError(
                f"FBTD_SLOT_MAP_KERNELS=1 with the slot maps on {torch.device(device)}: "
                "expected TRITON_INTERPRET=1 (the kernels on CPU tensors), got compiled "
                "Triton kernels; use FBTD_SLOT_MAP_KERNELS=auto or 0")
        self._row_plan: tuple | None = None  # (its key, ``RowPlan``): where the rows are

    def _features(self, feature_table_map: list[int], device) -> None:
        """Per feature (made once per feature-table map): its table's index here (-1: its
        map is not here), the table's first joint row and its last row (0 where -1)."""
        key = tuple(feature_table_map)
        if self._features_of == key:
            return
        at = {t: i for i, t in enumerate(self.tables)}
        index = [at.get(t, -1) for t in feature_table_map]
        kw = {"dtype": torch.int64, "device": device}
        self.feature_info = torch.tensor(  # [3, T]: gathered at once
            [index, [self.row_base[i] if i >= 0 else 0 for i in index],
             [self.caches[self.tables[i]].rows - 1 if i >= 0 else 0 for i in index]], **kw)
        # the torch ops' copy with a feature T past the last: padding after the last bag,
        # whose table is not here (no lookup)
        none = torch.tensor([[-1], [0], [0]], **kw)
        self.feature_info_padded = torch.cat([self.feature_info, none], 1)
        far = 2**62  # ``map``'s feature bounds clamped between these: first 0, last past N
        self.feature_clamp = (torch.tensor([0] * len(index) + [far], **kw),
                              torch.tensor([0] + [far] * len(index), **kw))
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
        if self.kernels:
            return self._map_fused(indices, offsets, T, B, clock)
        bounds = offsets[::B].contiguous().long()
        feature = torch.searchsorted(bounds, torch.arange(N, device=dev), right=True) - 1
        feature = feature.clamp_(0, T)  # T: padding past the last bag, no lookup
        table, base, last_row = self.feature_info_padded.index_select(1, feature).unbind()
        ids = indices.long()
        in_range = (ids >= 0) & (ids <= last_row)
        live = table >= 0
        take = live & in_range
        local = torch.minimum(ids.clamp(min=0), last_row)
        rows = local + base
        table = table.clamp(min=0)
        raw = self.slot_of_row.index_select(0, rows)
        capacity, slot_base = self.table_slots.index_select(1, table).unbind()
        hit = take & (raw < capacity)
        joint = torch.where(hit, raw + slot_base, S)
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
        cand = (last < clock) & ~(free | used)
        per_slot = torch.stack([used, free, cand, cand & self.dirty]).long()
        sums = _segment_sums(per_slot, self.slot_bounds)  # a table's slots are contiguous
        per_id = torch.stack([first, live & ~in_range]).long()
        # a feature's ids are contiguous (those before the first bound are the first
        # feature's; the padding after the last counts nothing, not being live): sums per
        # feature, then per table
        starts = bounds.clamp(*self.feature_clamp).clamp_(0, N)  # 0, inner bounds, N
        per_feature = _segment_sums(per_id, _flat_bounds(starts, 2, N))
        misses_bad = torch.zeros(2, Tm, dtype=torch.int64, device=dev).index_add_(
            1, self.feature_info[0].clamp(min=0), per_feature)
        counts = torch.stack([sums[0], misses_bad[0], sums[1], sums[2], sums[3], misses_bad[1]],
                             1)
        return Mapped(rows=rows, live=live, used=used, new_rows=new_rows, free=free, cand=cand,
                      counts=counts)

    def _map_fused(self, indices: torch.Tensor, offsets: torch.Tensor, T: int, B: int,
                   clock: int) -> Mapped:
        """``map`` in two kernel launches (and the misses' compaction: a cumulative sum and a
        scatter), the same ``Mapped`` bit for bit (``new_rows`` past ``sum(M)`` aside)."""
        from fbtriton_dist.ops import slot_map as fused

        N, dev = indices.numel(), indices.device
        S, Tm = self.slot_base[-1], len(self.tables)
        C_max = max(c.slots for c in self.caches.values())
        check_codes(C_max, N)
        K = Mapped.COUNTS  # the counts (int64) and the used marks (bool): one zeroed buffer
        zeroed = torch.zeros(8 * Tm * K + S, dtype=torch.uint8, device=dev)
        counts = zeroed[: 8 * Tm * K].view(torch.int64).view(Tm, K)
        used = zeroed[8 * Tm * K :].view(torch.bool)
        rows, live, local, code, table = fused.map_ids(
            indices, offsets.contiguous(), B, T, self.feature_info, self.table_slots,
            self.slot_of_row, used, counts, C_max + 1 + N)
        first, free, cand = fused.map_first(rows, code, table, self.table_slots,
                                            self.slot_of_row, used, self.last_seen, self.dirty,
                                            self.slot_table, counts, clock)
        if self.grouped:
            new_rows = fused.compact(first, local)
        else:  # grouped by table, id order within each
            order = torch.argsort(torch.where(first, table, Tm), stable=True)
            new_rows = local.index_select(0, order)
        return Mapped(rows=rows, live=live, used=used, new_rows=new_rows, free=free, cand=cand,
                      counts=counts)

    def split(self, values: list[int]) -> dict[int, list[int]]:
        """``host_values(mapped.counts)`` per table."""
        K = Mapped.COUNTS
        return {t: values[i * K : (i + 1) * K] for i, t in enumerate(self.tables)}

    def finish(self, mapped: Mapped, counts: dict[int, list[int]], clock: int, views,
               indices: torch.Tensor, *, lookup: bool, train: bool, pinned: bool,
               views_key: tuple | None = None) -> torch.Tensor | None:
        """Step 3 (for a lookup the caller checked ranges and sizes): place each table's
        misses (a prefetch places those that find a slot); for a lookup, stamp the hits and
        return ``indices`` with the ids of these tables replaced by their slots (dirty when
        ``train``). ``views_key``: what ``views`` are made of (equal keys, equal views), None:
        unknown (the fused moves then look at the views every time)."""
        if lookup:
            if any(c[0] for c in counts.values()):
                if self.kernels:  # stamped and marked dirty (no target is a used slot)
                    self._fused().stamp(mapped.used, self.last_seen, self.counts, self.dirty,
                                        clock, train)
                else:
                    self.last_seen.masked_fill_(mapped.used, clock)
                    self.counts.add_(mapped.used)
            for t, c in counts.items():
                self.caches[t].stats["lookups"] += c[0] + c[1]
                self.caches[t].touches += 1
        placed, error, start = [], None, 0  # per table: (i, its misses' first, k, free ones)
        for i, t in enumerate(self.tables):
            cache, (H, M, free, cand) = self.caches[t], counts[t][:4]
            k = min(M, free + cand)
            if k:
                placed.append((i, start, k, min(M, free)))
            start += M
            if not lookup:
                cache.stats["prefetched"] += k
                cache.stats["prefetch_used"] += k
            elif k < M:  # the tables before and this one are placed; the slots stay consistent
                error = ValueError(
                    f"table '{cache.name}' (tier {cache.storage.tier!r}): {M - k} of the "
                    f"batch's {H + M} distinct rows found no slot of {cache.slots}: the others "
                    "hold rows of this batch"
                    + (" or rows pinned by training batches whose backward has not run"
                       if pinned else "") + "; raise cache_load_factor or cache_slots"
                )
                break
        if placed:
            self._place(mapped, counts, placed, clock, views, lookup, train, views_key)
        if error is not None:
            raise error
        if not lookup:
            return None
        if self.kernels:
            return self._fused().slots_of(mapped.rows, mapped.live, self.slot_of_row, indices)
        if train:
            self.dirty.logical_or_(mapped.used)
        slots = self.slot_of_row.index_select(0, mapped.rows).to(indices.dtype)
        return torch.where(mapped.live, slots, indices)

    def _place(self, mapped: Mapped, counts: dict[int, list[int]], placed: list, clock: int,
               views, lookup: bool, train: bool, views_key: tuple | None = None) -> None:
        """The misses of the tables in ``placed`` (``(i, first miss, k, free ones)``) into
        their slots, for all tables at once: one order of every slot (by table, then the
        table's key: ``_keys``), the targets (each table's first ``k``: its free slots, then
        its victims), the victims' rows written back and forgotten, the misses' rows gathered
        in (per table: its rows are its own tensors), the map updated."""
        if self.kernels and self._place_fused(mapped, placed, clock, views, lookup, train,
                                              views_key):
            return
        key, lfu_ok, _ = self._keys(mapped, clock)
        parts, K, V = [], 0, 0  # per table: (i, its first target, k, free ones, first victim)
        for i, _, k, nfree in placed:
            parts.append((i, K, k, nfree, V))
            K, V = K + k, V + k - nfree
        if len(parts) == 1:  # one table: its first k by one topk
            (i, _, k, _, _), = parts
            s0 = self.slot_base[i]
            targets = torch.topk(key[s0 : self.slot_base[i + 1]], k, largest=False,
                                 sorted=True).indices + s0
        else:  # every table's slots in its key's order (the keys of a table are distinct)
            by_key = torch.argsort(key, stable=True)
            order = by_key.index_select(0, torch.argsort(
                self.slot_table.index_select(0, by_key), stable=True))
            targets = torch.cat([order[self.slot_base[i] : self.slot_base[i] + k]
                                 for i, _, k, _ in placed])
        for i, at, k, _, _ in parts:  # LFU keys too big for one int64: two stable sorts
            cache = self.caches[self.tables[i]]
            if cache.lfu and not lfu_ok:
                s0, s1 = self.slot_base[i], self.slot_base[i + 1]
                targets[at : at + k] = _sorted_victims(cache, mapped.used[s0:s1], k,
                                                       clock) + s0
        got = torch.cat([mapped.new_rows[first : first + k] for _, first, k, _ in placed])
        ttable, local = self.slot_info[:2].index_select(1, targets).long().unbind()
        pairs = {i: self.caches[self.tables[i]].device_pairs(views(self.tables[i]))
                 for i, *_ in parts}
        if V:
            victims = torch.cat([targets[at + nfree : at + k] for _, at, k, nfree, _ in parts])
            vrows = self.row_of_slot.index_select(0, victims)
            vtable, vlocal, vslots = self.slot_info.index_select(1, victims).unbind()
            vdirty = self.dirty.index_select(0, victims)
            self.written.index_add_(0, vtable, vdirty.long())
            vlocal = vlocal.long()
            for i, _, k, nfree, v0 in parts:
                t = self.tables[i]
                if k > nfree and counts[t][4]:  # any candidate dirty: write every victim
                    n = slice(v0, v0 + k - nfree)
                    _write(pairs[i], vlocal[n], vrows[n], vdirty[n])
            self.slot_of_row.index_put_(
                (vrows + self.table_row_base.index_select(0, vtable),), vslots)
        for i, at, k, nfree, _ in parts:
            cache = self.caches[self.tables[i]]
            cache.stats["evictions"] += k - nfree
            cache.stats["misses"] += k
            to, rows = local[at : at + k], got[at : at + k]
            for backing, slots in pairs[i]:
                slots.index_copy_(0, to, backing.index_select(0, rows).to(slots.dtype))
        self.row_of_slot.index_copy_(0, targets, got)
        joint = got + self.table_row_base.index_select(0, ttable)
        self.slot_of_row.index_copy_(0, joint, local.to(torch.int32))
        self.last_seen.index_fill_(0, targets, clock)
        self.counts.index_fill_(0, targets, 1 if lookup else 0)  # prefetched: 1 at its lookup
        self.dirty.index_fill_(0, targets, train)

    @staticmethod
    def _fused():
        from fbtriton_dist.ops import slot_map

        return slot_map

    def _row_plan_of(self, views, device: torch.device, views_key: tuple | None):
        """The fused moves' ``RowPlan`` of every table's tensor pairs (made again when an
        address changes), or None: some tensor's rows are not contiguous or of a dtype the
        kernels know (the torch moves then). With ``views_key``, a step whose views and
        backing stores are what they were takes the plan without making the views."""
        quick = None
        if views_key is not None:
            quick = (views_key, device, tuple(
                (t.data_ptr(), t.dtype, t.shape) for c in self.caches.values()
                for t in (c.backing.weight, *c.backing.states.values())))
            if self._row_plan is not None and self._row_plan[2] == quick:
                return self._row_plan[1]
        fused = self._fused()
        pairs = [self.caches[t].device_pairs(views(t)) for t in self.tables]
        key = fused.RowPlan.key(pairs)
        if self._row_plan is None or self._row_plan[0] != key:
            if not fused.RowPlan.fits(pairs):
                self._row_plan = None
                return None
            self._row_plan = (key, fused.RowPlan(pairs, device), quick)
        elif quick is not None:  # the same plan, now known by this key too
            self._row_plan = (key, self._row_plan[1], quick)
        return self._row_plan[1]

    def _place_fused(self, mapped: Mapped, placed: list, clock: int, views, lookup: bool,
                     train: bool, views_key: tuple | None) -> bool:
        """``_place`` with the kernels: the same targets, then one launch (per dtype pair
        of the tensors) for every table and tensor: per target, its victim's row back if
        dirty (a clean one holds its row's bytes: ``_write``'s result) and its entry
        forgotten, then the miss's row in and the target's entries (``rows_swap``; without
        victims ``rows_in``). Without victims the targets are each table's first free slots
        (a cumulative sum of the free marks and one scatter, no keys, no sort); else by the
        keys: one ``topk``, or every table's slots in key order.
        The kernels find each row's table in a ``[T, 6]`` table of ``(first target, first
        victim, k, free ones, first miss, where its targets start in order)`` per table:
        O(tables) host work and copy, not O(rows). False (nothing done): the rows are not
        the kernels' (``_row_plan_of``)."""
        dev = self.last_seen.device
        plan = self._row_plan_of(views, dev, views_key)
        if plan is None:
            return False
        fused = self._fused()
        of = {i: (first, k, nfree) for i, first, k, nfree in placed}
        rows, K, V = [], 0, 0
        for i, t in enumerate(self.tables):
            first, k, nfree = of.get(i, (0, 0, 0))
            rows.append([K, V, k, nfree, first, self.slot_base[i]])
            if k:
                stats = self.caches[t].stats
                stats["evictions"] += k - nfree
                stats["misses"] += k
            K, V = K + k, V + k - nfree
        order = None
        if V:  # by the keys; where each table's targets start in the order
            order, start = self._victims_order(mapped, placed, clock)
            for i, row in enumerate(rows):
                row[5] = start.get(i, 0)
        else:  # free slots only: each table's first k, ascending; the order is the targets
            for row in rows:
                row[5] = row[0]
        if dev.type == "cuda":  # one small copy, from pinned memory: no wait for the stream
            parts = torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(
                dev, non_blocking=True)
        else:
            parts = torch.tensor(rows, dtype=torch.int64)
        if order is None:
            order = fused.free_targets(mapped.free, self.slot_table, self.table_slots, parts, K)
        if V:  # each target's victim out and miss in, by one program
            fused.rows_swap(plan, parts, order, K, mapped.new_rows, self.slot_info,
                            self.table_row_base, self.row_of_slot, self.slot_of_row,
                            self.last_seen, self.counts, self.dirty, self.written, clock,
                            lookup, train)
        else:
            fused.rows_in(plan, parts, order, K, mapped.new_rows, self.slot_info,
                          self.table_row_base, self.row_of_slot, self.slot_of_row,
                          self.last_seen, self.counts, self.dirty, clock, lookup, train)
        return True

    def _victims_order(self, mapped: Mapped, placed: list, clock: int
                       ) -> tuple[torch.Tensor, dict[int, int]]:
        """The fused placement's order of slots when some table evicts, and where each
        placed table's first ``k`` (its targets) start in it."""
        key, lfu_ok, joint = self._keys(mapped, clock)
        start = {i: self.slot_base[i] for i, *_ in placed}
        if len(placed) == 1:  # one table: its first k by one topk
            (i, _, k, _), = placed
            s0 = self.slot_base[i]
            order = torch.topk(key[s0 : self.slot_base[i + 1]], k, largest=False,
                               sorted=True).indices + s0
            start[i] = 0
        elif joint:  # every table's slots in its key's order: one sort of the joint keys
            order = torch.argsort(key)  # each table's first k distinct: no ties among them
        else:  # by key, then by table (the keys of a table are distinct)
            by_key = torch.argsort(key, stable=True)
            order = by_key.index_select(0, torch.argsort(
                self.slot_table.index_select(0, by_key), stable=True))
        if any(self.caches[self.tables[i]].lfu for i, *_ in placed) and not lfu_ok:
            # LFU keys too big for one int64: those tables' targets by two stable sorts
            order = order.clone()
            for i, _, k, _ in placed:
                cache = self.caches[self.tables[i]]
                if cache.lfu:
                    s0, s1 = self.slot_base[i], self.slot_base[i + 1]
                    order[start[i] : start[i] + k] = _sorted_victims(
                        cache, mapped.used[s0:s1], k, clock) + s0
        return order, start

    def _keys(self, mapped: Mapped, clock: int) -> tuple[torch.Tensor, bool, bool]:
        """Per slot ``[S]``: free slots first (by number), then the candidates in their
        table's eviction order, the others last; whether the LFU tables' keys fit an int64
        (else their slots are keyed LRU here and ``_sorted_victims`` orders them); and
        whether the keys are joint (the kernels: ``table << shift | key``, every free and
        candidate key below ``2**shift - 1``, the others capped there: one sort orders every
        table's slots as sorting by key, then by table, does)."""
        last, at, C = self.last_seen, self.slot_local, self.slot_capacity
        lfu_ok = True
        lfu = [c for c in self.caches.values() if c.lfu]
        if lfu:
            C_max = max(c.slots for c in lfu)
            lfu_ok = (max(c.touches for c in lfu) + 2) * (clock + 1) * C_max < _LFU_KEY_LIMIT
        if self.kernels:  # one launch, the same keys (joint where they fit)
            bound = (clock + 1) * max(  # above every free and candidate key
                (c.touches + 2 if c.lfu and lfu_ok else 1) * c.slots
                for c in self.caches.values())
            shift = _joint_shift(len(self.tables), bound)
            key = self._fused().keys(last, self.counts, at, C, self.lfu, mapped.free,
                                     mapped.cand, self.slot_table, clock,
                                     bool(lfu) and lfu_ok, _BIG, shift)
            return key, lfu_ok, shift > 0
        lru = (last + 1) * C + at  # > every free slot's key
        order = lru
        if lfu and lfu_ok:
            order = torch.where(self.lfu, (self.counts + 1) * ((clock + 1) * C) + lru, lru)
        return (torch.where(mapped.free, at, torch.where(mapped.cand, order, _BIG)), lfu_ok,
                False)


def _joint_shift(tables: int, bound: int) -> int:
    """Where the table goes in a joint key (``table << shift | key``) of ``tables`` tables
    whose free and candidate keys are below ``bound``; 0: they do not fit (two sorts)."""
    shift = 63 - max(1, (tables - 1).bit_length())
    return shift if bound < 2**shift - 1 else 0


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
