"""EmbeddingBagCollection: TorchRec's unsharded module on our TableBatchedEmbedding.

Same constructor, same KeyedJaggedTensor in / KeyedTensor out, same state_dict keys
(``embedding_bags.<table>.weight``, shapes [E, D]) as ``torchrec.EmbeddingBagCollection``.
Each table's weight is a real ``nn.EmbeddingBag`` parameter, and a view into the flat buffer of
one TableBatchedEmbedding per (dtype, pooling, ``host`` tier or not) group, so one kernel
launch serves the group.
"""

import functools
from collections.abc import Collection, Mapping, Sequence
from itertools import accumulate
from typing import List, Optional  # noqa: UP035 (TorchRec's stable interface spells them so)

import torch
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.modules import ebc_op, host_tier, op_spec, portable, torchrec_ir
from fbtriton_dist.modules.managed import ManagedCollisionCollection, managed_forward
from fbtriton_dist.modules.table_groups import (
    OpLayout,
    TableGroups,
    check_storage,
    refuse_data_parallel,
)
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.pooling import PoolingMode
from fbtriton_dist.sparse import (
    EmbeddingBagConfig,
    JaggedBatch,
    KeyedJaggedTensor,
    KeyedTensor,
    keyed_tensor,
    kjt_to_batch,
    vbe_kjt_to_batch,
)

DATA_TYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
POOLINGS = {m.name: m.label for m in (PoolingMode.SUM, PoolingMode.MEAN)}
"""TorchRec's pooled ``PoolingType`` names -> the TBE's ``pooling`` (``PoolingMode`` labels)."""


def embedding_names(tables: Sequence) -> list[str]:
    """The output key of every (table, feature), in config order, as TorchRec names them: the
    feature's name, or ``feature@table`` for a feature name more than one table (or one
    table twice) lists."""
    features = [f for cfg in tables for f in cfg.feature_names]
    return [
        f"{f}@{cfg.name}" if features.count(f) > 1 else f
        for cfg in tables
        for f in cfg.feature_names
    ]


