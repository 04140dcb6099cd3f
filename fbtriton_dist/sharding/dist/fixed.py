"""The fixed-shape input dist (``CommOptions(fixed_shapes=True)``): no host sync, static shapes.

The default input dist (``input_dist.py``) reads a header back to the host every step: the
data all-to-all needs split lists, and they depend on how many ids each destination gets.
That read stalls the host until the GPU has finished everything queued before it, so the host
cannot run ahead, and a step that syncs cannot be captured in a CUDA graph.

Here every (source, destination) message has a size fixed once, at the first call:

    meta (int64: 1 if the sender found bad input) | lengths (int32, n_sf[q] * B) |
    ids (C = max ids per batch * most shards an id lands in) | weights (float32, C)

The first call agrees on every rank's batch size and id capacity (one small all-to-all and
one host read); later calls run bucketize, one all-to-all with those cached splits, and a
receive side whose output sizes are static too: each TBE group gets ``sum_r C_r`` id slots,
of which the bags (offsets from the received lengths) use the first ones; the TBE is told the
rest is padding. The price is bytes: each destination gets C id slots whether it needs them or
not (R times the ids of a uniform row-wise split, at most).

Bad input (an id out of range, lengths that do not add up, a NaN/inf per-sample weight) cannot
stop the step without a sync: the bucketize drops the bad ids and the sender raises its flag in
the message. The flag is read asynchronously (pinned memory, an event): a later call, or
``poll()``, raises on every rank, within ``DEPTH`` steps; the rank that sent the batch names
the id (it keeps its last batches for that). Changing the batch size or sending more ids than
the capacity raises at once on that rank (``ValueError``), before any collective: the other
ranks then wait in the next collective until the process group's timeout.
"""

import collections
import dataclasses

import torch
import torch.distributed as dist

from fbtriton_dist.host_flags import HostFlags
from fbtriton_dist.ops import bucketize as ops
from fbtriton_dist.sharding.dist.input_dist import (
    InputDist,
    InputDistOut,
    LookupBatch,
    Message,
)
from fbtriton_dist.sharding.dist.layout import ShardLayout
from fbtriton_dist.sharding.dist.weights_grad import weights_need_grad
from fbtriton_dist.sparse import kjt_parts


def fixed_message(n_lengths: int, capacity: int, id_dtype, weighted: bool) -> Message:
    """Layout of one fixed-size message (see the module docstring)."""
    parts = [("meta", torch.int64, 1), ("lengths", torch.int32, n_lengths),
             ("ids", id_dtype, capacity)]
    if weighted:
        parts.append(("weights", torch.float32, capacity))
    return Message.of(parts)


