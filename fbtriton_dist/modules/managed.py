"""Managed tables (dynamic ids) for the unsharded collections: raw int64 ids remapped to slots
before the lookup, zero collisions while the live ids fit, admission and eviction.

* ``IdManager``: one table's id map as buffers (``keys``, ``counts``, ``last_seen``,
  ``sketch``, ``step``, ``seed``, cumulative ``totals``: all in ``state_dict()``, with
  ``config``, the manager's config as ``CONFIG_FIELDS``: a load checks it and names the table
  and the key that differ), its remap (``ops/id_remap.py``; the spec:
  ``reference/id_remap.py``) and its metrics. A map saved by several owners (a sharded
  collection) loads into it through ``sharding.managed.state.ManagedLoadPlanner``, which hands
  it a ``SavedOwners`` (``load_saved_owners`` says what it becomes).
* ``ManagedCollisionCollection``: the managers of a collection's managed tables (TorchRec's
  name); ``remap(features, update)`` returns the KeyedJaggedTensor with every managed feature's
  ids replaced by slots, and the slots that got a new id.
* ``reset_rows``: before the lookup, each fresh slot's row is re-initialised (the table's
  ``init_fn``, else uniform in ``weight_init_min/max``; drawn on the CPU from a generator seeded
  by the manager's seed and step, so a resumed run draws what an uninterrupted one would) and
  its fused optimizer state set to zero.
* ``ManagedCollisionEmbeddingBagCollection`` / ``ManagedCollisionEmbeddingCollection``:
  TorchRec's construction, ``(embedding collection, managed collision collection,
  return_remapped_features)``, ``forward -> (output, remapped KJT or None)``.

Where ours differs from TorchRec's MCH modules: a new id gets its slot in the step it is admitted
(TorchRec's waits for the next ``eviction_interval``); TorchRec's LFU admits a new id only
over a less frequent resident one, ours always evicts the least frequent slot not used this
step; the managers are configured by ``IdManagerConfig`` (capacity, lru / lfu / ttl / none,
``min_count`` admission) and a TorchRec ``MCHManagedCollisionModule`` is read into one
(``from_torchrec``: its zch_size and policy only); ids are never pre-hashed into
``input_hash_size``; the buffers and their state-dict names are ours; the default row is row
``capacity`` (TorchRec's: the last row too, ``zch_size - 1``). A plain torch optimizer's
state (not a fused one) of an evicted row is not reset. A single training forward per step
is assumed: every training-mode forward is one step of the managers' clocks; eval mode only
looks up. Not yet: tracing / scripting / export of a managed collection; ``shard()`` takes
our collections built with ``managed=`` (``sharding/managed/sharded.py``), not the TorchRec-style
wrappers.
"""

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fbtriton_dist.id_manager import POLICY_CODE, IdManagerConfig, managed_configs
from fbtriton_dist.modules import ebc_op
from fbtriton_dist.ops.id_remap import STATS, IdTable, id_remap
from fbtriton_dist.sparse import KeyedJaggedTensor, kjt_key_ranges, kjt_with_values

_BUFFERS = ("keys", "counts", "last_seen", "sketch")
CONFIG_FIELDS = ("capacity", "eviction", "ttl_steps", "admission.min_count",
                 "admission.sketch_width", "admission.sketch_depth")
"""The ``config`` entry of a map's state dict: these keys of its ``IdManagerConfig``, int64
(``eviction`` as its code, ``ttl_steps`` 0 when unset)."""
PER_OWNER = ("sketch", "step", "seed", "totals")
"""The buffers that each owner of a sharded map keeps for itself (the others are per slot)."""
_GOLDEN = 0x9E3779B97F4A7C15


def config_tensor(config: IdManagerConfig) -> torch.Tensor:
    """``[len(CONFIG_FIELDS)]`` int64 CPU: what a checkpoint records of a map's config."""
    a = config.admission
    return torch.tensor([config.capacity, POLICY_CODE[config.eviction], config.ttl_steps or 0,
                         a.min_count, a.sketch_width, a.sketch_depth], dtype=torch.int64)


