"""ShardedEmbeddingCollection: an EmbeddingCollection's tables cut by a plan, one row per id.

    features (this rank's KJT) --input_dist--> ids of every rank for this rank's shards
        --compute--> one row per received id [ids, local max D] per TBE group
        --output_dist--> {feature: JaggedTensor [this rank's ids of it, D]}

The input dist is the EmbeddingBagCollection's (``ShardedCollection``: one bucketize, a header
and a data all-to-all); the output dist (``sharding/dist/sequence_dist.py``) sends every row back to
the rank that sent its id and puts the rows in that rank's KJT order. Every sharding type
works: row-wise (and table-row-wise, grid: row blocks, nothing to sum), table-wise,
column-wise (column slices joined back), data-parallel (own rows kept, gradients
all-gathered). Per step: the input dist's host sync, one more host read (the KJT's ids per
key, to cut its values by feature) and one all-to-all of rows each way.
"""

from collections.abc import Mapping, Sequence

import torch

from fbtriton_dist import optim
from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.sharding.comm.options import CommOptions
from fbtriton_dist.sharding.dist.input_dist import LookupBatch
from fbtriton_dist.sharding.dist.sequence_dist import SequenceDist
from fbtriton_dist.sharding.modules.collection import ShardedCollection
from fbtriton_dist.sparse import JaggedTensor, kjt_sequences


class ShardedEmbeddingCollection(ShardedCollection):
    """The shards of an EmbeddingCollection that live on this rank, and the collectives that
    feed them. Same forward as the unsharded module (``fbtriton_dist.EmbeddingCollection``,
    TorchRec's), on this rank's local batch: ``dict[str, JaggedTensor]``, one row per id.

    Args:
        configs: the tables' ``EmbeddingConfig`` (every rank passes the same list).
        plan: where each shard lives.
        optimizer: the fused optimizer applied in backward to every local shard.
        need_indices: each output JaggedTensor carries its feature's ids as ``weights()``.
        weights, process_group, device, backend: as ``ShardedEmbeddingBagCollection``.
        comm: ``CommOptions``: ``wire_dtype`` (rows in bf16/fp16/fp8/int8 on the wire),
            ``dedup`` (ids deduplicated on the wire); ``fixed_shapes`` is not supported here
            (the row messages are sized by the header's counts).

    The stages::

        lengths, lookup, sizes, _ = ec.input_dist(kjt)  # bucketize + header/data all-to-alls
        rows = ec.compute(lookup)                       # a row per received id, per TBE group
        out = ec.output_dist(rows, lookup, kjt)         # {feature: JaggedTensor}
    """

    _pooling = "none"
    tables_key = "embeddings"

    def __init__(
        self,
        configs: Sequence,
        plan: ShardingPlan,
        *,
        optimizer: optim.Optimizer,
        need_indices: bool = False,
        weights: dict[str, torch.Tensor] | None = None,
        process_group=None,
        device: torch.device | str | None = None,
        backend: str = "auto",
        comm: CommOptions | None = None,
        storage: Mapping | None = None,
        replicas=None,
        optimizer_state_dtypes: Mapping | None = None,
    ) -> None:
        if comm is not None and getattr(comm, "fixed_shapes", False):
            raise ValueError(
                "ShardedEmbeddingCollection: CommOptions(fixed_shapes=True) is not supported "
                "(the rows travel in messages sized by each step's header); use the default"
            )
        self._need_indices = need_indices
        super().__init__(configs, plan, optimizer=optimizer, weights=weights,
                         process_group=process_group, device=device, backend=backend, comm=comm,
                         storage=storage, replicas=replicas,
                         optimizer_state_dtypes=optimizer_state_dtypes)

    def _make_output_dist(self) -> None:
        self.output_dist_ = SequenceDist(self.layout, self.rank, self.device,
                                         self._group_features, self.comm.wire)

    def embedding_configs(self) -> list:
        return self._configs

    def need_indices(self) -> bool:
        return self._need_indices

    def compute(self, lookup: LookupBatch) -> list[torch.Tensor]:
        """One row per received id, ``[ids, max D of the group]`` fp32, per TBE group; their
        gradient is divided by the world size in backward (``CommOptions.gradient_division``)."""
        if lookup.stats is not None:
            self.last_step_stats = lookup.stats
        self._share_row_counter_max()
        self._start_step()
        rows = [self._scale_grad(self._lookup(tbe, indices, offsets, None, lookup.batch_size))
                for tbe, indices, offsets, _ in self.group_batches(lookup)]
        if rows:  # one step counted per backward
            rows[0] = self._count_step(rows[0])
        return rows

    def output_dist(self, rows: list[torch.Tensor], lookup: LookupBatch,
                    features) -> dict[str, JaggedTensor]:
        """The rows back to the ranks whose ids they are, as this rank's
        ``{feature: JaggedTensor}`` (config order, TorchRec's names)."""
        names = self.layout.feature_names
        seqs = kjt_sequences(features, names)  # checked by the input dist already
        spans = [seqs.ids(f) for f in names]
        ids = [seqs.values[a:b] for a, b in spans]
        values = self.output_dist_(rows, lookup.received, lookup.sent, ids, self.group)
        return {
            out_name: JaggedTensor(
                values=v, lengths=seqs.key_lengths(f),
                weights=ids[i] if self._need_indices else None,
            )
            for i, (out_name, f, v) in enumerate(
                zip(self._embedding_names, names, values, strict=True)
            )
        }

    def forward(self, features) -> dict[str, JaggedTensor]:
        dist_out = self._take_prefetched(features)
        if dist_out is None:
            dist_out = self.input_dist(features)
        return self.output_dist(self.compute_step(dist_out.lookup), dist_out.lookup, features)
