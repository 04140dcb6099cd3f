"""EmbeddingCollection: TorchRec's unsharded sequence-embedding module on our TBE.

Same constructor, same KeyedJaggedTensor in / ``dict[str, JaggedTensor]`` out, same state_dict
keys (``embeddings.<table>.weight``, shapes [E, D]) as ``torchrec.EmbeddingCollection``: every
id gets its table's row, unpooled. Each table's weight is a real ``nn.Embedding`` parameter and
a view into the flat buffer of one TableBatchedEmbedding (``pooling="none"``) per dtype, so one
kernel launch looks up every table of a dtype.
"""

from collections.abc import Collection, Mapping
from itertools import accumulate
from typing import List, Optional  # noqa: UP035 (TorchRec's stable interface spells them so)

import torch
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.modules import ebc_op, ec_op, host_tier, op_spec, portable, torchrec_ir
from fbtriton_dist.modules.ebc import DATA_TYPES, embedding_names
from fbtriton_dist.modules.managed import ManagedCollisionCollection, managed_forward
from fbtriton_dist.modules.table_groups import (
    OpLayout,
    TableGroups,
    check_storage,
    refuse_data_parallel,
)
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.sparse import EmbeddingConfig, JaggedTensor, KeyedJaggedTensor, kjt_sequences


