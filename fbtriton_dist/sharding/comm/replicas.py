"""Replica groups (2D parallel): a world of R ranks split into R/S groups of S consecutive
ranks; each group shards the tables by one plan for S ranks inside its own process group,
and the ranks of the same local rank in every group (the replicas of the same shards) keep
their copies in step.

    rank r: group r // S, local rank r % S
    sharding group of r:  ranks [S*(r//S), S*(r//S) + S)       (every input/output dist)
    replica group of r:   ranks {r % S, r % S + S, ..., r % S + R - S}

``layout="strided"`` (TorchRec's ``DMPCollection`` default, ``use_inter_host_allreduce=False``)
puts rank r in group r % (R/S) at local rank r // (R/S) instead: a group's ranks are R/S apart
and the replicas of a shard are consecutive ranks (on one host, where R/S ranks fit on it).

Two ways to keep replicas in step (``replica_sync``):

- ``"step"``: every training step each shard is looked up once for the batches of all its
  replicas (their lookup batches, ids and bag lengths, are all-gathered over the replica group in
  forward, the gradients of the looked-up rows all-gathered in backward), so each replica
  applies the one fused update of the flat plan on R ranks to the same rows: weights and
  optimizer state equal the flat plan's (fp32 reduction order aside), and stay identical
  across replicas. The embedding gradients are divided by R, as the flat plan's.
- ``N`` (an int >= 1): each group trains on its own (a flat plan on S ranks, gradients
  divided by S); after every N-th backward the weights and the optimizer state of every
  local shard are averaged over the replica group (one fp32 all-reduce per tensor),
  ``sync_replicas`` does it on demand. ``CommOptions.replica_sync_dtype`` sends the weights
  in another wire format (bf16, fp16, fp8, int8, ``wire.py``): each of the K replicas owns
  a slice of the rows (rows ``[j*E/K, (j+1)*E/K)`` of the TBE's E rows, table after table); an
  all-to-all brings every replica's copy of its slice to the owner in the format, the owner
  averages the decoded rows in fp32 and an all-to-all sends the average back, in the format
  (each hop rounded once: the error bound is ``CommOptions.replica_sync_dtype``'s), and every
  replica, the owner too, decodes the same bytes. The optimizer state stays fp32.

Nothing here picks a kernel: the lookups and fused updates are the TBE's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fbtriton_dist import optim
from fbtriton_dist.sharding.comm.wire import Rows, WireFormat, exchange_rows

ReplicaSync = str | int
FP32 = WireFormat("fp32")


def check_replica_sync(replica_sync) -> ReplicaSync:
    """``"step"`` or an int >= 1, else ValueError."""
    if replica_sync == "step":
        return "step"
    if isinstance(replica_sync, bool) or not isinstance(replica_sync, int) or replica_sync < 1:
        raise ValueError(f"replica_sync: expected 'step' or an int >= 1 (average the replicas "
                         f"every N steps), got {replica_sync!r}")
    return replica_sync


def check_sync_format(replica_sync, fmt: WireFormat) -> None:
    """ValueError unless ``fmt`` (``CommOptions.replica_sync_format``) fits ``replica_sync``:
    any format averages every N steps; ``"step"`` exchanges row gradients in fp32 only (so
    that the grouped plan equals the flat plan). Raised on every rank before any
    collective."""
    if replica_sync == "step" and fmt.name != "fp32":
        raise ValueError(f"replica_sync_dtype: expected fp32 (None) with replica_sync='step' "
                         f"(its row gradients stay fp32: the grouped plan equals the flat "
                         f"plan; a format applies to replica_sync=N, the average of the "
                         f"weights), got {fmt.name!r}")


def check_group_size(group_size, world_size: int, plan_world_size: int) -> int:
    """``group_size`` S checked against the world R and the plan: an int >= 1 dividing R, and
    the plan made for S ranks; raised on every rank before any collective."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1 dividing the world size "
                         f"{world_size}, got {group_size!r}")
    if world_size % group_size:
        raise ValueError(f"group_size: expected a divisor of the world size {world_size} "
                         f"(groups of consecutive ranks), got {group_size}")
    if plan_world_size != group_size:
        raise ValueError(f"plan: expected a plan for the group size {group_size} ranks (each "
                         f"group shards the tables by it), got a plan for {plan_world_size} "
                         f"ranks (world size {world_size})")
    return group_size


