"""TBE forward: gather rows of many tables and pool them per bag, all features in one launch.

Layout (FBGEMM's): ``weights`` is one flat buffer holding every table row-major; feature ``f``
reads table rows at ``weights[w_offsets[f] + row * dims[f] : ... + dims[f]]`` and writes output
columns ``D_offsets[f] : D_offsets[f + 1]``. ``offsets`` has length T*B+1, feature-major: bag
``(f, b)`` holds ``indices[offsets[f*B + b] : offsets[f*B + b + 1]]``.
"""

import functools

import torch
import triton
import triton.language as tl

from fbtriton_dist import knobs
from fbtriton_dist.kernels.launch import Launcher, cdiv, next_power_of_2
from fbtriton_dist.pooling import PoolingMode

POOL_SUM, POOL_MEAN = PoolingMode.SUM, PoolingMode.MEAN
POOL_NONE = PoolingMode.NONE  # one output row per id (sequence embeddings), ``[N, max_D]``
# the same, constexpr globals for the jit functions
_MEAN = tl.constexpr(int(PoolingMode.MEAN))
_NONE = tl.constexpr(int(PoolingMode.NONE))


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


@triton.jit(do_not_specialize=["B", "N", "sentinel"])
def _tbe_forward_kernel(
    weights_ptr,  # [sum(E_t * D_t)] flat table rows, fp32/fp16/bf16
    w_offsets_ptr,  # [T] int64: element offset of feature f's table in weights
    dims_ptr,  # [T] int64: D of feature f's table
    D_offsets_ptr,  # [T + 1] int64: first output column of feature f
    rows_ptr,  # [T] int64: E of feature f's table (bounds check)
    row_offsets_ptr,  # [T] int64: first linear row of feature f's table (LINEARIZE)
    indices_ptr,  # [N] int32/int64 row ids, local to each table
    offsets_ptr,  # [T * B + 1] int32/int64 bag boundaries, feature-major
    psw_ptr,  # [N] fp32 per-sample weights (read only if HAS_PSW)
    out_ptr,  # [B, sum(D)] pooled output; POOL_NONE: [N, max_D], one row per id
    keys_ptr,  # [N] int32/int64 out: linear row key of each id, sentinel if dropped (LINEARIZE)
    bag_ids_ptr,  # [N] int32 out: bag (f * B + b) of each id (LINEARIZE)
    counts_ptr,  # [T * B] fp32 out: ids kept per bag (LINEARIZE and mean pooling)
    err_ptr,  # [3] int64 out: ids out of range, N - first such position, malformed bags
    B,  # batch size
    N,  # number of ids
    out_stride,  # row stride of out
    sentinel,  # key of a dropped id: one past the last linear row
    POOLING: tl.constexpr,  # POOL_SUM, POOL_MEAN or POOL_NONE
    HAS_PSW: tl.constexpr,  # multiply each row by its per-sample weight
    CHECK: tl.constexpr,  # drop out-of-range ids and count them (and malformed offsets) in err
    LINEARIZE: tl.constexpr,  # write keys / bag ids for the backward
    ALIGN: tl.constexpr,  # every row starts at a multiple of ALIGN elements (vector loads)
    AHEAD: tl.constexpr,  # load the next step's ids before this step's rows
    FULL: tl.constexpr,  # every feature's D is BLOCK_D: no column mask, rows cut by a shift
    BLOCK_L: tl.constexpr,  # ids gathered per step
    BLOCK_D: tl.constexpr,  # >= max D, power of two
):
    # one program per bag (f, b), in the feature-major order of offsets
    fb = tl.program_id(0).to(tl.int64)
    f = fb // B
    b = fb - f * B
    start = tl.load(offsets_ptr + fb).to(tl.int64)
    end = tl.load(offsets_ptr + fb + 1).to(tl.int64)
    if FULL:
        D = BLOCK_D
    else:
        D = tl.multiple_of(tl.load(dims_ptr + f), ALIGN)  # so that d < D is constant per vector
    w_base = tl.load(w_offsets_ptr + f)
    col = tl.load(D_offsets_ptr + f)
    if CHECK:
        E = tl.load(rows_ptr + f)
        bad_bag = (end < start) | (start < 0) | (end > N)
        bad_bag = (
            bad_bag | ((fb == 0) & (start != 0)) | ((fb == tl.num_programs(0) - 1) & (end != N))
        )
        if bad_bag:
            tl.atomic_add(err_ptr + 2, 1)
        start = tl.minimum(tl.maximum(start, 0), N)
        end = tl.minimum(end, N)
    if LINEARIZE:
        row_base = tl.load(row_offsets_ptr + f)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    kept = tl.zeros([BLOCK_L], dtype=tl.int32)
    if AHEAD:  # a step's ids were loaded during the step before: it waits on its rows only
        pos = start + tl.arange(0, BLOCK_L)
        idx_next = tl.load(indices_ptr + pos, mask=pos < end, other=0)
    for l0 in range(start, end, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        l_mask = pos < end
        if AHEAD:
            idx = idx_next.to(tl.int64)
            idx_next = tl.load(indices_ptr + pos + BLOCK_L, mask=pos + BLOCK_L < end, other=0)
        else:
            idx = tl.load(indices_ptr + pos, mask=l_mask, other=0).to(tl.int64)
        if CHECK:  # counted after the loop: the bag's ids minus the kept ones
            l_mask = l_mask & (idx >= 0) & (idx < E)
        kept += l_mask.to(tl.int32)
        row = tl.multiple_of(w_base + idx * D, ALIGN)
        rows = tl.load(
            weights_ptr + row[:, None] + d[None, :],
            mask=l_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_PSW:
            psw = tl.load(psw_ptr + pos, mask=l_mask, other=0.0).to(tl.float32)
            rows = rows * psw[:, None]
        if POOLING == _NONE:  # each id's row to its own output row (a dropped id's stays zero)
            at = pos[:, None] * out_stride + d[None, :]
            tl.store(out_ptr + at, cast_rne(rows, out_ptr.dtype.element_ty),
                     mask=(pos < end)[:, None] & d_mask[None, :])
        else:
            acc += tl.sum(rows, axis=0)
        if LINEARIZE:
            key = tl.where(l_mask, row_base + idx, sentinel)
            tl.store(keys_ptr + pos, key.to(keys_ptr.dtype.element_ty), mask=pos < end)
            tl.store(bag_ids_ptr + pos, fb.to(tl.int32), mask=pos < end)
    if LINEARIZE:
        # ids after the last bag are padding (a fixed-size batch): every program marks its
        # share of them dropped, so that the backward skips them
        nprog = tl.num_programs(0)
        tail_start = tl.load(offsets_ptr + nprog).to(tl.int64)
        tail_start = tl.minimum(tl.maximum(tail_start, 0), N)
        per = (N - tail_start + nprog - 1) // nprog
        t0 = tail_start + fb * per
        t1 = tl.minimum(t0 + per, N)
        for p0 in range(t0, t1, BLOCK_D):
            p = p0 + d
            tl.store(keys_ptr + p, sentinel.to(keys_ptr.dtype.element_ty), mask=p < t1)
            tl.store(bag_ids_ptr + p, 0, mask=p < t1)
        if fb == 0:  # ids before the first bag (malformed offsets, "warn"): dropped too
            head = tl.minimum(tl.maximum(tl.load(offsets_ptr).to(tl.int64), 0), N)
            for p0 in range(0, head, BLOCK_D):
                p = p0 + d
                tl.store(keys_ptr + p, sentinel.to(keys_ptr.dtype.element_ty), mask=p < head)
                tl.store(bag_ids_ptr + p, 0, mask=p < head)
    if CHECK:
        # the ids dropped: a count per lane carried through the loop, not a reduction and a
        # branch per step (an instruction-bound kernel on Zipf ids: ncu, S6); the first bad
        # position is looked for only in a bag that has one
        n_bad = (end - start) - tl.sum(kept, axis=0)
        if n_bad > 0:
            first = start * 0 + N
            for l0 in range(start, end, BLOCK_L):
                pos = l0 + tl.arange(0, BLOCK_L)
                idx = tl.load(indices_ptr + pos, mask=pos < end, other=0).to(tl.int64)
                bad = (pos < end) & ((idx < 0) | (idx >= E))
                first = tl.minimum(first, tl.min(tl.where(bad, pos, N), axis=0))
            tl.atomic_add(err_ptr, n_bad.to(tl.int64))
            tl.atomic_max(err_ptr + 1, N - first)
    if POOLING != _NONE:
        n_kept = tl.sum(kept, axis=0).to(tl.float32)
        if POOLING == _MEAN:
            acc = acc / tl.maximum(n_kept, 1.0)
            if LINEARIZE:
                tl.store(counts_ptr + fb, n_kept)
        # every D, so every column offset and the row stride, is a multiple of ALIGN
        out_at = tl.multiple_of(b * out_stride + col, ALIGN)
        tl.store(out_ptr + out_at + d, cast_rne(acc, out_ptr.dtype.element_ty), mask=d_mask)


_FORWARD = Launcher(_tbe_forward_kernel)


@triton.jit(do_not_specialize=["B", "N", "n_bags", "sentinel"])
def _tbe_linearize_kernel(
    indices_ptr,  # [N] int32/int64 row ids, local to each table
    offsets_ptr,  # [n_bags + 1] bag boundaries, feature-major
    rows_ptr,  # [T] int64 E of feature f's table (CHECK)
    row_offsets_ptr,  # [T] int64 first linear row of feature f's table
    keys_ptr,  # [N] int32/int64 out: linear row key of each id, sentinel if dropped
    bag_ids_ptr,  # [N] int32 out: bag (f * B + b) of each id
    counts_ptr,  # [n_bags] fp32 out: ids kept per bag (MEAN)
    B,
    N,
    n_bags,
    sentinel,
    CHECK: tl.constexpr,  # as the forward's: out-of-range ids dropped, malformed bags clamped
    MEAN: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # what the forward writes with LINEARIZE, in a kernel of its own (so that it can run on
    # another stream beside the forward): BAGS bags per program, BLOCK ids of each per step
    fb = tl.program_id(0).to(tl.int64) * BAGS + tl.arange(0, BAGS)
    bm = fb < n_bags
    f = fb // B
    start = tl.load(offsets_ptr + fb, mask=bm, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + fb + 1, mask=bm, other=0).to(tl.int64)
    if CHECK:
        start = tl.minimum(tl.maximum(start, 0), N)
        end = tl.minimum(end, N)
        E = tl.load(rows_ptr + f, mask=bm, other=0)[:, None]
    base = tl.load(row_offsets_ptr + f, mask=bm, other=0)[:, None]
    kept = tl.zeros([BAGS], dtype=tl.int32)
    for l0 in range(0, tl.max(end - start, axis=0), BLOCK):
        pos = start[:, None] + l0 + tl.arange(0, BLOCK)[None, :]
        m = bm[:, None] & (pos < end[:, None])
        idx = tl.load(indices_ptr + pos, mask=m, other=0).to(tl.int64)
        ok = m
        if CHECK:
            ok = m & (idx >= 0) & (idx < E)
        key = tl.where(ok, base + idx, sentinel)
        tl.store(keys_ptr + pos, key.to(keys_ptr.dtype.element_ty), mask=m)
        tl.store(bag_ids_ptr + pos, (fb[:, None] + 0 * pos).to(tl.int32), mask=m)
        kept += tl.sum(ok.to(tl.int32), axis=1)
    if MEAN:
        tl.store(counts_ptr + fb, kept.to(tl.float32), mask=bm)
    # ids after the last bag are padding: every program marks its share of them dropped
    nprog = tl.num_programs(0)
    tail_start = tl.load(offsets_ptr + n_bags).to(tl.int64)
    tail_start = tl.minimum(tl.maximum(tail_start, 0), N)
    per = (N - tail_start + nprog - 1) // nprog
    t0 = tail_start + tl.program_id(0) * per
    t1 = tl.minimum(t0 + per, N)
    for p0 in range(t0, t1, BAGS * BLOCK):
        p = p0 + tl.arange(0, BAGS * BLOCK)
        tl.store(keys_ptr + p, sentinel.to(keys_ptr.dtype.element_ty), mask=p < t1)
        tl.store(bag_ids_ptr + p, 0, mask=p < t1)
    if tl.program_id(0) == 0:  # ids before the first bag (malformed offsets): dropped too
        head = tl.minimum(tl.maximum(tl.load(offsets_ptr).to(tl.int64), 0), N)
        for p0 in range(0, head, BAGS * BLOCK):
            p = p0 + tl.arange(0, BAGS * BLOCK)
            tl.store(keys_ptr + p, sentinel.to(keys_ptr.dtype.element_ty), mask=p < head)
            tl.store(bag_ids_ptr + p, 0, mask=p < head)


_LINEARIZE = Launcher(_tbe_linearize_kernel)

LAUNCHERS = {"_FORWARD": _FORWARD, "_LINEARIZE": _LINEARIZE}
"""This file's launchers by their names here (``bench/tbe_sweep.py`` reports and toggles them
under these names, the keys of its ``regs``)."""


def tbe_linearize(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor,
    row_offsets: torch.Tensor,
    *,
    num_rows: int,
    pooling: int,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(keys [N], bag_ids [N] int32, counts [T*B] fp32 for mean pooling else None): exactly
    what ``tbe_forward(..., linearize=True)`` returns besides its output, for the same
    ``check`` (``err`` given to the forward: out-of-range ids get the dropped key and are
    not counted, malformed bags are clamped as there). A kernel of its own, so that it can run
    on a side stream while the forward does (``ops.tbe``)."""
    T = rows.numel()
    n_bags = offsets.numel() - 1
    B = n_bags // T if T else 0
    N = indices.numel()
    device = indices.device
    keys = torch.empty(N, dtype=key_dtype(num_rows), device=device)
    bag_ids = torch.empty(N, dtype=torch.int32, device=device)
    counts = torch.zeros(n_bags, dtype=torch.float32, device=device) if pooling == POOL_MEAN else None
    if B == 0:
        keys.fill_(num_rows)
        bag_ids.zero_()
        return keys, bag_ids, counts
    BAGS, BLOCK = 8, 16
    _LINEARIZE(
        (cdiv(n_bags, BAGS),),
        indices,
        offsets,
        rows,
        row_offsets,
        keys,
        bag_ids,
        counts if counts is not None else rows,
        B,
        N,
        n_bags,
        num_rows,
        CHECK=check,
        MEAN=pooling == POOL_MEAN,
        BAGS=BAGS,
        BLOCK=BLOCK,
        num_warps=1,
    )
    return keys, bag_ids, counts


@functools.cache
def block_sizes(max_D: int) -> tuple[int, int]:
    """(BLOCK_L, BLOCK_D) for a batch whose widest table has ``max_D`` columns."""
    block_d = next_power_of_2(max(int(max_D), 1))
    block_l = max(1, min(32, 4096 // block_d))
    return block_l, block_d


def forward_config(max_D: int, weight_bytes: int) -> tuple[int, int, int, int, bool]:
    """(BLOCK_L, BLOCK_D, num_warps, maxnreg, AHEAD) of the forward kernel. A heuristic keyed
    on shape, from sweeps on an H200 (``python -m fbtriton_dist.bench.tbe_sweep``,
    docs/results/tbe-h200-record-prefetch-2026-12-02.md, tbe-h200-bounds-count-2026-12-02.md):
    one warp per bag (its sums stay inside the warp, and
    32 bags fit on an SM) and 4 ids in flight per step up to D=256 (with rows loaded as 16-byte
    vectors, ``row_align``); a bigger tile spills registers. 16-bit rows up to D=128 take 8
    ids per step with the next step's ids loaded ahead (AHEAD: S2 0.118 -> 0.099 ms); on fp32
    rows AHEAD gained <= 2% on uniform and Zipf(1.05) ids and lost 5% on Zipf(1.15).
    Several bags per program ([BAGS, BLOCK_L, D] tiles, one warp each) measured 1.3-2x slower,
    and so did 2-4 bags pooled one after the other by one program (their bounds in one load).
    ``FBTD_TBE_FWD=block_l,num_warps[,maxnreg]`` overrides the first fields (maxnreg: a
    register cap, NVIDIA only; 0 or absent: none)."""
    _, block_d = block_sizes(max_D)
    num_warps = 1 if block_d <= 256 else 2
    block_l = max(1, 2048 // block_d) if block_d > 256 else 4
    ahead = weight_bytes <= 2 and block_d <= 128
    if ahead:
        block_l = 8
    maxnreg = 0
    fields = knobs.tbe_forward_config()
    if fields:
        block_l, num_warps = fields[:2]
        maxnreg = fields[2] if len(fields) == 3 else 0
    return block_l, block_d, num_warps, maxnreg, ahead


def key_dtype(num_rows: int) -> torch.dtype:
    """int32 linear row keys when every table's rows (and the sentinel) fit, else int64: a
    32-bit radix sort makes half the passes."""
    return torch.int32 if num_rows < 2**31 - 1 else torch.int64


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
    rows: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    num_rows: int = 0,
    err: torch.Tensor | None = None,
    linearize: bool = False,
    row_align: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pooled lookup of T features over B bags. Returns ``[B, sum(D)]`` in ``output_dtype``;
    with ``pooling=POOL_NONE``, ``[N, max_D]``: row i is id i's row (times its per-sample
    weight) in its first D columns, zeros after them, in padding rows and for dropped ids.

    ``err`` ([3] int64, zeroed) turns on the in-kernel check against ``rows`` ([T] E per
    feature): out-of-range ids are dropped and counted in ``err[0]``, ``err[1]`` gets N minus
    the first one's position, malformed bags (decreasing offsets, offsets outside [0, N])
    are counted in ``err[2]``. Without ``err`` inputs are assumed validated.
    ``linearize`` (training) also returns, for the backward, ``keys`` [N] (``row_offsets[f] +
    id``, ``num_rows`` for a dropped id; int32 when it fits), ``bag_ids`` [N] int32 and, for
    mean pooling, ``counts`` [T*B] fp32 (ids kept per bag).
    Ids after ``offsets[-1]`` are padding (a batch of fixed size): never read, and with
    ``linearize`` given the dropped key, so the backward skips them. ``row_align``: a power
    of two dividing every feature's D and ``w_offsets`` (``TBELayout.row_align``), the width
    of the vector loads of rows.
    """
    T = dims.numel()
    B = (offsets.numel() - 1) // T
    N = indices.numel()
    device = weights.device
    if pooling == POOL_NONE:  # zeros: the columns past a feature's D and the padding rows
        out = torch.zeros((N, max_D), dtype=output_dtype, device=device)
    else:
        out = torch.empty((B, total_D), dtype=output_dtype, device=device)
    keys = bag_ids = counts = None  # allocated for training batches only (LINEARIZE)
    if linearize:
        keys = torch.empty(N, dtype=key_dtype(num_rows), device=device)
        bag_ids = torch.empty(N, dtype=torch.int32, device=device)
        if pooling == POOL_MEAN:
            counts = torch.empty(T * B, dtype=torch.float32, device=device)
    result = (out, keys, bag_ids, counts) if linearize else out
    if B == 0 or total_D == 0 or out.numel() == 0:
        if linearize:
            keys.fill_(num_rows)
            bag_ids.zero_()
        if counts is not None:
            counts.zero_()
        return result
    block_l, block_d, num_warps, maxnreg, ahead = forward_config(max_D, weights.element_size())
    psw = per_sample_weights if per_sample_weights is not None else indices
    _FORWARD(
        (T * B,),
        weights_ptr=weights,
        w_offsets_ptr=w_offsets,
        dims_ptr=dims,
        D_offsets_ptr=D_offsets,
        rows_ptr=rows if rows is not None else dims,
        row_offsets_ptr=row_offsets if row_offsets is not None else dims,
        indices_ptr=indices,
        offsets_ptr=offsets,
        psw_ptr=psw,
        out_ptr=out,
        keys_ptr=keys if keys is not None else dims,  # written with LINEARIZE only
        bag_ids_ptr=bag_ids if bag_ids is not None else dims,
        counts_ptr=counts if counts is not None else out,
        err_ptr=err if err is not None else dims,
        B=B,
        N=N,
        out_stride=out.stride(0),
        sentinel=num_rows,
        POOLING=pooling,
        HAS_PSW=per_sample_weights is not None,
        CHECK=err is not None,
        LINEARIZE=linearize,
        ALIGN=row_align,
        AHEAD=ahead,
        # D_offsets sum the features' D: at T * max_D every one is max_D
        FULL=total_D == T * max_D and max_D == block_d,
        BLOCK_L=block_l,
        BLOCK_D=block_d,
        num_warps=num_warps,
        maxnreg=maxnreg if maxnreg and device.type == "cuda" and not torch.version.hip else None,
    )
    return result
