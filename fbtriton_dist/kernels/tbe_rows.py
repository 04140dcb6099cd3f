"""TBE backward, step 3 (``tbe_backward``'s last kernel): sum each run's gradient and update its
row in place.

Each program takes RUNS runs (unique rows) side by side (a [RUNS, D] tile), sums each run's
gradient in fp32 (its ids, or its blocks' partials from the chunk kernel in order) and applies
the optimizer to the rows in place (``kernels/tbe_optim.py``: one update helper per optimizer),
or, without an optimizer, writes the rows' gradients to a compact buffer. The grid is
persistent: programs loop over the groups of runs up to the count on the device.

The kernel is bound by its chain of dependent loads, so what it reads of a run is one record
written by the runs kernel (start, key, first weight element, D, first gradient element: one
level of independent loads, then the row and its first gradient); with PREFETCH the next
group's record is loaded while this group's rows are read and updated.
"""

import functools

import torch
import triton
import triton.language as tl

from fbtriton_dist import optim
from fbtriton_dist.kernels.launch import Launcher, cdiv
from fbtriton_dist.kernels.tbe_optim import (
    half_format,
    load_hyper,
    optimizer_code,
    optimizer_update,
    store_rows,
)


@triton.jit
def _run_record(
    run_starts_ptr,  # [U + 1] int64 first sorted position of each run, then N
    run_keys_ptr,  # [U] int64 linear row key of each run (sentinel: dropped ids)
    run_elems_ptr,  # [U] int64 flat weights element of each run's row
    run_dims_ptr,  # [U] int64 D of each run's row
    run_goffs_ptr,  # [U] int64 grad_output element of each run's first id
    r,  # [RUNS] run indices
    U,  # number of runs
    sentinel,
    ALIGN: tl.constexpr,
    GALIGN: tl.constexpr,
):
    """(start, end, key, elem, D, goff0) of runs r, loads independent of each other; past U
    the key is the sentinel (the run is not live). The alignment hints go on the loads
    themselves: ``tl.multiple_of`` marks the op defining its value, and a helper's argument
    has none (the hint would be lost, and with it the vector loads of rows)."""
    m = r < U
    s = tl.load(run_starts_ptr + r, mask=m, other=0)
    e = tl.load(run_starts_ptr + r + 1, mask=m, other=0)
    key = tl.load(run_keys_ptr + r, mask=m, other=sentinel)
    # elem and D are multiples of ALIGN, goff0 of GALIGN: d < D is constant per vector
    elem = tl.multiple_of(tl.load(run_elems_ptr + r, mask=m, other=0), [ALIGN])
    D = tl.multiple_of(tl.load(run_dims_ptr + r, mask=m, other=ALIGN), [ALIGN])
    goff0 = tl.multiple_of(tl.load(run_goffs_ptr + r, mask=m, other=0), [GALIGN])
    return s, e, key, elem, D, goff0


@triton.jit
def _run_rows(
    grad_ptr,  # [B, sum(D)] upstream gradient
    weights_ptr,  # [sum(E_t * D_t)] flat weights
    scales_ptr,  # [N] fp32 scale of each sorted id (if HAS_SCALE)
    mom1_ptr,  # state 0: per row when ROW_STATE
    s,  # [RUNS] the runs' records (_run_record)
    e,
    key,
    elem,
    D,
    goff0,
    d,  # [BLOCK_D] column indices
    sentinel,
    OPTIMIZER: tl.constexpr,
    ROW_STATE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    ALIGN: tl.constexpr,
    GALIGN: tl.constexpr,
):
    """(w [RUNS, BLOCK_D] fp32 the rows (with an optimizer, else 0), m_row [RUNS] their state 0
    where it is per row, g0 [RUNS, BLOCK_D] fp32 the scaled gradient of each short run's first
    id): the loads that depend on the record only."""
    live = key < sentinel
    dm = live[:, None] & (d[None, :] < D[:, None])
    first = live & (e - s <= CHUNK_SIZE)
    if OPTIMIZER != 0:
        ptrs = elem[:, None] + d[None, :]
        w = tl.load(weights_ptr + ptrs, mask=dm, other=0.0).to(tl.float32)
    else:
        w = tl.zeros(dm.shape, dtype=tl.float32)
    if ROW_STATE:
        m_row = tl.load(mom1_ptr + key, mask=live, other=0.0).to(tl.float32)
    else:
        m_row = tl.zeros(key.shape, dtype=tl.float32)
    g0 = tl.load(
        grad_ptr + goff0[:, None] + d[None, :], mask=first[:, None] & dm, other=0.0
    ).to(tl.float32)
    if HAS_SCALE:
        g0 = g0 * tl.load(scales_ptr + s, mask=first, other=0.0)[:, None]
    return w, m_row, g0