@dataclass(frozen=True, eq=False)
class ReplicaGroups:
    """The process groups of one rank in a world split into groups of ``group_size``
    consecutive ranks (``make_replica_groups`` builds them on every rank)."""

    world_size: int
    """R: ranks in the whole process group."""
    group_size: int
    """S: ranks per sharding group (the plan's world size)."""
    group_index: int
    """This rank's group, ``rank // S``."""
    local_rank: int
    """This rank in its group, ``rank % S``."""
    group: object
    """The process group of this rank's sharding group (S ranks)."""
    replica_group: object
    """The process group of this rank's replicas (R / S ranks, one per group)."""
    local_world_size: int
    """Ranks per host of the plan (divides S)."""
    host_groups: dict
    """``{first local rank of a host: process group}`` of this rank's sharding group, for
    plans with several hosts per group (made on every rank); empty otherwise."""
    sync: ReplicaSync
    """``"step"`` or every how many steps the replicas are averaged."""
    group_ranks: tuple = ()
    """The global ranks of every sharding group, in group order."""

    @property
    def num_groups(self) -> int:
        return self.world_size // self.group_size

    def new_sharding_group(self):
        """A new process group over this rank's sharding group (e.g. a pipeline's own group
        for the input dist): one ``dist.new_group`` per group, made on every rank in the same
        order; every rank calls it."""
        mine = None
        for g, ranks in enumerate(self.group_ranks):
            pg = dist.new_group(list(ranks))
            if g == self.group_index:
                mine = pg
        return mine


GROUP_LAYOUTS = ("consecutive", "strided")


def make_replica_groups(process_group, group_size: int, replica_sync, plan_world_size: int,
                        local_world_size: int, layout: str = "consecutive") -> ReplicaGroups:
    """Check ``group_size`` (against the plan's ``plan_world_size`` and ``local_world_size``
    ranks per host), ``replica_sync`` and ``layout`` (ValueError on every rank, before any
    collective), then make every sharding group, every replica group and every per-host
    group inside a sharding group with ``dist.new_group`` in the same order on every rank."""
    sync = check_replica_sync(replica_sync)
    if layout not in GROUP_LAYOUTS:
        raise ValueError(f"group_layout: expected one of {list(GROUP_LAYOUTS)}, got {layout!r}")
    R = dist.get_world_size(process_group)
    S = check_group_size(group_size, R, plan_world_size)
    H, K = local_world_size, R // S
    if S % H:
        raise ValueError(f"plan: expected local_world_size dividing the group size {S}, got {H}")
    if layout == "strided" and H < S:
        raise ValueError(f"group_layout='strided': expected a plan with one host per group "
                         f"(local_world_size {S}), got local_world_size {H}")
    rank = dist.get_rank(process_group)

    def member(g: int, local: int) -> int:  # the rank at local rank ``local`` of group g
        return g * S + local if layout == "consecutive" else local * K + g

    def world(ranks):
        if process_group is None:
            return sorted(ranks)
        return sorted(dist.get_global_rank(process_group, r) for r in ranks)

    mine = next((g, local) for g in range(K) for local in range(S) if member(g, local) == rank)
    mine_group = mine_replicas = None
    hosts: dict = {}
    group_ranks = tuple(tuple(world([member(g, local) for local in range(S)])) for g in range(K))
    for g in range(K):
        pg = dist.new_group(list(group_ranks[g]))
        if g == mine[0]:
            mine_group = pg
    for local in range(S):
        pg = dist.new_group(world([member(g, local) for g in range(K)]))
        if local == mine[1]:
            mine_replicas = pg
    if H < S:
        for g in range(K):
            for first in range(0, S, H):
                pg = dist.new_group(world([member(g, first + i) for i in range(H)]))
                if g == mine[0]:
                    hosts[first] = pg
    return ReplicaGroups(world_size=R, group_size=S, group_index=mine[0], local_rank=mine[1],
                         group=mine_group, replica_group=mine_replicas, local_world_size=H,
                         host_groups=hosts, sync=sync, group_ranks=group_ranks)


# -- "step": one lookup for the batches of all replicas -------------------------------------


