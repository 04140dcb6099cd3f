"""The ``host`` storage tier of a TableBatchedEmbedding: where its flat weights and fused
optimizer states are allocated (``docs/storage.md``).

A TBE whose tables are all ``host`` keeps its weights and states in host memory mapped into
the device (``ops/host_mapped.py``) wherever ``maps_host_memory(device)`` says so (CUDA): the
kernels read and update the rows in place over PCIe, no device memory holds them. Elsewhere
(the CPU, where host memory is device memory) it allocates as ``device`` does. A TBE mixing
``host`` tables with others cannot: its tables share one flat buffer, so it is refused where
the tier would map; the collections give ``host`` tables their own TBE (group key
``is_host``) on every device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fbtriton_dist import optim
from fbtriton_dist.ops import cpu_memory, host_mapped
from fbtriton_dist.storage import Storage

__all__ = ["all_host", "check_mixed", "check_weights", "empty", "is_host", "maps_host_memory",
           "place", "place_all", "place_module", "zeros"]


def _maps_host_memory(device: torch.device) -> bool:
    """The rule itself; the tests replace it to run the mapped path on the CPU."""
    return device.type == "cuda"


def maps_host_memory(device: torch.device | str) -> bool:
    """``host`` tables on ``device`` live in mapped host memory (CUDA), not as ``device``."""
    return _maps_host_memory(torch.device(device))


def is_host(storage: Storage) -> bool:
    """A table on the ``host`` tier (the collections' group key: such tables share a TBE
    only with each other)."""
    return storage.tier == "host"


def all_host(storage: Sequence[Storage]) -> bool:
    """Every table of a TBE is ``host`` (its buffers are mapped where the tier maps)."""
    return bool(storage) and all(is_host(s) for s in storage)


def check_mixed(names: Sequence[str], storage: Sequence[Storage], device) -> None:
    """Refuse ``host`` tables sharing a TBE with other tiers on a device where ``host`` is
    mapped host memory: one flat buffer cannot be both."""
    host = [n for n, s in zip(names, storage, strict=True) if is_host(s)]
    if host and len(host) < len(names) and maps_host_memory(device):
        others = [n for n, s in zip(names, storage, strict=True) if not is_host(s)]
        raise ValueError(
            f"tables {host} (storage tier 'host') and {others} (other tiers) share one "
            f"TableBatchedEmbedding on {torch.device(device)}: its flat weights live in one "
            "memory; put the 'host' tables in a separate TableBatchedEmbedding (the "
            "EmbeddingBagCollection / EmbeddingCollection do that for you)")


def _on_cpu(device) -> bool:
    """``device`` (None: torch's default) is the CPU."""
    return (torch.empty(0).device if device is None else torch.device(device)).type == "cpu"


def zeros(numel: int, dtype: torch.dtype, device, storage: Sequence[Storage]) -> torch.Tensor:
    """A flat ``[numel]`` buffer of zeros for a TBE with tables ``storage`` on ``device``:
    mapped host memory when all are ``host`` and the device maps it, else ordinary."""
    if all_host(storage) and maps_host_memory(device):
        return host_mapped.empty(numel, dtype, device, fill=0)
    if _on_cpu(device):  # large ones in huge pages (ops/cpu_memory.py)
        return cpu_memory.zeros(numel, dtype)
    return torch.zeros(numel, dtype=dtype, device=device)


def empty(numel: int, dtype: torch.dtype, device, storage: Sequence[Storage]) -> torch.Tensor:
    """As ``zeros``, uninitialised."""
    if all_host(storage) and maps_host_memory(device):
        return host_mapped.empty(numel, dtype, device)
    if _on_cpu(device):
        return cpu_memory.empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def place(tensor: torch.Tensor, storage: Sequence[Storage], device=None) -> torch.Tensor:
    """``tensor`` in the memory that a TBE with tables ``storage`` wants on ``device``
    (default: ``tensor``'s): a mapped host copy for all-``host`` tables on a device that maps
    host memory, unless it is mapped there already; else ``tensor`` itself."""
    device = tensor.device if device is None else torch.device(device)
    if not (all_host(storage) and maps_host_memory(device)) or tensor.is_meta:
        return tensor
    if tensor.device == device and host_mapped.is_host_mapped(tensor):
        return tensor
    return host_mapped.copy_of(tensor, device)


def place_all(tensors: Sequence[torch.Tensor], storage: Sequence[Storage], fn=None) -> None:
    """``place`` each of ``tensors`` (a TBE's weights and states) in place (``.data``: a
    Parameter stays the same object). With ``fn``, an ``nn.Module._apply`` conversion about
    to run: on the device ``fn`` moves to (probed on an empty tensor), so that ``fn`` then
    finds them there and no device memory ever holds the rows."""
    if not all_host(storage):
        return
    device = None if fn is None else fn(tensors[0].new_empty(0)).device
    for tensor in tensors:
        tensor.data = place(tensor, storage, device)


def place_module(tbe, fn=None) -> None:
    """``place_all`` a TableBatchedEmbedding's flat weights and fused-optimizer states
    (before its ``_apply`` with ``fn``, after it without)."""
    tensors = [tbe.weights, *(getattr(tbe, name) for name in optim.STATE_BUFFERS)]
    place_all(tensors, tbe.storage, fn)


def check_weights(weights: torch.Tensor, names: Sequence[str], storage: Sequence[Storage]):
    """Given flat weights of all-``host`` tables on a device that maps host memory must be
    mapped host memory (``ops/host_mapped.py``): a TBE uses the tensor it is given."""
    if place(weights, storage) is not weights:
        raise ValueError(
            f"weights: tables {list(names)} are on storage tier 'host', expected weights in "
            f"host memory mapped to {weights.device} (fbtriton_dist.ops.host_mapped.empty), "
            "got device memory")
