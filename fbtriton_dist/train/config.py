"""The training job's YAML file as frozen dataclasses, and the command-line arguments of a job.

A job file (``configs/jobs/*.yaml``; every section but ``tables`` is optional)::

    name: quickstart                 # default: the file's stem; the run folder is runs/<name>
    seed: 0
    deterministic: true              # torch.use_deterministic_algorithms, exact resume
    device: auto                     # auto | cpu | cuda
    backend: auto                    # TBE backend: auto | triton | cpu | reference (ops.backends)
    tables: ../tables/small.yaml     # a table-set file (relative to this file), or a list of
                                     # table entries in the table-set schema (docs/planner.md)
    model: {dense_arch: [64, 16], over_arch: [64, 32, 1]}     # DLRM; dense_arch[-1] == D
                                     # or {kind: sequence, target: item, history: [item_seq],
                                     #     dense_arch: [..], over_arch: [.., 1]} (pooling: none
                                     #     tables are sequence tables), or {kind: dcnv2,
                                     #     cross_layers: 3, low_rank: 512} (MLPerf's sizes)
    data:
      source: synthetic              # synthetic | random_rec | criteo | multihot
      num_dense: 13
      synthetic: {zipf: 1.05, zipf_per_feature: {f0: 1.2}, noise: 0.5,
                  candidates_per_user: 1, user_features: null, vbe: true,  # K > 1: VBE
                  device: auto,  # auto (the training device) | cpu
                  drift: null}   # {new_ids_per_step, window, features}: drift_config.py
      random_rec: {ids_per_feature: null, num_generated_batches: 10}
      criteo: {train: [day_0.tsv], eval: [day_23.tsv]}
      multihot: {dir: /data/mh, train_days: 0-22, eval_days: [23], eval_part: val}
    sharding: {plan: null, hbm_gb: 80, host_budget_gb: null, disk_budget_gb: null, reserved: 0.1,
               file_dir: null,       # files of tables the planner puts on tier 'file'
               shard_tiers: false,   # hot shards of storage: auto tables back on device
               row_cuts: balanced,
               local_world_size: null,
               gradient_division: true,           # embedding gradients / R, as TorchRec
               group_size: null,     # S: replica groups of S ranks (null: the world, flat; auto)
               replica_sync: step,   # step (= the flat plan) | N: average replicas every N
               replica_sync_dtype: fp32,   # with N: the weights averaged in fp32 .. int8
               cost: {},             # CostModel bandwidths, bytes/s (bench link --out)
               comm: {wire_dtype: fp32,   # fp32 | bf16 | fp16 | fp8 | int8 on the wire
                      backward_wire_dtype: null,   # the gradients' (null: as wire_dtype)
                      dedup: false, fixed_shapes: false, max_ids: null}}  # no host sync
    optimizer:
      embedding: {type: rowwise_adagrad, lr: 0.05}     # fused into the TBE backward
      dense: {type: adagrad, lr: 0.01}                 # a torch optimizer on the dense params
      schedule: {warmup_steps: 0, decay_start: 0, decay_steps: 0,   # both rates: lr_schedule.py
                 decay_power: 2.0, end_factor: 0.0}
    train: {steps: 300, epochs: null, batch_size: 256, eval_every: 100, eval_batches: 4,
            nonfinite: error,          # error | skip: a step with a nan/inf loss or gradient
            pipeline: auto,            # auto | plain | overlap | graph (the step loop)
            prefetch_rows: auto}       # auto (file tables) | true (cached, file) | false
    checkpoint: {enabled: true, dir: null, every: 100, keep: 2}
    logging: {run_dir: null, metrics: metrics.jsonl, log_every: 10, progress_bar: true,
              tensorboard: null}

Errors name the file, the key path and the valid choices, e.g.
``configs/jobs/x.yaml: optimizer.embedding.type: expected one of [sgd, adagrad, ...], got 'ada'``.
Never imports torch: ``fbtriton-dist plan`` and argument parsing stay light.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from fbtriton_dist.ops import backends
from fbtriton_dist.planner import ConfigError, FieldError, TableSet, load_tables
from fbtriton_dist.planner._yaml import (
    build,
    check_choice,
    check_int,
    check_name,
    check_number,
    expect_mapping,
    read_yaml,
)
from fbtriton_dist.planner.cost_inputs import cost_values
from fbtriton_dist.planner.tables import table_set_from_dict

from . import mlperf_config as mlperf
from .config_values import (
    _check_bool,
    _check_optional,
    _feature_names,
    _ints,
    _numbers_by_name,
    _optional_strings,
    _pair,
    _strings,
)
from .drift_config import DriftConfig, check_drift, drift_section
from .mlperf_config import MultiHotConfig
from .optim_config import (
    CounterBasedRegularization,
    CowClipRegularization,
    DenseOptimizerConfig,
    EmbeddingOptimizerConfig,
    LrSchedule,
    OptimizerConfig,
    counter_definition,
    global_decay_definition,
)

__all__ = [
    "CheckpointConfig",
    "CommConfig",
    "CriteoConfig",
    "DataConfig",
    "DenseOptimizerConfig",
    "EmbeddingOptimizerConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RandomRecConfig",
    "ShardingConfig",
    "SyntheticConfig",
    "TrainConfig",
    "job_from_dict",
    "load_job",
]

DataSource = Literal["synthetic", "random_rec", "criteo", "multihot"]
ModelKind = Literal["dlrm", "dcnv2", "sequence"]
CRITEO_DENSE, CRITEO_SPARSE = 13, 26


def _choices(lit: Any) -> tuple[str, ...]:
    return lit.__args__


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    """The model around the tables: ``dlrm`` (``torchrec.models.dlrm.DLRM`` over the
    EmbeddingBagCollection) or ``sequence`` (``train/models.py``: target attention over
    behaviour sequences looked up by an EmbeddingCollection, pooled tables beside them)."""

    kind: ModelKind = "dlrm"
    """``dlrm``: every table pooled; ``dcnv2``: MLPerf's DLRM-dcnv2 (``models.DCNv2Model``,
    every table pooled, a low-rank cross network; layer sizes default to MLPerf's);
    ``sequence``: tables with ``pooling: none`` are sequence
    tables (an EmbeddingCollection), the others pooled (an EmbeddingBagCollection)."""
    dense_arch: tuple[int, ...] = (64, 16)
    """Layer sizes of the MLP over the dense features (DLRM: the last must equal every
    table's D)."""
    over_arch: tuple[int, ...] = (64, 1)
    """Layer sizes of the MLP over the interactions; at least two, the last is 1 (the logit)."""
    target: str | None = None
    """``sequence``: the feature holding each sample's candidate item (a sequence table's;
    its rows are averaged per sample)."""
    history: tuple[str, ...] = ()
    """``sequence``: behaviour-sequence features (sequence tables of the target's D), each
    attended to by the target."""
    cross_layers: int = 3
    """``dcnv2``: layers of the low-rank cross network."""
    low_rank: int = 512
    """``dcnv2``: rank r of each cross layer's ``W [N, r] V [r, N]``."""

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, _choices(ModelKind))
        check_int("cross_layers", self.cross_layers, 0)
        check_int("low_rank", self.low_rank, 1)
        if len(self.over_arch) < 2 or self.over_arch[-1] != 1:
            raise FieldError(
                "over_arch", f"expected at least two layer sizes ending in 1, got {self.over_arch}"
            )
        if self.kind == "sequence" and (self.target is None or not self.history):
            raise FieldError("target" if self.target is None else "history",
                             "a sequence model needs a target feature and history features")


