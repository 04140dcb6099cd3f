"""The configs of the fused optimizers that need no file of their own (SGD, Adagrad, rowwise
Adagrad and its EMA-in-place variant, rowwise RMSprop with adaptive regularisation, Adam and its
partial-rowwise / LAMB family, LARS-SGD, FTRL): frozen dataclasses that check their
hyper-parameters. ``optim.py`` registers them (and re-exports every name here); their update
formulas are in ``docs/modules.md``, "Fused optimizers". Torch-free.
"""

from dataclasses import dataclass
from typing import Any, Literal

from fbtriton_dist.optim_counter import counter_mode
from fbtriton_dist.optim_gwd import is_global_mode

__all__ = ["FTRL", "LAMB", "SGD", "WEIGHT_DECAY_MODES", "Adagrad", "Adam",
           "EmaInplaceRowWiseAdagrad", "LarsSGD", "PartialRowWiseAdam", "PartialRowWiseLAMB",
           "RowWiseAdagrad", "RowWiseRMSpropAR"]


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{owner}.{name}: expected a number >= 0, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class SGD:
    """w -= lr * g, with g the row's gradient summed over the batch (FBGEMM EXACT_SGD)."""

    lr: float = 0.01
    """Learning rate."""

    def __post_init__(self) -> None:
        _check_positive("SGD", lr=self.lr)


@dataclass(kw_only=True, frozen=True)
class Adagrad:
    """Per-element Adagrad (FBGEMM EXACT_ADAGRAD, torch.optim.Adagrad without decay):
    ``m += g^2``, ``w -= lr * g / (sqrt(m) + eps)``."""

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-10
    """Added to sqrt(m) in the denominator."""

    def __post_init__(self) -> None:
        _check_positive("Adagrad", lr=self.lr, eps=self.eps)


WEIGHT_DECAY_MODES = ("none", "l2", "decoupled")
"""Rowwise Adagrad's ``weight_decay_mode`` choices: FBGEMM's ``WeightDecayMode`` NONE, L2 and
DECOUPLE (COUNTER and COWCLIP are ``RowWiseAdagradWithCounter``'s; DECOUPLE_GLOBAL is
``RowWiseAdagradGlobalDecay``'s)."""

_FBGEMM_WEIGHT_DECAY_MODES = {0: "none", 1: "l2", 2: "decoupled"}
"""FBGEMM's ``WeightDecayMode`` values (an ``IntEnum``) that have an equivalent here."""


def _weight_decay_mode(value: Any, owner: str = "RowWiseAdagrad") -> str:
    """``value`` as one of ``WEIGHT_DECAY_MODES``: ours, or FBGEMM's ``WeightDecayMode`` (a
    member, its name in any case, or its integer; DECOUPLE is our "decoupled")."""
    key = value
    if isinstance(value, int) and not isinstance(value, bool):
        key = _FBGEMM_WEIGHT_DECAY_MODES.get(int(value), value)
    elif isinstance(value, str):
        key = value.lower()
        key = "decoupled" if key == "decouple" else key
    if key not in WEIGHT_DECAY_MODES:
        hint = (" (counter / cowclip: RowWiseAdagradWithCounter)" if counter_mode(value) else
                " (decoupled_global: RowWiseAdagradGlobalDecay)" if is_global_mode(value) else "")
        raise ValueError(
            f"{owner}.weight_decay_mode: expected one of ['none', 'l2', 'decoupled'] "
            f"(or FBGEMM's WeightDecayMode NONE, L2, DECOUPLE), got {value!r}{hint}"
        )
    return key


@dataclass(kw_only=True, frozen=True)
class RowWiseAdagrad:
    """One Adagrad accumulator per row (FBGEMM EXACT_ROWWISE_ADAGRAD).

    ``m += mean(g'^2)`` over the row, ``w = c * w - lr / (sqrt(m) + eps) * g``, where with
    ``weight_decay_mode="l2"`` g' = g + weight_decay * w and c = 1 - weight_decay * lr /
    (sqrt(m) + eps); with ``"decoupled"`` g' = g and c = 1 - lr * weight_decay; with
    ``"none"`` g' = g and c = 1 (``weight_decay`` is ignored, as FBGEMM's NONE does).
    """

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to sqrt(m) in the denominator."""
    weight_decay: float = 0.0
    """Weight decay coefficient (0 turns it off)."""
    weight_decay_mode: Literal["none", "l2", "decoupled"] = "l2"
    """How weight decay enters: not at all, as an L2 term in the gradient, or decoupled
    (AdamW-like). FBGEMM's ``WeightDecayMode`` members (NONE, L2, DECOUPLE) are taken too and
    stored as these names."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_positive(owner, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        object.__setattr__(self, "weight_decay_mode",
                           _weight_decay_mode(self.weight_decay_mode, owner))

    @property
    def applied_weight_decay(self) -> float:
        """The decay coefficient the update uses: 0 with ``weight_decay_mode="none"``."""
        return 0.0 if self.weight_decay_mode == "none" else self.weight_decay