def check_config(table: str, config: IdManagerConfig, saved: torch.Tensor, key: str) -> None:
    """Raise a ValueError naming the table, the config key and the state-dict key when the
    checkpoint's ``config`` entry ``saved`` differs from ``config``."""
    mine, theirs = config_tensor(config).tolist(), saved.reshape(-1).tolist()
    if len(theirs) != len(mine):
        raise ValueError(f"table '{table}' id_manager: expected {len(mine)} config values "
                         f"({', '.join(CONFIG_FIELDS)}) under '{key}', got {len(theirs)}")
    names = {v: k for k, v in POLICY_CODE.items()}
    for name, a, b in zip(CONFIG_FIELDS, theirs, mine, strict=True):
        if a != b:
            a, b = (names.get(a, a), names.get(b, b)) if name == "eviction" else (a, b)
            raise ValueError(f"table '{table}' id_manager.{name}: the checkpoint's is {a!r}, "
                             f"this module's {b!r} (state-dict key '{key}')")


def owner_seed(seed: int, owner: int, owners: int) -> int:
    """The seed owner ``owner`` of ``owners`` of a table of seed ``seed`` draws its fresh rows
    from (one owner: ``seed``); ``sharding/managed/sharded.py``."""
    if owners == 1:
        return seed
    return (seed + _GOLDEN * (owner + 1)) % (1 << 62)


def table_seed(seed_of_owner_0: int, owners: int) -> int:
    """The table's seed back from its first owner's (``owner_seed`` inverted)."""
    return seed_of_owner_0 if owners == 1 else (seed_of_owner_0 - _GOLDEN) % (1 << 62)


