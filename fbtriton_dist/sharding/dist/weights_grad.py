"""Per-sample (per-id) weights that require grad, through the input dist.

The input dist's data all-to-all moves bytes, without autograd. When some rank's per-sample
weights require grad (a feature processor made them, e.g. TorchRec's position weights), every
rank sends them in an all-to-all of their own instead, built from differentiable pieces:

    KJT weights [N] --index_select(the position of each sent id)--> sent order
        --all_to_all (autograd)--> received, rank-major --gather--> the lookup's order

so the owners' TBE lookup gives d(loss)/d(weight) of every id it read, and backward sends those
gradients back to the ranks and places the weights came from (summed over the shards one id
lands in: column slices add up). A data-parallel table's id lands in every replica, and every
replica's lookup sees the whole batch's gradient, so only the id's own rank's replica passes
its gradient back. The header tells every rank whether any rank's weights require grad, so all
take the same path (a rank whose weights do not still joins the backward's all-to-all).
"""

import torch

from fbtriton_dist.ops import bucketize as ops
from fbtriton_dist.sharding.comm.collectives import all_to_all
from fbtriton_dist.sparse import KJTParts

EXACT = 2**24  # float32 holds every integer up to this exactly


def weights_need_grad(weights: torch.Tensor | None) -> bool:
    """Whether per-sample ``weights`` need a gradient in this step."""
    return weights is not None and weights.requires_grad and torch.is_grad_enabled()


def sent_positions(dist, parts: KJTParts, n_sent: int) -> torch.Tensor:
    """[n_sent] int64: the place in the KJT's values of each id the input dist ``dist`` sends,
    in the order it sends them. The bucketize itself routes the places (as its weights), so
    the order is the one the ids travel in on every backend."""
    N = parts.values.numel()
    if n_sent == 0 or parts.batch_size == 0 or not dist.sfs:
        return torch.zeros(0, dtype=torch.int64, device=dist.device)
    keyed = dist.tables_for(parts.keys)
    offsets = dist.bag_offsets(parts)

    def route(places: torch.Tensor) -> torch.Tensor:
        _, _, out = ops.bucketize(
            parts.values, offsets, places.to(torch.float32), keyed.sf_key, dist.lo, dist.hi,
            parts.batch_size, backend=dist.backend, capacity=N * dist.max_cover,
            grid=keyed.grid,
        )
        return out[:n_sent].to(torch.int64)

    places = torch.arange(N, dtype=torch.int64, device=dist.device)
    if N <= EXACT:
        return route(places)
    return (route(places >> 12) << 12) | route(places & 4095)  # two exact halves


def weights_with_grad(dist, parts: KJTParts, sent_h, recv_h, hdr_recv, group) -> torch.Tensor:
    """The lookup batch's per-sample weights (feature-major, as ``InputDist._unpack`` lays
    them out) as a differentiable function of the KJT's weights (see the module docstring)."""
    R, me = dist.world, dist.rank
    n_local = dist.n_sf[me]
    in_splits = [sum(sent_h[q][: dist.n_sf[q]]) for q in range(R)]
    out_splits = [sum(recv_h[r][:n_local]) for r in range(R)]
    w = parts.weights
    if not w.requires_grad:  # joins the backward's all-to-all all the same
        w = w.detach().requires_grad_(torch.is_grad_enabled())
    sent = w.index_select(0, sent_positions(dist, parts, sum(in_splits))).to(torch.float32)
    replicas = [i for i, sf in enumerate(dist.sfs) if sf.data_parallel and sf.rank != me]
    if replicas and sent.numel():
        per_sf = torch.tensor([c for q in range(R) for c in sent_h[q][: dist.n_sf[q]]],
                              dtype=torch.int64, device=dist.device)
        sf_of = torch.repeat_interleave(torch.arange(len(dist.sfs), device=dist.device),
                                        per_sf, output_size=sent.numel())
        other = torch.zeros(len(dist.sfs), dtype=torch.bool, device=dist.device)
        other[replicas] = True
        sent = torch.where(other[sf_of], sent.detach(), sent)  # their gradient: not ours
    got = all_to_all(sent, in_splits, out_splits, group)
    gather = dist.feature_major(hdr_recv, got.numel())
    return got if gather is None else got[gather]
