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

The map and the bookkeeping live on the host: ids of a batch are read there (a sync on CUDA).
"""

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence

import torch

from fbtriton_dist.id_manager import IdManagerConfig
from fbtriton_dist.ops.id_remap import IdTable, id_remap
from fbtriton_dist.storage import Storage

Views = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""A cached table's slots as the kernels read them: ``[C, D]`` weights and each optimizer
state by name (``[C]`` per row, ``[C, D]`` per element)."""


def _file_tensor(path: str, numel: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A ``[numel]`` tensor mapped onto a new file ``path`` (zeros), shared: writes go to the
    file. The file is made full size under a temporary name (space reserved with
    ``posix_fallocate``) and renamed: it never exists half made."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        free = shutil.disk_usage(folder).free
    except OSError as e:
        raise ValueError(f"{what}: cannot use directory {folder!r} for {path!r} "
                         f"({nbytes} bytes needed): {e}") from None
    if free < nbytes:
        raise ValueError(f"{what}: {path!r} needs {nbytes} bytes, {free} free on its disk")
    fd, tmp = -1, None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise ValueError(f"{what}: cannot create {path!r} ({nbytes} bytes): {e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


class Backing:
    """Every row of one cached table and its optimizer state: ``weight`` ``[E, D]`` and
    ``states`` (name -> ``[E]`` or ``[E, D]`` fp32), in host memory or files
    ``<path>/<table>.<weight|state name>``."""

    def __init__(self, name: str, storage: Storage, rows: int, dim: int, dtype: torch.dtype,
                 pin: bool) -> None:
        self.name, self.storage, self.rows, self.dim = name, storage, rows, dim
        self.pin = pin
        self.weight = self._tensor("weight", rows * dim, dtype).view(rows, dim)
        self.states: dict[str, torch.Tensor] = {}

    def file(self, part: str) -> str | None:
        """The file of ``part`` (``weight`` or a state's name); None: host memory."""
        if self.storage.tier != "file":
            return None
        return os.path.join(self.storage.path, f"{self.name}.{part}")

    def _tensor(self, part: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        path = self.file(part)
        if path is not None:
            return _file_tensor(path, numel, dtype, f"table '{self.name}' (tier 'file') {part}")
        t = torch.zeros(numel, dtype=dtype)
        return t.pin_memory() if self.pin and numel else t

    def set_states(self, states: Sequence) -> None:
        """Optimizer states (``optim.REGISTRY``'s ``StateSpec``s) at zero."""
        self.states = {
            s.name: (self._tensor(s.name, self.rows, torch.float32) if s.per_row else
                     self._tensor(s.name, self.rows * self.dim, torch.float32)
                     .view(self.rows, self.dim))
            for s in states
        }

    def pin_now(self) -> None:
        """The module moved to CUDA: host-memory rows become pinned (files stay mapped)."""
        if self.storage.tier == "file" or self.pin:
            return
        self.pin = True
        self.weight = self.weight.pin_memory()
        self.states = {k: v.pin_memory() for k, v in self.states.items()}


class RowCache:
    """One cached table's slot map (``ops.id_remap``'s ``IdTable``, LRU or LFU), the row in
    each slot (``row_of_slot``, -1: free), which slots are dirty, and its ``Backing``."""

    def __init__(self, name: str, storage: Storage, rows: int, dim: int, dtype: torch.dtype,
                 pin: bool) -> None:
        self.name, self.storage, self.rows, self.dim = name, storage, rows, dim
        self.slots = storage.slots(rows)
        self.backing = Backing(name, storage, rows, dim, dtype, pin)
        self.map = IdTable(IdManagerConfig(capacity=self.slots, eviction=storage.policy), name)
        self.row_of_slot = torch.full((self.slots,), -1, dtype=torch.int64)
        self.dirty = torch.zeros(self.slots, dtype=torch.bool)
        self.stats = dict.fromkeys(("lookups", "misses", "evictions", "writebacks"), 0)

    def invalidate(self) -> None:
        """Forget every slot (nothing written back): the backing store was rewritten."""
        for b in (self.map.keys, self.map.counts):
            b.zero_()
        self.map.last_seen.fill_(-1)
        self.map.reindex()
        self.row_of_slot.fill_(-1)
        self.dirty.zero_()

    def resident(self) -> list[int]:
        """The rows in the cache, ascending."""
        return sorted(int(r) for r in self.row_of_slot[self.row_of_slot >= 0])

    def _write_back(self, slots: torch.Tensor, views: Views) -> None:
        rows = self.row_of_slot.index_select(0, slots)
        weight, states = views
        dev = slots.to(weight.device)
        pairs = [(self.backing.weight, weight), *((b, states[n])
                                                  for n, b in self.backing.states.items())]
        for backing, cache in pairs:
            backing.index_copy_(0, rows, cache.index_select(0, dev).to("cpu", backing.dtype))
        self.stats["writebacks"] += int(slots.numel())

    def _load(self, slots: torch.Tensor, rows: torch.Tensor, views: Views) -> None:
        weight, states = views
        dev = slots.to(weight.device)
        pairs = [(self.backing.weight, weight), *((b, states[n])
                                                  for n, b in self.backing.states.items())]
        for backing, cache in pairs:
            cache.index_copy_(0, dev, backing.index_select(0, rows).to(cache.device,
                                                                         cache.dtype))

    def assign(self, rows: torch.Tensor, clock: int, views: Views, train: bool,
               pinned: bool) -> torch.Tensor:
        """Slots ``[U]`` of the distinct rows ``rows`` ``[U]`` (int64, host), loading the
        misses (after writing back the dirty rows they evict). ``train``: the slots become
        dirty. ``pinned``: earlier batches' slots are still pinned (for the message)."""
        U = int(rows.numel())
        if U > self.slots:
            raise ValueError(
                f"table '{self.name}' (tier {self.storage.tier!r}): a batch reads {U} distinct "
                f"rows, its cache has {self.slots} slots (of {self.rows} rows); raise "
                f"cache_load_factor or cache_slots to at least {U} / {U / self.rows:.3g}"
            )
        slots, fresh = id_remap(self.map, rows, step=clock, update=True)
        self.stats["lookups"] += U
        if fresh.numel():
            old = self.row_of_slot[fresh]
            out = fresh[(old >= 0) & self.dirty[fresh]]
            if out.numel():
                self._write_back(out, views)
            self.stats["evictions"] += int((old >= 0).sum())
            self.stats["misses"] += int(fresh.numel())
            new = self.map.keys[fresh]
            self._load(fresh, new, views)
            self.row_of_slot[fresh] = new
            self.dirty[fresh] = False
        if bool((slots >= self.slots).any()):  # the slots given stay consistent: loaded above
            missing = int((slots >= self.slots).sum())
            raise ValueError(
                f"table '{self.name}' (tier {self.storage.tier!r}): {missing} of the batch's {U} "
                f"distinct rows found no slot of {self.slots}: the others hold rows of this batch"
                + (" or rows pinned by training batches whose backward has not run" if pinned
                   else "") + "; raise cache_load_factor or cache_slots"
            )
        if train:
            self.dirty[slots] = True
        return slots

    def flush(self, views: Views) -> None:
        """Write every dirty slot back; they are clean afterwards."""
        slots = (self.dirty & (self.row_of_slot >= 0)).nonzero().squeeze(1)
        if slots.numel():
            self._write_back(slots, views)
        self.dirty.zero_()


class TieredTables:
    """The row caches of one TableBatchedEmbedding's cached tables (table index -> its
    ``RowCache``), the map clock and the training batches whose backward is pending."""

    def __init__(self, caches: dict[int, RowCache]) -> None:
        self.caches = caches
        self.clock = 0
        self._pending: list[tuple[weakref.ref, list[bool]]] = []

    def _pending_now(self) -> bool:
        """Drop the batches whose backward ran or whose graph is gone; any left?"""
        self._pending = [(node, done) for node, done in self._pending
                         if not done[0] and node() is not None]
        return bool(self._pending)

    def remap(self, indices: torch.Tensor, offsets: torch.Tensor, feature_table_map: list[int],
              names: Callable[[int], str], views: Callable[[int], Views],
              train: bool) -> torch.Tensor:
        """``indices`` ``[N]`` with every cached table's ids replaced by slots (a copy),
        loading misses. ``offsets`` ``[T*B+1]`` feature-major; ``names(f)``: feature f's name
        for errors; ``views(t)``: table t's slots."""
        pinned = self._pending_now()
        if not pinned:  # while a batch is pending, its slots stay "used now": no tick
            self.clock += 1
        T = len(feature_table_map)
        B = (offsets.numel() - 1) // T
        if B == 0 or indices.numel() == 0:
            return indices
        bounds = offsets[::B].tolist()
        out = indices.clone()
        for t, cache in self.caches.items():
            parts = [(f, bounds[f], bounds[f + 1]) for f in range(T)
                     if feature_table_map[f] == t and bounds[f + 1] > bounds[f]]
            if not parts:
                continue
            ids = torch.cat([indices[a:b] for _, a, b in parts]).to("cpu", torch.int64)
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= cache.rows:
                bad = lo if lo < 0 else hi
                f = next(f for f, a, b in parts
                         if bool(((indices[a:b] < 0) | (indices[a:b] >= cache.rows)).any()))
                raise ValueError(
                    f"feature '{names(f)}' of table '{cache.name}' (tier "
                    f"{cache.storage.tier!r}): id {bad} out of range [0, {cache.rows}) "
                    "(cached tiers always check ids)"
                )
            rows, inverse = torch.unique(ids, return_inverse=True)
            slots = cache.assign(rows, self.clock, views(t), train, pinned)[inverse]
            slots = slots.to(indices.device, indices.dtype)
            at = 0
            for _, a, b in parts:
                out[a:b] = slots[at : at + b - a]
                at += b - a
        return out

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
        for t, cache in self.caches.items():
            cache.flush(views(t))

    def invalidate(self) -> None:
        for cache in self.caches.values():
            cache.invalidate()
        self._pending = []

    def stats(self) -> dict[int, dict[str, int]]:
        return {t: dict(c.stats) for t, c in self.caches.items()}


def slots_of(storage: Sequence[Storage], tables: Sequence[tuple[int, int]]) -> list[int]:
    """Rows of each table as the kernels see them: its cache slots, or all its rows."""
    return [s.slots(E) for s, (E, _) in zip(storage, tables, strict=True)]
