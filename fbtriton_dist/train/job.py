"""The training job: DLRM over the EmbeddingBagCollection, planned, (sharded,) trained.

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
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torchrec
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.optim import apply_optimizer_in_backward

from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.planner import (
    ConfigError,
    CostModel,
    IdDistribution,
    PlanError,
    PlanValidationError,
    ShardingPlan,
    ShardingPlanner,
)
from fbtriton_dist.planner.report import format_report

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import (
    DenseOptimizerConfig,
    EmbeddingOptimizerConfig,
    JobConfig,
    add_arguments,
    finish_arguments,
    load_job,
)
from .data import Batch, DataPosition, make_source
from .metrics import MetricsWriter, StageTimer, auc, format_summary

__all__ = ["Env", "build_model", "distributed", "main", "make_plan", "run", "train"]

GiB = 1024**3
PG_TIMEOUT_S = float(os.environ.get("FBTD_PG_TIMEOUT_S", "600"))
"""Collectives that wait longer than this fail the job instead of hanging it."""
# the planner's state-size model knows no elementwise Adagrad: count it as Adam (conservative)
_PLANNER_OPTIMIZER = {
    "sgd": "sgd",
    "adagrad": "adam",
    "rowwise_adagrad": "rowwise_adagrad",
    "adam": "adam",
}


@dataclass(frozen=True)
class Env:
    """Where this process runs: its rank, the world, its device and process group."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    process_group: dist.ProcessGroup | None


