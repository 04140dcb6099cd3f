"""TorchRec ``ModuleSharder``s for our EmbeddingBagCollection and EmbeddingCollection: DMP
shards them through ``shard()``.

    model = DistributedModelParallel(model, plan=..., sharders=[EmbeddingBagCollectionSharder(),
                                                                EmbeddingCollectionSharder()])

``DistributedModelParallel`` walks the model; for every module whose path has a plan it calls
the sharder of the module's exact type: ``shard(module, params, env, device, module_fqn)``,
with ``params`` TorchRec's ``{table name: ParameterSharding}`` for that module (from
``EmbeddingShardingPlanner``, which plans ours through this sharder's ``shardable_parameters``,
``sharding_types`` and ``compute_kernels``, or written by hand). Here that plan becomes our
``fbtriton_dist.planner.ShardingPlan`` (``to_fbtd_plan``: each ShardMetadata's offsets and
sizes become a ``Shard``), and our ``shard()`` builds the ``ShardedEmbeddingBagCollection``
(``ShardedEmbeddingCollection``). DMP gets it wrapped in ``DMPShardedEmbeddingBagCollection``
(``DMPShardedEmbeddingCollection``), a TorchRec ``ShardedModule``
(so DDP leaves it alone) and ``FusedOptimizerModule`` (so ``dmp.fused_optimizer`` holds its
fused optimizer: ``step()`` and ``zero_grad()`` are no-ops, the update runs in backward).

What of DMP's contract this does not meet: TorchRec's kernels and the ``fused_params`` that
are no optimizer setting (refused, naming the key; ``optimizer`` and its hyper-parameters map
onto our fused optimizers, ``optim_fused_params.py``; the only compute kernel is ``fused``);
``table_column_wise`` is taken as column-wise (the ranks as given); ``reshard()``; of the
fused optimizer's ``param_groups`` only ``lr`` reaches the kernels (at ``step()``, as
TorchRec's: a scheduler works). ``named_parameters()`` lists every
table's local weights under TorchRec's names (``embedding_bags.<table>.weight``, views of
the live shards, marked ``_in_backward_optimizers`` as TorchRec marks its fused ones, left
out of DDP through
``sharded_parameter_names``); a rank holding several column slices of one table lists the
others as ``weight_1``, ... (TorchRec keeps one).

``DMPCollection`` (at the end): TorchRec's 2D-parallel DMP (its ``DMPCollection``
arguments), sharding ours in replica groups (``sharding/comm/replicas.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, KJTList
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import (
    LazyNoWait,
    ModuleSharder,
    NoWait,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
)
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from torchrec.streamable import Multistreamable

from fbtriton_dist import optim
from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.modules.ec import EmbeddingCollection
from fbtriton_dist.optim_fused_params import from_fused_params
from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding
from fbtriton_dist.sharding.comm.options import CommOptions
from fbtriton_dist.sharding.comm.replicas import (
    check_replica_sync,
    check_sync_format,
    make_replica_groups,
)
from fbtriton_dist.sharding.dist.input_dist import InputDistOut
from fbtriton_dist.sharding.modules.collection import ShardedCollection
from fbtriton_dist.sharding.modules.sharded_ebc import ShardedEmbeddingBagCollection
from fbtriton_dist.sharding.modules.sharded_ec import ShardedEmbeddingCollection
from fbtriton_dist.sharding.shard import shard
from fbtriton_dist.storage import COMPUTE_KERNELS, Storage, storage_of_kernel

__all__ = [
    "DMPCollection",
    "DMPShardedEmbeddingBagCollection",
    "DMPShardedEmbeddingCollection",
    "EmbeddingBagCollectionSharder",
    "EmbeddingCollectionSharder",
    "to_fbtd_plan",
]

SHARDING_TYPES = (
    "table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard", "data_parallel",
)
"""TorchRec's sharding types we take (its ``ShardingType`` values are our names)."""
_ALIASES = {"table_column_wise": "column_wise"}


