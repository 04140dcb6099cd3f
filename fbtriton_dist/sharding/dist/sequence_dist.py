"""Sequence output dist: every looked-up row back to the rank that sent its id, in the order
of that rank's KJT.

An EmbeddingCollection has no bags to pool, so nothing is summed on the way back: rank q's
lookup holds one row per id it received, shard-feature after shard-feature and, inside one,
source rank after source rank (the input dist's feature-major lookup batch), and the header
told both sides how many ids each (source, shard-feature) pair holds. One all-to-all of
values brings the rows home:

1. q sends rank r, for each of its shard-features (each the rows of one row block and one
   column slice of a feature's table), r's rows, ``[ids, columns]`` row-major, back to back;
2. r cuts what it receives into those blocks (it sent the ids: it knows their counts), and
   for each feature and column slice puts the blocks' rows back in its KJT's order. An id's
   row block is the shard whose rows hold it, and the bucketize kept the KJT's order inside
   each block, so the order is a stable sort of the ids by their row block (one per slice
   and step, shared by slices with the same row cuts); column slices are joined side by side.

Table-row-wise and grid shards are row blocks like any other here (no sum inside the host).
Data-parallel shard-features never travel: every rank looked up every rank's ids in its
replica and keeps its own rows; backward all-gathers their gradients, so every replica takes
the same update. Backward is autograd's: the gathers become scatters, the all-to-all sends
the gradient rows back to their owners.
"""

import torch

from fbtriton_dist.sharding.comm.collectives import all_to_all, own_rows
from fbtriton_dist.sharding.comm.wire import Rows, wire_all_to_all, wire_formats
from fbtriton_dist.sharding.dist.layout import ShardLayout


