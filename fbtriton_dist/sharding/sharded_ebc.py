"""ShardedEmbeddingBagCollection and ``shard()``: the three stages of a sharded lookup.

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

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.sharding import state_dict as states
from fbtriton_dist.sharding.comm_report import comm_report
from fbtriton_dist.sharding.fixed import FixedInputDist
from fbtriton_dist.sharding.input_dist import InputDist, InputDistOut, LookupBatch, VBEStep
from fbtriton_dist.sharding.layout import ShardLayout
from fbtriton_dist.sharding.options import CommOptions
from fbtriton_dist.sharding.output_dist import OutputDist
from fbtriton_dist.sparse import keyed_tensor


class ShardedEmbeddingBagCollection(nn.Module):
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

    ``input_group`` (default: the process group) carries the input dist; a pipeline may give
    it a group of its own so the next batch's ids do not queue behind this batch's output
    dist on one NCCL stream.
    """

    def __init__(
        self,
        configs: Sequence,
        plan: ShardingPlan,
        *,
        optimizer: optim.Optimizer,
        is_weighted: bool = False,
        weights: dict[str, torch.Tensor] | None = None,
        process_group=None,
        device: torch.device | str | None = None,
        backend: str = "auto",
        comm: CommOptions | None = None,
    ) -> None:
        super().__init__()
        if comm is not None and not isinstance(comm, CommOptions):
            raise ValueError(f"comm: expected a CommOptions, got {type(comm).__name__}")
        self.comm = comm if comm is not None else CommOptions()
        if optimizer is None:
            raise ValueError(
                "sharded tables are trained with a fused optimizer: pass optimizer= to shard() "
                "or annotate the embedding parameters with apply_optimizer_in_backward"
            )
        self.group = process_group
        self.input_group = process_group
        self._prefetched: list[tuple[object, InputDistOut]] = []
        self.rank = dist.get_rank(process_group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.layout = ShardLayout(configs, plan, dist.get_world_size(process_group))
        self._is_weighted = is_weighted
        self._configs = list(configs)
        self._optimizer = optimizer
        self.plan = plan
        self.backend = backend
        self.last_step_stats: dict | None = None
        """What the input dist of the last step learnt (``comm_report`` reads it)."""
        self.host_group = self._host_group(process_group)
        local, ftm = self.layout.local_tables(self.rank)
        self.local_tables = local
        # one TableBatchedEmbedding per dtype; shard-features are already grouped by dtype
        # not submodules: the state dict speaks TorchRec's keys (see state_dict below)
        self.tbes: list[TableBatchedEmbedding] = []
        self._group_features: list[int] = []
        for dtype in dict.fromkeys(t.dtype for t in local):
            members = [i for i, t in enumerate(local) if t.dtype == dtype]
            sfs = [j for j, i in enumerate(ftm) if local[i].dtype == dtype]
            tbe = TableBatchedEmbedding(
                [local[i].shape for i in members],
                [members.index(ftm[j]) for j in sfs],
                pooling="sum",  # MEAN is divided by the global bag length after the reduction
                optimizer=optimizer,
                weights_dtype=dtype,
                device=self.device,
                backend=backend,
                bounds_check="ignore",  # checked on the sending rank, before the collectives
                table_names=[self._shard_name(local[i]) for i in members],
                init_weights=False,
            )
            self.tbes.append(tbe)
            self._group_features.append(len(sfs))
        self._init_shards(weights)
        self._embedding_names = self.layout.output_names
        self._dims = self.layout.feature_dims
        self._make_dists()

    def _make_dists(self) -> None:
        """The input and output dists and the MEAN index tensors, on ``self.device``."""
        if self.comm.fixed_shapes:
            self.input_dist_ = FixedInputDist(
                self.layout, self.rank, self.device, self._group_features,
                max_ids=self.comm.max_ids, backend=self.backend,
            )
        else:
            self.input_dist_ = InputDist(
                self.layout, self.rank, self.device, self._group_features,
                dedup=self.comm.dedup, backend=self.backend,
            )
        self.output_dist_ = OutputDist(self.layout, self.rank, self.device, self.comm.wire_dtype)
        self._mean = torch.tensor(self.layout.feature_mean, device=self.device)[:, None]
        self._col_feature = torch.repeat_interleave(
            torch.arange(len(self._dims)), torch.tensor(self._dims, dtype=torch.int64)
        ).to(self.device)

    def _host_group(self, group):
        """The process group of this rank's host: ``group`` itself if it is one host, else a
        new group per host, made on every rank in the same order (``new_group`` wants that)."""
        H, R = self.layout.local_world_size, self.layout.world_size
        if H == R:
            return group
        mine = None
        for first in range(0, R, H):
            ranks = [r if group is None else dist.get_global_rank(group, r)
                     for r in range(first, first + H)]
            g = dist.new_group(ranks)
            if first <= self.rank < first + H:
                mine = g
        return mine

    def _shard_name(self, t) -> str:
        rows, cols = f"{t.row_start}:{t.row_end}", f"{t.col_start}:{t.col_end}"
        return f"{self._configs[t.table].name}[{rows}, {cols}]"

    @property
    def optimizer(self) -> optim.Optimizer:
        """The fused optimizer every local shard is updated with in backward."""
        return self._optimizer

    def local_shards(self):
        """(LocalTable, [E_s, D_s] weight view, [state views]) for every shard on this rank."""
        views = [v for tbe in self.tbes for v in tbe.split_embedding_weights()]
        states = [s for tbe in self.tbes for s in tbe.split_optimizer_states()]
        by_dtype = [
            t
            for dtype in dict.fromkeys(t.dtype for t in self.local_tables)
            for t in self.local_tables
            if t.dtype == dtype
        ]
        return list(zip(by_dtype, views, states, strict=True))

    def local_views(self):
        """(LocalTable, its [E_s, D_s] weight view) for every shard on this rank."""
        return [(t, v) for t, v, _ in self.local_shards()]

    @torch.no_grad()
    def _init_shards(self, weights: dict[str, torch.Tensor] | None) -> None:
        for t, view in self.local_views():
            cfg = self._configs[t.table]
            if weights is not None:
                view.copy_(weights[cfg.name][t.row_start : t.row_end, t.col_start : t.col_end])
            elif cfg.init_fn is not None:
                cfg.init_fn(view)
            else:
                view.uniform_(cfg.get_weight_init_min(), cfg.get_weight_init_max())

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list:
        return self._configs

    # -- the three stages -------------------------------------------------------------------
    def input_dist(self, features) -> InputDistOut:
        """KJT of this rank -> ``(lengths [T, B] of its own bags, the lookup batch of its
        shards, every rank's batch size)``: one bucketize, a header all-to-all, one host sync
        (the data all-to-all's split lists; on GPU the bucketize launcher sizes its output
        with one more), one data all-to-all (``fbtriton_dist.sharding.input_dist``)."""
        out = self.input_dist_(features, self._is_weighted, self.input_group)
        self.last_step_stats = out.lookup.stats
        return out

    def poll_input(self, wait: bool = True) -> None:
        """With ``CommOptions(fixed_shapes=True)``: raise if a recent batch (or, after CUDA
        graph replays, any batch since the last poll) had bad input on some rank; ``wait``:
        wait for the batches in flight (else only those done). A no-op otherwise: the default
        input dist raises in the step itself."""
        if isinstance(self.input_dist_, FixedInputDist):
            self.input_dist_.poll(wait)

    # -- what a pipeline needs (fixed shapes: the capacity, the failure flag) ----------------
    @property
    def fixed_shapes(self) -> bool:
        """Whether the input dist has fixed message sizes (``CommOptions.fixed_shapes``)."""
        return isinstance(self.input_dist_, FixedInputDist)

    def input_capacity(self) -> int:
        """With fixed shapes, after the first batch: the most ids this rank's batch may hold
        (its agreed ``max_ids``)."""
        if not self.fixed_shapes or self.input_dist_.agreed is None:
            raise RuntimeError("input_capacity: needs CommOptions(fixed_shapes=True) and a "
                               "first batch (the capacity is agreed on it)")
        return self.input_dist_.agreed[1][self.rank]

    @property
    def input_failed(self) -> torch.Tensor:
        """With fixed shapes: the sticky [] int64 device flag, nonzero once some rank sent bad
        input (graph replays update it); ``clear_input_failed`` resets it."""
        if not self.fixed_shapes:
            raise RuntimeError("input_failed: only the fixed-shape input dist flags late")
        return self.input_dist_.failed

    def clear_input_failed(self) -> None:
        self.input_failed.zero_()

    def explain_input(self, features) -> Exception:
        """What is wrong with ``features`` (this rank's batch), by the slow exact check: an
        IndexError/ValueError naming the id and bound, or a RuntimeError when it finds none."""
        return self.input_dist_.explain(features, self._is_weighted)

    def prefetch(self, features) -> InputDistOut:
        """Run ``input_dist(features)`` now (a pipeline does, for the next batch, on a side
        stream) and keep it for the ``forward`` that is called with this same ``features``
        object."""
        out = self.input_dist(features)
        self._prefetched = [*self._prefetched[-1:], (features, out)]
        return out

    def offer(self, features, out: InputDistOut) -> None:
        """Use ``out`` as the input dist of the next ``forward(features)`` (a pipeline that
        ran it elsewhere, e.g. inside a CUDA graph); replaces any prefetched one."""
        self._prefetched = [(features, out)]

    def drop_prefetched(self) -> None:
        """Forget prefetched input dists (a ``forward`` then runs its own)."""
        self._prefetched = []

    def _take_prefetched(self, features) -> InputDistOut | None:
        for i, (f, out) in enumerate(self._prefetched):
            if f is features:
                del self._prefetched[i]
                return out
        return None

    def compute(self, lookup: LookupBatch) -> torch.Tensor:
        """Pooled partials ``[global B, local shard columns]`` (fp32, SUM)."""
        if lookup.stats is not None:  # the step this lookup belongs to (pipelines run ahead)
            self.last_step_stats = lookup.stats
        B = lookup.batch_size
        if not self.tbes:  # no shards here; still a node of the graph (see OutputDist)
            return torch.zeros((B, 0), device=self.device, requires_grad=torch.is_grad_enabled())
        outs, first = [], 0
        single = len(self.tbes) == 1
        for g, (tbe, n) in enumerate(zip(self.tbes, self._group_features, strict=True)):
            indices, offsets, psw = lookup.indices, lookup.offsets, lookup.per_sample_weights
            if lookup.groups:  # fixed shapes: each group padded to its own slots
                indices, offsets, psw = lookup.groups[g]
            elif not single:
                a, b = lookup.id_bounds[g], lookup.id_bounds[g + 1]  # host numbers, no sync
                indices = indices[a:b]
                offsets = offsets[first * B : (first + n) * B + 1] - a
                psw = psw[a:b] if psw is not None else None
            outs.append(tbe(indices, offsets, psw))
            first += n
        return outs[0] if single else torch.cat(outs, dim=1)

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
        return self.output_dist(self.compute(dist_out.lookup), dist_out.lengths,
                                dist_out.batch_sizes, dist_out.vbe)

    def comm_report(self) -> dict[str, dict[str, float]]:
        """Bytes this rank sent and received in the last step per collective, next to the
        planner's estimate (``sharding.comm_report``; syncs: not for the hot path)."""
        return comm_report(self)

    # -- state dict: TorchRec's keys, sharded values (``sharding.state_dict``) -------------
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """``{prefix}embedding_bags.<table>.weight``: a ShardedTensor of views of the live
        weights, or for a data-parallel table its full replica."""
        return states.weights_state_dict(self, destination, prefix)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        states.load_weights(self, state_dict, prefix, missing_keys, unexpected_keys, errors)

    def fused_optimizer_state_dict(self) -> dict:
        """The fused optimizer's state, ``embedding_bags.<table>.weight.<i>`` and ``step``."""
        return states.fused_optimizer_state_dict(self)

    def load_fused_optimizer_state_dict(self, state: dict) -> None:
        """Restore ``fused_optimizer_state_dict()`` (after DCP loaded it in place)."""
        states.load_fused_optimizer_state_dict(self, state)

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{embedding_bags.<table>.weight: [E, D]}`` on every rank (a collective)."""
        return states.gather_full_state_dict(self)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for tbe in self.tbes:
            tbe._apply(fn)
        if self.tbes and self.tbes[0].weights.device != self.device:
            self.device = self.tbes[0].weights.device  # .to(device): the index lists follow
            self._make_dists()
        return self

def _is_ebc(module: nn.Module) -> bool:
    from fbtriton_dist.modules.ebc import EmbeddingBagCollection

    if isinstance(module, EmbeddingBagCollection):
        return True
    try:
        import torchrec
    except ImportError:
        return False
    return isinstance(module, torchrec.EmbeddingBagCollection)


def _optimizer_of(ebc: nn.Module, name: str) -> optim.Optimizer | None:
    specs = {
        (p._optimizer_classes[0], tuple(sorted(p._optimizer_kwargs[0].items())))
        for p in ebc.parameters()
        if getattr(p, "_optimizer_classes", None)
    }
    if len(specs) > 1:
        raise ValueError(f"{name}: one fused optimizer for all sharded tables, got {specs}")
    if not specs:
        return None
    cls, kwargs = specs.pop()
    return optim.from_torch(cls, dict(kwargs), name)


def shard(
    module: nn.Module,
    plan: ShardingPlan,
    process_group=None,
    device: torch.device | str | None = None,
    *,
    optimizer: optim.Optimizer | None = None,
    backend: str = "auto",
    comm: CommOptions | None = None,
) -> nn.Module:
    """Replace every EmbeddingBagCollection in ``module`` (ours or TorchRec's, at any depth)
    by a ShardedEmbeddingBagCollection that keeps only this rank's shards. Weights are copied
    from the module, or, for a module built on the meta device, initialised shard by shard
    (a table is never materialised whole). The fused optimizer is ``optimizer`` or the one the
    tables were annotated with by ``apply_optimizer_in_backward``. ``comm``: how the sharded
    collections talk to each other (``CommOptions``: bf16/fp16 pooled values on the wire, id
    dedup; default exact). Returns the module (the sharded collection itself if ``module``
    was one)."""
    if _is_ebc(module):
        return _shard_one(module, "module", plan, process_group, device, optimizer, backend, comm)
    for name, child in list(module.named_modules()):
        if not _is_ebc(child) or not name:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, _shard_one(child, name, plan, process_group, device, optimizer,
                                         backend, comm))
    return module


def _shard_one(ebc, name, plan, process_group, device, optimizer, backend, comm=None):
    configs = ebc.embedding_bag_configs()
    first = next(iter(ebc.parameters()), None)
    weights = None
    if first is not None and not first.is_meta:
        weights = {c.name: ebc.embedding_bags[c.name].weight.detach() for c in configs}
    return ShardedEmbeddingBagCollection(
        configs,
        plan,
        optimizer=optimizer if optimizer is not None else _optimizer_of(ebc, name),
        is_weighted=ebc.is_weighted(),
        weights=weights,
        process_group=process_group,
        device=device if device is not None else (
            first.device if first is not None and not first.is_meta else None
        ),
        backend=backend,
        comm=comm,
    )