@dataclass(kw_only=True, frozen=True)
class EmaInplaceRowWiseAdagrad(RowWiseAdagrad):
    """Rowwise Adagrad whose tables keep an exponential moving average of their first half
    of columns in their second half (FBGEMM EMAINPLACE_ROWWISE_ADAGRAD, its
    ``EmainplaceModeDefinition``): the update is ``RowWiseAdagrad``'s (every column, the
    same state); before the lookup of training step k (k = the module's step + 1, FBGEMM's
    ``iter``), when ``k % int(step_ema) == 0`` and ``k >= int(step_start)``, every row of
    every table gets ``w[D/2:] += step_ema_coef * (w[:D/2] - w[D/2:])`` (rows outside the
    batch too). Every table's D must be even."""

    step_ema: float = 10
    """The EMA runs every this many training steps (>= 1; FBGEMM keeps it a float and
    truncates it)."""
    step_start: float = 0
    """No EMA before this step (>= 0)."""
    step_ema_coef: float = 0.6
    """The fraction of the way the second half moves toward the first (in [0, 1])."""

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if not self.step_ema >= 1:
            raise ValueError(f"{owner}.step_ema: expected a number >= 1, got {self.step_ema!r}")
        _check_positive(owner, step_start=self.step_start)
        if not 0.0 <= self.step_ema_coef <= 1.0:
            raise ValueError(f"{owner}.step_ema_coef: expected a number in [0, 1], got "
                             f"{self.step_ema_coef!r}")

    def ema_due(self, k: int) -> bool:
        """Whether the EMA runs before the lookup of training step k (1 at the first)."""
        return k % int(self.step_ema) == 0 and k >= int(self.step_start)


@dataclass(kw_only=True, frozen=True)
class RowWiseRMSpropAR:
    """Rowwise RMSprop with adaptive regularisation (FBGEMM's ``rowwise_rmsprop_ar`` in its
    public sources, newer than fbgemm-gpu 1.8.0; its frequency-adaptive rate ``falr`` off), on
    the rows of the batch. With v and p per row (0 at first), t the step count:
    ``v = ema_beta v + (1 - ema_beta) mean(g^2)``, the gap ``I = t - p`` (1 where p = 0, a
    row's first update), ``lambda = clamp(lr ar_alpha I, 0, 1)``,
    ``w = max(min_shrinkage, 1 - lambda) w - lr / (sqrt(v) + eps) g``, then ``p = t``: a
    row's decay grows with the steps since it was last in a batch, paid when it is."""

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to sqrt(v) in the denominator (> 0)."""
    ar_alpha: float = 0.0
    """Adaptive decay coefficient (0: plain rowwise RMSprop)."""
    ema_beta: float = 0.99
    """Decay of the mean squared gradient v, in [0, 1)."""
    min_shrinkage: float = 0.1
    """Floor of the decay factor, in [0, 1]."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_positive(owner, lr=self.lr, ar_alpha=self.ar_alpha)
        _check_above_zero(owner, eps=self.eps)
        if not 0.0 <= self.ema_beta < 1.0:
            raise ValueError(f"{owner}.ema_beta: expected a number in [0, 1), got "
                             f"{self.ema_beta!r}")
        if not 0.0 <= self.min_shrinkage <= 1.0:
            raise ValueError(f"{owner}.min_shrinkage: expected a number in [0, 1], got "
                             f"{self.min_shrinkage!r}")


