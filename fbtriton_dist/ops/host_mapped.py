"""Tensors of a device whose memory is host memory (zero-copy): the ``host`` storage tier.

``empty(shape, dtype, device)`` on a CUDA device allocates host memory the device can address
(CUDA managed memory kept on the host, ``ops/cuda_managed.py``, read through large pages; or,
with ``FBTD_HOST_MEMORY=pinned`` or where the device cannot, pinned memory) and hands torch
a DLPack capsule that calls that memory CUDA memory of ``device``: with unified virtual
addressing (every 64-bit CUDA platform) that memory has the same address on the device,
so every torch op and every Triton kernel reads and writes it in place, over PCIe, as FBGEMM's
``EmbeddingLocation.MANAGED`` rows (TorchRec's ``fused_uvm``). No compiled extension: the
capsule is built with ctypes. On the CPU the same code wraps ordinary host memory with the
DLPack CPU device type (tests run the very same capsule and deleter code there).

The capsule's deleter drops the one reference that keeps the host tensor alive: the memory is
freed (to the driver, or to torch's pinned allocator) when the last tensor viewing it dies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from fbtriton_dist import knobs
from fbtriton_dist.ops import cuda_managed

__all__ = ["DL_CPU", "DL_CUDA", "copy_of", "cuda_addressable", "empty", "host_copy", "host_of",
           "is_host_mapped", "live_count", "wrap"]

DL_CPU = 1
"""DLPack's ``kDLCPU``."""
DL_CUDA = 2
"""DLPack's ``kDLCUDA``."""


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DELETER)]

_CODES = {  # DLPack type codes: 0 int, 1 uint, 2 float, 4 bfloat
    torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16),
    torch.float64: (2, 64), torch.int64: (0, 64), torch.int32: (0, 32), torch.int8: (0, 8),
    torch.uint8: (1, 8),
}

_ALIVE: dict[int, tuple] = {}
"""Address of each live ``DLManagedTensor`` -> what must outlive it: the struct, the host
tensor, the shape and stride arrays. The deleter removes the entry."""
_MAPPED: dict[int, int] = {}
"""Host address of each live mapping (non-empty ones) -> its DLManagedTensor's address."""


@_DELETER
def _delete(managed) -> None:
    address = ctypes.addressof(managed.contents)
    entry = _ALIVE.pop(address, None)
    if entry is not None:
        _MAPPED.pop(entry[1].data_ptr(), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def wrap(host: torch.Tensor, device_type: int, device_id: int = 0) -> torch.Tensor:
    """A tensor on DLPack device ``(device_type, device_id)`` over the memory of the contiguous
    CPU tensor ``host`` (``DL_CUDA``: ``host`` must be pinned). The result keeps ``host``
    alive; writes through either are seen by the other."""
    if host.device.type != "cpu" or not host.is_contiguous():
        raise ValueError(f"host: expected a contiguous CPU tensor, got {host.device} "
                         f"contiguous={host.is_contiguous()}")
    if host.dtype not in _CODES:
        raise ValueError(f"dtype: expected one of {list(_CODES)}, got {host.dtype}")
    if (device_type == DL_CUDA and host.numel()  # empty: no memory
            and not cuda_addressable(host)):
        raise ValueError("host: a CUDA mapping needs pinned or managed host memory, got "
                         "pageable memory")
    n = host.dim()
    shape = (ctypes.c_int64 * max(n, 1))(*host.shape)
    strides = (ctypes.c_int64 * max(n, 1))(*host.stride())
    code, bits = _CODES[host.dtype]
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(host.data_ptr(), _DLDevice(device_type, device_id), n,
                                  _DLDataType(code, bits, 1), shape, strides, 0)
    managed.deleter = _delete
    address = ctypes.addressof(managed)
    _ALIVE[address] = (managed, host, shape, strides)
    if host.numel():
        _MAPPED[host.data_ptr()] = address
    capsule = _capsule_new(address, b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)


def _host_memory(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if knobs.host_memory() == "managed" and cuda_managed.available(index):
            return cuda_managed.empty(shape, dtype, device)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if device.type != "cpu":
        raise ValueError(f"device: expected a CUDA or CPU device, got {device}")
    return torch.empty(shape, dtype=dtype)


def _map(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return wrap(host, DL_CUDA, index)
    return wrap(host, DL_CPU)


def empty(shape: int | Sequence[int], dtype: torch.dtype, device: torch.device | str,
          fill: float | None = None) -> torch.Tensor:
    """A ``shape`` tensor of ``dtype`` on ``device`` whose memory is host memory (pinned and
    mapped on CUDA, ordinary on the CPU), uninitialised or ``fill``-ed (on the host)."""
    device = torch.device(device)
    host = _host_memory(shape, dtype, device)
    if fill is not None:
        host.fill_(fill)
    return _map(host, device)


def copy_of(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A copy of ``tensor`` (any device) on ``device`` in host memory, as ``empty``'s; the
    values are copied into the host memory before it is mapped."""
    device = torch.device(device)
    return _map(host_copy(tensor, device), device)


def host_copy(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor holding ``tensor``'s values in host memory that ``device`` addresses, as
    ``empty``'s (on CUDA managed or pinned; ``wrap`` maps it)."""
    host = _host_memory(tuple(tensor.shape), tensor.dtype, torch.device(device))
    with torch.no_grad():
        host.copy_(tensor)
    return host


def cuda_addressable(tensor: torch.Tensor) -> bool:
    """``tensor`` (a CPU tensor) lies in pinned or managed host memory: ``wrap`` maps it for
    CUDA."""
    return tensor.is_pinned() or cuda_managed.is_managed(tensor)


def is_host_mapped(tensor: torch.Tensor) -> bool:
    """``tensor`` (or a view of it) lives in memory made by ``empty`` / ``wrap``; an empty
    tensor (no memory anywhere) counts as mapped."""
    if tensor.numel() == 0:
        return True
    return tensor.untyped_storage().data_ptr() in _MAPPED


def host_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The CPU tensor whose memory the mapped ``tensor`` (or a view of it) is, else None."""
    address = _MAPPED.get(tensor.untyped_storage().data_ptr()) if tensor.numel() else None
    return None if address is None else _ALIVE[address][1]


def live_count() -> int:
    """Mappings whose tensors are still alive (what the tests check for leaks)."""
    return len(_ALIVE)
