"""Output dist: pooled blocks back to the ranks that own the samples, added into place.

Rank q's lookup output ``[B_global, W_q]`` holds, per shard-feature, a partial pooled block for
every sample of the global batch. Two all-to-alls of column blocks (one mechanism,
``BlockExchange``) bring them home:

1. inside each host, table-row-wise and grid shard-features only: every holder of a slice
   sends each other holder the rows of the destinations that holder is responsible for
   (``ShardLayout.responsible``) and adds what it receives into its own partial, a
   reduce-scatter over the global batch (uneven batch sizes included);
2. across all ranks: q sends rank r the rows of r's samples for each of its shard-features
   (an in-host one only if q is responsible for r), and r adds each column block into the
   feature's columns: a sum over row shards, side by side for column shards, the bytes of a
   reduce-scatter for row-wise, one block per destination for a table-row-wise slice.

Data-parallel shard-features never travel: every rank computed them for the global batch and
keeps its own rows. Backward is autograd's: index_add -> gather, all-to-all -> reverse
all-to-all (step 1's: an all-gather of the gradient rows inside the host), own rows ->
all-gather.

A VBE step (``strides`` given, ``input_dist.VBEStep``): every rank's rows are its padded
batch P_r, but a block carries only feature f's first ``strides[r][f]`` rows of it (column
run by column run of one feature, row-major inside), so the wire holds each feature's
deduplicated rows; the receiver expands them afterwards.
"""

from dataclasses import dataclass
from itertools import accumulate

import torch

from fbtriton_dist.sharding.comm.collectives import all_to_all, exchange_sum, own_rows
from fbtriton_dist.sharding.comm.wire import Rows, wire_all_to_all, wire_formats
from fbtriton_dist.sharding.dist.layout import ShardLayout


@dataclass(frozen=True)
class Block:
    """The rows of ``dest``'s samples, columns ``src`` of the sender's input, added into
    columns ``dst`` of the receiver's target."""

    dest: int
    src: tuple[int, ...]
    dst: tuple[int, ...]
    features: tuple[int, ...] = ()
    """The feature of each column (a VBE step sends each feature's own rows)."""
    segments: tuple[int, ...] = ()
    """The columns of each shard-feature in the block, in order: the rows an 8-bit wire
    scales one by one (empty: the whole block row is one)."""

    def widths(self) -> tuple[int, ...]:
        return self.segments or (len(self.src),)

    def shard_of_column(self) -> list[int]:
        return [i for i, w in enumerate(self.widths()) for _ in range(w)]


