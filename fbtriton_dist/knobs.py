"""Every ``FBTD_*`` environment variable the package reads, read here and nowhere else.

A knob changes how fast something runs or how long it waits, never a result. Each is listed
in ``KNOBS`` (name -> what it does, its default) and in DEVELOPERS.md. Two are read once, when
this module is first imported (``FBTD_FAST_LAUNCH``, ``FBTD_TBE_AHEAD``: set them before
Python starts); the launch-config overrides are read at every call, so that a sweep
(``python -m fbtriton_dist.bench.tbe_sweep``) can set them between launches.

The shell entry points have their own (``FBTD_VENV``, ``FBTD_JOB``, ``FBTD_DEV``,
``FBTD_TEST_WORKERS`` in ``launch/*.sh``) and the tests one (``FBTD_DIST_BACKEND`` in
``tests/sharding/harness.py``); they never reach the package.
"""

import contextlib
import os

KNOBS: dict[str, tuple[str, str]] = {
    "FBTD_FAST_LAUNCH": (
        "0: launch every Triton kernel through Triton's own path (kernels/launch.py), "
        "instead of the cached launcher", "1"),
    "FBTD_TBE_AHEAD": (
        "0: sort the backward's keys in the backward, not on a side stream beside the "
        "forward (ops/tbe.py; to measure the difference)", "1"),
    "FBTD_TBE_FWD": (
        "block_l,num_warps[,maxnreg]: the TBE forward kernel's launch config "
        "(kernels/tbe_forward.py)", "the shape heuristic"),
    "FBTD_TBE_BWD": (
        "runs,num_warps[,ids[,chunk[,maxnreg]]]: the TBE backward kernels' launch config; "
        "fields not given keep the heuristic's (kernels/tbe_backward.py)", "the heuristic"),
    "FBTD_BUCKETIZE": (
        "bags,block,warps (powers of two): the bucketize kernels' launch config "
        "(kernels/bucketize.py)", "8,16,1"),
    "FBTD_CPU_NATIVE": (
        "0: the CPU backend runs its torch ops only (ops/cpu.py), without building or calling "
        "its native C kernels (ops/cpu_native.py); read at every call", "1"),
    "FBTD_CPU_HUGE_PAGES": (
        "0: a CPU TBE's large flat weights and states (>= 32 MiB) get no madvise(MADV_HUGEPAGE) "
        "(ops/cpu_memory.py); read when they are allocated", "1"),
    "FBTD_CPU_NATIVE_CACHE": (
        "directory where the native CPU kernels are compiled to (ops/cpu_native.py)",
        "~/.cache/fbtriton_dist"),
    "FBTD_SLOT_MAP": (
        "where a cached table's slot map lives: auto (on the cache's device on CUDA, on the "
        "host elsewhere), device (on the cache's device everywhere: the CUDA path on the CPU) "
        "or host; read when a module is built or moved (modules/tiers.py)", "auto"),
    "FBTD_HOST_MEMORY": (
        "the host tier's memory on CUDA: managed (CUDA managed memory kept on the host, read "
        "by the GPU through large pages; pinned where the device lacks concurrent managed "
        "access) or pinned (page-locked host memory); read at each allocation "
        "(ops/host_mapped.py)", "managed"),
    "FBTD_SLOT_MAP_KERNELS": (
        "the device slot map's ops: auto (Triton kernels on CUDA, torch ops elsewhere), 1 "
        "(the kernels everywhere: under TRITON_INTERPRET=1 on the CPU), 0 (torch ops "
        "everywhere); read when a module is built or moved (modules/tier_device_map.py)",
        "auto"),
    "FBTD_HOST_STAGE": (
        "the host tier's training lookups: auto (each batch's distinct rows staged in device "
        "memory where the tier is mapped host memory: CUDA), 1 (staged wherever a TBE's "
        "tables are all host: the CPU path of the tests), 0 (never: every row read over "
        "the link where it lies); read at each lookup (modules/host_stage.py)", "auto"),
    "FBTD_PG_TIMEOUT_S": (
        "seconds a collective of the training job waits before the process group fails "
        "(train/job.py)", "600"),
}
"""name -> (what it does, its default)."""


def _flag(name: str) -> bool:
    return os.environ.get(name, KNOBS[name][1]) != "0"


FAST_LAUNCH: bool = _flag("FBTD_FAST_LAUNCH")
"""``FBTD_FAST_LAUNCH``, read at import."""
TBE_AHEAD: bool = _flag("FBTD_TBE_AHEAD")
"""``FBTD_TBE_AHEAD``, read at import."""


def cpu_native() -> bool:
    """``FBTD_CPU_NATIVE``, read at every call (tests turn it off and on)."""
    return _flag("FBTD_CPU_NATIVE")