# -- TorchRec's plan -> ours ---------------------------------------------------------------------
def _table_sharding(cfg, ps: ParameterSharding, world_size: int) -> TableSharding:
    E, D, name = cfg.num_embeddings, cfg.embedding_dim, cfg.name
    kind = _ALIASES.get(ps.sharding_type, ps.sharding_type)
    if kind not in SHARDING_TYPES:
        raise ValueError(
            f"table '{name}': expected a sharding type in {[*SHARDING_TYPES, *_ALIASES]}, "
            f"got {ps.sharding_type!r}"
        )
    if kind == "data_parallel":
        shards = [Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D)
                  for r in range(world_size)]
    else:
        metas = getattr(ps.sharding_spec, "shards", None)
        if not metas:
            raise ValueError(
                f"table '{name}' ({kind}): expected a sharding_spec with ShardMetadata, "
                f"got {ps.sharding_spec!r}"
            )
        shards = []
        for m in metas:
            (r0, c0), (nr, nc) = m.shard_offsets, m.shard_sizes
            if nr == 0 or nc == 0:  # TorchRec's even row cuts leave empty shards on small tables
                continue
            if m.placement is None:
                raise ValueError(f"table '{name}': shard at {m.shard_offsets} has no placement")
            shards.append(Shard(rank=m.placement.rank(), row_start=r0, row_end=r0 + nr,
                                col_start=c0, col_end=c0 + nc))
        shards.sort(key=lambda s: (s.col_start, s.row_start))  # our order: slice by slice, rows
    return TableSharding(name=name, sharding=kind, num_embeddings=E, embedding_dim=D,
                         shards=tuple(shards), storage=_storage_of(name, ps))


def _storage_of(name: str, ps: ParameterSharding) -> Storage | None:
    """The tier of TorchRec's ``compute_kernel`` (``fbtriton_dist.storage.COMPUTE_KERNELS``):
    ``fused_uvm`` -> ``host``, ``fused_uvm_caching`` -> ``cached`` with its
    ``cache_params.load_factor``; ``fused`` (and any other) -> None, the module's own."""
    kernel = getattr(ps, "compute_kernel", None)
    if kernel not in COMPUTE_KERNELS or COMPUTE_KERNELS[kernel] == "device":
        return None
    load_factor = getattr(getattr(ps, "cache_params", None), "load_factor", None)
    return storage_of_kernel(kernel, name, load_factor)


def to_fbtd_plan(
    configs, params: Mapping[str, ParameterSharding], world_size: int, local_world_size: int
) -> ShardingPlan:
    """TorchRec's plan of one module (``{table name: ParameterSharding}``) as our
    ``ShardingPlan`` over ``configs`` (``EmbeddingBagConfig``), validated."""
    names = [c.name for c in configs]
    missing = [n for n in names if n not in params]
    unknown = sorted(set(params) - set(names))
    if missing or unknown:
        raise ValueError(
            f"plan: expected one ParameterSharding per table {names}; missing {missing}, "
            f"unknown {unknown}"
        )
    plan = ShardingPlan(
        world_size=world_size,
        local_world_size=local_world_size,
        tables=tuple(_table_sharding(c, params[c.name], world_size) for c in configs),
    )
    plan.validate()
    return plan


# -- what DMP holds ------------------------------------------------------------------------------
class _Context:
    """One step's state between ``compute`` and ``output_dist`` (TorchRec's ShrdCtx)."""

    def __init__(self) -> None:
        self.dist_input: InputDistOut | None = None
        self.features = None  # the KJT (an EmbeddingCollection's output dist orders by it)

    def record_stream(self, stream) -> None:
        if self.dist_input is not None:
            self.dist_input.lengths.record_stream(stream)
            if self.dist_input.vbe is not None and self.dist_input.vbe.inverse is not None:
                self.dist_input.vbe.inverse.record_stream(stream)


class _DistInput(Multistreamable):
    """One step's ``InputDistOut`` (``.out``) as TorchRec's train pipelines carry the result
    of an input dist: in a ``KJTList``, moved between CUDA streams by ``record_stream``."""

    def __init__(self, out: InputDistOut) -> None:
        self.out = out

    def record_stream(self, stream) -> None:
        out, lookup = self.out, self.out.lookup
        tensors = [out.lengths, lookup.indices, lookup.offsets, lookup.per_sample_weights,
                   *(t for group in lookup.groups for t in group),
                   out.vbe.inverse if out.vbe is not None else None]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.record_stream(stream)


def _input_of(dist_input) -> InputDistOut:
    """The ``InputDistOut`` in what a pipeline hands ``compute``: a ``KJTList`` of one
    ``_DistInput`` (TorchRec's pipelines, ``forward``), a ``_DistInput`` or itself."""
    if isinstance(dist_input, KJTList):
        dist_input = dist_input[0]
    return dist_input.out if isinstance(dist_input, _DistInput) else dist_input