class EmbeddingBagCollection(TableGroups):
    """Drop-in for ``torchrec.EmbeddingBagCollection``: pooled embeddings of many tables.

    Args:
        tables: ``torchrec.EmbeddingBagConfig`` per table (``num_embeddings``,
            ``embedding_dim``, ``feature_names``, ``pooling`` SUM/MEAN, ``data_type``
            FP32/FP16/BF16, ``init_fn`` / ``weight_init_min``/``max``).
        is_weighted: whether the input KeyedJaggedTensor carries per-id weights.
        device: where the tables live; ``"meta"`` allocates nothing.
        backend, bounds_check: passed to each TableBatchedEmbedding.
        managed: table name -> ``id_manager.IdManagerConfig``: managed tables (dynamic ids;
            ``modules/managed.py``), whose raw int64 ids are remapped to slots before the
            lookup (``id_managers``, a ``ManagedCollisionCollection``; its ``metrics()``).
        storage: table name -> ``fbtriton_dist.storage.Storage`` (or a mapping of its fields,
            or a tier name): where its rows live (``docs/storage.md``); others on ``device``.
            A ``cached`` / ``file`` table's parameter ``embedding_bags.<t>.weight`` holds its
            cache slots; ``state_dict()`` gives its whole table (flushed, a host tensor) under
            that key, and a load writes there; ``flush()`` writes dirty rows back. Training it
            needs a fused optimizer (``apply_optimizer_in_backward``).
        optimizer_state_dtypes: FBGEMM's option (TorchRec passes it in ``fused_params``):
            ``{"momentum1" | "momentum2": "fp32" | "fp16" | "bf16"}`` (or torch dtypes,
            FBGEMM's ``SparseType``), the storage of the fused optimizer's state of every
            table; the update runs in fp32 (``TableBatchedEmbedding``'s). Default fp32.

    ``forward(features: KeyedJaggedTensor) -> KeyedTensor`` with one key per (table, feature),
    in config order (``feature@table`` where tables share a feature name), ``[B, sum(D)]`` fp32
    values; KJT keys no table uses are ignored. Weights are ordinary parameters (any torch optimizer
    works); parameters annotated by ``apply_optimizer_in_backward`` are instead updated by the
    fused TBE backward (the classes of ``optim.REGISTRY``: torch SGD, Adagrad, Adam, torchrec
    RowWiseAdagrad).
    """

    # host-side state torch.jit.script need not type (the scripted forward reads none of it)
    __jit_ignored_attributes__ = ["_groups", "_tbes", "_embedding_bag_configs", "_table_configs",
                                  "_op_layout", "optimizer_state_dtypes"]

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],  # noqa: UP006 (TorchRec's exact annotation)
        is_weighted: bool = False,
        device: Optional[torch.device] = None,
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
        self._is_weighted = is_weighted
        self._embedding_bag_configs = list(tables)
        self._table_configs = self._embedding_bag_configs
        # no device: the default one (``with torch.device("meta")`` included)
        self._device = torch.device(device) if device is not None else torch.get_default_device()
        for cfg in tables:
            if not cfg.feature_names:
                cfg.feature_names = [cfg.name]
        self.embedding_bags = nn.ModuleDict()
        # (dtype, pooling, is_host): host tables own their TBEs on every device (host_tier.py)
        self._groups: dict[tuple[torch.dtype, str, bool], list[int]] = {}
        for t, cfg in enumerate(tables):
            key = (self._dtype(cfg), self._pooling(cfg), host_tier.is_host(tiers[t]))
            self._groups.setdefault(key, []).append(t)

        self._tbes = []  # a TableBatchedEmbedding per group (not submodules: the parameters are)
        self._feature_order: list[str] = []
        views: dict[int, torch.Tensor] = {}  # what the kernels read: a cached table's slots
        whole: dict[int, torch.Tensor] = {}  # the whole tables: a cached table's backing store
        for (dtype, pooling, _), members in self._groups.items():
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
                pooling=pooling,
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
            self._feature_order += [f for t in members for f in tables[t].feature_names]
            self._tbes.append(tbe)
        for t, cfg in enumerate(tables):  # in config order, as TorchRec
            dtype, pooling = self._dtype(cfg), self._pooling(cfg)
            self.embedding_bags[cfg.name] = nn.EmbeddingBag(
                views[t].shape[0],  # a cached table's parameter: its slots
                cfg.embedding_dim,
                mode=pooling,
                _weight=views[t],
                include_last_offset=True,
                device=self._device,
                dtype=dtype,
            )
            # nn.EmbeddingBag draws N(0, 1) at construction (TorchRec's EBC builds one per
            # table and then runs reset_parameters): draw it too, so a seeded build matches.
            # A cached table whose uniform init overwrites it draws into scratch instead (its
            # backing store, a file maybe bigger than RAM, is then written once, not twice)
            if tiers[t].cached and _init_overwrites(cfg):
                draw_normal_like(whole[t])
            else:
                nn.init.normal_(whole[t])

        self._embedding_names = embedding_names(tables)
        # the scripted forward's plain lookup (``portable.pooled``), in config order
        self._config_features = [f for cfg in tables for f in cfg.feature_names]
        self._config_feature_tables = [t for t, cfg in enumerate(tables) for _ in cfg.feature_names]
        self._config_means = [
            self._pooling(cfg) == "mean" for cfg in tables for _ in cfg.feature_names
        ]
        self._config_names = [f"{f}@{cfg.name}" for cfg in tables for f in cfg.feature_names]
        # output feature j (config order) is position _config_positions[j] of _feature_order
        group_positions = {
            (t, j): i
            for i, (t, j) in enumerate(
                (t, j)
                for members in self._groups.values()
                for t in members
                for j in range(len(tables[t].feature_names))
            )
        }
        self._config_positions = [
            group_positions[(t, j)] for t, cfg in enumerate(tables)
            for j in range(len(cfg.feature_names))
        ]
        self._lengths_per_embedding = [
            cfg.embedding_dim for cfg in tables for _ in cfg.feature_names
        ]
        # output columns come out group after group; src puts them back in config order
        first_feature = [0, *accumulate(len(c.feature_names) for c in tables)]
        produced = [
            first_feature[t] + j
            for members in self._groups.values()
            for t in members
            for j in range(len(tables[t].feature_names))
        ]
        dims = self._lengths_per_embedding
        start, col = {}, 0
        for k in produced:
            start[k], col = col, col + dims[k]
        src = [start[k] + d for k in range(len(dims)) for d in range(dims[k])]
        self._column_order = None if src == list(range(col)) else torch.tensor(src, device="cpu")
        self._op_layout = OpLayout(
            feature_order=self._feature_order,
            embedding_names=self._embedding_names,
            lengths_per_embedding=self._lengths_per_embedding,
            config_features=self._config_features,
            config_feature_tables=self._config_feature_tables,
            weighted=self._is_weighted,
            config_means=self._config_means,
            config_names=self._config_names,
        )
        self._alias_states()
        self._tier_hooks()
        self._portable_export = False  # ir.encapsulate_ir_modules sets it
        self.reset_parameters()
        # after the weights' draws: its seed is drawn as a ManagedCollisionCollection's
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

    @staticmethod
    def _pooling(cfg) -> str:
        name = getattr(cfg.pooling, "name", str(cfg.pooling))
        if name not in POOLINGS:
            raise ValueError(
                f"table '{cfg.name}' pooling: expected one of {list(POOLINGS)}, got {name}"
            )
        return POOLINGS[name]

    def is_weighted(self) -> bool:
        return self._is_weighted

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    @property
    def device(self) -> torch.device:
        return self._device

    def set_portable_export(self, enabled: bool = True) -> None:
        """``torch.export`` records the lookup as the portable op that ``ir.deserialize``
        rebuilds (``ir.encapsulate_ir_modules`` turns it on)."""
        self._portable_export = bool(enabled)

    def portable_export_enabled(self) -> bool:
        """Whether ``torch.export`` records the portable op (``set_portable_export``)."""
        return self._portable_export

    def reset_parameters(self) -> None:
        """Each table's ``init_fn`` (TorchRec's default: uniform in weight_init_min/max), and
        fused optimizer states and steps to zero: after ``to_empty(device=...)`` this gives the
        weights a module built on that device with the same seed starts from."""
        self._reset_tables(_init_table)
        if getattr(self, "id_managers", None) is not None:  # managed tables: empty maps
            self.id_managers.reset()

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """KeyedJaggedTensor (keys in any order) -> KeyedTensor, keys in config order.

        Traced (``torch.fx``, ``torch.compile``, ``torch.export``) or on meta tensors, the
        lookup is one registered op, ``torch.ops.fbtriton_dist.ebc_lookup`` (``ebc_op``).
        Under ``torch.jit.script`` (inference) it is ``portable.pooled``, plain torch ops."""
        if torch.jit.is_scripting():
            return self._scripted_forward(features)
        return self._forward(features)

    def _scripted_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        keys = features.keys()
        for k in keys:
            if keys.count(k) > 1:
                raise ValueError("KeyedJaggedTensor keys must be unique")
        order = [keys.index(f) for f in self._config_features]
        params: list[torch.Tensor] = []
        for bag in self.embedding_bags.values():
            params.append(bag.weight)
        lengths = features.lengths().view(len(keys), features.stride())
        weights = features.weights_or_none() if self._is_weighted else None
        values = portable.pooled(
            features.values(), lengths, weights, params, self._config_feature_tables,
            self._config_means, order, self._config_names,
        )
        return KeyedTensor(
            keys=self._embedding_names,
            length_per_key=self._lengths_per_embedding,
            values=values,
            key_dim=1,
        )

    @torch.jit.unused
    def _forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if ebc_op.compiling_around(self, features):
            return ebc_op.run_eagerly(self._forward_body, features)
        return self._forward_body(features)

    @torch.jit.unused
    def _forward_body(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if self.id_managers is not None:
            features = managed_forward(self, features)
        if ebc_op.traced(features):
            self._refuse_traced_tiers()
            return ebc_op.forward(self, features)
        if features.variable_stride_per_key():
            return self._vbe_forward(features)
        batch = kjt_to_batch(features, self._feature_order, self._is_weighted)
        values = self.lookup(batch)
        return keyed_tensor(self._embedding_names, self._lengths_per_embedding, values)

    def _vbe_forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """A batch size per feature (VBE): each feature's bags pooled once (the TBE's VBE
        lookup), then every output feature's rows expanded by the KJT's inverse indices to
        ``[B, sum(D)]``, as TorchRec's EBC does (one gather; its backward sums the expanded
        gradients back into each bag)."""
        batch, rows = vbe_kjt_to_batch(features, self._feature_order, self._is_weighted)
        sizes, B = batch.batch_sizes, batch.batch_size
        if rows is None:  # every feature has the same batch: the fixed batch it is
            fixed = JaggedBatch(batch.indices, batch.offsets, batch.per_sample_weights, B)
            return keyed_tensor(self._embedding_names, self._lengths_per_embedding,
                                self.lookup(fixed))
        pooled, base, flat_at, f0 = [], {}, 0, 0
        for tbe, params, fused, indices, offsets, psw, _ in self._group_batches(batch):
            T = tbe.num_features
            out = tbe.lookup(indices, offsets, psw, grad_targets=None if fused else params,
                             batch_size_per_feature_per_rank=[[n] for n in sizes[f0:f0 + T]])
            dims = [tbe.tables[t][1] for t in tbe.feature_table_map]
            for i in range(T):  # where feature f0 + i's [B_f, D] block starts in the flat
                base[f0 + i] = flat_at
                flat_at += sizes[f0 + i] * dims[i]
            pooled.append(out)
            f0 += T
        flat = pooled[0] if len(pooled) == 1 else torch.cat(pooled)
        columns = []  # output feature j (config order): _feature_order position p
        for j, D in enumerate(self._lengths_per_embedding):
            p = self._config_positions[j]
            cols = torch.arange(D, device=flat.device)
            columns.append(base[p] + rows[p][:, None] * D + cols[None, :])
        index = torch.cat(columns, dim=1)
        values = flat.index_select(0, index.reshape(-1)).view(B, sum(self._lengths_per_embedding))
        return keyed_tensor(self._embedding_names, self._lengths_per_embedding, values)

    def _group_batches(self, batch: JaggedBatch, bound: list | None = None):
        """Per (dtype, pooling) group, bound to the parameters' storage: (tbe, its parameters,
        its fused optimizer or None, its indices, offsets, per-sample weights, (a, b): where
        its ids are in ``batch.indices``). ``bound``: (parameters, fused optimizer) of each
        group, the TBEs already bound to them (``op_spec.bind``); default: this module's."""
        for g, (members, tbe, indices, offsets, psw, span) in enumerate(
                self._group_slices(batch)):
            if bound is not None:
                params, fused = bound[g]
            else:
                params = self.group_params(members)
                self._bind(tbe, params)
                fused = self.sync_optimizer(tbe, members)
                if fused is not None:
                    refuse_data_parallel("EmbeddingBagCollection")
            yield tbe, params, fused, indices, offsets, psw, span

    def _group_slices(self, batch: JaggedBatch):
        """Per (dtype, pooling) group: (its table indices, tbe, its indices, offsets,
        per-sample weights, (a, b): where its ids are in ``batch.indices``)."""
        sizes = batch.batch_sizes or [batch.batch_size] * len(self._feature_order)
        bag_start = [0, *accumulate(sizes)]  # first bag of each feature (VBE or not)
        T_seen, ids_at = 0, None
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            T = tbe.num_features
            indices, offsets, psw = batch.indices, batch.offsets, batch.per_sample_weights
            a, b = 0, indices.numel()
            if len(self._tbes) > 1:  # this group's features only
                if ids_at is None:  # one host read: where each feature's ids start
                    at = torch.tensor(bag_start, device=offsets.device)
                    ids_at = offsets.index_select(0, at).tolist()
                a, b = ids_at[T_seen], ids_at[T_seen + T]
                indices = indices[a:b]
                offsets = offsets[bag_start[T_seen] : bag_start[T_seen + T] + 1] - a
                psw = psw[a:b] if psw is not None else None
            yield members, tbe, indices, offsets, psw, (a, b)
            T_seen += T

    def prefetch(self, features: KeyedJaggedTensor,
                 tiers: Collection[str] | None = None) -> None:
        """Start reading the rows of a coming batch ``features`` (``forward``'s argument) that
        the cached tables do not hold, with their optimizer state, on each tiered TBE's worker
        thread (``TableBatchedEmbedding.prefetch``); that batch's lookup loads them from
        there. Call it after the current batch's forward, e.g. before its backward: a lookup
        takes the prefetch in flight. Exact whatever comes between (``modules/tiers.py``).
        Nothing to do without cached tables; managed tables (``managed=``) stay on
        ``device``, so their raw ids are not mapped here. ``tiers``: only the tables on these
        tiers (e.g. ``("file",)``); None: every cached table."""
        if not any(tbe.tiered for tbe in self._tbes):
            return
        sizes = None
        if features.variable_stride_per_key():
            batch, rows = vbe_kjt_to_batch(features, self._feature_order, self._is_weighted)
            if rows is None:  # one batch size for all: the fixed batch the forward looks up
                batch = JaggedBatch(batch.indices, batch.offsets, None, batch.batch_size)
            else:
                sizes = batch.batch_sizes
        else:
            batch = kjt_to_batch(features, self._feature_order, self._is_weighted)
        f0 = 0
        for _, tbe, indices, offsets, _, _ in self._group_slices(batch):
            T = tbe.num_features
            if tbe.tiered:
                tbe.prefetch(indices, offsets, None if sizes is None
                             else [[n] for n in sizes[f0:f0 + T]], tiers=tiers)
            f0 += T

    def lookup(self, batch: JaggedBatch, bound: list | None = None) -> torch.Tensor:
        """Pooled ``[B, sum(D)]`` of a batch in ``_feature_order``, columns in config order
        (``bound``: as ``_group_batches``')."""
        pooled = [
            tbe.lookup(indices, offsets, psw, grad_targets=None if fused else params)
            for tbe, params, fused, indices, offsets, psw, _ in self._group_batches(batch, bound)
        ]
        values = pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)
        if self._column_order is not None:
            values = values.index_select(1, self._column_order.to(values.device))
        return values

    def lookup_backward(self, batch: JaggedBatch, grad: torch.Tensor, psw_grad: bool,
                        update: bool, bound: list | None = None):
        """``lookup``'s backward (the registered ops'): (the per-sample weights' gradient in
        batch order or None, each table's weight gradient in config order, None for a fused
        table). ``update``: only apply the fused groups' optimizers to their rows in place;
        else every gradient, without touching the rows."""
        if self._column_order is not None:
            order = self._column_order.to(grad.device)
            grad = torch.empty_like(grad).index_copy_(1, order, grad)  # back to group order
        grads, grad_psw, col = {}, None, 0
        if psw_grad and not update:
            grad_psw = torch.zeros_like(batch.per_sample_weights)
        groups = self._groups.values()
        for (tbe, _, fused, indices, offsets, psw, (a, b)), members in zip(
            self._group_batches(batch, bound), groups, strict=True
        ):
            width = tbe.total_dim
            g = grad[:, col : col + width].contiguous()
            col += width
            if update and fused is None:
                continue
            g_psw, g_tables = tbe.lookup_backward(
                g, indices, offsets, psw, psw_grad=grad_psw is not None, rows=update or not fused
            )
            if g_psw is not None:
                grad_psw[a:b] = g_psw
            for t, g_t in zip(members, g_tables or [None] * len(members), strict=True):
                grads[t] = g_t
        return grad_psw, [grads.get(t) for t in range(len(self._embedding_bag_configs))]

    def extra_repr(self) -> str:
        groups = ", ".join(f"{len(m)} x {dt} {pool}" + (" host" if host else "")
                           for (dt, pool, host), m in self._groups.items())
        return f"tables: {groups}, is_weighted={self._is_weighted}"


