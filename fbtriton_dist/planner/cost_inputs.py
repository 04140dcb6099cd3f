"""The cost model's machine numbers given by the user: a job's ``sharding.cost:`` mapping and
``fbtriton-dist plan ... --cost FILE.yaml`` (a file ``python -m fbtriton_dist.bench link
--out FILE.yaml`` writes from measurements, ``docs/storage.md`` "Measuring the links").

Both take :class:`CostModel` bandwidth fields by name, in bytes/s::

    cost: {host_tier_bandwidth: 2.1e+10, disk_bandwidth: 3.5e+08}

A key not given keeps the model's default. An unknown key, a value that is not a finite
number > 0, or a file that is not such a mapping raises ``ValueError`` naming the key (and the
file). PyYAML reads ``25e9`` (no dot, no exponent sign) as a string: such a string that
Python's ``float`` reads is taken as that number. Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ._yaml import ConfigError, FieldError, choices_text, read_yaml
from .cost import CostModel

__all__ = ["COST_KEYS", "cost_line", "cost_values", "given_line", "read_cost_file",
           "with_cost"]

COST_KEYS: tuple[str, ...] = ("hbm_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth",
                              "host_tier_bandwidth", "disk_bandwidth")
"""The :class:`CostModel` fields a cost mapping may set (bytes/s each)."""


def _number(key: str, value: Any) -> float:
    if isinstance(value, str):  # 25e9: a string to YAML 1.1, a number to the user
        try:
            value = float(value)
        except ValueError:
            raise FieldError(key, f"expected a number of bytes/s > 0, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(key, f"expected a number of bytes/s > 0, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise FieldError(key, f"expected a finite number of bytes/s > 0, got {value}")
    return float(value)


def cost_values(value: Any, key: str = "cost") -> dict[str, float]:
    """The mapping ``value`` (found at key path ``key``) checked: each key one of
    :data:`COST_KEYS`, each value a finite number > 0 (bytes/s). Raises :class:`FieldError`
    with the full key path."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise FieldError(key, f"expected a mapping of {choices_text(COST_KEYS)} to bytes/s, "
                              f"got {value!r}")
    out = {}
    for name, v in value.items():
        if name not in COST_KEYS:
            raise FieldError(f"{key}.{name}", f"unknown key, expected one of "
                                              f"{choices_text(COST_KEYS)}")
        out[name] = _number(f"{key}.{name}", v)
    return out


def read_cost_file(path: str) -> dict[str, float]:
    """The ``cost:`` mapping of the YAML file ``path`` (``yaml.safe_load``; the only top-level
    key), checked as :func:`cost_values`; errors name the file and the key path."""
    data = read_yaml(path)
    if not isinstance(data, Mapping) or set(data) != {"cost"}:
        got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise ConfigError(path, "", f"expected a mapping with the one key 'cost' (what `bench "
                                    f"link --out` writes), got {got}")
    try:
        return cost_values(data["cost"])
    except FieldError as e:
        raise ConfigError(path, e.field, e.message) from e


def with_cost(model: CostModel, values: Mapping[str, float]) -> CostModel:
    """``model`` with the bandwidths of ``values`` (checked as :func:`cost_values`)."""
    return dataclasses.replace(model, **cost_values(values))


def cost_line(model: CostModel) -> str:
    """The bandwidths ``model`` costs with, one line (a written plan's header says them)."""
    return "cost (bytes/s): " + ", ".join(f"{k} {getattr(model, k):.4g}" for k in COST_KEYS)


def given_line(model: CostModel) -> str | None:
    """The bandwidths of ``model`` that differ from :class:`CostModel`'s defaults, one line
    (what ``plan`` prints under its report), or None when all are the defaults."""
    default = CostModel()
    given = [k for k in COST_KEYS if getattr(model, k) != getattr(default, k)]
    if not given:
        return None
    return ("cost model, given (bytes/s): "
            + ", ".join(f"{k} {getattr(model, k):.4g} (default {getattr(default, k):.4g})"
                        for k in given))
