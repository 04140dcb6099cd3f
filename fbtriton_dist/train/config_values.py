"""Converters and checks of single job-file values (lists of numbers, names, paths): each
raises ``FieldError`` naming the key; used by ``config.py``'s sections. Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fbtriton_dist.planner import FieldError
from fbtriton_dist.planner._yaml import check_int, check_name, check_number


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FieldError(name, f"expected true or false, got {value!r}")


def _check_optional(check: Callable[..., None], name: str, value: Any, *args: Any) -> None:
    if value is not None:
        check(name, value, *args)


def _ints(value: Any, key: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise FieldError(key, f"expected a non-empty list of integers, got {value!r}")
    for i, v in enumerate(value):
        check_int(f"{key}[{i}]", v, 1)
    return tuple(value)


def _strings(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise FieldError(key, f"expected a path or a list of paths, got {value!r}")
    for i, v in enumerate(value):
        check_name(f"{key}[{i}]", v)
    return tuple(value)


def _feature_names(value: Any, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list of feature names, got {value!r}")
    for i, v in enumerate(value):
        check_name(f"{key}[{i}]", v)
    return tuple(value)


def _optional_strings(value: Any, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise FieldError(key, f"expected a list of feature names, got {value!r}")
    for i, v in enumerate(value):
        check_name(f"{key}[{i}]", v)
    return tuple(value)


def _numbers_by_name(value: Any, key: str) -> Mapping[str, float]:
    if not isinstance(value, Mapping):
        raise FieldError(key, f"expected a mapping of feature name to number, got {value!r}")
    for name, v in value.items():
        check_number(f"{key}.{name}", v, 0.0)
    return dict(value)


def _pair(value: Any, key: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise FieldError(key, f"expected a list of two numbers, got {value!r}")
    for i, v in enumerate(value):
        check_number(f"{key}[{i}]", v, 0.0)
    return (value[0], value[1])