@triton.jit
def _short_runs_grad(
    acc,  # [RUNS, BLOCK_D] fp32 each short run's first id's gradient
    grad_ptr,  # [B, sum(D)] upstream gradient
    goffs_ptr,  # [N] int64 element of grad_output each sorted id reads
    scales_ptr,  # [N] fp32 scale of each sorted id (if HAS_SCALE)
    s,  # [RUNS] first sorted position of each run
    n_short,  # [RUNS] ids of each run of at most CHUNK_SIZE ids, else 0
    d,  # [BLOCK_D] column indices
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    HAS_SCALE: tl.constexpr,
    RUNS: tl.constexpr,
    IDS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GALIGN: tl.constexpr,
):
    """``acc`` plus the gradients of ids 1.. of each short run, the runs side by side: step j
    reads the j-th id of every run (most rows of uniform ids have one id: no step at all).
    Loading the next step's offsets during this step (as the chunk kernel does) measured
    slower here: S3 row kernel 314 -> 401 µs, S6 821 -> 1035."""
    if IDS == 1:
        for j in range(1, tl.max(n_short, axis=0)):
            jm = j < n_short
            goff = tl.multiple_of(tl.load(goffs_ptr + s + j, mask=jm, other=0), GALIGN)
            gr = tl.load(
                grad_ptr + goff[:, None] + d[None, :],
                mask=jm[:, None] & dm,
                other=0.0,
            ).to(tl.float32)
            if HAS_SCALE:
                gr = gr * tl.load(scales_ptr + s + j, mask=jm, other=0.0)[:, None]
            acc += gr
    elif RUNS == 1:
        # IDS ids of the one run per step, an [IDS, BLOCK_D] tile summed over its ids
        s1 = tl.sum(s, axis=0)
        n1 = tl.sum(n_short, axis=0)
        jj = tl.arange(0, IDS)
        for j0 in range(1, n1, IDS):
            j = j0 + jj
            jm = j < n1
            goff = tl.multiple_of(tl.load(goffs_ptr + s1 + j, mask=jm, other=0), GALIGN)
            gr = tl.load(
                grad_ptr + goff[:, None] + d[None, :], mask=jm[:, None] & dm, other=0.0
            ).to(tl.float32)
            if HAS_SCALE:
                gr = gr * tl.load(scales_ptr + s1 + j, mask=jm, other=0.0)[:, None]
            acc += tl.sum(gr, axis=0)[None, :]
    else:
        # IDS ids of every run per step: tile row t is id (t % IDS) of run (t // IDS)
        s_t = tl.reshape(tl.broadcast_to(s[:, None], [RUNS, IDS]), [RUNS * IDS])
        n_t = tl.reshape(tl.broadcast_to(n_short[:, None], [RUNS, IDS]), [RUNS * IDS])
        dm_t = tl.reshape(
            tl.broadcast_to(dm[:, None, :], [RUNS, IDS, BLOCK_D]), [RUNS * IDS, BLOCK_D]
        )
        jj = tl.arange(0, RUNS * IDS) % IDS
        for j0 in range(1, tl.max(n_short, axis=0), IDS):
            j = j0 + jj
            jm = j < n_t
            goff = tl.multiple_of(tl.load(goffs_ptr + s_t + j, mask=jm, other=0), GALIGN)
            gr = tl.load(
                grad_ptr + goff[:, None] + d[None, :], mask=jm[:, None] & dm_t, other=0.0
            ).to(tl.float32)
            if HAS_SCALE:
                gr = gr * tl.load(scales_ptr + s_t + j, mask=jm, other=0.0)[:, None]
            acc += tl.sum(tl.reshape(gr, [RUNS, IDS, BLOCK_D]), axis=1)
    return acc


