"""The training job: DLRM (or the sequence model) over our embedding collections, planned,
(sharded,) trained.

    python -m fbtriton_dist.train --config configs/jobs/quickstart.yaml [--resume] [--steps N]
    torchrun --nproc-per-node 2 -m fbtriton_dist.train --config configs/jobs/quickstart.yaml

Without torchrun (or with one process) the job runs in this process and never initialises a
process group. Under torchrun with several processes it initialises gloo (CPU) or NCCL (GPU)
with a timeout, shards the embedding tables by the plan (``fbtriton_dist.shard``, the one
multi-rank step, marked below), averages dense gradients over the ranks, and destroys the
process group on every way out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torchrec
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.optim import apply_optimizer_in_backward

from fbtriton_dist import knobs, optim
from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.modules.ec import EmbeddingCollection
from fbtriton_dist.modules.managed import ManagedCollisionCollection
from fbtriton_dist.ops.cpu_threads import threads_per_rank, usable_cores
from fbtriton_dist.planner import (
    ConfigError,
    PlanError,
    PlanValidationError,
    ShardingPlan,
)
from fbtriton_dist.storage import Storage

from .checkpoint import (
    clean_stale,
    load_checkpoint,
    read_meta,
    remove_run_files,
    usable_checkpoint,
)
from .command import add_arguments, finish_arguments, other_run, run_dir_problem
from .config import (
    DenseOptimizerConfig,
    EmbeddingOptimizerConfig,
    JobConfig,
    load_job,
)
from .data import DataPosition
from .dense_optim import CapturableAdagrad
from .env import Env
from .file_tier import check_file_dirs, with_run_folders
from .loop import NonFiniteError, Trainer
from .metrics import format_summary
from .models import DCNv2Model, TargetAttentionModel
from .modes import AUTO_PICKS_GRAPH, graph_blockers, max_ids_bound, resolve_pipeline
from .picture import PICTURE, picture_line
from .planning import GiB, make_plan, plan_storage  # noqa: F401 (GiB: tests use it)
from .planning import job_constraints as _constraints  # noqa: F401 (tests use it)
from .resume import identity_problem
from .sources import make_source

__all__ = [
    "Built",
    "Env",
    "build",
    "build_model",
    "distributed",
    "main",
    "make_plan",
    "run",
    "train",
]



@contextlib.contextmanager
def distributed(device: str = "auto", group_of_one: bool = False) -> Iterator[Env]:
    """One process: no process group (unless ``group_of_one``, under torchrun). Under torchrun
    with WORLD_SIZE > 1: init gloo (CPU) or NCCL (GPU) with a timeout, and destroy it however
    the body exits. Drop every model that holds ``env.process_group`` before the body ends
    (see the ``finally``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("<job>", "device", f"cuda, but this torch ({torch.__version__}) sees "
                                             "no CUDA device; use device: auto or cpu")
    if device == "cuda" and local_rank >= torch.cuda.device_count():
        raise ConfigError("<job>", "device", f"cuda: local rank {local_rank} needs GPU "
                                             f"{local_rank}, this machine has "
                                             f"{torch.cuda.device_count()}")
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not cuda and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores: each process its share (all of them in one process)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        torch.set_num_threads(threads_per_rank(usable_cores(), max(1, local)))
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if world <= 1 and not (group_of_one and "MASTER_ADDR" in os.environ):
        yield Env(rank=0, world_size=1, local_world_size=1, device=dev, process_group=None)
        return
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        timeout=datetime.timedelta(seconds=knobs.pg_timeout_s()),
        device_id=dev if cuda else None,
    )
    try:
        yield Env(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
            device=dev,
            process_group=dist.group.WORLD,
        )
    finally:
        # A gloo process group that outlives destroy_process_group() (still referenced by a
        # sharded model in a reference cycle) is freed while the interpreter shuts down, and
        # that aborts the process ("terminate called without an active exception", exit -6)
        # in about one run of four. Collect such models first, so the group dies here.
        gc.collect()
        dist.destroy_process_group()


