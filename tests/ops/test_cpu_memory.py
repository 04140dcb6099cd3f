"""A CPU TBE's large flat weights and per-element states ask for transparent huge pages
(``ops/cpu_memory.py``): their memory's mapping carries the kernel's ``hg`` flag
(``MADV_HUGEPAGE``), a small table's and the knob-off module's do not, and the lookup reads
the same values as the reference backend."""

import os

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import cpu_memory

pytestmark = pytest.mark.skipif(
    not (os.path.exists("/proc/self/smaps")
         and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")),
    reason="needs Linux with transparent huge pages (/proc/self/smaps, /sys/kernel/mm/"
           "transparent_hugepage)",
)

LARGE_ROWS = cpu_memory.MIN_BYTES // (128 * 4) + 4096  # just over MIN_BYTES at D = 128


def _advised(t: torch.Tensor) -> bool:
    """The mapping holding ``t``'s first 2 MiB-aligned byte has ``hg`` in its VmFlags."""
    addr = (t.data_ptr() + cpu_memory.HUGE_PAGE - 1) & ~(cpu_memory.HUGE_PAGE - 1)
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds address {addr:#x}")


def test_large_cpu_tables_ask_for_huge_pages_small_ones_and_the_knob_off_do_not(monkeypatch):
    monkeypatch.setenv("FBTD_CPU_HUGE_PAGES", "1")
    m = TableBatchedEmbedding([(LARGE_ROWS, 128), (50, 8)], optimizer=optim.Adagrad(lr=0.1),
                              backend="cpu", seed=0)
    assert m.weights.numel() * 4 >= cpu_memory.MIN_BYTES
    assert _advised(m.weights) and _advised(m.momentum1)  # weights (empty), state (zeros)
    assert m.momentum1.abs().sum().item() == 0.0

    small = TableBatchedEmbedding([(1000, 128)], backend="cpu")
    assert cpu_memory.advise_huge_pages(small.weights) == 0

    monkeypatch.setenv("FBTD_CPU_HUGE_PAGES", "0")
    off = TableBatchedEmbedding([(LARGE_ROWS, 128)], backend="cpu", seed=0)
    assert not _advised(off.weights)

    # the rows read back as the reference backend reads them, the last row included
    ids = torch.tensor([0, LARGE_ROWS - 1, 7, LARGE_ROWS - 1, 3, 49])
    offsets = torch.tensor([0, 2, 4, 5, 6])
    ref = TableBatchedEmbedding([(LARGE_ROWS, 128), (50, 8)], backend="reference",
                                weights=m.weights.detach().clone(), init_weights=False)
    with torch.no_grad():
        assert torch.equal(m(ids, offsets), ref(ids, offsets))