def _gather_padded(x: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every replica's ``x`` (first dim ``sizes[k]``), through one all_gather of padded
    copies."""
    most = max(1, *sizes)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return [p[:n] for p, n in zip(parts, sizes, strict=True)]


class _ReplicaRows(torch.autograd.Function):
    """Forward: this replica's rows of the union lookup's output; backward: every replica's
    row gradients, all-gathered, in the union's order (so the union lookup's fused update
    sees the gradient of the flat plan)."""

    @staticmethod
    def forward(ctx, union, order, own, sizes, me, group, traffic):
        ctx.order, ctx.sizes, ctx.me, ctx.group, ctx.traffic = order, sizes, me, group, traffic
        return union.index_select(0, own)

    @staticmethod
    def backward(ctx, grad):
        parts = _gather_padded(grad.contiguous(), ctx.sizes, ctx.group)
        bytes_each = max(1, *ctx.sizes) * grad[:1].numel() * grad.element_size()
        ctx.traffic.add_all_gather(bytes_each, len(ctx.sizes))
        rows = torch.cat(parts)
        if ctx.order is not None:
            rows = rows.index_select(0, ctx.order)
        return rows, None, None, None, None, None, None


class ReplicaTraffic:
    """Bytes this rank sent and received over its replica group since ``reset``."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0

    def reset(self) -> None:
        self.sent = self.received = 0

    def add_all_gather(self, message_bytes: int, ranks: int) -> None:
        """An all-gather of one ``message_bytes`` message per rank over ``ranks`` ranks: each
        rank's message reaches the ``ranks - 1`` others, and theirs reach it."""
        self.sent += int(message_bytes) * (ranks - 1)
        self.received += int(message_bytes) * (ranks - 1)

    def add(self, sent: int, received: int) -> None:
        """Bytes counted by the caller (``average_rows``'s all-to-alls)."""
        self.sent += int(sent)
        self.received += int(received)

    def add_all_reduce(self, tensor_bytes: int, ranks: int) -> None:
        """An all-reduce of ``tensor_bytes`` over ``ranks`` ranks, counted as a ring moves it
        (reduce-scatter then all-gather): 2 (ranks - 1) / ranks of it each way."""
        moved = 2 * int(tensor_bytes) * (ranks - 1) // ranks
        self.sent += moved
        self.received += moved


def replica_lookup(tbe, indices: torch.Tensor, offsets: torch.Tensor, psw, batch_size: int,
                   groups: ReplicaGroups, traffic: ReplicaTraffic) -> torch.Tensor:
    """``tbe(indices, offsets, psw)`` of this rank's lookup batch (``offsets`` feature-major,
    ``batch_size`` bags per feature), looked up together with the same TBE's batches of every
    replica, so the fused update in backward is the one of all their ids (the flat plan's).
    Pooled: rows ``[batch_size, cols]``; ``pooling="none"``: a row per id, as ``tbe``."""
    group, K, me = groups.replica_group, groups.num_groups, groups.group_index
    n = tbe.num_features
    head = torch.tensor([indices.numel(), batch_size], dtype=torch.int64, device=indices.device)
    heads = [torch.empty_like(head) for _ in range(K)]
    dist.all_gather(heads, head, group=group)
    counts = [int(h[0]) for h in heads]
    batches = [int(h[1]) for h in heads]
    lengths = offsets[1:] - offsets[:-1]
    all_lengths = _gather_padded(lengths, [n * b for b in batches], group)
    all_ids = _gather_padded(indices, counts, group)
    all_psw = _gather_padded(psw, counts, group) if psw is not None else None
    message = (2 * 8 + max(1, *batches) * n * lengths.element_size()
               + max(1, *counts) * (indices.element_size() + (4 if psw is not None else 0)))
    traffic.add_all_gather(message, K)
    union_lengths = torch.cat([x.view(n, b) for x, b in zip(all_lengths, batches, strict=True)],
                              dim=1)
    # ids of replica k, feature f go to union feature f after those of replicas < k
    feature_of = torch.cat([
        torch.repeat_interleave(torch.arange(n, device=indices.device) * K + k,
                                x.view(n, b).sum(1))
        for k, (x, b) in enumerate(zip(all_lengths, batches, strict=True))
    ])
    order = torch.argsort(feature_of, stable=True)
    union_ids = torch.cat(all_ids).index_select(0, order)
    union_psw = torch.cat(all_psw).index_select(0, order) if all_psw is not None else None
    union_offsets = torch.zeros(union_lengths.numel() + 1, dtype=offsets.dtype,
                                device=offsets.device)
    torch.cumsum(union_lengths.reshape(-1), 0, out=union_offsets[1:])
    union = tbe(union_ids, union_offsets, union_psw)
    if tbe.pooling == "none":  # a row per id, in the union's id order
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        first = sum(counts[:me])
        own = position[first : first + counts[me]]
        return _ReplicaRows.apply(union, order, own, counts, me, group, traffic)
    first = sum(batches[:me])  # bags: replica-major rows
    own = torch.arange(first, first + batch_size, device=union.device)
    return _ReplicaRows.apply(union, None, own, batches, me, group, traffic)


