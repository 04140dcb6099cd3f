"""The storage tiers' row cache on the host, in C (``csrc/tier_cache.c``): the slot map's pass
over a batch's ids and the row copies between a cache and its backing store, a loop each
instead of a dozen small torch ops per table and lookup (``modules/tiers.py`` calls them where
they apply and runs its torch ops otherwise).

Built at first use like the fast CPU path's kernels (``ops/cpu_native.py``: ``cc -O3 -shared
-fPIC`` into its cache directory under a name that hashes the source, compiler and flags,
through a temporary file renamed into place), off with them (``FBTD_CPU_NATIVE=0``). Without a
compiler, or when the build fails, one warning says why and the torch ops run.
"""

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from fbtriton_dist import knobs
from fbtriton_dist.ops.cpu_native import cache_dir

SOURCE = Path(__file__).resolve().parent / "csrc" / "tier_cache.c"
FLAGS = ("-O3", "-shared", "-fPIC")
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "tier_map": (_I64, [_P, _I64, _P, _I64, _I64, _P, _I64, _P, _P]),
    "tier_touch": (None, [_P, _I64, _I64, _P, _P, _I64]),
    "tier_slots": (None, [_P, _I64, _P, _P, _P, _I32]),
    "tier_copy_rows": (_I32, [_P, _P, _I64, _P, _P, _I64, _I64, _I64]),
    "tier_victims": (_I64, [_P, _P, _I64, _I64, _I64, _P, _P, _P]),
    "tier_swap_rows": (_I64, [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _P, _P, _I64]),
    "tier_install": (None, [_P, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _I64, _I64]),
    "tier_assign": (_I64, [_P, _I64, _P, _I64, _I64, _P, _P, _I64, _P, _P, _P, _I64, _I32,
                           _I32, _I64, _P, _P, _P, _P, _P, _P]),
    "tier_assign_tables": (_I64, [_I64, _P, _P]),
}
ASSIGN_ARGS = 20
"""``tier_assign_tables``' int64 per table (``tier_assign``'s arguments in order)."""
RADIX = 4 << 8
"""``csrc/tier_cache.c``'s radix buckets, ``WAYS * RADIX`` there (``tier_victims``' scratch)."""
_lock = threading.Lock()
_state: dict = {}


def library() -> ctypes.CDLL | None:
    """The functions, built and loaded at the first call; None when ``FBTD_CPU_NATIVE=0`` or
    when they cannot be built (warned once per process)."""
    if not knobs.cpu_native():
        return None
    if "lib" in _state or "error" in _state:
        return _state.get("lib")
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"] = _load()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _state["error"] = str(e)
                warnings.warn(f"the row cache's native helpers are unavailable ({e}); the "
                              "storage tiers run their torch ops instead", RuntimeWarning,
                              stacklevel=3)
    return _state.get("lib")


def _load() -> ctypes.CDLL:
    cc = os.environ.get("CC") or "cc"
    compiler = shutil.which(cc)
    if compiler is None:
        raise RuntimeError(f"no C compiler: {cc!r} is not on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), platform.machine().encode(),
                                     *(f.encode() for f in FLAGS)])).hexdigest()[:20]
    so = cache_dir() / f"tier_cache-{key}.so"
    if not so.exists():
        fd, tmp = tempfile.mkstemp(prefix=so.name + ".", suffix=".tmp", dir=so.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} could not build {SOURCE.name}: "
                                   + ((done.stderr or done.stdout).strip()[-400:]
                                      or f"exit {done.returncode}"))
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def map_ids(lib, ids: torch.Tensor, slot_of_row: torch.Tensor, slots: int,
            stamp: torch.Tensor, batch: int) -> tuple[int, torch.Tensor] | None:
    """``(distinct cached ids, distinct misses [M] in first-occurrence order)`` of the host
    int64 ``ids`` through ``slot_of_row`` (their slots stamped with ``batch``); None on an id
    out of range (the caller's check names it)."""
    new = torch.empty(ids.numel(), dtype=torch.int64)
    hits = ctypes.c_int64(0)
    m = lib.tier_map(ids.data_ptr(), ids.numel(), slot_of_row.data_ptr(), slot_of_row.numel(),
                     slots, stamp.data_ptr(), batch, new.data_ptr(), ctypes.byref(hits))
    if m < 0:
        return None
    return int(hits.value), new[:m]


