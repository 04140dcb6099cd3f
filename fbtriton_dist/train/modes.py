"""Which step loop a job runs (``train.pipeline``), decided before the model is built.

``graph`` changes how the model is built (fixed-shape input dists with a capacity, a dense
optimizer that can be captured), so the job resolves the mode first, from the config, the
device and whether there is a process group:

* ``plain``: batch after batch (always possible).
* ``overlap``: ``TrainPipeline``, the next batch's input dist while this one trains (needs
  sharded collections, i.e. a process group).
* ``graph``: the whole step, with the next batch's input dist, one CUDA graph replay
  (``TrainPipeline(cuda_graph=True)``): CUDA, a process group (several ranks, or
  ``torchrun --nproc-per-node 1``), a batch of the same shape every step, a bound on the ids
  of a batch (the job then builds a dense optimizer that can be captured: Adam/AdamW with
  ``capturable=True``, Adagrad as ``dense_optim.CapturableAdagrad``).
* ``auto``: ``graph`` where it can run (nothing in :func:`graph_blockers` stands in the way),
  else ``overlap`` with a process group and ``nonfinite: error``, else ``plain``
  (:data:`AUTO_PICKS_GRAPH` turns the first choice off).

Managed tables (``id_manager:``) run ``plain``: their remap is part of the input dist, and
the next batch's remap ahead of this step's update would re-initialise a row this step still
updates (a slot evicted for a new id), and put the next step's map into this step's
checkpoint.

Torch-free: only the config is read.
"""

from __future__ import annotations

import math

from fbtriton_dist import optim
from fbtriton_dist.planner import ConfigError

from .config import CRITEO_SPARSE, JobConfig

__all__ = ["AUTO_PICKS_GRAPH", "graph_blockers", "max_ids_bound", "prefetch_tiers",
           "resolve_pipeline"]

AUTO_PICKS_GRAPH = True
"""Whether ``auto`` picks ``graph`` where it can run (CUDA, a process group, a constant batch
size, a known id bound). It was off while the job's graph step failed on an H200 (2026-12-02:
the data thread pinning batches invalidated the capture; captures are now thread-local,
``fbtriton_dist.graphs.CAPTURE_MODE``); ``tests/train/test_gpu_pipeline.py`` checks it there."""


def max_ids_bound(cfg: JobConfig) -> int | None:
    """The most ids one rank's batch can hold (the fixed input dist's capacity): the
    configured ``sharding.comm.max_ids``, else what the data source allows: Criteo one id per
    categorical column and sample, ``random_rec`` at most ``ids_per_feature`` per bag,
    synthetic Poisson bag lengths ``mean + 8 std`` (a batch above it: about 1e-15 per step).
    None: no bound known."""
    if cfg.sharding.comm.max_ids is not None:
        return cfg.sharding.comm.max_ids
    B, data = cfg.train.batch_size, cfg.data
    if data.source == "criteo":
        return B * CRITEO_SPARSE
    factors = []
    for t in cfg.tables.tables:
        pf = t.pooling_factors or [1.0] * len(t.features)
        factors += list(pf)
    if data.source == "random_rec":
        per_bag = data.random_rec.ids_per_feature
        return B * sum(per_bag or max(1, round(L)) for L in factors)
    mean = B * sum(factors)
    return math.ceil(mean + 8 * math.sqrt(mean)) + 16


def prefetch_tiers(cfg: JobConfig) -> frozenset[str]:
    """The storage tiers whose tables' rows the step loop reads ahead
    (``train.prefetch_rows``): ``auto``: ``file``; true: ``cached`` and ``file``; false:
    none. The plain loop (one process) and the ``overlap`` pipeline both read them."""
    choice = cfg.train.prefetch_rows
    if choice == "auto":
        return frozenset({"file"})
    return frozenset({"cached", "file"}) if choice else frozenset()


def _managed_blocker(cfg: JobConfig) -> str | None:
    """Why a pipelined loop cannot run managed tables (None: none are managed)."""
    names = list(cfg.tables.id_managers)
    if not names:
        return None
    return (f"managed tables {names} (id_manager) remap ids in the input dist: the next "
            "batch's remap must not run before this step's update")


