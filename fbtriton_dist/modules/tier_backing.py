"""The backing store of a cached table (``modules/tiers.py``): every row and its optimizer
state in host memory or in memory-mapped files (``file``), and the row copies between it and
the cache's slots."""

import mmap
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence

import torch

from fbtriton_dist.ops import host_mapped, tier_native
from fbtriton_dist.storage import Storage


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
    return _map_random(path, nbytes, numel, dtype)


def _map_random(path: str, nbytes: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``[numel]`` of ``dtype`` mapped shared onto ``path`` (writes go to the file), advised
    ``MADV_RANDOM`` where the platform has it: a miss reads its row's page, not the
    read-around window (``read_ahead_kb``, often MiBs) that a fault of a mapping reads by
    default, which made every missed row of a table bigger than RAM cost a window of disk
    reads (``docs/results/file-tier-1p5x-ram-2026-12-05.md``). The tensor holds the mapping."""
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    return torch.frombuffer(mapping, dtype=dtype, count=numel)


class Backing:
    """Every row of one cached table and its optimizer state: ``weight`` ``[E, D]`` and
    ``states`` (name -> ``[E]`` or ``[E, D]``, each in its dtype: fp32, or the module's
    ``optimizer_state_dtypes``), in host memory or files
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
        return host_mapped.host_copy(t, "cuda") if self.pin and numel else t

    def set_states(self, states: Sequence,
                   dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        """Optimizer states (``optim.REGISTRY``'s ``StateSpec``s) at zero, each in its dtype
        of ``dtypes`` (name -> dtype; fp32 where it names none), as the cache's slots keep
        it: the copies between them are exact."""
        dtypes = dtypes or {}
        self.states = {
            s.name: (self._tensor(s.name, self.rows, dtypes.get(s.name, torch.float32))
                     if s.per_row else
                     self._tensor(s.name, self.rows * self.dim,
                                  dtypes.get(s.name, torch.float32)).view(self.rows, self.dim))
            for s in states
        }

    def pin_now(self) -> None:
        """The module moved to CUDA: host-memory rows move into memory the device addresses
        (``ops/host_mapped.py``: managed or pinned; files stay mapped)."""
        if self.storage.tier == "file" or self.pin:
            return
        self.pin = True
        self.weight = host_mapped.host_copy(self.weight, "cuda")
        self.states = {k: host_mapped.host_copy(v, "cuda") for k, v in self.states.items()}


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64, torch.int64)


def copy_rows(dst: torch.Tensor, dst_at: torch.Tensor, src: torch.Tensor,
              src_at: torch.Tensor | None) -> None:
    """``dst[dst_at] = src[src_at]`` (``src_at`` None: every row of ``src``, in order), rows
    of ``[n, D]`` or elements of ``[n]``; converted to ``dst``'s device and dtype. Host tensors
    go through the native helper (``ops/tier_native.py``: a ``memcpy`` per row), else numpy
    (about twice torch's ``index_copy_`` on the CPU), else torch."""
    lib = tier_native.library() if dst.device.type == src.device.type == "cpu" else None
    if lib is not None and tier_native.copy_rows(lib, dst, dst_at, src, src_at):
        return
    if (dst.device.type == src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.dtype in _NUMPY_DTYPES):
        d, s = dst.detach().numpy(), src.detach().numpy()
        d[dst_at.numpy()] = s if src_at is None else s[src_at.numpy()]
        return
    rows = src if src_at is None else src.index_select(0, src_at.to(src.device))
    dst.index_copy_(0, dst_at.to(dst.device), rows.to(dst.device, dst.dtype))