class SequenceDist:
    """The sequence output dist of one rank, fixed by the plan (``layout``).

    ``wire``: the wire formats of the rows (forward) and their gradients (backward), a
    ``(forward, backward)`` pair of ``WireFormat``s or one format name / dtype for both
    (None: fp32; fp8 / int8 scale each id's row of a shard-feature); the output is fp32."""

    def __init__(self, layout: ShardLayout, rank: int, device, group_sizes: list[int],
                 wire=None) -> None:
        self.layout, self.rank, self.device = layout, rank, torch.device(device)
        self.group_sizes = list(group_sizes)  # local shard-features of each TBE group
        self.formats = wire_formats(wire)
        fwd, bwd = self.formats
        self.cast_only = fwd == bwd and not fwd.scaled  # a cast both ways (or none)
        R = layout.world_size
        self.local = layout.local[rank]
        # for each feature, its column slices in column order, each its row blocks in row
        # order as (owner rank, index among the owner's shard-features); data-parallel: the
        # one block on this rank
        slices: list[dict[tuple[int, int], list]] = [{} for _ in layout.feature_names]
        for q in range(R):
            for j, sf in enumerate(layout.local[q]):
                if sf.data_parallel and q != rank:
                    continue
                slices[sf.feature].setdefault((sf.col_start, sf.col_end), []).append((sf, q, j))
        self.slices = [
            [(cols, sorted(blocks, key=lambda b: b[0].row_start))
             for cols, blocks in sorted(per.items())]
            for per in slices
        ]
        self._last: tuple | None = None  # (values, rows) sent and received per peer, last step
        dims = {cols[1] - cols[0] for per in self.slices for cols, _ in per}
        self.one_slice_of_one_dim = len(dims) == 1 and all(len(per) == 1 for per in self.slices)
        """Every feature one column slice, all of one D (row-, table-wise, data-parallel
        tables of one D): the rows of all features are put in order by one gather."""
        if self.one_slice_of_one_dim:
            blocks = [(f, sf.row_start) for f, per in enumerate(self.slices)
                      for sf, _, _ in per[0][1]]
            self._block_starts = torch.tensor([(f << 40) | r for f, r in blocks],
                                              dtype=torch.int64, device=self.device)

    def traffic(self, batch_sizes=None, strides=None) -> dict[str, tuple[int, int]]:
        """Bytes (sent, received) to/from the other ranks in the last step, forward and
        backward (it mirrors the forward); the rows are counted per id, so the batch sizes
        (the pooled output dist's arguments) are not needed."""
        sent, received = self._bytes(lambda q: q != self.rank)
        back_received, back_sent = self._bytes(lambda q: q != self.rank, backward=True)
        return {"output_dist.forward": (sent, received),
                "output_dist.backward": (back_sent, back_received)}

    def inter_host(self, batch_sizes=None, strides=None,
                   backward: bool = False) -> tuple[int, int]:
        """Bytes (sent, received) of the last forward that crossed hosts (``backward``: its
        messages in the backward's format)."""
        H = self.layout.local_world_size
        return self._bytes(lambda q: q // H != self.rank // H, backward)

    def _bytes(self, keep, backward: bool = False) -> tuple[int, int]:
        """Bytes (sent, received) of the last forward's messages to / from the peers ``keep``
        picks, in the forward's format (``backward``: the backward's, received / sent)."""
        if self._last is None:
            return 0, 0
        fmt = self.formats[int(backward)]
        return tuple(sum(fmt.nbytes(n, m) for q, (n, m) in enumerate(zip(*side, strict=True))
                         if keep(q)) for side in self._last)

    def __call__(self, rows: list[torch.Tensor], received, sent, ids: list[torch.Tensor],
                 group=None) -> list[torch.Tensor]:
        """``rows``: the local lookup, one ``[ids, max D]`` tensor per TBE group (this rank's
        shard-features in order, ``received[r][i]`` rows of source r for shard-feature i);
        ``sent[q][j]``: the ids this rank sent for rank q's shard-feature j; ``ids[f]``: this
        rank's ids of feature f (config order), in its KJT's order. Returns, per feature,
        ``[ids of f, D_f]`` fp32 rows in that order."""
        layout, R = self.layout, self.layout.world_size
        blocks = self._local_blocks(rows, received)  # [local sf][source] -> [n, dim]
        # 1. this rank's rows of every other rank's ids, to that rank; data-parallel stays
        pieces, send_n = [], []
        for r in range(R):
            mine = [blocks[i][r].reshape(-1) for i, sf in enumerate(self.local)
                    if not sf.data_parallel]
            pieces += mine
            send_n.append(sum(p.numel() for p in mine))
        recv_n = [sum(n * sf.dim for n, sf in zip(sent[q], layout.local[q], strict=True)
                      if not sf.data_parallel) for q in range(R)]
        send_rows = [[(received[r][i], (sf.dim,)) for i, sf in enumerate(self.local)
                      if not sf.data_parallel] for r in range(R)]
        recv_rows = [[(n, (sf.dim,)) for n, sf in zip(sent[q], layout.local[q], strict=True)
                      if not sf.data_parallel] for q in range(R)]
        count = [[sum(n for n, _ in peer) for peer in side] for side in (send_rows, recv_rows)]
        self._last = ((send_n, count[0]), (recv_n, count[1]))
        if pieces:
            values = torch.cat(pieces)
        else:  # still a node of the graph: every rank takes part in the backward all-to-all
            values = torch.zeros(0, device=self.device, requires_grad=torch.is_grad_enabled())
        if self.cast_only:
            fwd = self.formats[0]
            if fwd.name != "fp32":
                values = values.to(fwd.dtype)
            got = all_to_all(values, send_n, recv_n, group).float()
        else:
            got = wire_all_to_all(values.float(), Rows(send_rows, self.device),
                                  Rows(recv_rows, self.device), self.formats, group)
        # 2. cut into blocks: (owner q, its shard-feature j) -> [ids sent, dim] (one split)
        where = [(q, j, n, sf.dim) for q in range(R)
                 for j, (n, sf) in enumerate(zip(sent[q], layout.local[q], strict=True))
                 if not sf.data_parallel]
        came: dict[tuple[int, int], torch.Tensor] = {
            (q, j): piece.view(n, dim)
            for (q, j, n, dim), piece in zip(where, got.split([n * d for _, _, n, d in where]),
                                             strict=True)
        }
        came.update(self._own_replica_rows(blocks, received, group))
        # 3. per feature and column slice, the blocks' rows back in the KJT's order
        if self.one_slice_of_one_dim:
            return self._reorder_all(came, ids)
        out = []
        for f, per_slice in enumerate(self.slices):
            order_cache: dict[tuple[int, ...], torch.Tensor] = {}
            cols = []
            for _, row_blocks in per_slice:
                parts = [came[(q, j)] for _, q, j in row_blocks]
                if len(parts) == 1:
                    cols.append(parts[0])
                    continue
                starts = tuple(sf.row_start for sf, _, _ in row_blocks[1:])
                if starts not in order_cache:
                    order_cache[starts] = _kjt_order(ids[f], starts)
                cols.append(torch.cat(parts).index_select(0, order_cache[starts]))
            out.append(cols[0] if len(cols) == 1 else torch.cat(cols, dim=1))
        return out

    def _reorder_all(self, came: dict, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """``one_slice_of_one_dim``: every feature's rows in its KJT order by one gather.
        Each id's block is found among all features' (feature << 40 | first row) at once; a
        stable sort by block lists the ids as the blocks came (block after block, each in KJT
        order); its inverse takes the concatenated blocks back to the KJT's order."""
        parts = [came[(q, j)] for per in self.slices for _, q, j in per[0][1]]
        if not parts:
            return []
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        sizes = [int(t.numel()) for t in ids]
        if all(len(per[0][1]) == 1 for per in self.slices):  # one block each: in order
            return list(rows.split(sizes))
        feature = torch.repeat_interleave(
            torch.arange(len(ids), device=rows.device),
            torch.tensor(sizes, device=rows.device), output_size=sum(sizes))
        key = (feature << 40) | torch.cat(ids).to(torch.int64)
        block = torch.searchsorted(self._block_starts.to(rows.device), key, right=True)
        by_block = torch.sort(block, stable=True).indices
        where = torch.empty_like(by_block)
        where[by_block] = torch.arange(by_block.numel(), device=rows.device)
        return list(rows.index_select(0, where).split(sizes))

    def _local_blocks(self, rows: list[torch.Tensor], received) -> list[list[torch.Tensor]]:
        """The local lookup cut into ``[ids of source r, dim]`` blocks, per shard-feature and
        source rank (host numbers: no sync). One ``split`` per group: its backward is one
        concatenation, not a zero-filled copy of the whole lookup per block."""
        R = self.layout.world_size
        blocks, i = [], 0
        for group_rows, n_sf in zip(rows, self.group_sizes, strict=True):
            sizes = [received[r][j] for j in range(i, i + n_sf) for r in range(R)]
            pieces = group_rows.split(sizes)
            for j in range(n_sf):
                dim = self.local[i + j].dim
                per_source = pieces[j * R : (j + 1) * R]
                if dim < group_rows.shape[1]:
                    per_source = [p[:, :dim] for p in per_source]
                blocks.append(list(per_source))
            i += n_sf
        return blocks

    def _own_replica_rows(self, blocks, received, group) -> dict:
        """Data-parallel shard-features: this rank's rows of its replica's lookup, all in
        one ``own_rows`` (backward all-gathers every rank's gradients of them)."""
        R, me = self.layout.world_size, self.rank
        dp = [i for i, sf in enumerate(self.local) if sf.data_parallel]
        if not dp:
            return {}
        flat = torch.cat([blocks[i][r].reshape(-1) for r in range(R) for i in dp])
        per_rank = [sum(received[r][i] * self.local[i].dim for i in dp) for r in range(R)]
        mine = own_rows(flat, per_rank, me, group)
        sizes = [received[me][i] * self.local[i].dim for i in dp]
        return {(me, i): piece.view(received[me][i], self.local[i].dim)
                for i, piece in zip(dp, mine.split(sizes), strict=True)}


def _kjt_order(ids: torch.Tensor, starts: tuple[int, ...]) -> torch.Tensor:
    """For ids cut into row blocks at ``starts`` (the first row of every block but the first)
    and listed block after block, each block in the KJT's order: where each id of ``ids``
    (the KJT's order) sits in that list."""
    cuts = torch.tensor(starts, dtype=ids.dtype, device=ids.device)
    block = torch.bucketize(ids, cuts, right=True)
    by_block = torch.sort(block, stable=True).indices
    where = torch.empty_like(by_block)
    where[by_block] = torch.arange(by_block.numel(), device=ids.device)
    return where
