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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For every shard-feature s (feature ``sf_feature[s]``, rows [start, end)) and sample b:
    the ids of bag (feature, b) inside the row range, rebased to ``start``.

    Returns ``lengths`` [S * B] (shard-feature-major), ``ids`` [sum(lengths)] int64 in
    (s, b, original order) order, and the matching per-sample weights (or None). With
    ``capacity``, ids and weights are padded to that length (the kernel then needs no sync).
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