# -- N: average weights and optimizer state every N steps -------------------------------


@torch.no_grad()
def average_replicas(tbes, groups: ReplicaGroups, traffic: ReplicaTraffic,
                     include_optimizer_state: bool = True,
                     fmt: WireFormat = FP32) -> None:
    """Average the weights and (``include_optimizer_state``) the optimizer state of every TBE
    over the replica group: each flat tensor by an fp32 all-reduce divided by the number of
    replicas, the weights in ``fmt`` (not fp32) by ``average_rows``."""
    K = groups.num_groups
    for tbe in tbes:
        states = optim.spec_of(tbe.optimizer).states if tbe.optimizer is not None else ()
        if not include_optimizer_state:
            states = ()
        weights = tbe.weights.detach()
        if fmt.name != "fp32" and weights.numel():
            weights.copy_(average_rows(weights, tbe.slot_tables, fmt, groups.replica_group,
                                       traffic))
            tensors = [getattr(tbe, s.name) for s in states]
        else:
            tensors = [weights, *(getattr(tbe, s.name) for s in states)]
        for t in tensors:
            if not t.numel():
                continue
            x = t.float() if t.dtype != torch.float32 else t.clone()
            dist.all_reduce(x, group=groups.replica_group)
            t.copy_(x / K)
            traffic.add_all_reduce(x.numel() * 4, K)


def row_slices(tables, K: int) -> list[list[tuple[int, tuple[int]]]]:
    """The rows of ``tables`` (``[(E_t, D_t)]``, back to back) cut into K slices of whole rows
    (rows ``[j*E/K, (j+1)*E/K)`` of the E rows in all): slice j as ``Rows`` patterns,
    ``[(rows, (D_t,)), ...]``."""
    E = sum(n for n, _ in tables)
    bounds = [E * j // K for j in range(K + 1)]
    out = []
    for j in range(K):
        lo, hi, part = bounds[j], bounds[j + 1], []
        first = 0
        for n, D in tables:
            a, b = max(lo, first), min(hi, first + n)
            if b > a:
                part.append((b - a, (D,)))
            first += n
        out.append(part)
    return out


def average_rows(x: torch.Tensor, tables, fmt: WireFormat, group,
                 traffic: ReplicaTraffic) -> torch.Tensor:
    """The average over the ranks of ``group`` of flat ``x`` (rows of ``tables``,
    ``[(E_t, D_t)]``), sent in ``fmt`` in two hops (module docstring): every rank's copy of
    slice j to rank j, there decoded and averaged in fp32, the average back to every rank;
    fp32, the same on every rank."""
    K, me = dist.get_world_size(group), dist.get_rank(group)
    slices = row_slices(tables, K)
    every = Rows(slices, x.device)  # slice j to / from rank j
    mine = Rows([slices[me]] * K, x.device)  # my slice, from / to every rank
    copies = exchange_rows(x.float().reshape(-1), every, mine, fmt, group)
    n = mine.values[me]
    mean = copies.view(K, n).sum(0) / K if n else copies.new_zeros(0)
    out = exchange_rows(mean.repeat(K), mine, every, fmt, group)
    own = fmt.nbytes(every.values[me], every.rows[me])
    others = sum(fmt.nbytes(v, r) for j, (v, r) in enumerate(zip(every.values, every.rows,
                                                                  strict=True)) if j != me)
    traffic.add(others + (K - 1) * own, (K - 1) * own + others)  # both hops, self not counted
    return out


class AfterBackward(torch.autograd.Function):
    """Identity; its backward queues ``callback`` to run once the whole backward pass is done
    (after every fused update of the step)."""

    @staticmethod
    def forward(ctx, x, callback):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.autograd.Variable._execution_engine.queue_callback(ctx.callback)
        return grad, None