@dataclass(kw_only=True, frozen=True)
class SyntheticConfig:
    """Zipf ids, Poisson bag lengths around each feature's pooling factor, learnable labels."""

    zipf: float = 1.05
    """Zipf exponent of features whose table has no ``id_distribution: {kind: zipf}``."""
    zipf_per_feature: Mapping[str, float] = field(default_factory=dict)
    """Exponent per feature name, overriding the above and the table set."""
    noise: float = 0.5
    """Std of the Gaussian noise added to the hidden logit (0: labels fully learnable)."""
    candidates_per_user: int = 1
    """K > 1: every user is scored against K candidate items, so a batch of B samples has
    ceil(B / K) users; the user features carry one bag per user and the item features one per
    sample (a VBE batch: ``stride_per_key_per_rank`` and ``inverse_indices``). 1: one bag per
    sample for every feature."""
    user_features: Sequence[str] | None = None
    """The user-side features with ``candidates_per_user`` > 1; None: the first half of the
    features in table order."""
    vbe: bool = True
    """With ``candidates_per_user`` > 1: false sends the same samples as a fixed batch (each
    user bag copied for each of its candidates), to compare against VBE."""
    device: str = "auto"
    """Where batches are made: ``auto`` the training device (on a GPU the ids are drawn
    there, by the data thread), ``cpu`` on the host (then copied)."""
    drift: DriftConfig | None = None
    """An open id space that drifts (raw int64 ids, new ones every step): ``drift_config.py``."""
    fixed_bags: bool = False
    """Every bag holds exactly its feature's pooling factor (rounded) ids, as MLPerf's
    multi-hot data; false: Poisson lengths around it."""

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("auto", "cpu"))
        check_number("zipf", self.zipf, 0.0)
        check_number("noise", self.noise, 0.0)
        check_int("candidates_per_user", self.candidates_per_user, 1)
        _check_bool("fixed_bags", self.fixed_bags)


