"""The id remap of a managed table, slow and obvious: the spec of ``ops/id_remap.py`` (the fast
CPU path and the Triton hash-table kernels of ``kernels/id_remap.py`` must agree with it
exactly: the same slots, the same evictions, the same state).

State of a table of ``C`` slots (the default row is row ``C``):

* ``keys [C]`` int64: the raw id in each slot (meaningless where the slot is empty);
* ``counts [C]`` int64: occurrences of the slot's id since it got the slot (LFU);
* ``last_seen [C]`` int64: the training step that last saw it; ``-1``: the slot is empty;
* ``sketch [depth, W]`` int64: the admission count-min sketch (``W = 0``: no admission).

One training step (``update=True``) remaps the batch ``ids [N]`` in this order:

1. ``ttl``: every slot with ``last_seen < step - ttl_steps`` is freed (expired): its id was
   not seen in the last ``ttl_steps`` steps ``[step - ttl_steps, step)``.
2. The batch's distinct ids, in order of first occurrence; each one's occurrences ``n``.
3. Hits (ids with a slot): ``counts += n``, ``last_seen = step``.
4. Misses: with ``min_count > 1``, first every miss adds ``n`` to its counter in each sketch
   row, then a miss is admitted if its smallest counter is ``>= min_count`` (so ids of one
   batch sharing counters see each other's occurrences: the result does not depend on order).
   Not admitted: rejected, the default row.
5. The admitted ids, in first-occurrence order, take the empty slots in ascending slot order;
   then, if the table is full, ``lru`` / ``lfu`` evict slots this step has not touched
   (``last_seen < step``), in ascending ``(last_seen, slot)`` (lru) or ``(counts, last_seen,
   slot)`` (lfu) order; admitted ids left without a slot (every slot used this step, or
   ``ttl``, which evicts nothing) overflow to the default row; ``none`` raises a ValueError
   naming the table (the hits and the sketch have counted the step). A new slot starts at
   ``counts = n``, ``last_seen = step``. ``step`` grows by at least one between updates.

Eval (``update=False``) only looks up: misses read the default row, nothing changes.
Returns ``(slots [N], fresh [M])``: each id's row, and the slots given a new id this step in
the order they were assigned (their rows and optimizer states are the caller's to reset).
``stats [len(STATS)]`` is overwritten with this step's numbers.
"""

import torch

NONE, LRU, LFU, TTL = 0, 1, 2, 3
STATS = ("lookups", "hits", "default_reads", "admitted", "rejected", "overflow", "evicted",
         "expired")
"""``stats`` fields: ids looked up, of them those whose id had a slot before the step, those
read from the default row; distinct ids admitted (given a slot), rejected (below
``min_count``), overflowed (admitted, no slot free); slots evicted for a new id; expired."""
SKETCH_SEEDS = (0x1E3779B97F4A7C15, 0x3C6EF372FE94F82A, 0x5AA66D2C7DE0743F,
                0x78DDE6E5FD29F054)
"""One seed per sketch row (at most 4 rows), added to the id before the mix."""
_MIX = (0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))
"""splitmix64's finaliser multipliers, as signed int64."""


