"""Output dist: pooled blocks back to the ranks that own the samples, added into place.

Forward, on rank q: its lookup output ``[B_global, W_q]`` is cut by sample owner; rank r gets
the rows of its samples for q's shard-features and adds each column block into the feature's
columns (a sum over row shards, side by side for column shards): one all-to-all for all
sharding types, the bytes of a reduce-scatter for row-wise. Data-parallel shard-features never
travel: every rank computed them for the global batch and keeps its own rows. Backward is
autograd's: index_add -> gather, all-to-all -> reverse all-to-all, own rows -> all-gather.
"""

import torch

from fbtriton_dist.dist.comm import all_to_all, own_rows
from fbtriton_dist.dist.layout import ShardLayout


class OutputDist:
    """Column index lists of one rank, fixed by the plan."""

    def __init__(self, layout: ShardLayout, rank: int, device: torch.device) -> None:
        self.layout, self.rank = layout, rank
        R = layout.world_size
        cols = [layout.output_columns(q, data_parallel=False) for q in range(R)]
        self.send_cols = torch.tensor(cols[rank][0], dtype=torch.int64, device=device)
        self.recv_cols = [torch.tensor(dst, dtype=torch.int64, device=device) for _, dst in cols]
        self.all_recv_cols = torch.cat(self.recv_cols)
        dp_src, dp_dst = layout.output_columns(rank, data_parallel=True)
        self.dp_src = torch.tensor(dp_src, dtype=torch.int64, device=device)
        self.dp_dst = torch.tensor(dp_dst, dtype=torch.int64, device=device)
        self.total_D = layout.feature_cols[-1]

    def traffic(self, batch_sizes: list[int]) -> dict[str, tuple[int, int]]:
        """Bytes (sent, received) to/from the other ranks per collective, backward included
        (it mirrors the forward), for fp32 pooled values."""
        me, B = self.rank, batch_sizes[self.rank]
        W = self.send_cols.numel()
        widths = [c.numel() for c in self.recv_cols]
        others = [q for q in range(len(batch_sizes)) if q != me]
        fwd_sent = 4 * W * sum(batch_sizes[q] for q in others)
        fwd_recv = 4 * B * sum(widths[q] for q in others)
        dp = 4 * self.dp_src.numel()
        return {
            "output_dist.forward": (fwd_sent, fwd_recv),
            "output_dist.backward": (fwd_recv, fwd_sent),
            "data_parallel.grad_all_gather": (
                dp * B * len(others), dp * sum(batch_sizes[q] for q in others)
            ),
        }

    def __call__(self, local: torch.Tensor, batch_sizes: list[int], group=None) -> torch.Tensor:
        """``local`` [sum(batch_sizes), W_rank] -> pooled ``[B_rank, sum(D)]`` (fp32, SUM)."""
        B = batch_sizes[self.rank]
        W = self.send_cols.numel()
        send = local.index_select(1, self.send_cols)  # rows already grouped by owner
        widths = [c.numel() for c in self.recv_cols]
        # every rank takes part in this all-to-all (and, through autograd, in its backward),
        # even with nothing to send or receive: the output always depends on what came back
        recv = all_to_all(
            send.reshape(-1, 1), [B_r * W for B_r in batch_sizes], [B * w for w in widths], group
        )
        blocks = [blk.view(B, w) for blk, w in zip(torch.split(recv, [B * w for w in widths]), widths, strict=True)]
        out = local.new_zeros((B, self.total_D)).index_add(
            1, self.all_recv_cols, torch.cat(blocks, dim=1)
        )
        if self.dp_src.numel():
            mine = own_rows(local.index_select(1, self.dp_src), batch_sizes, self.rank, group)
            out = out.index_add(1, self.dp_dst, mine)
        return out
