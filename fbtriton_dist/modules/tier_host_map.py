"""The host slot maps of a module's cached tables (``modules/tiers.py``) in one C call per
batch (``ops/tier_native.py``'s ``tier_assign_tables``: ``tier_assign`` for each table in a
row), for the usual case: the C helpers built, every table with one feature, no rows read
ahead, every (backing store, cache) pair of one dtype and row shape. The call's arguments
(``ASSIGN_ARGS`` int64 per table: the addresses of the map's tensors, of the caches and
backing stores, of the work space) are made once and only the batch's few change per step;
they are made again when an address changes (``key``). Elsewhere ``RowCache.assign`` maps
table by table, with the same slots."""

import ctypes
import math
from collections.abc import Callable

import torch

from fbtriton_dist.ops import tier_native

_IDS, _N, _BATCH, _CLOCK, _TRAIN, _WORK, _OUT = 0, 1, 7, 11, 13, 18, 19
"""Where the per-batch arguments are among a table's ``ASSIGN_ARGS``."""
_MAPS = ("slot_of_row", "row_of_slot", "stamp", "last_seen", "counts", "dirty")


def key_of(caches: dict, views_key: tuple) -> tuple:
    """What the call's arguments are made of: the slot views' key (the module's flat
    tensors' addresses) and every cache's map and backing store tensors' addresses."""
    return (views_key, *[getattr(c, name).data_ptr() for c in caches.values() for name in _MAPS],
            *[t.data_ptr() for c in caches.values()
              for t in (c.backing.weight, *c.backing.states.values())])


class HostMaps:
    """The call's arguments for the caches ``caches`` (table -> ``RowCache``, maps on the
    host), each table's ids being feature ``feature_of[t]``'s; ``views(t)``: table t's slots.
    ``usable`` is False where a pair is not ``swappable`` (then nothing else is made)."""

    def __init__(self, lib, caches: dict, feature_of: dict[int, int],
                 views: Callable[[int], tuple], key: tuple) -> None:
        self.key, self.caches, self.feature_of = key, caches, feature_of
        self.usable = True
        pairs = {t: c.pairs_of(views(t)) for t, c in caches.items()}
        if not all(tier_native.swappable(cache, back) for ps in pairs.values()
                   for back, cache in ps):
            self.usable = False
            return
        K, A = len(caches), tier_native.ASSIGN_ARGS
        self._fn = lib.tier_assign_tables
        self.args = (ctypes.c_int64 * (K * A))()
        self.info = (ctypes.c_int64 * (5 * K + 1))()
        self._keep = []  # the ctypes arrays and tensors whose addresses the arguments hold
        for k, (t, c) in enumerate(caches.items()):
            ps = pairs[t]
            arrays = ((ctypes.c_void_p * len(ps))(*(cache.data_ptr() for _, cache in ps)),
                      (ctypes.c_void_p * len(ps))(*(back.data_ptr() for back, _ in ps)),
                      (ctypes.c_int64 * len(ps))(*(math.prod(cache.shape[1:])
                                                   * cache.element_size() for _, cache in ps)))
            self._keep.append((arrays, ps))
            row = [0, 0, c.slot_of_row.data_ptr(), c.rows, c.slots, c.row_of_slot.data_ptr(),
                   c.stamp.data_ptr(), 0, c.last_seen.data_ptr(), c.counts.data_ptr(),
                   c.dirty.data_ptr(), 0, int(c.lfu), 0, len(ps),
                   *(ctypes.addressof(a) for a in arrays), 0, 0]
            self.args[k * A : (k + 1) * A] = row
        self._scratch: list[torch.Tensor | None] = [None] * K

    def run(self, indices: torch.Tensor, out: torch.Tensor, bounds: list[int], clock: int,
            train: bool, fail: Callable[[object, int, int, int, dict], None]) -> None:
        """Map the batch: ``indices`` ``[N]`` (host int64, contiguous), ``out`` ``[N]`` int64
        where each table's feature range (``bounds``: the features' starts, then N) gets its
        slots. Every table's ``stats`` are counted; at the first table whose code is not 0,
        ``fail(cache, code, start, end, counts)`` raises (the tables before it are mapped)."""
        A = tier_native.ASSIGN_ARGS
        args, ids_at, out_at = self.args, indices.data_ptr(), out.data_ptr()
        size = indices.element_size()
        for k, (t, c) in enumerate(self.caches.items()):
            f = self.feature_of[t]
            a, n = bounds[f], bounds[f + 1] - bounds[f]
            need = tier_native.scratch_size(c.slots, n)
            s = self._scratch[k]
            if s is None or s.numel() < need:
                s = self._scratch[k] = torch.empty(need, dtype=torch.int64)
                args[k * A + _WORK] = s.data_ptr()
            c.batches += 1
            at = k * A
            args[at + _IDS] = ids_at + a * size
            args[at + _N] = n
            args[at + _BATCH] = c.batches
            args[at + _CLOCK] = clock
            args[at + _TRAIN] = int(train)
            args[at + _OUT] = out_at + a * size
        code = self._fn(len(self.caches), args, self.info)
        done = self.info[5 * len(self.caches)] if code else len(self.caches)
        info = self.info
        for k, (t, c) in enumerate(self.caches.items()):
            if k == done:
                f = self.feature_of[t]
                fail(c, code, bounds[f], bounds[f + 1],
                     dict(zip(tier_native.INFO, info[5 * k : 5 * k + 5], strict=True)))
                return
            stats = c.stats
            stats["lookups"] += info[5 * k] + info[5 * k + 1]
            stats["evictions"] += info[5 * k + 2]
            stats["misses"] += info[5 * k + 3]
            stats["writebacks"] += info[5 * k + 4]