@dataclass(kw_only=True, frozen=True)
class RandomRecConfig:
    """``torchrec.datasets.random.RandomRecDataset`` (uniform ids, random labels)."""

    ids_per_feature: int | None = None
    """Ids per bag; None: each feature's pooling factor, rounded, at least 1."""
    num_generated_batches: int = 10
    """Distinct batches it generates and then cycles through."""

    def __post_init__(self) -> None:
        _check_optional(check_int, "ids_per_feature", self.ids_per_feature, 1)
        check_int("num_generated_batches", self.num_generated_batches, 1)


@dataclass(kw_only=True, frozen=True)
class CriteoConfig:
    """Criteo click-logs TSV files: label, 13 integer and 26 hex categorical columns."""

    train: tuple[str, ...]
    """Training files, read in this order (relative paths: from the job file's folder)."""
    eval: tuple[str, ...] = ()
    """Evaluation files; empty: no evaluation."""
    features: tuple[str, ...] = ()
    """Feature name of each categorical column C1..C26; empty: the tables' features in order."""

    def __post_init__(self) -> None:
        if not self.train:
            raise FieldError("train", "expected at least one file")
        if self.features and len(self.features) != CRITEO_SPARSE:
            raise FieldError(
                "features", f"expected {CRITEO_SPARSE} names (C1..C26), got {len(self.features)}"
            )


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Where batches come from; only the section of ``source`` is used."""

    source: DataSource = "synthetic"
    """``synthetic``, ``random_rec`` or ``criteo``."""
    num_dense: int = CRITEO_DENSE
    """Dense features per sample (13 for Criteo)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """Options of ``source: synthetic``."""
    random_rec: RandomRecConfig = field(default_factory=RandomRecConfig)
    """Options of ``source: random_rec``."""
    criteo: CriteoConfig | None = None
    """Options of ``source: criteo`` (required with it)."""
    multihot: MultiHotConfig | None = None
    """Options of ``source: multihot`` (required with it): MLPerf's multi-hot Criteo files."""
    prefetch: int = 4
    """Training batches made ahead by a background thread (a bounded queue of this many;
    pinned on CUDA); 0: made in the training thread. The batches and order do not change."""

    def __post_init__(self) -> None:
        check_choice("source", self.source, _choices(DataSource))
        check_int("num_dense", self.num_dense, 1)
        check_int("prefetch", self.prefetch, 0)
        needs = {"criteo": (self.criteo, "train: [files]"), "multihot": (self.multihot, "dir")}
        section, what = needs.get(self.source, (0, ""))
        if section is None:
            raise FieldError(self.source, f"required with source: {self.source} ({what})")
        if self.source in needs and self.num_dense != CRITEO_DENSE:
            raise FieldError("num_dense", f"expected {CRITEO_DENSE} with source: {self.source}, "
                                          f"got {self.num_dense}")


WIRE_CHOICES = ("fp32", "bf16", "fp16", "fp8", "int8")
"""``sharding.comm.wire_dtype``'s choices (``planner.cost.WIRE_FORMATS``)."""


