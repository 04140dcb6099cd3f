"""Rowwise Adagrad with global weight decay (FBGEMM's ``EXACT_ROWWISE_ADAGRAD`` with
``weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL`` and a ``GlobalWeightDecayDefinition``):
the config and its definition, torch-free (``optim.py`` registers it; the planner and the job
config read it). The lazy decay: ``reference/global_decay.py`` (spec) and
``ops/global_decay.py``; the formulas: ``docs/optimizers_global_decay.md``.

Decoupled weight decay ``w *= 1 - lr * weight_decay`` as if every step decayed every row,
paid lazily: a row the batch touches first pays the steps it missed since its last update
(per-row ``prev_iter``, FBGEMM's name), then gets rowwise Adagrad's decoupled update.
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from fbtriton_dist.optim_counter import DefinitionError

GLOBAL_MODE = "decoupled_global"
"""Its ``weight_decay_mode``: FBGEMM's ``WeightDecayMode.DECOUPLE_GLOBAL`` (value 5)."""
_FBGEMM_VALUE = 5


def is_global_mode(value: Any) -> bool:
    """Does ``value`` (a ``weight_decay_mode``: ours, FBGEMM's member, its name in any case, or
    its integer) name DECOUPLE_GLOBAL?"""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value) == _FBGEMM_VALUE
    raw = value.name if hasattr(value, "name") and isinstance(value.name, str) else value
    return isinstance(raw, str) and raw.lower() in (GLOBAL_MODE, "decouple_global")


def _number(key: str, value: Any, integer: bool = False,
            high: float | None = None) -> float | int:
    """``value`` checked; raises ``DefinitionError(key, why)``."""
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if integer:
        if not ok or value != int(value):
            raise DefinitionError(key, f"expected an integer, got {value!r}")
        return int(value)
    if not ok or not value >= 0 or (high is not None and not value <= high):
        bound = ">= 0" if high is None else f"in [0, {high:g}]"
        raise DefinitionError(key, f"expected a number {bound}, got {value!r}")
    return float(value)


@dataclass(kw_only=True, frozen=True)
class GlobalWeightDecay:
    """FBGEMM's ``GlobalWeightDecayDefinition``."""

    start_iter: int = 0
    """The lazy decay runs from this step on (the module's step t, 1 at the first update);
    before it a touched row gets only the decoupled decay of its own update and its
    ``prev_iter`` stays as it was."""
    lower_bound: float = 0.0
    """Floor of the catch-up factor ``(1 - lr * weight_decay)^missed``, in [0, 1] (a floor
    above 1 would grow rows; FBGEMM does not check it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_iter", _number("start_iter", self.start_iter,
                                                       integer=True))
        object.__setattr__(self, "lower_bound", _number("lower_bound", self.lower_bound,
                                                        high=1.0))


def definition(value: Any) -> GlobalWeightDecay:
    """``value`` as ``GlobalWeightDecay``: None (the defaults), an instance, FBGEMM's
    ``GlobalWeightDecayDefinition`` or a mapping of its fields (the job's YAML). Raises
    ``DefinitionError`` (``field`` "" where the value as a whole is wrong)."""
    names = [f.name for f in fields(GlobalWeightDecay)]
    if value is None:
        return GlobalWeightDecay()
    if isinstance(value, GlobalWeightDecay):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise DefinitionError(unknown[0], f"unknown key, expected one of "
                                  f"[{', '.join(names)}]")
        return GlobalWeightDecay(**value)
    if all(hasattr(value, n) for n in names):  # FBGEMM's GlobalWeightDecayDefinition
        return GlobalWeightDecay(**{n: getattr(value, n) for n in names})
    raise DefinitionError("", f"expected a mapping or FBGEMM's GlobalWeightDecayDefinition "
                          f"with fields [{', '.join(names)}], got {value!r}")


@dataclass(kw_only=True, frozen=True)
class RowWiseAdagradGlobalDecay:
    """Rowwise Adagrad with decoupled weight decay applied to every row at every step, paid
    lazily by the rows a batch touches (FBGEMM's DECOUPLE_GLOBAL). The update:
    ``docs/optimizers_global_decay.md``."""

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-10
    """Added to sqrt(m) in the denominator."""
    weight_decay: float = 0.0
    """Decoupled decay coefficient: each step multiplies a row by ``1 - lr * weight_decay``
    (0: no decay, the catch-up too is off, as FBGEMM's)."""
    weight_decay_mode: Literal["decoupled_global"] = GLOBAL_MODE
    """FBGEMM's DECOUPLE_GLOBAL (its member, name or value 5 taken)."""
    global_weight_decay: GlobalWeightDecay | None = None
    """FBGEMM's ``GlobalWeightDecayDefinition`` (None: its defaults, ``start_iter=0``,
    ``lower_bound=0``); a mapping of its fields or FBGEMM's object is taken."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        try:
            for key in ("lr", "eps", "weight_decay"):
                _number(key, getattr(self, key))
        except DefinitionError as e:
            raise ValueError(f"{owner}.{e}") from e
        if not is_global_mode(self.weight_decay_mode):
            raise ValueError(f"{owner}.weight_decay_mode: expected 'decoupled_global' (FBGEMM's "
                             f"WeightDecayMode.DECOUPLE_GLOBAL), got {self.weight_decay_mode!r}")
        object.__setattr__(self, "weight_decay_mode", GLOBAL_MODE)
        try:
            object.__setattr__(self, "global_weight_decay", definition(self.global_weight_decay))
        except DefinitionError as e:
            path = f"{owner}.global_weight_decay" + (f".{e.field}" if e.field else "")
            raise ValueError(f"{path}: {e.message}") from e

    @property
    def applied_weight_decay(self) -> float:
        """The decay coefficient of the update (rowwise Adagrad's name)."""
        return self.weight_decay




GWD_TORCH = {
    "path": "fbtriton_dist.modules.fused_optim.RowWiseAdagradGlobalDecay",
    "kwargs": {"lr": 0.01, "eps": 1e-10, "weight_decay": 0.0},
    "modes": {"weight_decay_mode": GLOBAL_MODE, "global_weight_decay": None},
}
"""Its registry ``TorchClass``'s fields: our annotation class (neither torch nor TorchRec has
one; TorchRec's ``RowWiseAdagrad`` with ``weight_decay_mode`` DECOUPLE_GLOBAL maps here too,
``optim.from_torch``), its keywords and choice keywords with their defaults."""