def fold_sketch(blocks: Sequence[torch.Tensor], depth: int, width: int) -> torch.Tensor:
    """``[depth, width]``: the sum of admission sketches ``[depth, w]`` of other widths, each
    folded (``w > width``: counters ``b mod width`` summed) or repeated (``w < width``) to
    ``width``. A counter is ``h & (w - 1)`` of the id's hash (powers of two), so every id's
    counters are still never below its count: at worst an id is admitted early."""
    out = torch.zeros(depth, width, dtype=torch.int64)
    for b in blocks:
        if b.numel() == 0 or width == 0:
            continue
        b = b.to("cpu", torch.int64)
        w = b.shape[1]
        out += b.reshape(depth, w // width, width).sum(1) if w >= width else b.repeat(1, width // w)
    return out


@dataclass
class SavedOwners:
    """A managed table's map as saved by other owners than the loading module's (staged by
    ``sharding.managed.state.ManagedLoadPlanner`` in place of the per-owner entries of the
    state dict; the per-slot ``keys``, ``counts``, ``last_seen`` and the rows load by row as
    always). The tensors are filled by the DCP load."""

    table: str
    owners: list[tuple[int, int]]
    """``(first row, slots)`` of every saved owner, in row order."""
    step: torch.Tensor
    """``[owners]`` (``[]`` from an unsharded save): every owner's clock (one value)."""
    seed: torch.Tensor
    """``[owners]`` / ``[]``: each owner's seed (``owner_seed`` of the table's)."""
    totals: torch.Tensor
    """``[owners, len(STATS)]`` / ``[len(STATS)]``: each owner's cumulative stats."""
    sketch: dict[int, torch.Tensor] = field(default_factory=dict)
    """saved owner -> its ``[depth, w]`` sketch, for the saved owners whose hash range meets
    the loading rank's (all of them for a single owner)."""

    def last_step(self) -> int:
        return int(self.step.max()) if self.step.numel() else 0

    def table_seed(self) -> int:
        return table_seed(int(self.seed.reshape(-1)[0]), len(self.owners))

    def total(self) -> torch.Tensor:
        return self.totals.reshape(-1, len(STATS)).sum(0)


def load_saved_owners(saved: SavedOwners, config: IdManagerConfig) -> dict[str, torch.Tensor]:
    """The per-owner buffers of a single owner of all ``config.capacity`` slots (an unsharded
    map, a table-wise or data-parallel shard) loading ``saved``: ``step`` (the saved clock),
    ``seed`` (the table's), ``totals`` (the owners' summed), ``sketch`` (``fold_sketch`` of
    the owners'). Its slots are the table's rows, so each entry stays at its saved row."""
    depth = config.admission.sketch_depth if config.sketch_width else 0
    return {"step": torch.tensor(saved.last_step()), "seed": torch.tensor(saved.table_seed()),
            "totals": saved.total(),
            "sketch": fold_sketch(list(saved.sketch.values()), depth, config.sketch_width)}


def saved_owners_of(state_dict: Mapping, prefix: str) -> SavedOwners | None:
    """The ``SavedOwners`` staged under one of ``prefix``'s per-owner keys, if any."""
    for k in ("owners", *PER_OWNER):
        value = state_dict.get(prefix + k)
        if isinstance(value, SavedOwners):
            return value
    return None


class IdManager(nn.Module):
    """One managed table's id map: raw ids -> slots ``[0, capacity)``, default row
    ``capacity``. ``remap(ids [N] int64, update) -> (slots [N], fresh [M], step)``."""

    def __init__(self, name: str, config: IdManagerConfig, device=None,
                 backend: str = "auto") -> None:
        super().__init__()
        self.name, self.config, self.backend = name, config, backend
        self._table = IdTable(config, name, device=device)
        for b in _BUFFERS:
            self.register_buffer(b, getattr(self._table, b))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        with torch.random.fork_rng(devices=[]):  # the global RNG draws weights only
            seed = int(torch.randint(2**62, (), device="cpu"))
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.int64, device=device))
        self.register_buffer("totals", torch.zeros(len(STATS), dtype=torch.int64, device=device))
        self.register_buffer("last", self._table.stats, persistent=False)
        self._step: int | None = None  # host mirror of ``step``

    def reset(self) -> None:
        """Empty the map (every slot free, counters, sketch, step and totals zero) and draw
        a new seed: ``reset_parameters`` after ``to_empty``, or a fresh start."""
        if self.keys.is_meta:
            return
        with torch.no_grad():
            for b in ("keys", "counts", "sketch", "step", "totals", "last"):
                getattr(self, b).zero_()
            self.last_seen.fill_(-1)
            with torch.random.fork_rng(devices=[]):
                self.seed.fill_(int(torch.randint(2**62, (), device="cpu")))
        self.reindex()

    def reindex(self) -> None:
        """The map's buffers were rewritten in place (a reset, a load): rebuild the remap's
        index from them and read the step from the device again at the next remap."""
        self._table.reindex()
        self._step = None

    def _bind(self) -> None:
        """Point the remap's table at the current buffers (after ``.to()`` or a load)."""
        t = self._table
        if any(getattr(t, b) is not getattr(self, b) for b in _BUFFERS) or t.stats is not self.last:
            for b in _BUFFERS:
                setattr(t, b, getattr(self, b))
            t.stats = self.last
            t.reindex()

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "config"] = config_tensor(self.config)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        key = prefix + "config"
        if key in state_dict:  # absent: a state dict from before it was recorded
            check_config(self.name, self.config, state_dict.pop(key), key)
        saved = saved_owners_of(state_dict, prefix)
        if saved is not None:  # saved by other owners: ``load_saved_owners``
            state_dict.pop(prefix + "owners", None)
            state_dict.update({prefix + k: v for k, v in
                               load_saved_owners(saved, self.config).items()})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.reindex()  # loaded in place: the index is stale

    def remap(self, ids: torch.Tensor, update: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(slots, fresh, step)``; ``update``: a training step (the clock advances)."""
        self._bind()
        if self._step is None:
            self._step = int(self.step)
        step = self._step
        slots, fresh = id_remap(self._table, ids, step=step, update=update, backend=self.backend)
        if update:
            self._step += 1
            self.step.fill_(self._step)
            self.totals += self.last
        return slots, fresh, step

    def metrics(self) -> dict[str, float]:
        """The last remap's numbers (``STATS``), ``hit_rate`` (ids whose id had a slot /
        ids), ``occupancy`` (occupied slots / capacity), ``step``, and ``total_<stat>`` since
        construction (kept in the state dict). One host read."""
        last, totals = self.last.tolist(), self.totals.tolist()
        out: dict[str, float] = dict(zip(STATS, last, strict=True))
        out["hit_rate"] = last[1] / last[0] if last[0] else 0.0
        out["occupancy"] = int((self.last_seen >= 0).sum()) / self.config.capacity
        out["step"] = int(self.step)
        out.update({f"total_{k}": v for k, v in zip(STATS, totals, strict=True)})
        return out

    def extra_repr(self) -> str:
        c = self.config
        return (f"{self.name}: capacity={c.capacity}, eviction={c.eviction}, "
                f"min_count={c.admission.min_count}")


class ManagedCollisionCollection(nn.Module):
    """The id managers of a collection's managed tables.

    Args:
        managed_collision_modules: table name -> ``IdManagerConfig`` (or its mapping, as in
            YAML: ``{"capacity": 1000, "eviction": "lfu"}``), or a TorchRec
            ``MCHManagedCollisionModule`` (its config is read: ``from_torchrec``).
        embedding_configs: the collection's table configs (``name``, ``num_embeddings`` =
            capacity + 1, ``feature_names``).
        need_preprocess: TorchRec's; ignored (ids are never pre-hashed here).
        device, backend: where the maps live; ``"auto"``, ``"triton"``, ``"cpu"``,
            ``"reference"``.
    """

    def __init__(self, managed_collision_modules: Mapping, embedding_configs: Sequence,
                 need_preprocess: bool = True, *, device=None, backend: str = "auto") -> None:
        super().__init__()
        configs = managed_configs(
            {n: from_torchrec(m, n) for n, m in managed_collision_modules.items()},
            [(c.name, c.num_embeddings) for c in embedding_configs],
        )
        self._features = {c.name: list(c.feature_names or [c.name]) for c in embedding_configs
                          if c.name in configs}
        self._managed_collision_modules = nn.ModuleDict(
            {n: IdManager(n, cfg, device=device, backend=backend) for n, cfg in configs.items()}
        )

    def managers(self) -> dict[str, IdManager]:
        return dict(self._managed_collision_modules.items())

    def remap(self, features: KeyedJaggedTensor, update: bool
              ) -> tuple[KeyedJaggedTensor, dict[str, tuple[torch.Tensor, int]]]:
        """``features`` with each managed table's ids replaced by their slots (a table's ids:
        its features in config order, each feature's ids in KJT order, are one batch), and,
        per table, ``(fresh slots, step)``. Keys of unmanaged tables pass unchanged."""
        ranges = kjt_key_ranges(features)
        values = features.values()
        out, fresh = None, {}
        for name, manager in self._managed_collision_modules.items():
            spans = [ranges[f] for f in self._features[name] if f in ranges]
            if not spans:
                continue
            if values.dtype != torch.int64:
                raise ValueError(
                    f"table '{name}' ids: expected int64 raw ids (KeyedJaggedTensor values) for "
                    f"a managed table, got {values.dtype}"
                )
            parts = [values[a:b] for a, b in spans]
            ids = parts[0] if len(parts) == 1 else torch.cat(parts)
            slots, new, step = manager.remap(ids, update)
            out = values.clone() if out is None else out
            at = 0
            for a, b in spans:
                out[a:b] = slots[at : at + b - a]
                at += b - a
            fresh[name] = (new, step)
        if out is None:
            return features, fresh
        return kjt_with_values(features, out), fresh

    def reset(self) -> None:
        """``IdManager.reset`` of every table."""
        for m in self._managed_collision_modules.values():
            m.reset()

    def metrics(self) -> dict[str, dict[str, float]]:
        """Per managed table, ``IdManager.metrics()``."""
        return {n: m.metrics() for n, m in self._managed_collision_modules.items()}


_TORCHREC_POLICIES = {"LRU_EvictionPolicy": "lru", "LFU_EvictionPolicy": "lfu",
                      "DistanceLFU_EvictionPolicy": "lfu"}


def from_torchrec(module, table: str = "table"):
    """A TorchRec ``MCHManagedCollisionModule`` (read by attribute, torchrec not imported) ->
    ``IdManagerConfig(capacity=zch_size - 1, eviction=lru | lfu)``; anything else as is.
    Its eviction interval, input hash and its ``DistanceLFU`` decay are not carried over
    (distance-LFU becomes LFU)."""
    if not hasattr(module, "_zch_size") or not hasattr(module, "_eviction_policy"):
        return module
    policy = type(module._eviction_policy).__name__
    if policy not in _TORCHREC_POLICIES:
        raise ValueError(
            f"table '{table}' managed collision module: expected an eviction policy among "
            f"{sorted(_TORCHREC_POLICIES)}, got {policy}"
        )
    return IdManagerConfig(capacity=int(module._zch_size) - 1,
                           eviction=_TORCHREC_POLICIES[policy])


def _row_seed(seed: int, step: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def fresh_rows(cfg, n: int, D: int, seed: int, step: int) -> torch.Tensor:
    """``[n, D]`` fp32 CPU rows for the ``n`` slots a manager of ``seed`` gave a new id at
    ``step`` (in the order it gave them): the table's ``init_fn``, else uniform in
    ``weight_init_min/max``, from a generator seeded by ``(seed, step)`` (the global RNG is
    left as it was). The sharded managers (``sharding/managed/sharded.py``) draw theirs here too."""
    rows = torch.empty(n, D, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_row_seed(seed, step))
        if cfg.init_fn is not None:
            cfg.init_fn(rows)
        else:
            rows.uniform_(cfg.get_weight_init_min(), cfg.get_weight_init_max())
    return rows


def reset_rows(collection, fresh: Mapping[str, tuple[torch.Tensor, int]],
               managers: Mapping[str, IdManager]) -> None:
    """Re-initialise each fresh slot's row (its table's ``init_fn``, else uniform in
    ``weight_init_min/max``) and its fused optimizer state (zero), in the collection (our
    EmbeddingBagCollection or EmbeddingCollection) before the lookup reads them."""
    configs = collection.table_configs()
    index = {cfg.name: t for t, cfg in enumerate(configs)}
    for name, (slots, step) in fresh.items():
        if slots.numel() == 0:
            continue
        t = index[name]
        cfg = configs[t]
        (weight,) = collection.group_params([t])
        rows = fresh_rows(cfg, slots.numel(), weight.shape[1], int(managers[name].seed), step)
        with torch.no_grad():
            weight[slots.to(weight.device)] = rows.to(weight.device, weight.dtype)
        for tbe, members in collection.tbe_groups():
            if t in members and collection.sync_optimizer(tbe, members) is not None:
                for state in tbe.split_optimizer_states()[members.index(t)]:
                    state[slots.to(state.device)] = 0


def managed_forward(collection, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The collection's managed tables' ids remapped (a training step when ``training``) and
    the fresh rows reset: the KJT its lookup then reads."""
    if ebc_op.traced(features) or torch.jit.is_scripting():
        raise NotImplementedError(
            "managed tables (id_managers) under torch.fx, torch.export, torch.jit.script, "
            "torch.compile(fullgraph=True) or on meta tensors: their id maps are Python state "
            "a graph cannot hold; remap "
            "eagerly (torch.compile without fullgraph=True does: the lookup runs between its "
            "graphs)"
        )
    managed = collection.id_managers
    remapped, fresh = managed.remap(features, update=collection.training)
    reset_rows(collection, fresh, managed.managers())
    return remapped


