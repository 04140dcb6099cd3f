"""The Triton id index of a managed table: an open-addressing hash table, raw id -> slot.

``buckets [H]`` (H a power of two >= 2 * capacity) holds a slot number, ``EMPTY`` or
``TOMB`` (an erased entry, skipped by probes); a slot's raw id is ``keys[slot]``, so a probe
compares ids without storing them twice. Linear probing from ``hash(id) & (H - 1)``:

* ``_id_lookup_kernel``: BLOCK ids per program (repeats allowed) probe until their id or
  ``EMPTY``; with ``TOUCH`` a hit adds one to ``counts`` (``atomic_add``: integer sums do not
  depend on order) and stamps ``last_seen``;
* ``_id_erase_kernel``: the evicted slots' buckets become ``TOMB``;
* ``_id_insert_kernel``: new (id, slot) pairs claim the first ``EMPTY`` bucket of their probe
  with ``atomic_cas``; lanes that lose a race probe on. Which racing lane wins a bucket changes
  the table's layout, never a lookup's answer: the slots are the same on every run;
* ``_sketch_add_kernel`` / ``_sketch_min_kernel``: the admission count-min sketch (two
  launches, so every id of a step sees every other's increments, as the reference).

When live entries and tombstones pass 3/4 of H the table is rebuilt from ``keys`` and
``last_seen``. The ordering work of a step (distinct ids, first occurrences, free slots,
eviction order) is torch, shared with the CPU path in ``ops/id_remap.py``; the reference twin
of the whole remap is ``reference/id_remap.py``.
"""

import torch
import triton
import triton.language as tl

EMPTY = -1
TOMB = -2
BLOCK = 128


@triton.jit
def _bucket_of(x, H_MASK):
    """Home bucket of raw ids ``x`` (int64): a multiply-xorshift, masked."""
    h = x * 0x5851F42D4C957F2D
    h = h ^ (h >> 29)
    return h & H_MASK


