"""The training loop: steps, logging, evaluation, checkpoints and the final summary."""

from __future__ import annotations

import contextlib
import math
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.modules.ec import EmbeddingCollection

from .checkpoint import latest_checkpoint, nonfinite_weights, save_checkpoint
from .config import JobConfig
from .data import Batch, DataPosition
from .env import Env
from .lr_schedule import apply_learning_rates
from .metrics import (
    STAGES,
    CacheMetrics,
    IdManagerMetrics,
    MetricsWriter,
    StageTimer,
    Throughput,
    auc,
)
from .modes import prefetch_tiers, resolve_pipeline
from .resume import job_identity

NO_BAD_STEP = 2**62
"""``Trainer._first_bad`` while every step so far was finite."""


def ahead(items, depth: int, prepare=None):
    """``items`` made by a background thread up to ``depth`` ahead (0: here, as they are
    asked for); the same items in the same order. ``prepare(item)``, run in that thread on
    each item, gives what is handed out (the job pins batches into page-locked memory there on
    CUDA, so their copies to the GPU are asynchronous). An error of the producer is raised
    here; leaving early (``close()``, a ``return`` in the consumer) stops the thread."""
    if depth <= 0:
        yield from items
        return
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce():
        try:
            for item in items:
                if prepare is not None:
                    item = prepare(item)
                while not stop.is_set():
                    try:
                        out.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            out.put((done, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            out.put((done, e))

    worker = threading.Thread(target=produce, name="fbtd-data", daemon=True)
    worker.start()
    try:
        while True:
            item, error = out.get()
            if item is done:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                out.get_nowait()
            worker.join(timeout=0.05)


def check_lengths(batch: Batch, step: int) -> None:
    """Refuse a batch (on the host) holding a negative KJT length, naming the feature and the
    length: the lookup would otherwise fail on the offsets made from it ("offsets: expected
    non-decreasing values"), which the user never gave. Batches made on the GPU (the
    synthetic source's own) are not checked: that would synchronise every step."""
    lengths = batch.sparse.lengths()
    if lengths.device.type != "cpu" or not lengths.numel() or int(lengths.min()) >= 0:
        return
    first = int((lengths < 0).nonzero()[0, 0])
    start = 0
    for key, stride in zip(batch.sparse.keys(), batch.sparse.stride_per_key(), strict=True):
        if first < start + stride:
            raise ValueError(
                f"data: the batch of step {step + 1}: feature {key!r}: lengths[{first - start}] "
                f"= {int(lengths[first])} (bag {first - start} of {stride}) is negative; "
                "a KJT length is the number of ids in a bag, 0 or more")
        start += stride
    raise ValueError(f"data: the batch of step {step + 1}: lengths[{first}] = "
                     f"{int(lengths[first])} is negative")


def _pinned(item):
    """``(batch, position)`` with the batch in page-locked memory (copied to the GPU with
    ``non_blocking=True``: the copy overlaps the step before it)."""
    batch, position = item
    return batch.pin_memory(), position


class NonFiniteError(RuntimeError):
    """A step's loss or dense gradient was not finite (``train.nonfinite: error``)."""

__all__ = ["Trainer", "evaluate"]


def allreduce_mean(params: Sequence[nn.Parameter], group: dist.ProcessGroup) -> None:
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


def timed(fn, timer: StageTimer, stage: str):
    """``fn`` wrapped so that each call is timed as ``stage`` (anything with start/stop)."""

    def wrapper(*args, **kwargs):
        timer.start(stage)
        try:
            return fn(*args, **kwargs)
        finally:
            timer.stop(stage)

    return wrapper


def time_embeddings(model: nn.Module, fqns: Sequence[str], timer: StageTimer) -> None:
    """Time each embedding module: a sharded one by its three stages (``input_dist``,
    ``compute`` as ``lookup``, ``output_dist``), an unsharded one by its forward (``lookup``)."""
    stages = {"input_dist": "input_dist", "compute": "lookup", "output_dist": "output_dist"}
    for fqn in fqns:
        m = model.get_submodule(fqn)
        if all(callable(getattr(m, name, None)) for name in stages):
            for name, stage in stages.items():
                setattr(m, name, timed(getattr(m, name), timer, stage))
            continue
        m.register_forward_pre_hook(lambda *_: timer.start("lookup"))
        m.register_forward_hook(lambda *_: timer.stop("lookup"))


def time_dense(model: nn.Module, fqns: Sequence[str], timer: StageTimer) -> None:
    """Time the model's dense parts as ``dense`` directly: each top-level child that holds no
    embedding module (DLRM's dense_arch, inter_arch, over_arch). The pipeline needs this: its
    embedding stages do not all run inside the forward, so ``forward`` minus them (the plain
    loop's ``dense``) came out negative and was shown as 0."""
    for name, child in model.named_children():
        if any(f == name or f.startswith(f"{name}.") for f in fqns):
            continue
        child.register_forward_pre_hook(lambda *_: timer.start("dense"))
        child.register_forward_hook(lambda *_: timer.stop("dense"))


def split_dense(ms: dict[str, float]) -> dict[str, float]:
    """``forward`` covers the whole forward: report its non-embedding part as ``dense``
    (unless ``dense`` was timed directly, ``time_dense``)."""
    out = dict(ms)
    forward = out.pop("forward", None)
    if forward is not None and "dense" not in out:
        emb = sum(out.get(s, 0.0) for s in ("input_dist", "lookup", "output_dist"))
        out["dense"] = max(forward - emb, 0.0)
    return {s: round(out[s], 3) for s in STAGES if s in out}


def evaluate(model: nn.Module, batches: Sequence[Batch], env: Env) -> dict[str, float]:
    """Loss and AUC over every rank's predictions on its eval batches."""
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


GRAPH_WARMUP = 3
"""Eager steps of ``train.pipeline: graph`` before the capture."""


class Trainer:
    """Runs ``cfg.train`` on this rank from a step and data position; see :meth:`fit`.

    ``mode``: the resolved ``train.pipeline`` the model was built for (``modes.py``); None:
    resolved here. Stage times: the plain loop and ``overlap`` time each stage with the
    stage timer; ``graph`` times the whole replayed step (``step``: CUDA events around each
    replay, nothing recorded inside the capture)."""

    def __init__(
        self,
        cfg: JobConfig,
        env: Env,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dense_params: Sequence[nn.Parameter],
        embedding_fqns: Sequence[str],
        source,
        mode: str | None = None,
    ) -> None:
        self.cfg, self.env, self.model, self.optimizer = cfg, env, model, optimizer
        self.dense_params = list(dense_params)
        self.source = source
        self.mode = mode or self.loop_mode()
        graph = self.mode == "graph"
        # graph: the eager warm-up steps and the capture are not counted
        self.timer = StageTimer(env.device, warmup_steps=GRAPH_WARMUP + 2 if graph else 1)
        if not graph:  # a captured step has no stages to time: it is timed as a whole
            time_embeddings(model, embedding_fqns, self.timer)
        if self.mode == "overlap":
            time_dense(model, embedding_fqns, self.timer)
        self.throughput = Throughput(cfg.train.batch_size * env.world_size)
        self.id_metrics = IdManagerMetrics([model.get_submodule(f) for f in embedding_fqns])
        """Managed tables' occupancy, hit rate, admissions and evictions per step."""
        self.cache_metrics = CacheMetrics([model.get_submodule(f) for f in embedding_fqns],
                                          env.process_group)
        """Cached tables' hit rate and rows fetched / written back per step."""
        self.step, self.position = 0, DataPosition()
        self.steps_run = 0
        self.last_loss = math.nan
        self.last_eval: dict[str, float] = {}
        self.last_checkpoint: str | None = None
        self._saved_at: int | None = None
        self._window_loss = torch.zeros((), device=env.device)
        self._window_steps = 0
        self._window_skipped = 0  # steps of the window dropped by train.nonfinite: skip
        self._first_bad = torch.full((), NO_BAD_STEP, dtype=torch.int64, device=env.device)
        """The first step whose loss or dense gradient was not finite (train.nonfinite:
        error); read at log lines and checkpoints, never per step; updated in place (a CUDA
        graph replays the update)."""
        self._step_t = torch.zeros((), dtype=torch.int64, device=env.device)
        """The step being trained, counted on the device (a replayed graph counts too)."""
        self.skipped = 0  # steps dropped by train.nonfinite: skip
        self.target: dict[str, float] = {}
        """``train.target_auc`` reached: the step and seconds since the loop began."""
        self._embedding_modules = [model.get_submodule(f) for f in embedding_fqns]
        self.lr_factor = 1.0
        """``optimizer.schedule``'s factor of the base learning rates at the last step."""
        self.row_tiers = prefetch_tiers(cfg)
        """The storage tiers whose rows the step loop reads ahead (``train.prefetch_rows``)."""
        self.rows_ahead = self._rows_ahead_modules()
        """The collections whose next batch's rows the plain loop reads ahead."""

    # -- one step --------------------------------------------------------------------------
    def _schedule_rates(self, k: int) -> None:
        """Set both optimizers' rates for the ``k``-th step (``optimizer.schedule``); nothing
        when the schedule is constant or the factor did not change."""
        schedule = self.cfg.optimizer.schedule
        if schedule.constant:
            return
        f = schedule.factor(k)
        if f == self.lr_factor and k > 1:
            return
        o = self.cfg.optimizer
        apply_learning_rates(self._embedding_modules, self.optimizer.param_groups,
                             o.embedding.lr * f, o.dense.lr * f)
        self.lr_factor = f

    def _rows_ahead_modules(self) -> list[nn.Module]:
        """The collections whose rows the plain loop reads ahead: in one process (no process
        group; the ``overlap`` pipeline reads the sharded ones' rows), our unsharded
        collections with a table on a tier of ``train.prefetch_rows``."""
        if self.env.process_group is not None or self.mode != "plain" or not self.row_tiers:
            return []
        return [m for m in self._embedding_modules
                if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
                and any(s.tier in self.row_tiers for s in m.table_storage().values())]

    def train_step(self, batch: Batch, upcoming: Batch | None = None) -> torch.Tensor | None:
        """One step; returns its loss (detached), or None when ``train.nonfinite: skip``
        dropped it. ``upcoming``: the next step's batch (as the data gave it, on the host
        unless the source made it on the device), whose rows the caches miss are read ahead
        on the collections' worker threads from the end of this step's forward (its lookups
        have taken their rows; a lookup takes the prefetch in flight) while the backward runs
        (``rows_ahead``)."""
        batch = batch.to(self.env.device, non_blocking=True)
        self.timer.start("forward")
        logits = self.model(batch.dense, batch.sparse).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        self.timer.stop("forward")
        if upcoming is not None:
            for m in self.rows_ahead:
                m.prefetch(upcoming.sparse, tiers=self.row_tiers)
        skip = self.cfg.train.nonfinite == "skip"
        if skip and self._any_rank(~torch.isfinite(loss.detach())):
            self.skipped += 1  # before backward: the fused update never sees it
            self.timer.step_done()
            return None
        self.timer.start("backward")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the embedding rows are updated here, by the fused optimizer
        if self.env.process_group is not None:
            allreduce_mean(self.dense_params, self.env.process_group)
        if skip:
            grads = [p.grad.sum() for p in self.dense_params if p.grad is not None]
            bad = ~torch.isfinite(torch.stack(grads).sum() if grads else torch.zeros(()))
            if self._any_rank(bad):
                self.skipped += 1  # a gradient overflowed: the dense step is dropped
            else:
                self.optimizer.step()
        else:
            self._note_finite(loss.detach())
            self.optimizer.step()
        self.timer.stop("backward")
        self.timer.step_done()
        return loss.detach()

    def _any_rank(self, flag: torch.Tensor) -> bool:
        """Whether ``flag`` is set on some rank (a host sync; every rank gets the answer)."""
        flag = flag.to(torch.int32).reshape(1)
        if self.env.process_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.env.process_group)
        return bool(flag.item())

    def _check_finite(self) -> None:
        """Stop if some rank saw a non-finite loss or gradient (``train.nonfinite: error``):
        called at log lines, before checkpoints and at the end, on every rank alike."""
        if self.cfg.train.nonfinite != "error":
            return
        first = self._first_bad.clone().reshape(1)
        if self.env.process_group is not None:
            dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.env.process_group)
        step = int(first.item())
        if step != NO_BAD_STEP:
            raise NonFiniteError(
                f"step {step}: the loss or a dense gradient is not finite (nan/inf); stopped "
                "before any later checkpoint (look for nan/inf in the inputs, or lower the "
                f"learning rates; train.nonfinite: skip drops such steps instead)"
            )

    # -- around the steps ------------------------------------------------------------------
    def _window_mean(self) -> float:
        """The window's mean loss over its trained steps; nan when ``train.nonfinite: skip``
        dropped every one of them (never 0: no step was trained)."""
        if not self._window_steps:
            return math.nan
        return self._window_loss.item() / self._window_steps

    def _log(self, metrics: MetricsWriter, bar) -> None:
        self.last_loss = self._window_mean()
        sps = self.throughput.window()
        ms = split_dense(self.timer.take())
        managed = {"id_managers": self.id_metrics.take()} if self.id_metrics else {}
        if self.cache_metrics:
            managed["caches"] = self.cache_metrics.take(self.step)
        skipped = ({"skipped": self._window_skipped} if self.cfg.train.nonfinite == "skip"
                   else {})
        o = self.cfg.optimizer  # the rates of the window's last step
        rates = ({} if o.schedule.constant else
                 {"lr": {"embedding": o.embedding.lr * self.lr_factor,
                         "dense": o.dense.lr * self.lr_factor}})
        metrics.write(
            "train", self.step, loss=self.last_loss, samples_per_s=sps,
            epoch=self.position.epoch, ms=ms, **skipped, **managed, **rates,
        )  # fmt: skip
        bar.set_postfix(loss=f"{self.last_loss:.4f}", samples_s=f"{sps:,.0f}")
        if getattr(self, "_plain_lines", False):
            total = f"/{self.cfg.train.steps}" if self.cfg.train.steps else ""
            dropped = (f" ({self._window_skipped} step(s) skipped: not finite)"
                       if self._window_skipped else "")
            print(f"{self.cfg.name}: step {self.step}{total}, loss {self.last_loss:.4f}"
                  f"{dropped}, {sps:,.0f} samples/s", flush=True)
        self._window_loss.zero_()
        self._window_steps = self._window_skipped = 0

    def _evaluate(self, metrics: MetricsWriter, batches: Sequence[Batch]) -> None:
        if getattr(self.source, "eval_follows_step", False):  # drifting data: evaluate on
            batches = self.source.eval_batches_at(self.step, len(batches))  # what comes next
        self.last_eval = evaluate(self.model, batches, self.env)
        metrics.write("eval", self.step, **self.last_eval)

    def _checkpoint(self) -> None:
        if self.cfg.sharding.replica_sync != "step":  # replicas averaged every N steps: one
            for m in self._embedding_modules:         # copy of each shard is what DCP saves
                sync = getattr(m, "sync_replicas", None)
                if sync is not None:
                    sync()
        bad = nonfinite_weights(self.model, self.env.process_group)
        if bad:  # never a checkpoint of nan/inf weights: the last good one stays
            kept = latest_checkpoint(self.cfg.checkpoint_dir) or "none"
            raise NonFiniteError(
                f"step {self.step}: {', '.join(bad)}: weights not finite (nan/inf); the "
                f"checkpoint of step {self.step} was not written, the last good checkpoint "
                f"is kept: {kept} (lower the learning rates, or look for nan/inf in the "
                "inputs)")
        state = {"step": self.step, **self.position.to_dict(), "world_size": self.env.world_size}
        self.last_checkpoint = save_checkpoint(
            self.cfg.checkpoint_dir,
            self.step,
            self.model,
            self.optimizer,
            state,
            keep=self.cfg.checkpoint.keep,
            process_group=self.env.process_group,
            about=job_identity(self.cfg),
        )
        self._saved_at = self.step

    def _batches(self):
        """``(batch, position after it)`` until ``train.steps`` or ``train.epochs`` is reached."""
        t = self.cfg.train
        pin = _pinned if self.env.device.type == "cuda" else None
        handed = self.step  # batches handed out: a loop may take one ahead of its step
        while t.steps is None or self.step < t.steps:
            seen = 0
            made = self.source.train_batches(self.position)
            for item in ahead(made, self.cfg.data.prefetch, prepare=pin):
                check_lengths(item[0], handed)
                handed += 1
                seen += 1
                yield item
                if t.steps is not None and self.step >= t.steps:
                    return
            if seen == 0 and self.position.samples == 0:
                raise ValueError(
                    f"data: the {self.cfg.data.source} source gave no full batch of "
                    f"{self.throughput.samples_per_step} samples ({self.env.world_size} rank(s) "
                    f"x {t.batch_size})"
                )
            self.position = DataPosition(epoch=self.position.epoch + 1, samples=0)
            if t.epochs is not None and self.position.epoch >= t.epochs:
                return

    # -- the step loop: plain, or the pipeline -------------------------------------------------
    def loop_mode(self) -> str:
        """``train.pipeline`` resolved: ``plain``, ``overlap`` or ``graph`` (``modes.py``)."""
        return resolve_pipeline(self.cfg, self.env.device.type,
                                self.env.process_group is not None)

    def _steps(self):
        """``(loss or None, data position after the step)`` per step trained."""
        mode = self.mode
        if mode == "plain" and self.rows_ahead:
            yield from self._steps_reading_ahead()
            return
        if mode == "plain":
            for batch, position in self._batches():
                self._schedule_rates(self.step + 1)
                yield self.train_step(batch), position
            return
        pipe = self._pipeline(mode)
        positions: deque[DataPosition] = deque()

        def feed():  # the pipeline takes a batch ahead; positions stay with their batches
            for batch, position in self._batches():
                positions.append(position)
                yield batch

        batches, t = feed(), self.cfg.train
        whole = mode == "graph"  # CUDA events around the replay: the step's time on the GPU
        while t.steps is None or self.step < t.steps:
            if whole:
                self.timer.start("step")
            self._schedule_rates(self.step + 1)  # the step progress() trains
            try:
                loss = pipe.progress(batches)
            except StopIteration:
                self.timer.cancel("step")
                if pipe.graph is not None:
                    pipe.graph.poll()  # a bad id in the last replays: said now
                return
            if whole:
                self.timer.stop("step")
            self.timer.step_done()
            yield loss, positions.popleft()

    def _steps_reading_ahead(self):
        """The plain loop with rows read ahead: batch i + 1 is taken from the data before
        step i and handed to ``train_step`` (none after the last step of ``train.steps``).
        Results equal the plain loop's (``modules/tiers.py``: a copy made stale by a
        write-back is never used); an evaluation or a checkpoint between two steps is exact
        too (an evaluation's lookups take the prefetch in flight)."""
        steps = self.cfg.train.steps
        batches = self._batches()
        item = next(batches, None)
        while item is not None:
            batch, position = item
            last = steps is not None and self.step + 1 >= steps
            item = None if last else next(batches, None)
            self._schedule_rates(self.step + 1)
            yield self.train_step(batch, None if item is None else item[0]), position

    def _pipeline(self, mode: str):
        """``TrainPipeline`` over this model: the step's forward and backward timed as the
        plain loop's (``overlap``; ``graph`` is timed around each replay, see ``_steps``),
        dense gradients averaged after backward, the non-finite flag kept as ``train_step``
        keeps it (in place: a replay updates it)."""
        from fbtriton_dist.sharding import TrainPipeline

        graph, group = mode == "graph", self.env.process_group

        def loss_fn(model, batch):
            if not graph:
                self.timer.start("forward")
            logits = model(batch.dense, batch.sparse).squeeze(-1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            if not graph:
                self.timer.stop("forward")
                self.timer.start("backward")
            self._pending_loss = loss.detach()
            return loss

        def after_backward():
            if group is not None:
                allreduce_mean(self.dense_params, group)
            self._note_finite(self._pending_loss)
            if not graph:
                self.timer.stop("backward")

        return TrainPipeline(self.model, self.optimizer, self.env.device, loss_fn=loss_fn,
                             sparse=lambda b: b.sparse, after_backward=after_backward,
                             own_group=True, cuda_graph=graph, warmup=GRAPH_WARMUP,
                             prefetch_rows=self.row_tiers)

    def _note_finite(self, loss: torch.Tensor) -> None:
        """Keep the first step whose loss or dense gradient is not finite (no host sync; in
        place, with the step counted on the device, so a CUDA graph replays it)."""
        grads = [p.grad.sum() for p in self.dense_params if p.grad is not None]
        bad = ~torch.isfinite(loss + (torch.stack(grads).sum() if grads else 0.0))
        self._step_t.add_(1)
        self._first_bad.copy_(torch.where(bad & (self._first_bad == NO_BAD_STEP),
                                          self._step_t, self._first_bad))

    def fit(self, step: int = 0, position: DataPosition | None = None) -> dict[str, Any]:
        """Train from ``step`` / ``position`` to the end; return the summary."""
        from tqdm import tqdm

        cfg, t = self.cfg, self.cfg.train
        self.step, self.position = step, position or DataPosition()
        self._step_t.fill_(step)
        if self.id_metrics:
            self.id_metrics.begin()
        if self.cache_metrics:
            self.cache_metrics.begin(self.step)
        rank0 = self.env.rank == 0
        metrics = MetricsWriter(
            os.path.join(cfg.run_dir, cfg.logging.metrics) if rank0 else None,
            os.path.join(cfg.run_dir, cfg.logging.tensorboard) if cfg.logging.tensorboard else None,
        )
        eval_batches = self.source.eval_batches(t.eval_batches) if t.eval_batches else []
        # a bar on a terminal; in a log file (not a TTY) plain lines at each log step instead
        tty = sys.stderr.isatty()
        bar = tqdm(
            total=t.steps,
            initial=step,
            desc=cfg.name,
            disable=not rank0 or not cfg.logging.progress_bar or not tty,
            dynamic_ncols=True,
        )
        self._plain_lines = rank0 and cfg.logging.progress_bar and not tty
        every_eval = self.eval_interval()
        t0 = time.perf_counter()
        self.throughput.restart_clock()
        try:
            for loss, next_position in self._steps():
                if loss is not None:
                    self._window_loss += loss
                    self._window_steps += 1
                else:
                    self._window_skipped += 1
                self.step, self.position = self.step + 1, next_position
                self.steps_run += 1
                bar.update(1)
                log_now = self.step % cfg.logging.log_every == 0 or self.step == t.steps
                if log_now:  # read the loss (a device sync) before the step's end is marked
                    self._check_finite()
                    self.last_loss = self._window_mean()
                self.throughput.step()
                if log_now:
                    self._log(metrics, bar)
                every_ckpt = cfg.checkpoint.every
                if every_eval and self.step % every_eval == 0 and eval_batches:
                    self._evaluate(metrics, eval_batches)
                    if self._reached_target(time.perf_counter() - t0):
                        break
                if cfg.checkpoint.enabled and every_ckpt and self.step % every_ckpt == 0:
                    self._check_finite()  # never a checkpoint of nan weights
                    self._checkpoint()
                self.throughput.restart_clock()
            self._check_finite()
            if self._window_steps or self._window_skipped:
                self._log(metrics, bar)
            evaluated_last_step = every_eval and self.step % every_eval == 0 and self.last_eval
            if eval_batches and not evaluated_last_step:
                self._evaluate(metrics, eval_batches)
                self._reached_target(time.perf_counter() - t0)
            if cfg.checkpoint.enabled and self.steps_run and self._saved_at != self.step:
                self._checkpoint()
            summary = self.summary(time.perf_counter() - t0)
            metrics.write("summary", self.step, **summary)
        finally:
            bar.close()
            metrics.close()
        return summary

    def eval_interval(self) -> int:
        """Steps between evaluations: ``train.eval_every``, or ``eval_every_epochs`` of the
        source's ``steps_per_epoch`` (at least 1)."""
        t = self.cfg.train
        per_epoch = getattr(self.source, "steps_per_epoch", None)
        if t.eval_every_epochs is None or per_epoch is None:
            return t.eval_every
        return max(1, round(per_epoch * t.eval_every_epochs))

    def _reached_target(self, seconds: float) -> bool:
        """Whether the last evaluation reached ``train.target_auc`` (noted the first time)."""
        target = self.cfg.train.target_auc
        if target is None or not self.last_eval.get("auc", math.nan) >= target:
            return False  # an AUC of nan (one class only) never reaches it
        if not self.target:
            self.target = {"target_step": self.step, "time_to_target_s": seconds}
            if self.env.rank == 0:
                print(f"{self.cfg.name}: eval AUC {self.last_eval['auc']:.5f} >= target "
                      f"{target} at step {self.step}, {seconds:.1f} s", flush=True)
        return True

    def summary(self, wall_s: float) -> dict[str, Any]:
        sps = self.throughput.run()
        target = ({"target_auc": str(self.cfg.train.target_auc),
                   **(self.target or {"target_step": "not reached"})}
                  if self.cfg.train.target_auc is not None else {})
        return {
            "job": self.cfg.name,
            "world_size": self.env.world_size,
            "device": str(self.env.device),
            "steps": self.step,
            "steps_this_run": self.steps_run,
            "wall_s": wall_s,
            "samples_per_s": sps,
            "samples_per_s_per_rank": sps / self.env.world_size,
            **target,
            "train_loss": self.last_loss,
            "eval_loss": self.last_eval.get("loss", math.nan),
            "eval_auc": self.last_eval.get("auc", math.nan),
            "pipeline": self.mode,
            "ms_per_step": split_dense(self.timer.totals()),
            "skipped_steps": self.skipped,
            "checkpoint": self.last_checkpoint if self.last_checkpoint
            and os.path.isdir(self.last_checkpoint) else "-",
            "run_dir": self.cfg.run_dir,
            **({"id_managers": self.id_metrics.run()} if self.id_metrics else {}),
            **({"caches": self.cache_metrics.run(self.step)} if self.cache_metrics else {}),
        }
