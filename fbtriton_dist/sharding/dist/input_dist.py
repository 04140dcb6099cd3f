"""Input dist: send every id to the shards that hold its row, as one jagged batch per rank.

One step, R ranks, this rank's KJT (K keys, B samples, in the KJT's own key order):

1. bucketize (``ops.bucketize``: the Triton kernel or its reference, by ``backend``): one
   pass for all features cuts each bag by shard-feature, destination rank by destination
   rank. The bucketize reads the KJT's bags where they are (each shard-feature points at its
   feature's key), so the KJT is never permuted into config order.
2. header all-to-all: a fixed ``[R, H]`` int64 block, equal splits, so no host list is needed:
   per destination its id count per shard-feature, this rank's batch size, a failure flag
   (bad ids, lengths that do not add up, a KJT that does not match, NaN/inf weights), whether
   its per-sample weights require grad and,
   with dedup, its distinct ids per shard-feature. **The one host sync of the step** reads it
   back: the data all-to-all below needs host split lists (``all_to_all_single``'s contract),
   and every other size on the host (received ids, TBE group bounds, the comm report) comes
   from the same read.
3. data all-to-all: one byte message per (source, destination) pair holding, each piece
   padded to 8 bytes, the bag lengths (int32), the ids (int32 when every shard of the
   destination has fewer than 2**31 rows, else int64), with dedup each shard-feature's
   distinct ids and an inverse map, each id's place among its shard-feature's distinct ids
   (16 bits when no shard-feature has more than 65,536 distinct ids, else 32), and the
   per-sample weights (float32). Both sides compute the layout from the header; a message is
   deduplicated only where that makes it smaller. Weights that require grad (on any rank:
   a header flag) travel instead in an all-to-all of their own, with autograd, whose
   backward sends each id's weight gradient back to its place (``weights_grad.py``).

The receiver expands deduplicated ids back with the inverse map and reorders what it got
rank-major (``[r][sf][b]``) into the feature-major lookup batch (``[sf][r][b]``) with one
device gather built from the header on the device. Dedup therefore saves wire bytes, not
lookups: the TBE still reads one row per id (the pooling needs per-bag sums).

``CommOptions(fixed_shapes=True)`` is the other mode of the same input dist
(``sharding/dist/fixed.py``, a subclass): messages of a size fixed at the first batch, no header
and no host sync. Both modes share this file's message layout (``Message``), the per-key
tables, the bucketize check and the stats the comm report reads.
"""


import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from fbtriton_dist.ops import backend as backends
from fbtriton_dist.ops import bucketize as ops
from fbtriton_dist.sharding.dist.layout import ShardLayout
from fbtriton_dist.sharding.dist.weights_grad import weights_need_grad, weights_with_grad
from fbtriton_dist.sparse import (
    JaggedBatch,
    KJTParts,
    check_inverse_bounds,
    kjt_parts,
    kjt_to_batch,
    padding_positions,
    vbe_kjt_parts,
    vbe_kjt_to_batch,
)

ALIGN = 8  # bytes: every piece of a message starts aligned, so it can be viewed in place
INVERSE16 = 2**16  # inverse maps into at most this many distinct ids travel in 16 bits


@dataclass(frozen=True, eq=False)
class LookupBatch(JaggedBatch):
    """The ids of every rank for this rank's shard-features (feature-major, ``batch_size`` =
    the global batch), with what the host learnt from the header."""

    id_bounds: tuple[int, ...] = ()
    """Start of each TBE group's ids (shard-features grouped by dtype), then the total."""
    stats: dict | None = None
    """Host numbers of this step for ``comm_report``."""
    groups: tuple = ()
    """With fixed shapes: ``(indices, offsets, per_sample_weights)`` of each TBE group, the
    indices padded after the last bag to a fixed length (``fbtriton_dist.sharding.dist.fixed``);
    ``indices``/``offsets`` above are then the first group's."""
    received: tuple[tuple[int, ...], ...] = ()
    """[R][local shard-features] ids each source rank sent for each of this rank's
    shard-features (host numbers of the header; empty with fixed shapes)."""
    sent: tuple[tuple[int, ...], ...] = ()
    """[R][shard-features of rank q] ids this rank sent for each of rank q's shard-features
    (a sequence output dist sends the rows back in this order; empty with fixed shapes)."""