class _FusedOptimizer(FusedOptimizer):
    """The sharded tables' optimizer as TorchRec's ``KeyedOptimizer``: params are the weights
    (``embedding_bags.<table>.weight``, ShardedTensor views of the live shards), state the
    fused optimizer's state (``momentum1``, ...: ShardedTensor views too) and ``step``;
    ``step()`` hands a changed ``lr`` of the param group to the kernels (the update runs in
    backward), ``zero_grad()`` is a no-op."""

    def __init__(self, ebc: ShardedEmbeddingBagCollection | ShardedEmbeddingCollection) -> None:
        self._ebc = ebc
        weights, state = self._read()
        group = {"params": list(weights.values()), **dataclasses.asdict(ebc.optimizer)}
        super().__init__(weights, state, [group])

    def _read(self):
        weights = self._ebc.state_dict()
        states = self._ebc.fused_optimizer_state_dict()
        names = [s.torchrec_key or s.name  # momentum1, ... (TorchRec's keys)
                 for s in optim.spec_of(self._ebc.optimizer).states]
        state = {
            w: {**{n: states[f"{key}.{i}"] for i, n in enumerate(names)}, "step": states["step"]}
            for key, w in weights.items()
        }
        return weights, state

    def state_dict(self) -> dict[str, Any]:
        """KeyedOptimizer's form; read now (the step count, and views of moved buffers)."""
        self.params, self.state = self._read()
        self.param_groups[0]["params"] = list(self.params.values())
        return super().state_dict()

    def step(self, closure: Any = None) -> None:
        """The update ran in backward; here, as TorchRec's fused optimizers do, the group's
        ``lr`` (changed by a scheduler since) goes to the kernels for the next backward."""
        lr = self.param_groups[0]["lr"]
        if lr != self._ebc.optimizer.lr:
            self._ebc.set_learning_rate(lr)

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass


class _TableWeights(nn.Module):
    """One table's weights on this rank, as TorchRec's sharded collections list them:
    ``weight``, a parameter that is a view of the live shard (a rank holding several shards of
    the table, column slices: ``weight_1``, ... for the others; none: an empty one). The
    fused optimizer updates them in backward; they never get a ``.grad``. The state dict is the
    collection's (TorchRec's keys, ``ShardedTensor`` values), so loading leaves them alone."""

    def _load_from_state_dict(self, *args) -> None:
        pass