@triton.jit(do_not_specialize=["N", "step"])
def _id_lookup_kernel(
    ids_ptr,  # [N] int64 raw ids (repeats allowed)
    buckets_ptr,  # [H] int64 slot, EMPTY or TOMB
    keys_ptr,  # [C] int64 raw id of each slot
    counts_ptr,  # [C] int64 (TOUCH) occurrences of each slot's id
    last_seen_ptr,  # [C] int64 (TOUCH) step that last saw it
    out_ptr,  # [N] int64 out: slot of each id, -1: none
    N,  # ids
    step,  # this training step (TOUCH)
    H_MASK,  # H - 1
    TOUCH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per BLOCK ids; each lane probes until its id or an EMPTY bucket
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(ids_ptr + offs, mask=mask, other=0)
    pos = _bucket_of(x, H_MASK)
    slot = tl.full([BLOCK], -1, tl.int64)
    active = mask
    while tl.max(active.to(tl.int32), axis=0) > 0:
        b = tl.load(buckets_ptr + pos, mask=active, other=-1)
        live = active & (b >= 0)
        k = tl.load(keys_ptr + b, mask=live, other=0)
        found = live & (k == x)
        slot = tl.where(found, b, slot)
        active = active & (~found) & (b != -1)
        pos = (pos + 1) & H_MASK
    if TOUCH:  # repeats of an id add atomically; they all store the same step
        hit = slot >= 0
        tl.atomic_add(counts_ptr + slot, tl.full([BLOCK], 1, tl.int64), mask=hit)
        tl.store(last_seen_ptr + slot, tl.zeros([BLOCK], tl.int64) + step, mask=hit)
    tl.store(out_ptr + offs, slot, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _id_erase_kernel(
    ids_ptr,  # [M] int64 raw ids leaving the table
    slots_ptr,  # [M] int64 their slots
    buckets_ptr,  # [H] int64 slot, EMPTY or TOMB
    M,  # ids
    H_MASK,  # H - 1
    BLOCK: tl.constexpr,
):
    # one program per BLOCK ids; each lane probes to the bucket holding its slot
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    x = tl.load(ids_ptr + offs, mask=mask, other=0)
    s = tl.load(slots_ptr + offs, mask=mask, other=-3)
    pos = _bucket_of(x, H_MASK)
    active = mask
    while tl.max(active.to(tl.int32), axis=0) > 0:
        b = tl.load(buckets_ptr + pos, mask=active, other=-1)
        found = active & (b == s)
        tl.store(buckets_ptr + pos, tl.full([BLOCK], -2, tl.int64), mask=found)
        active = active & (~found) & (b != -1)
        pos = tl.where(active, (pos + 1) & H_MASK, pos)


@triton.jit(do_not_specialize=["M"])
def _id_insert_kernel(
    ids_ptr,  # [M] int64 distinct raw ids not in the table
    slots_ptr,  # [M] int64 their slots
    buckets_ptr,  # [H] int64 slot, EMPTY or TOMB
    M,  # ids
    H_MASK,  # H - 1
    BLOCK: tl.constexpr,
):
    # one program per BLOCK ids; each lane claims the first EMPTY bucket of its probe
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    x = tl.load(ids_ptr + offs, mask=mask, other=0)
    s = tl.load(slots_ptr + offs, mask=mask, other=0)
    pos = _bucket_of(x, H_MASK)
    active = mask
    while tl.max(active.to(tl.int32), axis=0) > 0:
        # inactive lanes compare with -3, which no bucket holds: they write nothing
        expect = tl.where(active, tl.full([BLOCK], -1, tl.int64), tl.full([BLOCK], -3, tl.int64))
        old = tl.atomic_cas(buckets_ptr + pos, expect, s)
        won = active & (old == -1)
        active = active & (~won)
        pos = tl.where(active, (pos + 1) & H_MASK, pos)


@triton.jit
def _shr(h, K: tl.constexpr):
    """Logical right shift of int64 ``h`` (``>>`` is arithmetic on signed ints)."""
    return (h >> K) & ((1 << (64 - K)) - 1)


@triton.jit
def _sketch_bucket(x, r: tl.constexpr, W_MASK):
    """Counter of ids ``x`` in sketch row ``r``: reference/id_remap.py ``sketch_buckets``
    (splitmix64's finaliser of ``x + SKETCH_SEEDS[r]``, int64 wrapping)."""
    if r == 0:
        z = x + 0x1E3779B97F4A7C15
    elif r == 1:
        z = x + 0x3C6EF372FE94F82A
    elif r == 2:
        z = x + 0x5AA66D2C7DE0743F
    else:
        z = x + 0x78DDE6E5FD29F054
    z = (z ^ _shr(z, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ _shr(z, 27)) * -7723592293110705685  # 0x94D049BB133111EB
    z = z ^ _shr(z, 31)
    return z & W_MASK


@triton.jit(do_not_specialize=["M"])
def _sketch_add_kernel(
    ids_ptr,  # [M] int64 raw ids without a slot
    n_ptr,  # [M] int64 their occurrences in the step
    sketch_ptr,  # [DEPTH, W] int64 counters
    M,  # ids
    W,  # counters per row (a power of two)
    DEPTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per BLOCK ids; every lane adds its occurrences in each row
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    x = tl.load(ids_ptr + offs, mask=mask, other=0)
    n = tl.load(n_ptr + offs, mask=mask, other=0)
    for r in tl.static_range(DEPTH):
        b = _sketch_bucket(x, r, W - 1)
        tl.atomic_add(sketch_ptr + r * W + b, n, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sketch_min_kernel(
    ids_ptr,  # [M] int64 raw ids without a slot
    sketch_ptr,  # [DEPTH, W] int64 counters
    out_ptr,  # [M] int64 out: smallest counter of each id
    M,  # ids
    W,  # counters per row (a power of two)
    DEPTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # one program per BLOCK ids
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M
    x = tl.load(ids_ptr + offs, mask=mask, other=0)
    est = tl.full([BLOCK], 0x7FFFFFFFFFFFFFFF, tl.int64)
    for r in tl.static_range(DEPTH):
        b = _sketch_bucket(x, r, W - 1)
        est = tl.minimum(est, tl.load(sketch_ptr + r * W + b, mask=mask, other=0))
    tl.store(out_ptr + offs, est, mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(max(n, 1), BLOCK),)


class HashIndex:
    """The launchers, around one table's ``buckets``; ``ops/id_remap.py`` drives it (the same
    methods as the CPU path's ``SortedIndex``)."""

    def __init__(self, keys: torch.Tensor, last_seen: torch.Tensor) -> None:
        C = keys.numel()
        self.H = 1 << max(4, (2 * C - 1).bit_length())
        self.buckets = torch.empty(self.H, dtype=torch.int64, device=keys.device)
        self._keys, self._last_seen = keys, last_seen
        self._rebuild()

    def _rebuild(self) -> None:
        self.buckets.fill_(EMPTY)
        occupied = (self._last_seen >= 0).nonzero().squeeze(1)
        self.live, self.tombs = 0, 0
        self._insert(self._keys[occupied], occupied)

    def _insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        if ids.numel():
            _id_insert_kernel[_grid(ids.numel())](
                ids.contiguous(), slots.contiguous(), self.buckets, ids.numel(), self.H - 1,
                BLOCK=BLOCK,
            )
        self.live += ids.numel()

    def lookup(self, ids: torch.Tensor, counts: torch.Tensor, last_seen: torch.Tensor,
               step: int, touch: bool) -> torch.Tensor:
        """``[N]`` slot of each id (repeats allowed), -1 where it has none; ``touch``: every
        hit adds one to its slot's count and stamps it with ``step``."""
        out = torch.empty_like(ids)
        if ids.numel():
            _id_lookup_kernel[_grid(ids.numel())](
                ids.contiguous(), self.buckets, self._keys, counts, last_seen, out, ids.numel(),
                int(step), self.H - 1, TOUCH=touch, BLOCK=BLOCK,
            )
        return out

    def replace(self, old_keys: torch.Tensor, old_slots: torch.Tensor, new_keys: torch.Tensor,
                new_slots: torch.Tensor) -> None:
        """Erase the resident ``old_keys`` (at ``old_slots``), then insert the distinct
        non-resident ``new_keys`` at ``new_slots``."""
        if old_keys.numel():
            _id_erase_kernel[_grid(old_keys.numel())](
                old_keys.contiguous(), old_slots.contiguous(), self.buckets, old_keys.numel(),
                self.H - 1, BLOCK=BLOCK,
            )
            self.live -= old_keys.numel()
            self.tombs += old_keys.numel()
        if (self.live + self.tombs + new_keys.numel()) * 4 > self.H * 3:
            self._rebuild_after(old_slots, new_keys, new_slots)
            return
        self._insert(new_keys, new_slots)

    def _rebuild_after(self, old_slots: torch.Tensor, new_keys: torch.Tensor,
                       new_slots: torch.Tensor) -> None:
        """Too many tombstones: rebuild from the resident slots but ``old_slots`` and
        ``new_slots`` (being handed over: ``last_seen`` may still mark their old owners),
        then insert the new pairs."""
        self.buckets.fill_(EMPTY)
        keep = self._last_seen >= 0
        keep[old_slots] = False
        keep[new_slots] = False
        occupied = keep.nonzero().squeeze(1)
        self.live, self.tombs = 0, 0
        self._insert(self._keys[occupied], occupied)
        self._insert(new_keys, new_slots)

    @staticmethod
    def sketch_add(sketch: torch.Tensor, ids: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Add each id's ``n`` to its counter in every sketch row, then its smallest one."""
        depth, width = sketch.shape
        est = torch.empty_like(ids)
        grid = _grid(ids.numel())
        _sketch_add_kernel[grid](ids.contiguous(), n.contiguous(), sketch, ids.numel(), width,
                                 DEPTH=depth, BLOCK=BLOCK)
        _sketch_min_kernel[grid](ids.contiguous(), sketch, est, ids.numel(), width,
                                 DEPTH=depth, BLOCK=BLOCK)
        return est
