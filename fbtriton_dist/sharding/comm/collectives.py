"""Collectives with gradients, each testable alone (tests/sharding/test_comm.py)."""

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


def exchange_lists(outs: list[torch.Tensor], ins: list[torch.Tensor], group=None) -> None:
    """All-to-all of per-peer tensors (``ins[q]`` to rank q, ``outs[r]`` filled from rank r),
    without autograd. On NCCL the tensors travel where they are (the same tensor may go to
    several peers, and the outputs may be views of one buffer): no packing copies. Backends
    without a list all-to-all (gloo) pack into one buffer and unpack."""
    if dist.get_backend(group) == "nccl":
        dist.all_to_all(outs, [t.contiguous() for t in ins], group=group)
        return
    flat = torch.cat([t.reshape(-1) for t in ins])
    got = flat.new_empty(sum(o.numel() for o in outs))
    dist.all_to_all_single(got, flat, [o.numel() for o in outs], [t.numel() for t in ins],
                           group=group)
    at = 0
    for o in outs:
        o.copy_(got[at : at + o.numel()].view(o.shape))
        at += o.numel()


def exchange_sum(x: torch.Tensor, row_splits: Sequence[int], wire_dtype=None,
                 group=None) -> torch.Tensor:
    """Row-wise reduce-scatter: rows ``row_splits[q]`` of ``x`` ([sum, W], the same W on every
    rank) go to rank q; this rank sums the ``[B, W]`` blocks it gets from every rank (B = its
    ``row_splits`` entry). On NCCL with equal splits and no ``wire_dtype`` that is one
    ``reduce_scatter_tensor`` (NCCL adds while it receives; two ranks: a + b, as the add
    below); otherwise an all-to-all of the blocks, summed here. ``wire_dtype``: the blocks and
    the gradients travel in it and are summed in ``x``'s dtype. Backward sends this rank's
    gradient, as it is, to every rank (on NCCL without a copy per peer)."""
    return _ExchangeSum.apply(x, list(row_splits), wire_dtype, group)


class _ExchangeSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, row_splits, wire_dtype, group):
        R, me = len(row_splits), dist.get_rank(group)
        B, W = row_splits[me], x.shape[1]
        if sum(row_splits) != x.shape[0]:
            raise ValueError(f"exchange_sum: row_splits {row_splits} add up to "
                             f"{sum(row_splits)}, but x has {x.shape[0]} rows")
        ctx.args = (row_splits, wire_dtype, group, x.dtype)
        if (R > 1 and wire_dtype is None and len(set(row_splits)) == 1
                and dist.get_backend(group) == "nccl"):
            out = x.new_empty((B, W))
            dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
            return out
        wire = x if wire_dtype is None else x.to(wire_dtype)
        if R == 1:  # the block comes back as it is: received straight into the output
            out = wire.new_empty((B, W))
            exchange_lists([out], [wire], group)
            return out.to(x.dtype)
        buf = wire.new_empty((R, B, W))
        exchange_lists(list(buf.unbind(0)), list(wire.split(row_splits)), group)
        if R == 2 and buf.dtype == x.dtype:  # an elementwise add streams better than a
            return torch.add(buf[0], buf[1])  # reduction over dim 0
        return buf.sum(0, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        row_splits, wire_dtype, group, dtype = ctx.args
        g = grad.contiguous() if wire_dtype is None else grad.to(wire_dtype).contiguous()
        out = g.new_empty((sum(row_splits), g.shape[1]))
        exchange_lists(list(out.split(row_splits)), [g] * len(row_splits), group)
        return out.to(dtype), None, None, None


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
