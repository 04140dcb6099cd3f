"""Input-dist bucketize: cut every bag's ids by shard-feature (row range), rebased.

Two launches over a (shard-feature, sample) grid: count the ids of each bag inside the shard's
row range; after an exclusive cumsum of those lengths (torch), copy them, compacted and
rebased, to their place. Output order is what the all-to-all sends: shard-feature-major (the
shard-features are listed destination rank by destination rank), then sample, then the ids'
original order.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _bucketize_count_kernel(
    indices_ptr,  # [N] ids, feature-major bags
    offsets_ptr,  # [F * B + 1] bag boundaries
    sf_feature_ptr,  # [S] feature of each shard-feature
    sf_lo_ptr,  # [S] first row of each shard
    sf_hi_ptr,  # [S] one past its last row
    lengths_ptr,  # [S * B] out: ids of bag (feature(s), b) in the shard
    B,  # local batch size
    BLOCK: tl.constexpr,  # ids read per step
):
    # one program per (shard-feature s, sample b)
    sb = tl.program_id(0).to(tl.int64)
    s = sb // B
    b = sb - s * B
    f = tl.load(sf_feature_ptr + s).to(tl.int64)
    lo = tl.load(sf_lo_ptr + s)
    hi = tl.load(sf_hi_ptr + s)
    start = tl.load(offsets_ptr + f * B + b).to(tl.int64)
    end = tl.load(offsets_ptr + f * B + b + 1).to(tl.int64)
    count = tl.zeros([], dtype=tl.int64)
    for p0 in range(start, end, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ids = tl.load(indices_ptr + p, mask=p < end, other=-1).to(tl.int64)
        count += tl.sum(((ids >= lo) & (ids < hi) & (p < end)).to(tl.int64), axis=0)
    tl.store(lengths_ptr + sb, count)


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
    BLOCK: tl.constexpr,
):
    # one program per (shard-feature s, sample b), as the count kernel
    sb = tl.program_id(0).to(tl.int64)
    s = sb // B
    b = sb - s * B
    f = tl.load(sf_feature_ptr + s).to(tl.int64)
    lo = tl.load(sf_lo_ptr + s)
    hi = tl.load(sf_hi_ptr + s)
    start = tl.load(offsets_ptr + f * B + b).to(tl.int64)
    end = tl.load(offsets_ptr + f * B + b + 1).to(tl.int64)
    out = tl.load(out_offsets_ptr + sb)
    for p0 in range(start, end, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ids = tl.load(indices_ptr + p, mask=p < end, other=-1).to(tl.int64)
        keep = (ids >= lo) & (ids < hi) & (p < end)
        slot = out + tl.cumsum(keep.to(tl.int64), axis=0) - 1
        tl.store(out_ids_ptr + slot, ids - lo, mask=keep)
        if HAS_PSW:
            w = tl.load(psw_ptr + p, mask=keep, other=0.0)
            tl.store(out_psw_ptr + slot, w, mask=keep)
        out += tl.sum(keep.to(tl.int64), axis=0)


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
    BLOCK = 32  # one warp per bag: a bag holds tens of ids
    _bucketize_count_kernel[(S * B,)](
        indices, offsets, sf_feature, sf_row_start, sf_row_end, lengths, B, BLOCK=BLOCK,
        num_warps=1,
    )
    starts = torch.cumsum(lengths, 0) - lengths
    M = int(lengths.sum()) if capacity is None else capacity
    ids = torch.empty(M, dtype=torch.int64, device=device)
    psw = per_sample_weights
    out_psw = psw.new_empty(M) if psw is not None else None
    _bucketize_scatter_kernel[(S * B,)](
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
        BLOCK=BLOCK,
        num_warps=1,
    )
    return lengths, ids, out_psw