def _shr(h: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``h`` by ``k`` (torch's ``>>`` is arithmetic)."""
    return (h >> k) & ((1 << (64 - k)) - 1)


def sketch_buckets(ids: torch.Tensor, depth: int, width: int) -> torch.Tensor:
    """``[depth, n]`` counter of each id in each sketch row: splitmix64's finaliser of
    ``z = id + S_r`` (int64, wrapping; ``>>>`` logical): ``z = (z ^ z >>> 30) * M1``,
    ``z = (z ^ z >>> 27) * M2``, ``z ^= z >>> 31``, then ``z & (width - 1)``. Every bit of
    the id moves every bit of ``z``, so ids differing only in high bits get other counters;
    the counter at a smaller width ``w`` is the one at ``width`` mod ``w`` (``fold_sketch``)."""
    rows = []
    for r in range(depth):
        z = ids.to(torch.int64) + SKETCH_SEEDS[r]
        z = (z ^ _shr(z, 30)) * _MIX[0]
        z = (z ^ _shr(z, 27)) * _MIX[1]
        z = z ^ _shr(z, 31)
        rows.append(z & (width - 1))
    return torch.stack(rows) if rows else ids.new_zeros((0, ids.numel()))


def table_full_error(table: str, capacity: int, wanted: int, free: int) -> ValueError:
    return ValueError(
        f"table '{table}' is full with eviction 'none': {wanted} new ids admitted this step, "
        f"{free} of its capacity {capacity} slots free; raise capacity or choose an eviction "
        f"(lru, lfu, ttl)"
    )


def id_remap(
    ids: torch.Tensor,  # [N] int64 raw ids
    keys: torch.Tensor,  # [C] int64
    counts: torch.Tensor,  # [C] int64
    last_seen: torch.Tensor,  # [C] int64, -1: empty
    sketch: torch.Tensor,  # [depth, W] int64 (W = 0 without admission)
    stats: torch.Tensor,  # [len(STATS)] int64 out
    *,
    step: int,
    policy: int,
    ttl_steps: int = 0,
    min_count: int = 1,
    update: bool = True,
    table: str = "table",
) -> tuple[torch.Tensor, torch.Tensor]:
    C = keys.numel()
    out = dict.fromkeys(STATS, 0)
    out["lookups"] = ids.numel()
    if update and policy == TTL:
        for s in range(C):
            if 0 <= last_seen[s] < step - ttl_steps:
                last_seen[s], counts[s] = -1, 0
                out["expired"] += 1
    n: dict[int, int] = {}  # distinct ids in first-occurrence order (dicts keep it)
    for x in ids.tolist():
        n[x] = n.get(x, 0) + 1
    resident = {int(keys[s]): s for s in range(C) if last_seen[s] >= 0}
    slot_of = {x: resident[x] for x in n if x in resident}
    out["hits"] = sum(n[x] for x in slot_of)
    fresh: list[int] = []
    if update:
        for x, s in slot_of.items():
            counts[s] += n[x]
            last_seen[s] = step
        misses = [x for x in n if x not in slot_of]
        admitted = misses
        if min_count > 1 and misses:
            depth, width = sketch.shape
            buckets = sketch_buckets(torch.tensor(misses, dtype=torch.int64), depth, width)
            for j, x in enumerate(misses):
                for r in range(depth):
                    sketch[r, buckets[r, j]] += n[x]
            admitted = [
                x for j, x in enumerate(misses)
                if min(int(sketch[r, buckets[r, j]]) for r in range(depth)) >= min_count
            ]
        out["rejected"] = len(misses) - len(admitted)
        free = [s for s in range(C) if last_seen[s] < 0]
        if policy == NONE and len(admitted) > len(free):
            raise table_full_error(table, C, len(admitted), len(free))
        victims: list[int] = []
        if len(admitted) > len(free) and policy in (LRU, LFU):
            untouched = [s for s in range(C) if 0 <= last_seen[s] < step]
            if policy == LRU:
                untouched.sort(key=lambda s: (int(last_seen[s]), s))
            else:
                untouched.sort(key=lambda s: (int(counts[s]), int(last_seen[s]), s))
            victims = untouched[: len(admitted) - len(free)]
        for x, s in zip(admitted, free + victims, strict=False):
            keys[s], counts[s], last_seen[s] = x, n[x], step
            slot_of[x] = s
            fresh.append(s)
        out["admitted"] = len(fresh)
        out["overflow"] = len(admitted) - len(fresh)
        out["evicted"] = len(victims)
    slots = [slot_of.get(x, C) for x in ids.tolist()]
    out["default_reads"] = sum(1 for s in slots if s == C)
    stats.copy_(torch.tensor([out[k] for k in STATS], dtype=torch.int64))
    return (torch.tensor(slots, dtype=torch.int64, device=ids.device),
            torch.tensor(fresh, dtype=torch.int64, device=ids.device))