NORMAL_CHUNK = 1 << 22
"""Elements per draw of :func:`draw_normal_like` (16 MiB of fp32 scratch)."""


def draw_normal_like(weight: torch.Tensor, chunk: int | None = None) -> None:
    """Advance the global CPU generator as ``weight.normal_()`` would, without writing
    ``weight``: N(0, 1) values of its dtype drawn into a scratch buffer of ``chunk`` (default
    ``NORMAL_CHUNK``) elements, piece after piece. CPU ``normal_`` of n >= 16 contiguous values
    takes one draw per value, and 16 more when n is not a multiple of 16 (the tail is drawn
    again): every piece but the last is a multiple of 16 long and the last is at least 16
    long with n's remainder, so the pieces take the draws one ``normal_`` of n takes
    (``tests/modules/test_tiers_init.py``)."""
    n = weight.numel()
    chunk = max(16, (chunk or NORMAL_CHUNK) // 16 * 16)
    if n <= chunk + 15:
        torch.empty(n, dtype=weight.dtype).normal_()
        return
    scratch = torch.empty(chunk + 15, dtype=weight.dtype)
    left = n
    while left:
        piece = chunk if left - chunk >= 16 else left  # never a last piece under 16
        scratch[:piece].normal_()
        left -= piece


_FILLS = (nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.constant_,
          nn.init.zeros_, nn.init.ones_)
"""``torch.nn.init`` functions that set every value whatever it held."""


def _init_overwrites(cfg) -> bool:
    """Whether the table's init (:func:`_init_table`) sets every value whatever it held: no
    ``init_fn`` (uniform), or one of ``_FILLS`` (TorchRec's default ``init_fn`` is
    ``functools.partial(torch.nn.init.uniform_, a=..., b=...)``)."""
    fn = cfg.init_fn
    if isinstance(fn, functools.partial) and not fn.args:
        fn = fn.func
    return fn is None or fn in _FILLS


def _init_table(cfg, weight: torch.Tensor) -> None:
    """A table's ``init_fn``, else uniform in its weight_init_min/max (TorchRec's default)."""
    if cfg.init_fn is not None:
        cfg.init_fn(weight)
    else:
        weight.uniform_(cfg.get_weight_init_min(), cfg.get_weight_init_max())


op_spec.MODULES[EmbeddingBagCollection.__name__] = EmbeddingBagCollection  # traced ops rebuild it
torchrec_ir.register(EmbeddingBagCollection)  # where torchrec has torchrec.ir