def _whole_table_step_blocker(cfg: JobConfig) -> str | None:
    """Why the embedding optimizer keeps the step out of a CUDA graph (None: it does not):
    EMA in place's and ensemble's whole-table steps are chosen on the host by the step count
    before each training lookup; a replayed graph would skip them."""
    name = cfg.optimizer.embedding.type
    if not issubclass(optim.spec(name).config, (optim.EmaInplaceRowWiseAdagrad,
                                                 optim.EnsembleRowWiseAdagrad)):
        return None
    return (f"optimizer.embedding.type: {name} runs a whole-table step chosen on the host by "
            "the step count before each training lookup, which a replayed CUDA graph would "
            "skip")


def graph_blockers(cfg: JobConfig, device_type: str, grouped: bool) -> list[str]:
    """Why the job cannot run ``train.pipeline: graph`` here (empty: it can)."""
    why = []
    managed = _managed_blocker(cfg)
    if managed:
        why.append(managed)
    if device_type != "cuda":
        why.append(f"the device is {device_type}, a CUDA graph needs CUDA")
    if not grouped:
        why.append("one process without a process group has no sharded tables to capture "
                   "(run it under torchrun, also with --nproc-per-node 1)")
    if cfg.train.nonfinite != "error":
        why.append("train.nonfinite: skip checks every step on the host")
    if not cfg.optimizer.schedule.constant:
        why.append("optimizer.schedule changes the dense learning rate every step (a CUDA "
                   "graph replays the captured one)")
    if cfg.optimizer.embedding.optimizer_name == "rowwise_adagrad_with_counter":
        why.append("optimizer.embedding: rowwise Adagrad with counter copies its parameters "
                   "from the host every step")
    if cfg.sharding.comm.dedup:
        why.append("sharding.comm.dedup: true sizes messages per step")
    table_step = _whole_table_step_blocker(cfg)
    if table_step:
        why.append(table_step)
    ahead = [t.name for t in cfg.tables.tables if t.storage is not None and t.storage.cached
             and t.storage.tier in prefetch_tiers(cfg)]
    if ahead:
        why.append(f"tables {ahead} read their rows ahead (train.prefetch_rows) on a worker "
                   "thread beside eager steps; a CUDA graph step maps them before each "
                   "replay instead (set train.prefetch_rows: false)")
    if cfg.model.kind == "sequence":
        why.append(f"model.kind: {cfg.model.kind} (the sharded EmbeddingCollection has no "
                   "fixed shapes)")
    syn = cfg.data.synthetic
    if cfg.data.source == "synthetic" and syn.candidates_per_user > 1 and syn.vbe:
        why.append("data.synthetic.candidates_per_user > 1 with vbe: a batch size per feature")
    if max_ids_bound(cfg) is None:
        why.append("no bound on the ids of a batch: set sharding.comm.max_ids")
    return why


def resolve_pipeline(cfg: JobConfig, device_type: str, grouped: bool) -> str:
    """``train.pipeline`` resolved to ``plain``, ``overlap`` or ``graph`` for a job on
    ``device_type`` (``grouped``: the job has a process group, so its tables are sharded).
    An explicit ``graph`` that cannot run here raises ConfigError naming every reason."""
    mode = cfg.train.pipeline
    managed = _managed_blocker(cfg)
    if mode == "overlap" and managed and grouped:
        raise ConfigError("<job>", "train.pipeline", f"overlap cannot run here: {managed}; "
                          "use plain or auto")
    if mode == "auto":
        if not grouped or cfg.train.nonfinite != "error" or managed:
            return "plain"
        if AUTO_PICKS_GRAPH and not graph_blockers(cfg, device_type, grouped):
            return "graph"
        return "overlap"
    if mode == "graph":
        why = graph_blockers(cfg, device_type, grouped)
        if why:
            raise ConfigError("<job>", "train.pipeline", "graph captures the whole step in a "
                              "CUDA graph; here it cannot: " + "; ".join(why))
        return mode
    return mode if grouped else "plain"  # one process: no input dist to overlap
