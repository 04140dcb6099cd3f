"""Variable batch size per feature (FBGEMM's VBE) on the fixed-batch TBE kernels.

FBGEMM's convention (``batch_size_per_feature_per_rank``, ``B[t][r]``: feature ``t``'s bags
from rank ``r``):

- ``offsets`` has ``sum(B) + 1`` entries: bags feature after feature, and inside a feature
  rank after rank, ``B[t][r]`` bags each;
- the output is 1-D: rank after rank, and inside rank ``r`` feature after feature, a
  row-major ``[B[t][r], D_t]`` block each (so that rank ``r``'s rows are one contiguous
  slice, ready for an all-to-all).

Here the batch is laid out as a fixed batch of ``B_pad = sum_r max_t B[t][r]`` samples per
feature, rank ``r``'s samples at ``[rank_start[r], rank_start[r] + B[t][r])`` and the rest
empty bags. The ids do not move (the padded bags come in the same order), only the offsets
get the empty bags; the kernels skip empty bags, so the ids are gathered and the rows reduced
once each, as FBGEMM's VBE does; the price is the padded output (``B_pad x sum(D)``, zeros in
the padding), which one gather turns into the VBE layout (its backward scatters the gradient
back, zeros for the padding, which holds no ids).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class VBELayout:
    """Where each VBE bag and output element lives in the padded fixed batch."""

    batch_sizes: tuple[tuple[int, ...], ...]
    """``B[t][r]``."""
    padded_batch: int
    """``B_pad``: samples per feature of the padded batch."""
    num_bags: int
    """``sum(B)``."""
    offset_src: torch.Tensor
    """[T * B_pad + 1] int64: for each offset of the padded batch, the VBE offset it equals
    (an empty bag of the padding repeats the offset before it)."""
    output_index: torch.Tensor
    """[sum_t,r B[t][r] * D_t] int64: for each VBE output element, its place in the flattened
    padded output ``[B_pad, sum(D)]``."""

    @property
    def output_numel(self) -> int:
        return self.output_index.numel()


def vbe_layout(
    batch_size_per_feature_per_rank: Sequence[Sequence[int]],
    dims: Sequence[int],
    device: torch.device,
) -> VBELayout:
    """The padded layout of a VBE batch of features with output widths ``dims`` (host lists:
    no device read). Bad batch sizes raise ValueError naming the feature."""
    B = tuple(tuple(int(b) for b in per_rank) for per_rank in batch_size_per_feature_per_rank)
    T = len(dims)
    if len(B) != T:
        raise ValueError(
            f"batch_size_per_feature_per_rank: expected one list per feature ({T}), got {len(B)}"
        )
    R = len(B[0]) if T else 0
    for t, per_rank in enumerate(B):
        if len(per_rank) != R or any(b < 0 for b in per_rank):
            raise ValueError(
                f"batch_size_per_feature_per_rank[{t}]: expected {R} batch sizes >= 0 (one per "
                f"rank, as feature 0), got {list(per_rank)}"
            )
    rank_width = [max((B[t][r] for t in range(T)), default=0) for r in range(R)]
    rank_start = [sum(rank_width[:r]) for r in range(R)]
    B_pad = sum(rank_width)
    D_offsets = [sum(dims[:t]) for t in range(T + 1)]
    total_D = D_offsets[-1]
    # padded bag t * B_pad + rank_start[r] + b is VBE bag number (bags before it) for b < B[t][r]
    real = torch.zeros(T * B_pad, dtype=torch.int64)
    for t in range(T):
        for r in range(R):
            real[t * B_pad + rank_start[r] : t * B_pad + rank_start[r] + B[t][r]] = 1
    offset_src = torch.zeros(T * B_pad + 1, dtype=torch.int64)
    torch.cumsum(real, 0, out=offset_src[1:])
    out = []
    for r in range(R):
        for t in range(T):
            rows = rank_start[r] + torch.arange(B[t][r])
            cols = D_offsets[t] + torch.arange(dims[t])
            out.append((rows[:, None] * total_D + cols[None, :]).reshape(-1))
    empty = torch.zeros(0, dtype=torch.int64)
    return VBELayout(
        batch_sizes=B,
        padded_batch=B_pad,
        num_bags=sum(map(sum, B)),
        offset_src=offset_src.to(device),
        output_index=(torch.cat(out) if out else empty).to(device),
    )


def padded_offsets(offsets: torch.Tensor, layout: VBELayout) -> torch.Tensor:
    """VBE ``offsets`` [sum(B) + 1] -> the padded batch's [T * B_pad + 1] (the same ids):
    one gather."""
    if offsets.dim() != 1 or offsets.numel() != layout.num_bags + 1:
        raise ValueError(
            f"offsets: batch_size_per_feature_per_rank gives {layout.num_bags} bags, so expected "
            f"{layout.num_bags + 1} offsets, got {tuple(offsets.shape)}"
        )
    return offsets.index_select(0, layout.offset_src)


def vbe_output(padded: torch.Tensor, layout: VBELayout) -> torch.Tensor:
    """The padded batch's pooled ``[B_pad, sum(D)]`` -> FBGEMM's 1-D VBE output."""
    return padded.reshape(-1).index_select(0, layout.output_index)
