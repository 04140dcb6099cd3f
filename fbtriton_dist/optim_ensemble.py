"""Ensemble rowwise Adagrad (FBGEMM's ``EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD``): the config and
its schedule, torch-free (``optim.py`` registers it; the planner and the job config read it).
The whole-table step: ``modules/fused_optim.py`` ``ensemble_and_swap``; the formulas:
``docs/optimizers_ensemble.md``.

FBGEMM (fbgemm-gpu 1.8.0 and its current sources) runs it as rowwise Adagrad's row update
(``momentum1``, one fp32 accumulator per row) plus, before the lookup of every training step,
a step over whole tables: a slow copy of each table (``momentum2``, one value per element,
FBGEMM's ``sparse_ema``) follows the rows by an exponential moving average every ``step_ema``
steps, and replaces them every ``step_swap`` steps. Its older fused kernel
(``ensemble_rowwise_adagrad`` in FBGEMM's code generator, with a ``momentum`` argument and a
per-row counter) was removed from FBGEMM before 1.8.0; this is the current definition.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

STEP_MODES = ("none", "use_counter", "use_iter")
"""``step_mode``: FBGEMM's ``StepMode`` NONE, USE_COUNTER, USE_ITER (values 0..2). With
``none`` the slow copy is zeroed after each moving-average step (FBGEMM's "embedding
scaling"); the other two keep it (a pure moving average)."""
_DECAY_MODES = ("none", "l2", "decoupled")
"""``weight_decay_mode``: FBGEMM's ``WeightDecayMode`` NONE, L2, DECOUPLE (values 0..2), as
rowwise Adagrad's."""
MODE_FIELDS = ("step_ema", "step_swap", "step_start", "step_ema_coef", "step_mode")
"""The fields of FBGEMM's ``EnsembleModeDefinition`` (its ``ensemble_mode`` argument), flat
here as in the job's YAML."""


def _named(owner: str, key: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` as one of ``choices``: ours, FBGEMM's enum member, its name in any case, or
    its integer value (the index in ``choices``)."""
    raw = value
    if isinstance(value, int) and not isinstance(value, bool):
        raw = choices[int(value)] if 0 <= int(value) < len(choices) else value
    elif hasattr(value, "name") and isinstance(value.name, str):
        raw = value.name
    if isinstance(raw, str):
        raw = {"decouple": "decoupled"}.get(raw.lower(), raw.lower())
    if raw not in choices:
        raise ValueError(f"{owner}.{key}: expected one of [{', '.join(choices)}] (or FBGEMM's "
                         f"enum member or value), got {value!r}")
    return raw


def _number(owner: str, key: str, value: Any, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        bound = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise ValueError(f"{owner}.{key}: expected a number {bound}, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class EnsembleRowWiseAdagrad:
    """Rowwise Adagrad with a slow moving-average copy of every table that periodically
    replaces it (FBGEMM ENSEMBLE_ROWWISE_ADAGRAD). The row update is ``RowWiseAdagrad``'s
    (``weight_decay`` / ``weight_decay_mode`` included). Before the lookup of training step k
    (k = the module's step + 1, FBGEMM's ``iter``), with every table's rows w and their slow
    copy s (``momentum2``, [E, D]): ``coef = 0 if k <= int(step_start) else step_ema_coef``;
    where ``k % int(step_ema) == 0``: ``s = coef s + (1 - coef) w``; where ``k %
    int(step_swap) == 0``: ``w = s``; then with ``step_mode="none"`` and an EMA this step:
    ``s = 0``. Rows outside the batch take part too."""

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to sqrt(m) in the denominator."""
    weight_decay: float = 0.0
    """Weight decay coefficient (0 turns it off)."""
    weight_decay_mode: Literal["none", "l2", "decoupled"] = "none"
    """As ``RowWiseAdagrad``'s (FBGEMM's ``WeightDecayMode`` NONE, L2, DECOUPLE taken); the
    default is FBGEMM's TBE's, NONE (no decay whatever ``weight_decay`` is)."""
    step_ema: float = 10000
    """The moving average runs every this many training steps (>= 1; FBGEMM keeps a float
    and truncates it)."""
    step_swap: float = 10000
    """The slow copy replaces the rows every this many training steps (>= 1)."""
    step_start: float = 0
    """Up to this step the moving average takes the rows as they are (coef 0; >= 0)."""
    step_ema_coef: float = 0.6
    """The weight of the old slow copy in its moving average (in [0, 1])."""
    step_mode: Literal["none", "use_counter", "use_iter"] = "use_iter"
    """FBGEMM's ``StepMode`` (``STEP_MODES``): ``none`` zeroes the slow copy after each
    moving-average step."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for key in ("lr", "eps", "weight_decay", "step_start"):
            _number(owner, key, getattr(self, key), 0.0)
        for key in ("step_ema", "step_swap"):
            _number(owner, key, getattr(self, key), 1.0)
        _number(owner, "step_ema_coef", self.step_ema_coef, 0.0, 1.0)
        object.__setattr__(self, "weight_decay_mode", _named(
            owner, "weight_decay_mode", self.weight_decay_mode, _DECAY_MODES))
        object.__setattr__(self, "step_mode", _named(owner, "step_mode", self.step_mode,
                                                     STEP_MODES))

    @property
    def applied_weight_decay(self) -> float:
        """The decay coefficient the update uses: 0 with ``weight_decay_mode="none"``."""
        return 0.0 if self.weight_decay_mode == "none" else self.weight_decay

    def schedule(self, k: int) -> tuple[bool, bool, float]:
        """``(ema, swap, coef)`` before the lookup of training step k (1 at the first)."""
        coef = 0.0 if k <= int(self.step_start) else float(self.step_ema_coef)
        return k % int(self.step_ema) == 0, k % int(self.step_swap) == 0, coef


def ensemble_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An annotation's keywords with FBGEMM's ``ensemble_mode`` (an ``EnsembleModeDefinition``
    or a mapping of its fields) spread into ours (``MODE_FIELDS``); a field given both ways,
    or one ``EnsembleModeDefinition`` lacks, raises."""
    out = dict(kwargs)
    mode = out.pop("ensemble_mode", None)
    if mode is None:
        return out
    fields = dict(mode) if isinstance(mode, Mapping) else {
        key: getattr(mode, key) for key in MODE_FIELDS if hasattr(mode, key)}
    unknown = sorted(set(fields) - set(MODE_FIELDS))
    if unknown:
        raise ValueError(f"ensemble_mode.{unknown[0]}: expected a field of FBGEMM's "
                         f"EnsembleModeDefinition [{', '.join(MODE_FIELDS)}]")
    both = sorted(set(fields) & set(out))
    if both:
        raise ValueError(f"{both[0]}: expected it once, got it in ensemble_mode too")
    return {**out, **fields}