class ManagedLookup(nn.Module):
    """The base of our managed-collision wrappers (TorchRec's construction): remap, reset
    fresh rows, look up."""

    _collection_attr = "_embedding_bag_collection"

    def __init__(self, collection, managed_collision_collection: ManagedCollisionCollection,
                 return_remapped_features: bool = False) -> None:
        super().__init__()
        if getattr(collection, "id_managers", None) is not None:
            raise ValueError(
                "embedding collection: expected one built without managed=..., got one that "
                "manages its ids already"
            )
        known = {c.name: c for c in collection.table_configs()}
        for name, manager in managed_collision_collection.managers().items():
            if name not in known:
                raise ValueError(
                    f"managed_collision_collection: unknown table {name!r}, expected one of "
                    f"{sorted(known)}"
                )
            if known[name].num_embeddings != manager.config.num_embeddings:
                raise ValueError(
                    f"table '{name}' num_embeddings: expected capacity + 1 = "
                    f"{manager.config.num_embeddings}, got {known[name].num_embeddings}"
                )
        setattr(self, self._collection_attr, collection)
        self._managed_collision_collection = managed_collision_collection
        self._return_remapped_features = return_remapped_features

    def forward(self, features: KeyedJaggedTensor):
        collection = getattr(self, self._collection_attr)
        mcc = self._managed_collision_collection
        remapped, fresh = mcc.remap(features, update=self.training)
        reset_rows(collection, fresh, mcc.managers())
        out = collection(remapped)
        return out, (remapped if self._return_remapped_features else None)

    def metrics(self) -> dict[str, dict[str, float]]:
        return self._managed_collision_collection.metrics()


class ManagedCollisionEmbeddingBagCollection(ManagedLookup):
    """Drop-in construction of ``torchrec.ManagedCollisionEmbeddingBagCollection``:
    ``(EmbeddingBagCollection, ManagedCollisionCollection, return_remapped_features=False)``;
    ``forward(kjt) -> (KeyedTensor, remapped KJT or None)``. The module docstring lists where
    it differs."""


class ManagedCollisionEmbeddingCollection(ManagedLookup):
    """Drop-in construction of ``torchrec.ManagedCollisionEmbeddingCollection``:
    ``forward(kjt) -> (dict[str, JaggedTensor], remapped KJT or None)``."""

    _collection_attr = "_embedding_collection"
