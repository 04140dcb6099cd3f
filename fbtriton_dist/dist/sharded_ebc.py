"""ShardedEmbeddingBagCollection and ``shard()``: the three stages of a sharded lookup.

    features (this rank's KJT) --input_dist--> ids of every rank for this rank's shards
        --compute--> pooled partials [global batch, local shard columns]
        --output_dist--> KeyedTensor [this rank's batch, sum(D)]

Output dist sums table-row-wise and grid blocks inside the holders' host first (one process
group per host of ``plan.local_world_size`` ranks, made here), then sends them across.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.dist import input_dist
from fbtriton_dist.dist.comm import gather_batch_sizes
from fbtriton_dist.dist.layout import ShardLayout
from fbtriton_dist.dist.output_dist import OutputDist
from fbtriton_dist.modules.ebc import fused_optimizer_from_torch
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.sparse import JaggedBatch, keyed_tensor, kjt_to_batch


class ShardedEmbeddingBagCollection(nn.Module):
    """The shards of an EmbeddingBagCollection that live on this rank, and the collectives
    that feed them. Same forward as the unsharded module, on this rank's local batch.

    Args:
        configs: the tables' ``EmbeddingBagConfig`` (every rank passes the same list).
        plan: where each shard lives (``fbtriton_dist.planner.ShardingPlan``).
        optimizer: the fused optimizer applied in backward to every local shard.
        weights: optional full weights ``{table name: [E, D]}`` to copy this rank's shards
            from; otherwise each shard is initialised with its table's ``init_fn``.
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
    ) -> None:
        super().__init__()
        if optimizer is None:
            raise ValueError(
                "sharded tables are trained with a fused optimizer: pass optimizer= to shard() "
                "or annotate the embedding parameters with apply_optimizer_in_backward"
            )
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.layout = ShardLayout(configs, plan, dist.get_world_size(process_group))
        self._is_weighted = is_weighted
        self._configs = list(configs)
        self._optimizer = optimizer
        self._local_world_size = plan.local_world_size
        self._plan = plan
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
        self.output_dist_ = OutputDist(self.layout, self.rank, self.device)
        self._embedding_names = self.layout.feature_names
        self._dims = self.layout.feature_dims

    def _host_group(self, group):
        """The process group of this rank's host: ``group`` itself if it is one host, else a
        new group per host, made on every rank in the same order (``new_group`` wants that)."""
        H, R = self._local_world_size, self.layout.world_size
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
        return f"{self._configs[t.table].name}[{t.row_start}:{t.row_end}, {t.col_start}:{t.col_end}]"

    def _local_shards(self):
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

    def _local_views(self):
        """(LocalTable, its [E_s, D_s] weight view) for every shard on this rank."""
        return [(t, v) for t, v, _ in self._local_shards()]

    @torch.no_grad()
    def _init_shards(self, weights: dict[str, torch.Tensor] | None) -> None:
        for t, view in self._local_views():
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
    def input_dist(self, features) -> tuple[JaggedBatch, JaggedBatch, list[int]]:
        """KJT of this rank -> (its own batch, the lookup batch of its shards, batch sizes)."""
        batch = kjt_to_batch(features, self.layout.feature_names, self._is_weighted)
        error = None
        try:
            input_dist.check_ids(batch, self.layout)
        except IndexError as e:
            error = e
        sizes = gather_batch_sizes(batch.batch_size, error is not None, self.device, self.group)
        if error is not None:
            raise error
        buckets = input_dist.bucketize(batch, self.layout)
        lookup, traffic = input_dist.exchange(buckets, self.layout, self.rank, sizes, self.group)
        self.last_traffic = traffic | self.output_dist_.traffic(sizes)
        self._last_inter_host = self.output_dist_.inter_host(sizes)
        self._last_pooling = self._pooling_factors(batch)
        self._last_batch_size = batch.batch_size
        return batch, lookup, sizes

    def _pooling_factors(self, batch: JaggedBatch) -> dict[str, float]:
        B = max(batch.batch_size, 1)
        per_feature = (batch.offsets[::B].diff() if batch.batch_size else batch.offsets[:0])
        return {f: n / B for f, n in zip(self.layout.feature_names, per_feature.tolist(), strict=False)}

    def comm_report(self) -> dict[str, dict[str, float]]:
        """Bytes this rank sent to / received from other ranks in the last step, per
        collective, next to the planner's estimate of what it receives
        (``fbtriton_dist.planner`` cost model at the measured batch size and pooling factors),
        and ``output_dist.forward.inter_host``: the part of the output dist that crossed hosts."""
        from fbtriton_dist.planner import CostModel, evaluate, to_table_specs

        if not hasattr(self, "last_traffic"):
            raise RuntimeError("comm_report: no step has run yet")
        B = self._last_batch_size
        specs = to_table_specs(self._configs, pooling_factors=self._last_pooling)
        model = CostModel(batch_size=max(B, 1), index_bytes=8, length_bytes=8, output_bytes=4)
        cost = evaluate(self._plan, specs, model=model).ranks[self.rank]
        measured_in = sum(v[1] for k, v in self.last_traffic.items() if k.startswith("input"))
        measured_out = sum(v[1] for k, v in self.last_traffic.items() if not k.startswith("input"))
        report = {k: {"sent": float(s), "received": float(r)} for k, (s, r) in self.last_traffic.items()}
        report["input_dist.total"] = {"received": float(measured_in),
                                      "planner_estimate": float(cost.input_dist_bytes)}
        report["output_dist.total"] = {"received": float(measured_out),
                                       "planner_estimate": float(cost.output_dist_bytes)}
        sent, received = self._last_inter_host  # a part of output_dist.forward, not added again
        report["output_dist.forward.inter_host"] = {"sent": float(sent), "received": float(received)}
        return report

    def compute(self, lookup: JaggedBatch) -> torch.Tensor:
        """Pooled partials ``[global B, local shard columns]`` (fp32, SUM)."""
        B = lookup.batch_size
        if not self.tbes:  # no shards here; still a node of the graph (see OutputDist)
            return torch.zeros((B, 0), device=self.device, requires_grad=torch.is_grad_enabled())
        outs, first = [], 0
        single = len(self.tbes) == 1
        for tbe, n in zip(self.tbes, self._group_features, strict=True):
            indices, offsets, psw = lookup.indices, lookup.offsets, lookup.per_sample_weights
            if not single:
                a, b = (int(x) for x in lookup.offsets[[first * B, (first + n) * B]].tolist())
                indices = indices[a:b]
                offsets = offsets[first * B : (first + n) * B + 1] - a
                psw = psw[a:b] if psw is not None else None
            outs.append(tbe(indices, offsets, psw))
            first += n
        return outs[0] if single else torch.cat(outs, dim=1)

    def output_dist(self, local: torch.Tensor, batch: JaggedBatch, sizes: list[int]):
        out = self.output_dist_(local, sizes, self.group, self.host_group)
        if any(self.layout.feature_mean):  # exact MEAN: divide by the global bag length
            B = batch.batch_size
            lengths = (batch.offsets[1:] - batch.offsets[:-1]).view(-1, B).to(out.dtype)
            mean = torch.tensor(self.layout.feature_mean, device=out.device)[:, None]
            scale = torch.where(mean, 1.0 / lengths.clamp(min=1), 1.0)
            dims = torch.tensor(self._dims, device=out.device)
            out = out * scale.t().repeat_interleave(dims, dim=1)
        return keyed_tensor(self._embedding_names, self._dims, out)

    def forward(self, features):
        batch, lookup, sizes = self.input_dist(features)
        return self.output_dist(self.compute(lookup), batch, sizes)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for tbe in self.tbes:
            tbe._apply(fn)
        if self.tbes:  # .to(device): the index lists follow the shards
            self.device = self.tbes[0].weights.device
            self.output_dist_ = OutputDist(self.layout, self.rank, self.device)
        return self

    # -- state dict: TorchRec's keys, sharded values ---------------------------------------------
    def _sharded(self, t: int, tensors: list[tuple], size: tuple[int, ...], rowwise: bool = False):
        """A ShardedTensor of global ``size`` for table ``t`` from this rank's ``(offsets,
        local tensor)`` pieces; the global metadata comes from the plan (no collective)."""
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import (
            ShardedTensorMetadata,
            TensorProperties,
        )

        kind = self.device.type
        metas = []
        for sf_rank, offsets, sizes in self._global_pieces(t, rowwise):
            local_rank = sf_rank % self._local_world_size
            where = f"rank:{sf_rank}/cuda:{local_rank}" if kind == "cuda" else f"rank:{sf_rank}/cpu"
            metas.append(ShardMetadata(list(offsets), list(sizes), where))
        local = [
            Shard(tensor, next(m for m in metas if list(m.shard_offsets) == list(offsets)))
            for offsets, tensor in tensors
        ]
        dtype = tensors[0][1].dtype if tensors else self.layout.dtypes[t]
        meta = ShardedTensorMetadata(metas, torch.Size(size), TensorProperties(dtype=dtype))
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, meta, process_group=self.group
        )

    def _global_pieces(self, t: int, rowwise: bool):
        """(rank, offsets, sizes) of every shard of table ``t``, for weights ([E, D]) or a
        rowwise state ([E, number of column slices])."""
        slices = sorted({(sf.col_start, sf.col_end) for sf in self._table_shards(t)})
        for sf in self._table_shards(t):
            if not rowwise:
                yield sf.rank, (sf.row_start, sf.col_start), (sf.row_end - sf.row_start, sf.dim)
            else:
                col = slices.index((sf.col_start, sf.col_end))
                yield sf.rank, (sf.row_start, col), (sf.row_end - sf.row_start, 1)

    def _table_shards(self, t: int):
        """One shard-feature per shard of table ``t`` (its first feature's)."""
        first = self.layout.feature_table.index(t)
        return [sf for q in self.layout.local for sf in q if sf.feature == first]

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """``{prefix}embedding_bags.<table>.weight``: a ShardedTensor (this rank's shards are
        views of the live weights, so torch.distributed.checkpoint saves and loads in place),
        or for a data-parallel table its full replica."""
        out = {} if destination is None else destination
        local = self._local_views()
        for t, cfg in enumerate(self._configs):
            key = f"{prefix}embedding_bags.{cfg.name}.weight"
            mine = [(lt, v) for lt, v in local if lt.table == t]
            if self.layout.table_data_parallel[t]:
                out[key] = mine[0][1]
                continue
            pieces = [((lt.row_start, lt.col_start), v) for lt, v in mine]
            out[key] = self._sharded(t, pieces, (cfg.num_embeddings, cfg.embedding_dim))
        return out

    def fused_optimizer_state_dict(self) -> dict:
        """The fused optimizer's state in the same form: ``embedding_bags.<table>.weight.<i>``
        per state tensor (rowwise Adagrad: ``[E, column slices]``, one accumulator per row of
        each column slice; Adagrad, Adam: ``[E, D]``), and ``step`` (the step count, for Adam's
        bias correction)."""
        out = {"step": torch.tensor(self.tbes[0].step if self.tbes else 0)}
        shards = self._local_shards()
        rowwise = isinstance(self._optimizer, optim.RowWiseAdagrad)
        for t, cfg in enumerate(self._configs):
            mine = [(lt, st) for lt, _, st in shards if lt.table == t]
            slices = sorted({(sf.col_start, sf.col_end) for sf in self._table_shards(t)})
            size = (cfg.num_embeddings, len(slices) if rowwise else cfg.embedding_dim)
            for i in range(self._optimizer.num_states):
                key = f"embedding_bags.{cfg.name}.weight.{i}"
                if self.layout.table_data_parallel[t]:  # the replica, same shape as sharded
                    out[key] = mine[0][1][i].view(-1, 1) if rowwise else mine[0][1][i]
                    continue
                pieces = [
                    ((lt.row_start, slices.index((lt.col_start, lt.col_end))), st[i].view(-1, 1))
                    if rowwise
                    else ((lt.row_start, lt.col_start), st[i])
                    for lt, st in mine
                ]
                out[key] = self._sharded(t, pieces, size, rowwise)
        return out

    def load_fused_optimizer_state_dict(self, state: dict) -> None:
        """Restore ``fused_optimizer_state_dict()`` (after torch.distributed.checkpoint loaded
        into it in place, only the step count is left to set)."""
        for tbe in self.tbes:
            tbe.step = int(state["step"])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        local = self._local_views()
        for t, cfg in enumerate(self._configs):
            key = f"{prefix}embedding_bags.{cfg.name}.weight"
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            for lt, view in local:
                if lt.table != t:
                    continue
                if isinstance(value, ShardedTensor):
                    piece = next(
                        (s.tensor for s in value.local_shards()
                         if list(s.metadata.shard_offsets) == [lt.row_start, lt.col_start]
                         and list(s.metadata.shard_sizes) == list(view.shape)),
                        None,
                    )
                    if piece is None:
                        errors.append(
                            f"{key}: the ShardedTensor's local shards do not match this rank's "
                            "shards; load it with torch.distributed.checkpoint, which reshards"
                        )
                        continue
                elif tuple(value.shape) == (cfg.num_embeddings, cfg.embedding_dim):
                    piece = value[lt.row_start : lt.row_end, lt.col_start : lt.col_end]
                else:
                    errors.append(f"{key}: expected shape ({cfg.num_embeddings}, "
                                  f"{cfg.embedding_dim}), got {tuple(value.shape)}")
                    continue
                if piece.data_ptr() != view.data_ptr():
                    with torch.no_grad():
                        view.copy_(piece)
        known = {f"{prefix}embedding_bags.{c.name}.weight" for c in self._configs}
        unexpected_keys += [k for k in state_dict if k.startswith(prefix) and k not in known
                            and k[len(prefix):].split(".")[0] == "embedding_bags"]

    # -- full (unsharded) state -------------------------------------------------------------
    @torch.no_grad()
    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{embedding_bags.<table>.weight: [E, D]}`` on every rank, loadable by TorchRec's
        EmbeddingBagCollection (fp32 sum of each rank's shards; replicas taken once)."""
        local = self._local_views()
        out = {}
        for t, cfg in enumerate(self._configs):
            dtype = self.layout.dtypes[t]
            full = torch.zeros((cfg.num_embeddings, cfg.embedding_dim), dtype=torch.float32,
                               device=self.device)
            replica_elsewhere = self.layout.table_data_parallel[t] and self.rank != 0
            for lt, view in local:
                if lt.table == t and not replica_elsewhere:  # replicas: rank 0's copy only
                    full[lt.row_start : lt.row_end, lt.col_start : lt.col_end] = view.float()
            dist.all_reduce(full, group=self.group)
            out[f"embedding_bags.{cfg.name}.weight"] = full.to(dtype)
        return out


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
    return fused_optimizer_from_torch(cls, dict(kwargs), name)


def shard(
    module: nn.Module,
    plan: ShardingPlan,
    process_group=None,
    device: torch.device | str | None = None,
    *,
    optimizer: optim.Optimizer | None = None,
    backend: str = "auto",
) -> nn.Module:
    """Replace every EmbeddingBagCollection in ``module`` (ours or TorchRec's, at any depth)
    by a ShardedEmbeddingBagCollection that keeps only this rank's shards. Weights are copied
    from the module, or, for a module built on the meta device, initialised shard by shard
    (a table is never materialised whole). The fused optimizer is ``optimizer`` or the one the
    tables were annotated with by ``apply_optimizer_in_backward``. Returns the module (the
    sharded collection itself if ``module`` was one)."""
    if _is_ebc(module):
        return _shard_one(module, "module", plan, process_group, device, optimizer, backend)
    for name, child in list(module.named_modules()):
        if not _is_ebc(child) or not name:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, _shard_one(child, name, plan, process_group, device, optimizer,
                                         backend))
    return module


def _shard_one(ebc, name, plan, process_group, device, optimizer, backend):
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
        device=device if device is not None else (first.device if first is not None and not first.is_meta else None),
        backend=backend,
    )
