"""TBE backward: reduce each touched row's gradient once, then update the row in place.

Steps (launcher ``tbe_backward``):
1. every id gets a linear key ``row_offsets[f] + id``, unique per (table, row) since the
   features of one table share its row offset; a stable sort groups equal keys into runs;
2. ``_tbe_chunk_reduce_kernel``: runs longer than CHUNK (hot rows) are cut into chunks of CHUNK
   ids, each reduced by its own program into a fp32 partial row, so a row hit 100,000 times is
   spread over many programs and summed pairwise-ish rather than in one long serial chain;
3. ``_tbe_row_update_kernel``: one program per run sums its ids (or its chunks' partials, in
   order) in fp32 and applies the optimizer to the row, or, without an optimizer, writes the
   row's gradient to a compact buffer.
No atomics anywhere: results are bit-identical run to run.
"""

import torch
import triton
import triton.language as tl

from fbtriton_dist import optim
from fbtriton_dist.kernels.tbe_forward import block_sizes, cast_rne, cast_rtz

OPT_NONE = 0
OPT_SGD = 1
OPT_ROWWISE_ADAGRAD = 2
OPT_ADAM = 3
OPT_ADAGRAD = 4
CHUNK = 256  # ids per program before a run is split into chunks


def optimizer_code(optimizer: optim.Optimizer | None) -> int:
    """The kernels' integer code for an optimizer config (None: plain gradients)."""
    if optimizer is None:
        return OPT_NONE
    codes = {
        optim.SGD: OPT_SGD,
        optim.Adagrad: OPT_ADAGRAD,
        optim.RowWiseAdagrad: OPT_ROWWISE_ADAGRAD,
        optim.Adam: OPT_ADAM,
    }
    return codes[type(optimizer)]


