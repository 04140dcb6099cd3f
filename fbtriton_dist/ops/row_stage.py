"""Rows copied between a TBE's flat buffers and a stage of one batch's distinct rows
(``modules/host_stage.py``): the Triton kernel (``kernels/row_stage.py``) on CUDA, its torch
twin elsewhere (the CPU, and the kernel's reference in the tests); the layer between (modules
never import kernels)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fbtriton_dist.kernels import row_stage as _kernel
from fbtriton_dist.kernels.row_stage import NONE, PER_ELEMENT, PER_ROW  # noqa: F401

__all__ = ["NONE", "PER_ELEMENT", "PER_ROW", "stage_rows"]


def _torch_stage_rows(count, host_elem, stage_elem, dims, host_key, pairs, kinds, max_D,
                      to_stage):
    """The same copy with torch ops (reads ``count`` on the host)."""
    n = int(count)
    cols = torch.arange(max_D, device=dims.device)
    inside = cols[None, :] < dims[:n, None]
    h = (host_elem[:n, None] + cols[None, :])[inside]
    s = (stage_elem[:n, None] + cols[None, :])[inside]
    r = torch.arange(n, device=dims.device)
    for (flat, stage), kind in zip(pairs, kinds, strict=True):
        a, b = (h, s) if kind == PER_ELEMENT else (host_key[:n], r)
        if to_stage:
            stage[b] = flat[a]
        else:
            flat[a] = stage[b]


def stage_rows(
    count: torch.Tensor,
    host_elem: torch.Tensor,
    stage_elem: torch.Tensor,
    dims: torch.Tensor,
    host_key: torch.Tensor,
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    kinds: Sequence[int],
    max_D: int,
    to_stage: bool,
    triton_kernel: bool | None = None,
) -> None:
    """Copy the first ``count`` rows of every ``(flat buffer, stage)`` pair (the weights'
    first, ``kinds[0] == PER_ELEMENT``; then at most two states, each ``PER_ELEMENT`` or
    ``PER_ROW``) into the stage (``to_stage``) or back. ``triton_kernel``: None picks the
    kernel on CUDA tensors and torch ops elsewhere."""
    if len(pairs) != len(kinds) or not 1 <= len(pairs) <= 3 or kinds[0] != PER_ELEMENT:
        raise ValueError(f"stage_rows: the weights then at most two states, got kinds {kinds}")
    if triton_kernel is None:
        triton_kernel = host_elem.is_cuda
    if triton_kernel:
        _kernel.stage_rows(count, host_elem, stage_elem, dims, host_key, pairs, kinds, max_D,
                           to_stage)
    else:
        _torch_stage_rows(count, host_elem, stage_elem, dims, host_key, pairs, kinds, max_D,
                          to_stage)
