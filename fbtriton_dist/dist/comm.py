"""Collectives with gradients, each testable alone (tests/dist/test_comm.py)."""

from collections.abc import Sequence

import torch
import torch.distributed as dist


def all_to_all(
    x: torch.Tensor, in_splits: Sequence[int], out_splits: Sequence[int], group=None
) -> torch.Tensor:
    """All-to-all of the rows of ``x`` ([sum(in_splits), ...]): ``in_splits[q]`` rows go to
    rank q, ``out_splits[r]`` rows come from rank r. Backward sends the gradients back."""
    return _AllToAll.apply(x, list(in_splits), list(out_splits), group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_splits, out_splits, group):
        ctx.splits = (in_splits, out_splits)
        ctx.group = group
        return _exchange(x, in_splits, out_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return _exchange(grad.contiguous(), out_splits, in_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, in_splits, out_splits, group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
    return out


def own_rows(x: torch.Tensor, batch_sizes: Sequence[int], rank: int, group=None) -> torch.Tensor:
    """Rows of this rank's samples from a ``[sum(batch_sizes), W]`` result that every rank
    computed identically (data-parallel tables). Backward all-gathers the gradient rows of
    every rank, so each replica sees the gradient of the whole global batch."""
    return _OwnRows.apply(x, list(batch_sizes), rank, group)


class _OwnRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, batch_sizes, rank, group):
        ctx.args = (batch_sizes, group)
        start = sum(batch_sizes[:rank])
        return x[start : start + batch_sizes[rank]]

    @staticmethod
    def backward(ctx, grad):
        batch_sizes, group = ctx.args
        B_max = max(batch_sizes)
        padded = grad.new_zeros((B_max, *grad.shape[1:]))
        padded[: grad.shape[0]] = grad
        parts = [torch.empty_like(padded) for _ in batch_sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:B] for p, B in zip(parts, batch_sizes, strict=True)]), None, None, None


def gather_batch_sizes(B: int, failed: bool, device: torch.device, group=None) -> list[int]:
    """All ranks' local batch sizes, in one collective that also carries a failure flag: a
    rank that found bad input before the data collectives passes ``failed=True`` (and raises
    its own error afterwards); every other rank then raises here, naming it, instead of
    waiting in an all-to-all until the timeout. (The sharded collection's input dist carries
    the same two numbers in its header all-to-all instead: no extra collective.)"""
    world = dist.get_world_size(group)
    mine = torch.tensor([B, int(failed)], dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    bad = [r for r, p in enumerate(parts) if int(p[1])]
    if bad and not failed:
        raise RuntimeError(f"rank(s) {bad} found bad input in this batch (see their error)")
    return [int(p[0]) for p in parts]