def cpu_huge_pages() -> bool:
    """``FBTD_CPU_HUGE_PAGES``, read at every allocation it governs."""
    return _flag("FBTD_CPU_HUGE_PAGES")


def cpu_native_cache() -> str | None:
    """``FBTD_CPU_NATIVE_CACHE``, or None (unset: ``cpu_native.cache_dir``'s default)."""
    return os.environ.get("FBTD_CPU_NATIVE_CACHE") or None


def slot_map_kernels() -> str:
    """``FBTD_SLOT_MAP_KERNELS``: ``auto``, ``0`` or ``1``; raises ValueError otherwise."""
    raw = os.environ.get("FBTD_SLOT_MAP_KERNELS") or KNOBS["FBTD_SLOT_MAP_KERNELS"][1]
    if raw not in ("auto", "0", "1"):
        raise ValueError(f"FBTD_SLOT_MAP_KERNELS: expected one of ['auto', '0', '1'], got {raw!r}")
    return raw


def host_stage() -> str:
    """``FBTD_HOST_STAGE``: ``auto``, ``0`` or ``1``; raises ValueError otherwise."""
    raw = os.environ.get("FBTD_HOST_STAGE") or KNOBS["FBTD_HOST_STAGE"][1]
    if raw not in ("auto", "0", "1"):
        raise ValueError(f"FBTD_HOST_STAGE: expected one of ['auto', '0', '1'], got {raw!r}")
    return raw


def slot_map() -> str:
    """``FBTD_SLOT_MAP``: ``auto``, ``device`` or ``host``; raises ValueError otherwise."""
    raw = os.environ.get("FBTD_SLOT_MAP") or KNOBS["FBTD_SLOT_MAP"][1]
    if raw not in ("auto", "device", "host"):
        raise ValueError(f"FBTD_SLOT_MAP: expected one of ['auto', 'device', 'host'], got {raw!r}")
    return raw


def host_memory() -> str:
    """``FBTD_HOST_MEMORY``: ``managed`` or ``pinned``; raises ValueError otherwise."""
    raw = os.environ.get("FBTD_HOST_MEMORY") or KNOBS["FBTD_HOST_MEMORY"][1]
    if raw not in ("managed", "pinned"):
        raise ValueError(f"FBTD_HOST_MEMORY: expected one of ['managed', 'pinned'], got {raw!r}")
    return raw


@contextlib.contextmanager
def set_for_now(name: str, value: str):
    """Knob ``name`` (a key of ``KNOBS``) set to ``value`` inside the ``with``, as before
    after it (the benchmarks build modules under a knob this way)."""
    if name not in KNOBS:
        raise ValueError(f"knob: expected one of {sorted(KNOBS)}, got {name!r}")
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _ints(name: str, counts: tuple[int, ...], form: str) -> list[int] | None:
    """The comma-separated integers of knob ``name`` (None when unset or empty); raises
    ValueError naming the knob, the expected ``form`` and the value."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        fields = [int(x) for x in raw.split(",")]
    except ValueError:
        fields = []
    if len(fields) not in counts:
        raise ValueError(f"{name}: expected {form}, got {raw!r}")
    return fields


def tbe_forward_config() -> list[int] | None:
    """``FBTD_TBE_FWD`` as ``[block_l, num_warps]`` or ``[block_l, num_warps, maxnreg]``."""
    return _ints("FBTD_TBE_FWD", (2, 3), "block_l,num_warps[,maxnreg]")


def tbe_backward_config() -> list[int] | None:
    """``FBTD_TBE_BWD``: 1 to 5 of ``runs, num_warps, ids, chunk, maxnreg``."""
    return _ints("FBTD_TBE_BWD", (1, 2, 3, 4, 5),
                 "at most 5 fields (runs,num_warps,ids,chunk,maxnreg)")


def bucketize_config() -> list[int] | None:
    """``FBTD_BUCKETIZE`` as ``[bags, block, warps]``, each a power of two."""
    fields = _ints("FBTD_BUCKETIZE", (3,), "bags,block,warps (powers of two)")
    if fields is not None and any(x < 1 or x & (x - 1) for x in fields):
        raise ValueError("FBTD_BUCKETIZE: expected bags,block,warps (powers of two), got "
                         f"{os.environ['FBTD_BUCKETIZE']!r}")
    return fields


def pg_timeout_s() -> float:
    """``FBTD_PG_TIMEOUT_S``: the training job's collective timeout in seconds (> 0)."""
    raw = os.environ.get("FBTD_PG_TIMEOUT_S", KNOBS["FBTD_PG_TIMEOUT_S"][1])
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"FBTD_PG_TIMEOUT_S: expected a number of seconds > 0, got {raw!r}")
    return value
