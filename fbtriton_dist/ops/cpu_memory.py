"""Large CPU buffers of a TableBatchedEmbedding (its flat weights, its optimizer states) in
transparent huge pages.

A lookup reads rows scattered over the whole table: with 4 KiB pages nearly every row of a
large table is a TLB miss and a page walk (nested under a VM), which bounds the CPU forward
more than the row's bytes do (``docs/results/tbe-cpu-forward-c1-2026-12-05.md``). Here a
buffer of at least ``MIN_BYTES`` gets ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned part of
its memory before anything touches it, so the kernel backs it with 2 MiB pages where it can
(the machine's ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``);
where it cannot (``never``, no THP, not Linux) nothing changes. An advice only: the values,
and so every result, are the same either way. ``FBTD_CPU_HUGE_PAGES=0`` turns it off
(``knobs.cpu_huge_pages``).

Torch allocates buffers this large with their own ``mmap`` (glibc's threshold is at most
32 MiB, ``MIN_BYTES``), so the advice covers memory no other tensor shares, and it goes when
the buffer is freed.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from fbtriton_dist import knobs

__all__ = ["HUGE_PAGE", "MIN_BYTES", "advise_huge_pages", "empty", "zeros"]

HUGE_PAGE = 2 << 20
"""Bytes of an x86-64 / arm64 transparent huge page."""
MIN_BYTES = 32 << 20
"""Smaller buffers are left alone: their rows' pages fit the TLB (2048 entries of 4 KiB on
an AMD Zen 3 cover 8 MiB), and glibc may serve them from its heap."""
_MADV_HUGEPAGE = 14
_libc: list = []


def _madvise():
    if not _libc:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t,
                                                     ctypes.c_int]
        except (OSError, AttributeError):
            fn = None
        _libc.append(fn)
    return _libc[0]


def advise_huge_pages(t: torch.Tensor) -> int:
    """Ask for huge pages under ``t``'s memory (a CPU tensor of at least ``MIN_BYTES``, the
    knob on, Linux): the 2 MiB-aligned bytes advised, 0 where nothing was (or the kernel
    refused). Pages already touched stay as they are: call it before filling ``t``."""
    nbytes = t.numel() * t.element_size()
    if (t.device.type != "cpu" or nbytes < MIN_BYTES or not sys.platform.startswith("linux")
            or not knobs.cpu_huge_pages()):
        return 0
    madvise = _madvise()
    start = (t.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (t.data_ptr() + nbytes) & ~(HUGE_PAGE - 1)
    if madvise is None or end <= start:
        return 0
    return end - start if madvise(start, end - start, _MADV_HUGEPAGE) == 0 else 0


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(numel)`` on the CPU, advised (``advise_huge_pages``) before first use."""
    t = torch.empty(numel, dtype=dtype)
    advise_huge_pages(t)
    return t


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(numel)`` on the CPU, its pages advised before the zeros touch them."""
    return empty(numel, dtype).zero_()
