"""The row cache's slot map on the device, fused (``modules/tier_device_map.py``: its torch
ops are the CPU path and the reference of these kernels; ``docs/storage.md``, "The slot map
on the device"). A step of a module's cached tables:

* ``map_ids`` and ``map_first`` (``DeviceMaps.map``), two launches over the batch's ids (and its slots): per
  id its feature (a binary search of the feature bounds ``offsets[f * B]``), table, row, in
  range, slot, hit, the ``used`` marks of the slots hit, and for a miss a code of its
  position written into its row's ``slot_of_row`` entry with ``atomic_max`` (the first
  occurrence's code is the largest); the second launch, once every code is in, keeps the
  ids that find their own code (the first occurrences; each puts its row's entry back: a
  missing row's entry is its table's C) and adds per slot the free slots, candidates and
  dirty candidates. Per-table counts are block sums (one per table a block touches) added
  with integer atomics onto ``[T, 6]`` counters, so their order does not matter.
  ``compact`` puts the first occurrences in id order (a cumulative sum, one scatter).
* ``stamp``: the hits' ``last_seen`` / ``counts`` (and ``dirty`` for a training batch).
* ``keys``: each slot's eviction key (``DeviceMaps._keys``), joint with its table where
  the keys fit (one sort then orders every table's slots).
* ``rows_swap``: per target slot, its victim's row (every tensor pair: weights, each
  optimizer state) back to the backing store (a dirty one: a clean slot holds its row's
  bytes) and its map entry forgotten, then the miss's row in and the target's map entries:
  one launch per pair of dtypes, a program per target, so that the writes to host memory
  and the reads from it share the link at once (two launches, all out then all in, took
  3.9 ms a step where this takes 3.3 on an H100: ``docs/storage.md``). ``rows_in`` the same
  without victims (free slots only).
  A table of base addresses, row strides and row lengths per (table, tensor) (``RowPlan``)
  says where the rows are; a kernel casts the int64 addresses to pointers. Each row finds
  its table's part of the placement by a binary search of a ``[T, 6]`` table (a row per table).
* ``slots_of``: the batch's ids of these tables replaced by their slots.

Races: the codes are integers maxed atomically and read by the next launch only (stream
order); a row's ids are all hits or all misses (a hit's entry is never written in ``map``);
stores of ``used`` repeat the same value; the put-back is done by the one first occurrence
and a non-first reader that sees it cannot mistake a table's C for its code (codes are
larger than every C).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fbtriton_dist.kernels.launch import Launcher, cdiv, next_power_of_2

BLOCK = 1024
COUNTS = 6  # per table: hits, misses, free, candidates, dirty candidates, out of range


@triton.jit
def _add_per_table(counts_ptr, col, table, value, valid, COUNTS: tl.constexpr):
    """``counts[t, col] += sum(value)`` over the lanes of table ``t``, for each table of the
    block: one sum and one atomic per table between its smallest and largest."""
    table = table.to(tl.int32)
    lo = tl.min(tl.where(valid, table, 2**30), axis=0)
    hi = tl.max(tl.where(valid, table, -1), axis=0)
    for t in range(lo, hi + 1):
        s = tl.sum(tl.where(valid & (table == t), value, 0).to(tl.int64), axis=0)
        tl.atomic_add(counts_ptr + t * COUNTS + col, s, mask=s != 0)


@triton.jit(do_not_specialize=["N", "B", "T", "S", "code_top"])
def _map_ids_kernel(
    indices_ptr,  # [N] int32/int64 ids
    offsets_ptr,  # [T * B + 1] offsets; feature f's ids start at offsets[f * B]
    feature_info_ptr,  # [3, T] int64: table here (-1: not here), first joint row, last row
    table_slots_ptr,  # [2, Tm] int32: C, first joint slot
    slot_of_row_ptr,  # [R] int32 (codes written for the misses)
    rows_ptr,  # out [N] int64 joint row (clamped into its table)
    live_ptr,  # out [N] uint8 its table's map is here
    local_ptr,  # out [N] int64 row in its table
    code_ptr,  # out [N] int32 a miss's code, else 0
    table_ptr,  # out [N] int32 table here (0 where none)
    used_ptr,  # [S] uint8 (zeros): slots hit
    counts_ptr,  # [Tm, COUNTS] int64 (zeros): out-of-range ids added
    N, B, T, Tm, S, code_top,  # code of id i: code_top - i
    SEARCH: tl.constexpr,  # binary search steps: ceil(log2(T + 2))
    COUNTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    valid = i < N
    # the feature: the number of bounds offsets[f * B] (f in [0, T]) <= i, minus one
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.zeros([BLOCK], tl.int64) + (T + 1)
    for _ in range(SEARCH):
        go = lo < hi
        mid = (lo + hi) // 2
        bound = tl.load(offsets_ptr + mid * B, mask=go & valid, other=0).to(tl.int64)
        below = bound <= i
        lo = tl.where(go & below, mid + 1, lo)
        hi = tl.where(go & ~below, mid, hi)
    feature = tl.minimum(tl.maximum(lo - 1, 0), T - 1)
    table = tl.load(feature_info_ptr + feature, mask=valid, other=-1)
    base = tl.load(feature_info_ptr + T + feature, mask=valid, other=0)
    last_row = tl.load(feature_info_ptr + 2 * T + feature, mask=valid, other=0)
    ids = tl.load(indices_ptr + i, mask=valid, other=0).to(tl.int64)
    in_range = (ids >= 0) & (ids <= last_row)
    live = (table >= 0) & (lo <= T)  # lo == T + 1: padding past the last bag, no lookup
    take = live & in_range
    local = tl.minimum(tl.maximum(ids, 0), last_row)
    rows = local + base
    table = tl.maximum(table, 0)
    raw = tl.load(slot_of_row_ptr + rows, mask=valid, other=0)
    capacity = tl.load(table_slots_ptr + table, mask=valid, other=0)
    slot_base = tl.load(table_slots_ptr + Tm + table, mask=valid, other=0)
    # a missing row's entry is its C or, once another id of it wrote, a code (> every C):
    # a miss either way; a hit's entry is never written here
    hit = take & (raw < capacity)
    miss = take & ~hit
    tl.store(used_ptr + (raw + slot_base), tl.full([BLOCK], 1, tl.uint8), mask=valid & hit)
    code = tl.where(miss, (code_top - i).to(tl.int32), 0)
    tl.atomic_max(slot_of_row_ptr + rows, code, mask=valid & miss)
    tl.store(rows_ptr + i, rows, mask=valid)
    tl.store(live_ptr + i, live.to(tl.uint8), mask=valid)
    tl.store(local_ptr + i, local, mask=valid)
    tl.store(code_ptr + i, code, mask=valid)
    tl.store(table_ptr + i, table.to(tl.int32), mask=valid)
    _add_per_table(counts_ptr, 5, table, (live & ~in_range).to(tl.int64), valid, COUNTS)


@triton.jit(do_not_specialize=["N", "S", "clock"])
def _map_first_kernel(
    rows_ptr, code_ptr, table_ptr,  # [N] from ``_map_ids_kernel``
    table_slots_ptr,  # [2, Tm] int32: C, first joint slot
    slot_of_row_ptr,  # [R] int32: codes read, entries put back
    first_ptr,  # out [N] uint8 the first occurrence of a missing row
    used_ptr,  # [S] uint8 slots hit
    last_seen_ptr,  # [S] int64
    dirty_ptr,  # [S] uint8
    slot_table_ptr,  # [S] int32 each slot's table
    free_ptr,  # out [S] uint8 free slots
    cand_ptr,  # out [S] uint8 eviction candidates
    counts_ptr,  # [Tm, COUNTS] int64
    N, S, clock,
    COUNTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    if pid * BLOCK < N:  # the ids' part
        valid = i < N
        code = tl.load(code_ptr + i, mask=valid, other=0)
        rows = tl.load(rows_ptr + i, mask=valid, other=0)
        table = tl.load(table_ptr + i, mask=valid, other=0)
        miss = valid & (code != 0)
        now = tl.load(slot_of_row_ptr + rows, mask=miss, other=0)
        first = miss & (now == code)
        capacity = tl.load(table_slots_ptr + table, mask=first, other=0)
        tl.store(slot_of_row_ptr + rows, capacity, mask=first)  # put back
        tl.store(first_ptr + i, first.to(tl.uint8), mask=valid)
        _add_per_table(counts_ptr, 1, table, first.to(tl.int64), valid, COUNTS)
    if pid * BLOCK < S:  # the slots' part
        valid = i < S
        used = tl.load(used_ptr + i, mask=valid, other=0) != 0
        last = tl.load(last_seen_ptr + i, mask=valid, other=0)
        dirty = tl.load(dirty_ptr + i, mask=valid, other=0) != 0
        table = tl.load(slot_table_ptr + i, mask=valid, other=0)
        free = last < 0
        cand = (last < clock) & ~(free | used)
        tl.store(free_ptr + i, free.to(tl.uint8), mask=valid)
        tl.store(cand_ptr + i, cand.to(tl.uint8), mask=valid)
        _add_per_table(counts_ptr, 0, table, used.to(tl.int64), valid, COUNTS)
        _add_per_table(counts_ptr, 2, table, free.to(tl.int64), valid, COUNTS)
        _add_per_table(counts_ptr, 3, table, cand.to(tl.int64), valid, COUNTS)
        _add_per_table(counts_ptr, 4, table, (cand & dirty).to(tl.int64), valid, COUNTS)


@triton.jit(do_not_specialize=["N"])
def _compact_kernel(first_ptr, at_ptr, local_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """``out[at[i] - 1] = local[i]`` for the first occurrences (``at``: inclusive cumsum)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < N
    first = tl.load(first_ptr + i, mask=valid, other=0) != 0
    at = tl.load(at_ptr + i, mask=first, other=1)
    tl.store(out_ptr + (at - 1), tl.load(local_ptr + i, mask=first, other=0), mask=first)