@triton.jit
def _add_long_runs(
    acc,  # [RUNS, BLOCK_D] fp32 the short runs' sums
    partial_ptr,  # [cdiv(N, CHUNK_SIZE), 2, BLOCK_D] fp32 block sums of long runs
    lane,  # [RUNS] 0..RUNS-1
    s,  # [RUNS] first sorted position of each run
    e,  # [RUNS] one past its last
    long,  # [RUNS] live runs of more than CHUNK_SIZE ids
    d,  # [BLOCK_D] column indices
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    CHUNK_SIZE: tl.constexpr,
    PART_L: tl.constexpr,
    RUNS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``acc`` plus each long run's gradient: the sum of its blocks' partials, in order, one
    run at a time."""
    if tl.sum(long.to(tl.int32), axis=0) > 0:
        for i in range(0, RUNS):
            sel = lane == i
            if tl.sum((sel & long).to(tl.int32), axis=0) > 0:
                s_i = tl.sum(tl.where(sel, s, 0), axis=0)
                e_i = tl.sum(tl.where(sel, e, 0), axis=0)
                c0 = s_i // CHUNK_SIZE
                c1 = (e_i - 1) // CHUNK_SIZE + 1
                part_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
                for k0 in range(c0, c1, PART_L):
                    k = k0 + tl.arange(0, PART_L)
                    slot = tl.where((k == c0) & (s_i != c0 * CHUNK_SIZE), 1, 0)
                    part = tl.load(
                        partial_ptr + (2 * k + slot)[:, None] * BLOCK_D + d[None, :],
                        mask=(k < c1)[:, None],
                        other=0.0,
                    )
                    part_sum += tl.sum(part, axis=0)
                acc += tl.where(sel[:, None] & dm, part_sum[None, :], 0.0)
    return acc


@triton.jit
def _update_group(
    w,  # [RUNS, BLOCK_D] fp32 the rows (_run_rows)
    m_row,  # [RUNS] fp32 their per-row state 0 (ROW_STATE)
    acc,  # [RUNS, BLOCK_D] fp32 each short run's first gradient (_run_rows)
    r,  # [RUNS] run indices
    lane,  # [RUNS] 0..RUNS-1
    s,  # [RUNS] the runs' records (_run_record)
    e,
    key,
    elem,
    D,
    d,  # [BLOCK_D] column indices
    grad_ptr,
    weights_ptr,
    goffs_ptr,
    scales_ptr,
    partial_ptr,
    out_rows_ptr,
    mom1_ptr,
    mom2_ptr,
    mom3_ptr,
    sentinel,
    hyper_ptr,
    step_ptr,
    seed,
    OPTIMIZER: tl.constexpr,
    WD_DECOUPLED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    PART_L: tl.constexpr,
    RUNS: tl.constexpr,
    IDS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    GALIGN: tl.constexpr,
):
    """Sum the rest of each run's gradient into ``acc`` and update (or write out) the rows."""
    live = key < sentinel
    dm = live[:, None] & (d[None, :] < D[:, None])
    n = e - s
    long = live & (n > CHUNK_SIZE)
    n_short = tl.where(live & (n <= CHUNK_SIZE), n, 0)
    acc = _short_runs_grad(acc, grad_ptr, goffs_ptr, scales_ptr, s, n_short, d, dm, HAS_SCALE,
                           RUNS, IDS, BLOCK_D, GALIGN)
    acc = _add_long_runs(acc, partial_ptr, lane, s, e, long, d, dm, CHUNK_SIZE, PART_L, RUNS,
                         BLOCK_D)
    if OPTIMIZER == 0:
        tl.store(out_rows_ptr + r[:, None] * BLOCK_D + d[None, :], acc, mask=live[:, None])
    else:
        lr, eps, weight_decay, t, beta1, beta2, bias_c1, bias_c2 = load_hyper(hyper_ptr, step_ptr)
        ptrs = elem[:, None] + d[None, :]
        w = optimizer_update(
            w, acc, m_row, key, live, ptrs, dm, D, mom1_ptr, mom2_ptr, mom3_ptr, lr, eps,
            weight_decay,
            beta1, beta2, bias_c1, bias_c2, t, hyper_ptr, OPTIMIZER, WD_DECOUPLED,
        )
        store_rows(weights_ptr, ptrs, dm, w, key, seed, t, STOCHASTIC, MANTISSA, MIN_EXP, RUNS,
                   BLOCK_D)


@triton.jit(do_not_specialize=["sentinel", "seed"])
def _tbe_row_update_kernel(
    grad_ptr,  # [B, sum(D)] upstream gradient
    weights_ptr,  # [sum(E_t * D_t)] flat weights, updated in place
    goffs_ptr,  # [N] int64 element of grad_output each sorted id reads
    scales_ptr,  # [N] fp32 scale of each sorted id (if HAS_SCALE)
    run_starts_ptr,  # [U + 1] int64 first sorted position of each run, then N
    run_keys_ptr,  # [U] int64 linear row key of each run (sentinel: dropped ids)
    run_elems_ptr,  # [U] int64 flat weights element of each run's row
    run_dims_ptr,  # [U] int64 D of each run's row
    run_goffs_ptr,  # [U] int64 grad_output element of each run's first id
    num_runs_ptr,  # [1] int64 U
    partial_ptr,  # [cdiv(N, CHUNK_SIZE), 2, BLOCK_D] fp32 block sums of long runs
    out_rows_ptr,  # [U, BLOCK_D] fp32 out: row gradients (OPTIMIZER == 0)
    mom1_ptr,  # state 0 (optim.REGISTRY): [sum(E_t)] per row or [sum(E_t * D_t)] fp32
    mom2_ptr,  # state 1: [sum(E_t * D_t)] or [sum(E_t)] fp32
    mom3_ptr,  # state 2: [sum(E_t)] fp32 (rowwise_adagrad_with_counter's row_counter)
    sentinel,  # key of dropped ids: their run is skipped
    hyper_ptr,  # fp32 optimizer hyper-parameters, optim.HYPER_FIELDS (+ tbe_optim's counter's)
    step_ptr,  # [1] int64 fused updates taken, this one included: t >= 1
    seed,  # the module's stochastic-rounding seed; this step's is (seed * 1000003 + t) % (2^31-1)
    OPTIMIZER: tl.constexpr,  # kernel code of the optimizer (optim.REGISTRY), 0: none
    ROW_STATE: tl.constexpr,  # its state 0 is per row: loaded with the row
    WD_DECOUPLED: tl.constexpr,  # rowwise adagrad: decoupled weight decay, else L2
    HAS_SCALE: tl.constexpr,
    STOCHASTIC: tl.constexpr,  # stochastic rounding of half weights
    MANTISSA: tl.constexpr,  # mantissa bits of the weight dtype (stochastic rounding)
    MIN_EXP: tl.constexpr,  # smallest normal exponent of the weight dtype
    CHUNK_SIZE: tl.constexpr,
    PART_L: tl.constexpr,  # block partials summed per step (long runs)
    RUNS: tl.constexpr,  # runs (unique rows) per program, one per tile row
    IDS: tl.constexpr,  # ids of each run read per step
    PREFETCH: tl.constexpr,  # load the next group's record while this group is updated
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,  # every row starts at a multiple of it (vector loads and stores)
    GALIGN: tl.constexpr,  # every gradient offset is a multiple of it
):
    # persistent: each program takes groups of RUNS consecutive runs, grid-stride, until the
    # run count (a grid sized for the worst case, every id its own run, launched mostly
    # empty programs: twice as many for a padded batch, whose padding is one run)
    U = tl.load(num_runs_ptr).to(tl.int64)
    n_groups = (U + RUNS - 1) // RUNS
    pid = tl.program_id(0).to(tl.int64)
    stride = tl.num_programs(0).to(tl.int64) * RUNS
    lane = tl.arange(0, RUNS)
    d = tl.arange(0, BLOCK_D)
    if PREFETCH:
        s, e, key, elem, D, goff0 = _run_record(
            run_starts_ptr, run_keys_ptr, run_elems_ptr, run_dims_ptr, run_goffs_ptr,
            pid * RUNS + lane, U, sentinel, ALIGN, GALIGN)
    for g in range(pid, n_groups, tl.num_programs(0)):
        r = g * RUNS + lane
        if PREFETCH == 0:
            s, e, key, elem, D, goff0 = _run_record(
                run_starts_ptr, run_keys_ptr, run_elems_ptr, run_dims_ptr, run_goffs_ptr, r, U,
                sentinel, ALIGN, GALIGN)
            w, m_row, acc = _run_rows(grad_ptr, weights_ptr, scales_ptr, mom1_ptr, s, e, key,
                                      elem, D, goff0, d, sentinel, OPTIMIZER, ROW_STATE,
                                      HAS_SCALE, CHUNK_SIZE, ALIGN, GALIGN)
        else:  # this group's record came with the last iteration; the next one's now
            sn, en, keyn, elemn, Dn, goffn = _run_record(
                run_starts_ptr, run_keys_ptr, run_elems_ptr, run_dims_ptr, run_goffs_ptr,
                r + stride, U, sentinel, ALIGN, GALIGN)
            w, m_row, acc = _run_rows(grad_ptr, weights_ptr, scales_ptr, mom1_ptr, s, e, key,
                                      elem, D, goff0, d, sentinel, OPTIMIZER, ROW_STATE,
                                      HAS_SCALE, CHUNK_SIZE, ALIGN, GALIGN)
        _update_group(w, m_row, acc, r, lane, s, e, key, elem, D, d, grad_ptr, weights_ptr,
                      goffs_ptr, scales_ptr, partial_ptr, out_rows_ptr, mom1_ptr, mom2_ptr,
                      mom3_ptr, sentinel, hyper_ptr, step_ptr, seed, OPTIMIZER, WD_DECOUPLED, HAS_SCALE,
                      STOCHASTIC, MANTISSA, MIN_EXP, CHUNK_SIZE, PART_L, RUNS, IDS, BLOCK_D,
                      ALIGN, GALIGN)
        if PREFETCH:
            s, e, key, elem, D, goff0 = sn, en, keyn, elemn, Dn, goffn


_ROWS = Launcher(_tbe_row_update_kernel)

LAUNCHERS = {"_ROWS": _ROWS}
"""This file's launchers by their names here (``bench/tbe_sweep.py`` reports and toggles them
under these names, the keys of its ``regs``)."""


def resident_programs(device: torch.device, num_warps: int, maxnreg: int = 0) -> int:
    """Programs of ``num_warps`` warps that the device keeps resident at once (a persistent
    grid): per SM at most 32 blocks and 64 warps on NVIDIA GPUs since Volta, and, with the
    registers capped at ``maxnreg`` per thread, as many warps as the 64K registers hold (a
    grid of more would run its last programs after the first ones, a second wave); a few on
    CPU (the interpreter), so that its loops run more than once."""
    if device.type != "cuda":
        return 3
    per_sm = min(32, 64 // num_warps)
    if maxnreg:
        per_sm = min(per_sm, 65536 // (maxnreg * 32 * num_warps))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index) * max(1, per_sm)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def update_rows(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    plan,
    partial: torch.Tensor,
    out_rows: torch.Tensor,
    *,
    optimizer: optim.Optimizer | None,
    momentum1: torch.Tensor | None,
    momentum2: torch.Tensor | None,
    momentum3: torch.Tensor | None = None,
    hyper: torch.Tensor | None = None,
    step: torch.Tensor | None,
    seed: int,
    stochastic_rounding: bool,
    config: tuple[int, ...],
    block_d: int,
    row_align: int,
    galign: int,
) -> None:
    """Sum each run of ``plan`` (``tbe_backward.BackwardPlan``) and update its row in place
    (with ``optimizer``), or write the row gradients to ``out_rows`` (without). ``config``:
    ``backward_config``'s (RUNS, num_warps, IDS, CHUNK, maxnreg, PREFETCH)."""
    device = weights.device
    code = optimizer_code(optimizer)
    states = optim.spec_of(optimizer).states if optimizer is not None else ()
    runs, num_warps, ids, chunk, maxnreg, prefetch = config
    scales = plan.scales
    mantissa, min_exp = half_format(weights.dtype)
    _ROWS(
        (min(cdiv(plan.N, runs), resident_programs(device, num_warps, maxnreg)),),
        grad_output,
        weights,
        plan.goffs,
        scales if scales is not None else partial,
        plan.run_starts,
        plan.run_keys,
        plan.run_elems,
        plan.run_dims,
        plan.run_goffs,
        plan.num_runs,
        partial,
        out_rows,
        momentum1 if momentum1 is not None else partial,
        momentum2 if momentum2 is not None else partial,
        momentum3 if momentum3 is not None else partial,
        plan.sentinel,
        hyper if code else partial,
        step if code else plan.num_runs,
        seed % 2147483647,  # (seed * 1000003 + t) % (2^31 - 1) stays in int64
        OPTIMIZER=code,
        ROW_STATE=bool(states) and states[0].per_row,
        WD_DECOUPLED=getattr(optimizer, "weight_decay_mode", "l2") == "decoupled",
        HAS_SCALE=scales is not None,
        STOCHASTIC=bool(stochastic_rounding) and weights.dtype in (torch.float16, torch.bfloat16),
        MANTISSA=mantissa,
        MIN_EXP=min_exp,
        CHUNK_SIZE=chunk,
        PART_L=max(1, min(32, 1024 * num_warps // block_d)),
        RUNS=runs,
        IDS=ids,
        PREFETCH=prefetch,
        BLOCK_D=block_d,
        ALIGN=row_align,
        GALIGN=galign,
        num_warps=num_warps,
        # a launch option of NVIDIA's backend only (ROCm's torch also says "cuda")
        maxnreg=maxnreg if maxnreg and device.type == "cuda" and not torch.version.hip else None,
    )