@dataclass(frozen=True, eq=False)
class VBEStep:
    """A step where some rank's batch has a batch size per feature (VBE). Every rank's
    lookup block is padded to its ``batch_sizes`` entry P_r with empty bags; the output dist
    sends feature f's first ``strides[r][f]`` rows of rank r's block only (the deduplicated
    rows), and rank r expands them to its samples by ``inverse``."""

    strides: tuple[tuple[int, ...], ...]
    """[R][T] rows of feature f (config order) in rank r's batch, for the features of this
    rank's shards and, for r = this rank, every feature; -1 where this rank does not know."""
    inverse: torch.Tensor | None
    """[T, B] int64: the row of each feature each of this rank's samples reads (the KJT's
    inverse indices, config feature order); None when this rank's own batch is fixed."""


class InputDistOut(NamedTuple):
    """What the ``input_dist`` stage hands to ``compute`` and ``output_dist``."""

    lengths: torch.Tensor
    """[T, B] this rank's bag lengths, config feature order (MEAN divides by them)."""
    lookup: LookupBatch
    """The lookup batch of this rank's shards."""
    batch_sizes: list[int]
    """Every rank's local batch size (VBE: its padded batch P_r)."""
    vbe: VBEStep | None = None
    """Set when some rank's batch has a batch size per feature."""


@dataclass(frozen=True)
class Message:
    """Byte layout of one (source, destination) message; both sides derive it from the
    header (or, with fixed shapes, from the first batch). ``pieces``: name -> (byte offset,
    dtype, element count)."""

    pieces: dict
    nbytes: int
    raw_bytes: int  # the same message without dedup

    @classmethod
    def of(cls, parts: list[tuple[str, torch.dtype, int]], raw_bytes: int | None = None):
        """The pieces ``(name, dtype, count)`` back to back, each ``ALIGN``-byte aligned."""
        pieces, offset = {}, 0
        for name, dtype, n in parts:
            pieces[name] = (offset, dtype, n)
            offset += padded(n * dtype.itemsize)
        return cls(pieces=pieces, nbytes=offset,
                   raw_bytes=offset if raw_bytes is None else raw_bytes)

    def piece(self, buf: torch.Tensor, base: int, name: str) -> torch.Tensor:
        """Piece ``name`` of this message, which starts at byte ``base`` of ``buf``, in place."""
        offset, dtype, n = self.pieces[name]
        return view_bytes(buf, base + offset, dtype, n)