def _table_configs(cfg: JobConfig) -> list[torchrec.EmbeddingBagConfig]:
    """The pooled tables' configs (every table but the sequence ones, ``pooling: none``)."""
    return [
        torchrec.EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.features),
            pooling=PoolingType[t.pooling.upper()],
            data_type=DataType[t.dtype.upper()],
        )
        for t in cfg.tables.tables
        if t.pooling != "none"
    ]


def _sequence_configs(cfg: JobConfig) -> list[torchrec.EmbeddingConfig]:
    """The sequence tables' configs (``pooling: none``: a row per id, an EmbeddingCollection)."""
    return [
        torchrec.EmbeddingConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.features),
            data_type=DataType[t.dtype.upper()],
        )
        for t in cfg.tables.tables
        if t.pooling == "none"
    ]


def _embedding_optimizer(c: EmbeddingOptimizerConfig) -> optim.Optimizer:
    """Our fused optimizer for ``optimizer.embedding``: the keys its torch / TorchRec class
    takes (``optim.REGISTRY``), that class's defaults for those not given."""
    entry = optim.spec(c.optimizer_name)
    given = {"lr": c.lr, "eps": c.eps, "betas": c.betas, "weight_decay": c.weight_decay,
             "counter_based_regularization": c.counter, "cowclip_regularization": c.cowclip,
             "global_weight_decay": c.global_weight_decay,
             "eta": c.eta, "momentum": c.momentum, "beta": c.beta, "l1": c.l1, "l2": c.l2,
             "weight_decay_mode": c.weight_decay_mode, "step_ema": c.step_ema,
             "step_start": c.step_start, "step_ema_coef": c.step_ema_coef,
             "ar_alpha": c.ar_alpha, "ema_beta": c.ema_beta, "min_shrinkage": c.min_shrinkage,
             "step_swap": c.step_swap, "step_mode": c.step_mode}
    takes = {**entry.keywords, **entry.modes}
    kwargs = {k: v for k, v in given.items() if k in takes and v is not None}
    return entry.from_kwargs(kwargs, "optimizer.embedding")


def _state_dtypes(cfg: JobConfig) -> dict[str, str]:
    """``optimizer.embedding.state_dtype`` as the collections' ``optimizer_state_dtypes``:
    that dtype for every state of the fused optimizer."""
    c = cfg.optimizer.embedding
    return {s.name: c.state_dtype for s in optim.spec(c.optimizer_name).states
            if not s.fp32_only}


def _dense_optimizer(c: DenseOptimizerConfig, params: Sequence[nn.Parameter],
                     capturable: bool = False):
    """The torch optimizer of ``optimizer.dense``; ``capturable``: its step count on the
    device, so a CUDA graph can replay ``step()`` (``train.pipeline: graph``): Adam/AdamW
    with ``capturable=True``, Adagrad as ``CapturableAdagrad`` (the same update)."""
    kw: dict[str, Any] = {"lr": c.lr, "weight_decay": c.weight_decay}
    if c.eps is not None and c.type != "sgd":
        kw["eps"] = c.eps
    if c.type == "sgd":
        return torch.optim.SGD(params, momentum=c.momentum, **kw)
    if c.type == "adagrad":
        return (CapturableAdagrad if capturable else torch.optim.Adagrad)(params, **kw)
    cls = torch.optim.Adam if c.type == "adam" else torch.optim.AdamW
    if capturable:
        kw["capturable"] = True
    return cls(params, betas=c.betas, **kw)


