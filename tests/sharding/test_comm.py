"""Each collective alone, forward and gradient, on real gloo process groups."""

import pytest
import torch

from tests.sharding.harness import device, run_ranks


def _all_to_all(rank, world):
    from fbtriton_dist.sharding.comm.collectives import all_to_all

    # rank r sends (q + 1) rows to rank q, each row filled with 100 r + q
    in_splits = [q + 1 for q in range(world)]
    out_splits = [rank + 1] * world
    x = torch.cat([torch.full((q + 1, 2), 100.0 * rank + q) for q in range(world)]).to(device())
    x.requires_grad_()
    y = all_to_all(x, in_splits, out_splits)
    expected = torch.cat([torch.full((rank + 1, 2), 100.0 * r + rank) for r in range(world)])
    expected = expected.to(device())
    # gradient: weight each received row by its value; comes back as the sent values
    (y * y.detach()).sum().backward()
    return torch.equal(y.detach(), expected), torch.equal(x.grad, x.detach())


def _own_rows(rank, world):
    from fbtriton_dist.sharding.comm.collectives import own_rows

    sizes = [2, 3, 1][:world]
    x = torch.arange(sum(sizes) * 2, dtype=torch.float32, device=device()).view(-1, 2)
    x.requires_grad_()
    mine = own_rows(x, sizes, rank)
    start = sum(sizes[:rank])
    ok_fwd = torch.equal(mine.detach(), x.detach()[start : start + sizes[rank]])
    mine.sum().mul(rank + 1).backward()
    # every rank's gradient rows arrive everywhere: row block r is filled with r + 1
    expected = torch.cat([torch.full((B, 2), float(r + 1)) for r, B in enumerate(sizes)])
    expected = expected.to(device())
    return ok_fwd, torch.equal(x.grad, expected)


def _host_reduce_scatter(rank, world):
    from fbtriton_dist.sharding.dist.output_dist import Block, BlockExchange

    # every rank holds a partial for the whole global batch (uneven sizes); rank p is
    # responsible for its own samples: the others send it those rows, it adds them
    sizes = [2, 3, 1][:world]
    rows = torch.arange(1.0, sum(sizes) + 1)[:, None]
    x = (rows * (rank + 1)).to(device()).requires_grad_()
    send = [[Block(p, (0,), (0,))] if p != rank else [] for p in range(world)]
    recv = [[Block(rank, (0,), (0,))] if q != rank else [] for q in range(world)]
    ex = BlockExchange(range(world), send, recv, (1, 1), True, device())
    y = ex(x, x, sizes)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    expected = x.detach().clone()
    expected[mine] = rows[mine].to(device()) * sum(q + 1 for q in range(world))
    y[mine].sum().mul(rank + 1).backward()
    # backward all-gathers: each rank's rows of sample owner p get p's gradient, p + 1
    grad = torch.cat([torch.full((B, 1), float(p + 1)) for p, B in enumerate(sizes)])
    return torch.equal(y.detach(), expected), torch.equal(x.grad, grad.to(device()))


def _exchange_sum(rank, world, wire, sizes):
    return _exchange_sum_body(rank, world, wire, sizes)


def _exchange_sum_body(rank, world, wire, sizes):
    from fbtriton_dist.sharding.comm.collectives import exchange_sum

    # rank r holds a partial [sum(sizes), 3] with rows (r + 1) * (global row + 1); rank q gets
    # the sum over r of its rows
    rows = torch.arange(1.0, sum(sizes) + 1)[:, None].expand(-1, 3)
    x = (rows * (rank + 1)).to(device()).requires_grad_()
    y = exchange_sum(x, sizes, wire_dtype=wire)
    start = sum(sizes[:rank])
    expected = rows[start : start + sizes[rank]] * sum(r + 1 for r in range(world))
    (y * (rank + 1)).sum().backward()
    # each rank's gradient goes back to every rank: row block q is filled with q + 1
    grad = torch.cat([torch.full((B, 3), float(q + 1)) for q, B in enumerate(sizes)])
    return (tuple(y.shape), torch.equal(y.detach().cpu(), expected),
            torch.equal(x.grad.cpu(), grad), x.grad.dtype)


