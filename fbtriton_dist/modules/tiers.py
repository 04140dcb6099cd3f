"""Storage tiers of a TableBatchedEmbedding's tables (``fbtriton_dist.storage``): the row
cache of the ``cached`` and ``file`` tiers.

A cached table of E rows keeps all of them, and their fused optimizer state, in a *backing
store* (``Backing``: host tensors, pinned when the module is on CUDA; or memory-mapped files
for ``file``) and C of them in *slots* on the compute device: the table's part of the TBE's
flat weights and optimizer state, C rows instead of E. Before every lookup
(``TieredTables.remap``) each cached table's distinct ids of the batch are mapped to slots by
the managed tables' id map (``ops.id_remap``: LRU or LFU; a slot used by the current batch is
never a victim); a miss's slot, if it held a row, is written back (row and state) when dirty,
then the missing row and its state are loaded into it; the ids become slots and the TBE's
lookup and fused backward run on a table of C rows, so the update lands in the cache. A
training batch (fused optimizer, grad enabled) marks its slots dirty and pins them until its
backward has run (``track``): the map's clock does not advance while one is pending, so they
stay "used now" for later forwards. ``flush`` writes every dirty slot back.

Where the map lives: on the host (the C pass of ``ops/tier_native.py``, or torch ops), the
default on the CPU and for ``file`` tables; or on the cache's device (``tier_device_map.py``:
device ops, one host read of a few counts per step), the default for ``cached`` tables on CUDA
and on the CPU with ``FBTD_SLOT_MAP=device`` (``TieredTables.place``).
"""

import contextlib
import time
import weakref
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from fbtriton_dist import graphs, knobs
from fbtriton_dist.modules import tier_device_map, tier_host_map, tier_ids
from fbtriton_dist.modules.tier_backing import Backing, copy_rows
from fbtriton_dist.ops import host_mapped, tier_native
from fbtriton_dist.ops.id_remap import pick_victims
from fbtriton_dist.storage import Storage