def _collection(cls, configs, cfg: JobConfig, where: torch.device,
                storage: Mapping[str, Storage] | None = None):
    """Our ``cls`` (EmbeddingBagCollection / EmbeddingCollection) of ``configs`` on
    ``where``, its managed tables (the table set's ``id_manager:``) with their id maps. On
    the meta device (several ranks) the maps are made on the CPU: ``fbtriton_dist.shard``
    reads their configs and seeds, and each owner then makes its own map of its slots (the
    whole table's map is allocated once on every rank meanwhile). ``storage``: the tables'
    tiers (``build_model``)."""
    names = {c.name for c in configs}
    managed = {n: m for n, m in cfg.tables.id_managers.items() if n in names} or None
    # the tables' storage tiers: the plan's (``storage: auto`` chosen), else the table set's;
    # on meta (several ranks) the plan carries them to ``shard()`` (train/planning.py
    # ``with_storage``): a cache is never built on meta
    if storage is None:
        storage = {t.name: t.storage for t in cfg.tables.tables if t.storage is not None}
    storage = {n: st for n, st in storage.items()
               if n in names and st is not None and where.type != "meta"} or None
    collection = cls(tables=configs, device=where, backend=cfg.backend, managed=managed,
                     storage=storage, optimizer_state_dtypes=_state_dtypes(cfg))
    if managed and where.type == "meta":
        collection.id_managers = ManagedCollisionCollection(
            managed, configs, device=torch.device("cpu"), backend=cfg.backend)
    return collection


def build_model(cfg: JobConfig, device: torch.device, world_size: int = 1,
                storage: Mapping[str, Storage] | None = None) -> nn.Module:
    """The job's model (``model.kind``): DLRM (or MLPerf's DLRM-dcnv2, ``models.DCNv2Model``)
    over our EmbeddingBagCollection, or the
    target-attention model over an EmbeddingCollection of the sequence tables and an
    EmbeddingBagCollection of the others (``train/models.py``); the tables annotated with the
    fused optimizer. Tables with an ``id_manager`` are managed (raw ids remapped to slots,
    ``modules/managed.py``).

    With several ranks the tables are built on the meta device (nothing allocated):
    ``fbtriton_dist.shard`` initialises each rank's shards in place. In one process the
    tables are built on their tier: ``storage`` (table name -> ``Storage``, the plan's:
    :func:`plan_storage`), else the table set's ``storage:``.
    """
    where = torch.device("meta") if world_size > 1 else device
    # our collections, as TorchRec's, take their fused optimizer from this annotation
    cls, kwargs = optim.torch_equivalent(_embedding_optimizer(cfg.optimizer.embedding))
    pooled = _table_configs(cfg)
    ebc = None
    if pooled:
        ebc = _collection(EmbeddingBagCollection, pooled, cfg, where, storage)
        apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    if cfg.model.kind == "dlrm":
        model = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=cfg.data.num_dense,
            dense_arch_layer_sizes=list(cfg.model.dense_arch),
            over_arch_layer_sizes=list(cfg.model.over_arch),
            dense_device=device,
        )
        # TorchRec builds the interaction's triu_indices buffer on the CPU whatever
        # dense_device is: on CUDA each step then copied it from pageable memory (a host sync,
        # and an error inside a CUDA graph capture)
        model.inter_arch.to(device)
        return model
    if cfg.model.kind == "dcnv2":
        m = cfg.model
        return DCNv2Model(ebc, features=[f for c in pooled for f in c.feature_names],
                          num_dense=cfg.data.num_dense, dense_arch=m.dense_arch,
                          over_arch=m.over_arch, cross_layers=m.cross_layers,
                          low_rank=m.low_rank, dense_device=device)
    ec = _collection(EmbeddingCollection, _sequence_configs(cfg), cfg, where, storage)
    apply_optimizer_in_backward(cls, ec.parameters(), kwargs)
    dims = {f: t.embedding_dim for t in cfg.tables.tables for f in t.features}
    return TargetAttentionModel(
        ebc, ec, target=cfg.model.target, history=cfg.model.history,
        num_dense=cfg.data.num_dense, dense_arch=cfg.model.dense_arch,
        over_arch=cfg.model.over_arch,
        pooled_dim=sum(c.embedding_dim * len(c.feature_names) for c in pooled),
        target_dim=dims[cfg.model.target], dense_device=device,
    )


