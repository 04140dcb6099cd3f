"""The fast CPU path's native kernels (``csrc/``: C, on a pool of pthreads), compiled at first
use and called through ctypes; ``ops/cpu.py`` calls them where they apply and keeps its torch
ops for the rest.

The library is built once per source, compiler and flags (``BASE_FLAGS``;
``$CC`` picks the compiler) into the cache directory (``FBTD_CPU_NATIVE_CACHE``, default
``~/.cache/fbtriton_dist``, else a per-user temporary directory), under a name that hashes
them: a compile writes a temporary file and renames it into place (``os.replace``), so that
processes (ranks) building it at once never load a half-written file. Without a compiler, or
when every build fails, one warning names why and the torch ops run instead;
``FBTD_CPU_NATIVE=0`` turns the kernels off (``knobs.cpu_native``). The kernels run on
``torch.get_num_threads()`` threads, at most one per core the process may use (its affinity
mask and cgroup CPU quota, ``usable_cpus()``), and give the same bits for any count. Their
threads claim tasks from a counter rather than meeting at barriers (``csrc/tbe_pool.c``): on a
machine whose cores other processes keep busy, a thread the OS holds back leaves its tasks to
the others instead of stalling them (OpenMP's fork-join teams, torch's included, wait for it).

Each wrapper returns None where the kernels do not apply (no library, a weights dtype other
than fp32 / fp16 / bf16, a non-CPU tensor, keys too wide to sort), and the caller runs its
torch ops. Every kernel checks the ids and bags it reads against the buffers' sizes (never out
of bounds, whatever ``bounds_check`` let through) and raises on a bad batch; the forward,
given ``err``, instead drops and counts them (``bounds_check="error"`` / ``"warn"``: the
lookup's bounds check, ``ops.tbe``).
"""

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from fbtriton_dist import knobs, optim, optim_counter
from fbtriton_dist.pooling import PoolingMode
from fbtriton_dist.reference.tbe import step_seed

CSRC = Path(__file__).resolve().parent / "csrc"
BACKWARD_SOURCE = CSRC / "tbe_cpu_backward.c"
"""The backward and its fused optimizers: their ``OPT_*`` codes and ``HYPER_*`` slots."""
COUNTER_SOURCE = CSRC / "tbe_cpu_counter.c"
"""Rowwise Adagrad with counter's row update: its ``CTR_*`` slots
(``optim_counter.NATIVE_COUNTER_FIELDS``). ``BACKWARD_SOURCE`` includes it (its row update
inlined into the run loop), so it is built as a header is."""
SOURCES = (CSRC / "tbe_cpu.c", BACKWARD_SOURCE, CSRC / "tbe_pool.c")
HEADERS = (CSRC / "tbe_cpu.h", COUNTER_SOURCE)
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread", "-shared", "-fPIC")
"""``-fno-math-errno``: sqrtf never sets errno, so that GCC vectorises the per-element updates
(Adagrad's, Adam's sqrt; correctly rounded either way: the same bits)."""
FLAG_SETS = (
    (),
    ("-DTBE_NO_CLONES",),  # a compiler without target_clones (or not GCC)
)
"""Tried in order until one builds."""

DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
BEFORE_LOOKUP_STATES = {("rowwise_adagrad_global_decay", "prev_iter")}
"""(optimizer, state) pairs the backward neither reads nor writes: global decay's ``prev_iter``
belongs to the module's catch-up decay before the lookup (``ops/global_decay.py``); its row
update is rowwise Adagrad's on ``momentum1``."""


def _header_optimizers() -> tuple[str, ...]:
    """The ``OPT_<NAME>`` codes of ``csrc/tbe_cpu_backward.c`` but ``OPT_NONE``, as registry
    names (none where the source is missing: the kernels cannot be built then)."""
    try:
        text = re.sub(r"/\*.*?\*/", "", BACKWARD_SOURCE.read_text(), flags=re.S)  # no comments
    except OSError:
        return ()
    return tuple(n.lower() for n in re.findall(r"\bOPT_([A-Z][A-Z0-9_]*)\s*=", text)
                 if n != "NONE")


NATIVE_OPTIMIZERS = _header_optimizers()
"""The optimizers of ``optim.REGISTRY`` that the C side implements: an ``OPT_<NAME>`` of
``csrc/tbe_cpu_backward.c`` each (read from there; a test checks each code against the
registry's). The CPU backend's capabilities list only these (while the source is there): a
registry optimizer the C code lacks is refused when a module is built, not at its first
backward."""
OPT_CODES = {n: optim.KERNEL_CODES[n] for n in NATIVE_OPTIMIZERS if n in optim.KERNEL_CODES}
"""The C side's optimizer codes (``optim.NO_OPTIMIZER_CODE``: none, the summed gradients
written out)."""
BAD_FIRST, BAD_LAST, BAD_ORDER, BAD_ID, BAD_WEIGHT, NO_MEMORY, TOO_BIG = 1, 2, 4, 8, 16, 32, 64