@dataclass(kw_only=True, frozen=True)
class CommConfig:
    """How the sharded collections talk (``fbtriton_dist.sharding.CommOptions``); exact by
    default."""

    wire_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8"] = "fp32"
    """Pooled embeddings (sequence: rows) and their gradients on the wire (decoded and summed
    in fp32); fp8 and int8 add an fp32 scale (int8: and min) per row (``CommOptions``)."""
    backward_wire_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8"] | None = None
    """The gradients' wire format (null: ``wire_dtype``)."""
    dedup: bool = False
    """Each destination gets its distinct ids once plus an inverse map (bit-identical)."""
    fixed_shapes: bool = False
    """Input messages of a size fixed at the first batch: no host sync in a step (bit-identical
    results). Every batch, train and eval, must have ``train.batch_size`` samples and at most
    ``max_ids`` ids per rank; bad ids are reported a few steps late. Not with ``dedup``."""
    max_ids: int | None = None
    """With ``fixed_shapes``: the most ids one rank's batch may hold (null: the first batch's
    count, which a later batch with more ids then exceeds: an error naming it)."""

    def __post_init__(self) -> None:
        check_choice("wire_dtype", self.wire_dtype, WIRE_CHOICES)
        if self.backward_wire_dtype is not None:
            check_choice("backward_wire_dtype", self.backward_wire_dtype, WIRE_CHOICES)
        _check_bool("dedup", self.dedup)
        _check_bool("fixed_shapes", self.fixed_shapes)
        _check_optional(check_int, "max_ids", self.max_ids, 1)
        if self.fixed_shapes and self.dedup:
            raise FieldError("fixed_shapes", "does not combine with dedup: true (dedup sizes "
                             "each message by its distinct ids, which change every batch)")
        if self.max_ids is not None and not self.fixed_shapes:
            raise FieldError("max_ids", "is the capacity of fixed_shapes: set fixed_shapes: "
                             "true with it")


