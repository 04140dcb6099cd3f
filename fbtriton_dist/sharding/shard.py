"""``shard()``: replace the embedding collections of a model by their sharded counterparts."""

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.sharding.comm.options import CommOptions
from fbtriton_dist.sharding.modules.sharded_ebc import ShardedEmbeddingBagCollection
from fbtriton_dist.sharding.modules.sharded_ec import ShardedEmbeddingCollection
from fbtriton_dist.storage import storage_of


def _kind(module: nn.Module) -> str | None:
    """``"ebc"`` for an EmbeddingBagCollection, ``"ec"`` for an EmbeddingCollection (ours or
    TorchRec's), else None."""
    from fbtriton_dist.modules.ebc import EmbeddingBagCollection
    from fbtriton_dist.modules.ec import EmbeddingCollection

    if isinstance(module, EmbeddingBagCollection):
        return "ebc"
    if isinstance(module, EmbeddingCollection):
        return "ec"
    try:
        import torchrec
    except ImportError:
        return None
    if isinstance(module, torchrec.EmbeddingBagCollection):
        return "ebc"
    if isinstance(module, torchrec.EmbeddingCollection):
        return "ec"
    return None


def _optimizer_of(module: nn.Module, name: str) -> optim.Optimizer | None:
    """The one fused optimizer the tables' annotations map to (compared as our configs, so
    annotation values need not be hashable: ensemble's ``ensemble_mode`` as a dict)."""
    found: list[optim.Optimizer] = []
    for a in map(optim.in_backward_annotation, module.parameters()):
        if a is not None and (config := optim.from_torch(a[0], a[1], name)) not in found:
            found.append(config)
    if len(found) > 1:
        raise ValueError(f"{name}: expected one fused optimizer for all sharded tables, got "
                         f"{found}")
    return found[0] if found else None


def shard(
    module: nn.Module,
    plan: ShardingPlan,
    process_group=None,
    device: torch.device | str | None = None,
    *,
    optimizer: optim.Optimizer | None = None,
    backend: str = "auto",
    comm: CommOptions | None = None,
    group_size: int | None = None,
    replica_sync: str | int = "step",
    group_layout: str = "consecutive",
    replica_groups=None,
    optimizer_state_dtypes=None,
) -> nn.Module:
    """Replace every EmbeddingBagCollection and EmbeddingCollection in ``module`` (ours or
    TorchRec's, at any depth) by a ShardedEmbeddingBagCollection / ShardedEmbeddingCollection
    that keeps only this rank's shards (one plan covers the tables of all of them). Weights
    are copied from the module, or, for a module built on the meta device, initialised shard
    by shard (a table is never materialised whole). The fused optimizer is ``optimizer`` or
    the one the tables were annotated with by ``apply_optimizer_in_backward``. ``comm``: how
    the sharded collections talk to each other (``CommOptions``: bf16/fp16 values on the
    wire, id dedup; default exact) and whether the embedding gradients are divided by the
    world size R in backward (``gradient_division``, default yes, as TorchRec and DDP do:
    with each rank's loss the mean over its samples, a step on R ranks equals the unsharded
    module's step on the global batch, so a learning rate means the same on any R). Returns
    the module (the sharded collection itself if ``module`` was one).

    ``group_size`` S (replica groups, 2D parallel; default: the world size R, flat): the R
    ranks of ``process_group`` split into R/S groups of S consecutive ranks, each sharding
    the tables by ``plan`` (a plan for S ranks, or the planner's grouped plan for R ranks,
    ``group_size`` S and ``replica_sync`` in it) inside its own process group; the ranks of
    the same local rank hold the same shards and are kept in step by ``replica_sync``:
    ``"step"`` (every step one fused update of all their ids: equals the flat plan on R ranks)
    or an int N (weights and optimizer state averaged every N steps; each group's gradients
    divided by S; ``comm.replica_sync_dtype``: the format the weights are averaged in).
    ``group_layout="strided"``: group r % (R/S) instead (TorchRec's
    ``DMPCollection`` default). ``sharding/comm/replicas.py``; docs/sharding.md "Replica groups
    (2D)". ``replica_groups``: groups already made (``sharding.comm.replicas.make_replica_groups``,
    e.g. by ``DMPCollection`` once for all its modules), instead of ``group_size``.

    ``optimizer_state_dtypes`` (FBGEMM's option, ``{"momentum1" | "momentum2": dtype}``): the
    storage of the fused optimizer's state of every shard; None: each collection's own
    (``EmbeddingBagCollection(optimizer_state_dtypes=...)``; fp32 for TorchRec's)."""
    from fbtriton_dist.modules.managed import ManagedLookup
    from fbtriton_dist.sharding.comm.replicas import (
        check_replica_sync,
        check_sync_format,
        make_replica_groups,
    )

    for name, m in module.named_modules():
        if isinstance(m, ManagedLookup):
            raise NotImplementedError(
                f"{name or 'module'}: sharding TorchRec-style ManagedCollision* wrappers is not "
                "supported yet; build the collection with managed=... instead "
                "(sharding/managed/sharded.py)"
            )
    if plan.group_world != plan.world_size:  # a grouped plan (planner.groups): R and S
        if group_size not in (None, plan.group_size):
            raise ValueError(f"group_size: the plan is grouped with group_size="
                             f"{plan.group_size}, got group_size={group_size}")
        if dist.is_initialized() and dist.get_world_size(process_group) != plan.world_size:
            raise ValueError(f"plan: expected a plan for the world of "
                             f"{dist.get_world_size(process_group)} ranks, got a grouped plan "
                             f"for {plan.world_size}")
        group_size, replica_sync = plan.group_size, plan.replica_sync
        plan = plan.group_plan()
    replicas = replica_groups
    check_replica_sync(replica_sync)
    if replicas is not None or group_size is not None:  # on every rank, before new_group
        if comm is not None and not isinstance(comm, CommOptions):
            raise ValueError(f"comm: expected a CommOptions, got {type(comm).__name__}")
        check_sync_format(replicas.sync if replicas is not None else replica_sync,
                          (comm or CommOptions()).replica_sync_format)
    if replicas is not None:
        if plan.world_size != replicas.group_size:
            raise ValueError(f"plan: expected a plan for the group size {replicas.group_size} "
                             f"ranks, got a plan for {plan.world_size} ranks")
        process_group = replicas.group
    elif group_size is not None:
        replicas = make_replica_groups(process_group, group_size, replica_sync, plan.world_size,
                                       plan.local_world_size, group_layout)
        if replicas.num_groups == 1:
            replicas = None  # S = R: the flat plan
        else:
            process_group = replicas.group
    if _kind(module) is not None:
        return _shard_one(module, "module", plan, process_group, device, optimizer, backend, comm,
                          replicas, optimizer_state_dtypes)
    found = [(name, child) for name, child in module.named_modules()
             if name and _kind(child) is not None]
    plans = _plans_per_collection(found, plan)
    for (name, child), sub in zip(found, plans, strict=True):
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, _shard_one(child, name, sub, process_group, device, optimizer,
                                         backend, comm, replicas, optimizer_state_dtypes))
    return module


