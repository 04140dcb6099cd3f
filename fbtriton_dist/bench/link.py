"""``python -m fbtriton_dist.bench link``: measure the bandwidths the planner's cost model
prices storage tiers with, and write them as a ``cost:`` YAML block for ``fbtriton-dist plan
--cost FILE.yaml`` or a job's ``sharding.cost`` (``planner/cost_inputs.py``,
``docs/storage.md`` "Measuring the links").

Each measure moves rows of ``--dim`` values of ``--dtype`` through the library's own code:

* CUDA, ``hbm_bandwidth``: random row gathers of a table in device memory
  (``index_select``), bytes gathered per second (the cost model's ``lookup_bytes``).
* CUDA, ``host_tier_bandwidth``: a ``cached`` table's miss traffic as the device slot map
  moves it (``modules/tier_device_map.py``): a backing store in pinned host memory
  (``modules/tier_backing.py`` ``Backing``) seen as a CUDA tensor (``ops/host_mapped.py``),
  distinct random rows gathered from it into the cache's slots and the slots scattered back
  (``tier_backing.copy_rows``); (rows in + rows out) / (load + write-back time).
* CPU, ``hbm_bandwidth``: the same gather in RAM (the CPU's "device" memory).
* CPU, ``host_tier_bandwidth``: the same load / write-back with the backing store and the
  cache both in RAM (``copy_rows``' native row copies).
* CPU, ``disk_bandwidth``: a ``file`` table's backing store (``Backing`` on tier ``file``:
  memory-mapped files, ``MADV_RANDOM``) in a temporary folder (``--dir``): the rows are
  written and synced, then before each repeat the file's pages are dropped from the page
  cache (``madvise(MADV_DONTNEED)`` on the mapping, ``posix_fadvise(POSIX_FADV_DONTNEED)`` on
  the file: no root needed) and ``mincore`` says how much of it stayed resident; the repeat
  loads its rows (read from disk), writes them back (into the page cache) and ``fsync``s the
  file (the dirty pages to disk): "cold". The same rows again with the pages in the page
  cache, no ``fsync``: "warm". The YAML takes "cold" when at most ``COLD_RESIDENT`` of the
  file was resident before its reads, else "warm", and its comment says which.

Each number is the median of ``--repeats`` repeats (min - max beside it); the YAML takes the
largest ``--batch-rows``' median. Only what was measured on the device is written.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from fbtriton_dist import knobs
from fbtriton_dist.modules.tier_backing import Backing, copy_rows
from fbtriton_dist.ops import cuda_managed, host_mapped
from fbtriton_dist.storage import Storage

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COLD_RESIDENT = 0.05
"""At most this share of the file resident in the page cache before a cold repeat's reads,
else the disk number is labelled warm."""
DEFAULTS = {  # device: (table rows, rows moved per call)
    "cuda": (8_000_000, (16_384, 131_072, 1_048_576)),
    "cpu": (2_000_000, (1_024, 8_192, 32_768)),
}
TINY = (4_096, (64, 256))
MADV_DONTNEED = 4


@dataclass(frozen=True)
class Result:
    """One measure at one size: ``seconds`` per repeat for ``nbytes`` moved."""

    measure: str
    cost_key: str | None
    rows: int
    nbytes: int
    seconds: tuple[float, ...]
    note: str = ""

    def rates(self) -> list[float]:
        return [self.nbytes / s for s in self.seconds]

    @property
    def median(self) -> float:
        return statistics.median(self.rates())


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fbtriton_dist.bench link",
        description="Measure the storage tiers' row traffic and the random row gather "
                    "bandwidth; print a table and a cost: YAML block for `plan --cost`.")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda: HBM gathers and the cached tier over PCIe; cpu: RAM gathers, "
                        "the cached tier in RAM and the file tier (default: cuda if available)")
    p.add_argument("--dim", type=int, default=128, help="D, values per row (default 128)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--table-rows", type=int, default=None,
                   help="E, rows of the table / backing store (default: cuda 8e6, cpu 2e6)")
    p.add_argument("--batch-rows", type=int, nargs="+", default=None, metavar="N",
                   help="distinct rows moved per call, a few sizes (default: cuda 16384 "
                        "131072 1048576, cpu 1024 8192 32768); the YAML takes the largest")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per size (default 5)")
    p.add_argument("--dir", default=None,
                   help="where the file tier's temporary folder goes (default: the system's "
                        "temp dir; put it on the disk the file tables will use)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (tests, CI)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's CPU threads (torch.set_num_threads; default: torch's, "
                        f"{torch.get_num_threads()} here): the CPU gather runs on them")
    p.add_argument("--host-memory", default=None, metavar="KIND[,KIND]",
                   help="cuda: the backing store's host memory, managed and/or pinned "
                        "(FBTD_HOST_MEMORY; default: its setting); the YAML takes the first. "
                        "Pinned memory's small GPU pages show past a few GiB of --table-rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="COST.yaml", default=None,
                   help="write the cost: YAML block here")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: expected a CUDA device, torch sees none")
    kinds = (knobs.host_memory() if args.host_memory is None else args.host_memory).split(",")
    if not kinds or any(k not in ("managed", "pinned") for k in kinds) or len(set(kinds)) < len(
            kinds):
        p.error(f"--host-memory: expected managed, pinned or both (comma-separated), got "
                f"{args.host_memory!r}")
    args.host_memory = kinds
    rows, sizes = TINY if args.tiny else DEFAULTS[args.device]
    args.table_rows = args.table_rows or rows
    args.batch_rows = sorted(args.batch_rows or sizes)
    for name, value, low in (("--dim", args.dim, 1), ("--repeats", args.repeats, 1),
                             ("--table-rows", args.table_rows, 1),
                             ("--threads", 1 if args.threads is None else args.threads, 1)):
        if value < low:
            p.error(f"{name}: expected an integer >= {low}, got {value}")
    if args.dir is not None and not os.path.isdir(args.dir):
        p.error(f"--dir: expected an existing directory, got {args.dir!r}")
    if not 1 <= args.batch_rows[0] <= args.batch_rows[-1] <= args.table_rows:
        p.error(f"--batch-rows: expected sizes in [1, --table-rows={args.table_rows}], got "
                f"{args.batch_rows}")
    return args


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _rows(gen: torch.Generator, E: int, n: int, device) -> torch.Tensor:
    """``n`` distinct random rows of ``E``, ascending (as a batch's missed rows are)."""
    return torch.randperm(E, generator=gen)[:n].sort().values.to(device)


def _gather(table: torch.Tensor, sizes, repeats, gen, sync, key: str) -> list[Result]:
    """Random row gathers of ``table`` (its device's memory), bytes gathered per second."""
    out = []
    E, row_bytes = table.shape[0], table.shape[1] * table.element_size()
    for n in sizes:
        buf = torch.empty(n, table.shape[1], dtype=table.dtype, device=table.device)
        ids = torch.randint(E, (n,), generator=gen).to(table.device)
        torch.index_select(table, 0, ids, out=buf)  # warm-up
        times = []
        for _ in range(repeats):
            ids = torch.randint(E, (n,), generator=gen).to(table.device)
            times.append(_timed(lambda ids=ids, buf=buf: torch.index_select(table, 0, ids, out=buf),
                                sync))
        out.append(Result(f"{table.device.type} random row gather", key, n, n * row_bytes,
                          tuple(times)))
    return out


def _round_trips(backing: torch.Tensor, cache: torch.Tensor, sizes, repeats, gen, sync,
                 measure: str, key: str | None, before: Callable[[], str] | None = None,
                 after: Callable[[], None] | None = None) -> list[Result]:
    """Distinct random rows of ``backing`` loaded into the first slots of ``cache`` and
    written back (``copy_rows``, the tiers' row copies), (rows in + out) per second; ``before``
    runs ahead of each repeat untimed and returns a note, ``after`` is timed with it. The note
    gives each phase's median time (load, write-back, after)."""
    out = []
    E, row_bytes = backing.shape[0], backing.shape[1] * backing.element_size()
    for n in sizes:
        slots = torch.arange(n, device=cache.device)
        warm = _rows(gen, E, n, cache.device)
        copy_rows(cache, slots, backing, warm)
        times, notes, phases = [], [], []
        for _ in range(repeats):
            rows = _rows(gen, E, n, cache.device)
            if before is not None:
                notes.append(before())
            steps = [lambda rows=rows, slots=slots: copy_rows(cache, slots, backing, rows),
                     lambda rows=rows, slots=slots: copy_rows(backing, rows, cache, slots)]
            phases.append([_timed(step, sync) for step in (*steps, after) if step is not None])
            times.append(sum(phases[-1]))
        split = ", ".join(f"{name} {statistics.median(p[i] for p in phases) * 1e3:.2f} ms"
                          for i, name in enumerate(("load", "write-back", "fsync")[
                              :len(phases[0])]))
        note = "; ".join(x for x in (notes[-1] if notes else "", split) if x)
        out.append(Result(measure, key, n, 2 * n * row_bytes, tuple(times), note))
    return out


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def resident_share(tensor: torch.Tensor) -> float:
    """Share of the pages under ``tensor`` (a file mapping) in the page cache (``mincore``)."""
    page = mmap.PAGESIZE
    nbytes = tensor.numel() * tensor.element_size()
    pages = (nbytes + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = _libc()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) / pages


def drop_pages(tensor: torch.Tensor, path: str) -> float:
    """Write the file ``path`` under the mapping ``tensor`` to disk, unmap its pages from this
    process and drop them from the page cache (no root needed: only this file's clean pages);
    returns the share still resident."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        libc = _libc()
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        nbytes = tensor.numel() * tensor.element_size()
        if libc.madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes),
                        MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_share(tensor)


def _fill(t: torch.Tensor, gen: torch.Generator) -> None:
    step = 1 << 16
    for i in range(0, t.shape[0], step):
        t[i:i + step] = torch.randn(t[i:i + step].shape, generator=gen).to(t.dtype)


def measure_cuda(args, gen) -> list[Result]:
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = DTYPES[args.dtype]
    E, D, sizes = args.table_rows, args.dim, args.batch_rows
    sync = torch.cuda.synchronize
    table = torch.randn(E, D, device=device).to(dtype)
    out = _gather(table, sizes, args.repeats, gen, sync, "hbm_bandwidth")
    del table
    cache = torch.zeros(sizes[-1], D, dtype=dtype, device=device)
    for i, kind in enumerate(args.host_memory):  # the YAML takes the first
        with knobs.set_for_now("FBTD_HOST_MEMORY", kind):
            backing = Backing("link", Storage(tier="cached"), E, D, dtype, pin=True)
        _fill(backing.weight, gen)
        view = host_mapped.wrap(backing.weight, host_mapped.DL_CUDA, device.index)
        made = "managed" if cuda_managed.is_managed(backing.weight) else "pinned"
        out += _round_trips(view, cache, sizes, args.repeats, gen, sync,
                            f"cached tier: {made} host <-> HBM (mapped view)",
                            "host_tier_bandwidth" if i == 0 else None)
        del view, backing
    return out


def measure_cpu(args, gen) -> list[Result]:
    dtype = DTYPES[args.dtype]
    E, D, sizes = args.table_rows, args.dim, args.batch_rows
    sync = _no_sync
    table = torch.randn(E, D).to(dtype)
    out = _gather(table, sizes, args.repeats, gen, sync, "hbm_bandwidth")
    backing = Backing("link", Storage(tier="cached"), E, D, dtype, pin=False)
    backing.weight.copy_(table)
    del table
    cache = torch.zeros(sizes[-1], D, dtype=dtype)
    out += _round_trips(backing.weight, cache, sizes, args.repeats, gen, sync,
                        "cached tier: RAM <-> RAM", "host_tier_bandwidth")
    del backing
    with tempfile.TemporaryDirectory(prefix="fbtd-link-", dir=args.dir) as folder:
        files = Backing("link", Storage(tier="file", path=folder), E, D, dtype, pin=False)
        weight, path = files.weight, files.file("weight")
        _fill(weight, gen)
        shares: list[float] = []

        def drop() -> str:
            shares.append(drop_pages(weight, path))
            return f"resident before: {max(shares[-args.repeats:]):.1%} at most"

        cold = _round_trips(weight, cache, sizes, args.repeats, gen, sync,
                            "file tier: cold + fsync", "disk_bandwidth", before=drop,
                            after=lambda: _fsync(path))
        warm = []
        for r in cold:  # the same sizes again, the file now in the page cache
            _touch(weight)
            warm += _round_trips(weight, cache, [r.rows], args.repeats, gen, sync,
                                 "file tier: page cache warm", "disk_bandwidth",
                                 before=lambda: f"resident {resident_share(weight):.1%}")
    used, other = (cold, warm) if max(shares) <= COLD_RESIDENT else (warm, cold)
    out += [*used, *(_unused(r) for r in other)]
    return out


def _no_sync() -> None:
    """The CPU's work is done when its call returns."""


def _unused(r: Result) -> Result:
    return Result(r.measure, None, r.rows, r.nbytes, r.seconds, r.note)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _touch(t: torch.Tensor) -> None:
    """Read every page of ``t`` (into the page cache)."""
    float(t.float().sum()) if t.numel() else None


def cost_of(results: Sequence[Result]) -> dict[str, float]:
    """Each cost key's median at the largest size measured for it."""
    out: dict[str, Result] = {}
    for r in results:
        if r.cost_key is not None and (r.cost_key not in out or r.rows > out[r.cost_key].rows):
            out[r.cost_key] = r
    return {k: float(f"{r.median:.4e}") for k, r in out.items()}


def _machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    text = f"{os.cpu_count()} CPU(s) {cpu}"
    if device == "cuda":
        text += f", {torch.cuda.get_device_name()}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{text}; load average {load:.2f}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} thread(s)")


