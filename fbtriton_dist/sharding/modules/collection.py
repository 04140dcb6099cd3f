"""What every sharded collection shares: this rank's shards in one TableBatchedEmbedding per
dtype, the input dist that feeds them, the fused optimizer, the state dict.

``ShardedCollection`` holds the tables of one collection (``configs``) cut by a
``ShardingPlan``; its subclasses add the lookup and the output dist:
``ShardedEmbeddingBagCollection`` (pooled bags, ``sharding/modules/sharded_ebc.py``) and
``ShardedEmbeddingCollection`` (one row per id, ``sharding/modules/sharded_ec.py``). The input
dist is the same for both: each id goes to the shards whose rows hold it.
"""

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist import optim
from fbtriton_dist.modules import ebc_op, fused_optim
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.sharding.comm.options import CommOptions
from fbtriton_dist.sharding.comm.replicas import (
    AfterBackward,
    ReplicaGroups,
    ReplicaTraffic,
    average_replicas,
    check_sync_format,
    replica_lookup,
)
from fbtriton_dist.sharding.comm.report import comm_report
from fbtriton_dist.sharding.dist.fixed import FixedInputDist
from fbtriton_dist.sharding.dist.input_dist import InputDist, InputDistOut, LookupBatch
from fbtriton_dist.sharding.dist.layout import ShardLayout
from fbtriton_dist.sharding.modules import state_dict as states
from fbtriton_dist.storage import Storage, storage_of