def _log(env: Env, text: str) -> None:
    if env.rank == 0:
        print(text, flush=True)


def _resume_point(cfg: JobConfig, env: Env) -> str | None:
    """The newest checkpoint that checks out against what its save recorded (rank 0 looks,
    every rank gets the answer); each one skipped is named with what is wrong with it. None:
    nothing to resume in a folder that holds no run (a first run with ``--resume``). A run
    folder that holds a run (metrics, or checkpoints) but no usable checkpoint is an error
    (``RunDirError``): restarting at step 0 would append a second run to its metrics."""
    ckpt_dir = cfg.checkpoint_dir
    choice: list[str | None] = [None, None]
    if env.rank == 0:
        path, skipped = usable_checkpoint(ckpt_dir)
        for bad, why in skipped:
            print(f"warning: --resume: skipping checkpoint {bad}: {why}", file=sys.stderr,
                  flush=True)
        choice[0] = path
        metrics = os.path.join(cfg.run_dir, cfg.logging.metrics)
        has_metrics = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
        if path is None and (skipped or has_metrics):
            found = "; ".join(f"{os.path.basename(b)}: {w}" for b, w in skipped)
            what = (f"every checkpoint is damaged ({found})" if skipped
                    else f"{cfg.logging.metrics} holds a run but no checkpoint was saved")
            choice[1] = (
                f"--resume: no usable checkpoint in {ckpt_dir}: {what}. Nothing was changed. "
                "Repair or move the damaged checkpoints aside and --resume again, or pass "
                f"--overwrite (instead of --resume) to start over at step 0 in {cfg.run_dir} "
                "(deletes its metrics and checkpoints)")
    if env.process_group is not None:
        dist.broadcast_object_list(choice, src=0, group=env.process_group)
    if choice[1] is not None:
        raise RunDirError(choice[1])
    return choice[0]


def _resume(cfg: JobConfig, env: Env, built: Built) -> tuple[int, DataPosition]:
    """``--resume``: load the newest usable checkpoint into ``built`` (step 0 in a new run
    folder); a checkpoint of another job, table set or optimizer, or one whose state cannot
    be loaded into this job's plan, is a ``RunDirError`` naming what it holds."""
    path = _resume_point(cfg, env)
    if path is None:
        _log(env, f"--resume: no complete checkpoint in {cfg.checkpoint_dir} (a new run), "
                  "starting at step 0")
        return 0, DataPosition()
    problem = identity_problem(path, read_meta(path).get("job"), cfg)
    if problem is not None:
        raise RunDirError(problem)
    try:
        state = load_checkpoint(path, built.model, built.optimizer,
                                process_group=env.process_group)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "Error:" in ln] or [str(e)]
        raise RunDirError(
            f"--resume: checkpoint {path} cannot be loaded into this job's model and plan "
            f"({lines[-1][:300]}); nothing was changed in {cfg.run_dir}: resume with the job "
            "file (tables, optimizers) it was saved with, or start a new run") from e
    step = int(state["step"])
    position = DataPosition(epoch=int(state["epoch"]), samples=int(state["samples"]))
    _log(env, f"resumed from {path}: step {step}, epoch {position.epoch}")
    saved_world = int(state.get("world_size", env.world_size))
    if cfg.data.source == "multihot" and saved_world != env.world_size:
        _log(env, f"warning: --resume: the checkpoint was saved on {saved_world} ranks, this "
                  f"run has {env.world_size}: each rank reads a contiguous part of the multi-hot "
                  "files, so the rest of this epoch reads as many rows per rank from the new "
                  "parts, not exactly the rows left (docs/mlperf.md)")
    if cfg.train.steps is not None and cfg.train.steps <= step:
        raise RunDirError(
            f"train.steps = {cfg.train.steps}, but the checkpoint {path} is at step "
            f"{step}: nothing left to train; give --steps above {step}"
        )
    return step, position