class EmbeddingCollection(TableGroups):
    """Drop-in for ``torchrec.EmbeddingCollection``: one embedding row per id.

    Args:
        tables: ``torchrec.EmbeddingConfig`` per table (``num_embeddings``, ``embedding_dim``,
            ``feature_names``, ``data_type`` FP32/FP16/BF16, ``init_fn``). Unlike TorchRec's,
            the tables may have different dims.
        device: where the tables live; ``"meta"`` allocates nothing.
        need_indices: each output JaggedTensor carries its feature's ids as ``weights()``
            (TorchRec's convention).
        use_gather_select, use_gather_select_per_sharding: TorchRec's lookup choices, accepted
            for its signature; one kernel serves every case here.
        backend, bounds_check: passed to each TableBatchedEmbedding.
        managed: table name -> ``id_manager.IdManagerConfig``: managed tables (dynamic ids,
            ``modules/managed.py``), as EmbeddingBagCollection's.
        storage: table name -> ``fbtriton_dist.storage.Storage``: storage tiers, as
            EmbeddingBagCollection's.
        optimizer_state_dtypes: FBGEMM's option (TorchRec passes it in ``fused_params``):
            ``{"momentum1" | "momentum2": "fp32" | "fp16" | "bf16"}`` (or torch dtypes,
            FBGEMM's ``SparseType``), the storage of the fused optimizer's state of every
            table; the update runs in fp32 (``TableBatchedEmbedding``'s). Default fp32.

    ``forward(features: KeyedJaggedTensor) -> dict[str, JaggedTensor]``: one key per (table,
    feature) in config order (``feature@table`` where tables share a feature name), values
    ``[ids of the feature, D]`` fp32 in the KJT's order, the KJT's lengths. Per-id weights of
    the KJT are not used (as TorchRec's). Weights are ordinary parameters (any torch optimizer
    works); parameters annotated by ``apply_optimizer_in_backward`` are updated by the fused
    TBE backward instead (the classes of ``optim.REGISTRY``).
    """

    # host-side state torch.jit.script need not type (the scripted forward reads none of it)
    __jit_ignored_attributes__ = ["_groups", "_tbes", "_embedding_configs", "_table_configs",
                                  "_embedding_names_by_table", "_op_layout",
                                  "optimizer_state_dtypes"]
    _tables_attr = "embeddings"
    _group_what = "dtype and host tier"

    def __init__(
        self,
        tables: List[EmbeddingConfig],  # noqa: UP006 (TorchRec's exact annotation)
        device: Optional[torch.device] = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: Optional[dict[str, bool]] = None,
        *,
        backend: str = "auto",
        bounds_check: str = "error",
        managed: Mapping | None = None,
        storage: Mapping | None = None,
        optimizer_state_dtypes: Mapping | None = None,
    ) -> None:
        super().__init__()
        self.optimizer_state_dtypes = optim.state_dtype_names(optimizer_state_dtypes)
        """``{state buffer: dtype name}``: how every group's fused-optimizer state is stored
        (``shard()`` keeps it)."""
        names = [t.name for t in tables]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"tables: duplicate table names {duplicates}")
        tiers = check_storage(storage, tables, managed)
        self._embedding_configs = list(tables)
        self._table_configs = self._embedding_configs
        self._need_indices = need_indices
        self._device = torch.device(device) if device is not None else torch.get_default_device()
        for cfg in tables:
            if not cfg.feature_names:
                cfg.feature_names = [cfg.name]
        # (dtype, is_host): host tables own their TBEs on every device (host_tier.py)
        self._groups: dict[tuple[torch.dtype, bool], list[int]] = {}
        for t, cfg in enumerate(tables):
            self._groups.setdefault((self._dtype(cfg), host_tier.is_host(tiers[t])), []).append(t)

        self._tbes: list[TableBatchedEmbedding] = []
        self._feature_order: list[str] = []  # the features of the groups, group after group
        self._output_of: list[int] = []  # for each of them, its output (config order)
        first_output = [0, *accumulate(len(c.feature_names) for c in tables)]
        views: dict[int, torch.Tensor] = {}  # what the kernels read: a cached table's slots
        whole: dict[int, torch.Tensor] = {}  # the whole tables: a cached table's backing store
        for (dtype, _), members in self._groups.items():
            shapes = [(tables[t].num_embeddings, tables[t].embedding_dim) for t in members]
            slots = [tiers[t].slots(E) for t, (E, _) in zip(members, shapes, strict=True)]
            flat = host_tier.empty(sum(C * D for C, (_, D) in zip(slots, shapes, strict=True)),
                                   dtype, self._device, [tiers[t] for t in members])
            ftm = [i for i, t in enumerate(members) for _ in tables[t].feature_names]
            with torch.random.fork_rng(devices=[]):  # the global RNG draws weights only
                seed = int(torch.randint(2**31 - 1, (), device="cpu"))
            tbe = TableBatchedEmbedding(
                shapes,
                ftm,
                pooling="none",
                weights_dtype=dtype,
                device=self._device,
                backend=backend,
                bounds_check=bounds_check,
                table_names=[tables[t].name for t in members],
                feature_names=[f for t in members for f in tables[t].feature_names],
                weights=flat,
                init_weights=False,
                seed=seed,
                storage=[tiers[t] for t in members],
                optimizer_state_dtypes=self.optimizer_state_dtypes,
            )
            tbe.weights.requires_grad_(False)
            views.update(zip(members, tbe.split_slot_weights(), strict=True))
            whole.update(zip(members, tbe.split_embedding_weights(), strict=True))
            for t in members:
                names = tables[t].feature_names
                self._feature_order += names
                self._output_of += [first_output[t] + j for j in range(len(names))]
            self._tbes.append(tbe)
        self.embeddings = nn.ModuleDict()
        for t, cfg in enumerate(tables):  # in config order, drawn as TorchRec draws them
            self.embeddings[cfg.name] = nn.Embedding(
                views[t].shape[0], cfg.embedding_dim, _weight=views[t], device=self._device,
                dtype=self._dtype(cfg),
            )  # a cached table's parameter: its slots
            if self._device.type != "meta":
                with torch.no_grad():
                    nn.init.normal_(whole[t])  # nn.Embedding's draw
                    if cfg.init_fn is not None:
                        cfg.init_fn(whole[t])
        self._embedding_names = embedding_names(tables)
        self._embedding_names_by_table = [
            self._embedding_names[first_output[t] : first_output[t + 1]]
            for t in range(len(tables))
        ]
        self._dims = [cfg.embedding_dim for cfg in tables for _ in cfg.feature_names]
        # the scripted forward's plain lookup (``portable.rows``), in config order
        self._config_features = [f for cfg in tables for f in cfg.feature_names]
        self._config_feature_tables = [t for t, cfg in enumerate(tables) for _ in cfg.feature_names]
        self._op_layout = OpLayout(
            feature_order=self._feature_order,
            embedding_names=self._embedding_names,
            lengths_per_embedding=self._dims,
            config_features=self._config_features,
            config_feature_tables=self._config_feature_tables,
        )
        self._alias_states()
        self._tier_hooks()
        self.id_managers = (
            ManagedCollisionCollection(managed, tables, device=self._device, backend=backend)
            if managed else None
        )

    @staticmethod
    def _dtype(cfg) -> torch.dtype:
        name = getattr(cfg.data_type, "name", str(cfg.data_type))
        if name not in DATA_TYPES:
            raise ValueError(
                f"table '{cfg.name}' data_type: expected one of {list(DATA_TYPES)}, got {name}"
            )
        return DATA_TYPES[name]

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table

    def embedding_dim(self) -> int:
        """The tables' one embedding dim (TorchRec's accessor); raises for mixed dims."""
        dims = {cfg.embedding_dim for cfg in self._embedding_configs}
        if len(dims) != 1:
            raise ValueError(f"embedding_dim: the tables have different dims {sorted(dims)}")
        return dims.pop()

    @property
    def device(self) -> torch.device:
        return self._device

    def reset_parameters(self) -> None:
        """Each table's ``init_fn`` (TorchRec's EmbeddingConfig default: uniform in
        weight_init_min/max), and fused optimizer states and steps to zero."""
        self._reset_tables(lambda cfg, w: cfg.init_fn(w) if cfg.init_fn is not None else None)
        if getattr(self, "id_managers", None) is not None:  # managed tables: empty maps
            self.id_managers.reset()

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """KeyedJaggedTensor (keys in any order, a batch size per key allowed) -> one
        JaggedTensor per (table, feature), config order.

        Traced (``torch.fx``, ``torch.compile``, ``torch.export``) or on meta tensors, the
        lookup is one registered op, ``torch.ops.fbtriton_dist.ec_lookup`` (``ec_op``).
        Under ``torch.jit.script`` (inference) it is ``portable.rows``, plain torch ops."""
        if torch.jit.is_scripting():
            return self._scripted_forward(features)
        return self._forward(features)

    def _scripted_forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        keys = features.keys()
        for k in keys:
            if keys.count(k) > 1:
                raise ValueError("KeyedJaggedTensor keys must be unique")
        values, lengths = features.values(), features.lengths()
        ids_per_key = features.length_per_key()
        strides = features.stride_per_key()
        params: list[torch.Tensor] = []
        for emb in self.embeddings.values():
            params.append(emb.weight)
        out: dict[str, JaggedTensor] = {}
        for j in range(len(self._config_features)):
            k = keys.index(self._config_features[j])
            ids = values.narrow(0, sum(ids_per_key[:k]), ids_per_key[k])
            rows = portable.rows(ids, params[self._config_feature_tables[j]],
                                 self._embedding_names[j])
            out[self._embedding_names[j]] = JaggedTensor(
                values=rows, lengths=lengths.narrow(0, sum(strides[:k]), strides[k]),
                weights=ids if self._need_indices else None,
            )
        return out

    @torch.jit.unused
    def _forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if ebc_op.compiling_around(self, features):
            return ebc_op.run_eagerly(self._forward_body, features)
        return self._forward_body(features)

    @torch.jit.unused
    def _forward_body(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if self.id_managers is not None:
            features = managed_forward(self, features)
        if ebc_op.traced(features):
            self._refuse_traced_tiers()
            return ec_op.forward(self, features)
        seqs = kjt_sequences(features, self._feature_order)
        ids = [seqs.values[a:b] for a, b in (seqs.ids(f) for f in self._feature_order)]
        rows = self.lookup(ids)
        return self.jagged_outputs(rows, ids, [seqs.key_lengths(f) for f in self._feature_order])

    def jagged_outputs(self, rows, ids, lengths) -> dict[str, JaggedTensor]:
        """The JaggedTensors in config order from the rows, ids and lengths of each feature of
        ``op_layout().feature_order``."""
        out: list[JaggedTensor | None] = [None] * len(self._embedding_names)
        for i, j in enumerate(self._output_of):
            out[j] = JaggedTensor(values=rows[i], lengths=lengths[i],
                                  weights=ids[i] if self._need_indices else None)
        return dict(zip(self._embedding_names, out, strict=True))

    def _groups_of(self, ids: list[torch.Tensor], bound: list | None = None):
        """Per dtype group, bound to the parameters' storage: (tbe, its members, parameters,
        fused optimizer or None, indices, offsets (one bag per feature), first position of
        each of its features in ``ids``' order). ``bound``: (parameters, fused optimizer) of
        each group, the TBEs already bound to them (``op_spec.bind``); default: this module's."""
        for g, (tbe, members, indices, offsets, starts, f0) in enumerate(self._group_ids(ids)):
            if bound is not None:
                params, fused = bound[g]
            else:
                params = self.group_params(members)
                self._bind(tbe, params)
                fused = self.sync_optimizer(tbe, members)
                if fused is not None:
                    refuse_data_parallel("EmbeddingCollection")
            yield tbe, members, params, fused, indices, offsets, starts, f0

    def _group_ids(self, ids: list[torch.Tensor]):
        """Per dtype group: (tbe, its members, indices, offsets (one bag per feature), first
        position of each of its features in ``ids``' order)."""
        f0 = 0
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            mine = ids[f0 : f0 + tbe.num_features]
            indices = mine[0] if len(mine) == 1 else torch.cat(mine)
            # one bag per feature: without pooling only which ids are whose matters
            starts = [0, *accumulate(int(t.numel()) for t in mine)]
            offsets = torch.tensor(starts, dtype=indices.dtype, device=indices.device)
            yield tbe, members, indices, offsets, starts, f0
            f0 += tbe.num_features

    def prefetch(self, features: KeyedJaggedTensor,
                 tiers: Collection[str] | None = None) -> None:
        """Start reading the rows of a coming batch ``features`` (``forward``'s argument) that
        the cached tables do not hold, with their optimizer state, on each tiered TBE's worker
        thread (``TableBatchedEmbedding.prefetch``); that batch's lookup loads them from
        there. Call it after the current batch's forward, e.g. before its backward: a lookup
        takes the prefetch in flight. Exact whatever comes between (``modules/tiers.py``).
        Nothing to do without cached tables; managed tables stay on ``device``. ``tiers``:
        only the tables on these tiers (e.g. ``("file",)``); None: every cached table."""
        if not any(tbe.tiered for tbe in self._tbes):
            return
        seqs = kjt_sequences(features, self._feature_order)
        ids = [seqs.values[a:b] for a, b in (seqs.ids(f) for f in self._feature_order)]
        for tbe, _, indices, offsets, _, _ in self._group_ids(ids):
            if tbe.tiered:
                tbe.prefetch(indices, offsets, tiers=tiers)

    def lookup(self, ids: list[torch.Tensor], autograd: bool = True,
               bound: list | None = None) -> list[torch.Tensor]:
        """Rows ``[ids of f, D_f]`` of every feature of ``op_layout().feature_order`` (its
        ``ids``). ``autograd=False``: no gradient to the parameters (the registered op's)."""
        rows: list[torch.Tensor] = []
        for tbe, _, params, fused, indices, offsets, starts, f0 in self._groups_of(ids, bound):
            targets = None if fused or not autograd else params
            out = tbe.lookup(indices, offsets, None, grad_targets=targets)
            for i in range(tbe.num_features):
                rows.append(out[starts[i] : starts[i + 1], : self._dims[self._output_of[f0 + i]]])
        return rows

    def lookup_backward(self, ids: list[torch.Tensor], grads: list, update: bool,
                        bound: list | None = None) -> list:
        """``lookup``'s backward (the registered op's): each table's weight gradient in
        config order (None for a fused table). ``update``: only apply the fused groups'
        optimizers to their rows in place; else every gradient, the rows untouched."""
        out: dict[int, torch.Tensor | None] = {}
        for tbe, members, _, fused, indices, offsets, starts, f0 in self._groups_of(ids, bound):
            if update and fused is None:
                continue
            width = max(tbe.tables[t][1] for t in range(len(tbe.tables)))
            g = torch.zeros((indices.numel(), width), dtype=torch.float32,
                            device=indices.device)
            for i in range(tbe.num_features):
                if grads[f0 + i] is not None:
                    g[starts[i] : starts[i + 1], : grads[f0 + i].shape[1]] = grads[f0 + i]
            _, g_tables = tbe.lookup_backward(g, indices, offsets, None,
                                              rows=update or not fused)
            for t, g_t in zip(members, g_tables or [None] * len(members), strict=True):
                out[t] = g_t
        return [out.get(t) for t in range(len(self._embedding_configs))]

    def extra_repr(self) -> str:
        groups = ", ".join(f"{len(m)} x {dt}" + (" host" if host else "")
                           for (dt, host), m in self._groups.items())
        return f"tables: {groups}, need_indices={self._need_indices}"


op_spec.MODULES[EmbeddingCollection.__name__] = EmbeddingCollection  # traced ops rebuild it
torchrec_ir.register(EmbeddingCollection)  # where torchrec has torchrec.ir