@triton.jit
def _gather_grad_sum(
    grad_ptr,
    grad_stride,
    D_offsets_ptr,
    bags_ptr,
    scales_ptr,
    start,
    end,
    B,
    d,
    d_mask,
    HAS_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """fp32 sum over sorted ids [start, end) of grad_output[b, col(f) + d] * scale."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j0 in range(start, end, BLOCK_L):
        j = j0 + tl.arange(0, BLOCK_L)
        j_mask = j < end
        bag = tl.load(bags_ptr + j, mask=j_mask, other=0).to(tl.int64)
        f = bag // B
        b = bag - f * B
        col = tl.load(D_offsets_ptr + f, mask=j_mask, other=0)
        g = tl.load(
            grad_ptr + b[:, None] * grad_stride + col[:, None] + d[None, :],
            mask=j_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_SCALE:
            s = tl.load(scales_ptr + j, mask=j_mask, other=0.0)
            g = g * s[:, None]
        acc += tl.sum(g, axis=0)
    return acc


@triton.jit
def _tbe_chunk_reduce_kernel(
    grad_ptr,  # [B, sum(D)] upstream gradient
    grad_stride,  # row stride of grad
    D_offsets_ptr,  # [T + 1] int64 output column of each feature
    dims_ptr,  # [T] int64 D of each feature
    bags_ptr,  # [N] int64 bag id (f * B + b) of each sorted id
    scales_ptr,  # [N] fp32 per-sample weight / bag length of each sorted id (if HAS_SCALE)
    chunk_starts_ptr,  # [C] int64 first sorted position of each chunk
    chunk_ends_ptr,  # [C] int64 one past its last
    partial_ptr,  # [C, BLOCK_D] fp32 out: each chunk's gradient sum
    B,  # batch size
    HAS_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per chunk of a hot row
    c = tl.program_id(0).to(tl.int64)
    start = tl.load(chunk_starts_ptr + c)
    end = tl.load(chunk_ends_ptr + c)
    f = tl.load(bags_ptr + start) // B
    d = tl.arange(0, BLOCK_D)
    d_mask = d < tl.load(dims_ptr + f)
    acc = _gather_grad_sum(
        grad_ptr,
        grad_stride,
        D_offsets_ptr,
        bags_ptr,
        scales_ptr,
        start,
        end,
        B,
        d,
        d_mask,
        HAS_SCALE,
        BLOCK_L,
        BLOCK_D,
    )
    tl.store(partial_ptr + c * BLOCK_D + d, acc)


@triton.jit
def _tbe_row_update_kernel(
    grad_ptr,  # [B, sum(D)] upstream gradient
    grad_stride,  # row stride of grad
    weights_ptr,  # [sum(E_t * D_t)] flat weights, updated in place
    w_offsets_ptr,  # [T] int64 element offset of each feature's table
    dims_ptr,  # [T] int64 D of each feature
    row_offsets_ptr,  # [T] int64 first linear row of each feature's table
    D_offsets_ptr,  # [T + 1] int64 output column of each feature
    keys_ptr,  # [N] int64 sorted linear row keys
    bags_ptr,  # [N] int64 bag id of each sorted id
    scales_ptr,  # [N] fp32 scale of each sorted id (if HAS_SCALE)
    run_starts_ptr,  # [U + 1] int64 first sorted position of each run, then N
    run_chunks_ptr,  # [U] int64 first chunk of each long run in partial
    partial_ptr,  # [C, BLOCK_D] fp32 chunk sums
    out_rows_ptr,  # [U, BLOCK_D] fp32 out: row gradients (OPTIMIZER == 0)
    mom1_ptr,  # rowwise adagrad: [sum(E_t)] fp32; adagrad, adam: [sum(E_t * D_t)] fp32
    mom2_ptr,  # adam: [sum(E_t * D_t)] fp32
    B,  # batch size
    lr,
    eps,
    beta1,
    beta2,
    weight_decay,  # optimizer hyper-parameters
    bias_c1,
    bias_c2,  # adam: 1 - beta1^t, 1 - beta2^t
    seed,  # stochastic rounding seed for this step
    OPTIMIZER: tl.constexpr,  # OPT_* code
    WD_DECOUPLED: tl.constexpr,  # rowwise adagrad: decoupled weight decay, else L2
    HAS_SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,  # stochastic rounding of half weights
    MANTISSA: tl.constexpr,  # mantissa bits of the weight dtype (stochastic rounding)
    MIN_EXP: tl.constexpr,  # smallest normal exponent of the weight dtype
    CHUNK_SIZE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per unique (table, row)
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(run_starts_ptr + r)
    end = tl.load(run_starts_ptr + r + 1)
    f = tl.load(bags_ptr + start) // B
    D = tl.load(dims_ptr + f)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D

    if end - start <= CHUNK_SIZE:
        g = _gather_grad_sum(
            grad_ptr,
            grad_stride,
            D_offsets_ptr,
            bags_ptr,
            scales_ptr,
            start,
            end,
            B,
            d,
            d_mask,
            HAS_SCALE,
            BLOCK_L,
            BLOCK_D,
        )
    else:
        c0 = tl.load(run_chunks_ptr + r)
        c1 = c0 + tl.cdiv(end - start, CHUNK_SIZE)
        g = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k0 in range(c0, c1, BLOCK_L):
            k = k0 + tl.arange(0, BLOCK_L)
            part = tl.load(
                partial_ptr + k[:, None] * BLOCK_D + d[None, :],
                mask=(k < c1)[:, None] & d_mask[None, :],
                other=0.0,
            )
            g += tl.sum(part, axis=0)

    if OPTIMIZER == 0:
        tl.store(out_rows_ptr + r * BLOCK_D + d, g)
    else:
        key = tl.load(keys_ptr + start)
        row = key - tl.load(row_offsets_ptr + f)
        w_ptrs = weights_ptr + tl.load(w_offsets_ptr + f) + row * D + d
        w = tl.load(w_ptrs, mask=d_mask, other=0.0).to(tl.float32)
        if OPTIMIZER == 1:
            w = w - lr * g
        elif OPTIMIZER == 2:
            if WD_DECOUPLED:
                g_sq = tl.sum(g * g, axis=0) / D.to(tl.float32)
            else:
                g_wd = g + weight_decay * w
                g_sq = tl.sum(tl.where(d_mask, g_wd * g_wd, 0.0), axis=0) / D.to(tl.float32)
            m = tl.load(mom1_ptr + key) + g_sq
            tl.store(mom1_ptr + key, m)
            mult = lr / (tl.sqrt(m) + eps)
            if WD_DECOUPLED:
                corr = 1.0 - lr * weight_decay
            else:
                corr = 1.0 - mult * weight_decay
            w = corr * w - mult * g
        elif OPTIMIZER == 4:
            s_ptrs = tl.load(w_offsets_ptr + f) + row * D + d
            m = tl.load(mom1_ptr + s_ptrs, mask=d_mask, other=0.0) + g * g
            tl.store(mom1_ptr + s_ptrs, m, mask=d_mask)
            w = w - lr * g / (tl.sqrt(m) + eps)
        else:
            s_ptrs = tl.load(w_offsets_ptr + f) + row * D + d
            m1 = beta1 * tl.load(mom1_ptr + s_ptrs, mask=d_mask, other=0.0) + (1.0 - beta1) * g
            m2 = beta2 * tl.load(mom2_ptr + s_ptrs, mask=d_mask, other=0.0) + (1.0 - beta2) * g * g
            tl.store(mom1_ptr + s_ptrs, m1, mask=d_mask)
            tl.store(mom2_ptr + s_ptrs, m2, mask=d_mask)
            w = w - lr * ((m1 / bias_c1) / (tl.sqrt(m2 / bias_c2) + eps) + weight_decay * w)
        if STOCHASTIC:
            # add uniform noise of one ulp of the target dtype, then round toward zero
            bits = w.to(tl.int32, bitcast=True)
            exp = ((bits >> 23) & 0xFF) - 127
            ulp_exp = tl.maximum(tl.maximum(exp, MIN_EXP) - MANTISSA, -126)
            ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
            noise = tl.rand(seed, (key * BLOCK_D + d).to(tl.int32)) * ulp
            w = tl.where(w < 0, w - noise, w + noise)
            w_new = cast_rtz(w, weights_ptr.dtype.element_ty)
        else:
            w_new = cast_rne(w, weights_ptr.dtype.element_ty)
        tl.store(w_ptrs, w_new, mask=d_mask)


def sort_by_row(
    indices: torch.Tensor, offsets: torch.Tensor, row_offsets: torch.Tensor, B: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ids by linear row key. Returns (sorted keys [N], sorted bag ids [N], perm [N])."""
    N = indices.numel()
    pos = torch.arange(N, device=indices.device, dtype=offsets.dtype)
    bags = torch.searchsorted(offsets[1:], pos, right=True)
    keys = row_offsets[bags // B] + indices.to(torch.int64)
    keys, perm = torch.sort(keys, stable=True)
    return keys, bags[perm], perm


def _half_format(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, smallest normal exponent) of a weight dtype, for stochastic rounding."""
    return {torch.float16: (10, -14), torch.bfloat16: (7, -126)}.get(dtype, (23, -126))


def tbe_backward(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    w_offsets: torch.Tensor,
    dims: torch.Tensor,
    row_offsets: torch.Tensor,
    D_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    pooling: int,
    max_D: int,
    optimizer: optim.Optimizer | None,
    step: int,
    momentum1: torch.Tensor | None,
    momentum2: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Backward of ``tbe_forward`` for grad_output ``[B, sum(D)]``.

    With an optimizer: updates ``weights`` (and momentum1/momentum2) in place, returns None.
    Without: returns ``(row_elems [U] int64, row_dims [U] int64, row_grads [U, >=max_D] fp32)``:
    for every unique touched row, the flat offset of its first element in ``weights``, its D and
    its summed gradient (columns past D are zero).
    """
    device = weights.device
    T = dims.numel()
    B = (offsets.numel() - 1) // T
    code = optimizer_code(optimizer)
    block_l, block_d = block_sizes(max_D)
    N = indices.numel()
    if N == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        rows = torch.empty((0, block_d), device=device, dtype=torch.float32)
        return None if code else (empty, empty, rows)

    keys, bags, perm = sort_by_row(indices, offsets, row_offsets, B)
    scales = None
    if per_sample_weights is not None:
        scales = per_sample_weights.to(torch.float32)[perm]
    if pooling == 1:
        lengths = (offsets[1:] - offsets[:-1]).to(torch.float32)
        inv = 1.0 / lengths[bags]
        scales = inv if scales is None else scales * inv
    grad_output = grad_output.contiguous()

    is_start = torch.ones(N, dtype=torch.bool, device=device)
    is_start[1:] = keys[1:] != keys[:-1]
    starts = torch.nonzero(is_start).flatten()
    U = starts.numel()
    run_starts = torch.cat([starts, torch.tensor([N], device=device)])
    lengths = run_starts[1:] - run_starts[:-1]
    n_chunks = torch.where(lengths > CHUNK, (lengths + CHUNK - 1) // CHUNK, 0)
    run_chunks = torch.cumsum(n_chunks, 0) - n_chunks
    C = int(n_chunks.sum())
    partial = torch.empty((max(C, 1), block_d), device=device, dtype=torch.float32)
    if C:
        chunk_run = torch.repeat_interleave(torch.arange(U, device=device), n_chunks)
        chunk_starts = (
            starts[chunk_run] + (torch.arange(C, device=device) - run_chunks[chunk_run]) * CHUNK
        )
        chunk_ends = torch.minimum(chunk_starts + CHUNK, run_starts[1:][chunk_run])
        _tbe_chunk_reduce_kernel[(C,)](
            grad_output,
            grad_output.stride(0),
            D_offsets,
            dims,
            bags,
            scales if scales is not None else keys,
            chunk_starts,
            chunk_ends,
            partial,
            B,
            HAS_SCALE=scales is not None,
            BLOCK_L=block_l,
            BLOCK_D=block_d,
        )

    out_rows = torch.empty(
        (U if code == OPT_NONE else 1, block_d), device=device, dtype=torch.float32
    )
    hp = _hyper_parameters(optimizer, step)
    mantissa, min_exp = _half_format(weights.dtype)
    # runs are mostly short (uniform ids: ~1 id per row); size the id tile to the mean run so
    # that a program does not load a BLOCK_L x BLOCK_D tile that is mostly masked
    row_block_l = min(block_l, triton.next_power_of_2(max(1, N // max(U, 1))))
    _tbe_row_update_kernel[(U,)](
        grad_output,
        grad_output.stride(0),
        weights,
        w_offsets,
        dims,
        row_offsets,
        D_offsets,
        keys,
        bags,
        scales if scales is not None else keys,
        run_starts,
        run_chunks,
        partial,
        out_rows,
        momentum1 if momentum1 is not None else partial,
        momentum2 if momentum2 is not None else partial,
        B,
        *hp,
        seed,
        OPTIMIZER=code,
        WD_DECOUPLED=isinstance(optimizer, optim.RowWiseAdagrad)
        and optimizer.weight_decay_mode == "decoupled",
        HAS_SCALE=scales is not None,
        STOCHASTIC=bool(stochastic_rounding) and weights.dtype in (torch.float16, torch.bfloat16),
        MANTISSA=mantissa,
        MIN_EXP=min_exp,
        CHUNK_SIZE=CHUNK,
        BLOCK_L=row_block_l,
        BLOCK_D=block_d,
        num_warps=4 if block_d <= 256 else 8,
    )
    if code != OPT_NONE:
        return None
    f = bags[starts] // B
    row_elems = w_offsets[f] + (keys[starts] - row_offsets[f]) * dims[f]
    return row_elems, dims[f], out_rows


def _hyper_parameters(optimizer: optim.Optimizer | None, step: int) -> tuple[float, ...]:
    """(lr, eps, beta1, beta2, weight_decay, 1 - beta1^t, 1 - beta2^t) for the row kernel."""
    if optimizer is None:
        return (0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0)
    lr = float(optimizer.lr)
    eps = float(getattr(optimizer, "eps", 0.0))
    wd = float(getattr(optimizer, "weight_decay", 0.0))
    b1, b2 = getattr(optimizer, "betas", (0.0, 0.0))
    bc1 = 1.0 - b1**step if isinstance(optimizer, optim.Adam) else 1.0
    bc2 = 1.0 - b2**step if isinstance(optimizer, optim.Adam) else 1.0
    return (lr, eps, float(b1), float(b2), wd, bc1, bc2)