_P, _I64, _I32, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
_PLAN = [_P, _I32, _I64, _P, _I32, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _I32, _I64, _P, _P,
         _P, _P, _P, _P, _P, _P]
"""The plan's arguments (the C side's PLAN_ARGS)."""
_SIGNATURES = {
    "tbe_check": (_I32, [_P, _I32, _I64, _P, _I32, _I64, _I64, _P, _P, _I32]),
    "tbe_forward": (_I32, [_P, _I32, _I64, _P, _P, _P, _P, _P, _I32, _I64, _P, _I32, _P, _I64,
                           _I64, _I32, _P, _I64, _P, _I32, _I32]),
    "tbe_plan": (_I64, [*_PLAN, _P, _P, _I32]),
    "tbe_backward_fused": (_I32, [*_PLAN, _P, _P, _I32, _P, _P, _I32, _P, _I32, ctypes.c_uint64,
                                  _I64, _I32]),
    "tbe_backward_fused_counter": (_I32, [*_PLAN, _P, _P, _I32, _P, _P, _P, _P, _P, _I32,
                                          ctypes.c_uint64, _I64, _I32]),
    "tbe_backward": (_I32, [_P, _P, _I32, _P, _P, _P, _P, _I64, _P, _P, _P, _P, _I32, _P, _P,
                            _I32, _P, _I32, ctypes.c_uint64, _P, _P, _P, _I64, _I32]),
    "tbe_usable_cpus": (_I32, []),
    "tbe_pool_started": (_I32, []),
    "tbe_psw_grad": (_I32, [_P, _I64, _I32, _P, _I32, _I64, _P, _P, _P, _P, _P, _I32, _I64, _P,
                            _I32, _I64, _I64, _P, _I32]),
}

_lock = threading.Lock()
_state: dict = {}
"""``lib``: the loaded library, or ``error``: why there is none (warned once)."""


def reset() -> None:
    """Forget the loaded library (or the failure): the next call builds or loads it again."""
    with _lock:
        _state.clear()


def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded at the first call; None when ``FBTD_CPU_NATIVE=0`` or
    when they cannot be built (warned once per process)."""
    if not knobs.cpu_native():
        return None
    lib = _state.get("lib")
    if lib is not None or "error" in _state:
        return lib
    with _lock:
        if "lib" not in _state and "error" not in _state:
            try:
                _state["lib"] = _load()
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _state["error"] = str(e)
                warnings.warn(
                    f"the fast CPU path's native kernels are unavailable ({e}); the CPU backend "
                    "runs its torch ops instead (set FBTD_CPU_NATIVE=0 to not try)",
                    RuntimeWarning, stacklevel=3,
                )
    return _state.get("lib")


def describe() -> str:
    """What the CPU backend runs: the library's path, or why the torch ops run instead."""
    lib = library()
    if lib is not None:
        return f"native kernels {lib._name}"
    return "torch ops (" + (_state.get("error") or "FBTD_CPU_NATIVE=0") + ")"


def cache_dir() -> Path:
    """``FBTD_CPU_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/fbtriton_dist`` (``~/.cache``), else a
    per-user directory under the system's temporary directory; created if missing."""
    chosen = knobs.cpu_native_cache()
    if chosen:
        candidates = [Path(chosen)]
    else:
        home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
        candidates = [Path(home) / "fbtriton_dist",
                      Path(tempfile.gettempdir()) / f"fbtriton_dist-{uid}"]
    for path in candidates:
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise RuntimeError(f"no writable cache directory among {[str(p) for p in candidates]}")