class BlockExchange:
    """One all-to-all of column blocks within ``peers`` (a process group, in its rank order):
    ``send[i]`` / ``recv[i]`` are the blocks this rank sends to / receives from ``peers[i]``,
    ``widths`` the columns of the input and of the target. A block's rows are ``dest``'s samples
    in the global batch on the sending side, and on the receiving side too if ``global_rows``
    (else the receiver's own batch, rows 0..B)."""

    def __init__(self, peers, send, recv, widths, global_rows, device, wire=None) -> None:
        self.peers, self.send, self.recv = list(peers), send, recv
        self.widths, self.global_rows, self.device = widths, global_rows, device
        self.formats = wire_formats(wire)  # (forward, backward) ``WireFormat``s
        fwd, bwd = self.formats
        # one unscaled format both ways: a cast (autograd casts the gradient the same way)
        self.cast_only = fwd == bwd and not fwd.scaled
        self.wire_dtype = fwd.dtype if self.cast_only and fwd.name != "fp32" else None
        self._rows_cache: dict = {}
        self._cached = (None, None)  # (batch sizes, flat indices): a step repeats its sizes
        self._slice_cache: dict = {}
        self._vbe_cut = None  # the pieces a VBE step cuts the blocks into (``_feature_pieces``)

    @staticmethod
    def _feature_pieces(blocks) -> list[list[tuple[int, int, int, int, int]]]:
        """Per peer, the pieces a VBE step cuts its blocks into: ``(destination, feature, source
        column, target column, columns)`` for each run of one shard-feature's columns where
        source and target columns both go up by one (both sides cut a block the same way)."""
        out = []
        for per_peer in blocks:
            pieces = []
            for b in per_peer:
                start, shard = 0, b.shard_of_column()
                for i in range(1, len(b.features) + 1):
                    if i < len(b.features) and b.features[i] == b.features[start] and (
                        shard[i] == shard[start]
                    ):
                        continue
                    pieces += [(b.dest, b.features[start], a, c, k) for a, c, k in
                               _runs(b.src[start:i], b.dst[start:i])]
                    start = i
            out.append(pieces)
        return out

    def _vbe_static(self):
        if self._vbe_cut is None:
            self._vbe_cut = (self._feature_pieces(self.send), self._feature_pieces(self.recv))
        return self._vbe_cut

    def elements(self, batch_sizes: list[int], strides=None) -> tuple[list[int], list[int]]:
        """Values sent to / received from each peer (``strides``: a VBE step's)."""
        if strides is not None:
            return tuple([sum(strides[d][f] * k for d, f, _, _, k in peer) for peer in side]
                         for side in self._vbe_static())
        count = [[sum(batch_sizes[b.dest] * len(b.src) for b in bl) for bl in side]
                 for side in (self.send, self.recv)]
        return count[0], count[1]

    def rows(self, batch_sizes: list[int], strides=None) -> tuple[Rows, Rows]:
        """The rows (one sample's columns of one shard-feature) sent to / received from each
        peer, as the wire formats scale them; a VBE step's: each feature's rows at its
        stride, in the merged pieces' order (``_merged``)."""
        if strides is not None:
            return tuple(Rows([[(m, w) for _, m, _, _, _, w in _merged(peer, strides)]
                               for peer in side], self.device) for side in self._vbe_static())
        key = tuple(batch_sizes)
        if key not in self._rows_cache:
            self._rows_cache[key] = tuple(
                Rows([[(batch_sizes[b.dest], b.widths()) for b in bl] for bl in side],
                     self.device) for side in (self.send, self.recv))
        return self._rows_cache[key]

    def _exchange(self, values, send_n, recv_n, group, batch_sizes, strides=None):
        """``values`` (fp32, flat) on the wire: received values, fp32."""
        if self.cast_only:
            if self.wire_dtype is not None:  # backward: the gradient is cast the same way
                values = values.to(self.wire_dtype)
            return all_to_all(values, send_n, recv_n, group).float()
        send, recv = self.rows(batch_sizes, strides)
        return wire_all_to_all(values, send, recv, self.formats, group)

    def _flat(self, blocks, batch_sizes, width, global_rows, receiving):
        """Flat indices (row * width + column) of every block's values, peer by peer."""
        starts = [0, *accumulate(batch_sizes)]
        parts = [torch.zeros(0, dtype=torch.int64)]
        for b in (b for per_peer in blocks for b in per_peer):
            rows = torch.arange(batch_sizes[b.dest]) + (starts[b.dest] if global_rows else 0)
            cols = torch.tensor(b.dst if receiving else b.src, dtype=torch.int64)
            parts.append((rows[:, None] * width + cols[None, :]).flatten())
        return torch.cat(parts).to(self.device)

    def _indices(self, batch_sizes: list[int]):
        if self._cached[0] != batch_sizes:
            send = self._flat(self.send, batch_sizes, self.widths[0], True, False)
            recv = self._flat(self.recv, batch_sizes, self.widths[1], self.global_rows, True)
            self._cached = (list(batch_sizes), (send, recv, *self.elements(batch_sizes)))
        return self._cached[1]

    def _vbe(self, x, target, batch_sizes, strides, group, rows: int) -> torch.Tensor:
        """The exchange of a VBE step: each feature's rows at its stride, as 2-D slices
        ``(first row, rows, first column, columns)``; no per-value index (the strides change
        from batch to batch)."""
        starts = [0, *accumulate(batch_sizes)]
        send_cut, recv_cut = self._vbe_static()
        send = [[(starts[d], m, a, k) for d, m, a, _, k, _ in _merged(peer, strides)]
                for peer in send_cut]
        g = self.global_rows
        recv = [[(starts[d] if g else 0, m, c, k) for d, m, _, c, k, _ in
                 _merged(peer, strides)] for peer in recv_cut]
        values = _TakePieces.apply(x, [p for peer in send for p in peer])
        send_n = [sum(m * k for _, m, _, k in peer) for peer in send]
        recv_n = [sum(m * k for _, m, _, k in peer) for peer in recv]
        got = self._exchange(values, send_n, recv_n, group, batch_sizes, strides)
        B, width = target.shape if target is not None else (rows, self.widths[1])
        dtype = target.dtype if target is not None else x.dtype
        out = _PlacePieces.apply(got.to(dtype), [p for peer in recv for p in peer], B, width)
        return out if target is None else target + out

    def _slices(self, batch_sizes: list[int]):
        """The exchange as 2-D slices where every block is a few runs of consecutive columns:
        (send [[(row0, row1, col0, col1) per source run] per block], recv {(col0, col1):
        [(offset, rows, block width, first column in the block)]}, values sent / received per
        peer, whether the blocks sent are the input's rows in order with every column); None
        where that does not pay (then flat indices). A block travels row-major,
        ``[rows, len(src)]``, as on the flat path."""
        key = tuple(batch_sizes)
        if key in self._slice_cache:
            return self._slice_cache[key]
        starts = [0, *accumulate(batch_sizes)]
        send, recv, blocks, offset = [], {}, [], 0
        for b in (b for per_peer in self.send for b in per_peer):
            r0, r1 = starts[b.dest], starts[b.dest] + batch_sizes[b.dest]
            send.append([(r0, r1, a, a + n) for a, _, n in _runs(b.src, range(len(b.src)))])
        for b in (b for per_peer in self.recv for b in per_peer):
            n_rows, k = batch_sizes[b.dest], len(b.dst)
            runs = _runs(range(k), b.dst)
            for i, c, n in runs:
                recv.setdefault((c, c + n), []).append((offset, n_rows, k, i))
            blocks.append((offset, n_rows, k, [(i, c, n) for i, c, n in runs]))
            offset += n_rows * k
        ranges = sorted(recv)
        runs = [r for block in send for r in block if r[1] > r[0]]
        whole = all(a == 0 and b == self.widths[0] for _, _, a, b in runs) and all(
            r0 == (runs[i - 1][1] if i else 0) for i, (r0, *_) in enumerate(runs)
        ) and (runs[-1][1] if runs else 0) == starts[-1]
        placed = ([(c0, c1, recv[(c0, c1)]) for c0, c1 in ranges], blocks)
        summed = whole and self._sums_rows(send, recv, batch_sizes)
        plan = (send, placed, *self.elements(batch_sizes), whole, summed)
        pieces = len(runs) + sum(len(v) for v in recv.values())
        if not send or not recv or self.global_rows or pieces > 64 * len(self.peers) or any(
            a[1] > b[0] for a, b in zip(ranges, ranges[1:], strict=False)
        ):
            # nothing to send or receive (the flat path keeps autograd reaching the
            # collective), overlapping column ranges, rows placed by the global batch, or many
            plan = None
        self._slice_cache[key] = plan
        return plan

    def _sums_rows(self, send, recv, batch_sizes) -> bool:
        """Row-wise: every rank sends every rank (in rank order) its rows of all its columns,
        and the receiver adds them over its full width (the widths agree): then the exchange
        is one ``exchange_sum``, without placement."""
        R, W = len(self.peers), self.widths[0]
        if self.peers != list(range(R)) or W != self.widths[1] or len(send) != R:
            return False
        starts = [0, *accumulate(batch_sizes)]
        if any(blk != [(starts[q], starts[q + 1], 0, W)] for q, blk in enumerate(send)):
            return False
        parts = recv.get((0, W), [])
        if list(recv) != [(0, W)] or len(parts) != R:
            return False
        n = parts[0][1]
        return all(p == (j * n * W, n, W, 0) for j, p in enumerate(parts))

    def _sliced(self, x, target, plan, group, rows: int, batch_sizes) -> torch.Tensor:
        send, recv, send_n, recv_n, whole, summed = plan
        if summed and self.cast_only:
            out = exchange_sum(x, self._row_splits(send), self.wire_dtype, group)
            return out if target is None else target + out
        if whole:  # the blocks are x's rows in order (row-wise): send x as it is
            values = x.reshape(-1)
        else:
            blocks = []
            for block in send:
                parts = [x[r0:r1, a:b] for r0, r1, a, b in block]
                blocks.append((parts[0] if len(parts) == 1 else torch.cat(parts, 1)).reshape(-1))
            values = torch.cat(blocks) if len(blocks) != 1 else blocks[0]
        got = self._exchange(values, send_n, recv_n, group, batch_sizes)
        B, out_width = target.shape if target is not None else (rows, self.widths[1])
        dtype = target.dtype if target is not None else x.dtype
        out = _Place.apply(got.to(dtype), recv, B, out_width)
        return out if target is None else target + out

    @staticmethod
    def _row_splits(send) -> list[int]:
        return [blk[0][1] - blk[0][0] for blk in send]

    def __call__(self, x, target, batch_sizes: list[int], group=None, rows: int = 0,
                 strides=None):
        """``target`` plus the blocks of ``x`` that every peer sent this rank (``target`` None:
        zeros of ``rows`` rows by the receiving width). ``strides``: a VBE step's rows per
        (rank, feature) (``input_dist.VBEStep.strides``)."""
        if strides is not None:
            return self._vbe(x, target, batch_sizes, strides, group, rows)
        plan = self._slices(batch_sizes)
        if plan is not None:
            return self._sliced(x, target, plan, group, rows, batch_sizes)
        if target is None:
            target = x.new_zeros((rows, self.widths[1]))
        send_idx, recv_idx, send_n, recv_n = self._indices(batch_sizes)
        values = x.reshape(-1).index_select(0, send_idx)
        got = self._exchange(values, send_n, recv_n, group, batch_sizes).to(target.dtype)
        return target.reshape(-1).index_add(0, recv_idx, got).view(target.shape)