@contextlib.contextmanager
def distributed(device: str = "auto") -> Iterator[Env]:
    """One process: no process group. Under torchrun with WORLD_SIZE > 1: init gloo (CPU) or
    NCCL (GPU) with a timeout, and destroy it however the body exits."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if world <= 1:
        yield Env(rank=0, world_size=1, local_world_size=1, device=dev, process_group=None)
        return
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
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
        dist.destroy_process_group()


def _table_configs(cfg: JobConfig) -> list[torchrec.EmbeddingBagConfig]:
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
    ]


def _embedding_optimizer(c: EmbeddingOptimizerConfig) -> tuple[type, dict[str, Any]]:
    """The ``(class, kwargs)`` for ``apply_optimizer_in_backward`` that our EBC fuses."""
    kw: dict[str, Any] = {"lr": c.lr}
    if c.eps is not None and c.type != "sgd":
        kw["eps"] = c.eps
    if c.type == "sgd":
        return torch.optim.SGD, kw
    if c.type == "adagrad":
        return torch.optim.Adagrad, kw
    if c.type == "adam":
        return torch.optim.Adam, {**kw, "betas": c.betas}
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    return RowWiseAdagrad, {**kw, "weight_decay": c.weight_decay}


def _dense_optimizer(c: DenseOptimizerConfig, params: Sequence[nn.Parameter]):
    kw: dict[str, Any] = {"lr": c.lr, "weight_decay": c.weight_decay}
    if c.eps is not None and c.type != "sgd":
        kw["eps"] = c.eps
    if c.type == "sgd":
        return torch.optim.SGD(params, momentum=c.momentum, **kw)
    if c.type == "adagrad":
        return torch.optim.Adagrad(params, **kw)
    cls = torch.optim.Adam if c.type == "adam" else torch.optim.AdamW
    return cls(params, betas=c.betas, **kw)


def build_model(cfg: JobConfig, device: torch.device, world_size: int = 1) -> DLRM:
    """DLRM over our EmbeddingBagCollection, its tables annotated with the fused optimizer.

    With several ranks the tables are built on the meta device (nothing allocated):
    ``fbtriton_dist.shard`` initialises each rank's shards in place.
    """
    ebc = EmbeddingBagCollection(
        tables=_table_configs(cfg),
        device=torch.device("meta") if world_size > 1 else device,
        backend=cfg.backend,
    )
    cls, kwargs = _embedding_optimizer(cfg.optimizer.embedding)
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=cfg.data.num_dense,
        dense_arch_layer_sizes=list(cfg.model.dense_arch),
        over_arch_layer_sizes=list(cfg.model.over_arch),
        dense_device=device,
    )


def make_plan(cfg: JobConfig, world_size: int, local_world_size: int) -> tuple[ShardingPlan, str]:
    """The plan (planned, or read from ``sharding.plan`` and checked) and its printed report."""
    s = cfg.sharding
    H = s.local_world_size or local_world_size
    if world_size % H:
        H = world_size
    specs = cfg.tables.tables
    stats = dict(cfg.tables.stats)
    if cfg.data.source == "synthetic" and cfg.data.synthetic.zipf > 0:
        zipf = IdDistribution(kind="zipf", alpha=cfg.data.synthetic.zipf)
        stats = {t.name: stats.get(t.name, zipf) for t in specs}
    optimizer = _PLANNER_OPTIMIZER[cfg.optimizer.embedding.type]
    planner = ShardingPlanner(
        world_size=world_size,
        local_world_size=H,
        hbm_bytes_per_rank=s.hbm_gb * GiB,
        reserved_fraction=s.reserved,
        cost_model=CostModel(batch_size=cfg.train.batch_size),
        optimizer=optimizer,
        row_cuts=s.row_cuts,
    )
    if s.plan is not None:
        path = cfg.path(s.plan)
        plan = ShardingPlan.load_yaml(path)
        if plan.world_size != world_size:
            raise ValueError(
                f"{path}: plan is for world_size={plan.world_size}, this job runs on "
                f"{world_size} rank(s); plan again or drop sharding.plan"
            )
    else:
        plan = planner.plan(specs, cfg.tables.constraints, stats)
    plan.validate(specs, budget_bytes=planner.budget_bytes, optimizer=optimizer)
    cost = planner.cost(plan, specs, stats)
    title = f"job {cfg.name}: {len(specs)} tables on {planner.describe()}"
    return plan, format_report(plan, specs, cost, stats, title=title)


def _allreduce_mean(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
    """Average dense gradients over the ranks (one flat all-reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _timed(fn, timer: StageTimer, stage: str):
    def wrapper(*args, **kwargs):
        timer.start(stage)
        try:
            return fn(*args, **kwargs)
        finally:
            timer.stop(stage)

    return wrapper


def _time_embeddings(model: nn.Module, fqns: Sequence[str], timer: StageTimer) -> None:
    """Time each embedding module: a sharded one by its three stages (``input_dist``,
    ``compute`` as ``lookup``, ``output_dist``), an unsharded one by its forward (``lookup``)."""
    stages = {"input_dist": "input_dist", "compute": "lookup", "output_dist": "output_dist"}
    for fqn in fqns:
        m = model.get_submodule(fqn)
        if all(callable(getattr(m, name, None)) for name in stages):
            for name, stage in stages.items():
                setattr(m, name, _timed(getattr(m, name), timer, stage))
            continue
        m.register_forward_pre_hook(lambda *_: timer.start("lookup"))
        m.register_forward_hook(lambda *_: timer.stop("lookup"))


def evaluate(model: nn.Module, batches: Sequence[Batch], env: Env) -> dict[str, float]:
    """Loss and AUC over this rank's eval batches, AUC over every rank's predictions."""
    if not batches:
        return {}
    model.eval()
    scores, labels = [], []
    with torch.no_grad():
        for b in batches:
            b = b.to(env.device)
            scores.append(model(b.dense, b.sparse).squeeze(-1).float().cpu())
            labels.append(b.labels.cpu())
    model.train()
    s, y = torch.cat(scores), torch.cat(labels)
    if env.process_group is not None:
        gathered: list[Any] = [None] * env.world_size
        dist.all_gather_object(gathered, (s, y), group=env.process_group)
        s = torch.cat([g[0] for g in gathered])
        y = torch.cat([g[1] for g in gathered])
    loss = nn.functional.binary_cross_entropy_with_logits(s, y).item()
    return {"loss": loss, "auc": auc(s, y), "samples": int(y.numel())}


def _log(env: Env, text: str) -> None:
    if env.rank == 0:
        print(text, flush=True)


def train(cfg: JobConfig, env: Env, resume: bool = False) -> dict[str, Any]:
    """Run the job on this rank; return the summary (the same on every rank)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        return _train(cfg, env, resume)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _train(cfg: JobConfig, env: Env, resume: bool) -> dict[str, Any]:
    torch.manual_seed(cfg.seed)  # identical dense initial weights on every rank
    run_dir = cfg.run_dir
    if env.rank == 0:
        os.makedirs(run_dir, exist_ok=True)
    plan, report = make_plan(cfg, env.world_size, env.local_world_size)
    _log(env, report)
    if env.rank == 0:
        plan.save_yaml(os.path.join(run_dir, "plan.yaml"), header=f"plan of job {cfg.name}")
        _log(env, f"plan saved to {os.path.join(run_dir, 'plan.yaml')}")

    model = build_model(cfg, env.device, env.world_size)
    emb_fqns = [n for n, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)]
    # ---- the one multi-rank step: replace every EmbeddingBagCollection by its sharded twin ----
    if env.world_size > 1:
        import fbtriton_dist

        model = fbtriton_dist.shard(model, plan, env.process_group, env.device)
    dense_params = [
        p
        for n, p in model.named_parameters()
        if not any(n.startswith(f"{f}.") for f in emb_fqns) and p.requires_grad
    ]
    optimizer = _dense_optimizer(cfg.optimizer.dense, dense_params)

    source = make_source(
        cfg.tables,
        cfg.data,
        batch_size=cfg.train.batch_size,
        seed=cfg.seed,
        rank=env.rank,
        world_size=env.world_size,
        resolve=cfg.path,
    )
    step, position = 0, DataPosition()
    ckpt_dir = cfg.checkpoint_dir
    if resume:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            _log(env, f"--resume: no complete checkpoint in {ckpt_dir}, starting at step 0")
        else:
            state = load_checkpoint(path, model, optimizer, process_group=env.process_group)
            step = int(state["step"])
            position = DataPosition(epoch=int(state["epoch"]), samples=int(state["samples"]))
            _log(env, f"resumed from {path}: step {step}, epoch {position.epoch}")
    return _loop(cfg, env, model, optimizer, dense_params, emb_fqns, source, step, position)


def _loop(cfg, env, model, optimizer, dense_params, emb_fqns, source, step, position):
    from tqdm import tqdm

    t = cfg.train
    metrics = MetricsWriter(
        os.path.join(cfg.run_dir, cfg.logging.metrics) if env.rank == 0 else None,
        os.path.join(cfg.run_dir, cfg.logging.tensorboard) if cfg.logging.tensorboard else None,
    )
    timer = StageTimer(env.device)
    _time_embeddings(model, emb_fqns, timer)
    eval_batches = source.eval_batches(t.eval_batches) if t.eval_batches else []
    global_batch = t.batch_size * env.world_size
    bar = tqdm(
        total=t.steps,
        initial=step,
        desc=cfg.name,
        disable=env.rank != 0 or not cfg.logging.progress_bar,
        dynamic_ncols=True,
    )
    last_eval: dict[str, float] = {}
    last_ckpt = None
    window_loss, window_n, window_t0 = torch.zeros((), device=env.device), 0, time.perf_counter()
    run_t0, warm_t0, steps_run, last_loss = time.perf_counter(), None, 0, math.nan
    saved_at, last_step_end = None, time.perf_counter()
    paused = {"window": 0.0, "total": 0.0}  # seconds of eval and checkpointing, not training

    def pause(seconds: float) -> None:
        paused["window"] += seconds
        paused["total"] += seconds

    def checkpoint() -> str:
        train_state = {"step": step, **position.to_dict(), "world_size": env.world_size}
        return save_checkpoint(
            cfg.checkpoint_dir,
            step,
            model,
            optimizer,
            train_state,
            keep=cfg.checkpoint.keep,
            process_group=env.process_group,
        )

    try:
        done = t.steps is not None and step >= t.steps
        while not done:
            seen = 0
            for batch, next_position in source.train_batches(position):
                seen += 1
                batch = batch.to(env.device, non_blocking=True)
                timer.start("forward")
                logits = model(batch.dense, batch.sparse).squeeze(-1)
                loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
                timer.stop("forward")
                timer.start("backward")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # the embedding rows are updated here, by the fused optimizer
                if env.process_group is not None:
                    _allreduce_mean(dense_params, env.process_group)
                optimizer.step()
                timer.stop("backward")
                timer.step_done()
                step, position = step + 1, next_position
                steps_run += 1
                if steps_run == 1:  # the first step warms up: not timed
                    warm_t0, paused["total"] = time.perf_counter(), 0.0
                window_loss += loss.detach()
                window_n += 1
                bar.update(1)
                if step % cfg.logging.log_every == 0 or step == t.steps:
                    last_loss = window_loss.item() / window_n
                    now = time.perf_counter()
                    sps = window_n * global_batch / max(now - window_t0 - paused["window"], 1e-9)
                    paused["window"] = 0.0
                    metrics.write(
                        "train",
                        step,
                        loss=last_loss,
                        samples_per_s=sps,
                        epoch=position.epoch,
                        ms=_dense_split(timer.take()),
                    )
                    bar.set_postfix(loss=f"{last_loss:.4f}", samples_s=f"{sps:,.0f}")
                    window_loss.zero_()
                    window_n, window_t0 = 0, now
                t0 = time.perf_counter()
                if t.eval_every and step % t.eval_every == 0 and eval_batches:
                    last_eval = evaluate(model, eval_batches, env)
                    metrics.write("eval", step, **last_eval)
                every = cfg.checkpoint.every
                if cfg.checkpoint.enabled and every and step % every == 0:
                    last_ckpt, saved_at = checkpoint(), step
                pause(time.perf_counter() - t0)
                last_step_end = time.perf_counter()
                if t.steps is not None and step >= t.steps:
                    done = True
                    break
            else:
                if seen == 0 and position.samples == 0:
                    raise ValueError(
                        f"data: the {cfg.data.source} source gave no full batch of "
                        f"{global_batch} samples ({env.world_size} rank(s) x {t.batch_size})"
                    )
                position = DataPosition(epoch=position.epoch + 1, samples=0)
                done = t.epochs is not None and position.epoch >= t.epochs
        if eval_batches and (not t.eval_every or step % t.eval_every or not last_eval):
            last_eval = evaluate(model, eval_batches, env)
            metrics.write("eval", step, **last_eval)
        if cfg.checkpoint.enabled and steps_run and saved_at != step:
            last_ckpt = checkpoint()
        end = time.perf_counter()
        pause(end - last_step_end)
        timed = steps_run - 1
        summary = {
            "job": cfg.name,
            "world_size": env.world_size,
            "device": str(env.device),
            "steps": step,
            "steps_this_run": steps_run,
            "wall_s": end - run_t0,
            "samples_per_s": (
                timed * global_batch / (end - warm_t0 - paused["total"]) if timed > 0 else math.nan
            ),
            "train_loss": last_loss,
            "eval_loss": last_eval.get("loss", math.nan),
            "eval_auc": last_eval.get("auc", math.nan),
            "ms_per_step": _dense_split(timer.totals()),
            "checkpoint": last_ckpt or "-",
            "run_dir": cfg.run_dir,
        }
        metrics.write("summary", step, **{k: v for k, v in summary.items() if k != "step"})
    finally:
        bar.close()
        metrics.close()
    _log(env, format_summary(summary))
    return summary


def _dense_split(ms: dict[str, float]) -> dict[str, float]:
    """``forward`` covers the whole forward: report its non-embedding part as ``dense``."""
    out = dict(ms)
    forward = out.pop("forward", None)
    if forward is not None:
        emb = sum(out.get(s, 0.0) for s in ("input_dist", "lookup", "output_dist"))
        out["dense"] = max(forward - emb, 0.0)
    order = ("input_dist", "lookup", "output_dist", "dense", "backward")
    return {s: round(out[s], 3) for s in order if s in out}


def run(args: argparse.Namespace) -> int:
    """Load the job named by the parsed arguments and train it (0 on success)."""
    cfg = load_job(args.config, args.overrides, args.steps)
    with distributed(cfg.device) as env:
        train(cfg, env, resume=args.resume)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fbtriton_dist.train", description="Train a DLRM job from a YAML file."
    )
    add_arguments(p)
    args = finish_arguments(p, *p.parse_known_args(argv))
    try:
        return run(args)
    except (PlanError, PlanValidationError) as e:
        print(f"train: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError) as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 2