class FixedInputDist(InputDist):
    """The input dist with fixed message sizes (module docstring).

    Args:
        layout, rank, device, group_sizes, backend: as ``InputDist``.
        max_ids: the most ids one rank's batch may hold (``KeyedJaggedTensor.values()``
            length; a longer values tensor whose lengths use fewer is fine). None: the first
            batch's.
    """

    DEPTH = 4  # steps the failure flags may lag behind

    def __init__(self, layout: ShardLayout, rank: int, device, group_sizes: list[int], *,
                 max_ids: int | None = None, backend: str = "auto") -> None:
        super().__init__(layout, rank, device, group_sizes, backend=backend)
        if max_ids is not None and max_ids < 0:
            raise ValueError(f"max_ids: expected >= 0, got {max_ids}")
        self.max_ids = max_ids
        self.agreed = None  # (batch sizes [R], id capacities [R]) after the first call
        self.failed = torch.zeros((), dtype=torch.int64, device=self.device)
        """Sticky device flag: some rank sent bad input since the last ``reset_failed()``
        (a graph replay updates it; ``poll()`` reads it)."""
        self._pending: collections.deque = collections.deque()

    # -- the first call: agree on the shapes -------------------------------------------------
    def _agree(self, B: int, n_values: int, group) -> None:
        R = self.world
        cap = self.max_ids if self.max_ids is not None else n_values
        mine = torch.tensor([[B, cap]] * R, dtype=torch.int64, device=self.device)
        got = torch.empty_like(mine)
        dist.all_to_all_single(got, mine, group=group)
        rows = got.tolist()  # the one host read, once
        sizes, caps = [r[0] for r in rows], [r[1] for r in rows]
        self.agreed = (sizes, caps)
        n_local = self.n_sf[self.rank]
        # one id dtype on every wire (int32 unless some rank holds a shard of >= 2**31 rows):
        # the send buffer is then one typed view, written by one bucketize
        wire = torch.int64 if torch.int64 in self.id_dtype else torch.int32
        self.wire_id = wire
        self.send_msgs = [fixed_message(self.n_sf[q] * B, cap * self.max_cover, wire,
                                        self.weighted) for q in range(R)]
        self.recv_msgs = [fixed_message(n_local * sizes[r], caps[r] * self.max_cover, wire,
                                        self.weighted) for r in range(R)]
        self.slots = sum(m.pieces["ids"][2] for m in self.recv_msgs)  # id slots per group
        self.send_bytes = sum(m.nbytes for m in self.send_msgs)
        self.recv_bytes = sum(m.nbytes for m in self.recv_msgs)
        dev = self.device

        def at(msgs, name):  # element index of piece ``name`` of every message, in its dtype
            out, base = [], 0
            for m in msgs:
                offset, dtype, _ = m.pieces[name] if name in m.pieces else (0, torch.float32, 0)
                out.append((base + offset) // dtype.itemsize)
                base += m.nbytes
            return out

        # sender: per shard-feature s (destination q), where its destination's pieces are
        ids_at, w_at, len_at = at(self.send_msgs, "ids"), at(self.send_msgs, "weights"), at(
            self.send_msgs, "lengths")
        dest = [q for q in range(R) for _ in range(self.n_sf[q])]
        s_in_q = [s - self.sf_start[q] for s, q in enumerate(dest)]

        def tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=dev)

        self._sf_first = tensor([self.sf_start[q] * B for q in dest])
        self._sf_id_start = tensor([ids_at[q] for q in dest])
        self._sf_w_start = tensor([w_at[q] for q in dest])
        self._sf_len_start = tensor([len_at[q] + i * B for q, i in zip(dest, s_in_q,
                                                                      strict=True)])
        self._meta_at = tensor(at(self.send_msgs, "meta"))
        # receiver: where each source's ids and weights start in the receive buffer
        self._src_ids = tensor(at(self.recv_msgs, "ids"))
        self._src_w = tensor(at(self.recv_msgs, "weights"))
        # TBE group of each local shard-feature, and its first shard-feature
        group_of, first_of = [], []
        for g, n in enumerate(self.group_sizes):
            group_of += [g] * n
            first_of += [sum(self.group_sizes[:g])] * n
        self._group_base = tensor([g * self.slots for g in group_of])
        self._group_first = tensor(first_of)

    def _check_host(self, B: int, n_values: int) -> None:
        sizes, caps = self.agreed
        me = self.rank
        if B != sizes[me]:
            raise ValueError(
                f"fixed_shapes: batch size {B} on rank {me}, but the shapes were fixed at the "
                f"first batch with {sizes[me]}; keep every batch the same size (drop or pad the "
                "last one) or use CommOptions(fixed_shapes=False)"
            )
        if n_values > caps[me]:
            raise ValueError(
                f"fixed_shapes: {n_values} ids in this batch on rank {me}, more than the "
                f"capacity {caps[me]} (CommOptions.max_ids, default the first batch's); set "
                "max_ids to the most ids a batch can hold"
            )

    # -- the step ----------------------------------------------------------------------------
    def __call__(self, features, weighted: bool, group=None) -> InputDistOut:
        self.weighted = weighted
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            self.poll(wait=False)
        if features.variable_stride_per_key():
            raise ValueError(
                "CommOptions(fixed_shapes=True): a batch size per feature (VBE, "
                "stride_per_key) changes the message sizes every batch; use "
                "CommOptions(fixed_shapes=False) for VBE batches"
            )
        parts = kjt_parts(features, self.layout.feature_names, weighted)
        if weights_need_grad(parts.weights):
            raise ValueError(
                "CommOptions(fixed_shapes=True): per-sample weights that require grad (a "
                "feature processor's) travel in an all-to-all sized every batch; use "
                "CommOptions(fixed_shapes=False), or detach the weights"
            )
        B, N = parts.batch_size, parts.values.numel()
        if self.agreed is None:
            self._agree(B, N, group)
        self._check_host(B, N)
        R, me = self.world, self.rank
        sizes, _ = self.agreed

        sendbuf = torch.empty(self.send_bytes, dtype=torch.uint8, device=self.device)
        lengths = self._bucketize_into(parts, sendbuf)
        recvbuf = torch.empty(self.recv_bytes, dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(recvbuf, sendbuf, [m.nbytes for m in self.recv_msgs],
                               [m.nbytes for m in self.send_msgs], group=group)
        lookup, flags, counts = self._unpack_fixed(recvbuf, sizes, weighted)
        torch.maximum(self.failed, flags.max(), out=self.failed)
        if not capturing:
            self._watch(flags, features)

        others = [q for q in range(R) if q != me]
        sent = sum(self.send_msgs[q].nbytes for q in others)
        received = sum(self.recv_msgs[r].nbytes for r in others)
        own = self.own_lengths(parts)
        S = len(self.sfs)

        def ids_sent_received(lengths=lengths, counts=counts):
            per_dest = torch.zeros(R, dtype=torch.int64, device=self.device)
            per_dest.index_add_(0, self.dest, lengths.view(S, B).sum(1))
            return per_dest.sum() - per_dest[me], counts.sum() - counts[me].sum()

        stats = self.stats(
            traffic={"input_dist.data": (sent, received)},
            # computed when comm_report asks (it syncs anyway), not in every step: the
            # buffers they read hold the last step's values (a graph replay refills them)
            ids=ids_sent_received,
            without_dedup=(sent, received),
            batch_sizes=sizes,
            per_feature=lambda own=own: own.sum(1),
            B=B,
        )
        return InputDistOut(own, dataclasses.replace(lookup, stats=stats), sizes)

    def _unpack_fixed(self, buf, sizes, weighted):
        """(LookupBatch with one (indices, offsets, weights) per TBE group, each [slots] long
        with padding (zeros) after its bags; the senders' failure flags [R]; ids per (source,
        shard-feature) [R, n_local])."""
        R, me, dev = self.world, self.rank, self.device
        n_local = self.n_sf[me]
        metas, lens, base = [], [], 0
        for r, msg in enumerate(self.recv_msgs):
            metas.append(msg.piece(buf, base, "meta"))
            lens.append(msg.piece(buf, base, "lengths").view(n_local, sizes[r]))
            base += msg.nbytes
        flags = torch.cat(metas)
        B_global = sum(sizes)
        lengths = torch.cat(lens, dim=1)  # [n_local, B_global] int32
        if len(set(sizes)) == 1:  # one reduction for all sources
            counts = lengths.view(n_local, R, sizes[0]).permute(1, 0, 2).sum(2, dtype=torch.int64)
        else:
            counts = torch.stack([x.sum(1, dtype=torch.int64) for x in lens])  # [R, n_local]
        G = len(self.group_sizes)
        # the id slots after the bags are padding, never read (the TBE looks up bags only);
        # their weights are zeros all the same (no stray NaN in a buffer that gets compared)
        ids = torch.empty(G * self.slots, dtype=self.wire_id, device=dev)
        w = torch.zeros(G * self.slots, dtype=torch.float32, device=dev) if weighted else None
        if n_local:
            # feature-major within each group: (i, r) after every (i' < i, r') of the group
            ends, dst = ops.segment_plan(counts, self._group_first, self._group_base,
                                         backend=self.backend)
            ops.segment_copy(
                buf.view(self.wire_id), buf.view(torch.float32) if weighted else None,
                self._src_ids, self._src_w, ends, dst, ids, w,
                max(m.pieces["ids"][2] for m in self.recv_msgs), backend=self.backend,
            )
        groups, first = [], 0
        for g, n in enumerate(self.group_sizes):
            offsets = torch.zeros(n * B_global + 1, dtype=torch.int64, device=dev)
            torch.cumsum(lengths[first : first + n].reshape(-1), 0, out=offsets[1:])
            sl = slice(g * self.slots, (g + 1) * self.slots)
            groups.append((ids[sl], offsets, w[sl] if weighted else None))
            first += n
        if groups:
            indices, offsets, psw = groups[0]
        else:
            indices = torch.zeros(0, dtype=torch.int64, device=dev)
            offsets = torch.zeros(1, dtype=torch.int64, device=dev)
            psw = None
        lookup = LookupBatch(
            indices=indices, offsets=offsets, per_sample_weights=psw, batch_size=B_global,
            id_bounds=(), groups=tuple(groups),
        )
        return lookup, flags, counts

    # -- failures, read late -----------------------------------------------------------------
    def _watch(self, flags: torch.Tensor, features) -> None:
        if self.device.type != "cuda":
            self._raise_if(flags.tolist(), [features])  # the CPU path may sync
            return
        while len(self._pending) >= self.DEPTH:
            self._drain_one(wait=True)
        self._pending.append((HostFlags(flags.numel(), flags.device).start(flags), features))

    def _drain_one(self, wait: bool) -> bool:
        copy, features = self._pending[0]
        flags = copy.poll(wait)
        if flags is None:
            return False
        self._pending.popleft()
        self._raise_if(flags, [features, *[p[1] for p in self._pending]])
        return True

    def poll(self, wait: bool = True) -> None:
        """Raise if a batch in flight had bad input (``wait``: wait for all of them; also
        reads the sticky ``failed`` flag that graph replays update)."""
        while self._pending:
            if not self._drain_one(wait):
                return
        if wait and int(self.failed):
            bad = "some rank"
            self.failed.zero_()
            raise RuntimeError(
                f"input dist (fixed_shapes): {bad} sent a batch with an id out of its table's "
                "range or lengths that do not add up to its values since the last check; the "
                "bad ids were dropped. Check the batches with fixed_shapes=False to name the id"
            )

    def _raise_if(self, flags: list[int], candidates) -> None:
        bad = [r for r, f in enumerate(flags) if f]
        if not bad:
            return
        self._pending.clear()
        self.failed.zero_()
        if self.rank in bad:
            for features in candidates:  # the batches this rank sent that may be the one
                error = self.explain(features, self.weighted)
                if not isinstance(error, RuntimeError):
                    raise error
        raise RuntimeError(
            f"rank(s) {bad} found bad input in a recent batch (see their error); with "
            "fixed_shapes the bad ids were dropped from that step"
        )

    def _bucketize_into(self, parts, sendbuf):
        """Bucketize straight into the send buffer: every destination's lengths and ids at
        their place of its message, its meta the failure flag. The values may be longer
        than the lengths use (a static buffer): only an overrun fails. Returns the lengths
        [S*B]. With the Triton backend the kernels also check the ids and bags and write the
        flag (a dozen small torch ops fewer per step)."""
        keyed = self.tables_for(parts.keys)
        B, N = parts.batch_size, parts.values.numel()
        offsets = self.bag_offsets(parts)
        meta = sendbuf.view(torch.int64)
        check = (keyed.grid_cover, meta, self._meta_at) if keyed.grid_cover is not None else None
        if B == 0 or not self.sfs:
            lengths = torch.zeros(len(self.sfs) * B, dtype=torch.int64, device=self.device)
        else:
            lengths = ops.bucketize_into(
                parts.values, offsets, parts.weights, keyed.sf_key, self.lo, self.hi, B,
                sendbuf, (self._sf_first, self._sf_id_start, self._sf_w_start,
                          self._sf_len_start), self.wire_id,
                backend=self.backend, capacity=self.send_msgs[0].pieces["ids"][2],
                grid=keyed.grid, check=check,
            )
            if check is not None:  # the kernels checked the batch and wrote the flag
                if parts.weights is not None:  # they do not look at the weights
                    flag = torch.maximum(meta[self._meta_at], self.bad_weights(parts))
                    meta.index_put_((self._meta_at,), flag)
                return lengths
        failed = self.bad_batch(parts, lengths, offsets[-1] > N).to(torch.int64)
        meta.index_put_((self._meta_at,), failed.expand(self.world))
        return lengths