class ShardedCollection(nn.Module):
    """The shards of one embedding collection that live on this rank, and the input dist
    that feeds them (the base of the sharded EmbeddingBagCollection and EmbeddingCollection).

    Args:
        configs: the tables' configs (every rank passes the same list).
        plan: where each shard lives (``fbtriton_dist.planner.ShardingPlan``).
        optimizer: the fused optimizer applied in backward to every local shard.
        weights: optional full weights ``{table name: [E, D]}`` to copy this rank's shards
            from; otherwise each shard is initialised with its table's ``init_fn``.
        comm: how it talks to the other ranks (``CommOptions``); kept as ``self.comm``.
        storage: optional ``{table name: Storage}`` (``fbtriton_dist.storage``; a mapping of
            its fields or a tier name too): every shard of the table lives on that tier, a
            ``cached`` / ``file`` shard with ``Storage.slots(its rows)`` cache slots. Tables
            not named, and all without it, are on ``device``. A shard whose plan entry names
            a storage of its own (``Shard.storage``) lives there instead (per-shard tiers).
            The state dict and the fused optimizer's state give the whole shards (flushed),
            as on ``device``.
        optimizer_state_dtypes: FBGEMM's option, ``{"momentum1" | "momentum2": dtype}``: the
            fused optimizer's state of every shard stored in fp16 / bf16 (the update in fp32,
            ``TableBatchedEmbedding``'s); the state dict keeps that dtype.

    ``replicas`` (``sharding.comm.replicas.ReplicaGroups``, made by ``shard(group_size=...)``):
    this collection is one group's copy of the tables in a world split into replica groups;
    ``process_group`` is then the group's, and the replicas are kept in step by
    ``replicas.sync`` (``"step"``: one fused update of every replica's ids; N: weights and
    optimizer state averaged every N steps, ``sync_replicas``).

    ``input_group`` (default: the process group) carries the input dist; a pipeline may give
    it a group of its own so the next batch's ids do not queue behind this batch's output
    dist on one NCCL stream.
    """

    _pooling = "sum"
    """The local TBE's pooling (``"none"``: a row per id)."""
    tables_key = "embedding_bags"
    """TorchRec's state-dict name of the tables (``<tables_key>.<table>.weight``)."""

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
        storage: Mapping[str, Storage | Mapping | str | None] | None = None,
        replicas: ReplicaGroups | None = None,
        optimizer_state_dtypes: Mapping | None = None,
    ) -> None:
        super().__init__()
        self.optimizer_state_dtypes = optim.state_dtype_names(optimizer_state_dtypes)
        """``{state buffer: dtype name}``: the storage of every local TBE's optimizer state
        (FBGEMM's ``optimizer_state_dtypes``; default fp32)."""
        if comm is not None and not isinstance(comm, CommOptions):
            raise ValueError(f"comm: expected a CommOptions, got {type(comm).__name__}")
        self.comm = comm if comm is not None else CommOptions()
        if optimizer is None:
            raise ValueError(
                "sharded tables are trained with a fused optimizer: pass optimizer= to shard() "
                "or annotate the embedding parameters with apply_optimizer_in_backward"
            )
        if process_group is None and not dist.is_initialized():
            raise RuntimeError(
                "shard(): sharded tables talk to the other ranks through a process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets up its "
                "environment), or pass process_group=; in one process without one, keep the "
                "unsharded module"
            )
        self.group = process_group
        self.input_group = process_group
        self._prefetched: list[tuple[object, InputDistOut]] = []
        self.rank = dist.get_rank(process_group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        host = [n for n, s in dict(storage or {}).items() if storage_of(s, n).tier == "host"]
        self.layout = ShardLayout(configs, plan, dist.get_world_size(process_group), host)
        self.replicas = replicas
        """The replica groups this collection is one group's copy in, or None (flat)."""
        self._check_replicas(storage)
        self.replica_traffic = ReplicaTraffic()
        """Bytes sent / received over the replica group (``comm_report``'s
        ``replica_sync``)."""
        self._steps_since_sync = 0
        self._counter_steps = 0  # training lookups (rowwise Adagrad with counter's refreshes)
        divide = self.comm.gradient_division is not False  # None: TorchRec's default, divide
        ranks = self.layout.world_size
        if replicas is not None and replicas.sync == "step":
            ranks = replicas.world_size  # the flat plan's step on all R ranks
        self.grad_scale = 1.0 / ranks if divide else 1.0
        """What backward multiplies the gradient of every local lookup output by: 1/R with
        ``CommOptions.gradient_division`` (the default; replica groups synced every N steps:
        1/S, each group's own step), else 1."""
        self._is_weighted = is_weighted
        self._configs = list(configs)
        self._check_plan()
        self.storage = self._table_storage(storage)
        """Each table's ``Storage`` (every one of its shards lives on that tier)."""
        self._optimizer = optimizer
        self.plan = plan
        self.backend = backend
        self.last_step_stats: dict | None = None
        """What the input dist of the last step learnt (``comm_report`` reads it)."""
        self.host_group = self._host_group(process_group)
        local, ftm = self.layout.local_tables(self.rank)
        self.local_tables = local
        # one TableBatchedEmbedding per (dtype, host tier); the layout groups shard-features
        # so. Not submodules: the state dict speaks TorchRec's keys (see state_dict below)
        self.tbes: list[TableBatchedEmbedding] = []
        self._group_features: list[int] = []
        # the TBEs' rounding seeds are drawn without advancing the global RNG: ranks hold
        # different numbers of TBEs, and a model built after shard() must see the same RNG
        # on every rank (the same draw everywhere, then varied by rank and group)
        with torch.random.fork_rng(devices=[]):
            base = int(torch.randint(2**31 - 1, (), device="cpu"))
        for dtype, host in dict.fromkeys((t.dtype, t.host) for t in local):
            members = [i for i, t in enumerate(local) if (t.dtype, t.host) == (dtype, host)]
            sfs = [j for j, i in enumerate(ftm) if i in members]
            tbe = TableBatchedEmbedding(
                [local[i].shape for i in members],
                [members.index(ftm[j]) for j in sfs],
                pooling=self._pooling,
                optimizer=optimizer,
                weights_dtype=dtype,
                device=self.device,
                backend=backend,
                bounds_check="ignore",  # checked on the sending rank, before the collectives
                table_names=[self._shard_name(local[i]) for i in members],
                storage=[self.shard_storage(local[i]) for i in members],
                init_weights=False,
                seed=(base + 7919 * self.rank + 104729 * len(self.tbes)) % (2**31 - 1),
                optimizer_state_dtypes=self.optimizer_state_dtypes,
            )
            self.tbes.append(tbe)
            self._group_features.append(len(sfs))
        self._init_shards(weights)
        self._embedding_names = self.layout.output_names
        self._dims = self.layout.feature_dims
        self._make_dists()

    def _check_replicas(self, storage) -> None:
        """What replica groups do not support: fixed shapes, storage tiers."""
        if self.replicas is None:
            return
        check_sync_format(self.replicas.sync, self.comm.replica_sync_format)
        if self.comm.fixed_shapes:
            raise ValueError("group_size: replica groups need the default input dist; got "
                             "CommOptions(fixed_shapes=True)")
        tiers = {n: storage_of(s, n).tier for n, s in dict(storage or {}).items()}
        tiers.update({f"{self.layout.configs[k[0]].name}[rows {k[1]}..{k[2]}, cols "
                      f"{k[3]}..{k[4]}]": st.tier for k, st in self.layout.shard_storage.items()})
        if any(t != "device" for t in tiers.values()):
            raise ValueError(f"group_size: replica groups keep every table on 'device'; got "
                             f"storage tiers {tiers}")

    # -- replica groups ------------------------------------------------------------------
    def _lookup(self, tbe, indices, offsets, psw, batch_size: int) -> torch.Tensor:
        """``tbe(indices, offsets, psw)``, or with replica groups synced every step the
        lookup of every replica's batch at once (``sharding.comm.replicas.replica_lookup``)."""
        r = self.replicas
        if r is None or r.sync != "step" or r.num_groups == 1 or not torch.is_grad_enabled():
            return tbe(indices, offsets, psw)
        if psw is not None and psw.requires_grad:
            raise ValueError("replica_sync='step': per-sample weights that require grad (a "
                             "feature processor) are not supported with replica groups; use "
                             "replica_sync=N or a flat plan")
        return replica_lookup(tbe, indices, offsets, psw, batch_size, r, self.replica_traffic)

    def _count_step(self, x: torch.Tensor) -> torch.Tensor:
        """With ``replica_sync=N``: ``x`` itself, its backward counting the step once the
        whole backward is done and averaging the replicas every N steps."""
        r = self.replicas
        if (r is None or r.sync == "step" or r.num_groups == 1 or not x.requires_grad
                or not torch.is_grad_enabled()):
            return x
        return AfterBackward.apply(x, self._step_done)

    def _share_row_counter_max(self) -> None:
        """Rowwise Adagrad with counter, before the lookup of a training step whose backward
        refreshes ``max_counter`` (a multiple of ``max_counter_update_freq``): every local TBE
        gets the largest row counter of its group of tables over every rank's shards, as the
        unsharded collection's TBE reads it over whole tables (one all-reduce MAX over the
        process group, a slot per TBE group of the layout, the same order on every rank; a
        rank without shards of a group adds 0; ``fused_optim.set_row_counter_max``)."""
        opt = self._optimizer
        if (not isinstance(opt, optim.RowWiseAdagradWithCounter)
                or opt.max_counter_update_freq <= 0 or not torch.is_grad_enabled()):
            return
        if self.tbes:  # its updates so far (a rank without TBEs counts its lookups)
            self._counter_steps = self.tbes[0].step
        self._counter_steps += 1
        if self._counter_steps % opt.max_counter_update_freq:
            return
        keys = list(dict.fromkeys((t.dtype, t.host) for r in range(self.layout.world_size)
                                  for t in self.layout.local_tables(r)[0]))
        mine = list(dict.fromkeys((t.dtype, t.host) for t in self.local_tables))  # self.tbes'
        top = torch.zeros(len(keys), device=self.device)
        for key, tbe in zip(mine, self.tbes, strict=True):
            if tbe.row_counter.numel():
                top[keys.index(key)] = tbe.row_counter.max()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        for key, tbe in zip(mine, self.tbes, strict=True):
            fused_optim.set_row_counter_max(tbe, top[keys.index(key)].reshape(1).clone())

    def _start_step(self) -> None:
        """A training step's lookup begins: with ``replica_sync="step"`` the replica bytes are
        counted afresh (``comm_report``)."""
        if self.replicas is not None and self.replicas.sync == "step" and torch.is_grad_enabled():
            self.replica_traffic.reset()

    def _step_done(self) -> None:
        self._steps_since_sync += 1
        if self._steps_since_sync >= self.replicas.sync:
            self.sync_replicas()

    def sync_replicas(self, include_optimizer_state: bool = True) -> None:
        """Average the weights and (``include_optimizer_state``) the fused optimizer's state
        of every local shard over its replicas (every rank calls it; ``replica_sync=N`` does
        after every N-th backward), the weights in ``comm.replica_sync_dtype``. A no-op
        without replica groups."""
        if self.replicas is None or self.replicas.num_groups == 1:
            return
        self.replica_traffic.reset()
        average_replicas(self.tbes, self.replicas, self.replica_traffic, include_optimizer_state,
                         self.comm.replica_sync_format)
        self._steps_since_sync = 0

    def _check_plan(self) -> None:
        """Refuse what this kind of collection cannot shard (a subclass's rule)."""

    def _table_storage(self, storage) -> dict[str, Storage]:
        """``storage`` per table name, checked: known tables; no replicated (data-parallel)
        table behind a cache: each rank would train its own cache of the same rows and keep
        a whole backing store (and files of the same names) for a table small enough to
        replicate; put it on ``device``."""
        names = [c.name for c in self._configs]
        given = dict(storage or {})
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"storage: unknown table(s) {unknown}; the collection holds {names}")
        out = {n: storage_of(given.get(n), n) for n in names}
        bad = [n for t, n in enumerate(names)
               if out[n].tier != "device" and self.layout.table_data_parallel[t]]
        if bad:
            raise ValueError(
                f"table(s) {bad}: data_parallel tables live on 'device' (storage tier(s) "
                f"{[out[n].tier for n in bad]} given): a replica on every rank behind its own "
                "cache is not supported; shard the table (table_wise, row_wise, ...) to put it "
                "on a tier, or keep it data_parallel on 'device' (docs/storage.md)")
        return out

    def shard_storage(self, t) -> Storage:
        """Where local shard ``t`` (a ``LocalTable``) lives: its own storage in the plan
        (``Shard.storage``, per-shard tiers), else its table's (``self.storage``)."""
        return t.storage if t.storage is not None else self.storage[self._configs[t.table].name]

    def storage_of_piece(self, table: int, rows: tuple[int, int], cols: tuple[int, int]
                         ) -> Storage:
        """Where the shard of ``table`` over ``rows`` x ``cols`` lives, on whichever rank:
        its own storage in the plan, else its table's."""
        own = self.layout.shard_storage.get((table, *rows, *cols))
        return own if own is not None else self.storage[self._configs[table].name]

    def tiered(self) -> bool:
        """Some local shard lives behind a row cache (``cached`` / ``file``)."""
        return any(tbe.tiered for tbe in self.tbes)

    def compute_step(self, lookup: LookupBatch):
        """``compute(lookup)``; under ``torch.compile`` with tiered local shards it runs
        eagerly between the graphs (their slot maps are Python state): one graph break."""
        if self.tiered() and torch.compiler.is_dynamo_compiling():
            return ebc_op.run_eagerly(self.compute, lookup)
        return self.compute(lookup)

    def input_dist_is_pure(self) -> bool:
        """Whether ``input_dist`` only reads this module (writes no weights, caches or id
        maps): a CPU pipeline then runs the next batch's on a worker thread during a step."""
        return not self.tiered()

    def flush(self) -> None:
        """Write every dirty cached row of the local shards back to its backing store."""
        for tbe in self.tbes:
            tbe.flush()

    def invalidate(self) -> None:
        """Forget the cached rows of the local shards without writing them back (after their
        backing stores were written in place, e.g. by torch.distributed.checkpoint)."""
        for tbe in self.tbes:
            tbe.invalidate()

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Per cached local shard (``table[rows, cols]``): distinct rows looked up, misses,
        evictions, write-backs and the prefetch's rows and microseconds (cumulative;
        ``TableBatchedEmbedding.cache_stats``)."""
        return {k: v for tbe in self.tbes for k, v in tbe.cache_stats().items()}

    def group_batches(self, lookup: LookupBatch, weights: torch.Tensor | None = None
                      ) -> list[tuple[TableBatchedEmbedding, torch.Tensor, torch.Tensor,
                                      torch.Tensor | None]]:
        """``(tbe, indices, offsets, per-sample weights)`` per local TBE: its part of
        ``lookup`` (``weights``: the lookup's per-sample weights as ``compute`` passes them),
        exactly what ``compute`` looks up in it. Fixed shapes: each group's padded tensors;
        one TBE: the lookup's own; else the group's slice of the ids (host numbers, no sync)
        and its offsets rebased."""
        B, first, single = lookup.batch_size, 0, len(self.tbes) == 1
        out = []
        for g, (tbe, n) in enumerate(zip(self.tbes, self._group_features, strict=True)):
            indices, offsets, psw = lookup.indices, lookup.offsets, weights
            if lookup.groups:  # fixed shapes: each group padded to its own slots
                indices, offsets, psw = lookup.groups[g]
            elif not single:
                a, b = lookup.id_bounds[g], lookup.id_bounds[g + 1]
                indices = indices[a:b]
                offsets = offsets[first * B : (first + n) * B + 1] - a
                psw = psw[a:b] if psw is not None else None
            out.append((tbe, indices, offsets, psw))
            first += n
        return out

    def prefetch_rows(self, dist_out: InputDistOut,
                      tiers: Collection[str] | None = None) -> None:
        """Start reading the rows a coming batch's lookup needs that the local shards' caches
        do not hold (``TableBatchedEmbedding.prefetch`` of every tiered local TBE, with the
        ids ``compute`` will give it), on each TBE's worker thread; that batch's lookup loads
        them from there. ``dist_out``: the batch's ``input_dist`` (``prefetch``). Call it
        after the current batch's lookup: a lookup takes the prefetch in flight, so one
        started before it would be used by it instead (exact either way: ``modules/tiers.py``
        never uses a copy made stale by a write-back). A no-op without tiered shards.
        ``tiers``: only the shards on these tiers (e.g. ``("file",)``); None: every one."""
        if not self.tiered():
            return
        for tbe, indices, offsets, _ in self.group_batches(dist_out.lookup):
            if tbe.tiered:
                tbe.prefetch(indices, offsets, tiers=tiers)

    def _make_dists(self) -> None:
        """The input dist and the subclass's output dist, on ``self.device``."""
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
        self._make_output_dist()

    def _make_output_dist(self) -> None:
        raise NotImplementedError

    def _scale_grad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself in forward; backward multiplies its gradient by ``grad_scale`` before
        the fused update (``CommOptions.gradient_division``)."""
        if self.grad_scale == 1.0 or not x.requires_grad:
            return x
        return _ScaleGrad.apply(x, self.grad_scale)

    def _undivided_weights_grad(self, weights: torch.Tensor | None) -> torch.Tensor | None:
        """Per-sample ``weights`` of a lookup whose output goes through ``_scale_grad``:
        backward multiplies their gradient by ``1 / grad_scale``, so it is d(loss)/d(weight)
        itself. Weights that require grad come from dense parameters (a feature processor),
        which DDP averages over the ranks: dividing here too would divide twice."""
        if weights is None or self.grad_scale == 1.0 or not weights.requires_grad:
            return weights
        return _ScaleGrad.apply(weights, 1.0 / self.grad_scale)

    def _host_group(self, group):
        """The process group of this rank's host: ``group`` itself if it is one host, else a
        new group per host, made on every rank in the same order (``new_group`` wants that)."""
        H, R = self.layout.local_world_size, self.layout.world_size
        if H == R:
            return group
        if self.replicas is not None:  # made for every group on every rank
            return self.replicas.host_groups[self.rank // H * H]
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

    def set_learning_rate(self, lr: float) -> None:
        """Change the fused optimizer's learning rate of every local shard (a scheduler's
        hook; ``TableBatchedEmbedding.set_learning_rate``)."""
        if self._optimizer is None:
            raise ValueError("set_learning_rate: this collection has no fused optimizer")
        self._optimizer = dataclasses.replace(self._optimizer, lr=lr)
        for tbe in self.tbes:
            tbe.set_learning_rate(lr)

    def local_shards(self):
        """(LocalTable, [E_s, D_s] weight view, [state views]) for every shard on this rank."""
        views = [v for tbe in self.tbes for v in tbe.split_embedding_weights()]
        states = [s for tbe in self.tbes for s in tbe.split_optimizer_states()]
        by_dtype = [  # the TBEs' order: by (dtype, host tier)
            t
            for group in dict.fromkeys((t.dtype, t.host) for t in self.local_tables)
            for t in self.local_tables
            if (t.dtype, t.host) == group
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

    def table_configs(self) -> list:
        """The configs of the collection's tables (every rank's list)."""
        return self._configs

    # -- the input dist ---------------------------------------------------------------------
    def input_dist(self, features) -> InputDistOut:
        """KJT of this rank -> ``(lengths [T, B] of its own bags, the lookup batch of its
        shards, every rank's batch size)``: one bucketize, a header all-to-all, one host sync
        (the data all-to-all's split lists; on GPU the bucketize launcher sizes its output
        with one more), one data all-to-all (``fbtriton_dist.sharding.dist.input_dist``)."""
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

    def comm_report(self) -> dict[str, dict[str, float]]:
        """Bytes this rank sent and received in the last step per collective, next to the
        planner's estimate (``sharding.comm.report``; syncs: not for the hot path)."""
        return comm_report(self)

    # -- state dict: TorchRec's keys, sharded values (``sharding.modules.state_dict``) -------------
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """``{prefix}<tables_key>.<table>.weight``: a ShardedTensor of views of the live
        weights, or for a data-parallel table its full replica."""
        return states.weights_state_dict(self, destination, prefix)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        states.load_weights(self, state_dict, prefix, missing_keys, unexpected_keys, errors)

    def fused_optimizer_state_dict(self) -> dict:
        """The fused optimizer's state, ``<tables_key>.<table>.weight.<i>`` and ``step``."""
        return states.fused_optimizer_state_dict(self)

    def load_fused_optimizer_state_dict(self, state: dict) -> None:
        """Restore ``fused_optimizer_state_dict()`` (after DCP loaded it in place)."""
        states.load_fused_optimizer_state_dict(self, state)

    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{<tables_key>.<table>.weight: [E, D]}`` on every rank (a collective)."""
        return states.gather_full_state_dict(self)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for tbe in self.tbes:
            tbe._apply(fn)
        if self.tbes and self.tbes[0].weights.device != self.device:
            self.device = self.tbes[0].weights.device  # .to(device): the index lists follow
            self._make_dists()
        return self




class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None