@dataclass(kw_only=True, frozen=True)
class ShardingConfig:
    """How the tables are sharded: a plan file, or the planner's options."""

    plan: str | None = None
    """A plan YAML (``fbtriton-dist plan --out``) for exactly this world size; None: plan."""
    hbm_gb: float = 80.0
    """Device memory per rank in GiB."""
    host_budget_gb: float | None = None
    """Host memory per rank in GiB for the backing stores of tables on the ``host`` and
    ``cached`` storage tiers (a table's ``storage:``); None: not checked."""
    disk_budget_gb: float | None = None
    """Disk per rank in GiB for the files of tables on the ``file`` storage tier; None: not
    checked."""
    file_dir: str | None = None
    """The directory (relative to the job file) of the files of the tables the planner puts
    on the ``file`` tier (``storage: auto``; the planner's ``file_dir``); None: such a table
    is an error. Each run keeps its files in a folder of its own in it, as in a table's own
    ``storage.path`` (``train/file_tier.py``); not writable: refused before training."""
    shard_tiers: bool = False
    """A tier per shard (``plan --shard-tiers``, ``ShardingPlanner(shard_tiers=True)``): once
    the plan is made, the hottest shards of the ``storage: auto`` tables the planner put
    behind a cache (``cached`` / ``file``) go back on ``device`` while their rank's device
    budget holds them (``planner/shard_tiers.py``); false: every shard on its table's tier."""
    reserved: float = 0.1
    """Share of it kept for the dense model and buffers."""
    row_cuts: Literal["balanced", "equal"] = "balanced"
    """Skew-aware row cuts or equal row blocks."""
    local_world_size: int | None = None
    """Ranks per host; None: torchrun's LOCAL_WORLD_SIZE."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Wire dtype and id dedup of the sharded collections."""
    gradient_division: bool = True
    """Divide the embedding gradients by the world size in backward (TorchRec's default; the
    dense gradients are averaged over the ranks): a learning rate means the same on any
    number of ranks. false: the ranks' embedding gradients are summed (R times larger)."""
    group_size: int | Literal["auto"] | None = None
    """Replica groups (2D parallel): the R ranks split into R/S groups of S consecutive ranks,
    each sharding the tables by a plan for S ranks, replicated across groups (S must divide
    R); None: S = R, the flat plan; ``auto``: the planner proposes S
    (``planner.groups.propose_group_size``, as ``plan --group-size auto``)."""
    replica_sync: Literal["step"] | int = "step"
    """With ``group_size``: ``step``: the replicas of a shard make one fused update of all
    their ids every step (equals the flat plan on R ranks); an int N: each group trains on its
    own and weights and optimizer state are averaged over the replicas every N steps (and
    before each checkpoint, which saves one copy)."""
    replica_sync_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8"] = "fp32"
    """With ``replica_sync: N``: the wire format the weights are averaged in
    (``CommOptions.replica_sync_dtype``: two hops, each within ``wire_dtype``'s bound per
    hop; the optimizer state stays fp32); the planner costs the average in it. Only fp32
    with ``step``."""
    cost: Mapping[str, float] = field(default_factory=dict)
    """The planner's bandwidths in bytes/s by ``CostModel`` field name (``hbm_bandwidth``,
    ``host_tier_bandwidth``, ``disk_bandwidth``, ...: ``planner/cost_inputs.py``), e.g. what
    ``python -m fbtriton_dist.bench link`` measured; a key not given keeps the default."""

    def __post_init__(self) -> None:
        _check_optional(check_name, "plan", self.plan)
        check_number("hbm_gb", self.hbm_gb, 0.0, strict=True)
        if self.host_budget_gb is not None:
            check_number("host_budget_gb", self.host_budget_gb, 0.0, strict=True)
        if self.disk_budget_gb is not None:
            check_number("disk_budget_gb", self.disk_budget_gb, 0.0, strict=True)
        _check_optional(check_name, "file_dir", self.file_dir)
        _check_bool("shard_tiers", self.shard_tiers)
        check_number("reserved", self.reserved, 0.0)
        if self.reserved >= 1:
            raise FieldError("reserved", f"expected a number < 1, got {self.reserved}")
        check_choice("row_cuts", self.row_cuts, ("balanced", "equal"))
        _check_optional(check_int, "local_world_size", self.local_world_size, 1)
        _check_bool("gradient_division", self.gradient_division)
        S = self.group_size  # auto: the planner proposes S (train/planning.py)
        if S not in (None, "auto") and (isinstance(S, bool) or not isinstance(S, int) or S < 1):
            raise FieldError("group_size", f"expected an integer >= 1 dividing the world size, "
                             f"or auto (the planner proposes it), got {S!r}")
        sync = self.replica_sync
        if sync != "step" and (isinstance(sync, bool) or not isinstance(sync, int) or sync < 1):
            raise FieldError("replica_sync", f"expected step or an integer >= 1 (average the "
                             f"replicas every N steps), got {sync!r}")
        check_choice("replica_sync_dtype", self.replica_sync_dtype, WIRE_CHOICES)
        if sync == "step" and self.replica_sync_dtype != "fp32":
            raise FieldError("replica_sync_dtype", f"expected fp32 with replica_sync: step (its "
                             f"row gradients stay fp32; a format applies to replica_sync: N), "
                             f"got {self.replica_sync_dtype!r}")
        cost_values(self.cost)


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """How long to train, and how often to evaluate."""

    steps: int | None = None
    """Stop after this many steps (in all; a resumed job counts the steps already done)."""
    epochs: int | None = None
    """Stop after this many passes over the data (Criteo files); None: only ``steps``."""
    batch_size: int = 256
    """B, samples per rank per step."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end)."""
    eval_batches: int | Literal["all"] = 4
    """Batches per rank in one evaluation (0: never evaluate; ``all``: the whole eval set,
    ``data.source: multihot``)."""
    eval_every_epochs: float | None = None
    """Evaluate every this fraction of an epoch (MLPerf: 0.05), instead of ``eval_every``
    (``data.source: multihot``, whose epoch length is known)."""
    target_auc: float | None = None
    """Stop at the first evaluation whose AUC reaches this (MLPerf: 0.80275); the summary
    then gives ``time_to_target_s`` and ``target_step``."""
    pipeline: Literal["auto", "plain", "overlap", "graph"] = "auto"
    """The step loop. ``plain``: batch after batch, in order (debugging); ``overlap``:
    ``TrainPipeline``, the next batch's input dist runs while this batch trains (sharded runs;
    results equal plain); ``graph``: fixed shapes, the whole step one CUDA graph (CUDA, a
    process group, a batch of one shape: ``train/modes.py``); ``auto``: graph where
    it can run, else overlap when sharded and ``nonfinite: error``, else plain."""
    nonfinite: Literal["error", "skip"] = "error"
    """A step whose loss or dense gradient is not finite: ``error`` stops the job naming the
    step (found at the next log line or checkpoint, before anything is saved); ``skip``
    checks every step before its backward (one host sync) and drops it, counting the skips."""
    prefetch_rows: bool | Literal["auto"] = "auto"
    """Read the next batch's rows that the caches of tables on a cached tier miss ahead, on a
    worker thread while this step computes (``TableBatchedEmbedding.prefetch``; the plain loop
    in one process and the ``overlap`` pipeline; results unchanged). ``auto``: tables on the
    ``file`` tier only (a slow backing store; the worker's reads of a ``cached`` table's host
    rows cost a CPU step more than they hide: docs/storage.md); true: ``cached`` and
    ``file``; false: none."""

    def __post_init__(self) -> None:
        check_choice("nonfinite", self.nonfinite, ("error", "skip"))
        if self.prefetch_rows != "auto" and not isinstance(self.prefetch_rows, bool):
            raise FieldError("prefetch_rows", "expected auto, true or false, got "
                             f"{self.prefetch_rows!r}")
        check_choice("pipeline", self.pipeline, ("auto", "plain", "overlap", "graph"))
        if self.nonfinite == "skip" and self.pipeline in ("overlap", "graph"):
            raise FieldError("nonfinite", "skip checks each step before its backward: it "
                                          "needs pipeline: plain (or auto)")
        _check_optional(check_int, "steps", self.steps, 1)
        _check_optional(check_int, "epochs", self.epochs, 1)
        if self.steps is None and self.epochs is None:
            raise FieldError("steps", "give steps or epochs (or both)")
        check_int("batch_size", self.batch_size, 1)
        check_int("eval_every", self.eval_every, 0)
        if self.eval_batches != "all":
            check_int("eval_batches", self.eval_batches, 0)
        _check_optional(check_number, "eval_every_epochs", self.eval_every_epochs, 0.0, True)
        _check_optional(check_number, "target_auc", self.target_auc, 0.0)


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Atomic torch.distributed.checkpoint saves (see ``train/checkpoint.py``)."""

    enabled: bool = True
    """Save checkpoints (every ``every`` steps and at the end)."""
    dir: str | None = None
    """Where; None: ``<run_dir>/checkpoints``."""
    every: int = 0
    """Save every this many steps (0: only at the end)."""
    keep: int = 2
    """Keep the newest this many complete checkpoints."""

    def __post_init__(self) -> None:
        _check_bool("enabled", self.enabled)
        _check_optional(check_name, "dir", self.dir)
        check_int("every", self.every, 0)
        check_int("keep", self.keep, 1)


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    """Where results go and how progress is shown."""

    run_dir: str | None = None
    """Run folder (plan.yaml, metrics, checkpoints); None: ``runs/<name>``."""
    metrics: str = "metrics.jsonl"
    """Metrics JSONL file, relative to ``run_dir``."""
    log_every: int = 10
    """Write a train record every this many steps."""
    progress_bar: bool = True
    """Show a tqdm progress bar (rank 0)."""
    tensorboard: str | None = None
    """TensorBoard log folder, relative to ``run_dir``; None: off."""

    def __post_init__(self) -> None:
        _check_optional(check_name, "run_dir", self.run_dir)
        check_name("metrics", self.metrics)
        check_int("log_every", self.log_every, 1)
        _check_bool("progress_bar", self.progress_bar)
        _check_optional(check_name, "tensorboard", self.tensorboard)


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    """One training job; ``base_dir`` is the job file's folder (relative paths start there)."""

    name: str
    """Job name (default: the file's stem)."""
    tables: TableSet
    """The embedding tables, with their pooling factors and id distributions."""
    base_dir: str = "."
    """The job file's folder."""
    seed: int = 0
    """Seeds the model's initial weights and the synthetic data."""
    deterministic: bool = False
    """``torch.use_deterministic_algorithms(True)``: a resumed run repeats the same losses."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: cuda (LOCAL_RANK's GPU) when available, else cpu."""
    backend: str = "auto"
    """TBE backend: ``auto`` or a name of the registry (``ops.backends.names()``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The DLRM around the tables."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where batches come from."""
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """Plan file or planner options."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Fused embedding optimizer and dense optimizer."""
    train: TrainConfig
    """Steps / epochs, batch size, evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run folder, metrics, progress bar, TensorBoard."""
    table_scale: float = 1.0
    """Every table's rows times this (ceil, at least 1; ``tables`` already holds the scaled
    rows): MLPerf's tables on a CPU. Ids beyond a scaled table wrap (``% E``)."""

    def _check_model(self) -> None:
        tables = self.tables.tables
        sequence = [t for t in tables if t.pooling == "none"]
        if self.model.kind in ("dlrm", "dcnv2"):
            if sequence:
                raise FieldError(
                    "model.kind",
                    f"DLRM pools every table, but {[t.name for t in sequence]} have pooling "
                    "none (sequence tables): use model.kind: sequence",
                )
            D = self.model.dense_arch[-1]
            wrong = {t.name: t.embedding_dim for t in tables if t.embedding_dim != D}
            if wrong:
                raise FieldError(
                    "model.dense_arch",
                    f"DLRM needs every table's embedding_dim == dense_arch[-1] = {D}; "
                    f"tables {wrong} differ",
                )
            return
        table_of = {f: t for t in sequence for f in t.features}
        m = self.model
        for key, f in [("model.target", m.target)] + [
            (f"model.history[{i}]", h) for i, h in enumerate(m.history)
        ]:
            if f not in table_of:
                raise FieldError(key, f"{f!r} is not a feature of a sequence table (pooling: "
                                      f"none), expected one of {sorted(table_of)}")
        D = table_of[m.target].embedding_dim
        wrong = {h: table_of[h].embedding_dim for h in m.history
                 if table_of[h].embedding_dim != D}
        if wrong:
            raise FieldError("model.history", f"attention needs the target's D = {D}; the "
                                              f"history features {wrong} differ")

    def __post_init__(self) -> None:
        check_name("name", self.name)
        check_int("seed", self.seed, 0)
        _check_bool("deterministic", self.deterministic)
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("backend", self.backend, backends.choices())
        self._check_model()
        self._apply_state_dtype()
        features = [f for t in self.tables.tables for f in t.features]
        unknown = [f for f in self.data.synthetic.zipf_per_feature if f not in features]
        if unknown:
            raise FieldError(
                f"data.synthetic.zipf_per_feature.{unknown[0]}",
                f"not a feature of the tables, expected one of [{', '.join(features)}]",
            )
        check_drift(self.data.synthetic, features)
        users = self.data.synthetic.user_features or ()
        unknown = [f for f in users if f not in features]
        if unknown:
            raise FieldError(
                "data.synthetic.user_features",
                f"{unknown[0]!r} is not a feature of the tables, expected some of "
                f"[{', '.join(features)}]",
            )
        criteo = self.data.criteo
        if self.data.source == "criteo" and criteo is not None:
            if not criteo.features and len(features) != CRITEO_SPARSE:
                raise FieldError(
                    "data.criteo.features",
                    f"the tables have {len(features)} features, Criteo has {CRITEO_SPARSE} "
                    "categorical columns: list the feature of each column",
                )
            bad = [f for f in criteo.features if f not in features]
            if bad:
                raise FieldError(
                    "data.criteo.features",
                    f"{bad[0]!r} is not a feature of the tables, expected one of "
                    f"[{', '.join(features)}]",
                )
            missing = [f for f in features if criteo.features and f not in criteo.features]
            if missing:
                raise FieldError(
                    "data.criteo.features", f"no column for the tables' feature(s) {missing}"
                )
        mlperf.check_multihot_only(self.train, self.data.source)
        if self.train.steps is None and self.data.source not in ("criteo", "multihot"):
            raise FieldError("train.steps", f"required with data.source: {self.data.source}")

    def _apply_state_dtype(self) -> None:
        """Every table takes ``optimizer.embedding.state_dtype`` (the collections store one
        for all tables); a table set's ``state_dtype`` other than fp32 must say the same."""
        sd = self.optimizer.embedding.state_dtype
        wrong = {t.name: t.state_dtype for t in self.tables.tables
                 if t.state_dtype not in ("fp32", sd)}
        if wrong:
            raise FieldError("optimizer.embedding.state_dtype",
                             f"expected the tables' state_dtype {wrong} (one for all tables), "
                             f"got {sd!r}")
        if any(t.state_dtype != sd for t in self.tables.tables):
            specs = tuple(dataclasses.replace(t, state_dtype=sd) for t in self.tables.tables)
            object.__setattr__(self, "tables", dataclasses.replace(self.tables, tables=specs))

    def path(self, p: str) -> str:
        """``p`` relative to the job file's folder (absolute paths unchanged)."""
        return p if os.path.isabs(p) else os.path.normpath(os.path.join(self.base_dir, p))

    @property
    def run_dir(self) -> str:
        return self.logging.run_dir or os.path.join("runs", self.name)

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_dir, "checkpoints")


