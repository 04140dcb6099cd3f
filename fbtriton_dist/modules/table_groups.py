"""What the unsharded collections (``EmbeddingBagCollection``, ``EmbeddingCollection``) share:
per-table parameters that are views into the flat buffer of one ``TableBatchedEmbedding`` per
group of tables, kept bound to it across ``.to()`` / ``load_state_dict(assign=True)``, and the
fused optimizer that ``apply_optimizer_in_backward`` annotations ask for."""

import copy
import dataclasses
import weakref
from collections.abc import Sequence

import torch
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.modules import host_tier
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.storage import Storage, storage_of

OP_STATES = ("_step", "momentum1", "momentum2")
"""A TableBatchedEmbedding's fused-optimizer state, as the registered lookup ops take it."""


@dataclasses.dataclass(kw_only=True, frozen=True)
class OpLayout:
    """What a collection's traced forward (``ebc_op.forward``, ``ec_op.forward``) reads from
    it besides tensors: host metadata fixed at construction (``TableGroups.op_layout()``).
    Lists, as the ops and ``KeyedTensor`` take them: read them, never change them."""

    feature_order: list[str]
    """The features of the groups, group after group: the order of the op's ``order`` and of
    the collection's ``lookup``."""
    embedding_names: list[str]
    """The output key of each (table, feature), config order."""
    lengths_per_embedding: list[int]
    """D of each output, config order."""
    config_features: list[str]
    """The KJT key of each output, config order (the portable lookup's features)."""
    config_feature_tables: list[int]
    """The table (config index) of each output."""
    weighted: bool = False
    """The KJT carries per-id weights (pooled lookups only)."""
    config_means: list[bool] = dataclasses.field(default_factory=list)
    """Pooled lookups: whether each output is a MEAN (else SUM) pooling."""
    config_names: list[str] = dataclasses.field(default_factory=list)
    """Pooled lookups: ``feature@table`` of each output (the portable op's messages)."""


_LIVE: "weakref.WeakValueDictionary[int, TableGroups]" = weakref.WeakValueDictionary()


def live_collection(key: int) -> "TableGroups | None":
    """The live collection whose ``id()`` is ``key`` (every one made, copied or unpickled
    registers itself), or None: ``torch.compile`` hands the traced ops' constant functions an
    ``id`` where some torch versions refuse a module."""
    return _LIVE.get(key)


