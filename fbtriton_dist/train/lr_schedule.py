"""``optimizer.schedule``: learning-rate warm-up and polynomial decay of both optimizers
(torch-free: the job config reads it).

    optimizer:
      embedding: {type: adagrad, lr: 0.005}
      dense: {type: adagrad, lr: 0.005}
      schedule: {warmup_steps: 0, decay_start: 0, decay_steps: 0, decay_power: 2.0,
                 end_factor: 0.0}

The MLPerf DLRM-dcnv2 reference's policy (its ``--lr_warmup_steps``, ``--lr_decay_start``,
``--lr_decay_steps``): one factor ``f(k)`` per step scales the base ``lr`` of the fused
embedding optimizer and of every dense parameter group alike. For the ``k``-th step of the
job (``k = 1, 2, ...``; a resumed job goes on counting):

- warm-up, ``k <= warmup_steps``: ``f = k / warmup_steps`` (linear up to the base rate);
- decay, ``decay_start < k <= decay_start + decay_steps``, with ``r = (decay_start +
  decay_steps - k + 1) / decay_steps`` (1 at the first decayed step, ``1 / decay_steps`` at
  the last): ``f = end_factor + (1 - end_factor) * r ** decay_power``;
- after the decay: ``f = end_factor``; anywhere else: ``f = 1``.

All zeros (the default) is a constant rate. The decay must start after the warm-up ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fbtriton_dist.planner._yaml import FieldError, check_int, check_number

__all__ = ["LrSchedule", "apply_learning_rates"]


@dataclass(kw_only=True, frozen=True)
class LrSchedule:
    """The factor of the base learning rates per step (the module docstring)."""

    warmup_steps: int = 0
    """Steps of linear warm-up (0: none)."""
    decay_start: int = 0
    """Steps before the decay begins (at least ``warmup_steps``)."""
    decay_steps: int = 0
    """Steps of polynomial decay (0: none)."""
    decay_power: float = 2.0
    """The decay's exponent (2: the reference's quadratic decay)."""
    end_factor: float = 0.0
    """The factor the decay ends at and keeps after it, in [0, 1]."""

    def __post_init__(self) -> None:
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("decay_start", self.decay_start, 0)
        check_int("decay_steps", self.decay_steps, 0)
        check_number("decay_power", self.decay_power, 0.0, True)
        check_number("end_factor", self.end_factor, 0.0)
        if self.end_factor > 1:
            raise FieldError("end_factor", f"expected a factor in [0, 1], got {self.end_factor}")
        if self.decay_steps and self.decay_start < self.warmup_steps:
            raise FieldError("decay_start", f"expected the decay to start after the warm-up "
                                            f"(>= warmup_steps {self.warmup_steps}), got "
                                            f"{self.decay_start}")

    @property
    def constant(self) -> bool:
        """Every step at the base rates."""
        return not self.warmup_steps and not self.decay_steps

    def factor(self, k: int) -> float:
        """The factor of the base rates for the ``k``-th step (1-based)."""
        if k < 1:
            raise ValueError(f"LrSchedule.factor: expected a step k >= 1, got {k}")
        if k <= self.warmup_steps:
            return k / self.warmup_steps
        if self.decay_steps and k > self.decay_start:
            left = self.decay_start + self.decay_steps - k + 1
            if left <= 0:
                return self.end_factor
            r = left / self.decay_steps
            return self.end_factor + (1.0 - self.end_factor) * r**self.decay_power
        return 1.0


def apply_learning_rates(embedding_modules: Iterable[Any], dense_groups: Iterable[dict],
                         embedding_lr: float, dense_lr: float) -> None:
    """Set the fused optimizer's rate of every embedding module (``set_learning_rate``: our
    collections, sharded or not) to ``embedding_lr`` and every dense parameter group's
    ``lr`` to ``dense_lr``."""
    for m in embedding_modules:
        m.set_learning_rate(embedding_lr)
    for group in dense_groups:
        group["lr"] = dense_lr