@triton.jit(do_not_specialize=["S", "clock"])
def _stamp_kernel(used_ptr, last_seen_ptr, counts_ptr, dirty_ptr, S, clock,
                  TRAIN: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    used = (i < S) & (tl.load(used_ptr + i, mask=i < S, other=0) != 0)
    tl.store(last_seen_ptr + i, tl.zeros([BLOCK], tl.int64) + clock, mask=used)
    tl.store(counts_ptr + i, tl.load(counts_ptr + i, mask=used, other=0) + 1, mask=used)
    if TRAIN:
        tl.store(dirty_ptr + i, tl.full([BLOCK], 1, tl.uint8), mask=used)


@triton.jit(do_not_specialize=["S", "clock"])
def _keys_kernel(last_seen_ptr, counts_ptr, slot_local_ptr, slot_capacity_ptr, lfu_ptr,
                 free_ptr, cand_ptr, slot_table_ptr, key_ptr, S, clock, BIG,
                 LFU: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """``SHIFT`` > 0: the key joint, ``table << SHIFT | min(key, 2**SHIFT - 1)`` (every free
    and candidate key below the cap: one sort orders all tables)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < S
    last = tl.load(last_seen_ptr + i, mask=valid, other=0)
    at = tl.load(slot_local_ptr + i, mask=valid, other=0).to(tl.int64)
    C = tl.load(slot_capacity_ptr + i, mask=valid, other=0).to(tl.int64)
    order = (last + 1) * C + at
    if LFU:
        n = tl.load(counts_ptr + i, mask=valid, other=0)
        lfu = tl.load(lfu_ptr + i, mask=valid, other=0) != 0
        order = tl.where(lfu, (n + 1) * ((clock + 1) * C) + order, order)
    free = tl.load(free_ptr + i, mask=valid, other=0) != 0
    cand = tl.load(cand_ptr + i, mask=valid, other=0) != 0
    key = tl.where(free, at, tl.where(cand, order, BIG))
    if SHIFT > 0:
        table = tl.load(slot_table_ptr + i, mask=valid, other=0).to(tl.int64)
        key = (table << SHIFT) | tl.minimum(key, (1 << SHIFT) - 1)
    tl.store(key_ptr + i, key, mask=valid)


@triton.jit(do_not_specialize=["S"])
def _free_targets_kernel(free_ptr, cum_ptr, slot_table_ptr, table_slots_ptr, parts_ptr,
                         targets_ptr, S, Tm, BLOCK: tl.constexpr):
    """Each table's first ``k`` free slots, ascending, at its targets (``parts[t]``: first
    target, k): a free slot's rank in its table is the running count of free slots
    (``cum``, inclusive) less the count before the table's first slot."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < S
    free = valid & (tl.load(free_ptr + i, mask=valid, other=0) != 0)
    table = tl.load(slot_table_ptr + i, mask=free, other=0).to(tl.int64)
    s0 = tl.load(table_slots_ptr + Tm + table, mask=free, other=0).to(tl.int64)
    before = tl.load(cum_ptr + s0 - 1, mask=free & (s0 > 0), other=0)
    rank = tl.load(cum_ptr + i, mask=free, other=0) - before - 1
    k = tl.load(parts_ptr + table * 6 + 2, mask=free, other=0)
    at = tl.load(parts_ptr + table * 6, mask=free, other=0)
    take = free & (rank < k)
    tl.store(targets_ptr + at + rank, i, mask=take)


@triton.jit
def _copy_row(src, dst, n, BLOCK_D: tl.constexpr):
    for d0 in range(0, n, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(src + d, mask=d < n)
        tl.store(dst + d, x.to(dst.dtype.element_ty), mask=d < n)


@triton.jit
def _part_of(parts_ptr, n_parts, x, col, SEARCH: tl.constexpr):
    """The last part ``p`` (of ``n_parts`` rows of 6) with ``parts[p, col] <= x``: the
    part of target (col 0) or victim (col 1) ``x`` (parts without victims share the next
    one's first victim and are passed over)."""
    lo = n_parts * 0
    hi = n_parts
    for _ in range(SEARCH):
        go = lo < hi
        mid = (lo + hi) // 2
        start = tl.load(parts_ptr + mid * 6 + col, mask=go, other=0)
        below = start <= x
        lo = tl.where(go & below, mid + 1, lo)
        hi = tl.where(go & ~below, mid, hi)
    return parts_ptr + (lo - 1) * 6


@triton.jit(do_not_specialize=["K", "n_parts", "clock"])
def _rows_in_kernel(
    parts_ptr,  # [T, 6] int64 per table: first target, first victim, k, free ones, first miss,
    # where the part's targets start in order
    order_ptr,  # int64 joint slots: target j of part p is order[start + j - first target]
    new_rows_ptr,  # [N] int64 the misses' rows, table by table
    slot_info_ptr, table_row_base_ptr,
    row_of_slot_ptr, slot_of_row_ptr, last_seen_ptr, counts_ptr, dirty_ptr,  # map, written
    plan_ptr,  # [Tm, P, 5] int64: backing address, row stride (bytes), cache's, row length
    K, S, P, n_parts, clock,
    SEARCH: tl.constexpr,
    MAP: tl.constexpr, LOOKUP: tl.constexpr, TRAIN: tl.constexpr,
    SRC: tl.constexpr, DST: tl.constexpr,  # the backing store's and the cache's dtypes
    BLOCK_D: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)  # target g of all
    p = tl.program_id(1)
    part = _part_of(parts_ptr, n_parts, g, 0, SEARCH)
    j = g - tl.load(part)
    slot = tl.load(order_ptr + tl.load(part + 5) + j)
    row = tl.load(new_rows_ptr + tl.load(part + 4) + j)
    table = tl.load(slot_info_ptr + slot).to(tl.int64)
    local = tl.load(slot_info_ptr + S + slot)
    at = plan_ptr + (table * P + p) * 5
    n = tl.load(at + 4)
    if n > 0:
        src = (tl.load(at) + row * tl.load(at + 1)).to(tl.pointer_type(SRC))
        dst = (tl.load(at + 2) + local.to(tl.int64) * tl.load(at + 3)).to(tl.pointer_type(DST))
        _copy_row(src, dst, n, BLOCK_D)
    if MAP:  # the map: once per target
        if p == 0:
            tl.store(row_of_slot_ptr + slot, row)
            tl.store(slot_of_row_ptr + row + tl.load(table_row_base_ptr + table), local)
            tl.store(last_seen_ptr + slot, clock.to(tl.int64))
            tl.store(counts_ptr + slot, tl.full([], LOOKUP, tl.int64))
            tl.store(dirty_ptr + slot, tl.full([], TRAIN, tl.uint8))


@triton.jit(do_not_specialize=["K", "P", "n_parts", "clock"])
def _rows_swap_kernel(
    parts_ptr, order_ptr, new_rows_ptr,  # as ``_rows_in_kernel``'s
    slot_info_ptr, table_row_base_ptr,
    row_of_slot_ptr, slot_of_row_ptr, last_seen_ptr, counts_ptr, dirty_ptr,  # map, read first
    written_ptr,  # [Tm] int64: dirty victims counted
    plan_ptr,  # [Tm, P, 5] int64 as ``_rows_in_kernel``'s
    K, S, P, n_parts, clock,
    SEARCH: tl.constexpr,
    MAP: tl.constexpr,  # this launch updates the map (the last of the dtype groups)
    LOOKUP: tl.constexpr, TRAIN: tl.constexpr,
    CACHE: tl.constexpr, BACK: tl.constexpr,  # the cache's and the backing store's dtypes
    BLOCK_D: tl.constexpr,
):
    """One target in one program: its victim's dirty row goes back (its map entry
    forgotten), then the miss's row comes in (``_rows_in_kernel``'s work), every tensor pair
    in turn, so that the writes to host memory and the reads from it of different targets
    overlap on the link (both directions at once). The map is read before it changes:
    earlier dtype groups' launches do not update it, and in this one each program reads
    then writes its own slot."""
    g = tl.program_id(0).to(tl.int64)  # target g of all
    part = _part_of(parts_ptr, n_parts, g, 0, SEARCH)
    j = g - tl.load(part)
    slot = tl.load(order_ptr + tl.load(part + 5) + j)
    row = tl.load(new_rows_ptr + tl.load(part + 4) + j)
    table = tl.load(slot_info_ptr + slot).to(tl.int64)
    local = tl.load(slot_info_ptr + S + slot).to(tl.int64)
    victim = j >= tl.load(part + 3)  # past its part's free targets
    old = tl.load(row_of_slot_ptr + slot, mask=victim, other=0)
    dirty = victim & (tl.load(dirty_ptr + slot) != 0)
    for p in range(P):
        at = plan_ptr + (table * P + p) * 5
        n = tl.load(at + 4)
        if n > 0:
            cached = (tl.load(at + 2) + local * tl.load(at + 3)).to(tl.pointer_type(CACHE))
            if dirty:
                _copy_row(cached, (tl.load(at) + old * tl.load(at + 1)).to(
                    tl.pointer_type(BACK)), n, BLOCK_D)
                tl.debug_barrier()  # the slot's bytes out before the new row's in
            _copy_row((tl.load(at) + row * tl.load(at + 1)).to(tl.pointer_type(BACK)),
                      cached, n, BLOCK_D)
    if MAP:
        base = tl.load(table_row_base_ptr + table)
        if victim:
            if dirty:
                tl.atomic_add(written_ptr + table, 1)
            tl.store(slot_of_row_ptr + old + base, tl.load(slot_info_ptr + 2 * S + slot))
        tl.store(row_of_slot_ptr + slot, row)
        tl.store(slot_of_row_ptr + row + base, local.to(tl.int32))
        tl.store(last_seen_ptr + slot, clock.to(tl.int64))
        tl.store(counts_ptr + slot, tl.full([], LOOKUP, tl.int64))
        tl.store(dirty_ptr + slot, tl.full([], TRAIN, tl.uint8))


@triton.jit(do_not_specialize=["N"])
def _slots_kernel(rows_ptr, live_ptr, slot_of_row_ptr, indices_ptr, out_ptr, N,
                  BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < N
    live = tl.load(live_ptr + i, mask=valid, other=0) != 0
    rows = tl.load(rows_ptr + i, mask=valid & live, other=0)
    slot = tl.load(slot_of_row_ptr + rows, mask=valid & live, other=0)
    ids = tl.load(indices_ptr + i, mask=valid, other=0)
    tl.store(out_ptr + i, tl.where(live, slot.to(ids.dtype), ids), mask=valid)


_free_targets = Launcher(_free_targets_kernel)
_map_ids = Launcher(_map_ids_kernel)
_map_first = Launcher(_map_first_kernel)
_compact = Launcher(_compact_kernel)
_stamp = Launcher(_stamp_kernel)
_keys = Launcher(_keys_kernel)
_rows_in = Launcher(_rows_in_kernel)
_rows_swap = Launcher(_rows_swap_kernel)
_slots = Launcher(_slots_kernel)


def interpreted() -> bool:
    """These kernels run in Triton's interpreter (``TRITON_INTERPRET=1``: on CPU tensors)."""
    return getattr(_map_ids_kernel, "params", None) is None


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def map_ids(indices, offsets, B: int, T: int, feature_info, table_slots, slot_of_row,
            used, counts, code_top: int):
    """The first launch of ``DeviceMaps.map``: ``(rows, live (bool), local, code, table)``
    ``[N]``; ``used`` (bool ``[S]``) and ``counts`` (``[Tm, 6]``) zeros, filled."""
    N, dev = indices.numel(), indices.device
    indices = indices.contiguous()
    rows = torch.empty(N, dtype=torch.int64, device=dev)
    live = torch.empty(N, dtype=torch.bool, device=dev)
    local = torch.empty(N, dtype=torch.int64, device=dev)
    code = torch.empty(N, dtype=torch.int32, device=dev)
    table = torch.empty(N, dtype=torch.int32, device=dev)
    Tm, S = table_slots.shape[1], used.numel()
    search = max(1, (T + 1).bit_length())
    _map_ids((cdiv(N, BLOCK),), indices, offsets, feature_info, table_slots, slot_of_row,
             rows, _u8(live), local, code, table, _u8(used), counts, N, B, T, Tm, S, code_top,
             search, COUNTS, BLOCK)
    return rows, live, local, code, table


def map_first(rows, code, table, table_slots, slot_of_row, used, last_seen, dirty,
              slot_table, counts, clock: int):
    """The second launch: ``(first, free, cand)`` (bool); ``counts`` completed."""
    N, S, dev = rows.numel(), used.numel(), rows.device
    first = torch.empty(N, dtype=torch.bool, device=dev)
    free = torch.empty(S, dtype=torch.bool, device=dev)
    cand = torch.empty(S, dtype=torch.bool, device=dev)
    _map_first((cdiv(max(N, S), BLOCK),), rows, code, table, table_slots, slot_of_row,
               _u8(first), _u8(used), last_seen, _u8(dirty), slot_table, _u8(free),
               _u8(cand), counts, N, S, clock, COUNTS, BLOCK)
    return first, free, cand


def compact(first, local) -> torch.Tensor:
    """``[N]``: the first occurrences' ``local`` in id order (the rest undefined)."""
    N = first.numel()
    out = torch.empty(N, dtype=torch.int64, device=first.device)
    at = first.cumsum(0)
    _compact((cdiv(N, BLOCK),), _u8(first), at, local, out, N, BLOCK)
    return out


def stamp(used, last_seen, counts, dirty, clock: int, train: bool) -> None:
    """The slots ``used``: ``last_seen = clock``, ``counts += 1``, dirty when ``train``."""
    S = used.numel()
    _stamp((cdiv(S, BLOCK),), _u8(used), last_seen, counts, _u8(dirty), S, clock, train, BLOCK)


def keys(last_seen, counts, slot_local, slot_capacity, lfu, free, cand, slot_table,
         clock: int, with_lfu: bool, big: int, shift: int) -> torch.Tensor:
    """``DeviceMaps._keys``' key per slot (``with_lfu``: the LFU tables' packed keys;
    ``shift`` > 0: joint with the slot's table, the table in the bits from ``shift``)."""
    S = last_seen.numel()
    key = torch.empty(S, dtype=torch.int64, device=last_seen.device)
    _keys((cdiv(S, BLOCK),), last_seen, counts, slot_local, slot_capacity, _u8(lfu), _u8(free),
          _u8(cand), slot_table, key, S, clock, big, with_lfu, shift, BLOCK)
    return key


def free_targets(free, slot_table, table_slots, parts, K: int) -> torch.Tensor:
    """``[K]``: each table's first ``parts[t, 2]`` free slots (joint numbers, ascending)
    from ``parts[t, 0]`` on (``parts``: one row per table)."""
    S = free.numel()
    targets = torch.empty(K, dtype=torch.int64, device=free.device)
    cum = free.cumsum(0)
    _free_targets((cdiv(S, BLOCK),), _u8(free), cum, slot_table, table_slots, parts, targets,
                  S, table_slots.shape[1], BLOCK)
    return targets


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
       torch.float64: tl.float64, torch.int64: tl.int64, torch.int32: tl.int32,
       torch.uint8: tl.uint8, torch.int8: tl.int8}


class RowPlan:
    """Where each cached table's rows are, per tensor pair (weights, each optimizer state):
    per dtype pair ``(backing, cache)`` an int64 ``[Tm, P, 5]`` device table of the backing
    store's address and row stride, the cache's address and row stride, and the row's
    length (0: no such pair in this group). Made again only when an address changes."""

    def __init__(self, pairs: list[list[tuple[torch.Tensor, torch.Tensor]]],
                 device: torch.device) -> None:
        self.P = max(len(p) for p in pairs)
        groups: dict[tuple, list] = {}
        for t, table_pairs in enumerate(pairs):
            for p, (back, cache) in enumerate(table_pairs):
                groups.setdefault((back.dtype, cache.dtype), []).append((t, p, back, cache))
        self.groups = []
        for (bd, cd), members in groups.items():
            plan = torch.zeros(len(pairs), self.P, 5, dtype=torch.int64)
            for t, p, back, cache in members:
                n = back[0].numel() if back.dim() > 1 else 1
                plan[t, p] = torch.tensor([  # strides in bytes
                    back.data_ptr(), back.stride(0) * back.element_size(), cache.data_ptr(),
                    cache.stride(0) * cache.element_size(), n])
            self.groups.append((_TL[bd], _TL[cd], plan.to(device),
                                next_power_of_2(min(max(m[2][0].numel() if m[2].dim() > 1
                                                        else 1 for m in members), 256))))

    @staticmethod
    def fits(pairs: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> bool:
        """Every tensor's rows are contiguous and its dtype one the kernels know."""
        return all(t.dtype in _TL and (t.dim() == 1 or t[0].is_contiguous())
                   and t.stride(0) > 0
                   for table_pairs in pairs for pair in table_pairs for t in pair)

    @staticmethod
    def key(pairs) -> tuple:
        return tuple((b.data_ptr(), b.stride(0), b.dtype, b.shape, c.data_ptr(), c.stride(0),
                      c.dtype, c.shape) for table_pairs in pairs for b, c in table_pairs)


def _search(tables: int) -> int:
    """Binary search steps over at most ``tables`` parts (fixed per module: one compile)."""
    return max(1, (tables + 1).bit_length())


def rows_in(plan: RowPlan, parts, order, K: int, new_rows, slot_info, table_row_base,
            row_of_slot, slot_of_row, last_seen, counts, dirty, clock: int, lookup: bool,
            train: bool) -> None:
    """The ``K`` misses' rows (each part's from its first miss in ``new_rows``) into their
    targets; the targets' map entries."""
    S, n = row_of_slot.numel(), parts.shape[0]
    for g, (back, cache, table, block) in enumerate(plan.groups):
        _rows_in((K, plan.P), parts, order, new_rows, slot_info, table_row_base,
                 row_of_slot, slot_of_row, last_seen, counts, _u8(dirty), table, K, S, plan.P,
                 n, clock, _search(table_row_base.numel()), g == 0, int(lookup), int(train), back, cache, block)


def rows_swap(plan: RowPlan, parts, order, K: int, new_rows, slot_info, table_row_base,
              row_of_slot, slot_of_row, last_seen, counts, dirty, written, clock: int,
              lookup: bool, train: bool) -> None:
    """The victims out and the ``K`` misses in, one launch per dtype group: per target, its
    victim's dirty row back (if it is one), then the miss's row in; the map's entries in the
    last group's launch."""
    S, n = row_of_slot.numel(), parts.shape[0]
    last = len(plan.groups) - 1
    for g, (back, cache, table, block) in enumerate(plan.groups):
        _rows_swap((K,), parts, order, new_rows, slot_info, table_row_base, row_of_slot,
                   slot_of_row, last_seen, counts, _u8(dirty), written, table, K, S, plan.P,
                   n, clock, _search(table_row_base.numel()), g == last, int(lookup),
                   int(train), cache, back, block)


def slots_of(rows, live, slot_of_row, indices) -> torch.Tensor:
    """``indices`` with the ids of the tables mapped here (``live``) replaced by their
    slots (``slot_of_row[rows]``)."""
    indices = indices.contiguous()
    N = indices.numel()
    out = torch.empty_like(indices)
    _slots((cdiv(N, BLOCK),), rows, _u8(live), slot_of_row, indices, out, N, BLOCK)
    return out