def touch(lib, stamp: torch.Tensor, batch: int, last_seen: torch.Tensor,
          counts: torch.Tensor, clock: int) -> None:
    lib.tier_touch(stamp.data_ptr(), stamp.numel(), batch, last_seen.data_ptr(),
                   counts.data_ptr(), clock)


def slots_of(lib, ids: torch.Tensor, slot_of_row: torch.Tensor, dirty: torch.Tensor,
             train: bool) -> torch.Tensor:
    out = torch.empty(ids.numel(), dtype=torch.int64)
    lib.tier_slots(ids.data_ptr(), ids.numel(), slot_of_row.data_ptr(), out.data_ptr(),
                   dirty.data_ptr(), int(train))
    return out


def victims(lib, last_seen: torch.Tensor, counts: torch.Tensor | None, clock: int, need: int,
            scratch: torch.Tensor) -> torch.Tensor:
    """The first ``need`` slots among those with ``0 <= last_seen < clock`` (fewer if fewer
    are) in ascending ``(last_seen, slot)`` order (LRU: ``counts`` None) or ``(counts,
    last_seen, slot)`` (LFU), as ``ops.id_remap.pick_victims`` orders them. ``scratch``: int64
    of at least ``scratch_size(slots, 0)``."""
    out = torch.empty(max(need, 0), dtype=torch.int64)
    slots = last_seen.numel()
    k = lib.tier_victims(last_seen.data_ptr(), None if counts is None else counts.data_ptr(),
                         slots, clock, need, out.data_ptr(), scratch.data_ptr(),
                         scratch[2 * slots:].data_ptr())
    return out[:k]


def scratch_size(slots: int, ids: int) -> int:
    """int64 scratch ``assign`` needs for a table of ``slots`` slots and a batch of ``ids``
    ids (``victims``: ``ids`` 0)."""
    return 2 * ids + 4 * slots + RADIX


INFO = ("hits", "misses", "victims", "taken", "written")
"""``assign``'s counts: distinct rows found cached, distinct rows not cached, slots evicted,
slots taken (misses loaded), rows written back."""


class Assigner:
    """One table's slot map for one batch in one C call (``tier_assign``), its fixed
    arguments made once: the map's tensors (``slot_of_row`` ``[E]`` int32, ``row_of_slot``,
    ``stamp``, ``last_seen``, ``counts`` ``[C]`` int64, ``dirty`` ``[C]`` bool), every
    ``(backing store, cache)`` of ``pairs`` (each ``swappable``) and ``scratch`` (int64).
    ``key``: the caller's name for them (their addresses), kept to tell when to make a new
    one."""

    def __init__(self, lib, maps: dict[str, torch.Tensor],
                 pairs: list[tuple[torch.Tensor, torch.Tensor]], scratch: torch.Tensor,
                 lfu: bool, key: tuple) -> None:
        self.key = key
        k = len(pairs)
        self._fn = lib.tier_assign
        self._info = (ctypes.c_int64 * len(INFO))()
        self._tensors = (maps, pairs, scratch)  # alive while their addresses are used
        self._before = (maps["slot_of_row"].data_ptr(), maps["slot_of_row"].numel(),
                        maps["row_of_slot"].numel(), maps["row_of_slot"].data_ptr(),
                        maps["stamp"].data_ptr())
        self._after = (maps["last_seen"].data_ptr(), maps["counts"].data_ptr(),
                       maps["dirty"].data_ptr())
        self._lfu = int(lfu)
        self._tables = (k, (ctypes.c_void_p * k)(*(c.data_ptr() for _, c in pairs)),
                        (ctypes.c_void_p * k)(*(b.data_ptr() for b, _ in pairs)),
                        (ctypes.c_int64 * k)(*(math.prod(c.shape[1:]) * c.element_size()
                                               for _, c in pairs)),
                        scratch.data_ptr())

    def __call__(self, ids: torch.Tensor, out: torch.Tensor, batch: int, clock: int,
                 train: bool) -> tuple[int, list[int]]:
        """``out`` ``[N]`` (int64, contiguous) = the slots of the host int64 contiguous
        ``ids`` ``[N]`` (``scratch`` of at least ``scratch_size(C, N)``), the misses loaded
        into slots after the dirty victims' rows are written back, stamps of ``batch``, uses
        at ``clock``, dirty when ``train``. Returns the C code (0; -1 an id out of range:
        nothing changed; -2 more distinct rows than slots: nothing to undo; -3 some misses
        found no slot) and the counts (``INFO``'s order)."""
        code = self._fn(ids.data_ptr(), ids.numel(), *self._before, batch, *self._after, clock,
                        self._lfu, int(train), *self._tables, out.data_ptr(), self._info)
        return int(code), list(self._info)