class _Place(torch.autograd.Function):
    """Column runs of the received row-major blocks put in their columns of a ``[B, width]``
    output (summed where several land on the same columns, zeros where none does). Backward
    cuts each block's gradient out of the output's with one concatenation per block: autograd
    of the slices would build a zero block per run and add them up."""

    @staticmethod
    def forward(ctx, got, placed, B, width):
        ranges, blocks = placed
        ctx.blocks, ctx.shape = blocks, got.shape
        cols, at = [], 0
        for c0, c1, parts in ranges:
            w = c1 - c0
            if c0 > at:
                cols.append(got.new_zeros((B, c0 - at)))
            (o0, n, _, _), count = parts[0], len(parts)
            if all(o == o0 + j * n * w and m == n and k == w for j, (o, m, k, _) in
                   enumerate(parts)):
                # whole blocks evenly spaced (row-wise: one partial per rank): one reduction
                block = got[o0 : o0 + count * n * w].view(count, n, w)
                cols.append(block[0] if count == 1 else block.sum(0))
            else:
                pieces = [got[o : o + m * k].view(m, k)[:, i : i + w] for o, m, k, i in parts]
                cols.append(pieces[0] if count == 1 else torch.stack(pieces).sum(0))
            at = c1
        if at < width:
            cols.append(got.new_zeros((B, width - at)))
        if len(cols) > 1:
            return torch.cat(cols, dim=1)
        # a view of ``got`` must be copied out of it (autograd); a sum is already new
        return cols[0] if cols[0]._base is None and cols[0] is not got else cols[0].clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty(ctx.shape)
        for o, m, k, runs in ctx.blocks:
            dst = out[o : o + m * k].view(m, k)
            pieces = [grad[:, c : c + n] for _, c, n in runs]  # in the block's column order
            if len(pieces) == 1:
                dst.copy_(pieces[0])
            else:
                torch.cat(pieces, dim=1, out=dst)
        return out, None, None, None