def format_table(results: Sequence[Result]) -> str:
    head = ("| measure | rows/call | MiB/call | GB/s median | min - max | cost key | note |\n"
            "| --- | ---: | ---: | ---: | --- | --- | --- |")
    lines = [head]
    for r in results:
        rates = r.rates()
        lines.append(f"| {r.measure} | {r.rows} | {r.nbytes / 2**20:.2f} | "
                     f"{r.median / 1e9:.3f} | {min(rates) / 1e9:.3f} - {max(rates) / 1e9:.3f} | "
                     f"{r.cost_key or '-'} | {r.note} |")
    return "\n".join(lines)


def cost_yaml(cost: dict[str, float], results: Sequence[Result], header: Sequence[str]) -> str:
    """The ``cost:`` block (``plan --cost``), each value a YAML float, commented."""
    label = {r.cost_key: r.measure for r in results if r.cost_key is not None}
    lines = [f"# {h}" for h in header]
    lines.append("cost:")
    for k, v in cost.items():
        lines.append(f"  {k}: {v:.4e}  # {v / 1e9:.3f} GB/s, {label[k]}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    command = "python -m fbtriton_dist.bench link " + " ".join(
        sys.argv[1:] if argv is None else argv)
    results = measure_cuda(args, gen) if args.device == "cuda" else measure_cpu(args, gen)
    cost = cost_of(results)
    print(format_table(results))
    header = [f"measured by: {command}", f"machine: {_machine(args.device)}",
              f"rows of {args.dim} x {args.dtype}, table of {args.table_rows} rows; medians of "
              f"{args.repeats} repeats at {args.batch_rows[-1]} rows a call (bench/link.py)"]
    text = cost_yaml(cost, results, header)
    print(text, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.out}")
    return cost


if __name__ == "__main__":
    main()