def install(lib, victims: torch.Tensor, targets: torch.Tensor, got: torch.Tensor,
            row_of_slot: torch.Tensor, slot_of_row: torch.Tensor, last_seen: torch.Tensor,
            counts: torch.Tensor, dirty: torch.Tensor, clock: int) -> None:
    """Unmap the victims' rows, then rows ``got`` into slots ``targets`` (clean, used at
    ``clock``, count 1)."""
    victims, targets, got = victims.contiguous(), targets.contiguous(), got.contiguous()
    lib.tier_install(victims.data_ptr(), victims.numel(), targets.data_ptr(), got.data_ptr(),
                     targets.numel(), row_of_slot.data_ptr(), slot_of_row.data_ptr(),
                     last_seen.data_ptr(), counts.data_ptr(), dirty.data_ptr(), clock,
                     row_of_slot.numel())


def swappable(cache: torch.Tensor, back: torch.Tensor) -> bool:
    """``swap_rows`` applies: contiguous host tensors of one dtype and row shape."""
    return (cache.device.type == back.device.type == "cpu" and cache.dtype == back.dtype
            and cache.is_contiguous() and back.is_contiguous()
            and cache.shape[1:] == back.shape[1:])


def swap_rows(lib, cache: torch.Tensor, back: torch.Tensor, targets: torch.Tensor,
              got: torch.Tensor, row_of_slot: torch.Tensor, dirty: torch.Tensor,
              src: torch.Tensor | None = None) -> int:
    """For each slot ``targets[i]`` of ``cache`` (``swappable`` with ``back`` and ``src``):
    its row back to ``back`` when dirty (``row_of_slot``, ``dirty``: before the slots are
    taken), then row ``got[i]`` of ``src`` (None: ``back``) into it. Returns the rows
    written back."""
    src = back if src is None else src
    targets, got = targets.contiguous(), got.contiguous()
    row_bytes = math.prod(cache.shape[1:]) * cache.element_size()
    n = lib.tier_swap_rows(cache.data_ptr(), cache.shape[0], back.data_ptr(), back.shape[0],
                           src.data_ptr(), src.shape[0], targets.data_ptr(), got.data_ptr(),
                           targets.numel(), row_of_slot.data_ptr(), dirty.data_ptr(),
                           row_bytes)
    if n < 0:
        raise IndexError(f"swap_rows: an index out of range (cache {tuple(cache.shape)}, "
                         f"backing {tuple(back.shape)}, source {tuple(src.shape)})")
    return int(n)


def copy_rows(lib, dst: torch.Tensor, dst_at: torch.Tensor, src: torch.Tensor,
              src_at: torch.Tensor | None) -> bool:
    """``dst[dst_at] = src[src_at]`` for contiguous host tensors of one dtype and row size,
    int64 contiguous indices; False (nothing done) where it does not apply."""
    if not (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.is_contiguous() and src.is_contiguous()
            and dst.shape[1:] == src.shape[1:]
            and dst_at.dtype == torch.int64 and dst_at.is_contiguous()
            and (src_at is None or (src_at.dtype == torch.int64 and src_at.is_contiguous()))):
        return False
    row_bytes = math.prod(dst.shape[1:]) * dst.element_size()
    bad = lib.tier_copy_rows(dst.data_ptr(), dst_at.data_ptr(), dst.shape[0], src.data_ptr(),
                             None if src_at is None else src_at.data_ptr(), src.shape[0],
                             dst_at.numel(), row_bytes)
    if bad:
        raise IndexError(f"copy_rows: an index out of range (dst {tuple(dst.shape)}, src "
                         f"{tuple(src.shape)})")
    return True