def _section(cls: type, where: str, convert: Mapping[str, Callable] | None = None) -> Callable:
    def make(value: Any, key: str) -> Any:
        return build(cls, value if value is not None else {}, where, key, convert=convert)

    return make


def _tables(where: str, base_dir: str) -> Callable[[Any, str], TableSet]:
    def make(value: Any, key: str) -> TableSet:
        if isinstance(value, str):
            path = value if os.path.isabs(value) else os.path.join(base_dir, value)
            return load_tables(os.path.normpath(path))
        if isinstance(value, list):
            return table_set_from_dict({"tables": value}, where)
        raise FieldError(key, f"expected a table-set file path or a list of tables, got {value!r}")

    return make


def job_from_dict(data: Any, where: str = "<job>", base_dir: str = ".") -> JobConfig:
    """Build a :class:`JobConfig` from the YAML mapping ``data`` found in ``where``."""
    top = dict(expect_mapping(where, "", data))
    name = top.pop("name", None)
    if name is None:
        name = os.path.splitext(os.path.basename(where))[0] if where != "<job>" else "job"
    scale = top.get("table_scale", 1.0)
    model = _section(ModelConfig, where,
                     {"dense_arch": _ints, "over_arch": _ints, "history": _feature_names})
    converters: dict[str, Callable] = {
        "tables": lambda v, k: mlperf.scale_tables(_tables(where, base_dir)(v, k), scale),
        "model": lambda v, k: model(mlperf.model_defaults(v), k),
        "data": _section(
            DataConfig,
            where,
            {
                "synthetic": _section(
                    SyntheticConfig, where,
                    {"zipf_per_feature": _numbers_by_name, "user_features": _optional_strings,
                     "drift": drift_section(where)}
                ),
                "random_rec": _section(RandomRecConfig, where),
                "criteo": _section(
                    CriteoConfig,
                    where,
                    {"train": _strings, "eval": _strings, "features": _strings},
                ),
                "multihot": _section(MultiHotConfig, where, mlperf.MULTIHOT_CONVERT),
            },
        ),
        "sharding": _section(ShardingConfig, where, {"comm": _section(CommConfig, where),
                                                     "cost": cost_values}),
        "optimizer": _section(
            OptimizerConfig,
            where,
            {
                "embedding": _section(EmbeddingOptimizerConfig, where, {
                    "betas": _pair, "counter": counter_definition(CounterBasedRegularization),
                    "cowclip": counter_definition(CowClipRegularization),
                    "global_weight_decay": global_decay_definition}),
                "dense": _section(DenseOptimizerConfig, where, {"betas": _pair}),
                "schedule": _section(LrSchedule, where),
            },
        ),
        "train": _section(TrainConfig, where),
        "checkpoint": _section(CheckpointConfig, where),
        "logging": _section(LoggingConfig, where),
    }
    top.setdefault("train", {})
    return build(
        JobConfig, top, where, "", convert=converters, extra={"name": name, "base_dir": base_dir}
    )


