"""TBE forward: gather rows of many tables and pool them per bag, all features in one launch.

Layout (FBGEMM's): ``weights`` is one flat buffer holding every table row-major; feature ``f``
reads table rows at ``weights[w_offsets[f] + row * dims[f] : ... + dims[f]]`` and writes output
columns ``D_offsets[f] : D_offsets[f + 1]``. ``offsets`` has length T*B+1, feature-major: bag
``(f, b)`` holds ``indices[offsets[f*B + b] : offsets[f*B + b + 1]]``.
"""

import torch
import triton
import triton.language as tl

POOL_SUM = 0
POOL_MEAN = 1


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, rounding to nearest even. bf16 is rounded by hand on the bits so that the
    interpreter (which truncates) and the GPU agree."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def cast_rtz(x, DTYPE: tl.constexpr):
    """fp32 -> fp16/bf16 rounding toward zero (bf16: drop the low 16 bits)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(DTYPE, fp_downcast_rounding="rtz")


@triton.jit
def _tbe_forward_kernel(
    weights_ptr,  # [sum(E_t * D_t)] flat table rows, fp32/fp16/bf16
    w_offsets_ptr,  # [T] int64: element offset of feature f's table in weights
    dims_ptr,  # [T] int64: D of feature f's table
    D_offsets_ptr,  # [T + 1] int64: first output column of feature f
    indices_ptr,  # [N] int32/int64 row ids, local to each table
    offsets_ptr,  # [T * B + 1] int32/int64 bag boundaries, feature-major
    psw_ptr,  # [N] fp32 per-sample weights (read only if HAS_PSW)
    out_ptr,  # [B, sum(D)] pooled output
    B,  # batch size
    out_stride,  # row stride of out
    POOLING: tl.constexpr,  # POOL_SUM or POOL_MEAN
    HAS_PSW: tl.constexpr,  # multiply each row by its per-sample weight
    BLOCK_L: tl.constexpr,  # ids gathered per step
    BLOCK_D: tl.constexpr,  # >= max D, power of two
):
    # one program per bag (f, b), in the feature-major order of offsets
    fb = tl.program_id(0).to(tl.int64)
    f = fb // B
    b = fb - f * B
    start = tl.load(offsets_ptr + fb).to(tl.int64)
    end = tl.load(offsets_ptr + fb + 1).to(tl.int64)
    D = tl.load(dims_ptr + f)
    w_base = tl.load(w_offsets_ptr + f)
    col = tl.load(D_offsets_ptr + f)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for l0 in range(start, end, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        l_mask = pos < end
        idx = tl.load(indices_ptr + pos, mask=l_mask, other=0).to(tl.int64)
        rows = tl.load(
            weights_ptr + w_base + idx[:, None] * D + d[None, :],
            mask=l_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_PSW:
            psw = tl.load(psw_ptr + pos, mask=l_mask, other=0.0).to(tl.float32)
            rows = rows * psw[:, None]
        acc += tl.sum(rows, axis=0)
    if POOLING == 1:
        acc = acc / tl.maximum(end - start, 1).to(tl.float32)
    tl.store(
        out_ptr + b * out_stride + col + d, cast_rne(acc, out_ptr.dtype.element_ty), mask=d_mask
    )


def block_sizes(max_D: int) -> tuple[int, int]:
    """(BLOCK_L, BLOCK_D) for a batch whose widest table has ``max_D`` columns."""
    block_d = triton.next_power_of_2(max(int(max_D), 1))
    block_l = max(1, min(32, 4096 // block_d))
    return block_l, block_d


def tbe_forward(
    weights: torch.Tensor,
    w_offsets: torch.Tensor,
    dims: torch.Tensor,
    D_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    pooling: int,
    max_D: int,
    total_D: int,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Pooled lookup of T features over B bags. Returns ``[B, sum(D)]`` in ``output_dtype``.

    Inputs are assumed validated (ops/tbe.py): offsets non-decreasing, ids in range.
    """
    T = dims.numel()
    B = (offsets.numel() - 1) // T
    out = torch.empty((B, total_D), dtype=output_dtype, device=weights.device)
    if B == 0 or total_D == 0:
        return out
    block_l, block_d = block_sizes(max_D)
    psw = per_sample_weights if per_sample_weights is not None else indices
    _tbe_forward_kernel[(T * B,)](
        weights,
        w_offsets,
        dims,
        D_offsets,
        indices,
        offsets,
        psw,
        out,
        B,
        out.stride(0),
        POOLING=pooling,
        HAS_PSW=per_sample_weights is not None,
        BLOCK_L=block_l,
        BLOCK_D=block_d,
        num_warps=4 if block_d <= 256 else 8,
    )
    return out
