"""Host memory that a CUDA device reads through large pages: CUDA managed memory kept on the
host (the ``host`` tier's default memory on CUDA, ``ops/host_mapped.py``).

Pinned host memory (``cudaHostAlloc``, ``cudaHostRegister``) is mapped into the GPU's address
space with small pages: random rows read from a table of several GiB miss the GPU's TLB on
almost every row. On an H100, uniform random 512-byte rows gathered from 7.6 GiB of pinned
memory came at 16.7 GB/s against 50.6 GB/s from the same amount of managed memory (and 51 GB/s
from either at 1 GiB; docs/results/gpu-h100-host-memory-2026-12-05.md). FBGEMM's UVM
(``EmbeddingLocation.MANAGED``) uses managed memory for this reason.

A block here is ``cuMemAllocManaged`` memory advised to live on the host
(``CU_MEM_ADVISE_SET_PREFERRED_LOCATION`` = the CPU) and to stay mapped for the device
(``CU_MEM_ADVISE_SET_ACCESSED_BY``): its pages are made in host memory and never migrate; the
GPU reads and writes them over PCIe, the CPU as ordinary memory. Used only where the device
supports concurrent managed access (every Linux GPU since Pascal): elsewhere ``available`` is
false and the caller keeps pinned memory. No compiled extension: the driver API through ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

__all__ = ["available", "empty", "is_managed", "live_blocks"]

_ATTACH_GLOBAL = 1
_ADVISE_PREFERRED_LOCATION = 3
_ADVISE_ACCESSED_BY = 5
_DEVICE_CPU = -1
_ATTR_CONCURRENT_MANAGED_ACCESS = 89

_BLOCKS: dict[int, int] = {}
"""Address of each live block -> its size in bytes."""


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ptr, size, i = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
    for name, args in (
        ("cuMemAllocManaged", [ctypes.POINTER(ptr), size, ctypes.c_uint]),
        ("cuMemAdvise", [ptr, size, i, i]),  # the CUdevice form (every driver exports it)
        ("cuMemFree_v2", [ptr]),
        ("cuCtxGetCurrent", [ctypes.POINTER(ctypes.c_void_p)]),
        ("cuCtxPushCurrent_v2", [ctypes.c_void_p]),
        ("cuCtxPopCurrent_v2", [ctypes.POINTER(ctypes.c_void_p)]),
        ("cuCtxSynchronize", []),
        ("cuDeviceGet", [ctypes.POINTER(i), i]),
        ("cuDeviceGetAttribute", [ctypes.POINTER(i), i, i]),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what}: CUDA driver error {result}")


@functools.cache
def available(index: int) -> bool:
    """CUDA device ``index`` can read managed memory kept on the host while the CPU uses it
    (``CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS``)."""
    lib = _driver()
    if lib is None or not torch.cuda.is_available():
        return False
    torch.cuda.synchronize(index)  # the device's primary context current on this thread
    dev, value = ctypes.c_int(), ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), index) != 0:
        return False
    if lib.cuDeviceGetAttribute(ctypes.byref(value), _ATTR_CONCURRENT_MANAGED_ACCESS,
                                dev.value) != 0:
        return False
    return value.value == 1


class _Block:
    """One managed allocation; freed (after the device's queued work) when it dies."""

    def __init__(self, nbytes: int, index: int) -> None:
        lib = _driver()
        torch.cuda.synchronize(index)  # the primary context current on this thread
        ctx, address, dev = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_int()
        _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        _check(lib.cuMemAllocManaged(ctypes.byref(address), nbytes, _ATTACH_GLOBAL),
               f"cuMemAllocManaged of {nbytes} bytes")
        self.address, self.context = address.value, ctx
        try:
            _check(lib.cuMemAdvise(self.address, nbytes, _ADVISE_PREFERRED_LOCATION,
                                   _DEVICE_CPU), "cuMemAdvise(preferred location: host)")
            _check(lib.cuMemAdvise(self.address, nbytes, _ADVISE_ACCESSED_BY, dev.value),
                   "cuMemAdvise(accessed by the device)")
        except RuntimeError:
            self._free()
            raise
        _BLOCKS[self.address] = nbytes

    def _free(self) -> None:
        lib = _driver()
        lib.cuCtxPushCurrent_v2(self.context)  # a deleter may run on any thread
        lib.cuCtxSynchronize()  # kernels still queued may read the block
        lib.cuMemFree_v2(self.address)
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def __del__(self) -> None:
        if _BLOCKS.pop(self.address, None) is not None:
            self._free()


def empty(shape: int | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` over a new block for CUDA ``device`` (its
    pages made in host memory at first touch). The block is freed with the last tensor over
    it."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    index = device.index if device.index is not None else torch.cuda.current_device()
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    block = _Block(nbytes, index)
    buffer = (ctypes.c_char * nbytes).from_address(block.address)
    buffer.block = block  # the tensor keeps the buffer, the buffer the block
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)


def is_managed(tensor: torch.Tensor) -> bool:
    """``tensor`` (or a view of it) lies in a block made here."""
    if tensor.device.type != "cpu" or not tensor.numel():
        return False
    start = tensor.untyped_storage().data_ptr()
    return any(a <= start < a + n for a, n in _BLOCKS.items())


def live_blocks() -> int:
    """Blocks not yet freed (what the tests check for leaks)."""
    return len(_BLOCKS)