def _merged(pieces, strides) -> list[tuple[int, int, int, int, int, tuple[int, ...]]]:
    """A VBE step's pieces of one peer as ``(destination, rows, source column, target column,
    columns, widths of the pieces merged)``, empty ones dropped and neighbours merged where
    the rows agree and both column ranges continue (the features of one stride side by side
    travel as one slice); both sides see the same pieces and strides, so they merge alike."""
    out: list[list] = []
    for d, f, a, c, k in pieces:
        m = strides[d][f]
        if m <= 0:
            continue
        if out and out[-1][0] == d and out[-1][1] == m and out[-1][2] + out[-1][4] == a and (
            out[-1][3] + out[-1][4] == c
        ):
            out[-1][4] += k
            out[-1][5] += (k,)
        else:
            out.append([d, m, a, c, k, (k,)])
    return [tuple(p) for p in out]


class _TakePieces(torch.autograd.Function):
    """The pieces ``(first row, rows, first column, columns)`` of ``x``, row-major, back to
    back (a VBE step's send buffer); backward puts their gradients in one zero ``x``-sized
    tensor (autograd of the slices would build a full-size zero tensor per piece)."""

    @staticmethod
    def forward(ctx, x, pieces):
        ctx.pieces, ctx.shape = pieces, x.shape
        parts = [x[r0 : r0 + m, a : a + k].reshape(-1) for r0, m, a, k in pieces]
        return torch.cat(parts) if parts else x.new_zeros(0)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros(ctx.shape)
        at = 0
        for r0, m, a, k in ctx.pieces:
            out[r0 : r0 + m, a : a + k] += grad[at : at + m * k].view(m, k)  # (may overlap)
            at += m * k
        return out, None


