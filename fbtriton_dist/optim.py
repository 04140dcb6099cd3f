"""Fused optimizers for TableBatchedEmbedding: configuration only, applied inside backward.

Semantics follow FBGEMM's TBE optimizers (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD,
ADAM): the
gradients of duplicate ids in a batch are summed first, then each unique row gets one update;
rows not in the batch are untouched (Adam's moments too: "lazy" Adam).
"""

import math
from dataclasses import dataclass
from typing import Literal


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

    num_states = 0


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

    num_states = 1


@dataclass(kw_only=True, frozen=True)
class RowWiseAdagrad:
    """One Adagrad accumulator per row (FBGEMM EXACT_ROWWISE_ADAGRAD).

    ``m += mean(g'^2)`` over the row, ``w = c * w - lr / (sqrt(m) + eps) * g``, where with
    ``weight_decay_mode="l2"`` g' = g + weight_decay * w and c = 1 - weight_decay * lr /
    (sqrt(m) + eps); with ``"decoupled"`` g' = g and c = 1 - lr * weight_decay.
    """

    lr: float = 0.01
    """Learning rate."""
    eps: float = 1e-8
    """Added to sqrt(m) in the denominator."""
    weight_decay: float = 0.0
    """Weight decay coefficient (0 turns it off)."""
    weight_decay_mode: Literal["l2", "decoupled"] = "l2"
    """How weight decay enters: as an L2 term in the gradient, or decoupled (AdamW-like)."""

    def __post_init__(self) -> None:
        _check_positive("RowWiseAdagrad", lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if self.weight_decay_mode not in ("l2", "decoupled"):
            raise ValueError(
                "RowWiseAdagrad.weight_decay_mode: expected one of ['l2', 'decoupled'], "
                f"got {self.weight_decay_mode!r}"
            )

    num_states = 1


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

    num_states = 2


Optimizer = SGD | Adagrad | RowWiseAdagrad | Adam


HYPER_FIELDS = ("lr", "eps", "beta1", "beta2", "weight_decay", "log_beta1", "log_beta2")
"""What the fused backward reads from a small fp32 device tensor (not from launch arguments,
so that a CUDA-graph-captured step sees a changed learning rate): the fields in this order."""


def hyper_parameters(optimizer: Optimizer | None) -> list[float]:
    """``optimizer``'s values of ``HYPER_FIELDS`` (0 where it has none). ``log_beta`` is the
    natural log of the beta (-inf for 0): Adam's bias corrections ``1 - beta^t`` are computed
    from it on the device, with the step count t read from device memory."""
    if optimizer is None:
        return [0.0] * len(HYPER_FIELDS)
    b1, b2 = getattr(optimizer, "betas", (0.0, 0.0))
    return [
        float(optimizer.lr),
        float(getattr(optimizer, "eps", 0.0)),
        float(b1),
        float(b2),
        float(getattr(optimizer, "weight_decay", 0.0)),
        *(math.log(b) if b > 0 else -math.inf for b in (b1, b2)),
    ]
