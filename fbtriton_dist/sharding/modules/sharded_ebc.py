"""ShardedEmbeddingBagCollection: the three stages of a sharded pooled lookup.

    features (this rank's KJT) --input_dist--> ids of every rank for this rank's shards
        --compute--> pooled partials [global batch, local shard columns]
        --output_dist--> KeyedTensor [this rank's batch, sum(D)]

Output dist sums table-row-wise and grid blocks inside the holders' host first (one process
group per host of ``plan.local_world_size`` ranks, made here), then sends them across.

Per step and direction: one bucketize for all features, one header and one data all-to-all
for the ids (one host sync, for the data all-to-all's split lists), one all-to-all of pooled
blocks (two for table-row-wise / grid); ``CommOptions`` puts the pooled blocks in bf16/fp16
and deduplicates ids on the wire. ``fbtriton_dist.sharding.pipeline.TrainPipeline`` runs the next
batch's input dist ahead (``prefetch``).
"""


import torch

from fbtriton_dist.sharding.dist.input_dist import LookupBatch, VBEStep
from fbtriton_dist.sharding.dist.output_dist import OutputDist
from fbtriton_dist.sharding.modules.collection import ShardedCollection
from fbtriton_dist.sparse import keyed_tensor


class ShardedEmbeddingBagCollection(ShardedCollection):
    """The shards of an EmbeddingBagCollection that live on this rank, and the collectives
    that feed them. Same forward as the unsharded module, on this rank's local batch.

    Args:
        configs: the tables' ``EmbeddingBagConfig`` (every rank passes the same list).
        plan: where each shard lives (``fbtriton_dist.planner.ShardingPlan``).
        optimizer: the fused optimizer applied in backward to every local shard.
        weights: optional full weights ``{table name: [E, D]}`` to copy this rank's shards
            from; otherwise each shard is initialised with its table's ``init_fn``.
        comm: how it talks to the other ranks (``CommOptions``: wire dtype, dedup); kept as
            ``self.comm``.

    The stages, for pipelines and benchmarks that run them apart::

        lengths, lookup, sizes, vbe = ebc.input_dist(kjt)  # bucketize + header/data all-to-alls
        local = ebc.compute(lookup)                         # TBE lookup of the local shards
        kt = ebc.output_dist(local, lengths, sizes, vbe)    # KeyedTensor [B, sum(D)]

    The shards, the input dist, prefetching and the state dict: ``ShardedCollection``.
    """

    def _make_output_dist(self) -> None:
        """The output dist and the MEAN index tensors, on ``self.device``."""
        self.output_dist_ = OutputDist(self.layout, self.rank, self.device, self.comm.wire)
        self._mean = torch.tensor(self.layout.feature_mean, device=self.device)[:, None]
        self._col_feature = torch.repeat_interleave(
            torch.arange(len(self._dims)), torch.tensor(self._dims, dtype=torch.int64)
        ).to(self.device)

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list:
        return self._configs

    # -- the three stages (the input dist: ``ShardedCollection.input_dist``) -------------------
    def compute(self, lookup: LookupBatch) -> torch.Tensor:
        """Pooled partials ``[global B, local shard columns]`` (fp32, SUM); their gradient is
        divided by the world size in backward (``CommOptions.gradient_division``), the
        per-sample weights' gradient (weights that require grad) is not."""
        if lookup.stats is not None:  # the step this lookup belongs to (pipelines run ahead)
            self.last_step_stats = lookup.stats
        B = lookup.batch_size
        self._share_row_counter_max()  # a collective: on ranks without shards too
        if not self.tbes:  # no shards here; still a node of the graph (see OutputDist)
            w = lookup.per_sample_weights
            if w is not None and w.requires_grad:  # and of the weights' all-to-all backward
                return (w.sum() * 0).expand(B, 0)
            return torch.zeros((B, 0), device=self.device, requires_grad=torch.is_grad_enabled())
        self._start_step()
        weights = self._undivided_weights_grad(lookup.per_sample_weights)
        outs = [self._lookup(tbe, indices, offsets, psw, B)
                for tbe, indices, offsets, psw in self.group_batches(lookup, weights)]
        single = len(outs) == 1
        return self._count_step(self._scale_grad(outs[0] if single else torch.cat(outs, dim=1)))

    def output_dist(self, local: torch.Tensor, lengths: torch.Tensor, sizes: list[int],
                    vbe: VBEStep | None = None):
        """Pooled partials -> KeyedTensor ``[B, sum(D)]`` of this rank's samples; MEAN
        features divided by their global bag length (``lengths`` [T, B] from input_dist).
        ``vbe`` (a step with a batch size per feature): each feature's deduplicated rows
        travel, then this rank expands them by its inverse indices (one gather; backward
        sums the expanded gradients back into each row before the output dist's)."""
        strides = vbe.strides if vbe is not None else None
        out = self.output_dist_(local, sizes, self.group, self.host_group, strides=strides)
        if any(self.layout.feature_mean):  # exact MEAN: divide by the global bag length
            scale = torch.where(self._mean, 1.0 / lengths.to(out.dtype).clamp(min=1), 1.0)
            out = out * scale.t().index_select(1, self._col_feature)
        if vbe is not None and vbe.inverse is not None:
            out = self._expand(out, vbe.inverse.to(out.device))
        return keyed_tensor(self._embedding_names, self._dims, out)

    def _expand(self, out: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``[P, sum(D)]`` -> ``[B, sum(D)]``: feature f's columns take row ``inverse[f, b]``
        for sample b. One gather when every feature has the same D (an index of [B, T]),
        else one per feature; backward adds each sample's gradient into its row."""
        T, dims = len(self._dims), self._dims
        if len(set(dims)) == 1:
            picked = out.view(out.shape[0], T, dims[0])[
                inverse.t(), torch.arange(T, device=out.device)
            ]
            return picked.reshape(inverse.shape[1], T * dims[0])
        cols = self.layout.feature_cols
        return torch.cat([out[:, cols[f] : cols[f + 1]].index_select(0, inverse[f])
                          for f in range(T)], dim=1)

    def forward(self, features):
        dist_out = self._take_prefetched(features)
        if dist_out is None:
            dist_out = self.input_dist(features)
        return self.output_dist(self.compute_step(dist_out.lookup), dist_out.lengths,
                                dist_out.batch_sizes, dist_out.vbe)