Views = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""A cached table's slots as the kernels read them: ``[C, D]`` weights and each optimizer
state by name (``[C]`` per row, ``[C, D]`` per element)."""


class Staged:
    """Rows of one cached table read from its backing store ahead of the lookup that needs
    them (``TieredTables.prefetch``): ``rows`` ``[P]`` ascending, ``weight`` ``[P, D]`` and
    each optimizer state ``[P]`` / ``[P, D]``. Read on a worker thread while the cache may
    write rows back: ``RowCache`` records what it writes back meanwhile (``written``) and
    never uses a staged copy of such a row."""

    def __init__(self, rows: torch.Tensor, weight: torch.Tensor,
                 states: dict[str, torch.Tensor]) -> None:
        self.rows, self.weight, self.states = rows, weight, states


class RowCache:
    """One cached table's slot map, LRU or LFU (the managed tables' rules: ``ops.id_remap``),
    and its ``Backing``. Per slot: the row in it (``row_of_slot``, -1: free), the map clock
    when a batch last used it (``last_seen``, -1: free), in how many batches it was used since
    it was loaded (``counts``, LFU), whether it is ``dirty``; per row, its slot
    (``slot_of_row`` ``[E]`` int32, C: not cached): a lookup is one gather, whatever the
    number of slots. The map costs 4 bytes per row of the table, next to its ``D`` elements
    and optimizer state in the backing store."""

    STATS = ("lookups", "misses", "evictions", "writebacks", "prefetched", "prefetch_used",
             "prefetch_us", "prefetch_wait_us")
    """``cache_stats()`` keys: distinct rows looked up, rows loaded (misses), rows evicted,
    rows written back; prefetch: rows read ahead, rows loaded from what was read ahead,
    microseconds the worker spent, microseconds lookups waited for it."""

    def __init__(self, name: str, storage: Storage, rows: int, dim: int, dtype: torch.dtype,
                 pin: bool) -> None:
        self.name, self.storage, self.rows, self.dim = name, storage, rows, dim
        self.slots = storage.slots(rows)
        self.backing = Backing(name, storage, rows, dim, dtype, pin)
        self.lfu = storage.policy == "lfu"
        self.row_of_slot = torch.full((self.slots,), -1, dtype=torch.int64)
        self.last_seen = torch.full((self.slots,), -1, dtype=torch.int64)
        self.counts = torch.zeros(self.slots, dtype=torch.int64)
        self.dirty = torch.zeros(self.slots, dtype=torch.bool)
        self.slot_of_row = torch.full((rows,), self.slots, dtype=torch.int32)
        self.stamp = torch.full((self.slots,), -1, dtype=torch.int64)  # native: batch of use
        self.batches = 0
        self.scratch: torch.Tensor | None = None  # the C helpers' work space (int64)
        self._assigner: tier_native.Assigner | None = None  # the one-call map's arguments
        self.stats = dict.fromkeys(self.STATS, 0)
        self.written: list[torch.Tensor] | None = None  # rows written back while staging
        self.on_device = False  # the map lives on the cache's device (``place_map``)
        self.touches = 0  # lookups since the map moved there: bounds every count (LFU keys)
        self.written_on_device: torch.Tensor | None = None  # write-backs not yet in stats
        self._views_key: tuple | None = None
        self._views: list[torch.Tensor] = []

    def __getstate__(self) -> dict:
        """A copy leaves the backing store's device views behind (made again when needed)."""
        return {**self.__dict__, "_views_key": None, "_views": [], "scratch": None,
                "_assigner": None}

    def place_map(self, device: torch.device | None) -> None:
        """The slot map's tensors onto ``device`` (the cache's device: ``tier_device_map``)
        or, None, the host (the C pass or torch ops), keeping their contents."""
        self.fold_stats()
        to = torch.device("cpu") if device is None else torch.device(device)
        for name in ("row_of_slot", "last_seen", "counts", "dirty", "slot_of_row"):
            setattr(self, name, getattr(self, name).to(to))
        self.on_device = device is not None
        self.written_on_device = (torch.zeros((), dtype=torch.int64, device=to)
                                  if self.on_device else None)
        if self.on_device:
            self.touches = max(self.touches, int(self.counts.max()))
        self._views_key, self._views = None, []

    def fold_stats(self) -> None:
        """The write-backs counted on the device into ``stats`` (a host read)."""
        if self.written_on_device is not None:
            self.stats["writebacks"] += int(self.written_on_device)
            self.written_on_device.zero_()

    def backing_views(self, device: torch.device) -> list[torch.Tensor]:
        """The backing store's weights and states as tensors of ``device`` over the same
        memory: on CUDA its pinned host tensors mapped (``ops/host_mapped.py``; a kernel reads
        and writes them over PCIe), elsewhere the tensors themselves. Made once per set of
        backing tensors."""
        if device.type == "cuda" and not all(
                host_mapped.cuda_addressable(t)
                for t in (self.backing.weight, *self.backing.states.values())):
            self.backing.pin = False  # a copy of the module holds pageable copies
            self.backing.pin_now()
        tensors = [self.backing.weight, *self.backing.states.values()]
        key = (device, tuple(t.data_ptr() for t in tensors))
        if key != self._views_key:
            if device.type == "cuda":
                index = torch.cuda.current_device() if device.index is None else device.index
                self._views = [host_mapped.wrap(t, host_mapped.DL_CUDA, index) for t in tensors]
            else:
                self._views = tensors
            self._views_key = key
        return self._views

    def device_pairs(self, views: Views) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(backing store as a tensor of the cache's device, cache) of the weights and of each
        optimizer state."""
        weight, states = views
        backs = self.backing_views(weight.device)
        return list(zip(backs, [weight, *(states[n] for n in self.backing.states)], strict=True))

    def invalidate(self) -> None:
        """Forget every slot (nothing written back): the backing store was rewritten."""
        self.row_of_slot.fill_(-1)
        self.last_seen.fill_(-1)
        self.counts.zero_()
        self.dirty.zero_()
        self.slot_of_row.fill_(self.slots)

    def resident(self) -> list[int]:
        """The rows in the cache, ascending."""
        return sorted(self.row_of_slot[self.row_of_slot >= 0].tolist())

    def pairs_of(self, views: Views) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(backing store, cache) of the weights and of each optimizer state."""
        return self._pairs(views)

    def _pairs(self, views: Views) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(backing store, cache) of the weights and of each optimizer state."""
        weight, states = views
        return [(self.backing.weight, weight),
                *((b, states[n]) for n, b in self.backing.states.items())]

    def _write_back(self, slots: torch.Tensor, views: Views) -> None:
        rows = self.row_of_slot.index_select(0, slots)
        for backing, cache in self._pairs(views):
            copy_rows(backing, rows, cache, slots)
        if self.written is not None:
            self.written.append(rows)
        self.stats["writebacks"] += int(slots.numel())

    def _sources(self, rows: torch.Tensor, staged: Staged | None
                 ) -> list[tuple[torch.Tensor | None, list[torch.Tensor], torch.Tensor]]:
        """Where rows ``rows`` ``[M]`` are read from: ``(positions in rows, None: all; per
        tensor (weights, each state) its source; the rows of the sources)``. ``staged``'s
        copies where it has one that no write-back has made stale, else the backing store."""
        backing = [self.backing.weight, *self.backing.states.values()]
        if staged is None or not staged.rows.numel():
            return [(None, backing, rows)]
        pos = torch.searchsorted(staged.rows, rows).clamp_(max=staged.rows.numel() - 1)
        ok = staged.rows[pos] == rows
        if self.written:
            ok &= ~torch.isin(staged.rows, torch.cat(self.written))[pos]
        used = int(ok.sum())
        if not used:
            return [(None, backing, rows)]
        self.stats["prefetch_used"] += used
        at, rest = ok.nonzero().squeeze(1), (~ok).nonzero().squeeze(1)
        copies = [staged.weight, *(staged.states[n] for n in self.backing.states)]
        out = [(at, copies, pos.index_select(0, at))]
        if rest.numel():
            out.append((rest, backing, rows.index_select(0, rest)))
        return out

    def _load(self, slots: torch.Tensor, views: Views, sources) -> None:
        """Rows and their state into ``slots``, from ``_sources``."""
        pairs = self._pairs(views)
        for at, srcs, src_at in sources:
            into = slots if at is None else slots.index_select(0, at)
            for (_, cache), src in zip(pairs, srcs, strict=True):
                copy_rows(cache, into, src, src_at)

    def stage(self, ids: torch.Tensor) -> Staged:
        """Read ahead the rows of ``ids`` (any int64, repeats allowed) that are not cached now
        (ids out of range are left to the lookup's check). Runs on the prefetch worker."""
        ids = ids.masked_select((ids >= 0) & (ids < self.rows))
        rows = torch.unique(ids.masked_select(self.slot_of_row.index_select(0, ids) >= self.slots))
        weight = self.backing.weight.index_select(0, rows)
        states = {n: b.index_select(0, rows) for n, b in self.backing.states.items()}
        return Staged(rows, weight, states)

    def _distinct(self, ids: torch.Tensor) -> torch.Tensor:
        """The distinct values of ``ids`` (rows not cached, repeats allowed) in the order they
        first occur (as the native pass gives them), without a sort: every occurrence writes
        a code of its position into its row's (free) entry of ``slot_of_row``, the largest
        code (the first position) stays, and the occurrences that find their own code are
        kept; the entries are put back."""
        C = self.slots
        code = torch.arange(C + 1 + ids.numel(), C + 1, -1, dtype=torch.int32)
        self.slot_of_row.scatter_reduce_(0, ids, code, "amax")
        first = ids.masked_select(self.slot_of_row.index_select(0, ids) == code)
        self.slot_of_row.index_fill_(0, first, C)
        return first

    def assign(self, ids: torch.Tensor, clock: int, views: Views, train: bool,
               pinned: bool, staged: Staged | None = None, out: torch.Tensor | None = None,
               check: Callable[[], None] | None = None) -> torch.Tensor:
        """Slots ``[N]`` (int64) of the rows ``ids`` ``[N]`` (int64 on the host, repeats
        allowed), loading the misses (after writing back the dirty rows they evict; from
        ``staged`` where it has them). ``train``: the slots become dirty. ``pinned``: earlier
        batches' slots are still pinned (for the message). ``check``: raises on ids out of
        ``[0, rows)`` (naming them); None: they are in range. ``out``: an int64 contiguous
        ``[N]`` the slots may be written into (then returned)."""
        C = self.slots
        lib = tier_native.library()
        if (lib is not None and staged is None and self.written is None
                and C + 1 + ids.numel() < 2**31):
            pairs = self._pairs(views)
            key = (self.slot_of_row.data_ptr(), self.row_of_slot.data_ptr(),
                   self.stamp.data_ptr(), self.last_seen.data_ptr(), self.counts.data_ptr(),
                   self.dirty.data_ptr(), *[t.data_ptr() for pair in pairs for t in pair])
            if (self._assigner is not None and self._assigner.key == key) or all(
                    tier_native.swappable(c, b) for b, c in pairs):
                return self._assign_native(lib, ids, clock, pairs, key, train, pinned, out,
                                           check)
        if check is not None:
            check()
        if lib is not None:  # one pass in C
            ids = ids.contiguous()
            self.batches += 1
            mapped = tier_native.map_ids(lib, ids, self.slot_of_row, C, self.stamp,
                                         self.batches)
            if mapped is None:
                raise ValueError(f"table '{self.name}': expected ids in [0, {self.rows})")
            H, new = mapped
        else:
            slot = self.slot_of_row.index_select(0, ids)  # C: not cached
            used = torch.zeros(C + 1, dtype=torch.bool)
            used.index_fill_(0, slot.long(), True)
            used = used[:C]
            new = self._distinct(ids.masked_select(slot == C))
            H = int(used.sum())
        M = int(new.numel())
        U = H + M
        if U > C:
            self._too_many(U)
        self.stats["lookups"] += U
        if H and lib is not None:
            tier_native.touch(lib, self.stamp, self.batches, self.last_seen, self.counts, clock)
        elif H:
            self.last_seen.masked_fill_(used, clock)
            self.counts += used
        if M:
            self._take_slots(new, clock, views, staged, pinned, U)
        if lib is not None:
            return tier_native.slots_of(lib, ids, self.slot_of_row, self.dirty, train)
        slots = (self.slot_of_row.index_select(0, ids) if M else slot).long()
        if train:
            self.dirty.index_fill_(0, slots, True)
        return slots

    def _assign_native(self, lib, ids: torch.Tensor, clock: int,
                       pairs: list[tuple[torch.Tensor, torch.Tensor]], key: tuple,
                       train: bool, pinned: bool, out: torch.Tensor | None,
                       check: Callable[[], None] | None) -> torch.Tensor:
        """``assign`` in one C call (``tier_native.Assigner``): no rows read ahead for this
        table, every (backing store, cache) pair of one dtype and row shape; ``key``: the
        addresses of the map's tensors and of ``pairs`` (a new ``Assigner`` when they
        change). Its pass checks the ids; ``check`` runs only when one is out of range
        (nothing has changed then)."""
        ids = ids.contiguous()
        need = tier_native.scratch_size(self.slots, ids.numel())
        if self.scratch is None or self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.int64)
            self._assigner = None
        if self._assigner is None or self._assigner.key != key:
            maps = {"slot_of_row": self.slot_of_row, "row_of_slot": self.row_of_slot,
                    "stamp": self.stamp, "last_seen": self.last_seen, "counts": self.counts,
                    "dirty": self.dirty}
            self._assigner = tier_native.Assigner(lib, maps, pairs, self.scratch, self.lfu,
                                                  key)
        self.batches += 1
        if out is None or not (out.dtype == torch.int64 and out.device.type == "cpu"
                               and out.is_contiguous() and out.numel() == ids.numel()):
            out = torch.empty(ids.numel(), dtype=torch.int64)
        code, counts = self._assigner(ids, out, self.batches, clock, train)
        self.count_native(code, dict(zip(tier_native.INFO, counts, strict=True)), check, pinned)
        return out

    def count_native(self, code: int, n: dict[str, int], check: Callable[[], None] | None,
                     pinned: bool) -> None:
        """After ``tier_assign`` of this table (its code and ``tier_native.INFO`` counts
        ``n``): the stats counted, or the error raised (``check`` names an id out of range)."""
        if code == -1:
            if check is not None:
                check()
            raise ValueError(f"table '{self.name}': expected ids in [0, {self.rows})")
        U = n["hits"] + n["misses"]
        if code == -2:
            self._too_many(U)
        stats = self.stats
        stats["lookups"] += U
        stats["evictions"] += n["victims"]
        stats["misses"] += n["taken"]
        stats["writebacks"] += n["written"]
        if code == -3:
            self._no_slot(n["misses"] - n["taken"], U, pinned)

    def _too_many(self, U: int) -> None:
        raise ValueError(
            f"table '{self.name}' (tier {self.storage.tier!r}): a batch reads {U} distinct "
            f"rows, its cache has {self.slots} slots (of {self.rows} rows); raise "
            f"cache_load_factor or cache_slots to at least {U} / {U / self.rows:.3g}"
        )

    def _no_slot(self, left: int, U: int, pinned: bool) -> None:
        raise ValueError(
            f"table '{self.name}' (tier {self.storage.tier!r}): {left} of "
            f"the batch's {U} distinct rows found no slot of {self.slots}: the others hold "
            "rows of this batch"
            + (" or rows pinned by training batches whose backward has not run" if pinned
               else "") + "; raise cache_load_factor or cache_slots"
        )

    def _take_slots(self, new: torch.Tensor, clock: int, views: Views, staged: Staged | None,
                    pinned: bool, U: int) -> None:
        """Slots for the rows ``new`` (not cached, in the order they first occur in the batch):
        free ones (ascending), then the victims (LRU / LFU order) among the slots not used at
        ``clock``; load them."""
        M = int(new.numel())
        lib = tier_native.library()
        free = (self.last_seen < 0).nonzero().squeeze(1)
        victims = None
        if M > free.numel() and lib is not None:
            need = tier_native.scratch_size(self.slots, 0)
            if self.scratch is None or self.scratch.numel() < need:
                self.scratch = torch.empty(need, dtype=torch.int64)
            victims = tier_native.victims(lib, self.last_seen, self.counts if self.lfu else None,
                                          clock, M - free.numel(), self.scratch)
        if victims is None and M > free.numel():
            cand = ((self.last_seen >= 0) & (self.last_seen < clock)).nonzero().squeeze(1)
            need = min(M - free.numel(), cand.numel())
            victims = pick_victims(cand, self.last_seen, self.counts if self.lfu else None,
                                   need) if need else free[:0]
        if victims is None:
            victims = free[:0]
        targets = torch.cat([free[:M], victims]) if victims.numel() else free[:M]
        got = new[: targets.numel()]
        self.stats["evictions"] += int(victims.numel())
        self.stats["misses"] += int(targets.numel())
        pairs = self._pairs(views)
        sources = self._sources(got, staged)
        if lib is not None and all(tier_native.swappable(c, b) for b, c in pairs) and all(
                tier_native.swappable(c, src) for _, srcs, _ in sources
                for (_, c), src in zip(pairs, srcs, strict=True)):
            # one pass per tensor: each dirty victim's row out, then the new row in
            if self.written is not None and victims.numel():
                self.written.append(self.row_of_slot.index_select(
                    0, victims.masked_select(self.dirty.index_select(0, victims))))
            for at, srcs, src_at in sources:
                into = targets if at is None else targets.index_select(0, at)
                for i, ((backing, cache), src) in enumerate(zip(pairs, srcs, strict=True)):
                    n = tier_native.swap_rows(lib, cache, backing, into, src_at,
                                              self.row_of_slot, self.dirty, src)
                    if i == 0:
                        self.stats["writebacks"] += n
        else:
            if victims.numel():
                out = victims.masked_select(self.dirty.index_select(0, victims))
                if out.numel():
                    self._write_back(out, views)
            self._load(targets, views, sources)
        if lib is not None:
            tier_native.install(lib, victims, targets, got, self.row_of_slot, self.slot_of_row,
                                self.last_seen, self.counts, self.dirty, clock)
        else:
            if victims.numel():
                self.slot_of_row.index_fill_(0, self.row_of_slot.index_select(0, victims),
                                             self.slots)
            self.row_of_slot.index_copy_(0, targets, got)
            self.slot_of_row.index_copy_(0, got, targets.to(torch.int32))
            self.last_seen.index_fill_(0, targets, clock)
            self.counts.index_fill_(0, targets, 1)
            self.dirty.index_fill_(0, targets, False)
        if targets.numel() < M:  # the slots given stay consistent: loaded above
            self._no_slot(M - targets.numel(), U, pinned)

    def flush(self, views: Views) -> None:
        """Write every dirty slot back; they are clean afterwards."""
        if self.on_device:
            tier_device_map.flush(self, views)
            return
        slots = (self.dirty & (self.row_of_slot >= 0)).nonzero().squeeze(1)
        if slots.numel():
            self._write_back(slots, views)
        self.dirty.zero_()


class TieredTables:
    """The row caches of one TableBatchedEmbedding's cached tables (table index -> its
    ``RowCache``), the map clock, the training batches whose backward is pending and the
    prefetch in flight (``prefetch``: one worker thread reads the next batch's missing rows
    from the backing stores while the current step computes; for maps on the device it
    places them in the caches, on a side stream on CUDA)."""

    def __init__(self, caches: dict[int, RowCache]) -> None:
        self.caches = caches
        self.clock = 0
        self._pending: list[tuple[weakref.ref, list[bool]]] = []
        self._worker: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future] = {}  # table -> its prefetch (maps on the host)
        # the prefetch of the tables whose maps are on the device: (future, side stream or
        # None, the batch's tensors kept alive until the stream is joined)
        self._ahead_device: tuple[Future, object, tuple] | None = None
        self._stream = None  # CUDA: the prefetch's side stream
        self._maps: tier_device_map.DeviceMaps | None = None  # the maps on the device
        self._host: tier_host_map.HostMaps | None = None  # the host maps' one call
        self._replay: object | None = None  # the GraphedStep replay mapped last

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) leaves the worker and the prefetch in
        flight behind."""
        self.cancel_prefetch()
        return {**self.__dict__, "_worker": None, "_ahead": {}, "_ahead_device": None,
                "_stream": None, "_host": None, "_replay": None}

    def place(self, device) -> None:
        """The module is on ``device`` (built or moved there): on CUDA the backing stores
        are pinned; each ``cached`` table's slot map goes to ``device`` where ``FBTD_SLOT_MAP``
        says so (``auto``: on CUDA; ``device``: everywhere; ``host``: nowhere), else to the
        host. ``file`` tables keep theirs on the host (their rows are not in pinned memory a
        device can address)."""
        self.cancel_prefetch()
        device = torch.device(device)
        mode = knobs.slot_map()
        on = mode == "device" or (mode == "auto" and device.type == "cuda")
        for cache in self.caches.values():
            if device.type == "cuda":
                cache.backing.pin_now()
            cache.place_map(device if on and cache.storage.tier == "cached" else None)
        self._stream = None
        on_device = {t: c for t, c in self.caches.items() if c.on_device}
        self._maps = tier_device_map.DeviceMaps(on_device, device) if on_device else None

    def maps_on_device(self) -> dict[str, bool]:
        """Per cached table (by name): its slot map is on the cache's device."""
        return {c.name: c.on_device for c in self.caches.values()}

    def _pending_now(self) -> bool:
        """Drop the batches whose backward ran or whose graph is gone; any left?"""
        self._pending = [(node, done) for node, done in self._pending
                         if not done[0] and node() is not None]
        return bool(self._pending)

    def remap(self, indices: torch.Tensor, offsets: torch.Tensor, feature_table_map: list[int],
              names: Callable[[int], str], views: Callable[[int], Views],
              train: bool, views_key: tuple | None = None, hold: bool = False
              ) -> torch.Tensor:
        """``indices`` ``[N]`` with every cached table's ids replaced by slots (a copy),
        loading misses (from the prefetch in flight, if any: waited for here; its error is
        raised here). ``offsets`` ``[T*B+1]`` feature-major; ``names(f)``: feature f's name
        for errors; ``views(t)``: table t's slots; ``views_key``: what they are made of (the
        module's flat tensors' addresses: equal keys, equal views), which lets the host maps
        run in one call (``tier_host_map``); None: table by table. ``hold``: the clock stays
        (an earlier lookup of the same step is pending, as for a tracked batch)."""
        pinned = self._pending_now() or hold
        if not pinned:  # while a batch is pending, its slots stay "used now": no tick
            self.clock += 1
        staged = self._collect()
        T = len(feature_table_map)
        if indices.numel() == 0 or (offsets.numel() - 1) // T == 0:
            return indices
        out = indices
        if self._maps is not None:  # one pass for the tables whose maps are on the device
            out = self._remap_on_device(indices, offsets, feature_table_map, names, views,
                                        train, pinned, views_key)
        on_host = {t: c for t, c in self.caches.items() if not c.on_device}
        if on_host and out is indices and not staged and views_key is not None:
            done = self._remap_at_once(indices, offsets, feature_table_map, names, views,
                                       views_key, train, pinned, on_host)
            if done is not None:
                return done
        per_table = tier_ids.table_ids(indices, offsets, feature_table_map, on_host) if (
            on_host) else {}
        if not per_table:
            return out
        if out is indices:  # a new tensor: the cached tables' ranges are written below
            out = tier_ids.fresh_copy(indices, [(a, b) for _, parts in per_table.values()
                                        for _, a, b in parts])
        slots_of = {}
        direct = out.dtype == torch.int64 and out.device.type == "cpu"
        into_of: dict[int, torch.Tensor | None] = {}
        for t, (ids, parts) in per_table.items():
            cache = self.caches[t]
            ids = ids.to("cpu")

            def check(cache=cache, ids=ids, parts=parts) -> None:
                lo, hi = torch.aminmax(ids)
                tier_ids.check_range(cache, int(lo), int(hi), indices, parts, names)

            # one feature: its slots may go straight into ``out``
            into = out[parts[0][1] : parts[0][2]] if direct and len(parts) == 1 else None
            into_of[t] = into
            try:
                slots_of[t] = cache.assign(ids, self.clock, views(t), train, pinned,
                                           staged.get(t), out=into, check=check)
            finally:
                cache.written = None
        for t, (_, parts) in per_table.items():
            slots = slots_of[t]
            if slots is into_of.get(t):
                continue  # written in place
            slots = slots.to(indices.device, indices.dtype)
            at = 0
            for _, a, b in parts:
                out[a:b] = slots[at : at + b - a]
                at += b - a
        return out

    def _remap_at_once(self, indices, offsets, feature_table_map, names, views, views_key,
                       train: bool, pinned: bool, on_host: dict) -> torch.Tensor | None:
        """``remap``'s host maps in one C call (``tier_host_map.HostMaps``), or None where
        it does not apply (no C helpers, ids not host int64 contiguous, a table with several
        features, rows read ahead, a pair of tensors the call cannot move)."""
        lib = tier_native.library()
        if (lib is None or indices.device.type != "cpu" or indices.dtype != torch.int64
                or not indices.is_contiguous()
                or any(c.written is not None for c in on_host.values())):
            return None
        feature_of: dict[int, int] = {}
        for f, t in enumerate(feature_table_map):
            if t in on_host:
                if t in feature_of:
                    return None
                feature_of[t] = f
        caches = {t: on_host[t] for t in feature_of}
        if not caches or any(c.slots + 1 + indices.numel() >= 2**31 for c in caches.values()):
            return None
        key = tier_host_map.key_of(caches, views_key)
        if self._host is None or self._host.key != key or self._host.feature_of != feature_of:
            self._host = tier_host_map.HostMaps(lib, caches, feature_of, views, key)
        if not self._host.usable:
            return None
        B = (offsets.numel() - 1) // len(feature_table_map)
        bounds = tier_device_map.host_values(offsets[::B])
        out = tier_ids.fresh_copy(indices, [(bounds[f], bounds[f + 1])
                                            for f in feature_of.values()])

        def fail(cache: RowCache, code: int, a: int, b: int, counts: dict) -> None:
            def check() -> None:
                lo, hi = torch.aminmax(indices[a:b])
                f = feature_of[next(t for t, c in caches.items() if c is cache)]
                tier_ids.check_range(cache, int(lo), int(hi), indices, [(f, a, b)], names)
            cache.count_native(code, counts, check, pinned)

        self._host.run(indices, out, bounds, self.clock, train, fail)
        return out

    def slots_in_graph(self, indices: torch.Tensor, offsets: torch.Tensor,
                       remap: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Under a ``GraphedStep`` capture of a lookup: the tensor the graph reads as the
        slots of ``indices``, filled eagerly by ``remap(hold=...)`` (the lookup's ``remap``)
        before each replay (``graphs.before_each_replay``: ``indices`` and ``offsets`` must be
        the step's arguments). The lookups of one replay are one batch for the clock: a later
        one holds it, so it cannot evict the slots an earlier one mapped; the replayed
        backward is over before the next replay's map."""
        slots = torch.empty_like(indices)

        def prepare(replay: object) -> None:
            hold = self._replay is replay
            self._replay = replay
            slots.copy_(remap(hold=hold))

        graphs.before_each_replay((indices, offsets), prepare,
                                  "TableBatchedEmbedding with cached storage tiers")
        return slots

    def _remap_on_device(self, indices, offsets, feature_table_map, names, views, train: bool,
                         pinned: bool, views_key: tuple | None = None) -> torch.Tensor:
        """``indices`` with the ids of the tables whose maps are on the device replaced by
        slots (``tier_device_map``): one pass for all of them, one host read of their counts,
        the checks (before anything changed; a bad id is found on the host then), then every
        table's placement."""
        maps = self._maps
        mapped = maps.map(indices, offsets, feature_table_map, self.clock)
        counts = maps.split(tier_device_map.host_values(mapped.counts.view(-1)))
        for t, c in counts.items():
            cache = self.caches[t]
            if c[5]:
                ids, parts = tier_ids.table_ids(indices, offsets, feature_table_map, [t])[t]
                lo, hi = torch.aminmax(ids)
                tier_ids.check_range(cache, int(lo), int(hi), indices, parts, names)
            tier_device_map.check(cache, c)
        return maps.finish(mapped, counts, self.clock, views, indices, lookup=True,
                           train=train, pinned=pinned, views_key=views_key)

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor,
                 feature_table_map: list[int], tiers: Collection[str] | None = None,
                 views: Callable[[int], Views] | None = None) -> None:
        """Start reading the rows of the batch ``indices`` / ``offsets`` that are not cached
        now, on the worker thread: the next ``remap`` loads them from there (waiting for what
        is not read yet). A prefetch not used by a lookup yet is replaced. Exact whatever
        happens meanwhile: a row written back after its copy was read is loaded from the
        backing store. ``tiers``: only the tables on these tiers (``cached``, ``file``);
        None: every cached table."""
        self._collect()  # an earlier one: finished (its error raised) and dropped
        chosen = {t: c for t, c in self.caches.items()
                  if tiers is None or c.storage.tier in tiers}
        on_device = {t: c for t, c in chosen.items() if c.on_device}
        if on_device:
            if views is None:
                raise ValueError("prefetch: tables whose slot maps are on the device need the "
                                 "views of their slots (views=)")
            self._prefetch_on_device(indices, offsets, feature_table_map, on_device, views)
        on_host = {t: c for t, c in chosen.items() if not c.on_device}
        per_table = tier_ids.table_ids(indices, offsets, feature_table_map, on_host) if (
            on_host) else {}
        if not per_table:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier-prefetch")
        for t, (ids, _) in per_table.items():
            cache = self.caches[t]
            cache.written = []
            self._ahead[t] = self._worker.submit(self._stage, cache, ids.to("cpu"))

    def _prefetch_on_device(self, indices, offsets, feature_table_map, tables,
                            views) -> None:
        """Place the coming batch's missing rows of ``tables`` (maps on the device) in their
        caches on the worker thread, on a side stream on CUDA that first waits for the work
        queued so far; the next lookup (and ``flush``, ``stats``, ``resident``) waits for it.
        Nothing is read on this thread."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tier-prefetch")
        stream = None
        if indices.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(indices.device)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(indices.device))
        future = self._worker.submit(self._ahead_on_device, indices, offsets,
                                     list(feature_table_map), tables, views, self.clock, stream)
        self._ahead_device = (future, stream, (indices, offsets))

    def _ahead_on_device(self, indices, offsets, feature_table_map, tables, views, clock: int,
                         stream) -> None:
        t0 = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            T = len(feature_table_map)
            if indices.numel() and (offsets.numel() - 1) // T:
                maps = self._maps
                mapped = maps.map(indices, offsets, feature_table_map, clock)
                counts = maps.split(tier_device_map.host_values(mapped.counts.view(-1)))
                maps.finish(mapped, counts, clock, views, indices, lookup=False, train=False,
                            pinned=False)
        us = int(1e6 * (time.perf_counter() - t0))
        for cache in tables.values():
            cache.stats["prefetch_us"] += us // len(tables)

    @staticmethod
    def _stage(cache: RowCache, ids: torch.Tensor) -> Staged:
        t0 = time.perf_counter()
        staged = cache.stage(ids)
        cache.stats["prefetched"] += int(staged.rows.numel())
        cache.stats["prefetch_us"] += int(1e6 * (time.perf_counter() - t0))
        return staged

    def _collect(self) -> dict[int, Staged]:
        """Wait for the prefetch in flight (the wait is counted per table) and take what it
        read; its worker's error is raised here, naming the table."""
        ahead, self._ahead = self._ahead, {}
        out, error = {}, self._join_device()
        for t, future in ahead.items():
            cache = self.caches[t]
            t0 = time.perf_counter()
            try:
                out[t] = future.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, after every wait
                error = error or (cache.name, e)
            cache.stats["prefetch_wait_us"] += int(1e6 * (time.perf_counter() - t0))
        if error is not None:
            for cache in self.caches.values():
                cache.written = None
            name, e = error
            raise RuntimeError(f"table '{name}': the prefetch of its rows failed on the worker "
                               f"thread: {type(e).__name__}: {e}") from e
        return out

    def _join_device(self, keep: bool = False) -> tuple[str, Exception] | None:
        """Wait for the prefetch of the maps on the device, if any (counted per table), and
        make the current stream wait for its side stream; drop it unless ``keep``. Its
        error: (the tables' names, the exception) or None."""
        if self._ahead_device is None:
            return None
        future, stream, _ = self._ahead_device
        t0 = time.perf_counter()
        e = future.exception()
        if stream is not None:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        tables = [c for c in self.caches.values() if c.on_device]
        if not keep:
            self._ahead_device = None
            for cache in tables:
                cache.stats["prefetch_wait_us"] += int(
                    1e6 * (time.perf_counter() - t0)) // max(1, len(tables))
        return None if e is None else ("', '".join(c.name for c in tables), e)

    def settle(self) -> None:
        """Wait for the prefetch of the maps on the device (its error stays for the next
        lookup): the maps and caches are still afterwards."""
        self._join_device(keep=True)

    def cancel_prefetch(self) -> None:
        """Wait for the prefetch in flight, if any, and drop it (its error too)."""
        self._join_device()
        ahead, self._ahead = self._ahead, {}
        for future in ahead.values():
            future.exception()
        for cache in self.caches.values():
            cache.written = None

    def track(self, out: torch.Tensor) -> None:
        """``out``, the lookup of a training batch: its slots stay pinned until the backward
        of its node has run, or its graph is freed without one."""
        node = out.grad_fn
        if node is None:
            return
        done = [False]

        def ran(*_):
            done[0] = True

        node.register_hook(ran)
        self._pending.append((weakref.ref(node), done))

    def flush(self, views: Callable[[int], Views]) -> None:
        self.settle()
        for t, cache in self.caches.items():
            cache.flush(views(t))

    def resident(self) -> dict[int, list[int]]:
        """Per table: the rows in its cache, ascending."""
        self.settle()
        return {t: c.resident() for t, c in self.caches.items()}

    def invalidate(self) -> None:
        self.cancel_prefetch()
        for cache in self.caches.values():
            cache.invalidate()
        self._pending = []

    def stats(self) -> dict[int, dict[str, int]]:
        self.settle()
        for c in self.caches.values():
            c.fold_stats()
        return {t: dict(c.stats) for t, c in self.caches.items()}


def slots_of(storage: Sequence[Storage], tables: Sequence[tuple[int, int]]) -> list[int]:
    """Rows of each table as the kernels see them: its cache slots, or all its rows."""
    return [s.slots(E) for s, (E, _) in zip(storage, tables, strict=True)]
