"""TBE backward: reduce each touched row's gradient once, then update the row in place.

Steps (launcher ``tbe_backward``), with no host synchronisation on the fused path:
1. every id has a linear key ``row_offsets[f] + id`` (written by the forward kernel), unique
   per (table, row) since the features of one table share its row offset; a stable radix sort
   (32-bit keys when they fit) groups equal keys into runs; ``_tbe_run_count_kernel`` counts
   the key changes per block of positions, and ``_tbe_runs_kernel`` numbers the runs (a scan
   inside its block plus the blocks' scanned counts) and writes where each starts (and how
   many there are, on the device). This step reads no gradient: ``tbe_backward_plan``, which
   the op layer starts on a side stream as soon as the forward is done;
2. ``_tbe_chunk_reduce_kernel``: the sorted ids are cut into blocks of CHUNK positions; a block
   that holds part of a run longer than CHUNK (a hot row) reduces that part into a fp32
   partial row, so a row hit 100,000 times is spread over many programs and summed in a tree
   rather than one long serial chain; blocks without long runs exit at once;
3. ``_tbe_row_update_kernel`` (``kernels/tbe_rows.py``): each program takes RUNS runs side by
   side, sums each run's gradient in fp32 (ids, or its blocks' partials in order) and applies
   the optimizer to the rows in place, or, without an optimizer, writes the rows' gradients to
   a compact buffer. It reads one record per run that the runs kernel wrote (start, key, the
   row's flat element and D, the first id's gradient offset), so that its chain of dependent
   loads is record -> row. The chunk kernel skips the dropped ids' run (padding of a
   fixed-size batch included).
No atomics: results are bit-identical run to run.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from fbtriton_dist import knobs, optim
from fbtriton_dist.kernels.launch import Launcher, cdiv
from fbtriton_dist.kernels.tbe_forward import block_sizes, key_dtype
from fbtriton_dist.kernels.tbe_optim import OPT_NONE, optimizer_code
from fbtriton_dist.kernels.tbe_rows import update_rows
from fbtriton_dist.pooling import PoolingMode

CHUNK = 256  # sorted ids per block; a run longer than this is reduced block by block
# The row and chunk kernels' narrowest tile: one warp's 32 lanes each own a 16-byte vector of
# an fp32 row at 128 columns; narrower tiles leave lanes repeating others' work, and measured
# slower (H200, 32 tables of 1M rows, B=2048, L=20, fp32 D=64: the row kernel 446 -> 278 µs
# with SGD, 516 -> 394 rowwise Adagrad; D=32 374 -> 251, 508 -> 368; fp16 D=64 654 -> 586,
# 756 -> 675: docs/results/tbe-h200-2026-12-04.md).
ROW_TILE = 128
RUNS_WARPS = 16  # warps of the runs kernel: 1024 sorted positions per program (H200, S1:
# 4 warps 42 µs with 146 registers, 16 warps 29.5 µs with 40; S6 220 -> 157 µs)


@triton.jit
def _gather_grad_sum(
    grad_ptr,
    goffs_ptr,
    scales_ptr,
    start,
    end,
    d,
    d_mask,
    HAS_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GALIGN: tl.constexpr,
):
    """fp32 sum over sorted ids [start, end) of grad_output[goff + d] * scale. The next
    step's offsets are loaded before this step's rows, so a step waits on one load, not a
    chain of two (S6's chunk kernel: 406 -> 361 µs). The hints go on the loads: a
    loop-carried value has no op to carry one."""
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    j = start + tl.arange(0, BLOCK_L)
    goff_next = tl.multiple_of(tl.load(goffs_ptr + j, mask=j < end, other=0), GALIGN)
    for j0 in range(start, end, BLOCK_L):
        j = j0 + tl.arange(0, BLOCK_L)
        j_mask = j < end
        goff = goff_next
        goff_next = tl.multiple_of(
            tl.load(goffs_ptr + j + BLOCK_L, mask=j + BLOCK_L < end, other=0), GALIGN)
        g = tl.load(
            grad_ptr + goff[:, None] + d[None, :],
            mask=j_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_SCALE:
            s = tl.load(scales_ptr + j, mask=j_mask, other=0.0)
            g = g * s[:, None]
        acc += tl.sum(g, axis=0)
    return acc


@triton.jit
def _run_of(changes_ptr, p, mask):
    """0-based run index of sorted position p: how many key changes come at or before it."""
    return tl.load(changes_ptr + p - 1, mask=mask & (p > 0), other=0).to(tl.int64)


@triton.jit(do_not_specialize=["N"])
def _tbe_run_count_kernel(
    keys_ptr,  # [N] sorted linear row keys
    block_changes_ptr,  # [cdiv(N, BLOCK)] int32 out: key changes in each block of positions
    N,
    BLOCK: tl.constexpr,
):
    # a key change at p > 0: keys[p] != keys[p - 1]; the runs kernel scans these counts
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = (p < N) & (p > 0)
    key = tl.load(keys_ptr + p, mask=m, other=0)
    prev = tl.load(keys_ptr + p - 1, mask=m, other=0)
    tl.store(block_changes_ptr + tl.program_id(0), tl.sum((m & (key != prev)).to(tl.int32), 0))


@triton.jit(do_not_specialize=["N", "B", "sentinel"])
def _tbe_runs_kernel(
    keys_ptr,  # [N] sorted linear row keys
    perm_ptr,  # [N] int64 original position of each sorted id
    bag_ids_ptr,  # [N] int32 bag id (f * B + b) of each id, original order
    psw_ptr,  # [N] per-sample weights, original order (HAS_PSW)
    counts_ptr,  # [T * B] fp32 ids kept per bag (MEAN)
    block_prefix_ptr,  # [cdiv(N, BLOCK)] int32 inclusive scan of the blocks' key changes
    changes_ptr,  # [N - 1] int32 out: inclusive scan of key changes between sorted neighbours
    D_offsets_ptr,  # [T + 1] int64 output column of each feature
    w_offsets_ptr,  # [T] int64 element offset of each feature's table
    dims_ptr,  # [T] int64 D of each feature
    row_offsets_ptr,  # [T] int64 first linear row of each feature's table
    goffs_ptr,  # [N] int64 out: element of grad_output each sorted id reads (b * stride + col)
    scales_ptr,  # [N] fp32 out: per-sample weight / bag length of each sorted id (HAS_SCALE)
    run_starts_ptr,  # [N + 1] int64 out: first sorted position of each run, then N after the last
    run_keys_ptr,  # [N] int64 out: key of each run
    run_elems_ptr,  # [N] int64 out: flat weights element of each run's row (0: dropped ids)
    run_dims_ptr,  # [N] int64 out: D of each run's row
    run_goffs_ptr,  # [N] int64 out: grad_output element of each run's first id
    num_runs_ptr,  # [1] int64 out: number of runs U
    step_ptr,  # [1] int64 in/out: fused updates taken; one added here (COUNT_STEP)
    N,  # number of ids
    B,  # batch size
    grad_stride,  # row stride of grad_output
    sentinel,  # key of dropped ids and padding: nothing reads their gradient offsets
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    SEQUENCE: tl.constexpr,  # no pooling: one gradient row per id
    COUNT_STEP: tl.constexpr,  # a fused update follows: advance its step counter
    BLOCK: tl.constexpr,
):
    # one program per BLOCK sorted positions: one pass that turns the sorted ids into what the
    # row kernel reads, so that its chain of dependent loads stays short
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = p < N
    if COUNT_STEP:  # on the device, so that every replay of a captured step advances it
        first = p == 0
        t = tl.load(step_ptr + p * 0, mask=first, other=0)
        tl.store(step_ptr + p * 0, t + 1, mask=first)
    key = tl.load(keys_ptr + p, mask=m, other=0)
    prev = tl.load(keys_ptr + p - 1, mask=m & (p > 0), other=0)
    # dropped ids and padding (a fixed-size batch: often half the positions) sort last and
    # are skipped by the reduction: no gather of their bags, no offsets written
    ml = m & (key < sentinel)
    src = tl.load(perm_ptr + p, mask=ml, other=0)
    bag = tl.load(bag_ids_ptr + src, mask=ml, other=0).to(tl.int64)
    f = bag // B
    if SEQUENCE:  # no pooling: id src's gradient is row src of grad_output
        goff = src * grad_stride
    else:
        col = tl.load(D_offsets_ptr + f, mask=ml, other=0)
        goff = (bag - f * B) * grad_stride + col
    tl.store(goffs_ptr + p, goff, mask=ml)
    if HAS_PSW or MEAN:
        scale = tl.full([BLOCK], 1.0, dtype=tl.float32)
        if HAS_PSW:
            scale = tl.load(psw_ptr + src, mask=ml, other=0.0).to(tl.float32)
        if MEAN:
            scale = scale / tl.maximum(tl.load(counts_ptr + bag, mask=ml, other=1.0), 1.0)
        tl.store(scales_ptr + p, scale, mask=ml)
    is_start = m & ((p == 0) | (key != prev))
    # run index: the key changes at positions 1..p (changes[p - 1], written here for the
    # chunk and row kernels), from this block's count scan and the blocks before it
    pid = tl.program_id(0)
    before = tl.load(block_prefix_ptr + pid - 1, mask=pid > 0, other=0)
    incl = before + tl.cumsum((m & (p > 0) & (key != prev)).to(tl.int32), 0)
    tl.store(changes_ptr + p - 1, incl, mask=m & (p > 0))
    r = incl.to(tl.int64) + 1
    tl.store(run_starts_ptr + r - 1, p, mask=is_start)
    tl.store(run_keys_ptr + r - 1, key.to(tl.int64), mask=is_start)
    # the row kernel's whole record of a run, so that it reads no layout table before the row
    D = tl.load(dims_ptr + f, mask=is_start, other=0)
    w_at = tl.load(w_offsets_ptr + f, mask=is_start & ml, other=0)
    first_row = tl.load(row_offsets_ptr + f, mask=is_start & ml, other=0)
    elem = tl.where(ml, w_at + (key.to(tl.int64) - first_row) * D, 0)
    tl.store(run_elems_ptr + r - 1, elem, mask=is_start)
    tl.store(run_dims_ptr + r - 1, D, mask=is_start)
    tl.store(run_goffs_ptr + r - 1, goff, mask=is_start)
    last = m & (p == N - 1)
    tl.store(run_starts_ptr + r, p + 1, mask=last)
    tl.store(num_runs_ptr + p * 0, r, mask=last)


@triton.jit(do_not_specialize=["N", "sentinel"])
def _tbe_chunk_reduce_kernel(
    grad_ptr,  # [B, sum(D)] upstream gradient
    goffs_ptr,  # [N] int64 element of grad_output each sorted id reads
    scales_ptr,  # [N] fp32 per-sample weight / bag length of each sorted id (if HAS_SCALE)
    changes_ptr,  # [N - 1] int32 inclusive scan of key changes between sorted neighbours
    run_starts_ptr,  # [U + 1] int64 first sorted position of each run, then N
    run_dims_ptr,  # [U] int64 D of each run's row
    run_keys_ptr,  # [U] int64 key of each run (sentinel: dropped ids and padding, skipped)
    partial_ptr,  # [cdiv(N, CHUNK_SIZE), 2, BLOCK_D] fp32 out: per block, head and tail sums
    N,  # number of ids
    sentinel,  # key of dropped ids
    HAS_SCALE: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GALIGN: tl.constexpr,  # every gradient offset is a multiple of it (vector loads)
):
    # one program per block of CHUNK_SIZE sorted positions. A run longer than CHUNK_SIZE covers
    # the end of its first block (its "tail"), whole middle blocks and the start of its last
    # block (their "head"); each block sums the part of such a run that it holds.
    c = tl.program_id(0).to(tl.int64)
    lo = c * CHUNK_SIZE
    hi = tl.minimum(lo + CHUNK_SIZE, N)
    d = tl.arange(0, BLOCK_D)
    r_head = _run_of(changes_ptr, lo, lo < N)
    r_tail = _run_of(changes_ptr, hi - 1, lo < N)
    head_start = tl.load(run_starts_ptr + r_head)
    head_end = tl.load(run_starts_ptr + r_head + 1)
    head_live = tl.load(run_keys_ptr + r_head) < sentinel
    if (head_end - head_start > CHUNK_SIZE) & head_live:
        # D is a multiple of GALIGN: the mask is constant per vector, so loads stay vectors
        d_mask = d < tl.multiple_of(tl.load(run_dims_ptr + r_head), GALIGN)
        end = tl.minimum(head_end, hi)
        acc = _gather_grad_sum(
            grad_ptr, goffs_ptr, scales_ptr, lo, end, d, d_mask, HAS_SCALE, BLOCK_L, BLOCK_D,
            GALIGN,
        )
        tl.store(partial_ptr + 2 * c * BLOCK_D + d, acc)
    if r_tail != r_head:
        tail_start = tl.load(run_starts_ptr + r_tail)
        tail_end = tl.load(run_starts_ptr + r_tail + 1)
        tail_live = tl.load(run_keys_ptr + r_tail) < sentinel
        if (tail_end - tail_start > CHUNK_SIZE) & tail_live:
            d_mask = d < tl.multiple_of(tl.load(run_dims_ptr + r_tail), GALIGN)
            acc = _gather_grad_sum(
                grad_ptr,
                goffs_ptr,
                scales_ptr,
                tail_start,
                hi,
                d,
                d_mask,
                HAS_SCALE,
                BLOCK_L,
                BLOCK_D,
                GALIGN,
            )
            tl.store(partial_ptr + (2 * c + 1) * BLOCK_D + d, acc)


_RUN_COUNT = Launcher(_tbe_run_count_kernel)
_RUNS = Launcher(_tbe_runs_kernel)
_CHUNKS = Launcher(_tbe_chunk_reduce_kernel)

LAUNCHERS = {"_RUN_COUNT": _RUN_COUNT, "_RUNS": _RUNS, "_CHUNKS": _CHUNKS}
"""This file's launchers by their names here (``bench/tbe_sweep.py`` reports and toggles them
under these names, the keys of its ``regs``)."""


def linearize(
    indices: torch.Tensor, offsets: torch.Tensor, row_offsets: torch.Tensor, B: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [N], bag ids [N] int32) of a batch whose forward did not write them."""
    N = indices.numel()
    pos = torch.arange(N, device=indices.device, dtype=offsets.dtype)
    bags = torch.searchsorted(offsets[1:], pos, right=True)
    keys = row_offsets[bags // B] + indices.to(torch.int64)
    return keys.to(key_dtype(num_rows)), bags.to(torch.int32)


def backward_config(
    max_D: int, weight_bytes: int = 4, code: int = OPT_NONE
) -> tuple[int, int, int, int, int, bool]:
    """(RUNS, num_warps, IDS, CHUNK, maxnreg, PREFETCH) of the row kernel and the chunk kernel
    for optimizer kernel ``code`` (``optimizer_code``), from sweeps on an H200 (``python -m
    fbtriton_dist.bench.tbe_sweep``; docs/results/tbe-h200-record-prefetch-2026-12-02.md,
    tbe-h200-bounds-count-2026-12-02.md, tbe-h200-2026-12-04.md). The
    row update is bound by its chain of dependent loads, so what counts is programs in flight:
    one run per one-warp program, its registers capped at 64 so that 32 programs (the most an
    SM holds) fit; two runs per program took ~126 registers (16 programs per SM) and measured
    1.1-1.6x slower. PREFETCH (the next run's record loaded during this one's update) for fp32
    rows up to D=128 only: 9% off the row kernel on S0/S1, but 5-15% slower with 16-bit rows
    or D=256. On Zipf ids the kernel's tail is the program with the most ids in runs of up to
    CHUNK: fp32 rows up to D=128 read IDS ids of a run per step, SGD and plain gradients 4
    with CHUNK 128 (the middle band of run lengths goes to the chunk kernel; S3's row kernel
    343 -> 221 µs, S6 832 -> 737), stateful optimizers 2 with CHUNK 256 (rowwise Adagrad S6
    864 -> 752; 4 with CHUNK 128 took 913); uniform ids (one id per run) do not notice.
    ``FBTD_TBE_BWD=runs,num_warps[,ids[,chunk[,maxnreg]]]`` overrides the fields it gives
    (maxnreg 0: no cap)."""
    block_d = row_tile(max_D)
    runs, num_warps, ids, chunk = 1, (1 if block_d <= 256 else 2), 1, CHUNK
    prefetch = weight_bytes >= 4 and block_d <= 128
    if prefetch:  # fp32 rows up to D=128
        stateless = code in (OPT_NONE, optim.spec("sgd").kernel_code)
        ids, chunk = (4, CHUNK // 2) if stateless else (2, CHUNK)
    given = knobs.tbe_backward_config() or []
    # the fields not given keep the heuristic's values (the cap follows num_warps)
    runs, num_warps, ids, chunk = (given + [runs, num_warps, ids, chunk][len(given):])[:4]
    maxnreg = given[4] if len(given) == 5 else (64 if num_warps == 1 else 0)
    return runs, num_warps, ids, chunk, maxnreg, prefetch


def row_tile(max_D: int) -> int:
    """BLOCK_D of the row and chunk kernels: the forward's tile, at least ``ROW_TILE``."""
    return max(block_sizes(max_D)[1], ROW_TILE)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """What the backward needs from the ids alone (not the gradient): the sorted keys and their
    runs. ``tbe_backward_plan`` makes it; made on a side stream right after the forward, it
    runs while the rest of the model and the output dist do (see ``ops.tbe``)."""

    N: int
    grad_stride: int  # row stride of the grad_output it was made for (sum(D))
    sentinel: int
    keys: torch.Tensor  # [N] sorted keys
    perm: torch.Tensor  # [N] int64 original position of each sorted id
    changes: torch.Tensor  # [N - 1] int32 inclusive scan of key changes
    goffs: torch.Tensor  # [N] int64 grad_output element of each sorted id
    scales: torch.Tensor | None  # [N] fp32 per-sample weight / bag length (if any)
    run_starts: torch.Tensor  # [N + 1] int64
    run_keys: torch.Tensor  # [N] int64
    run_elems: torch.Tensor  # [N] int64 flat weights element of each run's row
    run_dims: torch.Tensor  # [N] int64 D of each run's row
    run_goffs: torch.Tensor  # [N] int64
    num_runs: torch.Tensor  # [1] int64

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The plan's tensors themselves (``dataclasses.astuple`` would deep-copy them)."""
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return tuple(v for v in values if isinstance(v, torch.Tensor))


def tbe_backward_plan(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    D_offsets: torch.Tensor,
    row_offsets: torch.Tensor,
    *,
    w_offsets: torch.Tensor,
    dims: torch.Tensor,
    pooling: int,
    grad_stride: int,
    num_rows: int | None = None,
    keys: torch.Tensor | None = None,
    bag_ids: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
) -> BackwardPlan:
    """Sort the ids' keys and number their runs: the half of ``tbe_backward`` that does not
    read the gradient. ``w_offsets``/``dims`` ([T] int64, the layout's) give each run's row
    its flat weights element and D (the row kernel's record of a run).
    ``keys``/``bag_ids``/``counts`` as in ``tbe_backward``; ``grad_stride``
    is the row stride of the coming grad_output (``sum(D)`` for a contiguous one); ``step``
    given: its counter is advanced by one on the device (the fused update that follows; an
    empty batch counts too)."""
    device = D_offsets.device
    T = D_offsets.numel() - 1
    B = (offsets.numel() - 1) // T if T else 0
    N = indices.numel()
    sentinel = num_rows if num_rows is not None else 2**62
    if keys is None:
        keys, bag_ids = linearize(indices, offsets, row_offsets, B, sentinel)
    keys, perm = torch.sort(keys, stable=True)
    changes = torch.empty(max(N - 1, 0), dtype=torch.int32, device=device)  # the runs kernel's
    has_scale = per_sample_weights is not None or pooling == PoolingMode.MEAN
    if pooling == PoolingMode.MEAN and counts is None:
        counts = (offsets[1:] - offsets[:-1]).to(torch.float32)
    workspace = torch.empty(6 * N + 2, dtype=torch.int64, device=device)  # one allocation
    views = workspace.split_with_sizes([N, N, N, N, N, N + 1, 1])  # one op, seven views
    goffs, run_keys, run_elems, run_dims, run_goffs, run_starts, num_runs = views
    scales = torch.empty(N, dtype=torch.float32, device=device) if has_scale else None
    if not (N and B):  # nothing to sort or nothing to read a gradient from
        num_runs.zero_()
        if step is not None:
            step.add_(1)  # an empty batch is a step too
    else:
        n_blocks = cdiv(N, 1024)
        block_changes = torch.empty(n_blocks, dtype=torch.int32, device=device)
        _RUN_COUNT((n_blocks,), keys, block_changes, N, BLOCK=1024)
        block_prefix = torch.cumsum(block_changes, 0, dtype=torch.int32)
        _RUNS(
            (n_blocks,),
            keys,
            perm,
            bag_ids,
            per_sample_weights if per_sample_weights is not None else keys,
            counts if counts is not None else keys,
            block_prefix,
            changes,
            D_offsets,
            w_offsets,
            dims,
            row_offsets,
            goffs,
            scales if scales is not None else goffs,
            run_starts,
            run_keys,
            run_elems,
            run_dims,
            run_goffs,
            num_runs,
            step if step is not None else num_runs,
            N,
            B,
            grad_stride,
            sentinel,
            HAS_PSW=per_sample_weights is not None,
            MEAN=pooling == PoolingMode.MEAN,
            SEQUENCE=pooling == PoolingMode.NONE,
            COUNT_STEP=step is not None,
            BLOCK=1024,
            num_warps=RUNS_WARPS,
        )
    return BackwardPlan(N, grad_stride, sentinel, keys, perm, changes, goffs, scales,
                        run_starts, run_keys, run_elems, run_dims, run_goffs, num_runs)


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
    step: torch.Tensor | None,
    momentum1: torch.Tensor | None,
    momentum2: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    hyper: torch.Tensor | None = None,
    num_rows: int | None = None,
    keys: torch.Tensor | None = None,
    bag_ids: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    row_align: int = 1,
    plan: BackwardPlan | None = None,
    momentum3: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Backward of ``tbe_forward`` for grad_output ``[B, sum(D)]``.

    ``keys``/``bag_ids``/``counts`` are what the forward wrote with ``linearize=True`` (ids
    whose key is ``num_rows`` were dropped and get no gradient; mean pooling divides by
    ``counts``); without them they are computed here from ``indices``/``offsets``.
    With an optimizer: updates ``weights`` (and momentum1/momentum2) in place, returns None,
    without a host synchronisation. Without: returns ``(row_elems [U] int64, row_dims [U]
    int64, row_grads [U, >=max_D] fp32)``: for every unique touched row, the flat offset of its
    first element in ``weights``, its D and its summed gradient (columns past D are zero).

    ``row_align`` (``TBELayout.row_align``: divides every D and table start) lets the row and
    gradient loads be vectors. ``plan``: ``tbe_backward_plan`` of these ids, made earlier
    (then ``keys``/``bag_ids``/``counts`` are not read, and ``step`` is advanced here).

    Nothing that changes from step to step is a launch argument, so a CUDA graph of the step
    replays correctly: ``step`` ([1] int64 on the device, the fused updates taken so far) is
    advanced by one on the device, then read there as t: Adam's bias corrections
    ``1 - beta^t`` and the stochastic-rounding seed ``(seed * 1000003 + t) % (2^31 - 1)``;
    ``hyper`` ([12] fp32 on the device, ``optim.hyper_parameters(optimizer)``, built here when
    None) holds the learning rate and the rest. ``momentum3``: a third state (rowwise Adagrad
    with counter's row_counter; its momentum2 is prev_iter, and its hyper carries
    ``tbe_optim.COUNTER_FIELDS``: ``ops/backends/triton.py`` builds them).
    """
    device = weights.device
    T = dims.numel()
    B = (offsets.numel() - 1) // T
    code = optimizer_code(optimizer)
    block_d = row_tile(max_D)
    N = indices.numel()
    if code and (step is None or step.shape != (1,) or step.dtype != torch.int64):
        raise ValueError(
            "step: expected the optimizer's step counter, a [1] int64 tensor on "
            f"{device}, got {None if step is None else (step.dtype, tuple(step.shape))}"
        )
    if N == 0 or B == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        rows = torch.empty((0, block_d), device=device, dtype=torch.float32)
        if code:
            step.add_(1)  # an empty batch is a step too (no kernel runs to count it)
        return None if code else (empty, empty, rows)
    if code and hyper is None:
        hyper = torch.tensor(optim.hyper_parameters(optimizer), dtype=torch.float32).to(device)
    grad_output = grad_output.contiguous()
    if plan is None:
        plan = tbe_backward_plan(
            indices,
            offsets,
            per_sample_weights,
            D_offsets,
            row_offsets,
            w_offsets=w_offsets,
            dims=dims,
            pooling=pooling,
            grad_stride=grad_output.stride(0),
            num_rows=num_rows,
            keys=keys,
            bag_ids=bag_ids,
            counts=counts,
            step=step if code else None,
        )
    else:
        if plan.N != N or (plan.grad_stride != grad_output.stride(0) and B > 1):
            raise ValueError(
                f"plan: made for {plan.N} ids and gradient rows of stride {plan.grad_stride}, "
                f"got {N} ids and stride {grad_output.stride(0)}"
            )
        if code:
            step.add_(1)  # a plan made ahead (in the forward) did not count the step
    # gradient offsets are b * sum(D) + D_offsets[f]: multiples of what divides every D
    galign = min(row_align, max(1, 16 // grad_output.element_size()))
    config = backward_config(max_D, weights.element_size(), code)
    partial = _reduce_long_runs(grad_output, plan, config, block_d, galign)
    U = int(plan.num_runs) if code == OPT_NONE else 0  # plain gradients: sized output, one sync
    out_rows = torch.zeros((U, block_d), device=device) if code == OPT_NONE else partial
    update_rows(
        grad_output, weights, plan, partial, out_rows, optimizer=optimizer, momentum1=momentum1,
        momentum2=momentum2, momentum3=momentum3, hyper=hyper, step=step,
        seed=seed, stochastic_rounding=stochastic_rounding, config=config, block_d=block_d,
        row_align=row_align, galign=galign,
    )
    if code != OPT_NONE:
        return None
    live = plan.run_keys[:U] < plan.sentinel
    return plan.run_elems[:U][live], plan.run_dims[:U][live], out_rows[live]


def _reduce_long_runs(
    grad_output: torch.Tensor,
    plan: BackwardPlan,
    config: tuple[int, ...],
    block_d: int,
    galign: int,
) -> torch.Tensor:
    """Step 2: the fp32 partial sums ``[cdiv(N, CHUNK), 2, block_d]`` of the runs longer than
    a chunk (a ``[1, 2, block_d]`` placeholder when no run can be that long)."""
    _, num_warps, _, chunk = config[:4]
    N = plan.N
    n_blocks = cdiv(N, chunk)
    partial = torch.empty((n_blocks if N > chunk else 1, 2, block_d), device=grad_output.device)
    if N > chunk:  # else no run can be long
        _CHUNKS(
            (n_blocks,),
            grad_output,
            plan.goffs,
            plan.scales if plan.scales is not None else partial,
            plan.changes,
            plan.run_starts,
            plan.run_dims,
            plan.run_keys,
            partial,
            N,
            plan.sentinel,
            HAS_SCALE=plan.scales is not None,
            CHUNK_SIZE=chunk,
            BLOCK_L=max(1, min(32, 512 * num_warps // block_d)),
            BLOCK_D=block_d,
            GALIGN=galign,
            num_warps=num_warps,
        )
    return partial