class DMPShardedEmbeddingBagCollection(ShardedModule, FusedOptimizerModule):
    """Our ``ShardedEmbeddingBagCollection`` (``.sharded``) as the TorchRec ``ShardedModule``
    DMP expects: ``input_dist(ctx, kjt)`` / ``compute(ctx, dist_input)`` /
    ``output_dist(ctx, partials)`` are its three stages; the forward returns the KeyedTensor
    itself (not a LazyAwaitable). State dict: the sharded collection's (TorchRec's keys,
    ShardedTensor values).

    TorchRec's train pipelines (``TrainPipelineSparseDist``, ``TrainPipelineSemiSync``,
    ``PrefetchTrainPipelineSparseDist``) drive the stages themselves, so they get the shapes
    TorchRec's own sharded modules give them: ``input_dist`` returns a
    ``KJTListSplitsAwaitable`` whose two waits give a ``KJTList`` of one ``_DistInput`` (our
    collectives have already run: every wait is a ``NoWait``), ``compute_and_output_dist``
    a ``LazyNoWait`` of the output, ``prefetch`` does nothing (no cache to fill).

    Parameters: each table's local weights, ``embedding_bags.<table>.weight``
    (``embeddings.`` for an EmbeddingCollection; ``_TableWeights``), as TorchRec's: views of the
    live shards, each carrying ``_in_backward_optimizers`` (TorchRec's mark of a parameter an
    optimizer updates in backward; ``torchrec.optim.in_backward_optimizer_filter`` reads it),
    all in ``sharded_parameter_names`` so DMP's DDP leaves them alone. They never get a
    ``.grad``, so a torch optimizer built over ``dmp.parameters()`` skips them too."""

    def __init__(self, sharded: ShardedEmbeddingBagCollection, module_type: type) -> None:
        super().__init__()
        self.__dict__["sharded"] = sharded  # not a child: its state dict keys are ours
        self._module_type = module_type
        self._fused = _FusedOptimizer(sharded)
        self._expose_weights()

    def _expose_weights(self) -> None:
        """Register each table's local weights (views of the live shards) as parameters."""
        configs = self.sharded.table_configs()
        views: dict[str, list[torch.Tensor]] = {c.name: [] for c in configs}
        for t, view in self.sharded.local_views():
            views[configs[t.table].name].append(view)
        tables = nn.ModuleDict()
        for cfg in configs:
            holder = _TableWeights()
            if not views[cfg.name]:  # no shard here: an empty weight, as TorchRec's
                p = nn.Parameter(torch.empty(0, device=self.sharded.device))
                p._in_backward_optimizers = [EmptyFusedOptimizer()]
                holder.register_parameter("weight", p)
            for i, view in enumerate(views[cfg.name]):
                p = nn.Parameter(view)  # shares the shard's storage
                p._in_backward_optimizers = [self._fused]
                holder.register_parameter("weight" if i == 0 else f"weight_{i}", p)
            tables[cfg.name] = holder
        setattr(self, self.sharded.tables_key, tables)

    # ShardedModule
    def create_context(self) -> _Context:
        return _Context()

    def input_dist(self, ctx: _Context, features) -> KJTListSplitsAwaitable:
        ctx.features = features
        out = self.sharded.input_dist(features)  # its collectives run here
        return KJTListSplitsAwaitable([NoWait(NoWait(_DistInput(out)))], ctx)

    def compute(self, ctx: _Context, dist_input) -> torch.Tensor:
        ctx.dist_input = _input_of(dist_input)
        return self.sharded.compute(ctx.dist_input.lookup)

    def output_dist(self, ctx: _Context, output: torch.Tensor):
        d = ctx.dist_input
        return self.sharded.output_dist(output, d.lengths, d.batch_sizes, d.vbe)

    def compute_and_output_dist(self, ctx: _Context, dist_input) -> LazyNoWait:
        """What TorchRec's pipelines call after the input dist: the output, as the
        ``LazyAwaitable`` TorchRec's modules return (it waits on first use)."""
        return LazyNoWait(self.output_dist(ctx, self.compute(ctx, dist_input)))

    def forward(self, features):
        """The sharded collection's forward: the output itself, not an awaitable."""
        ctx = self.create_context()
        return self.output_dist(ctx, self.compute(ctx, self.input_dist(ctx, features).wait()
                                                  .wait()))

    @property
    def unsharded_module_type(self) -> type:
        return self._module_type

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        """Every table's weights (data-parallel ones too: the fused optimizer updates every
        replica alike), which DMP's DDP ignores."""
        for name, _ in self.named_parameters(prefix):
            yield name

    # FusedOptimizerModule
    @property
    def fused_optimizer(self) -> _FusedOptimizer:
        return self._fused

    # what ShardedEmbeddingBagCollection answers
    def is_weighted(self) -> bool:
        return self.sharded.is_weighted()

    def embedding_bag_configs(self) -> list:
        return self.sharded.embedding_bag_configs()

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        return self.sharded.state_dict(destination=destination, prefix=prefix)

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        self.sharded._load_from_state_dict(state_dict, prefix, *args)

    def _apply(self, fn, recurse=True):
        self.sharded._apply(fn, recurse)
        self._expose_weights()  # views of the shards where they are now
        return super()._apply(fn, recurse)


class DMPShardedEmbeddingCollection(DMPShardedEmbeddingBagCollection):
    """Our ``ShardedEmbeddingCollection`` (``.sharded``) as DMP's ``ShardedModule``: the same
    stages, the output dist giving ``{feature: JaggedTensor}`` in the KJT's order."""

    def output_dist(self, ctx: _Context, output):
        return self.sharded.output_dist(output, ctx.dist_input.lookup, ctx.features)

    def is_weighted(self) -> bool:
        return False

    def embedding_bag_configs(self) -> list:
        raise AttributeError("an EmbeddingCollection has embedding_configs()")

    def embedding_configs(self) -> list:
        return self.sharded.embedding_configs()

    def need_indices(self) -> bool:
        return self.sharded.need_indices()



