"""``data.synthetic.drift``: synthetic ids from an open id space that drifts (torch-free).

    data:
      source: synthetic
      synthetic:
        noise: 0.3
        drift: {new_ids_per_step: 40, window: 4000, features: null, dense_weight: 1.0}

With ``drift`` the synthetic source is ``train/open_ids.py``'s ``DriftingSource``: every
drifting feature's ids are raw int64 values (a 64-bit mix of a position in an endless id
stream, any value, negative ones too), drawn Zipf over a window of ``window`` consecutive
positions (each id's popularity rank fixed for its life); the window moves
``new_ids_per_step`` positions a step, so that many ids are born every step and as many
leave the window. A feature whose table is
managed (``id_manager:``) gets the raw ids; any other gets them folded ``% E`` (the hashing
trick). Torch-free: the job config reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fbtriton_dist.planner._yaml import FieldError, build, check_int, check_name, check_number

__all__ = ["DriftConfig", "check_drift", "drift_section"]


@dataclass(kw_only=True, frozen=True)
class DriftConfig:
    """An open id space that drifts (the module docstring)."""

    new_ids_per_step: int
    """Positions the window moves per training step: ids born (and retired) per step and
    feature; 0: an open but stationary id space."""
    window: int = 10_000
    """Live ids per drifting feature: the window's positions, each with a popularity rank
    for its life, drawn Zipf with the feature's exponent (``zipf_per_feature``, the table's
    ``id_distribution``, else ``zipf``)."""
    features: tuple[str, ...] | None = None
    """The features that draw from the open id space; None: every feature. The others draw
    Zipf ids in ``[0, E)`` as without drift."""
    dense_weight: float = 1.0
    """Scale of the dense features' part of the hidden logit the labels come from; 0: the
    labels depend on the ids alone (what the embeddings learn decides the AUC)."""

    def __post_init__(self) -> None:
        check_int("new_ids_per_step", self.new_ids_per_step, 0)
        check_int("window", self.window, 1)
        check_number("dense_weight", self.dense_weight, 0.0)
        if self.features is not None:
            if not isinstance(self.features, tuple) or not self.features:
                raise FieldError("features", f"expected a non-empty list of feature names or "
                                             f"null, got {self.features!r}")
            for i, f in enumerate(self.features):
                check_name(f"features[{i}]", f)


def _names(value: Any, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list of feature names or null, got {value!r}")
    return tuple(value)


def drift_section(where: str) -> Callable[[Any, str], DriftConfig | None]:
    """The converter of ``data.synthetic.drift`` (null or absent: no drift)."""

    def make(value: Any, key: str) -> DriftConfig | None:
        if value is None:
            return None
        return build(DriftConfig, value, where, key, convert={"features": _names})

    return make


def check_drift(synthetic: Any, features: Sequence[str]) -> None:
    """``data.synthetic.drift`` against the job's features and the rest of ``synthetic``
    (a ``SyntheticConfig``); FieldError with the key path."""
    drift = synthetic.drift
    if drift is None:
        return
    if not isinstance(drift, DriftConfig):
        raise FieldError("data.synthetic.drift", f"expected a DriftConfig or null, got {drift!r}")
    for i, f in enumerate(drift.features or ()):
        if f not in features:
            raise FieldError(f"data.synthetic.drift.features[{i}]",
                             f"{f!r} is not a feature of the tables, expected some of "
                             f"[{', '.join(features)}]")
    if synthetic.candidates_per_user > 1:
        raise FieldError("data.synthetic.drift", "does not combine with candidates_per_user "
                         f"> 1 (got {synthetic.candidates_per_user}): drifting batches are "
                         "one bag per sample")
