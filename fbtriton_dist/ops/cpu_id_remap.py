"""The fast CPU path's id index of a managed table: the resident keys sorted, with their slots.

Lookups are one ``searchsorted``; a step's replacements (evicted keys out, new keys in) are
one merge, ``O(C)`` copies instead of a re-sort. The batched algorithm around it, which the
Triton hash index (``kernels/id_remap.py``) shares, is ``ops/id_remap.py``.
"""

import torch

from fbtriton_dist.reference.id_remap import sketch_buckets


class SortedIndex:
    """Raw id -> slot of the occupied slots (``last_seen >= 0``)."""

    def __init__(self, keys: torch.Tensor, last_seen: torch.Tensor) -> None:
        occupied = (last_seen >= 0).nonzero().squeeze(1)
        self.keys, order = keys[occupied].sort()
        self.slots = occupied[order]

    def lookup(self, ids: torch.Tensor, counts: torch.Tensor, last_seen: torch.Tensor,
               step: int, touch: bool) -> torch.Tensor:
        """``[N]`` slot of each id (repeats allowed), -1 where it has none; ``touch``: every
        hit adds one to its slot's count and stamps it with ``step``."""
        if self.keys.numel() == 0:
            return torch.full_like(ids, -1)
        # sorted queries walk the keys in order (faster than random binary searches)
        queries, order = ids.sort()
        pos = torch.searchsorted(self.keys, queries).clamp_(max=self.keys.numel() - 1)
        slots = torch.empty_like(ids)
        slots[order] = torch.where(self.keys[pos] == queries, self.slots[pos], -1)
        if touch:
            hit = slots[slots >= 0]
            counts.index_add_(0, hit, torch.ones_like(hit))
            last_seen[hit] = step
        return slots

    def replace(self, old_keys: torch.Tensor, old_slots: torch.Tensor, new_keys: torch.Tensor,
                new_slots: torch.Tensor) -> None:
        """Drop the resident ``old_keys`` (their ``old_slots`` are not needed here), add the
        distinct non-resident ``new_keys`` at ``new_slots``."""
        keys, slots = self.keys, self.slots
        if old_keys.numel():
            keep = torch.ones_like(keys, dtype=torch.bool)
            keep[torch.searchsorted(keys, old_keys)] = False
            keys, slots = keys[keep], slots[keep]
        if new_keys.numel():
            nk, order = new_keys.sort()
            at = torch.searchsorted(keys, nk) + torch.arange(nk.numel(), device=nk.device)
            n = keys.numel() + nk.numel()
            rest = torch.ones(n, dtype=torch.bool, device=nk.device)
            rest[at] = False
            merged_k, merged_s = keys.new_empty(n), slots.new_empty(n)
            merged_k[at], merged_s[at] = nk, new_slots[order]
            merged_k[rest], merged_s[rest] = keys, slots
            keys, slots = merged_k, merged_s
        self.keys, self.slots = keys, slots

    @staticmethod
    def sketch_add(sketch: torch.Tensor, ids: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """Add each id's ``n`` to its counter in every sketch row, then its smallest one."""
        depth, width = sketch.shape
        buckets = sketch_buckets(ids, depth, width)
        for r in range(depth):
            sketch[r].index_add_(0, buckets[r], n)
        return sketch.gather(1, buckets).amin(0)