def padded(n: int) -> int:
    """``n`` bytes rounded up to the alignment of a message piece."""
    return -(-n // ALIGN) * ALIGN


def view_bytes(buf: torch.Tensor, start: int, dtype, n: int) -> torch.Tensor:
    """``n`` values of ``dtype`` at byte ``start`` of the uint8 buffer ``buf``, in place."""
    return buf[start : start + n * dtype.itemsize].view(dtype)


def message(
    n_lengths: int,
    count: int,
    unique: int,
    id_dtype,
    weighted: bool,
    dedup: bool,
    max_unique: int | None = None,
) -> Message:
    """Layout of a message with ``n_lengths`` bag lengths and ``count`` ids of which
    ``unique`` are distinct (summed over its shard-features, at most ``max_unique`` in one,
    default ``unique``); deduplicated only where that is smaller on the wire."""
    id_bytes = id_dtype.itemsize
    max_unique = unique if max_unique is None else max_unique
    inv_dtype = torch.int16 if max_unique <= INVERSE16 else torch.int32  # int16: 16 bits
    inv_bytes = 2 if inv_dtype == torch.int16 else 4
    use_dedup = dedup and padded(unique * id_bytes) + padded(count * inv_bytes) < padded(
        count * id_bytes
    )
    parts = [("lengths", torch.int32, n_lengths)]
    if use_dedup:
        parts += [("unique", id_dtype, unique), ("inverse", inv_dtype, count)]
    else:
        parts += [("ids", id_dtype, count)]
    if weighted:
        parts += [("weights", torch.float32, count)]
    raw = padded(4 * n_lengths) + padded(count * id_bytes) + (
        padded(4 * count) if weighted else 0
    )
    return Message.of(parts, raw_bytes=raw)


def check_ids(batch: JaggedBatch, layout: ShardLayout) -> None:
    """Every id inside its table; raises IndexError naming the first bad one. Only run to
    explain a failure the device check found (it syncs)."""
    if batch.indices.numel() == 0:
        return
    bag_feature, first_bag = _bag_features(batch, len(layout.feature_names))
    bags = torch.repeat_interleave(
        torch.arange(bag_feature.numel(), device=batch.indices.device),
        batch.offsets[1:] - batch.offsets[:-1],
        output_size=batch.indices.numel(),
    )
    rows = torch.tensor(
        [layout.table_rows[t] for t in layout.feature_table], device=batch.indices.device
    )[bag_feature[bags]]
    bad = (batch.indices < 0) | (batch.indices >= rows)
    if bool(bad.any()):
        p = int(torch.nonzero(bad)[0])
        f = int(bag_feature[bags[p]])
        b = int(bags[p]) - first_bag[f]
        t = layout.feature_table[f]
        raise IndexError(
            f"id {int(batch.indices[p])} of feature '{layout.feature_names[f]}' (sample {b}) is "
            f"out of range for table '{layout.configs[t].name}' with {layout.table_rows[t]} "
            f"rows: expected 0 <= id < {layout.table_rows[t]}"
        )


def check_weights(batch: JaggedBatch, layout: ShardLayout) -> None:
    """Every per-sample weight finite; raises ValueError naming the first bad one. Only run
    to explain a failure the device check found (it syncs)."""
    w = batch.per_sample_weights
    if w is None or w.numel() == 0:
        return
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        p = int(torch.nonzero(bad)[0])
        bag = int(torch.searchsorted(batch.offsets[1:], torch.tensor(p), right=True))
        bag_feature, first_bag = _bag_features(batch, len(layout.feature_names))
        f = int(bag_feature[bag])
        b = bag - first_bag[f]
        raise ValueError(
            f"per-sample weight {float(w[p])} of feature '{layout.feature_names[f]}' (sample "
            f"{b}): expected finite weights"
        )


def _bag_features(batch: JaggedBatch, T: int) -> tuple[torch.Tensor, list[int]]:
    """([bags] the feature of each bag, the first bag of each feature), fixed batch or VBE."""
    sizes = list(batch.batch_sizes or [batch.batch_size] * T)
    dev = batch.indices.device
    per_bag = torch.repeat_interleave(
        torch.arange(T, device=dev), torch.tensor(sizes, dtype=torch.int64, device=dev)
    )
    return per_bag, [sum(sizes[:f]) for f in range(T)]


class KeyTables(NamedTuple):
    """What a KJT's key order fixes (device tensors, cached per order)."""

    sf_key: torch.Tensor
    """[S] the key index of each shard-feature."""
    sf_keys: tuple[int, ...]
    """The same, on the host."""
    cover_key: torch.Tensor
    """[K] how many ids each valid id of a key becomes (a name two tables share: both)."""
    feat_key: torch.Tensor
    """[T] the key index of each config feature."""
    grid: torch.Tensor | None
    """The Triton bucketize's launch grid (``ops.bucketize.bucketize_grid``), or None."""
    grid_cover: torch.Tensor | None
    """Its in-kernel check's cover per grid row (``ops.bucketize.grid_cover``), or None."""


class InputDist:
    """The input dist of one rank, fixed by the plan: static index tensors on the device,
    built once; per KJT key order a few more, cached.

    Args:
        layout: the plan's shard-features.
        rank: this rank.
        device: where the ids are.
        group_sizes: shard-features of each local TBE group, in order.
        dedup: deduplicate ids per destination (see the module docstring).
        backend: what runs the bucketize and the receive side's ops (``ops.backend``).
    """

    def __init__(self, layout: ShardLayout, rank: int, device, group_sizes: list[int], *,
                 dedup: bool = False, backend: str = "auto") -> None:
        self.layout, self.rank, self.device, self.dedup = layout, rank, torch.device(device), dedup
        self.backend = backends.resolve(backend, self.device)
        R = layout.world_size
        self.n_sf = [len(q) for q in layout.local]  # shard-features per destination
        self.n_max = max(self.n_sf, default=0)
        # header columns: ids per shard-feature, [distinct ids per shard-feature,] bags per
        # shard-feature (its feature's batch size: B unless VBE), B, failed, VBE, weights
        # that require grad
        self.c_stride = self.n_max * (2 if dedup else 1)
        self.c_B = self.c_stride + self.n_max
        self.c_failed = self.c_B + 1
        self.c_vbe = self.c_B + 2
        self.c_grad = self.c_B + 3
        self.H = self.c_B + 4
        self.sfs = [sf for q in layout.local for sf in q]
        self.sf_start = [0]
        for n in self.n_sf:
            self.sf_start.append(self.sf_start[-1] + n)
        # ids travel as int32 to a rank whose shards all have fewer than 2**31 rows
        rows = [max((sf.row_end - sf.row_start for sf in q), default=0) for q in layout.local]
        self.id_dtype = [torch.int64 if E >= 2**31 else torch.int32 for E in rows]
        self.group_sizes = list(group_sizes)
        dev = self.device

        def tensor(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=dev)

        self.lo = tensor([sf.row_start for sf in self.sfs])
        self.hi = tensor([sf.row_end for sf in self.sfs])
        dest = [q for q, n in enumerate(self.n_sf) for _ in range(n)]
        self.dest = tensor(dest)
        self.hdr_pos = tensor([q * self.H + i for q, n in enumerate(self.n_sf) for i in range(n)])
        # every valid id of feature f lands in ``cover[f]`` shard-features: one row block per
        # column slice (R for a data-parallel table); an out-of-range id lands in none
        cover = [0] * len(layout.feature_names)
        for sf in self.sfs:
            cover[sf.feature] += sf.row_end - sf.row_start
        self.cover = [c // layout.table_rows[layout.feature_table[f]] for f, c in enumerate(cover)]
        per_name: dict[str, int] = {}  # a feature name two tables share: its ids go to both
        for f, name in enumerate(layout.feature_names):
            per_name[name] = per_name.get(name, 0) + self.cover[f]
        self.max_cover = max(per_name.values(), default=1)
        """The most shard-features one id of a KJT key lands in (the bound on the ids sent)."""
        self._per_keys: dict[tuple[str, ...], KeyTables] = {}
        self.world = R
        self.weighted = False

    # -- shared by both modes ---------------------------------------------------------------
    def tables_for(self, keys: tuple[str, ...]) -> KeyTables:
        """The per-key tables for a KJT with ``keys`` in this order (cached)."""
        if keys not in self._per_keys:
            key_of = [keys.index(f) for f in self.layout.feature_names]
            cover_key = [0] * len(keys)
            for f, k in enumerate(key_of):
                cover_key[k] += self.cover[f]
            sf_key = [key_of[sf.feature] for sf in self.sfs]
            grid = ops.bucketize_grid(sf_key, self.device, self.backend)

            def tensor(values):
                return torch.tensor(values, dtype=torch.int64, device=self.device)

            self._per_keys[keys] = KeyTables(
                tensor(sf_key), tuple(sf_key), tensor(cover_key), tensor(key_of), grid,
                ops.grid_cover(grid, cover_key, self.device),
            )
        return self._per_keys[keys]

    def bag_offsets(self, parts: KJTParts) -> torch.Tensor:
        """[K*B+1] int64 offsets of the KJT's bags (its lengths, summed)."""
        offsets = torch.zeros(len(parts.keys) * parts.batch_size + 1, dtype=torch.int64,
                              device=self.device)
        torch.cumsum(parts.lengths, 0, out=offsets[1:])
        return offsets

    def bad_batch(self, parts: KJTParts, lengths: torch.Tensor, bad_lengths: torch.Tensor):
        """The device flag of a batch whose ids do not all land where they should: a valid id
        lands in exactly ``cover`` shard-features and an id outside its table in none, so the
        bucketized lengths add up to ``cover`` x the bag lengths iff every id is valid."""
        K, B = len(parts.keys), parts.batch_size
        expected = (parts.lengths.view(K, B).sum(1) * self.tables_for(parts.keys).cover_key).sum()
        return bad_lengths | (lengths.sum() != expected) | self.bad_weights(parts)

    def bad_weights(self, parts: KJTParts) -> torch.Tensor:
        """The device flag of a NaN/inf per-sample weight on an id some table reads (keys no
        table uses, cover 0, and values past the bags are not looked at)."""
        w = parts.weights
        if w is None or w.numel() == 0 or parts.batch_size == 0:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        K, B = len(parts.keys), parts.batch_size
        ends = torch.cumsum(parts.lengths.view(K, B).sum(1), 0)
        key = torch.searchsorted(ends, torch.arange(w.numel(), device=w.device), right=True)
        used = torch.zeros(K + 1, dtype=torch.bool, device=self.device)
        used[:K] = self.tables_for(parts.keys).cover_key > 0
        return (~torch.isfinite(w) & used[key]).any()

    def bad_inverse(self, parts: KJTParts) -> torch.Tensor:
        """The device flag of a VBE batch whose inverse indices point outside a feature's
        bags (False for a fixed batch)."""
        if parts.inverse is None or parts.inverse.numel() == 0:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        strides = torch.tensor(parts.strides, dtype=torch.int64, device=self.device)
        bags = strides.index_select(0, self.tables_for(parts.keys).feat_key)[:, None]
        inv = parts.inverse.to(self.device)
        return ((inv < 0) | (inv >= bags)).any()

    def parts(self, features, weighted: bool) -> KJTParts:
        """The KJT's parts (``sparse.kjt_parts``; a batch size per feature: ``vbe_kjt_parts``,
        lengths padded to the largest)."""
        if features.variable_stride_per_key():
            return vbe_kjt_parts(features, self.layout.feature_names, weighted)
        return kjt_parts(features, self.layout.feature_names, weighted)

    def own_strides(self, parts: KJTParts) -> list[int]:
        """Bags of each config feature in this rank's batch (B unless VBE)."""
        if parts.strides is None:
            return [parts.batch_size] * len(self.layout.feature_names)
        key_of = [parts.keys.index(f) for f in self.layout.feature_names]
        return [parts.strides[k] for k in key_of]

    def own_lengths(self, parts: KJTParts) -> torch.Tensor:
        """[T, B] this rank's bag lengths in config feature order (MEAN divides by them)."""
        own = parts.lengths.view(len(parts.keys), parts.batch_size)
        if parts.keys == tuple(self.layout.feature_names):
            return own
        return own.index_select(0, self.tables_for(parts.keys).feat_key)

    def explain(self, features, weighted: bool) -> Exception:
        """The error in ``features`` that this rank's device check found: the slow, exact
        check (a ValueError or IndexError naming the feature, id and bound), or a
        RuntimeError if it finds none."""
        try:
            if features.variable_stride_per_key():
                batch, rows = vbe_kjt_to_batch(features, self.layout.feature_names, weighted)
                if rows is not None:
                    check_inverse_bounds(rows, self.layout.feature_names, batch.batch_sizes)
            else:
                batch = kjt_to_batch(features, self.layout.feature_names, weighted)
            check_ids(batch, self.layout)
            check_weights(batch, self.layout)
        except (IndexError, ValueError) as e:
            return e
        return RuntimeError("input dist: the device check failed but no bad id was found")

    # -- sender -----------------------------------------------------------------------------
    def _bucketize(self, parts: KJTParts):
        """(lengths [S*B], ids destination-major, weights, failed flag on the device)."""
        keyed = self.tables_for(parts.keys)
        B, N = parts.batch_size, parts.values.numel()
        offsets = self.bag_offsets(parts)
        bad_lengths = (offsets[-1] != N) | (parts.lengths < 0).any()  # explain() names it
        if B == 0 or not self.sfs:
            ids = parts.values.new_zeros(0).to(torch.int64)
            w = parts.weights.new_zeros(0) if parts.weights is not None else None
            lengths = torch.zeros(len(self.sfs) * B, dtype=torch.int64, device=self.device)
            return lengths, ids, w, bad_lengths
        # without dedup the ids buffer is sized by a bound (each id lands in at most
        # max_cover shards) instead of a sync; the header's counts say how much is used
        lengths, ids, w = ops.bucketize(
            parts.values, offsets, parts.weights, keyed.sf_key, self.lo, self.hi, B,
            backend=self.backend, capacity=None if self.dedup else N * self.max_cover,
            grid=keyed.grid,
        )
        return lengths, ids, w, self.bad_batch(parts, lengths, bad_lengths)

    def _unique(self, ids: torch.Tensor, per_sf: torch.Tensor):
        """Per shard-feature, its distinct ids (sorted) and each id's place among them,
        without a sync: (distinct values [M], of which the first ``sum(unique)`` are used,
        shard-feature after shard-feature; inverse [M]; distinct ids per shard-feature [S]).
        Ids are rebased rows of one shard (< 2**40)."""
        M, S = ids.numel(), len(self.sfs)
        sf = torch.repeat_interleave(
            torch.arange(S, device=ids.device), per_sf, output_size=M
        )
        sorted_key, perm = torch.sort((sf << 40) | ids)
        first = torch.ones(M, dtype=torch.bool, device=ids.device)
        first[1:] = sorted_key[1:] != sorted_key[:-1]
        group = torch.cumsum(first, 0) - 1
        values = torch.empty(M, dtype=torch.int64, device=ids.device)
        values[group] = sorted_key & ((1 << 40) - 1)
        sorted_sf = sorted_key >> 40
        unique = torch.zeros(S, dtype=torch.int64, device=ids.device)
        unique.index_add_(0, sorted_sf, first.to(torch.int64))
        start = torch.cumsum(unique, 0) - unique
        inverse = torch.empty(M, dtype=torch.int64, device=ids.device)
        inverse[perm] = group - start[sorted_sf]
        return values, inverse, unique

    def _exchange_header(self, features, weighted: bool, group):
        """Bucketize and swap headers: (the KJT's parts, the send side's tensors (lengths,
        ids, weights, distinct ids, inverse), the sent and received headers on the host, the
        received one on the device). Raises on every rank if some rank found bad input."""
        R, me = self.world, self.rank
        error, parts, sent = None, None, None
        try:
            parts = self.parts(features, weighted)
        except ValueError as e:  # tell the other ranks before raising
            error = e
        hdr = torch.zeros((R, self.H), dtype=torch.int64, device=self.device)
        if parts is not None:
            lengths, ids, w, failed = self._bucketize(parts)
            per_sf = lengths.view(len(self.sfs), parts.batch_size).sum(1)  # [S]
            hdr.view(-1).index_copy_(0, self.hdr_pos, per_sf)
            sf_strides = None
            if parts.strides is None:
                hdr[:, self.c_stride : self.c_B] = parts.batch_size
            else:  # VBE: each shard-feature's bags, and the inverse indices checked here
                keyed = self.tables_for(parts.keys)
                sf_strides = [parts.strides[k] for k in keyed.sf_keys]
                hdr.view(-1).index_copy_(0, self.hdr_pos + self.c_stride, torch.tensor(
                    sf_strides, dtype=torch.int64, device=self.device))
                hdr[:, self.c_vbe] = 1
                failed = failed | self.bad_inverse(parts)
            hdr[:, self.c_B] = parts.batch_size
            hdr[:, self.c_failed] = failed
            hdr[:, self.c_grad] = int(weights_need_grad(parts.weights))
            uniq = inverse = None
            if self.dedup and ids.numel():
                uniq, inverse, n_unique = self._unique(ids, per_sf)
                hdr.view(-1).index_copy_(0, self.hdr_pos + self.n_max, n_unique)
            sent = (lengths, ids, w, uniq, inverse, sf_strides)
        else:
            hdr[:, self.c_failed] = 1
        hdr_recv = torch.empty_like(hdr)
        dist.all_to_all_single(hdr_recv, hdr, group=group)
        sent_h, recv_h = torch.stack([hdr, hdr_recv]).tolist()  # the host sync (see above)
        bad = [r for r in range(R) if recv_h[r][self.c_failed]]
        if bad:
            if error is None and me in bad:
                error = self.explain(features, weighted)
            if error is not None:
                raise error
            raise RuntimeError(f"rank(s) {bad} found bad input in this batch (see their error)")
        return parts, sent, sent_h, recv_h, hdr_recv

    def _pack(self, sent, sent_h, B: int, weighted: bool):
        """The send buffer: one message per destination (``message``), and their layouts and
        (ids, first id, distinct ids, first distinct id) counts."""
        lengths, ids, w, uniq, inverse, sf_strides = sent
        if sf_strides is not None:  # VBE: only each shard-feature's real bags travel
            lengths = lengths.index_select(0, padding_positions(sf_strides, B, self.device))
        msgs, counts, id_start, u_start, l_start = [], [], 0, 0, [0]
        for q in range(self.world):
            count = sum(sent_h[q][: self.n_sf[q]])
            per_u = sent_h[q][self.n_max : self.n_max + self.n_sf[q]] if self.dedup else [0]
            unique = sum(per_u)
            n_lengths = sum(sent_h[q][self.c_stride : self.c_stride + self.n_sf[q]])
            msgs.append(message(n_lengths, count, unique, self.id_dtype[q], weighted,
                                self.dedup, max(per_u, default=0)))
            counts.append((count, id_start, unique, u_start))
            id_start += count
            u_start += unique
            l_start.append(l_start[-1] + n_lengths)
        buf = torch.empty(sum(m.nbytes for m in msgs), dtype=torch.uint8, device=self.device)
        base = 0
        for q, (msg, (count, a, unique, u)) in enumerate(zip(msgs, counts, strict=True)):
            pieces = {"lengths": lengths[l_start[q] : l_start[q + 1]], "ids": ids[a : a + count]}
            if "unique" in msg.pieces:
                pieces["unique"] = uniq[u : u + unique]
                pieces["inverse"] = inverse[a : a + count]
            if weighted:
                pieces["weights"] = w[a : a + count]
            for name, (_, _, n) in msg.pieces.items():
                if n:
                    msg.piece(buf, base, name).copy_(pieces[name])
            base += msg.nbytes
        return buf, msgs, counts

    def _receive_layouts(self, recv_h, sizes: list[int], weighted: bool) -> list[Message]:
        """The layout of each source's message to this rank, from the received header."""
        n_local, msgs = self.n_sf[self.rank], []
        for r in range(self.world):
            count = sum(recv_h[r][:n_local])
            per_u = recv_h[r][self.n_max : self.n_max + n_local] if self.dedup else [0]
            n_lengths = sum(recv_h[r][self.c_stride : self.c_stride + n_local])
            msgs.append(message(n_lengths, count, sum(per_u), self.id_dtype[self.rank],
                                weighted, self.dedup, max(per_u, default=0)))
        return msgs

    # -- the step ---------------------------------------------------------------------------
    def __call__(self, features, weighted: bool, group=None) -> InputDistOut:
        self.weighted = weighted
        parts, sent, sent_h, recv_h, hdr_recv = self._exchange_header(features, weighted, group)
        R, me = self.world, self.rank
        sizes = [recv_h[r][self.c_B] for r in range(R)]
        # weights that require grad on some rank travel in an all-to-all of their own, with
        # autograd (``weights_with_grad``); every rank learnt that from the header
        grad_w = parts.weights is not None and any(recv_h[r][self.c_grad] for r in range(R))
        weighted_wire = parts.weights is not None and not grad_w
        sendbuf, send_msgs, sends = self._pack(sent, sent_h, sizes[me], weighted_wire)
        recv_msgs = self._receive_layouts(recv_h, sizes, weighted_wire)
        recvbuf = torch.empty(sum(m.nbytes for m in recv_msgs), dtype=torch.uint8,
                              device=self.device)
        dist.all_to_all_single(
            recvbuf, sendbuf, [m.nbytes for m in recv_msgs], [m.nbytes for m in send_msgs],
            group=group,
        )
        lookup = self._unpack(recvbuf, recv_msgs, recv_h, hdr_recv, sizes, weighted_wire)
        if grad_w:
            lookup = dataclasses.replace(lookup, per_sample_weights=weights_with_grad(
                self, parts, sent_h, recv_h, hdr_recv, group))
        vbe = self.vbe_step(parts, recv_h)

        others = [q for q in range(R) if q != me]
        n_local = self.n_sf[me]
        hdr_bytes = 8 * self.H * len(others)
        own = self.own_lengths(parts)
        stats = self.stats(
            traffic={
                "input_dist.header": (hdr_bytes, hdr_bytes),
                "input_dist.data": (sum(send_msgs[q].nbytes for q in others),
                                    sum(recv_msgs[r].nbytes for r in others)),
            },
            ids=(sum(sends[q][0] for q in others),
                 sum(sum(recv_h[r][:n_local]) for r in others)),
            without_dedup=(sum(send_msgs[q].raw_bytes for q in others),
                           sum(recv_msgs[r].raw_bytes for r in others)),
            batch_sizes=sizes,
            per_feature=own.sum(1),  # device; read by comm_report only
            B=sizes[me],
            strides=vbe.strides if vbe is not None else None,
        )
        counts = {
            "received": tuple(tuple(recv_h[r][:n_local]) for r in range(R)),
            "sent": tuple(tuple(sent_h[q][: self.n_sf[q]]) for q in range(R)),
        }
        return InputDistOut(own, dataclasses.replace(lookup, stats=stats, **counts), sizes, vbe)

    def vbe_step(self, parts: KJTParts, recv_h) -> VBEStep | None:
        """The step's ``VBEStep`` if some rank's batch has a batch size per feature (every
        rank got every rank's header, so all agree), else None."""
        R, me = self.world, self.rank
        if not any(recv_h[r][self.c_vbe] for r in range(R)):
            return None
        T = len(self.layout.feature_names)
        strides = [[-1] * T for _ in range(R)]
        for r in range(R):
            for i, sf in enumerate(self.layout.local[me]):
                strides[r][sf.feature] = recv_h[r][self.c_stride + i]
        strides[me] = self.own_strides(parts)
        return VBEStep(tuple(map(tuple, strides)), parts.inverse)

    @staticmethod
    def stats(*, traffic: dict, ids, without_dedup, batch_sizes: list[int], per_feature,
              B: int, strides=None) -> dict:
        """What ``comm_report`` reads of a step: bytes per collective (sent, received), ids
        sent and received, the data bytes without dedup, every rank's batch size, the ids
        per feature of this rank's batch and its size ``B``. ``ids`` and ``per_feature`` may
        be functions that compute them (read only when a report asks). ``strides``: a VBE
        step's ``VBEStep.strides``."""
        return {"traffic": traffic, "ids": ids, "without_dedup": without_dedup,
                "batch_sizes": batch_sizes, "per_feature": per_feature, "B": B,
                "strides": strides}

    # -- receiver ---------------------------------------------------------------------------
    def feature_major(self, hdr_recv: torch.Tensor, n: int) -> torch.Tensor | None:
        """The gather that reorders the ``n`` received ids from rank-major ``[r][sf][b]`` to
        feature-major ``[sf][r][b]`` (from the header on the device), or None when they are
        in that order already."""
        R, n_local = self.world, self.n_sf[self.rank]
        if R == 1 or n_local <= 1 or not n:
            return None
        seg = hdr_recv[:, :n_local]  # [R, n_local] ids per (source rank, shard-feature)
        flat = seg.reshape(-1)
        old_start = (torch.cumsum(flat, 0) - flat).view(R, n_local).t().reshape(-1)
        new_sizes = seg.t().reshape(-1)
        new_start = torch.cumsum(new_sizes, 0) - new_sizes
        return torch.arange(n, device=self.device) + torch.repeat_interleave(
            old_start - new_start, new_sizes, output_size=n
        )

    def _unpack(self, buf, msgs, recv_h, hdr_recv, sizes, weighted) -> LookupBatch:
        R, n_local, dev = self.world, self.n_sf[self.rank], self.device
        lens, ids, ws, base = [], [], [], 0
        for r, msg in enumerate(msgs):
            got = msg.piece(buf, base, "lengths")
            if got.numel() != n_local * sizes[r]:  # VBE: padded back to the source's batch
                strides = recv_h[r][self.c_stride : self.c_stride + n_local]
                at = padding_positions(strides, sizes[r], dev)
                got = got.new_zeros(n_local * sizes[r]).index_copy_(0, at, got)
            lens.append(got.view(n_local, sizes[r]))
            if "unique" in msg.pieces:
                # each id's place among its shard-feature's distinct ids, plus where those
                # start in the message (from the header on the device)
                counts, distinct = hdr_recv[r, :n_local], hdr_recv[r, self.n_max :][:n_local]
                start = torch.repeat_interleave(
                    torch.cumsum(distinct, 0) - distinct, counts,
                    output_size=msg.pieces["inverse"][2],
                )
                inverse = msg.piece(buf, base, "inverse")
                inv = inverse.to(torch.int64)
                if inverse.dtype == torch.int16:
                    inv &= 0xFFFF  # 16 bits, read unsigned (up to 65,536 distinct ids)
                ids.append(msg.piece(buf, base, "unique").index_select(0, inv + start))
            else:
                ids.append(msg.piece(buf, base, "ids"))
            if weighted:
                ws.append(msg.piece(buf, base, "weights"))
            base += msg.nbytes
        B_global = sum(sizes)
        lengths = torch.cat(lens, dim=1) if lens else torch.zeros((0, B_global), device=dev)
        indices = torch.cat(ids).to(torch.int64)
        weights = torch.cat(ws) if weighted else None
        gather = self.feature_major(hdr_recv, indices.numel())
        if gather is not None:
            indices = indices[gather]
            weights = weights[gather] if weights is not None else None
        offsets = torch.zeros(n_local * B_global + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths.reshape(-1), 0, dtype=torch.int64, out=offsets[1:])
        per_sf = [sum(recv_h[r][i] for r in range(R)) for i in range(n_local)]
        bounds, first = [0], 0
        for g in self.group_sizes:
            bounds.append(bounds[-1] + sum(per_sf[first : first + g]))
            first += g
        return LookupBatch(
            indices=indices, offsets=offsets, per_sample_weights=weights, batch_size=B_global,
            id_bounds=tuple(bounds),
        )