class EmbeddingBagCollectionSharder(ModuleSharder[nn.Module]):
    """Shards ``fbtriton_dist.EmbeddingBagCollection`` (``module_type``; pass
    ``torchrec.EmbeddingBagCollection`` to shard TorchRec's into ours) under TorchRec's DMP.

    Args:
        optimizer: the fused optimizer; default the one ``apply_optimizer_in_backward``
            annotated the tables with.
        local_world_size: ranks per host of the plan (table-row-wise and grid tables stay in a
            host); default TorchRec's ``get_local_size`` (``LOCAL_WORLD_SIZE``).
        backend, comm: passed to ``fbtriton_dist.shard()``. The embedding gradients are
            divided by the world size unless ``comm.gradient_division`` is False or, with it
            None (the default), TorchRec's ``comm_ops.set_gradient_division(False)`` was
            called before DMP sharded the model: the same rule as TorchRec's own modules.
        fused_params: TorchRec's sharder argument (FBGEMM's TBE options): ``optimizer``
            (FBGEMM's ``EmbOptimType``) and its hyper-parameters by FBGEMM's names
            (``learning_rate``, ``eps``, ``weight_decay``, ``weight_decay_mode``, ``beta1``,
            ``ensemble_mode``, ...; FBGEMM's defaults where not given) become the fused
            optimizer (``optim_fused_params.from_fused_params``; then neither ``optimizer=``
            nor a different ``apply_optimizer_in_backward`` annotation may be given);
            ``optimizer_state_dtypes`` (``{"momentum1" | "momentum2": SparseType.BF16 |
            "bf16" | torch.bfloat16 ...}``) is passed to ``shard()``, overriding the
            collection's own. Any other key raises ValueError naming it.
    """

    def __init__(
        self,
        *,
        optimizer: optim.Optimizer | None = None,
        local_world_size: int | None = None,
        backend: str = "auto",
        comm: CommOptions | None = None,
        module_type: type = EmbeddingBagCollection,
        fused_params: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        fused = dict(fused_params or {})
        fused_optimizer, state_dtypes = from_fused_params(fused)
        if fused_optimizer is not None and optimizer is not None:
            raise ValueError(f"fused_params['optimizer'] and optimizer=: expected one fused "
                             f"optimizer, got {fused_optimizer} and {optimizer}")
        self._state_dtypes = (optim.state_dtype_names(state_dtypes)
                              if state_dtypes is not None else None)
        self._fused_params = fused
        self._optimizer = optimizer if optimizer is not None else fused_optimizer
        self._optimizer_from_fused_params = fused_optimizer is not None
        self._local_world_size = local_world_size
        self._backend = backend
        self._comm = comm
        self._module_type = module_type
        self._replicas = None

    @property
    def module_type(self) -> type:
        return self._module_type

    @property
    def fused_params(self) -> dict[str, Any] | None:
        """The ``fused_params`` given (TorchRec's sharder property), or None."""
        return dict(self._fused_params) or None

    @property
    def comm(self) -> CommOptions:
        """The ``CommOptions`` given (default ones when none were)."""
        return self._comm if self._comm is not None else CommOptions()

    @property
    def local_world_size(self) -> int | None:
        """Ranks per host of the plan, as given (None: TorchRec's ``get_local_size``)."""
        return self._local_world_size

    def use_replica_groups(self, replicas) -> None:
        """Shard in these replica groups (``sharding.comm.replicas.ReplicaGroups``;
        ``DMPCollection`` sets them): the plan is for one group's ranks, and each module is
        sharded inside this rank's group."""
        self._replicas = replicas

    _tables_attr = "embedding_bags"
    _wrapper = DMPShardedEmbeddingBagCollection

    def _configs(self, module: nn.Module) -> list:
        return module.embedding_bag_configs()

    def shardable_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """``{table name: weight}``, as TorchRec's sharder: the planner's and the plan's keys
        (a table on a cached tier: its whole rows, ``[E, D]``, not its cache's slots)."""
        tables = getattr(module, self._tables_attr)
        storage = module.table_storage() if hasattr(module, "table_storage") else {}
        whole = {}
        if any(st.cached for st in storage.values()):  # a cached table's weight is its cache
            sd = module.state_dict()
            whole = {n: nn.Parameter(sd[f"{self._tables_attr}.{n}.weight"], requires_grad=False)
                     for n, st in storage.items() if st.cached}
        return {c.name: whole.get(c.name, tables[c.name].weight) for c in self._configs(module)}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.FUSED.value]

    def shard(
        self,
        module: nn.Module,
        params: Mapping[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> DMPShardedEmbeddingBagCollection:
        if not isinstance(module, self._module_type):
            raise ValueError(
                f"{module_fqn or 'module'}: expected a {self._module_type.__name__}, "
                f"got {type(module).__name__}"
            )
        if self._optimizer_from_fused_params:
            self._check_annotations(module, module_fqn or "module")
        if self._replicas is not None:  # DMPCollection: a plan for one group
            r = self._replicas
            plan = to_fbtd_plan(self._configs(module), params, r.group_size, r.local_world_size)
            sharded = shard(module, plan, None, device, optimizer=self._optimizer,
                            backend=self._backend, comm=self._comm_options(), replica_groups=r,
                            optimizer_state_dtypes=self._state_dtypes)
            return self._wrapper(sharded, type(module))
        H = self._local_world_size
        if H is None:
            from torchrec.distributed.comm import get_local_size

            H = get_local_size(env.world_size)
        plan = to_fbtd_plan(self._configs(module), params, env.world_size, H)
        sharded = shard(
            module, plan, env.process_group, device,
            optimizer=self._optimizer, backend=self._backend, comm=self._comm_options(),
            optimizer_state_dtypes=self._state_dtypes,
        )
        return self._wrapper(sharded, type(module))


    def _check_annotations(self, module: nn.Module, name: str) -> None:
        """An ``apply_optimizer_in_backward`` annotation other than ``fused_params``'
        optimizer raises (neither is dropped silently)."""
        for param in module.parameters():
            annotation = optim.in_backward_annotation(param)
            if annotation is None:
                continue
            annotated = optim.from_torch(*annotation, name)
            if annotated != self._optimizer:
                raise ValueError(f"{name}: expected one fused optimizer, got {self._optimizer} "
                                 f"from fused_params and {annotated} from "
                                 "apply_optimizer_in_backward")

    def _comm_options(self) -> CommOptions:
        """``comm``, with ``gradient_division`` None resolved as TorchRec's sharders do:
        ``torchrec.distributed.comm_ops.get_gradient_division()`` now (default True)."""
        comm = self._comm if self._comm is not None else CommOptions()
        if comm.gradient_division is not None:
            return comm
        from torchrec.distributed.comm_ops import get_gradient_division

        return dataclasses.replace(comm, gradient_division=bool(get_gradient_division()))


class EmbeddingCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards ``fbtriton_dist.EmbeddingCollection`` (``module_type``; pass
    ``torchrec.EmbeddingCollection`` to shard TorchRec's into ours) under TorchRec's DMP; the
    arguments as ``EmbeddingBagCollectionSharder``'s (``comm``: no ``fixed_shapes``)."""

    _tables_attr = "embeddings"
    _wrapper = DMPShardedEmbeddingCollection

    def __init__(self, *, module_type: type = EmbeddingCollection, **kwargs) -> None:
        super().__init__(module_type=module_type, **kwargs)

    def _configs(self, module: nn.Module) -> list:
        return module.embedding_configs()


# -- 2D parallel: TorchRec's DMPCollection ----------------------------------------------------
_REFUSED = {
    "node_group_size": "pass local_world_size= to our sharder instead",
    "custom_all_reduce": "the replicas are averaged by our own all-reduce, fp32 or in "
                         "CommOptions.replica_sync_dtype on our sharders' comm",
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
    averages on demand; the weights travel in our sharders' ``comm.replica_sync_dtype``, fp32
    by default: TorchRec has no such argument). Sharders default to ours for
    ``fbtriton_dist``'s EBC and EC.

        model = DMPCollection(module=m, device=device, plan=plan_for_S_ranks, world_size=R,
                              sharding_group_size=S, global_pg=dist.group.WORLD)
        model.sync()   # average the replicas (replica_sync=N does it every N steps itself)

    The plan is TorchRec's ``ShardingPlan`` made for ``sharding_group_size`` ranks (ranks
    0..S-1 of one group, as TorchRec's). The groups are TorchRec's: by default
    (``use_inter_host_allreduce=False``) strided, group r % (R/S); with
    ``use_inter_host_allreduce=True`` consecutive, group r // S. The dense rest of the model
    is wrapped in DDP over ``global_pg`` (DMP's data-parallel wrapper).

    Refused (ValueError naming the argument): ``sharding_strategy`` other than ``DEFAULT``,
    ``node_group_size`` (pass ``local_world_size`` to our sharder instead),
    ``custom_all_reduce``, ``submodule_configs``, ``rs_awaitable_hook_module``,
    ``use_sharded_relay=True``, sharders other than ours, and ``plan=None`` (plan for the
    group size with ``EmbeddingShardingPlanner`` or our planner)."""

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
        for s in ours:  # on every rank, before any new_group
            check_sync_format(check_replica_sync(replica_sync), s.comm.replica_sync_format)
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