def apply_overrides(data: Any, overrides: Sequence[str], where: str) -> dict[str, Any]:
    """``key.path=value`` assignments (value parsed as YAML) applied to the job mapping."""
    out = dict(expect_mapping(where, "", data or {}))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(
                "command line", item, "expected an override KEY.PATH=VALUE, e.g. train.steps=50"
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError("command line", key, f"value is not valid YAML: {text!r}") from e
        node = out
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                raise ConfigError(
                    "command line", ".".join(parts[: i + 1]), "is not a mapping in the job file"
                )
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return out


def load_job(
    path: str | os.PathLike[str], overrides: Sequence[str] = (), steps: int | None = None
) -> JobConfig:
    """Read a job YAML file (``yaml.safe_load``) with ``key.path=value`` overrides applied."""
    where = os.fspath(path)
    data = read_yaml(where)
    if data is None:  # else "expected a mapping, got NoneType"
        raise ConfigError(where, "", "the job file is empty; a job needs at least `tables:` "
                          "(docs/training.md, configs/jobs/quickstart.yaml)")
    if steps is not None:
        overrides = [*overrides, f"train.steps={steps}"]
    if overrides:
        data = apply_overrides(data, overrides, where)
    return job_from_dict(data, where, os.path.dirname(os.path.abspath(where)))
