"""Rows copied between a TBE's flat buffers and a compact stage of one batch's distinct rows
(``modules/host_stage.py``: the ``host`` tier's training lookups on CUDA).

``stage_rows`` copies, for each of the first ``count`` stage rows (``count`` read on the
device: no host sync, so a CUDA graph can record it), the row's elements (``dims[r]`` of
them, at ``host_elem[r]`` in the flat buffer and ``stage_elem[r]`` in the stage) of the
weights and of each per-element optimizer state, and the one element of each per-row state
(at ``host_key[r]``, stage row ``r``): into the stage (``to_stage``) or back. A program
copies ROWS rows side by side, BLOCK_D columns at a time. ``ops/row_stage.py`` calls it on
CUDA and has its torch twin (the CPU path and the tests' reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fbtriton_dist.kernels.launch import Launcher, cdiv, next_power_of_2

_TILE = 2048  # elements a program copies at once (ROWS x BLOCK_D)

NONE, PER_ELEMENT, PER_ROW = 0, 1, 2
"""How a state is laid out: absent, like the weights (an element per weight), or one per row."""


@triton.jit
def _copy(src_ptr, dst_ptr, src_off, dst_off, mask):
    tl.store(dst_ptr + dst_off, tl.load(src_ptr + src_off, mask=mask), mask=mask)


@triton.jit
def _pair(a_ptr, b_ptr, a_off, b_off, mask, TO_STAGE: tl.constexpr):
    """Copy a (the flat buffer) -> b (the stage), or back."""
    if TO_STAGE:
        _copy(a_ptr, b_ptr, a_off, b_off, mask)
    else:
        _copy(b_ptr, a_ptr, b_off, a_off, mask)


@triton.jit(do_not_specialize=["cap"])
def _stage_rows_kernel(
    count_ptr,  # [1] int64 stage rows in use
    host_elem_ptr,  # [cap] int64 first element of each row in the flat buffers
    stage_elem_ptr,  # [cap] int64 first element of each row in the stage
    dims_ptr,  # [cap] int64 D of each row
    host_key_ptr,  # [cap] int64 linear row of each row (per-row states)
    w_ptr, w_stage_ptr,  # weights
    s1_ptr, s1_stage_ptr,  # state 1 (S1: its layout)
    s2_ptr, s2_stage_ptr,  # state 2
    cap,
    TO_STAGE: tl.constexpr,
    S1: tl.constexpr,
    S2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = r < tl.minimum(tl.load(count_ptr), cap)
    he = tl.load(host_elem_ptr + r, mask=live, other=0)
    se = tl.load(stage_elem_ptr + r, mask=live, other=0)
    D = tl.load(dims_ptr + r, mask=live, other=0)
    for d0 in tl.static_range(0, MAX_D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = live[:, None] & (d[None, :] < D[:, None])
        h = he[:, None] + d[None, :]
        s = se[:, None] + d[None, :]
        _pair(w_ptr, w_stage_ptr, h, s, m, TO_STAGE)
        if S1 == 1:
            _pair(s1_ptr, s1_stage_ptr, h, s, m, TO_STAGE)
        if S2 == 1:
            _pair(s2_ptr, s2_stage_ptr, h, s, m, TO_STAGE)
    if S1 == 2 or S2 == 2:
        hk = tl.load(host_key_ptr + r, mask=live, other=0)
        if S1 == 2:
            _pair(s1_ptr, s1_stage_ptr, hk, r, live, TO_STAGE)
        if S2 == 2:
            _pair(s2_ptr, s2_stage_ptr, hk, r, live, TO_STAGE)


_stage_rows = Launcher(_stage_rows_kernel)


def stage_rows(count: torch.Tensor, host_elem: torch.Tensor, stage_elem: torch.Tensor,
               dims: torch.Tensor, host_key: torch.Tensor,
               pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], kinds: Sequence[int],
               max_D: int, to_stage: bool) -> None:
    """The copy (``ops.row_stage.stage_rows``'s arguments, checked there) in one launch."""
    cap = host_elem.numel()
    if cap == 0:
        return
    (w, w_stage), *states = pairs
    states = list(states) + [(w, w_stage)] * (2 - len(states))  # unused slots: any pointer
    codes = list(kinds[1:]) + [NONE] * (3 - len(kinds))
    block_d = min(next_power_of_2(max_D), 256)
    rows = max(1, _TILE // block_d)
    _stage_rows((cdiv(cap, rows),), count, host_elem, stage_elem, dims, host_key, w, w_stage,
                states[0][0], states[0][1], states[1][0], states[1][1], cap, to_stage,
                codes[0], codes[1], rows, block_d, cdiv(max_D, block_d) * block_d,
                num_warps=4)
