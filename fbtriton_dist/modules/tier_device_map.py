"""The row cache's slot map on the cache's device (``docs/storage.md``, "The slot map on the
device"): the ``cached`` tier on CUDA, and on the CPU when ``FBTD_SLOT_MAP=device`` (tests,
``bench tbe --storage --slot-map device``).

The map's tensors (``RowCache.row_of_slot``, ``slot_of_row``, ``last_seen``, ``counts``,
``dirty``) live where the slots do; a lookup maps its ids with device ops of fixed shapes, so
that the only host reads of a step are the batch's feature bounds (``TieredTables``) and one
read of a few counts per step for all tables together (``host_values``):

1. ``map_batch`` (per table, no host read): the ids' slots (one gather), the slots the batch
   uses, its distinct misses in first-occurrence order (each miss writes a code of its
   position into its row's entry with ``scatter_reduce`` amax, the first occurrence keeps the
   largest, the entries are put back; compacted by a cumulative sum and a scatter), and the
   counts the host needs: distinct hits and misses, free slots, eviction candidates, whether
   a candidate is dirty, the ids' minimum and maximum;
2. one ``host_values`` of every table's counts (the step's one sync);
3. ``finish`` (per table, sizes known now): the range and size checks (nothing has changed
   yet), the hits stamped, then one ``topk`` over a key per slot (free slots by number, then
   the candidates in LRU ``(last_seen, slot)`` or LFU ``(counts, last_seen, slot)`` order)
   gives the free slots and the victims at once; the victims go back to the backing store
   (all of them when any candidate is dirty: a clean slot holds its row's bytes, so writing
   it is a no-op; the dirty ones are counted on the device), the misses' rows are gathered
   into their slots, the map is updated, the ids become slots.

The rows move as device gathers and scatters through the backing store's device view
(``RowCache.backing_views``: on CUDA the pinned host tensors seen as CUDA tensors,
``ops/host_mapped.py``): a kernel reads or writes each row over PCIe once, no host staging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Mapped", "finish", "flush", "host_values", "map_batch"]

_BIG = torch.iinfo(torch.int64).max
_LFU_KEY_LIMIT = 2**62
"""The largest LFU key of one ``topk``; beyond it (a very long run) two stable sorts order
the candidates instead."""


def host_values(counts: torch.Tensor) -> list[int]:
    """The values of ``counts`` (int64, on the map's device) as Python ints: the one
    device-to-host read of a lookup (a sync on CUDA). Tests count its calls."""
    return counts.tolist()


@dataclass
class Mapped:
    """One table's batch after ``map_batch``: the ids (clamped into range), each one's slot
    before the misses are placed (C: a miss or out of range), the slots the batch uses
    ``[C]``, its distinct misses ``[N]`` (the first M valid, first-occurrence order) and the
    counts for the host ``[7]``: distinct hits, distinct misses, free slots, candidates, any
    candidate dirty, min id, max id."""

    ids: torch.Tensor
    slot: torch.Tensor
    used: torch.Tensor
    new_rows: torch.Tensor
    counts: torch.Tensor
    COUNTS = 7


def map_batch(cache, ids: torch.Tensor, clock: int, lookup: bool) -> Mapped:
    """Step 1 for ``cache`` (a ``RowCache`` with its map on ``ids``' device) and the batch's
    ids ``[N]`` int64 (repeats allowed, out of range ones are ignored here and refused by
    ``finish``); ``lookup`` False: a prefetch (the batch's slots are kept from eviction but
    not stamped). Only fixed-shape device ops; the map is as before when it returns."""
    C, E, N = cache.slots, cache.rows, ids.numel()
    dev = ids.device
    slot_of_row = cache.slot_of_row
    valid = (ids >= 0) & (ids < E)
    idc = ids.clamp(0, E - 1)
    raw = slot_of_row.index_select(0, idc)
    slot = torch.where(valid, raw, C)
    used = torch.zeros(C + 1, dtype=torch.bool, device=dev)
    used.index_fill_(0, slot.long(), True)
    used = used[:C]
    miss = valid & (slot == C)
    # first occurrences of the misses: the largest code (the first position) wins
    code = torch.where(miss, (C + 1 + N) - torch.arange(N, device=dev, dtype=torch.int32), 0)
    slot_of_row.scatter_reduce_(0, idc, code, "amax")
    first = miss & (slot_of_row.index_select(0, idc) == code)
    slot_of_row.index_copy_(0, idc, raw)  # put back (repeats write the same value)
    rank = first.cumsum(0) - 1
    new_rows = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    new_rows.scatter_(0, torch.where(first, rank, N), idc)
    last = cache.last_seen
    cand = (last >= 0) & (last < clock) & ~used
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    lo, hi = torch.aminmax(ids) if N else (zero, zero)
    counts = torch.stack([used.sum(), first.sum(), (last < 0).sum(), cand.sum(),
                          (cand & cache.dirty).any().long(), lo, hi])
    return Mapped(ids=idc, slot=slot, used=used, new_rows=new_rows[:N], counts=counts)


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


def finish(cache, mapped: Mapped, counts: list[int], clock: int, views, *, lookup: bool,
           train: bool, pinned: bool) -> torch.Tensor | None:
    """Step 3 for ``cache`` (``check`` passed for a lookup): place the misses (a prefetch
    places those that find a slot), and for a lookup stamp the hits and return the ids'
    slots ``[N]`` int64 (dirty when ``train``)."""
    H, M, free, cand, any_dirty = counts[:5]
    C = cache.slots
    if lookup:
        cache.stats["lookups"] += H + M
        cache.touches += 1
        if H:
            cache.last_seen.masked_fill_(mapped.used, clock)
            cache.counts.add_(mapped.used)
    k = min(M, free + cand)
    if k:
        _place(cache, mapped, k, min(M, free), clock, views, bool(any_dirty), lookup)
    if lookup and k < M:  # the slots given stay consistent: placed above
        raise ValueError(
            f"table '{cache.name}' (tier {cache.storage.tier!r}): {M - k} of the batch's "
            f"{H + M} distinct rows found no slot of {C}: the others hold rows of this batch"
            + (" or rows pinned by training batches whose backward has not run" if pinned
               else "") + "; raise cache_load_factor or cache_slots"
        )
    if not lookup:
        cache.stats["prefetched"] += k
        cache.stats["prefetch_used"] += k
        return None
    slots = cache.slot_of_row.index_select(0, mapped.ids).long()
    if train:
        cache.dirty.index_fill_(0, slots, True)
    return slots


def _victim_order(cache, mapped: Mapped, k: int, clock: int) -> torch.Tensor:
    """The first ``k`` slots: free ones ascending, then the candidates (used before ``clock``,
    not by this batch) in eviction order."""
    C = cache.slots
    last = cache.last_seen
    at = torch.arange(C, device=last.device)
    free = last < 0
    cand = (last >= 0) & (last < clock) & ~mapped.used
    lru = (last + 1) * C + at  # > every free slot's key
    if not cache.lfu:
        key = torch.where(free, at, torch.where(cand, lru, _BIG))
        return torch.topk(key, k, largest=False, sorted=True).indices
    span = (clock + 1) * C
    if (cache.touches + 2) * span < _LFU_KEY_LIMIT:
        key = torch.where(free, at, torch.where(cand, (cache.counts + 1) * span + lru, _BIG))
        return torch.topk(key, k, largest=False, sorted=True).indices
    key = torch.where(free, at, torch.where(cand, lru, _BIG))
    order = torch.argsort(key)
    rank = torch.where(free, -1, torch.where(cand, cache.counts, _BIG))
    order = order.index_select(0, torch.argsort(rank.index_select(0, order), stable=True))
    return order[:k]


def _place(cache, mapped: Mapped, k: int, nfree: int, clock: int, views, any_dirty: bool,
           lookup: bool) -> None:
    targets = _victim_order(cache, mapped, k, clock)
    victims = targets[nfree:]
    got = mapped.new_rows[:k]
    pairs = cache.device_pairs(views)
    if victims.numel():
        cache.stats["evictions"] += victims.numel()
        vrows = cache.row_of_slot.index_select(0, victims)
        if any_dirty:
            vdirty = cache.dirty.index_select(0, victims)
            cache.written_on_device.add_(vdirty.sum())
            _write(pairs, victims, vrows, vdirty)
        cache.slot_of_row.index_fill_(0, vrows, cache.slots)
    cache.stats["misses"] += k
    for backing, slots in pairs:
        slots.index_copy_(0, targets, backing.index_select(0, got).to(slots.dtype))
    cache.row_of_slot.index_copy_(0, targets, got)
    cache.slot_of_row.index_copy_(0, got, targets.to(torch.int32))
    cache.last_seen.index_fill_(0, targets, clock)
    cache.counts.index_fill_(0, targets, 1 if lookup else 0)  # a prefetched row: 1 at its lookup
    cache.dirty.index_fill_(0, targets, False)


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
