"""The job's ``optimizer:`` section (torch-free): the fused embedding optimizer of every table,
the dense layers' torch optimizer and the learning-rate schedule of both (``lr_schedule.py``).
Its keys are documented in docs/training.md; ``config.py`` reads the section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fbtriton_dist import optim, optim_counter, optim_ensemble, optim_gwd
from fbtriton_dist.optim_counter import CounterBasedRegularization, CowClipRegularization
from fbtriton_dist.planner._yaml import FieldError, check_choice, check_number

from .config_values import _check_optional
from .lr_schedule import LrSchedule

__all__ = ["DenseOptimizerConfig", "EmbeddingOptimizerConfig", "LrSchedule", "OptimizerConfig"]

DenseOptimizer = Literal["sgd", "adagrad", "adam", "adamw"]


@dataclass(kw_only=True, frozen=True)
class EmbeddingOptimizerConfig:
    """The fused optimizer of every table (``apply_optimizer_in_backward``)."""

    type: str = "rowwise_adagrad"
    """A name of ``optim.REGISTRY`` (``optim.NAMES``: sgd, adagrad, rowwise_adagrad, ...)."""
    lr: float = 0.01
    """Learning rate."""
    eps: float | None = None
    """Denominator epsilon; None: the default of the optimizer's torch / TorchRec class (its
    registry entry's), as with ``apply_optimizer_in_backward``."""
    weight_decay: float = 0.0
    """Weight decay (only where the optimizer's torch class takes it: rowwise_adagrad (L2),
    partial_rowwise_adam, lamb, partial_rowwise_lamb (decoupled), lars_sgd)."""
    weight_decay_mode: str | None = None
    """rowwise_adagrad's ``none``, ``l2`` or ``decoupled`` (``optim.WEIGHT_DECAY_MODES``;
    FBGEMM's ``weight_decay_mode``), or ``counter`` / ``cowclip`` (rowwise Adagrad with
    counter: ``rowwise_adagrad_with_counter``, its definition under ``counter:`` /
    ``cowclip:``), or ``decoupled_global`` (global weight decay:
    ``rowwise_adagrad_global_decay``, its definition under ``global_weight_decay:``); None: its
    default, ``l2`` (``counter`` / ``decoupled_global`` for those two types)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """The moment decays of adam, partial_rowwise_adam, lamb, partial_rowwise_lamb."""
    eta: float | None = None
    """lars_sgd's trust coefficient; None: its default."""
    momentum: float | None = None
    """lars_sgd's momentum; None: its default."""
    beta: float | None = None
    """ftrl's beta; None: its default."""
    l1: float | None = None
    """ftrl's L1 regularisation; None: its default."""
    l2: float | None = None
    """ftrl's L2 regularisation; None: its default."""
    step_ema: float | None = None
    """emainplace_rowwise_adagrad's and ensemble_rowwise_adagrad's moving-average period in
    steps; None: its default."""
    step_start: float | None = None
    """emainplace_rowwise_adagrad's first moving-average step (ensemble_rowwise_adagrad's last
    step of coefficient 0); None: its default."""
    step_ema_coef: float | None = None
    """emainplace_rowwise_adagrad's and ensemble_rowwise_adagrad's moving-average coefficient;
    None: its default."""
    step_swap: float | None = None
    """ensemble_rowwise_adagrad's swap period in steps (>= 1); None: its default."""
    step_mode: str | None = None
    """ensemble_rowwise_adagrad's ``none``, ``use_counter`` or ``use_iter`` (FBGEMM's
    ``StepMode``); None: its default, ``use_iter``."""
    ar_alpha: float | None = None
    """rowwise_rmsprop_ar's adaptive decay coefficient; None: its default."""
    ema_beta: float | None = None
    """rowwise_rmsprop_ar's decay of the mean squared gradient; None: its default."""
    min_shrinkage: float | None = None
    """rowwise_rmsprop_ar's floor of the decay factor; None: its default."""
    state_dtype: str = "fp32"
    """Storage of every table's optimizer states, ``fp32``, ``fp16`` or ``bf16`` (FBGEMM's
    ``optimizer_state_dtypes`` for each state; the update runs in fp32); the planner counts
    it (``TableSpec.state_dtype``)."""
    counter: CounterBasedRegularization | None = None
    """``weight_decay_mode: counter``'s definition (FBGEMM's
    ``CounterBasedRegularizationDefinition`` fields); None: its defaults."""
    cowclip: CowClipRegularization | None = None
    """``weight_decay_mode: cowclip``'s definition (FBGEMM's ``CowClipDefinition`` fields);
    None: its defaults."""
    global_weight_decay: optim_gwd.GlobalWeightDecay | None = None
    """``weight_decay_mode: decoupled_global``'s definition (FBGEMM's
    ``GlobalWeightDecayDefinition`` fields ``start_iter``, ``lower_bound``); None: its
    defaults."""

    def __post_init__(self) -> None:
        check_choice("type", self.type, optim.NAMES)
        check_number("lr", self.lr, 0.0)
        _check_optional(check_number, "eps", self.eps, 0.0)
        check_number("weight_decay", self.weight_decay, 0.0)
        _check_optional(check_choice, "weight_decay_mode", self.weight_decay_mode,
                        optim.WEIGHT_DECAY_MODES + optim_counter.COUNTER_MODES
                        + (optim_gwd.GLOBAL_MODE,))
        _check_counter(self)
        for name in ("eta", "momentum", "beta", "l1", "l2", "step_start", "step_ema_coef",
                     "ar_alpha", "ema_beta", "min_shrinkage"):
            _check_optional(check_number, name, getattr(self, name), 0.0)
        check_choice("state_dtype", self.state_dtype, tuple(optim.STATE_DTYPE_BYTES))
        _check_optional(check_number, "step_ema", self.step_ema, 1.0)
        _check_optional(check_number, "step_swap", self.step_swap, 1.0)
        _check_optional(check_choice, "step_mode", self.step_mode, optim_ensemble.STEP_MODES)
        # the keys an optimizer reads are the keyword arguments of its torch / TorchRec class
        # (optim.REGISTRY's ``keywords``)
        given = {"weight_decay": bool(self.weight_decay)}
        given.update({k: getattr(self, k) is not None for k in ("eta", "momentum", "beta", "l1",
                                                                 "l2", "weight_decay_mode",
                                                                 "step_ema", "step_start",
                                                                 "step_ema_coef", "ar_alpha",
                                                                 "ema_beta", "min_shrinkage",
                                                                 "step_swap", "step_mode")})
        for key in (k for k, v in given.items() if v):
            if key not in {**optim.spec(self.type).keywords, **optim.spec(self.type).modes}:
                takers = [n for n in optim.NAMES
                          if key in {**optim.spec(n).keywords, **optim.spec(n).modes}]
                raise FieldError(
                    key, f"only supported with type: {', '.join(takers)}, got type: {self.type}"
                )


    @property
    def optimizer_name(self) -> str:
        """The registry entry it builds: ``type``, or ``rowwise_adagrad_with_counter`` for
        rowwise_adagrad with ``weight_decay_mode`` counter / cowclip (the planner counts its
        states)."""
        if self.type == "rowwise_adagrad" and self.weight_decay_mode in optim_counter.COUNTER_MODES:
            return "rowwise_adagrad_with_counter"
        if self.type == "rowwise_adagrad" and self.weight_decay_mode == optim_gwd.GLOBAL_MODE:
            return "rowwise_adagrad_global_decay"
        return self.type


