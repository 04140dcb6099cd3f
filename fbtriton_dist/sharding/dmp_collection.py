"""``DMPCollection``: TorchRec's 2D-parallel ``DistributedModelParallel`` (its
``torchrec.distributed.model_parallel.DMPCollection`` arguments), sharding our collections in
replica groups (``sharding/replicas.py``).

    model = DMPCollection(module=m, device=device, plan=plan_for_S_ranks, world_size=R,
                          sharding_group_size=S, global_pg=dist.group.WORLD)
    ...
    model.sync()   # average the replicas (replica_sync=N does it every N steps by itself)

The plan is TorchRec's ``ShardingPlan`` made for ``sharding_group_size`` ranks (ranks 0..S-1
of one group, as TorchRec's). The groups are TorchRec's: by default
(``use_inter_host_allreduce=False``) strided, group r % (R/S); with
``use_inter_host_allreduce=True`` consecutive, group r // S. The dense rest of the model is
wrapped in DDP over ``global_pg`` (DMP's data-parallel wrapper).

Arguments TorchRec takes that are refused here (ValueError naming the argument):
``sharding_strategy`` other than ``DEFAULT``, ``node_group_size`` (pass ``local_world_size``
to our sharder instead), ``custom_all_reduce``, ``submodule_configs``,
``rs_awaitable_hook_module``, ``use_sharded_relay=True``, sharders other than ours, and
``plan=None`` (plan for the group size with ``EmbeddingShardingPlanner`` or our planner).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder, EmbeddingCollectionSharder
from fbtriton_dist.sharding.modules.collection import ShardedCollection
from fbtriton_dist.sharding.replicas import make_replica_groups

__all__ = ["DMPCollection"]

_REFUSED = {
    "node_group_size": "pass local_world_size= to our sharder instead",
    "custom_all_reduce": "the replicas are averaged by our own fp32 all-reduce",
    "submodule_configs": "one plan and one group size for the whole model",
    "rs_awaitable_hook_module": "only the DEFAULT sharding strategy is supported",
}


class DMPCollection(DistributedModelParallel):
    """TorchRec's ``DMPCollection`` arguments where they map (``module``, ``device``, ``plan``,
    ``world_size``, ``sharding_group_size``, ``global_pg``, ``sharders``,
    ``init_data_parallel``, ``init_parameters``, ``data_parallel_wrapper``,
    ``use_inter_host_allreduce``), plus ``replica_sync``: ``"step"`` (default: every step one
    fused update of all replicas' ids, exactly the flat plan on ``world_size`` ranks) or an
    int N (TorchRec's behaviour: replicas train apart and are averaged every N steps; ``sync``
    averages on demand). Sharders default to ours for ``fbtriton_dist``'s EBC and EC."""

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | None = None,
        plan=None,
        world_size: int | None = None,
        sharding_group_size: int | None = None,
        global_pg=None,
        sharding_strategy=None,
        node_group_size: int | None = None,
        sharders: list | None = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper=None,
        use_inter_host_allreduce: bool = False,
        custom_all_reduce=None,
        submodule_configs=None,
        rs_awaitable_hook_module: str | None = None,
        use_sharded_relay: bool = False,
        *,
        replica_sync: str | int = "step",
    ) -> None:
        given = {"node_group_size": node_group_size, "custom_all_reduce": custom_all_reduce,
                 "submodule_configs": submodule_configs,
                 "rs_awaitable_hook_module": rs_awaitable_hook_module}
        for name, value in given.items():
            if value is not None:
                raise ValueError(f"DMPCollection: {name} is not supported ({_REFUSED[name]}); "
                                 f"got {value!r}")
        if use_sharded_relay:
            raise ValueError("DMPCollection: use_sharded_relay is not supported; got True")
        if sharding_strategy is not None and getattr(sharding_strategy, "name",
                                                     sharding_strategy) != "DEFAULT":
            raise ValueError(f"DMPCollection: sharding_strategy: expected DEFAULT (replicas "
                             f"hold whole shards), got {sharding_strategy!r}")
        if plan is None:
            raise ValueError("DMPCollection: plan: expected a ShardingPlan made for "
                             "sharding_group_size ranks, got None")
        if sharding_group_size is None:
            raise ValueError("DMPCollection: sharding_group_size: expected an int, got None")
        R = dist.get_world_size(global_pg)
        if world_size is not None and world_size != R:
            raise ValueError(f"DMPCollection: world_size: expected the size of global_pg, {R}, "
                             f"got {world_size}")
        if sharders is None:
            sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
        ours = [s for s in sharders if isinstance(s, EmbeddingBagCollectionSharder)]
        if len(ours) != len(sharders):
            raise ValueError("DMPCollection: sharders: expected fbtriton_dist's sharders "
                             "(fbtriton_dist.sharding.dmp; module_type=torchrec's collections "
                             f"shards those), got {[type(s).__name__ for s in sharders]}")
        hosts = {s.local_world_size for s in ours if s.local_world_size is not None}
        if len(hosts) > 1:
            raise ValueError(f"DMPCollection: sharders: expected one local_world_size, got "
                             f"{sorted(hosts)}")
        replicas = make_replica_groups(
            global_pg, sharding_group_size, replica_sync, sharding_group_size,
            hosts.pop() if hosts else sharding_group_size,
            "consecutive" if use_inter_host_allreduce else "strided",
        )
        for s in ours:
            s.use_replica_groups(replicas)
        self.replica_groups = replicas
        """The ``ReplicaGroups`` of this rank (its group's and its replicas' process groups)."""
        pg = global_pg if global_pg is not None else dist.GroupMember.WORLD
        env = ShardingEnv(world_size=R, rank=dist.get_rank(pg), pg=pg)
        super().__init__(module, env=env, device=device, plan=plan, sharders=sharders,
                         init_data_parallel=init_data_parallel, init_parameters=init_parameters,
                         data_parallel_wrapper=data_parallel_wrapper)

    def sharded_collections(self) -> list[ShardedCollection]:
        """Our sharded collections in the model (each sharded module's ``.sharded``)."""
        return [m.sharded for m in self.modules()
                if isinstance(getattr(m, "sharded", None), ShardedCollection)]

    def sync(self, include_optimizer_state: bool = True) -> None:
        """Average every shard's weights and (``include_optimizer_state``) optimizer state over
        its replicas (TorchRec's ``DMPCollection.sync``; every rank calls it)."""
        for collection in self.sharded_collections():
            collection.sync_replicas(include_optimizer_state)