@dataclass(kw_only=True, frozen=True)
class Adam:
    """Adam with per-element moments, updated only on the rows of the batch (FBGEMM ADAM).

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w)``,
    t the number of optimizer steps taken by the module (starting at 1).
    """

    lr: float = 0.001
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay of the first and second moments."""
    eps: float = 1e-8
    """Added to the denominator."""
    weight_decay: float = 0.0
    """Decoupled weight decay coefficient."""

    def __post_init__(self) -> None:
        _check_positive("Adam", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"Adam.betas: expected two numbers in [0, 1), got {self.betas!r}")


def _check_above_zero(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name}: expected a number > 0, got {value!r}")


def _check_betas(owner: str, betas: tuple[float, float]) -> None:
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{owner}.betas: expected two numbers in [0, 1), got {betas!r}")


@dataclass(kw_only=True, frozen=True)
class _AdamFamily:
    """The fields of the Adam-like optimizers below (FBGEMM's defaults)."""

    lr: float = 0.01
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay of the first and second moments."""
    eps: float = 1e-8
    """Added to the denominator sqrt(v_hat)."""
    weight_decay: float = 0.0
    """Decoupled weight decay coefficient (0 turns it off)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_positive(owner, lr=self.lr, weight_decay=self.weight_decay)
        _check_above_zero(owner, eps=self.eps)
        _check_betas(owner, self.betas)


@dataclass(kw_only=True, frozen=True)
class PartialRowWiseAdam(_AdamFamily):
    """Adam with a per-element first moment and a per-row second moment of the row's mean
    squared gradient (FBGEMM PARTIAL_ROWWISE_ADAM), on the rows of the batch only:

    ``m = b1 m + (1 - b1) g`` (per element), ``v = b2 v + (1 - b2) mean(g^2)`` (per row),
    ``w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w)``.
    """


@dataclass(kw_only=True, frozen=True)
class LAMB(_AdamFamily):
    """Adam's step scaled per row by the trust ratio (FBGEMM LAMB), on the rows of the batch:

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` (per element),
    ``r = m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w``,
    ``w -= lr * (||w|| / ||r||) * r``, the norms over the row (before the update). Where
    ``||r|| = 0`` the row does not move (FBGEMM divides by zero there); a row of zeros has
    ratio 0 and never moves, as in FBGEMM.
    """


@dataclass(kw_only=True, frozen=True)
class PartialRowWiseLAMB(_AdamFamily):
    """LAMB with a per-row second moment of the mean squared gradient (FBGEMM
    PARTIAL_ROWWISE_LAMB): ``v = b2 v + (1 - b2) mean(g^2)`` (per row), ``r = m / (1 - b1^t)
    / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w``, ``w -= lr * (||w|| / ||r||) * r``."""


@dataclass(kw_only=True, frozen=True)
class LarsSGD:
    """SGD with momentum and a per-row layer-wise rate (FBGEMM LARS_SGD), on the rows of the
    batch: ``lr' = lr * eta * ||w|| / (||g|| + weight_decay * ||w||)`` (norms over the row,
    0 where the denominator is 0; FBGEMM divides by zero there),
    ``m = momentum * m + lr' * (g + weight_decay * w)`` (per element), ``w -= m``."""

    lr: float = 0.01
    """Learning rate."""
    eta: float = 0.001
    """Trust coefficient of the layer-wise rate."""
    momentum: float = 0.9
    """Decay of the momentum buffer."""
    weight_decay: float = 0.0
    """L2 weight decay coefficient (in the rate's denominator and the step)."""

    def __post_init__(self) -> None:
        _check_positive("LarsSGD", lr=self.lr, eta=self.eta, weight_decay=self.weight_decay)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(
                f"LarsSGD.momentum: expected a number in [0, 1), got {self.momentum!r}"
            )


@dataclass(kw_only=True, frozen=True)
class FTRL:
    """FTRL-Proximal per coordinate (H. B. McMahan et al., "Ad Click Prediction: a View from
    the Trenches", KDD 2013, Algorithm 1), on the rows of the batch; FBGEMM has no FTRL. With
    z and n per element (both 0 at first), the summed gradient g and alpha = ``lr``:

    ``n' = n + g^2``, ``sigma = (sqrt(n') - sqrt(n)) / alpha``, ``z += g - sigma * w``,
    ``n = n'``, then ``w = 0`` where ``|z| <= l1``, else
    ``w = -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)``.

    Every coordinate of a row in the batch is set from its (z, n), as TensorFlow's sparse FTRL
    does: one whose gradient has been 0 so far becomes 0 (the formulation starts from w = 0).
    """

    lr: float = 0.05
    """alpha, the per-coordinate learning rate's scale (> 0)."""
    beta: float = 1.0
    """Added to sqrt(n) in the per-coordinate rate's denominator."""
    l1: float = 0.0
    """L1 regularisation (coordinates with |z| <= l1 are 0)."""
    l2: float = 0.0
    """L2 regularisation."""

    def __post_init__(self) -> None:
        _check_above_zero("FTRL", lr=self.lr)
        _check_positive("FTRL", beta=self.beta, l1=self.l1, l2=self.l2)
