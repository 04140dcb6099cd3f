"""Input dist: send every id to the shards that hold its row, as one jagged batch per rank.

Bucketize (kernels/bucketize.py on GPU, reference/bucketize.py on CPU) cuts each bag by
shard-feature, destination by destination; two all-to-alls move lengths, then ids. The batch a
rank receives is what its TableBatchedEmbedding reads: features = its shard-features, batch =
the global batch (rank 0's samples, then rank 1's, ...), feature-major offsets.
"""

from dataclasses import dataclass

import torch

from fbtriton_dist import reference
from fbtriton_dist.dist.comm import all_to_all
from fbtriton_dist.dist.layout import ShardLayout
from fbtriton_dist.sparse import JaggedBatch, permute_segments


@dataclass(frozen=True, eq=False)
class Buckets:
    """This rank's ids cut by destination rank, ready for the all-to-alls."""

    lengths: torch.Tensor  # [sum_q n_sf(q) * B] bag lengths, destination-major
    indices: torch.Tensor  # ids rebased to their shard's first row, destination-major
    weights: torch.Tensor | None  # per-sample weights travelling with the ids
    id_splits: list[int]  # ids sent to each rank


def check_ids(batch: JaggedBatch, layout: ShardLayout) -> None:
    """Every id inside its table (before any collective, so a bad id stops all ranks)."""
    B = batch.batch_size
    if batch.indices.numel() == 0 or B == 0:
        return
    bags = torch.repeat_interleave(
        torch.arange(len(layout.feature_names) * B, device=batch.indices.device),
        batch.offsets[1:] - batch.offsets[:-1],
        output_size=batch.indices.numel(),
    )
    rows = torch.tensor(
        [layout.table_rows[t] for t in layout.feature_table], device=batch.indices.device
    )[bags // B]
    bad = (batch.indices < 0) | (batch.indices >= rows)
    if bool(bad.any()):
        p = int(torch.nonzero(bad)[0])
        f, b = divmod(int(bags[p]), B)
        t = layout.feature_table[f]
        raise IndexError(
            f"id {int(batch.indices[p])} of feature '{layout.feature_names[f]}' (sample {b}) is "
            f"out of range for table '{layout.configs[t].name}' with {layout.table_rows[t]} "
            f"rows: expected 0 <= id < {layout.table_rows[t]}"
        )


def bucketize(batch: JaggedBatch, layout: ShardLayout) -> Buckets:
    """Cut this rank's batch (B samples of every feature) by destination shard-feature: the
    Triton kernel on GPU, its PyTorch twin on CPU."""
    sfs = [sf for shard_features in layout.local for sf in shard_features]
    device = batch.indices.device
    columns = [[sf.feature for sf in sfs], [sf.row_start for sf in sfs], [sf.row_end for sf in sfs]]
    sf_feature, lo, hi = (torch.tensor(c, dtype=torch.int64, device=device) for c in columns)
    impl = reference
    if device.type == "cuda":
        from fbtriton_dist import kernels  # noqa: PLC0415 (triton only on GPU)

        impl = kernels
    B = batch.batch_size
    lengths, indices, weights = impl.bucketize(
        batch.indices, batch.offsets, batch.per_sample_weights, sf_feature, lo, hi, B
    )
    per_dest = [len(q) * B for q in layout.local]
    id_splits = [int(x) for x in torch.stack(
        [chunk.sum() for chunk in torch.split(lengths, per_dest)]
    ).tolist()] if sfs else [0] * layout.world_size
    return Buckets(lengths=lengths, indices=indices, weights=weights, id_splits=id_splits)


def exchange(
    buckets: Buckets, layout: ShardLayout, rank: int, batch_sizes: list[int], group=None
) -> tuple[JaggedBatch, dict[str, tuple[int, int]]]:
    """The two all-to-alls (bag lengths, then ids [and weights]). Returns this rank's lookup
    batch (features = its shard-features, ``batch_size`` = the global batch) and the bytes
    sent to / received from the other ranks by each collective."""
    R = layout.world_size
    n_local = len(layout.local[rank])
    B = batch_sizes[rank]
    length_splits = [len(layout.local[q]) * B for q in range(R)]
    recv_splits = [n_local * B_r for B_r in batch_sizes]
    lengths = all_to_all(buckets.lengths, length_splits, recv_splits, group)
    blocks = [blk.view(n_local, -1) for blk in torch.split(lengths, recv_splits)] if n_local else []
    per_block = torch.stack([blk.sum(dim=1) for blk in blocks]) if blocks else None  # [R, n]
    seg_sizes = per_block.flatten().tolist() if per_block is not None else []
    id_recv = [sum(seg_sizes[r * n_local : (r + 1) * n_local]) for r in range(R)]
    indices = all_to_all(buckets.indices, buckets.id_splits, id_recv, group)
    weights = None
    if buckets.weights is not None:
        weights = all_to_all(buckets.weights, buckets.id_splits, id_recv, group)
    # received rank-major ([r][sf][b]); the lookup wants feature-major ([sf][r][b])
    order = [r * n_local + i for i in range(n_local) for r in range(R)]
    indices = permute_segments(indices, seg_sizes, order)
    if weights is not None:
        weights = permute_segments(weights, seg_sizes, order)
    local_lengths = torch.cat(blocks, dim=1).flatten() if blocks else lengths
    offsets = torch.zeros(local_lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(local_lengths, 0, out=offsets[1:])
    lookup = JaggedBatch(
        indices=indices, offsets=offsets, per_sample_weights=weights, batch_size=sum(batch_sizes)
    )
    id_bytes = 8 + (buckets.weights.element_size() if buckets.weights is not None else 0)
    others = [q for q in range(R) if q != rank]
    traffic = {
        "input_dist.lengths": (
            8 * sum(length_splits[q] for q in others),
            8 * sum(recv_splits[r] for r in others),
        ),
        "input_dist.ids": (
            id_bytes * sum(buckets.id_splits[q] for q in others),
            id_bytes * sum(id_recv[r] for r in others),
        ),
    }
    return lookup, traffic
