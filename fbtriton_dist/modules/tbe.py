"""TableBatchedEmbedding: many embedding tables looked up and pooled in one launch."""

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from itertools import accumulate
from typing import Any, Literal

import torch
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.modules import fused_optim, host_stage, host_tier, tbe_args
from fbtriton_dist.modules.fused_optim import check_ema_tables
from fbtriton_dist.modules.tiers import RowCache, TieredTables, Views
from fbtriton_dist.ops import backends, vbe
from fbtriton_dist.ops.tbe import (
    BoundsCheck,
    BoundsMonitor,
    FusedOptimizer,
    TBELayout,
    capturing,
    tbe_lookup,
    tbe_lookup_backward,
)
from fbtriton_dist.ops.vbe import VBELayout
from fbtriton_dist.pooling import PoolingMode
from fbtriton_dist.storage import Storage

_STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TableBatchedEmbedding(nn.Module):
    """Pooled lookups into T features over ``len(tables)`` tables, FBGEMM's TBE conventions.

    Args:
        tables: ``[(num_embeddings E, embedding_dim D), ...]``, one per table.
        feature_table_map: table of each feature (several features may share one); default
            one feature per table.
        pooling: ``"sum"`` or ``"mean"`` (divided by the bag length; empty bags give zeros),
            or ``"none"`` (sequence embeddings, FBGEMM's ``PoolingMode.NONE``): the output is
            ``[N, max_D]``, one row per id in ``indices`` order, its table's D columns first
            and zeros after them (all tables of one D: exactly FBGEMM's ``[N, D]``).
        optimizer: None (weights are a plain Parameter with a dense, or ``sparse``, gradient)
            or a fused optimizer from ``fbtriton_dist.optim``, applied in backward in place.
        weights_dtype, output_dtype: storage of the rows and of the pooled output; sums are
            accumulated in fp32 whatever they are.
        weights: optional flat ``[sum(E_t * D_t)]`` storage to use for the rows (shared, for
            instance, with per-table parameters); with ``init_weights=False`` it is kept as is.
        bounds_check: out-of-range ids (and, with ``"error"``, NaN/inf per-sample weights)
            raise (``"error"``), are dropped with a warning
            (``"warn"``), or are not checked (``"ignore"``: the caller promises valid ids).
        backend: ``"auto"`` (Triton for CUDA weights, the fast CPU path ``"cpu"`` for CPU
            weights) or a name of ``ops.backends.names()``: ``"triton"``, ``"cpu"``,
            ``"reference"`` (the slow spec). A pooling, optimizer, dtype or device the
            backend (resolved for the weights' device) does not support raises ``ValueError``
            here, naming the backend and what it supports.
        stochastic_rounding: fused updates of fp16/bf16 weights round stochastically.
        max_gradient: gradient clipping of the fused update (FBGEMM's ``gradient_clipping``
            with ``max_gradient``): the upstream gradient's elements are clamped to
            ``[-max_gradient, max_gradient]`` before the rows' gradients are summed (before
            per-sample weights and mean pooling scale them, as FBGEMM's CPU TBE); None: off.
            Plain gradients (``optimizer=None``) are not clipped.
        max_norm: rows looked up whose L2 norm exceeds it are renormalised to it in place
            before the lookup, as ``torch.nn.Embedding(max_norm=)`` (scale
            ``max_norm / (norm + 1e-7)``); None: off.
        optimizer_state_dtypes: FBGEMM's option: ``{"momentum1" | "momentum2": dtype}``, the
            storage of a fused optimizer's state (``"fp16"``, ``"bf16"``, ``"fp32"``, a torch
            dtype or FBGEMM's ``SparseType``); the update is computed in fp32 and only the
            stored state rounded (to nearest). Default fp32. Not with cached storage tiers.
        feature_names: a name per feature, for error messages.
        plan_ahead: a training batch's backward plan (sorted row keys) is made on a side
            stream beside the forward (``ops.tbe.tbe_lookup``); None: on CUDA unless
            ``FBTD_TBE_AHEAD=0``; True on the CPU: in the forward, in order.
        storage: per table, where its rows live (``fbtriton_dist.storage.Storage``, a mapping
            of its fields, a tier name, or None: ``device``); None: all on ``device``. A
            ``cached`` / ``file`` table keeps its rows and optimizer state in a backing store
            and ``Storage.slots(E)`` of them in the flat weights (``modules/tiers.py``);
            ``split_embedding_weights`` / ``split_optimizer_states`` / ``state_dict`` give
            its whole table (flushed), ``split_slot_weights`` what the kernels read.
            Training a cached table needs a fused optimizer; its ids are always checked. All
            ``host`` on CUDA: weights and states in pinned host memory (``host_tier.py``).

    ``forward(indices [N], offsets [T*B+1], per_sample_weights [N] | None) -> [B, sum(D)]``.

    Example::

        tbe = TableBatchedEmbedding([(1000, 16), (50, 8)], feature_table_map=[0, 0, 1],
                                    optimizer=optim.RowWiseAdagrad(lr=0.1))
        out = tbe(indices, offsets)  # offsets of length 3 * B + 1 -> out [B, 16 + 16 + 8]

    A fused training step can be captured in a CUDA graph (``fbtriton_dist.graphs``): the
    step count (``step``) and the optimizer's hyper-parameters live on the device, where the
    backward reads and advances them; ``bounds_check="error"`` cannot be captured.
    """

    def __init__(
        self,
        tables: Sequence[tuple[int, int]],
        feature_table_map: Sequence[int] | None = None,
        pooling: Literal["sum", "mean", "none"] = "sum",
        optimizer: optim.Optimizer | None = None,
        weights_dtype: torch.dtype = torch.float32,
        output_dtype: torch.dtype = torch.float32,
        bounds_check: BoundsCheck = "error",
        device: torch.device | str | None = None,
        backend: str = "auto",
        stochastic_rounding: bool = True,
        sparse: bool = False,
        table_names: Sequence[str] | None = None,
        seed: int | None = None,
        weights: torch.Tensor | None = None,
        init_weights: bool = True,
        plan_ahead: bool | None = None,
        feature_names: Sequence[str] | None = None,
        storage: Sequence[Storage | dict | str | None] | None = None,
        max_gradient: float | None = None,
        max_norm: float | None = None,
        optimizer_state_dtypes: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.optimizer_state_dtypes = optim.state_dtype_names(optimizer_state_dtypes)
        self.max_gradient, self.max_norm = tbe_args.positive_or_none(
            max_gradient=max_gradient, max_norm=max_norm)
        tables, names, self.storage, ftm = tbe_args.table_arguments(
            tables, table_names, storage, feature_table_map)
        self.table_names = names
        tbe_args.check_kinds(pooling, weights_dtype, output_dtype)
        backends.check_choice(backend)
        where = weights.device if weights is not None else torch.empty(0, device=device).device
        backends.check_supported(
            backend,
            device=where,
            pooling=pooling,
            dtypes=(weights_dtype, output_dtype),
            tiers=[s.tier for s in self.storage],
        )
        self._check_tier_device(where)
        tbe_args.check_bounds_check(bounds_check)

        self.tables = tables
        # rows of each table in the flat weights and states: its cache slots when cached
        self.slot_tables = [(s.slots(E), D) for s, (E, D) in zip(self.storage, tables,
                                                                  strict=True)]
        self.feature_table_map = ftm
        self.feature_names = tbe_args.feature_names_of(feature_names, len(ftm))
        self.pooling = pooling
        self.output_dtype = output_dtype
        self.bounds_check = bounds_check
        self._bounds_monitor = BoundsMonitor()
        self._vbe_layouts: dict[tuple, VBELayout] = {}
        self.backend = backend
        self.plan_ahead = plan_ahead
        self.stochastic_rounding = stochastic_rounding
        self.sparse = sparse
        # fused updates taken, counted on the device by the backward (so that a replayed CUDA
        # graph of the step advances it); ``step`` reads it on the host
        self.register_buffer("_step", torch.zeros(1, dtype=torch.int64, device=device),
                             persistent=False)
        # rowwise_adagrad_with_counter's (FBGEMM's name): 1 + the largest row counter
        self.register_buffer("max_counter", torch.ones(1, device=device), persistent=False)
        self.row_counter_max: torch.Tensor | None = None
        """[1] fp32: the largest row counter the ``max_counter`` refreshes take instead of this
        module's own (``fused_optim.set_row_counter_max``); None: its own."""
        self._stager = host_stage.Stager()  # host tables' training lookups on CUDA
        self._hyper: torch.Tensor | None = None  # optim.hyper_parameters on the device
        self._hyper_of: optim.Optimizer | None = None
        # drawn on the CPU (host metadata: also under ``with torch.device("meta")``)
        self.seed = (
            int(torch.randint(2**31 - 1, (), device="cpu").item()) if seed is None else int(seed)
        )

        # the flat layout of the weights and states (slots of cached tables)
        self.table_offsets = [0, *accumulate(E * D for E, D in self.slot_tables)]
        self.table_row_offsets = [0, *accumulate(E for E, _ in self.slot_tables)]
        self.set_layout_buffers(device)
        pin = where.type == "cuda"
        caches = {t: RowCache(names[t], s, E, D, weights_dtype, pin)
                  for t, (s, (E, D)) in enumerate(zip(self.storage, tables, strict=True))
                  if s.cached}
        self._tiers = TieredTables(caches) if caches else None
        if self._tiers is not None:  # pinned backing stores; slot maps where they go
            self._tiers.place(where)

        if weights is None:
            weights = host_tier.empty(self.table_offsets[-1], weights_dtype, where, self.storage)
        elif weights.shape != (self.table_offsets[-1],) or weights.dtype != weights_dtype:
            raise ValueError(
                f"weights: expected a flat {weights_dtype} tensor of {self.table_offsets[-1]} "
                f"elements, got {weights.dtype} {tuple(weights.shape)}"
            )
        host_tier.check_weights(weights, names, self.storage)
        self.weights = nn.Parameter(weights, requires_grad=True)
        for name in optim.STATE_BUFFERS:  # those the optimizer lacks stay empty
            self.register_buffer(name, torch.zeros(0, device=device))
        self.optimizer = None
        self.set_optimizer(optimizer)
        if init_weights:
            self.reset_parameters()

    def set_layout_buffers(self, device) -> None:
        """(Re)make the per-feature layout (``TBELayout``'s tensors, non-persistent buffers)
        on ``device`` from host metadata: at construction, again after every ``_apply``
        (``to_empty`` leaves them garbage), and where a module built on meta looks up on a
        device (``op_spec.skeleton``)."""
        ftm, tables = self.feature_table_map, self.slot_tables
        dims = [tables[t][1] for t in ftm]
        per_feature = {
            "w_offsets": [self.table_offsets[t] for t in ftm],
            "dims": dims,
            "row_offsets": [self.table_row_offsets[t] for t in ftm],
            "D_offsets": [0, *accumulate(dims)],
            "rows": [tables[t][0] for t in ftm],
        }
        for name, values in per_feature.items():
            self.register_buffer(
                f"_{name}", torch.tensor(values, dtype=torch.int64, device=device), persistent=False
            )

    def _apply(self, fn, recurse=True):
        host_tier.place_module(self, fn)  # host tables on CUDA: into mapped host memory
        super()._apply(fn, recurse)  # cached tables: the slots move, the backing store stays
        host_tier.place_module(self)
        self.set_layout_buffers(self.weights.device)
        backends.check_supported(self.backend, device=self.weights.device)  # a new device
        self._check_tier_device(self.weights.device)
        if self._tiers is not None:
            self._tiers.place(self.weights.device)
        return self

    def _check_tier_device(self, device) -> None:
        """Refuse what the tiers cannot do on ``device``: ``host`` tables mixed with others
        where ``host`` is mapped host memory (``modules/host_tier.py``); cached tables on meta."""
        kind = torch.device(device).type
        host_tier.check_mixed(self.table_names, self.storage, device)
        for name, s in zip(self.table_names, self.storage, strict=True):
            if s.cached and kind == "meta":
                raise ValueError(f"table '{name}': storage tier {s.tier!r} on the meta device "
                                 "is not supported yet (its backing store is allocated at once)")

    def set_optimizer(self, optimizer: optim.Optimizer | None) -> None:
        """Switch the fused optimizer (None: plain gradients). State is kept when the kind of
        optimizer stays (only hyper-parameters change), else allocated anew at zero."""
        states = optim.spec_of(optimizer).states if optimizer is not None else ()
        if optimizer is not None:
            backends.check_supported(self.backend, device=self.weights.device,
                                     optimizer=optim.spec_of(optimizer).name)
            check_ema_tables(optimizer, self._tiers is not None)
        same_kind = type(optimizer) is type(self.optimizer)
        self.optimizer = optimizer
        # a fused module's weights are updated in backward, not by torch optimizers
        self.weights.requires_grad_(optimizer is None)
        # autograd only calls backward when an input requires grad: with a fused optimizer the
        # weights don't, so this empty tensor does (FBGEMM's placeholder trick)
        self._anchor = torch.zeros(0, requires_grad=True) if optimizer is not None else None
        if same_kind:
            return
        # each state fp32 (or its optimizer_state_dtypes entry), one value per row or per
        # element (optim.REGISTRY); unused buffers stay empty
        sizes = {
            s.name: self.table_row_offsets[-1] if s.per_row else self.table_offsets[-1]
            for s in states
        }
        self._check_state_dtypes(optimizer, sizes)
        for name in optim.STATE_BUFFERS:
            numel = sizes.get(name, 0)
            dtype = _STATE_DTYPES[self.optimizer_state_dtypes.get(name, "fp32")]
            setattr(self, name, host_tier.zeros(numel, dtype, self.weights.device, self.storage))
        if self._tiers is not None:  # the backing stores keep each state in its dtype too
            dtypes = {s.name: _STATE_DTYPES[self.optimizer_state_dtypes.get(s.name, "fp32")]
                      for s in states}
            for cache in self._tiers.caches.values():
                cache.backing.set_states(states, dtypes)
        self.max_counter.fill_(1.0)
        self.step = 0

    def _check_state_dtypes(self, optimizer, sizes) -> None:
        """``optimizer_state_dtypes`` names only states ``optimizer`` has."""
        low = {k: v for k, v in self.optimizer_state_dtypes.items() if v != "fp32"}
        if optimizer is None or not low:
            return
        name = optim.spec_of(optimizer).name
        allowed = sorted(s.name for s in optim.spec_of(optimizer).states if not s.fp32_only)
        if extra := sorted(set(low) - set(allowed)):  # fp32_only: fp32 as FBGEMM keeps them
            raise ValueError(f"optimizer_state_dtypes: expected keys among {allowed} (the states "
                             f"of {name}{' not kept in fp32' * (len(allowed) < len(sizes))}), "
                             f"got {extra}")

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    @property
    def total_dim(self) -> int:
        """sum(D) over the features: the width of the pooled output ``[B, sum(D)]``."""
        return sum(self.tables[t][1] for t in self.feature_table_map)

    @property
    def on_meta(self) -> bool:
        """Its own buffers (step counter, layout, optimizer state) are on the meta device
        (built there; ``to_empty`` gives them memory)."""
        return self._step.is_meta

    @property
    def step(self) -> int:
        """Fused optimizer updates taken (Adam's t, the rounding seed's clock). Kept on the
        device, where the backward advances it without a host sync: reading it here syncs
        (logs, checkpoints); setting it writes the device counter in place, which a captured
        CUDA graph of the step keeps reading."""
        return int(self._step.item())

    @step.setter
    def step(self, value: int) -> None:
        self._step.fill_(int(value))

    def _device_hyper(self) -> torch.Tensor:
        """The fused optimizer's hyper-parameters on the weights' device, rewritten in place
        when the optimizer changes (a captured step reads the new values at its next replay)."""
        device = self.weights.device
        if self._hyper is None or self._hyper.device != device:
            self._hyper = torch.zeros(len(optim.HYPER_FIELDS), dtype=torch.float32, device=device)
            self._hyper_of = None
        if self._hyper_of is not self.optimizer:
            if capturing(device):
                raise RuntimeError(
                    "TableBatchedEmbedding: the fused optimizer changed between the last eager "
                    "step and a CUDA graph capture; run one step eagerly after set_optimizer / "
                    "set_learning_rate before capturing"
                )
            values = torch.tensor(optim.hyper_parameters(self.optimizer), dtype=torch.float32)
            self._hyper.copy_(values)
            self._hyper_of = self.optimizer
        return self._hyper

    def reset_parameters(self) -> None:
        """Rows of each table uniform in [-1/sqrt(E), 1/sqrt(E)] (TorchRec's default); states 0."""
        with torch.no_grad():
            for (E, _), view in zip(self.tables, self.split_embedding_weights(), strict=True):
                view.uniform_(-1.0 / math.sqrt(E), 1.0 / math.sqrt(E))
        self.reset_optimizer_states()

    def reset_optimizer_states(self) -> None:
        """Optimizer states and ``step`` to 0 (after ``to_empty`` they hold garbage); cached
        tables' caches are emptied."""
        with torch.no_grad():
            for name in optim.STATE_BUFFERS:
                getattr(self, name).zero_()
            self.max_counter.fill_(1.0)
            if self._tiers is not None:
                for cache in self._tiers.caches.values():
                    for state in cache.backing.states.values():
                        state.zero_()
                self._tiers.invalidate()
        self.step = 0

    # -- storage tiers (modules/tiers.py)
    @property
    def tiered(self) -> bool:
        """Some table is ``cached`` or ``file`` (its rows behind a row cache)."""
        return self._tiers is not None

    def _slot_views(self, t: int) -> Views:
        """Cached table ``t``'s slots in the flat weights and states."""
        C, D = self.slot_tables[t]
        e0, r0 = self.table_offsets[t], self.table_row_offsets[t]
        states = optim.spec_of(self.optimizer).states if self.optimizer is not None else ()
        return (self.weights.detach()[e0 : e0 + C * D].view(C, D),
                {s.name: getattr(self, s.name)[r0 : r0 + C] if s.per_row
                 else getattr(self, s.name)[e0 : e0 + C * D].view(C, D) for s in states})

    def _slot_views_key(self) -> tuple:
        """What ``_slot_views`` are made of: the flat weights' and states' addresses (the
        tables' offsets in them are fixed)."""
        states = optim.spec_of(self.optimizer).states if self.optimizer is not None else ()
        return (self.weights.data_ptr(), *(getattr(self, s.name).data_ptr() for s in states))

    def flush(self) -> None:
        """Write every dirty cached row (and its optimizer state) back to its backing store.
        Nothing to do without cached tables."""
        if self._tiers is not None:
            self._tiers.flush(self._slot_views)

    def invalidate(self) -> None:
        """Forget the cached rows without writing them back: after the backing store (the
        tensors ``split_embedding_weights`` / ``split_optimizer_states`` give for a cached
        table) was written."""
        if self._tiers is not None:
            self._tiers.invalidate()

    def resident_rows(self) -> dict[str, list[int]]:
        """Per cached table: the rows in its cache, ascending."""
        if self._tiers is None:
            return {}
        return {self.table_names[t]: rows for t, rows in self._tiers.resident().items()}

    def slot_maps_on_device(self) -> dict[str, bool]:
        """Per cached table: its slot map lives on the cache's device (``FBTD_SLOT_MAP``)."""
        return {} if self._tiers is None else self._tiers.maps_on_device()

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor,
                 batch_size_per_feature_per_rank: Sequence[Sequence[int]] | None = None,
                 tiers: Collection[str] | None = None) -> None:
        """Start reading the rows of a coming batch (``forward``'s arguments) that the cached
        tables do not hold, with their optimizer state, from the backing stores on a worker
        thread while this step computes; the next lookup loads them from there, waiting only
        for what is not read yet (``modules/tiers.py``). Exact whatever happens in between: a
        row written back after its copy was read is loaded from the backing store. Nothing to
        do without cached tables. ``tiers``: only the tables on these tiers (e.g.
        ``("file",)``); None: every cached table."""
        if self._tiers is None:
            return
        if batch_size_per_feature_per_rank is not None:
            layout = self.vbe_layout(batch_size_per_feature_per_rank)
            offsets = vbe.padded_offsets(offsets, layout)
        self._tiers.prefetch(indices, offsets, self.feature_table_map, tiers=tiers,
                             views=self._slot_views)

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Per cached table: distinct rows looked up, misses, evictions, write-backs, and the
        prefetch's rows and microseconds (``RowCache.STATS``)."""
        if self._tiers is None:
            return {}
        return {self.table_names[t]: v for t, v in self._tiers.stats().items()}

    def _layout(self) -> TBELayout:
        """The lookup's layout, made again only when ``set_layout_buffers`` made new buffers
        or the weights' dtype changed (a dataclass and sums over the tables: host time at
        every lookup otherwise)."""
        cached = self.__dict__.get("_layout_cache")
        if cached is not None and cached.dims is self._dims and (
                cached.row_align == self._row_align()):
            return cached
        self._layout_cache = TBELayout(
            w_offsets=self._w_offsets,
            dims=self._dims,
            row_offsets=self._row_offsets,
            D_offsets=self._D_offsets,
            rows=self._rows,
            max_D=max(D for _, D in self.tables),
            total_D=sum(self.tables[t][1] for t in self.feature_table_map),
            feature_table_map=self.feature_table_map,
            table_rows=[E for E, _ in self.slot_tables],
            table_names=self.table_names,
            feature_names=self.feature_names,
            row_align=self._row_align(),
        )
        return self._layout_cache

    def _row_align(self) -> int:
        """The kernels' vector width for rows (``tbe_args.row_align``), per weights dtype."""
        size = self.weights.element_size()
        align = self.__dict__.get("_row_aligns", {}).get(size)
        if align is None:
            align = tbe_args.row_align(self.slot_tables, self.table_offsets, size)
            self._row_aligns = {**self.__dict__.get("_row_aligns", {}), size: align}
        return align

    def resolved_backend(self) -> str:
        """What runs the lookups: ``backend`` with ``"auto"`` resolved for the weights' device."""
        device = self.weights.device
        key = (self.backend, device)
        cached = self.__dict__.get("_resolved_backend")
        if cached is None or cached[0] != key:  # resolved again after a move or a new backend
            cached = self._resolved_backend = (key, backends.resolve(self.backend, device))
        return cached[1]

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        feature_requires_grad: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """``indices`` [N], ``offsets`` [T*B+1] feature-major -> pooled ``[B, sum(D)]``.

        ``feature_requires_grad`` (FBGEMM's): a ``[T]`` tensor, one flag per feature; the
        ``per_sample_weights`` of a feature whose flag is 0 get no gradient (0 in their
        ``.grad``), as FBGEMM's ``grad_indice_weights``; the rows' gradients and the fused
        update are unchanged. With ``batch_size_per_feature_per_rank`` (FBGEMM's VBE:
        ``B[t][r]`` bags of feature ``t`` from rank ``r``), ``offsets`` has ``sum(B) + 1``
        entries and the output is FBGEMM's 1-D VBE layout (``ops.vbe``)."""
        if feature_requires_grad is not None and per_sample_weights is not None:
            per_sample_weights = tbe_args.weights_without_grad(
                offsets, per_sample_weights, feature_requires_grad, len(self.feature_table_map),
                batch_size_per_feature_per_rank)
        return self.lookup(indices, offsets, per_sample_weights,
                           batch_size_per_feature_per_rank=batch_size_per_feature_per_rank)

    def vbe_layout(self, batch_size_per_feature_per_rank: Sequence[Sequence[int]]) -> VBELayout:
        """The padded layout of these batch sizes (kept for the last few seen)."""
        key = (tuple(map(tuple, batch_size_per_feature_per_rank)), self.weights.device)
        layout = self._vbe_layouts.get(key)
        if layout is None:
            dims = [self.tables[t][1] for t in self.feature_table_map]
            layout = vbe.vbe_layout(batch_size_per_feature_per_rank, dims, self.weights.device)
            if len(self._vbe_layouts) >= 16:
                self._vbe_layouts.clear()
            self._vbe_layouts[key] = layout
        return layout

    def lookup(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        grad_targets: Sequence[torch.Tensor] | None = None,
        batch_size_per_feature_per_rank: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """``forward``, with, when not fused, the weight gradient delivered to
        ``grad_targets`` (one ``[E_t, D_t]`` tensor per table, e.g. per-table parameters that
        are views of ``weights``) instead of to ``weights``."""
        if batch_size_per_feature_per_rank is not None:
            if self.pooling == "none":
                raise ValueError(
                    "batch_size_per_feature_per_rank: variable batch per feature is for pooled "
                    "lookups; pooling='none' already returns one row per id of any batch"
                )
            layout = self.vbe_layout(batch_size_per_feature_per_rank)
            padded = self.lookup(indices, vbe.padded_offsets(offsets, layout), per_sample_weights,
                                 grad_targets)
            return vbe.vbe_output(padded, layout)
        backend = self.resolved_backend()
        # a lookup on the CPU without autograd never reaches the fused update: its state is not
        # gathered (host time at every inference forward); on a device it is (capture checks)
        fused = self._fused() if torch.is_grad_enabled() or not self.weights.is_cpu else None
        train = fused is not None and torch.is_grad_enabled()
        if self._tiers is not None:
            self._check_tier_grad(fused, grad_targets)

            def remap(indices=indices, offsets=offsets, train=train, hold=False):
                return self._tiers.remap(indices, offsets, self.feature_table_map,
                                         self._feature_name, self._slot_views, train,
                                         views_key=self._slot_views_key(), hold=hold)

            # captured (GraphedStep): the map runs before each replay, on the step's ids
            indices = (self._tiers.slots_in_graph(indices, offsets, remap)
                       if capturing(self.weights.device) else remap())
        if train and self.training and isinstance(self.optimizer, fused_optim.WHOLE_TABLE_STEP):
            # EMA in place, ensemble: their whole-table steps (reading the step syncs)
            if capturing(self.weights.device):
                fused_optim.refuse_whole_table_steps([self.optimizer],
                                                     "a CUDA graph capture of a training lookup")
            fused_optim.whole_table_step(self, self.step + 1)
        if train and self.training and isinstance(self.optimizer, optim.RowWiseAdagradGlobalDecay):
            fused_optim.global_decay(self, indices, offsets)  # FBGEMM's DECOUPLE_GLOBAL
        if self.max_norm is not None:
            self._renorm(indices, offsets)
        weights, layout = self.weights, self._layout()
        staged = self._stager.stage(self, indices, offsets, layout, fused) if train else None
        if staged is not None:  # host tables: the batch's rows in device memory
            weights, indices, layout, fused = staged.lookup_arguments()
        out = tbe_lookup(
            weights,
            indices,
            offsets,
            per_sample_weights,
            layout=layout,
            pooling=int(PoolingMode.of(self.pooling)),
            output_dtype=self.output_dtype,
            backend=backend,
            bounds_check=self.bounds_check,
            fused=fused,
            anchor=self._anchor if fused is not None and torch.is_grad_enabled() else None,
            sparse=self.sparse,
            grad_targets=grad_targets,
            table_offsets=self.table_offsets,
            monitor=self._bounds_monitor,
            plan_ahead=self.plan_ahead,
        )
        if self._tiers is not None and train:
            self._tiers.track(out)
        if staged is not None:
            staged.attach(out)  # the rows back after the update
        return out

    def _feature_name(self, f: int) -> str:
        return self.feature_names[f] if self.feature_names else f"feature_{f}"

    def _check_tier_grad(self, fused, grad_targets) -> None:
        """A cached table trains through the fused optimizer only: a plain gradient (and a
        torch optimizer's state) would follow cache slots, not rows."""
        if fused is not None or not torch.is_grad_enabled():
            return
        if self.weights.requires_grad or any(g.requires_grad for g in grad_targets or ()):
            tiered = [n for n, s in zip(self.table_names, self.storage, strict=True) if s.cached]
            raise ValueError(
                f"tables {tiered} (cached storage tiers): training needs a fused optimizer "
                "(optimizer= / apply_optimizer_in_backward); look up under torch.no_grad() "
                "for inference"
            )

    def _renorm(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        """``max_norm``: renormalise the rows of the batch in place (``torch.embedding_renorm_``
        per table, as ``torch.nn.Embedding``); ids outside a table are left to the bounds
        check of the lookup."""
        if capturing(self.weights.device):
            raise RuntimeError("TableBatchedEmbedding(max_norm=): the renormalisation finds the "
                               "batch's unique rows on the host; it cannot be captured")
        T = len(self.feature_table_map)
        B = (offsets.numel() - 1) // T
        bounds = offsets[::B].tolist() if B else [0] * (T + 1)
        with torch.no_grad():
            for t, (rows, D) in enumerate(self.slot_tables):
                feats = [f for f, tt in enumerate(self.feature_table_map) if tt == t]
                ids = torch.cat([indices[bounds[f] : bounds[f + 1]] for f in feats])
                ids = ids[(ids >= 0) & (ids < rows)].to(torch.int64)
                if ids.numel():
                    view = self.weights.detach()[self.table_offsets[t] : self.table_offsets[t + 1]]
                    torch.embedding_renorm_(view.view(rows, D), ids, self.max_norm, 2.0)

    def _fused(self) -> FusedOptimizer | None:
        if self.optimizer is None:
            return None
        return FusedOptimizer(
            optimizer=self.optimizer,
            momentum1=self.momentum1,
            momentum2=self.momentum2,
            counters=fused_optim.counter_tensors(self),
            step=self._step,
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed,
            max_gradient=self.max_gradient,
            hyper=self._device_hyper(),
        )

    def lookup_backward(
        self,
        grad_output: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        psw_grad: bool = False,
        rows: bool = True,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """The backward of a ``lookup`` of this batch made without autograd (the registered
        op's, ``ops.tbe.tbe_lookup_backward``): (per-sample weight gradient or None, per-table
        weight gradients, or None when the fused optimizer updated the rows in place;
        ``rows=False``: neither)."""
        if self._tiers is not None:
            raise NotImplementedError(
                "lookup_backward (traced / exported lookups) of cached storage tiers: not "
                "supported yet"
            )
        return tbe_lookup_backward(
            grad_output,
            self.weights,
            indices,
            offsets,
            per_sample_weights,
            layout=self._layout(),
            pooling=int(PoolingMode.of(self.pooling)),
            backend=self.resolved_backend(),
            bounds_check=self.bounds_check,
            fused=self._fused(),
            table_offsets=self.table_offsets,
            psw_grad=psw_grad,
            rows=rows,
        )

    def poll_bounds_check(self) -> None:
        """With ``bounds_check="warn"`` on CUDA the ids a batch dropped are reported at the next
        lookup, without a host sync; this reports the last batch's now (waiting for it)."""
        self._bounds_monitor.poll()

    def split_slot_weights(self) -> list[torch.Tensor]:
        """Per-table views ``[rows, D_t]`` of the flat weights as the kernels read them: the
        whole table, or a cached table's slots (writes go to the module)."""
        w = self.weights.detach()
        return [
            w[self.table_offsets[t] : self.table_offsets[t + 1]].view(E, D)
            for t, (E, D) in enumerate(self.slot_tables)
        ]

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """Per-table ``[E_t, D_t]`` tables: views of the flat weights, or for a cached table
        its backing store, flushed (after writing into it, call ``invalidate``)."""
        self.flush()
        slots = self.split_slot_weights()
        return [self._tiers.caches[t].backing.weight if s.cached else slots[t]
                for t, s in enumerate(self.storage)]

    def split_optimizer_states(self) -> list[list[torch.Tensor]]:
        """Per table, views of its optimizer states in the registry's order
        (``optim.REGISTRY``): ``[E]`` for a per-row state (rowwise Adagrad's), ``[E, D]`` for
        a per-element one (Adagrad's, Adam's two moments); [] for SGD or none. A cached
        table's are its backing store's, flushed."""
        states = optim.spec_of(self.optimizer).states if self.optimizer is not None else ()
        self.flush()
        out = []
        for t, (E, D) in enumerate(self.slot_tables):
            if self.storage[t].cached:
                backing = self._tiers.caches[t].backing.states
                out.append([backing[s.name] for s in states])
                continue
            r0, r1 = self.table_row_offsets[t], self.table_row_offsets[t + 1]
            e0, e1 = self.table_offsets[t], self.table_offsets[t + 1]
            out.append([
                getattr(self, s.name)[r0:r1] if s.per_row
                else getattr(self, s.name)[e0:e1].view(E, D)
                for s in states
            ])
        return out

    def set_learning_rate(self, lr: float) -> None:
        """Change the fused optimizer's learning rate (a scheduler's hook). The kernels read
        it from device memory, rewritten here in place: a captured CUDA graph of the training
        step uses the new rate from its next replay (no re-capture)."""
        if self.optimizer is None:
            raise ValueError("set_learning_rate: this module has no fused optimizer")
        self.optimizer = dataclasses.replace(self.optimizer, lr=lr)
        self._device_hyper()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Cached tables: ``weights`` and the states hold their whole tables (flushed), laid
        out as without a cache (``storage=None``)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._tiers is None:
            return
        tables = self.split_embedding_weights()
        destination[prefix + "weights"] = torch.cat(
            [w.reshape(-1).to(self.weights.device, self.weights.dtype) for w in tables])
        states = optim.spec_of(self.optimizer).states if self.optimizer is not None else ()
        per_table = self.split_optimizer_states()
        for i, s in enumerate(states):
            destination[prefix + s.name] = torch.cat(
                [p[i].reshape(-1).to(self.weights.device) for p in per_table])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Cached tables: the whole tables of ``weights`` and the states go to the backing
        stores, the others to the flat buffers; the caches are emptied."""
        if self._tiers is not None:
            self._load_tiered(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.invalidate()

    def _load_tiered(self, state_dict, prefix) -> None:
        self.flush()  # the cache's rows that the state dict does not replace stay
        states = optim.spec_of(self.optimizer).states if self.optimizer is not None else ()
        parts = [("weights", None, self.split_slot_weights(), self.split_embedding_weights())]
        per_table = self.split_optimizer_states()
        for i, s in enumerate(states):
            parts.append((s.name, s.per_row, None, [p[i] for p in per_table]))
        for key, per_row, _, whole in parts:
            value = state_dict.get(prefix + key)
            if value is None:
                continue
            sizes = [w.numel() for w in whole]
            if value.numel() != sum(sizes):
                shapes = [tuple(w.shape) for w in whole]
                raise ValueError(
                    f"{prefix}{key}: expected {sum(sizes)} elements (tables "
                    f"{dict(zip(self.table_names, shapes, strict=True))}), got {value.numel()} "
                    f"{tuple(value.shape)}"
                )
            flat = getattr(self, key).detach().clone()
            at = 0
            for t, (w, n) in enumerate(zip(whole, sizes, strict=True)):
                src = value.reshape(-1)[at : at + n]
                at += n
                if self.storage[t].cached:
                    with torch.no_grad():
                        w.view(-1).copy_(src)
                    continue
                if per_row:
                    a, b = self.table_row_offsets[t], self.table_row_offsets[t + 1]
                else:
                    a, b = self.table_offsets[t], self.table_offsets[t + 1]
                flat[a:b] = src
            state_dict[prefix + key] = flat

    def get_extra_state(self) -> dict:  # read from the device counters
        return {"step": self.step, **fused_optim.counter_extra_state(self)}

    def set_extra_state(self, state: dict) -> None:
        self.step = int(state["step"])  # written in place
        fused_optim.set_counter_extra_state(self, state)

    def extra_repr(self) -> str:
        return (
            f"tables={self.tables}, feature_table_map={self.feature_table_map}, "
            f"pooling={self.pooling}, optimizer={self.optimizer}, "
            f"weights_dtype={self.weights.dtype}, backend={self.backend}"
            + (f", max_gradient={self.max_gradient}" if self.max_gradient is not None else "")
            + (f", max_norm={self.max_norm}" if self.max_norm is not None else "")
            + ("".join(f", {n}: {st}" for n, st in zip(self.table_names, self.storage,
                                                      strict=True) if st.tier != "device"))
        )