def _load() -> ctypes.CDLL:
    cc = os.environ.get("CC") or "cc"
    compiler = shutil.which(cc)
    if compiler is None:
        raise RuntimeError(f"no C compiler: {cc!r} is not on PATH")
    missing = [p.name for p in (*SOURCES, *HEADERS) if not p.is_file()]
    if missing:
        raise RuntimeError(
            f"expected the C sources {', '.join(missing)} in {CSRC}, got none: the package was "
            "installed without its data files (pyproject.toml's [tool.setuptools.package-data])"
        )
    source = b"\0".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    where = cache_dir()
    errors = []
    for extra in FLAG_SETS:
        flags = (*BASE_FLAGS, *extra)
        key = hashlib.sha256(b"\0".join(
            [source, compiler.encode(), platform.machine().encode(), *(f.encode() for f in flags)]
        )).hexdigest()[:20]
        so = where / f"tbe_cpu-{key}.so"
        if not so.exists():
            error = _compile(compiler, flags, so)
            if error:
                errors.append(f"{' '.join(flags)}: {error}")
                continue
        lib = ctypes.CDLL(str(so))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        return lib
    raise RuntimeError(f"{compiler} could not build {', '.join(p.name for p in SOURCES)}: "
                       + "; ".join(errors))


def _compile(compiler: str, flags: tuple[str, ...], so: Path) -> str | None:
    """Build ``so`` (via a temporary file in its directory, renamed into place); returns the
    compiler's complaint, or None."""
    fd, tmp = tempfile.mkstemp(prefix=so.name + ".", suffix=".tmp", dir=so.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-o", tmp, *map(str, SOURCES)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return (done.stderr or done.stdout).strip()[-400:] or f"exit {done.returncode}"
        os.replace(tmp, so)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# ---------------------------------------------------------------- wrappers


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ids(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(contiguous int32 / int64 ids, 1 for int32)."""
    if t.dtype not in (torch.int32, torch.int64):
        t = t.to(torch.int64)
    return (t if t.is_contiguous() else t.contiguous()), int(t.dtype == torch.int32)


def _as(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` contiguous in ``dtype`` (itself when it is: these run at every call)."""
    if t is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    return t.to(dtype).contiguous()


def _long(t: torch.Tensor) -> torch.Tensor:
    return _as(t, torch.int64)


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    return _as(t, torch.float32)


def _usable(*tensors: torch.Tensor | None) -> ctypes.CDLL | None:
    """The library, if every tensor given is on the CPU (and the weights, the first, of a dtype
    the kernels take); else None."""
    for t in tensors:  # a loop, not any(generator): this runs at every forward
        if t is not None and not t.is_cpu:
            return None
    if tensors[0].dtype not in DTYPES or not tensors[0].is_contiguous():
        return None
    return library()


def _raise(code: int, what: str) -> None:
    bits = -code
    if bits & NO_MEMORY:
        raise MemoryError(f"{what}: out of memory in the native CPU kernels")
    if bits & (BAD_ORDER | BAD_FIRST | BAD_LAST):
        raise ValueError(f"{what}: expected offsets non-decreasing within [0, len(indices)] "
                         "(the native CPU kernels read no bag outside them)")
    if bits & BAD_ID:
        raise IndexError(f"{what}: an id is out of range for its table (expected 0 <= id < E; "
                         "bounds_check='ignore' does not check ids, the native CPU kernels "
                         "refuse to read outside the tables)")
    raise RuntimeError(f"{what}: native CPU kernel error {code}")


def usable_cpus() -> int | None:
    """The cores the kernels' threads may use (the affinity mask, capped by the cgroup's CPU
    quota): no kernel runs on more threads, whatever ``torch.get_num_threads()`` says; None
    without the library."""
    lib = library()
    return None if lib is None else lib.tbe_usable_cpus()


def pool_threads() -> int | None:
    """The kernels' pool threads started in this process (the calling thread not counted);
    None without the library."""
    lib = library()
    return None if lib is None else lib.tbe_pool_started()


def check(indices, offsets, rows, per_sample_weights) -> int | None:
    """The BAD_* bits of one batch (0: offsets and ids well formed, weights finite when
    given), or None without the library: one pass, before ``ops.tbe``'s slower check names
    what is wrong."""
    if indices.device.type != "cpu":
        return None
    lib = library()
    if lib is None:
        return None
    idx, idx32 = _ids(indices)
    off, off32 = _ids(offsets)
    T = rows.numel()
    B = (off.numel() - 1) // T
    psw = _fp32(per_sample_weights)
    return lib.tbe_check(idx.data_ptr(), idx32, idx.numel(), off.data_ptr(), off32, T, B,
                         _long(rows).data_ptr(), _ptr(psw), torch.get_num_threads())


def forward(weights, w_offsets, dims, D_offsets, indices, offsets, per_sample_weights, *,
            pooling: int, max_D: int, total_D: int, rows=None,
            err: torch.Tensor | None = None, check_weights: bool = False) -> torch.Tensor | None:
    """``cpu.tbe_forward`` in fp32 (pooled ``[B, total_D]``, unpooled ``[N, max_D]``), or
    None where the kernels do not apply. ``err`` ([3] int64, as the Triton forward's): ids
    outside ``rows`` are dropped and counted there (``err[0]``; ``err[1]``: N minus the first
    one's position, a max), malformed bags added to ``err[2]``, in the lookup's own pass
    (and, ``check_weights``, the non-finite per-sample weights); without it a bad batch
    raises."""
    lib = _usable(weights, indices, offsets, err)
    if lib is None or (err is not None and (err.dtype != torch.int64
                                            or not err.is_contiguous())):
        return None
    idx, idx32 = _ids(indices)
    off, off32 = _ids(offsets)
    T = dims.numel()
    B = (off.numel() - 1) // T
    psw = _fp32(per_sample_weights)
    if pooling == PoolingMode.NONE:
        out = torch.zeros((idx.numel(), max_D), dtype=torch.float32)
    else:
        out = torch.empty((B, total_D), dtype=torch.float32)
    rows = _long(rows) if rows is not None else None
    code = lib.tbe_forward(
        weights.data_ptr(), DTYPES[weights.dtype], weights.numel(), _long(w_offsets).data_ptr(),
        _long(dims).data_ptr(), _long(D_offsets).data_ptr(), _ptr(rows), idx.data_ptr(), idx32,
        idx.numel(), off.data_ptr(), off32, _ptr(psw), T, B, pooling, out.data_ptr(),
        out.shape[1], _ptr(err), int(check_weights), torch.get_num_threads(),
    )
    if code:
        _raise(code, "TBE forward")
    return out


def _plan_args(idx, idx32, off, off32, T, B, rows, w_offsets, dims, row_offsets, D_offsets,
               elem_limit, row_limit, pooling, stride, psw) -> tuple[list, dict]:
    """The C side's PLAN_ARGS, with the buffers they fill (by name)."""
    N = idx.numel()
    bufs = dict(packed=torch.empty(N, dtype=torch.int64), tmp=torch.empty(N, dtype=torch.int64),
                feat=torch.empty(N, dtype=torch.int32), gofs=torch.empty(N, dtype=torch.int64),
                scale=torch.empty(N) if psw is not None or pooling == PoolingMode.MEAN else None,
                runs=torch.empty(N + 4 * torch.get_num_threads() + 2, dtype=torch.int64))
    args = [idx.data_ptr(), idx32, N, off.data_ptr(), off32, T, B, _ptr(rows),
            w_offsets.data_ptr(), dims.data_ptr(), row_offsets.data_ptr(), elem_limit, row_limit,
            pooling, stride, D_offsets.data_ptr(), _ptr(psw), *map(_ptr, bufs.values())]
    return args, bufs


def backward(grad_output, weights, w_offsets, dims, row_offsets, D_offsets, indices, offsets,
             per_sample_weights, *, pooling: int, max_D: int, optimizer, t: int, momentum1,
             momentum2, stochastic_rounding: bool, seed: int, rows=None, prev_iter=None,
             row_counter=None, max_counter: float | None = None):
    """``cpu.tbe_backward`` after its step advance (``t`` the new step; 0 without optimizer):
    with an optimizer, True once every touched row is updated in place (``tbe_backward_fused``,
    one call; rowwise Adagrad with counter: ``tbe_backward_fused_counter`` with its
    ``prev_iter``, ``row_counter`` and the module's ``max_counter``, already refreshed);
    without, ``(row_elems, row_dims, row_grads)`` (``tbe_plan``, then ``tbe_backward``); None
    where the kernels do not apply (nothing done)."""
    lib = _usable(weights, grad_output, indices, offsets, momentum1, momentum2)
    if lib is None:
        return None
    spec = optim.spec_of(optimizer) if optimizer is not None else None
    if spec is not None and spec.name not in OPT_CODES:
        return None  # the torch ops' step (the backend's capabilities refuse it earlier)
    counter = isinstance(optimizer, optim.RowWiseAdagradWithCounter)
    buffers = {"momentum1": momentum1, "momentum2": momentum2, "prev_iter": prev_iter,
               "row_counter": row_counter}
    read = [s for s in spec.states if (spec.name, s.name) not in BEFORE_LOOKUP_STATES] \
        if spec is not None else []
    states = [buffers[s.name] for s in read]
    if any(s is None or s.dtype != torch.float32 or not s.is_contiguous() for s in states):
        return None
    idx, idx32 = _ids(indices)
    off, off32 = _ids(offsets)
    T = dims.numel()
    B = (off.numel() - 1) // T
    w_offsets, dims, row_offsets = _long(w_offsets), _long(dims), _long(row_offsets)
    elem_limit, row_limit = weights.numel(), -1
    for state, buffer in zip(read, states, strict=True):
        if state.per_row:
            row_limit = buffer.numel() if row_limit < 0 else min(row_limit, buffer.numel())
        else:
            elem_limit = min(elem_limit, buffer.numel())
    grad = _fp32(grad_output)
    args, bufs = _plan_args(idx, idx32, off, off32, T, B,
                            _long(rows) if rows is not None else None, w_offsets, dims,
                            row_offsets, _long(D_offsets), elem_limit, row_limit, pooling,
                            grad.shape[1] if grad.dim() == 2 else 0, _fp32(per_sample_weights))
    threads = torch.get_num_threads()
    if optimizer is not None:
        m1 = states[0] if states else None
        m2 = states[1] if len(states) > 1 else None
        hyper = _hyper(optimizer, t)
        if counter:
            values = optim_counter.native_counter_parameters(optimizer, max_counter)
            code = lib.tbe_backward_fused_counter(
                *args, grad.data_ptr(), weights.data_ptr(), DTYPES[weights.dtype], _ptr(m1),
                _ptr(m2), _ptr(states[2]), hyper, (ctypes.c_double * len(values))(*values),
                int(stochastic_rounding and weights.dtype != torch.float32),
                step_seed(seed, t), max_D, threads,
            )
        else:
            code = lib.tbe_backward_fused(
                *args, grad.data_ptr(), weights.data_ptr(), DTYPES[weights.dtype], _ptr(m1),
                _ptr(m2), OPT_CODES[spec.name], hyper,
                int(stochastic_rounding and weights.dtype != torch.float32), step_seed(seed, t),
                max_D, threads,
            )
        if code == -TOO_BIG:
            return None
        if code:
            _raise(code, "TBE backward")
        return True
    run_start = torch.empty(idx.numel() + 1, dtype=torch.int64)
    pos_bits = ctypes.c_int(0)
    U = lib.tbe_plan(*args, run_start.data_ptr(), ctypes.byref(pos_bits), threads)
    if U == -TOO_BIG:
        return None
    if U < 0:
        _raise(U, "TBE backward")
    row_grads = torch.empty((U, max_D), dtype=torch.float32)
    row_elems = torch.empty(U, dtype=torch.int64)
    row_dims = torch.empty(U, dtype=torch.int64)
    code = lib.tbe_backward(
        grad.data_ptr(), bufs["packed"].data_ptr(), pos_bits.value, bufs["feat"].data_ptr(),
        bufs["gofs"].data_ptr(), _ptr(bufs["scale"]), run_start.data_ptr(), U,
        w_offsets.data_ptr(), dims.data_ptr(), row_offsets.data_ptr(), weights.data_ptr(),
        DTYPES[weights.dtype], None, None, optim.NO_OPTIMIZER_CODE, _hyper(None, 0), 0, 0,
        row_grads.data_ptr(), row_elems.data_ptr(), row_dims.data_ptr(), max_D, threads,
    )
    if code:
        _raise(code, "TBE backward")
    return row_elems, row_dims, row_grads


def _hyper(optimizer, t: int) -> ctypes.Array:
    """The C side's ``double hyper[HYPER_COUNT]``: ``optim.NATIVE_HYPER_FIELDS``."""
    values = optim.native_hyper_parameters(optimizer, t)
    return (ctypes.c_double * len(values))(*values)


def per_sample_weights_grad(grad_output, weights, w_offsets, dims, D_offsets, indices, offsets,
                            *, pooling: int, rows=None) -> torch.Tensor | None:
    """``cpu.tbe_per_sample_weights_grad`` ([N] fp32), or None where the kernels do not
    apply."""
    lib = _usable(weights, grad_output, indices, offsets)
    if lib is None:
        return None
    idx, idx32 = _ids(indices)
    off, off32 = _ids(offsets)
    T = dims.numel()
    B = (off.numel() - 1) // T
    grad = _fp32(grad_output)
    out = torch.zeros(idx.numel(), dtype=torch.float32)
    rows = _long(rows) if rows is not None else None
    lib.tbe_psw_grad(
        grad.data_ptr(), grad.shape[1], pooling, weights.data_ptr(), DTYPES[weights.dtype],
        weights.numel(), _long(w_offsets).data_ptr(), _long(dims).data_ptr(),
        _long(D_offsets).data_ptr(), _ptr(rows), idx.data_ptr(), idx32, idx.numel(),
        off.data_ptr(), off32, T, B, out.data_ptr(), torch.get_num_threads(),
    )
    return out