class _PlacePieces(torch.autograd.Function):
    """Row-major pieces ``(first row, rows, first column, columns)``, back to back in ``got``,
    added into a zero ``[B, width]`` output (a VBE step); backward cuts each piece's gradient
    out of the output's, in one concatenation."""

    @staticmethod
    def forward(ctx, got, pieces, B, width):
        ctx.pieces = pieces
        out = got.new_zeros((B, width))
        at = 0
        for r0, m, c, k in pieces:
            out[r0 : r0 + m, c : c + k] += got[at : at + m * k].view(m, k)
            at += m * k
        return out

    @staticmethod
    def backward(ctx, grad):
        parts = [grad[r0 : r0 + m, c : c + k].reshape(-1) for r0, m, c, k in ctx.pieces]
        got = torch.cat(parts) if parts else grad.new_zeros(0)
        return got, None, None, None


def _runs(src, dst) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` of the runs where both column lists go up by one."""
    out = []
    for i, (a, c) in enumerate(zip(src, dst, strict=True)):
        if out and i and a == src[i - 1] + 1 and c == dst[i - 1] + 1:
            out[-1][2] += 1
        else:
            out.append([a, c, 1])
    return [tuple(r) for r in out]


def host_blocks(layout: ShardLayout, q: int, p: int) -> list[Block]:
    """Step 1, holder ``q`` to holder ``p`` of its host: per destination ``p`` is responsible
    for, q's rows of that destination's samples for the in-host slices both hold."""
    if q == p:  # a holder's own partial is already in place
        return []
    starts_q, starts_p = layout.local_columns(q), layout.local_columns(p)
    at_p = {}  # slice -> p's (first) shard-feature of it
    for j, sf in enumerate(layout.local[p]):
        at_p.setdefault(sf.slice_key, j)
    blocks = []
    for dest in range(layout.world_size):
        src, dst, features, segments = [], [], [], []
        for i, sf in enumerate(layout.local[q]):
            if sf.in_host and layout.responsible(sf, dest) == p:
                j = at_p[sf.slice_key]
                src += range(starts_q[i], starts_q[i] + sf.dim)
                dst += range(starts_p[j], starts_p[j] + sf.dim)
                features += [sf.feature] * sf.dim
                segments.append(sf.dim)
        if src:
            blocks.append(Block(dest, tuple(src), tuple(dst), tuple(features), tuple(segments)))
    return blocks


def out_blocks(layout: ShardLayout, q: int, r: int) -> list[Block]:
    """Step 2, rank ``q`` to rank ``r``: r's rows of q's shard-features (an in-host one only if
    q is responsible for r), added into the feature's columns of r's pooled output."""
    starts = layout.local_columns(q)
    src, dst, features, segments = [], [], [], []
    for i, sf in enumerate(layout.local[q]):
        if sf.data_parallel or (sf.in_host and layout.responsible(sf, r) != q):
            continue
        src += range(starts[i], starts[i] + sf.dim)
        first = layout.feature_cols[sf.feature] + sf.col_start
        dst += range(first, first + sf.dim)
        features += [sf.feature] * sf.dim
        segments.append(sf.dim)
    return [Block(r, tuple(src), tuple(dst), tuple(features), tuple(segments))] if src else []


class OutputDist:
    """Both exchanges of one rank, fixed by the plan. ``wire``: the wire formats of the pooled
    blocks (forward) and their gradients (backward), a ``(forward, backward)`` pair of
    ``WireFormat``s or one format name / dtype for both (``comm.wire``; None: fp32); the
    receiver adds them in fp32. Data-parallel gradients stay exact."""

    def __init__(
        self, layout: ShardLayout, rank: int, device: torch.device, wire=None
    ) -> None:
        self.layout, self.rank = layout, rank
        self.formats = wire_formats(wire)
        R, me = layout.world_size, rank
        W = layout.local_columns(me)[-1]
        self.total_D = layout.feature_cols[-1]
        host = layout.host_ranks(me)
        self.host = BlockExchange(
            host,
            [host_blocks(layout, me, p) for p in host],
            [host_blocks(layout, p, me) for p in host],
            (W, W),
            True,
            device,
            self.formats,
        )
        self.has_host_step = any(sf.in_host for p in host for sf in layout.local[p])
        self.out = BlockExchange(
            range(R),
            [out_blocks(layout, me, r) for r in range(R)],
            [out_blocks(layout, q, me) for q in range(R)],
            (W, self.total_D),
            False,
            device,
            self.formats,
        )
        dp_src, dp_dst = layout.output_columns(rank, data_parallel=True)
        self.dp_src = torch.tensor(dp_src, dtype=torch.int64, device=device)
        self.dp_dst = torch.tensor(dp_dst, dtype=torch.int64, device=device)

    def _bytes(self, ex: BlockExchange, batch_sizes: list[int], keep,
               strides=None, backward: bool = False) -> tuple[int, int]:
        """Bytes (sent, received) of ``ex``'s forward to / from the peers ``keep`` picks (its
        backward's received / sent), values and row scales in the direction's format."""
        fmt = self.formats[int(backward)]
        rows = ex.rows(batch_sizes, strides) if fmt.scaled else None
        return tuple(
            sum(fmt.nbytes(n, rows[i].rows[j] if rows else 0)
                for j, (p, n) in enumerate(zip(ex.peers, side, strict=True)) if keep(p))
            for i, side in enumerate(ex.elements(batch_sizes, strides))
        )

    def traffic(self, batch_sizes: list[int], strides=None) -> dict[str, tuple[int, int]]:
        """Bytes (sent, received) to/from the other ranks per collective, backward included
        (it mirrors the forward), pooled values in the wire dtype (``strides``: a VBE
        step's)."""
        me, B = self.rank, batch_sizes[self.rank]
        other = lambda p: p != me  # noqa: E731
        host_sent, host_recv = self._bytes(self.host, batch_sizes, other, strides)
        host_back = self._bytes(self.host, batch_sizes, other, strides, backward=True)
        sent, recv = self._bytes(self.out, batch_sizes, other, strides)
        back_recv, back_sent = self._bytes(self.out, batch_sizes, other, strides, backward=True)
        others = [q for q in range(len(batch_sizes)) if q != me]
        dp = 4 * self.dp_src.numel()
        return {
            "output_dist.host_reduce_scatter": (host_sent, host_recv),
            "output_dist.host_all_gather": (host_back[1], host_back[0]),
            "output_dist.forward": (sent, recv),
            "output_dist.backward": (back_sent, back_recv),
            "data_parallel.grad_all_gather": (
                dp * B * len(others), dp * sum(batch_sizes[q] for q in others)
            ),
        }

    def inter_host(self, batch_sizes: list[int], strides=None,
                   backward: bool = False) -> tuple[int, int]:
        """Bytes (sent, received) of the forward output dist that cross hosts (``backward``:
        the same messages in the backward's format, so backward received / sent)."""
        H = self.layout.local_world_size
        return self._bytes(self.out, batch_sizes, lambda p: p // H != self.rank // H, strides,
                           backward)

    def __call__(
        self, local: torch.Tensor, batch_sizes: list[int], group=None, host_group=None,
        strides=None,
    ) -> torch.Tensor:
        """``local`` [sum(batch_sizes), W_rank] -> pooled ``[B_rank, sum(D)]`` (fp32, SUM).
        ``host_group``: the ranks of this rank's host (``ShardLayout.host_ranks``).
        ``strides``: a VBE step's rows per (rank, feature); each feature's rows past them
        stay zero."""
        # every rank of a group takes part in its exchanges (and, through autograd, in their
        # backward), even with nothing to send or receive: the output depends on what came back
        if self.has_host_step:
            local = self.host(local, local, batch_sizes, host_group, strides=strides)
        out = self.out(local, None, batch_sizes, group, rows=batch_sizes[self.rank],
                       strides=strides)
        if self.dp_src.numel():
            mine = own_rows(local.index_select(1, self.dp_src), batch_sizes, self.rank, group)
            out = out.index_add(1, self.dp_dst, mine)
        return out
