"""Rowwise Adagrad with counter (FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` with ``weight_decay_mode``
COUNTER or COWCLIP, its ``rowwise_adagrad_with_counter`` update): the config and its two
regularisation definitions, torch-free (``optim.py`` registers it; the planner and the job
config read it). The update: ``reference/counter.py``; the formulas: ``docs/optimizers.md``.

Besides the per-row accumulator ``momentum1`` it keeps, per row, ``prev_iter`` (the step of the
row's last update, 0 before its first) and ``row_counter`` (its decayed occurrence count), and
per module ``max_counter`` (1 + the largest ``row_counter``, refreshed every
``max_counter_update_freq`` steps). FBGEMM's definitions (``CounterBasedRegularizationDefinition``,
``CowClipDefinition`` and their enums) are taken as given and stored as the dataclasses below.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

COUNTER_WEIGHT_DECAY_MODES = ("none", "l2", "decoupled", "adagradw")
"""``counter_weight_decay_mode``: FBGEMM's ``CounterWeightDecayMode`` NONE, L2, DECOUPLE,
ADAGRADW (values 0..3)."""
LEARNING_RATE_MODES = ("equal", "tail_id_lr_increase", "tail_id_lr_decrease", "counter_sgd")
"""``learning_rate_mode``: FBGEMM's ``LearningRateMode`` EQUAL, TAIL_ID_LR_INCREASE,
TAIL_ID_LR_DECREASE, COUNTER_SGD (values -1..2)."""
GRAD_SUM_DECAYS = ("no_decay", "ctr_decay")
"""``grad_sum_decay``: FBGEMM's ``GradSumDecay`` NO_DECAY, CTR_DECAY (values -1, 0); FBGEMM's
kernels carry it without reading it, so it changes nothing here either."""
COUNTER_MODES = ("counter", "cowclip")
"""``weight_decay_mode`` of this optimizer: FBGEMM's ``WeightDecayMode`` COUNTER (3), COWCLIP
(4)."""

class DefinitionError(ValueError):
    """A bad field of a regularisation definition: ``field`` its name, ``message`` why (the
    config and the job's YAML prefix their key path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


_FIRST_VALUE = {COUNTER_WEIGHT_DECAY_MODES: 0, LEARNING_RATE_MODES: -1, GRAD_SUM_DECAYS: -1,
                COUNTER_MODES: 3}
_ALIASES = {"decouple": "decoupled"}


def choice(value: Any, choices: tuple[str, ...], key: str) -> str:
    """``value`` as one of ``choices``: ours, or FBGEMM's enum member (its name), its name in
    any case, or its integer value."""
    raw = value
    if isinstance(value, int) and not isinstance(value, bool):
        index = int(value) - _FIRST_VALUE[choices]
        raw = choices[index] if 0 <= index < len(choices) else value
    elif hasattr(value, "name") and isinstance(value.name, str):
        raw = value.name
    if isinstance(raw, str):
        raw = _ALIASES.get(raw.lower(), raw.lower())
    if raw not in choices:
        raise DefinitionError(key, f"expected one of [{', '.join(choices)}] (or FBGEMM's enum "
                              f"member or value), got {value!r}")
    return raw


def _integer(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise DefinitionError(key, f"expected an integer, got {value!r}")
    return int(value)


def _at_least(key: str, value: Any, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise DefinitionError(key, f"expected a number {bound}, got {value!r}")
    return float(value)


@dataclass(kw_only=True, frozen=True)
class CounterBasedRegularization:
    """FBGEMM's ``CounterBasedRegularizationDefinition`` (``weight_decay_mode="counter"``)."""

    counter_weight_decay_mode: Literal["none", "l2", "decoupled", "adagradw"] = "none"
    """How weight decay enters (``COUNTER_WEIGHT_DECAY_MODES``)."""
    counter_halflife: int = -1
    """> 0: a row's counter halves every this many steps it is not seen; 0: the counter is 1;
    < 0: the raw count (ADAGRADW's -1 and -2 also pick its learning-rate scaling)."""
    adjustment_iter: int = -1
    """The adjustments and the decay start after this step (<= 0: from the first)."""
    adjustment_ub: float = 1.0
    """The exponent (tail-id modes) or counter scale (``counter_sgd``) of the rate adjustment;
    ADAGRADW's bound with ``counter_halflife=-2`` (>= 0)."""
    learning_rate_mode: Literal["equal", "tail_id_lr_increase", "tail_id_lr_decrease",
                                "counter_sgd"] = "equal"
    """How a row above the tail-id threshold scales its rate (``LEARNING_RATE_MODES``)."""
    grad_sum_decay: Literal["no_decay", "ctr_decay"] = "no_decay"
    """FBGEMM's ``GradSumDecay`` (no effect, as in FBGEMM's kernels)."""
    tail_id_threshold: float = 0.0
    """Rows whose counter exceeds it get the learning-rate adjustment (>= 0)."""
    tail_id_threshold_is_ratio: bool = False
    """``tail_id_threshold`` is a fraction (in [0, 1]) of ``max_counter`` (floored)."""
    max_counter_update_freq: int = 1000
    """``max_counter`` is refreshed before the update of every step that is a multiple of
    this (<= 0: never; it stays 1)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for key, choices in (("counter_weight_decay_mode", COUNTER_WEIGHT_DECAY_MODES),
                             ("learning_rate_mode", LEARNING_RATE_MODES),
                             ("grad_sum_decay", GRAD_SUM_DECAYS)):
            set_(self, key, choice(getattr(self, key), choices, key))
        for key in ("counter_halflife", "adjustment_iter", "max_counter_update_freq"):
            set_(self, key, _integer(key, getattr(self, key)))
        set_(self, "adjustment_ub", _at_least("adjustment_ub", self.adjustment_ub, 0.0))
        if not isinstance(self.tail_id_threshold_is_ratio, bool):
            raise DefinitionError("tail_id_threshold_is_ratio", "expected true or false, got "
                                  f"{self.tail_id_threshold_is_ratio!r}")
        set_(self, "tail_id_threshold", _at_least(
            "tail_id_threshold", self.tail_id_threshold, 0.0,
            1.0 if self.tail_id_threshold_is_ratio else math.inf))


@dataclass(kw_only=True, frozen=True)
class CowClipRegularization:
    """FBGEMM's ``CowClipDefinition`` (``weight_decay_mode="cowclip"``): the row's step is
    clipped to ``row_counter * max(weight_norm_coefficient * ||w||, lower_bound)``."""

    counter_weight_decay_mode: Literal["none", "l2", "decoupled", "adagradw"] = "none"
    """How weight decay enters (``adagradw`` decays nothing here, as in FBGEMM)."""
    counter_halflife: int = -1
    """As ``CounterBasedRegularization.counter_halflife``."""
    weight_norm_coefficient: float = 0.0
    """Scale of the row norm in the clip threshold (>= 0)."""
    lower_bound: float = 0.0
    """Floor of the clip threshold per count (>= 0)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "counter_weight_decay_mode", choice(
            self.counter_weight_decay_mode, COUNTER_WEIGHT_DECAY_MODES,
            "counter_weight_decay_mode"))
        object.__setattr__(self, "counter_halflife",
                           _integer("counter_halflife", self.counter_halflife))
        for key in ("weight_norm_coefficient", "lower_bound"):
            object.__setattr__(self, key, _at_least(key, getattr(self, key), 0.0))


def regularization(value: Any, cls: type):
    """``value`` as ``cls``: an instance, FBGEMM's definition (same field names; its
    ``TailIdThreshold`` becomes ``tail_id_threshold`` + ``tail_id_threshold_is_ratio``) or a
    mapping of those fields (the job's YAML). Raises ``DefinitionError`` (``field`` "" where
    the value as a whole is wrong)."""
    if isinstance(value, cls):
        return value
    names = [f.name for f in fields(cls)]
    if isinstance(value, Mapping):
        given = dict(value)
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise DefinitionError(unknown[0], f"unknown key, expected one of [{', '.join(names)}]")
    elif all(hasattr(value, n) for n in names if n != "tail_id_threshold_is_ratio"):
        given = {n: getattr(value, n) for n in names if hasattr(value, n)}
    else:
        raise DefinitionError("", f"expected a mapping or FBGEMM's definition with fields "
                              f"[{', '.join(names)}], got {value!r}")
    threshold = given.get("tail_id_threshold")
    if threshold is not None and hasattr(threshold, "val"):  # FBGEMM's TailIdThreshold
        given["tail_id_threshold"] = threshold.val
        given["tail_id_threshold_is_ratio"] = bool(threshold.is_ratio)
    return cls(**given)


@dataclass(kw_only=True, frozen=True)
class RowWiseAdagradWithCounter:
    """Rowwise Adagrad whose rate and decay depend on how often a row is seen (FBGEMM's
    ``weight_decay_mode`` COUNTER with ``counter_based_regularization``, or COWCLIP with
    ``cowclip_regularization``). The update: ``docs/optimizers.md``."""

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to sqrt(m) in the denominator."""
    weight_decay: float = 0.0
    """Weight decay coefficient (how it enters: ``counter_weight_decay_mode``)."""
    weight_decay_mode: Literal["counter", "cowclip"] = "counter"
    """FBGEMM's COUNTER or COWCLIP (``WeightDecayMode`` members and values taken)."""
    counter_based_regularization: CounterBasedRegularization | None = None
    """COUNTER's definition (None: FBGEMM's defaults); None with ``cowclip``."""
    cowclip_regularization: CowClipRegularization | None = None
    """COWCLIP's definition (None: FBGEMM's defaults); None with ``counter``."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        try:
            for key in ("lr", "eps", "weight_decay"):
                _at_least(key, getattr(self, key), 0.0)
            mode = choice(self.weight_decay_mode, COUNTER_MODES, "weight_decay_mode")
        except DefinitionError as e:
            raise ValueError(f"{owner}.{e}") from e
        object.__setattr__(self, "weight_decay_mode", mode)
        mine, other = (("counter_based_regularization", "cowclip_regularization")
                       if mode == "counter" else
                       ("cowclip_regularization", "counter_based_regularization"))
        if getattr(self, other) is not None:
            raise ValueError(f"{owner}.{other}: expected None with weight_decay_mode="
                             f"{mode!r} (it takes {mine}), got {getattr(self, other)!r}")
        cls = CounterBasedRegularization if mode == "counter" else CowClipRegularization
        value = getattr(self, mine)
        try:
            object.__setattr__(self, mine, cls() if value is None else regularization(value, cls))
        except DefinitionError as e:
            path = f"{owner}.{mine}" + (f".{e.field}" if e.field else "")
            raise ValueError(f"{path}: {e.message}") from e

    @property
    def regularization(self) -> CounterBasedRegularization | CowClipRegularization:
        """The definition in use (``counter_based_regularization`` or
        ``cowclip_regularization``)."""
        if self.weight_decay_mode == "counter":
            return self.counter_based_regularization
        return self.cowclip_regularization

    @property
    def max_counter_update_freq(self) -> int:
        """Steps between refreshes of ``max_counter`` (<= 0: never; COWCLIP never needs it)."""
        if self.weight_decay_mode == "counter":
            return self.counter_based_regularization.max_counter_update_freq
        return -1


def counter_mode(value: Any) -> str | None:
    """``"counter"`` / ``"cowclip"`` where ``value`` (a ``weight_decay_mode``: ours, FBGEMM's
    member, name or value) names one, else None."""
    try:
        return choice(value, COUNTER_MODES, "weight_decay_mode")
    except DefinitionError:
        return None


NATIVE_COUNTER_FIELDS = (
    "cowclip", "decay_mode", "learning_rate_mode", "halflife", "decay_rate", "adjustment_iter",
    "adjustment_ub", "threshold", "max_counter", "weight_norm_coefficient", "lower_bound",
)
"""What the native CPU update reads from its ``double counter[]`` (``ops/csrc/tbe_cpu_counter.c``'s
``CTR_*`` slots, checked against this by a test), besides the ``NATIVE_HYPER_FIELDS`` (lr, eps,
weight_decay, the step): the modes as their index in ``COUNTER_WEIGHT_DECAY_MODES`` and
``LEARNING_RATE_MODES``; ``decay_rate`` ln 2 / ``counter_halflife`` (0 unless > 0);
``threshold`` the tail-id threshold (a ratio already times ``max_counter``, floored)."""


def native_counter_parameters(opt: RowWiseAdagradWithCounter, max_counter: float) -> list[float]:
    """``opt``'s values of ``NATIVE_COUNTER_FIELDS``, with the module's ``max_counter`` of the
    step (refreshed before)."""
    reg = opt.regularization
    cowclip = opt.weight_decay_mode == "cowclip"
    threshold = 0.0 if cowclip else reg.tail_id_threshold
    if not cowclip and reg.tail_id_threshold_is_ratio:
        threshold = math.floor(threshold * max_counter)
    halflife = reg.counter_halflife
    return [
        float(cowclip),
        float(COUNTER_WEIGHT_DECAY_MODES.index(reg.counter_weight_decay_mode)),
        0.0 if cowclip else float(LEARNING_RATE_MODES.index(reg.learning_rate_mode)),
        float(halflife),
        math.log(2.0) / halflife if halflife > 0 else 0.0,
        0.0 if cowclip else float(reg.adjustment_iter),
        0.0 if cowclip else float(reg.adjustment_ub),
        float(threshold),
        float(max_counter),
        float(reg.weight_norm_coefficient) if cowclip else 0.0,
        float(reg.lower_bound) if cowclip else 0.0,
    ]