def _check_counter(c: EmbeddingOptimizerConfig) -> None:
    """``counter:`` / ``cowclip:`` go with their ``weight_decay_mode``, which goes with
    rowwise Adagrad; rowwise_adagrad_with_counter takes only those two modes."""
    takers = ("rowwise_adagrad", "rowwise_adagrad_with_counter")
    mode = c.weight_decay_mode
    if mode in optim_counter.COUNTER_MODES and c.type not in takers:
        raise FieldError("weight_decay_mode", f"{mode} is only supported with type: "
                         f"{', '.join(takers)}, got type: {c.type}")
    if c.type == "rowwise_adagrad_with_counter" and mode not in (None,
                                                                 *optim_counter.COUNTER_MODES):
        raise FieldError("weight_decay_mode", f"expected one of [counter, cowclip] with type: "
                         f"rowwise_adagrad_with_counter, got {mode!r}")
    effective = mode or {"rowwise_adagrad_with_counter": "counter", "rowwise_adagrad_global_decay":
                         optim_gwd.GLOBAL_MODE}.get(c.type)
    gwd_takers = ("rowwise_adagrad", "rowwise_adagrad_global_decay")
    if mode == optim_gwd.GLOBAL_MODE and c.type not in gwd_takers:
        raise FieldError("weight_decay_mode", f"{mode} is only supported with type: "
                         f"{', '.join(gwd_takers)}, got type: {c.type}")
    if c.type == gwd_takers[1] and mode not in (None, optim_gwd.GLOBAL_MODE):
        raise FieldError("weight_decay_mode", f"expected decoupled_global with type: "
                         f"{gwd_takers[1]}, got {mode!r}")
    for key, needs in (("counter", "counter"), ("cowclip", "cowclip"),
                       ("global_weight_decay", optim_gwd.GLOBAL_MODE)):
        if getattr(c, key) is not None and effective != needs:
            raise FieldError(key, f"only supported with weight_decay_mode: {needs}, got "
                             f"weight_decay_mode: {mode}")


