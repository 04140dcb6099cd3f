"""Pure-PyTorch twin of kernels/bucketize.py: ids cut by shard-feature."""

import torch


def bucketize(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    sf_feature: torch.Tensor,
    sf_row_start: torch.Tensor,
    sf_row_end: torch.Tensor,
    B: int,
    capacity: int | None = None,
    table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For every shard-feature s (feature ``sf_feature[s]``, rows [start, end)) and sample b:
    the ids of bag (feature, b) inside the row range, rebased to ``start``.

    Returns ``lengths`` [S * B] (shard-feature-major), ``ids`` [sum(lengths)] int64 in
    (s, b, original order) order, and the matching per-sample weights (or None). With
    ``capacity``, ids and weights are padded to that length (the kernel then needs no sync).
    ``table`` (the kernel's launch grid, ``kernels.bucketize.by_feature``) is ignored here.
    """
    lengths, ids, w = _bucketize(
        indices, offsets, per_sample_weights, sf_feature, sf_row_start, sf_row_end, B
    )
    if capacity is not None:
        pad = capacity - ids.numel()
        if pad < 0:
            raise ValueError(f"capacity: expected >= {ids.numel()} ids, got {capacity}")
        ids = torch.nn.functional.pad(ids, (0, pad))
        w = torch.nn.functional.pad(w, (0, pad)) if w is not None else None
    return lengths, ids, w


def _bucketize(indices, offsets, per_sample_weights, sf_feature, sf_row_start, sf_row_end, B):
    device = indices.device
    F = (offsets.numel() - 1) // max(B, 1)
    bounds = offsets[:: max(B, 1)].tolist() if B else [0] * (F + 1)
    bags = torch.repeat_interleave(
        torch.arange(F * B, device=device), offsets[1:] - offsets[:-1], output_size=indices.numel()
    )
    lengths, ids, weights = [], [], []
    for f, lo, hi in zip(
        sf_feature.tolist(), sf_row_start.tolist(), sf_row_end.tolist(), strict=True
    ):
        a, e = bounds[f], bounds[f + 1]
        bag_ids = indices[a:e].to(torch.int64)
        keep = (bag_ids >= lo) & (bag_ids < hi)
        samples = bags[a:e][keep] - f * B
        lengths.append(torch.bincount(samples, minlength=B)[:B])
        ids.append(bag_ids[keep] - lo)  # stable: (sample, original order) within the feature
        if per_sample_weights is not None:
            weights.append(per_sample_weights[a:e][keep])
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    w = None
    if per_sample_weights is not None:
        w = torch.cat(weights) if weights else per_sample_weights.new_zeros(0)
    return (torch.cat(lengths) if lengths else empty, torch.cat(ids) if ids else empty, w)


def bucketize_into(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    sf_feature: torch.Tensor,
    sf_row_start: torch.Tensor,
    sf_row_end: torch.Tensor,
    B: int,
    out_ids: torch.Tensor,
    out_weights: torch.Tensor | None,
    out_lengths: torch.Tensor,
    sf_first: torch.Tensor,
    sf_id_start: torch.Tensor,
    sf_w_start: torch.Tensor,
    sf_len_start: torch.Tensor,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``bucketize`` written straight into a send buffer, each destination at its place.

    Shard-features are listed destination by destination; for shard-feature s,
    ``sf_first[s]`` is the (s', b) index of its destination's first bag (``s' * B``), and the
    destination's ids (in the order ``bucketize`` returns them) go to ``out_ids`` from
    ``sf_id_start[s]`` on, their weights to ``out_weights`` from ``sf_w_start[s]`` on, and the
    B bag lengths of s (int32) to ``out_lengths[sf_len_start[s] : + B]``. The outputs are 1-D
    views of one buffer in their own dtypes (ids cast to ``out_ids.dtype``); nothing else of
    them is written. Returns the lengths [S*B] (int64)."""
    lengths, ids, w = _bucketize(
        indices, offsets, per_sample_weights, sf_feature, sf_row_start, sf_row_end, B
    )
    S = sf_feature.numel()
    if S * B == 0:
        return lengths
    starts = torch.cumsum(lengths, 0) - lengths
    s_of = torch.repeat_interleave(torch.arange(S, device=lengths.device), B)  # per (s, b)
    sf_of_id = torch.repeat_interleave(s_of, lengths, output_size=ids.numel())
    rank = torch.arange(ids.numel(), device=ids.device) - starts[sf_first][sf_of_id]
    out_ids[sf_id_start[sf_of_id] + rank] = ids.to(out_ids.dtype)
    if w is not None:
        out_weights[sf_w_start[sf_of_id] + rank] = w.to(out_weights.dtype)
    b = torch.arange(S * B, device=lengths.device) - s_of * B
    out_lengths[sf_len_start[s_of] + b] = lengths.to(out_lengths.dtype)
    return lengths


def segment_copy(
    src: torch.Tensor,
    src_w: torch.Tensor | None,
    src_base: torch.Tensor,
    src_w_base: torch.Tensor,
    ends: torch.Tensor,
    dst_start: torch.Tensor,
    out: torch.Tensor,
    out_w: torch.Tensor | None,
    capacity: int,
) -> None:
    """Copy R sources' segments to their places: source r holds n segments back to back from
    ``src[src_base[r]]`` on (weights from ``src_w[src_w_base[r]]``), segment i of length
    ``ends[r, i] - ends[r, i - 1]`` (``ends`` [R, n]: inclusive cumsum within the source, at
    most ``capacity``); it goes to ``out[dst_start[r, i]:]`` (and ``out_w``). Nothing else of
    ``out`` is written."""
    R, n = ends.shape
    if R == 0 or n == 0:
        return
    counts = torch.diff(ends, dim=1, prepend=ends.new_zeros(R, 1))
    total = int(ends[:, -1].sum())
    seg = torch.repeat_interleave(torch.arange(R * n, device=ends.device), counts.reshape(-1),
                                  output_size=total)
    seg_start = (ends - counts).reshape(-1)
    p = torch.arange(total, device=ends.device) - (torch.cumsum(counts.reshape(-1), 0)
                                                   - counts.reshape(-1))[seg]
    p = p + seg_start[seg]  # position within the source
    r = seg // n
    dst = dst_start.reshape(-1)[seg] + p - seg_start[seg]
    out[dst] = src[src_base[r] + p].to(out.dtype)
    if src_w is not None:
        out_w[dst] = src_w[src_w_base[r] + p].to(out_w.dtype)


def segment_plan(
    counts: torch.Tensor, group_first: torch.Tensor, group_base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``segment_copy`` puts R sources' segments: ``counts`` [R, n] ids of segment i
    (a shard-feature) from source r. Returns (``ends`` [R, n], the inclusive cumsum of each
    source's counts; ``dst_start`` [R, n]): the segments of one TBE group go feature-major,
    (i, r) after every (i' < i, any r') and (i, r' < r) of its group, from ``group_base[i]``
    on; ``group_first[i]`` is the first segment of i's group (groups are runs of i)."""
    R, n = counts.shape
    flat = counts.t().reshape(-1)
    start = (torch.cumsum(flat, 0) - flat).view(n, R)
    dst = start - start[group_first, :1] + group_base[:, None]
    return torch.cumsum(counts, 1), dst.t().contiguous()