class TableGroups(nn.Module):
    """Base of the collections. A subclass sets, in its ``__init__``:

    - ``_tables_attr``: the ``nn.ModuleDict`` attribute holding one module per table
      (TorchRec's name: ``embedding_bags`` / ``embeddings``), each with a ``weight``;
    - ``_table_configs``: the table configs, in config order;
    - ``_groups``: group key -> the config indices of its tables;
    - ``_tbes``: one TableBatchedEmbedding per group, in ``_groups`` order (not submodules:
      the per-table parameters are);
    - ``_op_layout``: its ``OpLayout``.

    What the traced ops (``ebc_op``, ``ec_op``, ``op_spec``) read of it: ``table_configs()``,
    ``tbe_groups()``, ``group_params()``, ``op_layout()``, ``op_states()`` and the subclass's
    ``lookup`` / ``lookup_backward``.
    """

    _tables_attr = "embedding_bags"
    _table_configs: list
    _groups: dict
    _tbes: list[TableBatchedEmbedding]
    _op_layout: OpLayout

    def __init__(self) -> None:
        super().__init__()
        _LIVE[id(self)] = self

    def __setstate__(self, state) -> None:  # pickle
        super().__setstate__(state)
        _LIVE[id(self)] = self

    def table_configs(self) -> list:
        """The table configs, in config order (a table's index here is its ``members`` id)."""
        return self._table_configs

    def group_params(self, members: Sequence[int]) -> list[nn.Parameter]:
        """The per-table parameters (``weight``) of the tables ``members`` (config indices)."""
        tables = getattr(self, self._tables_attr)
        return [tables[self._table_configs[t].name].weight for t in members]

    def tbe_groups(self) -> list[tuple[TableBatchedEmbedding, list[int]]]:
        """``(tbe, members)`` per group: its TableBatchedEmbedding and the config indices of
        its tables."""
        return list(zip(self._tbes, self._groups.values(), strict=True))

    def op_layout(self) -> OpLayout:
        """The host metadata the traced forward reads (``OpLayout``)."""
        return self._op_layout

    def __deepcopy__(self, memo):
        """A copy with its own tensors, as ``nn.Module``'s, whose parameters keep the
        ``apply_optimizer_in_backward`` annotations (``Parameter.__deepcopy__`` drops them):
        the copy trains with the same fused optimizer, on its own state."""
        other = self.__class__.__new__(self.__class__)
        memo[id(self)] = other
        _LIVE[id(other)] = other
        for key, value in self.__dict__.items():
            other.__dict__[key] = copy.deepcopy(value, memo)
        everything = range(len(self._table_configs))
        for p, q in zip(self.group_params(everything), other.group_params(everything),
                        strict=True):
            for attr in ("_optimizer_classes", "_optimizer_kwargs"):
                if hasattr(p, attr):
                    setattr(q, attr, copy.deepcopy(getattr(p, attr), memo))
        return other

    def _bind(self, tbe: TableBatchedEmbedding, params: list[nn.Parameter]) -> None:
        """Make sure the TBE reads the parameters' current storage: after ``.to()``, a
        ``load_state_dict(assign=True)`` or a ``.data`` swap, pack them into one buffer again
        and make the parameters views of it."""
        flat = tbe.weights
        esize = flat.element_size()
        bound = all(
            p.device == flat.device
            and p.dtype == flat.dtype
            and p.is_contiguous()
            and p.data_ptr() == flat.data_ptr() + a * esize
            for p, a in zip(params, tbe.table_offsets, strict=False)
        )
        if bound:
            return
        packed = host_tier.place(torch.cat([p.detach().reshape(-1) for p in params]), tbe.storage)
        tbe.weights = nn.Parameter(packed, requires_grad=False)
        for p, view in zip(params, tbe.split_slot_weights(), strict=True):
            p.data = view

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()``...: convert the parameters, then rebuild each
        group's buffer from them; the TBEs' own buffers (layout, optimizer state) only move."""
        super()._apply(fn, recurse)
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            params = self.group_params(members)
            tbe.weights = nn.Parameter(params[0].detach().new_empty(0), requires_grad=False)
            if tbe.on_meta:  # built on meta: to_empty (reset_parameters zeroes the state)
                tbe.to_empty(device=params[0].device)
            else:
                tbe.to(params[0].device)
            self._bind(tbe, params)
        self._device = self._tbes[0].weights.device
        self._alias_states()
        return self

    def _alias_states(self) -> None:
        """Register the fused-optimizer state of each group that has one
        (``TableBatchedEmbedding``'s step counter and momenta) as non-persistent buffers
        ``_fused_<g>_<state>`` of this module, the same tensors: a traced graph (FX,
        ``torch.export``, ``torch.compile``) then takes them as inputs like the weights, so a
        copy of the graph updates its own. Called whenever a TBE replaces them (construction,
        ``.to()``, a new fused optimizer). Groups without one register nothing."""
        for g, tbe in enumerate(self._tbes):
            for name in OP_STATES:
                key = f"_fused_{g}_{name.lstrip('_')}"
                if tbe.optimizer is None:
                    self._buffers.pop(key, None)
                    self._non_persistent_buffers_set.discard(key)
                elif self._buffers.get(key) is not getattr(tbe, name):
                    self.register_buffer(key, getattr(tbe, name), persistent=False)

    def op_states(self) -> list[torch.Tensor]:
        """The registered ops' ``states``: ``OP_STATES`` of each fused group, in group order."""
        return [
            self._buffers[f"_fused_{g}_{name.lstrip('_')}"]
            for g, tbe in enumerate(self._tbes)
            if tbe.optimizer is not None
            for name in OP_STATES
        ]

    def _fused_optimizer(self, members: Sequence[int]) -> optim.Optimizer | None:
        """The fused optimizer asked for by ``apply_optimizer_in_backward`` on this group's
        parameters (all or none of them, with one optimizer), or None."""
        tables = self._modules[self._tables_attr]._modules  # the tensors, also under FX tracing
        params = [tables[self._table_configs[t].name]._parameters["weight"] for t in members]
        specs = [optim.in_backward_annotation(p) for p in params]
        if all(s is None for s in specs):
            return None
        names = [self._table_configs[t].name for t in members]
        if any(s != specs[0] for s in specs):
            raise ValueError(
                f"tables {names}: apply_optimizer_in_backward must give tables of one group "
                f"({self._group_what}) the same optimizer (or none); got {specs}"
            )
        cls, kwargs = specs[0]
        return optim.from_torch(cls, dict(kwargs), f"tables {names}")

    _group_what = "dtype, pooling and host tier"

    def sync_optimizer(self, tbe: TableBatchedEmbedding, members: Sequence[int]):
        """Give the group's TBE the fused optimizer its parameters are annotated with."""
        fused = self._fused_optimizer(members)
        if fused != tbe.optimizer:
            tbe.set_optimizer(fused)
            tbe.weights.requires_grad_(False)  # gradients go to the per-table parameters
            self._alias_states()
        return fused

    def fused_optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        """The fused optimizer's state, keyed as the sharded module's:
        ``<tables>.<table>.weight.<i>`` (rowwise Adagrad ``[E, 1]``, others ``[E, D]``) and
        ``step``. Views of the live state: torch.distributed.checkpoint loads in place."""
        out = {"step": torch.tensor(max((tbe.step for tbe in self._tbes), default=0))}
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            if self.sync_optimizer(tbe, members) is None:
                continue
            for t, states in zip(members, tbe.split_optimizer_states(), strict=True):
                for i, state in enumerate(states):
                    key = f"{self._tables_attr}.{self._table_configs[t].name}.weight.{i}"
                    out[key] = state.view(-1, 1) if state.dim() == 1 else state
        return out

    def load_fused_optimizer_state_dict(self, state: dict) -> None:
        """After ``fused_optimizer_state_dict()`` was loaded in place: restore the step (and
        empty the caches of cached tables, whose backing stores were written)."""
        for tbe in self._tbes:
            tbe.step = int(state["step"])
            tbe.invalidate()

    # -- storage tiers (``storage=``; modules/tiers.py)
    def _whole_tables(self) -> dict[int, tuple[TableBatchedEmbedding, torch.Tensor]]:
        """Config index -> (its group's TBE, its whole ``[E, D]`` table: the backing store,
        flushed) of every cached table."""
        out = {}
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            if tbe.tiered:
                whole = tbe.split_embedding_weights()
                for i, t in enumerate(members):
                    if tbe.storage[i].cached:
                        out[t] = (tbe, whole[i])
        return out

    def set_learning_rate(self, lr: float) -> None:
        """Change the learning rate of every table's fused optimizer (a scheduler's hook):
        the ``apply_optimizer_in_backward`` annotations and the TBEs alike, so the next
        forward keeps it. ValueError when no table has a fused optimizer."""
        tables = self._modules[self._tables_attr]._modules
        fused = 0
        for tbe, members in zip(self._tbes, self._groups.values(), strict=True):
            if self._fused_optimizer(members) is None:
                continue
            for t in members:
                weight = tables[self._table_configs[t].name]._parameters["weight"]
                optim.set_in_backward_lr(weight, lr)
            self.sync_optimizer(tbe, members)
            fused += 1
        if not fused:
            raise ValueError("set_learning_rate: no table of this collection has a fused "
                             "optimizer (apply_optimizer_in_backward)")

    def flush(self) -> None:
        """Write every dirty row of the cached tables (and its optimizer state) back to its
        backing store (``state_dict`` does it first)."""
        for tbe in self._tbes:
            tbe.flush()

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Per cached table: distinct rows looked up, misses, evictions, write-backs
        (cumulative; ``TableBatchedEmbedding.cache_stats``)."""
        return {k: v for tbe in self._tbes for k, v in tbe.cache_stats().items()}

    def table_storage(self) -> dict[str, Storage]:
        """Each table's storage tier (``storage=``), by name."""
        return {self._table_configs[t].name: tbe.storage[i]
                for tbe, members in zip(self._tbes, self._groups.values(), strict=True)
                for i, t in enumerate(members)}

    def has_cached_tables(self) -> bool:
        """Does a table sit on a tier with a row cache (``cached``, ``file``)?"""
        return any(tbe.tiered for tbe in self._tbes)

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls it first: a cached table's parameter holds its cache's
        slots, not its rows, so a script of it would read the wrong rows: refused."""
        cached = [name for name, s in self.table_storage().items() if s.cached]
        if cached:
            raise NotImplementedError(
                f"torch.jit.script of a collection with cached tables {cached}: their "
                "parameters hold the caches' slots, not the tables' rows; build the collection "
                "without storage=, load this one's state_dict() (the whole tables) into it and "
                "script that"
            )
        return self

    def needs_eager_lookup(self) -> bool:
        """Does the lookup keep Python state a graph cannot hold: a row cache's slot map or
        managed tables' id maps? ``torch.compile`` then runs it between its graphs."""
        return self.has_cached_tables() or getattr(self, "id_managers", None) is not None

    def _refuse_traced_tiers(self) -> None:
        if self.has_cached_tables():
            raise NotImplementedError(
                "cached storage tiers (cached, file) under torch.fx, torch.export, "
                "torch.compile(fullgraph=True) or on meta tensors: their row cache's slot map "
                "is Python state a graph cannot hold; look up eagerly (torch.compile without "
                "fullgraph=True does: the lookup runs between its graphs)"
            )

    def _key(self, t: int) -> str:
        return f"{self._tables_attr}.{self._table_configs[t].name}.weight"

    def _tier_hooks(self) -> None:
        """With cached tables: ``state_dict`` gives each one's whole table (its backing store,
        flushed; a host tensor) under its usual key, and a load writes it there."""
        if not any(tbe.tiered for tbe in self._tbes):
            return
        self.register_state_dict_post_hook(_save_whole_tables)
        self.register_load_state_dict_pre_hook(_load_whole_tables)
        self.register_load_state_dict_post_hook(_invalidate_caches)

    def _load_whole(self, state_dict, prefix) -> None:
        for t, (_, whole) in self._whole_tables().items():
            key = prefix + self._key(t)
            value = state_dict.get(key)
            if value is None:
                continue
            if tuple(value.shape) != tuple(whole.shape):
                raise ValueError(
                    f"table '{self._table_configs[t].name}' ({key}): the checkpoint's shape is "
                    f"{list(value.shape)}, this module's {list(whole.shape)}"
                )
            with torch.no_grad():
                whole.copy_(value)
            (param,) = self.group_params([t])
            state_dict[key] = param.detach()  # the slots: loaded onto themselves

    def _reset_tables(self, init) -> None:
        """Fused optimizer states and steps to zero, then ``init(cfg, weight)`` per table (a
        cached table's whole table, in its backing store)."""
        if self._device.type == "meta":
            return
        for tbe in self._tbes:
            tbe.reset_optimizer_states()
        whole = self._whole_tables()
        for t, (cfg, weight) in enumerate(zip(self._table_configs, self.group_params(
                range(len(self._table_configs))), strict=True)):
            with torch.no_grad():
                init(cfg, whole[t][1] if t in whole else weight)
        for tbe in self._tbes:
            tbe.invalidate()


def _save_whole_tables(module: TableGroups, state_dict, prefix, local_metadata) -> None:
    for t, (_, whole) in module._whole_tables().items():  # noqa: SLF001 (its own hook)
        state_dict[prefix + module._key(t)] = whole  # noqa: SLF001


def _load_whole_tables(module: TableGroups, state_dict, prefix, *args) -> None:
    module._load_whole(state_dict, prefix)  # noqa: SLF001 (its own hook)


def _invalidate_caches(module: TableGroups, incompatible_keys) -> None:
    for tbe, _ in module.tbe_groups():
        tbe.invalidate()


def check_storage(storage, configs: Sequence, managed) -> list[Storage]:
    """Each table's ``Storage`` (config order) from a collection's ``storage=`` (table name
    -> ``Storage`` / mapping / tier name); unknown names, and cached tables that are also
    managed, are refused by name."""
    storage = dict(storage or {})
    names = [c.name for c in configs]
    unknown = sorted(set(storage) - set(names))
    if unknown:
        raise ValueError(f"storage: unknown tables {unknown}, expected some of {names}")
    out = [storage_of(storage.get(n), n) for n in names]
    both = sorted(n for n, s in zip(names, out, strict=True)
                  if s.tier != "device" and n in (managed or {}))
    if both:
        raise ValueError(f"tables {both}: managed tables (managed=) on a storage tier other "
                         "than 'device' are not supported yet")
    return out


def refuse_data_parallel(what: str) -> None:
    """A fused optimizer under DistributedDataParallel is wrong: every rank would update its
    own full replica with its own gradients. TorchRec's DistributedModelParallel does that to a
    module it has no sharder for; say what to do instead."""
    if torch.nn.parallel.DistributedDataParallel._get_active_ddp_module() is not None:
        raise RuntimeError(
            f"fbtriton_dist.{what} with a fused optimizer "
            "(apply_optimizer_in_backward) runs inside DistributedDataParallel: every rank "
            "would replicate every table and update it with its own gradients only. TorchRec's "
            "DistributedModelParallel does this when it has no sharder for our module; pass "
            f"sharders=[fbtriton_dist.sharding.dmp.{what}Sharder()] "
            "to DistributedModelParallel, or shard the model with fbtriton_dist.shard(model, plan)"
        )