def _configs_of(collection) -> list:
    if _kind(collection) == "ebc":
        return collection.embedding_bag_configs()
    return collection.embedding_configs()


def _plans_per_collection(found, plan: ShardingPlan) -> list[ShardingPlan]:
    """One plan covers the tables of every collection in the model (table names unique
    across them): each collection gets the part for its tables; a planned table that no
    collection holds is an error."""
    owner: dict[str, str] = {}
    for name, child in found:
        for cfg in _configs_of(child):
            if cfg.name in owner:
                raise ValueError(
                    f"table '{cfg.name}' is in both '{owner[cfg.name]}' and '{name}': the plan "
                    "names tables, so table names must be unique across the model's collections"
                )
            owner[cfg.name] = name
    stray = [t.name for t in plan.tables if t.name not in owner]
    if stray:
        raise ValueError(f"plan: table(s) {stray} are in no embedding collection of the model "
                         f"(the collections hold {sorted(owner)})")
    return [_subset_or_all(plan, [c.name for c in _configs_of(child)]) for _, child in found]


def _subset_or_all(plan: ShardingPlan, names: list[str]) -> ShardingPlan:
    """The plan of ``names``; those the plan lacks are left for the collection's own check
    (it names them)."""
    planned = {t.name for t in plan.tables}
    return plan.subset([n for n in names if n in planned])


def _storage_of(collection, plan: ShardingPlan) -> dict:
    """Each table's storage tier: the plan's where it names one (``TableSharding.storage``),
    else the collection's (``storage=`` of ours; ``device`` for TorchRec's)."""
    own = collection.table_storage() if hasattr(collection, "table_storage") else {}
    out = {}
    for cfg in _configs_of(collection):
        planned = next((t.storage for t in plan.tables if t.name == cfg.name), None)
        out[cfg.name] = planned if planned is not None else storage_of(own.get(cfg.name), cfg.name)
    return out


def _shard_one(collection, name, plan, process_group, device, optimizer, backend, comm=None,
               replicas=None, state_dtypes=None):
    kind = _kind(collection)
    ebc = kind == "ebc"
    configs = collection.embedding_bag_configs() if ebc else collection.embedding_configs()
    tables = collection.embedding_bags if ebc else collection.embeddings
    first = next(iter(collection.parameters()), None)
    storage = _storage_of(collection, plan)
    weights = None
    if first is not None and not first.is_meta:
        # a table the collection itself caches: its parameter is the cache's slots, its
        # state dict entry the whole table
        own = collection.table_storage() if hasattr(collection, "table_storage") else {}
        whole = collection.state_dict() if any(s.cached for s in own.values()) else {}
        key = "embedding_bags" if ebc else "embeddings"
        weights = {c.name: whole[f"{key}.{c.name}.weight"] if f"{key}.{c.name}.weight" in whole
                   else tables[c.name].weight.detach() for c in configs}
    common = {
        "optimizer": optimizer if optimizer is not None else _optimizer_of(collection, name),
        "weights": weights,
        "process_group": process_group,
        "device": device if device is not None else (
            first.device if first is not None and not first.is_meta else None
        ),
        "backend": backend,
        "comm": comm,
        "optimizer_state_dtypes": (state_dtypes if state_dtypes is not None
                                   else getattr(collection, "optimizer_state_dtypes", None)),
    }
    if any(s.tier != "device" for s in storage.values()):
        common["storage"] = storage
    ebc_cls, ec_cls = ShardedEmbeddingBagCollection, ShardedEmbeddingCollection
    if replicas is not None:
        common["replicas"] = replicas
    if getattr(collection, "id_managers", None) is not None:  # managed tables
        if replicas is not None:
            raise ValueError(f"{name}: managed (id-managed) tables are not supported with "
                             f"group_size={replicas.group_size}; use a flat plan")
        from fbtriton_dist.sharding.managed import sharded as managed

        ebc_cls = managed.ManagedShardedEmbeddingBagCollection
        ec_cls = managed.ManagedShardedEmbeddingCollection
        common["managed"] = collection.id_managers
    if ebc:
        return ebc_cls(configs, plan, is_weighted=collection.is_weighted(), **common)
    return ec_cls(configs, plan, need_indices=collection.need_indices(), **common)