def counter_definition(cls: type):
    """The job YAML's ``counter:`` / ``cowclip:`` mapping as ``cls`` (a converter of
    ``config.py``'s sections): a bad key or value names its full key path."""
    def make(value, key: str):
        try:
            return optim_counter.regularization(value if value is not None else {}, cls)
        except optim_counter.DefinitionError as e:
            raise FieldError(f"{key}.{e.field}" if e.field else key, e.message) from e

    return make


def global_decay_definition(value, key: str) -> optim_gwd.GlobalWeightDecay:
    """The job YAML's ``global_weight_decay:`` mapping (a converter of ``config.py``'s
    sections): a bad key or value names its full key path."""
    try:
        return optim_gwd.definition(value if value is not None else {})
    except optim_counter.DefinitionError as e:
        raise FieldError(f"{key}.{e.field}" if e.field else key, e.message) from e


@dataclass(kw_only=True, frozen=True)
class DenseOptimizerConfig:
    """The torch optimizer of the dense parameters."""

    type: DenseOptimizer = "adagrad"
    """``sgd``, ``adagrad``, ``adam`` or ``adamw``."""
    lr: float = 0.01
    """Learning rate."""
    weight_decay: float = 0.0
    """Weight decay."""
    momentum: float = 0.0
    """SGD momentum."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's moment decays."""
    eps: float | None = None
    """Denominator epsilon; None: the optimizer's default."""

    def __post_init__(self) -> None:
        check_choice("type", self.type, DenseOptimizer.__args__)
        for name in ("lr", "weight_decay", "momentum"):
            check_number(name, getattr(self, name), 0.0)
        _check_optional(check_number, "eps", self.eps, 0.0)


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """The two optimizers of a job: fused for the tables, torch for the dense layers."""

    embedding: EmbeddingOptimizerConfig = field(default_factory=EmbeddingOptimizerConfig)
    """Fused embedding optimizer."""
    dense: DenseOptimizerConfig = field(default_factory=DenseOptimizerConfig)
    """Dense optimizer."""
    schedule: LrSchedule = field(default_factory=LrSchedule)
    """Warm-up and decay of both optimizers' learning rates (``train/lr_schedule.py``);
    default: constant."""