def _exchange_sum_as_reduce_scatter(rank, world):
    """The NCCL branch of exchange_sum (equal splits, no wire dtype) on gloo, which has no
    reduce_scatter_tensor: a stand-in with NCCL's contract (input rank-major [R * B, W],
    output this rank's [B, W] block summed over ranks) shows the branch passes it the right
    tensors, and that it was taken."""
    import torch.distributed as dist


    calls = []

    def reduce_scatter_tensor(out, x, group=None):
        calls.append((tuple(out.shape), tuple(x.shape)))
        total = x.clone()
        dist.all_reduce(total, group=group)
        out.copy_(total.view(world, *out.shape)[rank])

    real_backend, real_rs = dist.get_backend, getattr(dist, "reduce_scatter_tensor", None)
    dist.get_backend = lambda group=None: "nccl"
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    try:
        result = _exchange_sum_body(rank, world, None, [3] * world)
    finally:
        dist.get_backend, dist.reduce_scatter_tensor = real_backend, real_rs
    return result, calls


def _failure_flag(rank, world):
    from fbtriton_dist.sharding.comm.collectives import gather_batch_sizes

    try:
        sizes = gather_batch_sizes(rank + 2, failed=rank == 1, device=device())
    except RuntimeError as e:
        return str(e)
    return sizes


def _sizes(world, even):
    """Small integers: exact in bf16 too; summed and returned in fp32. Uneven sizes (one rank
    without samples on 3 ranks) take the all-to-all; even ones, on NCCL, the reduce-scatter."""
    return [3, 3, 3][:world] if even else [2, 3, 0][:world]


WIRES = {"fp32": None, "bf16": torch.bfloat16}


def _every_collective(rank, world, nccl):
    """Every collective above on one set of ranks (starting the ranks costs more than the
    collectives): name -> what it returned. The failure flag goes last (it raises)."""
    out = {"all_to_all": _all_to_all(rank, world), "own_rows": _own_rows(rank, world),
           "host_reduce_scatter": _host_reduce_scatter(rank, world)}
    for name, wire in WIRES.items():
        for even in (False, True):
            out[f"exchange_sum[{name}-even={even}]"] = _exchange_sum_body(
                rank, world, wire, _sizes(world, even))
    if not nccl:  # NCCL runs the real reduce_scatter_tensor in exchange_sum[*-even=True]
        out["reduce_scatter_branch"] = _exchange_sum_as_reduce_scatter(rank, world)
    if world == 3:
        out["failure_flag"] = _failure_flag(rank, world)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_forward_and_backward(world):
    from tests.sharding.harness import backend

    nccl = backend() == "nccl"
    got = run_ranks(_every_collective, world, nccl)
    for r, res in enumerate(got):
        assert res["all_to_all"] == (True, True), r
        assert res["own_rows"] == (True, True), r
        assert res["host_reduce_scatter"] == (True, True), r
        for name in WIRES:
            for even in (False, True):
                want = ((_sizes(world, even)[r], 3), True, True, torch.float32)
                assert res[f"exchange_sum[{name}-even={even}]"] == want, (r, name, even)
        if not nccl:
            assert res["reduce_scatter_branch"] == (
                ((3, 3), True, True, torch.float32), [((3, 3), (3 * world, 3))]), r
    if world == 3:
        assert got[1]["failure_flag"] == [2, 3, 4]  # the failing rank gets the sizes, then
        for r in (0, 2):                             # raises its own error
            assert "rank(s) [1] found bad input" in got[r]["failure_flag"]


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_exchange_sum_at_world_size_one(wire):
    """One rank: its block comes back as it is (received straight into the output, no
    extra copy), in x's dtype, and the gradient goes back unchanged."""
    assert run_ranks(_exchange_sum, 1, wire, [4]) == [((4, 3), True, True, torch.float32)]
