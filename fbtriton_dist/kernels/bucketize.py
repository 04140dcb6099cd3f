"""Input-dist bucketize: cut every bag's ids by shard-feature (row range), rebased.

Two launches over a grid of (shard-feature, 32 samples): count the ids of each bag inside
the shard's row range; after an exclusive cumsum of those lengths (torch), copy them, compacted and
rebased, to their place. Output order is what the all-to-all sends: shard-feature-major (the
shard-features are listed destination rank by destination rank), then sample, then the ids'
original order.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _bags_of(offsets_ptr, sf_feature_ptr, B, BAGS: tl.constexpr):
    """(shard-feature s, samples b [BAGS], their mask, bag starts, bag ends) of this program."""
    per_sf = tl.cdiv(B, BAGS)
    pid = tl.program_id(0).to(tl.int64)
    s = pid // per_sf
    b = (pid - s * per_sf) * BAGS + tl.arange(0, BAGS)
    bm = b < B
    f = tl.load(sf_feature_ptr + s).to(tl.int64)
    start = tl.load(offsets_ptr + f * B + b, mask=bm, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + f * B + b + 1, mask=bm, other=0).to(tl.int64)
    return s, b, bm, start, end


@triton.jit
def _bucketize_count_kernel(
    indices_ptr,  # [N] ids, feature-major bags
    offsets_ptr,  # [F * B + 1] bag boundaries
    sf_feature_ptr,  # [S] feature of each shard-feature
    sf_lo_ptr,  # [S] first row of each shard
    sf_hi_ptr,  # [S] one past its last row
    lengths_ptr,  # [S * B] out: ids of bag (feature(s), b) in the shard
    B,  # local batch size
    BAGS: tl.constexpr,  # bags (samples) per program
    BLOCK: tl.constexpr,  # ids of each bag read per step
):
    # one program per (shard-feature s, BAGS samples): a [BAGS, BLOCK] tile of ids per step
    s, b, bm, start, end = _bags_of(offsets_ptr, sf_feature_ptr, B, BAGS)
    lo = tl.load(sf_lo_ptr + s)
    hi = tl.load(sf_hi_ptr + s)
    count = tl.zeros([BAGS], dtype=tl.int64)
    for l0 in range(0, tl.max(end - start, axis=0), BLOCK):
        p = start[:, None] + l0 + tl.arange(0, BLOCK)[None, :]
        m = bm[:, None] & (p < end[:, None])
        ids = tl.load(indices_ptr + p, mask=m, other=-1).to(tl.int64)
        count += tl.sum(((ids >= lo) & (ids < hi) & m).to(tl.int64), axis=1)
    tl.store(lengths_ptr + s * B + b, count, mask=bm)


@triton.jit
def _bucketize_scatter_kernel(
    indices_ptr,  # [N] ids, feature-major bags
    offsets_ptr,  # [F * B + 1] bag boundaries
    psw_ptr,  # [N] per-sample weights (if HAS_PSW)
    sf_feature_ptr,  # [S] feature of each shard-feature
    sf_lo_ptr,  # [S] first row of each shard
    sf_hi_ptr,  # [S] one past its last row
    out_offsets_ptr,  # [S * B] first output position of each (s, b)
    out_ids_ptr,  # [M] out: rebased ids
    out_psw_ptr,  # [M] out: their weights (if HAS_PSW)
    B,  # local batch size
    HAS_PSW: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # the count kernel's programs; each kept id goes to its bag's next output slot
    s, b, bm, start, end = _bags_of(offsets_ptr, sf_feature_ptr, B, BAGS)
    lo = tl.load(sf_lo_ptr + s)
    hi = tl.load(sf_hi_ptr + s)
    out = tl.load(out_offsets_ptr + s * B + b, mask=bm, other=0)
    for l0 in range(0, tl.max(end - start, axis=0), BLOCK):
        p = start[:, None] + l0 + tl.arange(0, BLOCK)[None, :]
        m = bm[:, None] & (p < end[:, None])
        ids = tl.load(indices_ptr + p, mask=m, other=-1).to(tl.int64)
        keep = (ids >= lo) & (ids < hi) & m
        slot = out[:, None] + tl.cumsum(keep.to(tl.int64), axis=1) - 1
        tl.store(out_ids_ptr + slot, ids - lo, mask=keep)
        if HAS_PSW:
            w = tl.load(psw_ptr + p, mask=keep, other=0.0)
            tl.store(out_psw_ptr + slot, w, mask=keep)
        out += tl.sum(keep.to(tl.int64), axis=1)


def bucketize(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    sf_feature: torch.Tensor,
    sf_row_start: torch.Tensor,
    sf_row_end: torch.Tensor,
    B: int,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as reference.bucketize.bucketize: (lengths [S*B], ids, weights). With
    ``capacity`` (>= the ids that can come out, e.g. N times the shards an id can land in)
    the outputs have that length and no host sync is needed to size them."""
    S = sf_feature.numel()
    device = indices.device
    lengths = torch.zeros(S * B, dtype=torch.int64, device=device)
    if S * B == 0:
        empty = torch.zeros(capacity or 0, dtype=torch.int64, device=device)
        w = per_sample_weights.new_zeros(capacity or 0) if per_sample_weights is not None else None
        return lengths, empty, w
    BAGS, BLOCK = 32, 32  # 32 bags of up to 32 ids per step: 1,024 ids per program
    grid = (S * triton.cdiv(B, BAGS),)
    _bucketize_count_kernel[grid](
        indices, offsets, sf_feature, sf_row_start, sf_row_end, lengths, B, BAGS=BAGS,
        BLOCK=BLOCK, num_warps=4,
    )
    starts = torch.cumsum(lengths, 0) - lengths
    M = int(lengths.sum()) if capacity is None else capacity
    ids = torch.empty(M, dtype=torch.int64, device=device)
    psw = per_sample_weights
    out_psw = psw.new_empty(M) if psw is not None else None
    _bucketize_scatter_kernel[grid](
        indices,
        offsets,
        psw if psw is not None else indices,
        sf_feature,
        sf_row_start,
        sf_row_end,
        starts,
        ids,
        out_psw if out_psw is not None else ids,
        B,
        HAS_PSW=psw is not None,
        BAGS=BAGS,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return lengths, ids, out_psw