def train(cfg: JobConfig, env: Env, resume: bool = False,
          overwrite: bool = False) -> dict[str, Any]:
    """Run the job on this rank; return the summary (the same on every rank). ``resume``:
    from the newest usable checkpoint; ``overwrite``: a run folder holding another run is
    emptied of it first (else refused); both together are refused (``RunDirError``)."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite together: --resume continues the run in "
                          f"{cfg.run_dir}, --overwrite deletes it; give one of them")
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        return _train(cfg, env, resume, overwrite)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


@dataclass
class Built:
    """The job's model on this rank (sharded when the world has several ranks), the dense
    optimizer, the dense parameters it steps and the fqns of the embedding modules."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    dense_params: list[nn.Parameter]
    embedding_fqns: list[str]


def build(cfg: JobConfig, env: Env, plan: ShardingPlan, mode: str = "plain") -> Built:
    """Seed, build the model over our collections, shard it by ``plan`` (with a process
    group: several ranks, or one under torchrun) and make the dense optimizer: the same on
    every call with the same config, so a checkpoint loads into it. ``mode`` (the resolved
    ``train.pipeline``) ``graph``: fixed-shape input dists with ``modes.max_ids_bound`` id
    slots and a capturable dense optimizer."""
    torch.manual_seed(cfg.seed)  # identical dense initial weights on every rank
    # several ranks: built on meta, each shard's storage goes from the plan to ``shard()``
    # (a tier per shard, ``sharding.shard_tiers``, too); one process: each table whole on one
    model = build_model(cfg, env.device, env.world_size,
                        storage=plan_storage(plan) if env.world_size == 1 else None)
    emb_fqns = [n for n, m in model.named_modules()
                if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    # ---- the one multi-rank step: replace every embedding collection by its sharded twin ----
    if env.process_group is not None:
        import fbtriton_dist
        from fbtriton_dist.sharding import CommOptions

        c = cfg.sharding.comm
        dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # fp8, int8: names
        back = c.backward_wire_dtype
        graph = mode == "graph"
        comm = CommOptions(wire_dtype=dtypes.get(c.wire_dtype, c.wire_dtype),
                           backward_wire_dtype="same" if back is None else dtypes.get(back, back),
                           dedup=c.dedup, fixed_shapes=c.fixed_shapes or graph,
                           max_ids=max_ids_bound(cfg) if graph else c.max_ids,
                           gradient_division=cfg.sharding.gradient_division,
                           replica_sync_dtype=cfg.sharding.replica_sync_dtype)
        model = fbtriton_dist.shard(model, plan, env.process_group, env.device, comm=comm,
                                    optimizer=_embedding_optimizer(cfg.optimizer.embedding),
                                    backend=cfg.backend)  # groups: in a grouped plan
    dense_params = [
        p
        for n, p in model.named_parameters()
        if not any(n.startswith(f"{f}.") for f in emb_fqns) and p.requires_grad
    ]
    optimizer = _dense_optimizer(cfg.optimizer.dense, dense_params, capturable=mode == "graph")
    return Built(model, optimizer, dense_params, emb_fqns)


def available_host_bytes() -> int | None:
    """This host's available memory (``MemAvailable`` of /proc/meminfo), None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_cpu_job(cfg: JobConfig, env: Env, plan: ShardingPlan) -> None:
    """On the CPU, before anything is allocated: Triton's kernels need its interpreter
    (a config error, exit 2), and this host's ranks' table shards with their optimizer state
    must fit in its available memory (``PlanError``: "does not fit", exit 1; the planner
    checked only ``sharding.hbm_gb``)."""
    if env.device.type != "cpu":
        return
    from fbtriton_dist.ops.backend import check_backend
    from fbtriton_dist.planner.memory import block_bytes, fmt_bytes

    if cfg.backend == "triton":
        try:
            check_backend("triton", env.device)
        except RuntimeError as e:
            raise ConfigError(f"job {cfg.name}", "backend", str(e)) from e
    host = env.rank // max(env.local_world_size, 1)
    mine = range(host * env.local_world_size, (host + 1) * env.local_world_size)
    specs = {t.name: t for t in cfg.tables.tables}
    optimizer = cfg.optimizer.embedding.optimizer_name
    need = sum(block_bytes(specs[t.name], s.row_end - s.row_start, s.col_end - s.col_start,
                           optimizer)
               for t in plan.tables for s in t.shards
               if s.rank in {r % plan.group_world for r in mine})  # replica groups: r % S
    free = available_host_bytes()
    if free is not None and need > free:
        raise PlanError(
            f"the tables do not fit in this host's memory: {fmt_bytes(need)} ({need:,} bytes) "
            f"of table weights and {optimizer} state on {len(mine)} CPU process(es), "
            f"{fmt_bytes(free)} ({free:,} bytes) of RAM available; shard them over more hosts, "
            "or use smaller tables")


class RunDirError(ValueError):
    """The run folder holds another run (exit status 2, as a config error)."""


def _unwritable(cfg: JobConfig) -> str | None:
    """Why the run folder (or the checkpoint folder) cannot be made or written, or None."""
    folders = [("logging.run_dir", cfg.run_dir)]
    if cfg.checkpoint.enabled:
        folders.append(("checkpoint.dir", cfg.checkpoint_dir))
    for key, folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as e:
            what = ("is a file, not a folder" if os.path.isfile(folder)
                    else f"cannot be written: {e.strerror or e}")
            return (f"{key}: {folder} {what}; give a writable folder "
                    f"({key}=... on the command line)")
    return None


def _claim_run_dir(cfg: JobConfig, env: Env, resume: bool, overwrite: bool) -> None:
    """A new run never writes into another run's folder: refuse it unless ``resume`` or
    ``overwrite`` (which deletes that run's metrics, plan and checkpoints first). Rank 0
    looks; every rank gets its verdict. Stale ``.tmp-*`` folders of interrupted saves go."""
    verdict: list[str | None] = [None]
    if env.rank == 0:
        verdict[0] = _unwritable(cfg)
    if env.rank == 0 and verdict[0] is None:
        other = other_run(cfg)
        if other and overwrite:
            remove_run_files(cfg.run_dir, cfg.checkpoint_dir,
                             [cfg.logging.metrics, "plan.yaml", PICTURE])
        elif other and not resume:
            verdict[0] = run_dir_problem(cfg)
        removed = clean_stale(cfg.checkpoint_dir)
        if removed:
            _log(env, f"removed {len(removed)} unfinished checkpoint save(s): {removed}")
    if env.process_group is not None:
        dist.broadcast_object_list(verdict, src=0, group=env.process_group)
    if verdict[0] is not None:
        raise RunDirError(verdict[0])


def _train(cfg: JobConfig, env: Env, resume: bool, overwrite: bool = False) -> dict[str, Any]:
    run_dir = cfg.run_dir
    grouped = env.process_group is not None
    mode = resolve_pipeline(cfg, env.device.type, grouped)
    if cfg.train.pipeline == "auto" and env.device.type == "cuda" and mode != "graph":
        why = "; ".join(graph_blockers(cfg, env.device.type, grouped)
                        or ["auto does not pick the graph yet (train/modes.py AUTO_PICKS_GRAPH)"])
        _log(env, f"train.pipeline: auto runs {mode}, not graph: {why}")
    _claim_run_dir(cfg, env, resume, overwrite)
    plan, report = make_plan(cfg, env.world_size, env.local_world_size)
    _log(env, report)
    _check_cpu_job(cfg, env, plan)
    # file-tier tables: this run's own folder in their directory, checked writable
    run_plan = with_run_folders(plan, run_dir)
    check_file_dirs(run_plan, {t.name: "sharding.file_dir" for t in cfg.tables.tables
                               if t.auto_storage})
    built = build(cfg, env, run_plan, mode)
    model, optimizer = built.model, built.optimizer

    source = make_source(
        cfg.tables,
        cfg.data,
        batch_size=cfg.train.batch_size,
        seed=cfg.seed,
        rank=env.rank,
        world_size=env.world_size,
        resolve=cfg.path,
        device=env.device,
    )
    step, position = _resume(cfg, env, built) if resume else (0, DataPosition())
    if env.rank == 0:  # only now: a resume that failed leaves the run's plan.yaml as it was
        plan.save_yaml(os.path.join(run_dir, "plan.yaml"), header=f"plan of job {cfg.name}")
        _log(env, f"plan saved to {os.path.join(run_dir, 'plan.yaml')}")
    trainer = Trainer(cfg, env, model, optimizer, built.dense_params, built.embedding_fqns,
                      source, mode=mode)
    summary = trainer.fit(step, position)
    _log(env, format_summary(summary))
    if env.rank == 0:  # never fails the run: a missing matplotlib is one line
        _log(env, picture_line(run_dir, cfg.logging.metrics))
    return summary


def run(args: argparse.Namespace) -> int:
    """Load the job named by the parsed arguments and train it (0 on success)."""
    cfg = load_job(args.config, args.overrides, args.steps)
    # torchrec's KeyedTensor regroup calls torch.fx's is_fx_tracing(), which logs a deprecation
    # notice on every rank: not the user's business
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    # torchrun with one process on CUDA: a process group of one, so the tables are sharded and
    # the step can be one CUDA graph (train.pipeline: graph, or auto when nothing else stops it)
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    p = cfg.train.pipeline
    one = cuda and (p == "graph" or (p == "auto" and AUTO_PICKS_GRAPH
                                     and not graph_blockers(cfg, "cuda", True)))
    with distributed(cfg.device, group_of_one=one) as env:
        train(cfg, env, resume=args.resume, overwrite=getattr(args, "overwrite", False))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fbtriton_dist.train", description="Train a DLRM job from a YAML file.",
        allow_abbrev=False,  # `--o` must not become --overwrite (it deletes a run)
    )
    add_arguments(p)
    args = finish_arguments(p, *p.parse_known_args(argv))
    # under torchrun: an error every rank meets alike (the config, the plan, the run folder,
    # a nan step: agreed on by all ranks) is said once, by rank 0; any other by its rank
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    tag = f" (rank {rank})" if world > 1 else ""
    try:
        return run(args)
    except (PlanError, PlanValidationError) as e:
        return _fail(1, f"train: {e}", agreed=True)
    except (ConfigError, RunDirError, NonFiniteError) as e:
        return _fail(3 if isinstance(e, NonFiniteError) else 2, f"train: error: {e}",
                     agreed=True)
    except ValueError as e:
        return _fail(2, f"train: error{tag}: {e}", agreed=False)


STATUS_FILE = "FBTD_STATUS_FILE"
"""Environment: a file where the job's exit status and error line are appended (``STATUS
<tab> LINE``), for ``launch/multinode.sh``: torchrun itself exits 1 whatever its workers'
status, after 40+ lines of its own; the script ends with the line and exits with the status."""


def _fail(status: int, line: str, agreed: bool) -> int:
    """Say the error (``agreed``: one every rank met alike, said by rank 0 only) and hand it
    to whoever launched the ranks: ``$FBTD_STATUS_FILE`` (by each host's first rank for an
    agreed error) and torchrun's error file (its "Root Cause" then shows the line, not "To
    enable traceback see ...")."""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if not agreed or rank == 0:
        print(line, file=sys.stderr, flush=True)
    if agreed and local != 0:
        return status
    with contextlib.suppress(OSError):
        if os.environ.get(STATUS_FILE):
            with open(os.environ[STATUS_FILE], "a", encoding="utf-8") as f:
                f.write(f"{status}\t{' '.join(line.split())}\n")
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            import json
            import time

            text = f"{line} (exit status {status})"
            data = {"message": {"message": text, "extraInfo": {
                "py_callstack": text, "timestamp": str(int(time.time()))}}}
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w", encoding="utf-8") as f:
                json.dump(data, f)
    return status
