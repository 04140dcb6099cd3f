"""Errors and the small YAML helpers shared by the table-set and plan files.

Every check on user input raises one of two errors (never ``assert``):

* :class:`FieldError` from a config object's ``__post_init__``: it knows the field name only.
* :class:`ConfigError` from a YAML loader: it names the file and the whole key path, e.g.
  ``configs/tables/ads.yaml: tables[3].sharding: expected one of [row_wise, ...], got 'rowwise'``.

Loaders call :func:`build` which turns the first into the second.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import yaml

__all__ = ["ConfigError", "FieldError", "atomic_write_text", "build", "read_yaml"]

T = TypeVar("T")


class FieldError(ValueError):
    """A bad value in one field of a config object; ``field`` is a key path like ``rows[1]``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(ValueError):
    """A bad YAML document: ``where`` is the file (or ``<string>``), ``key`` the key path."""

    def __init__(self, where: str, key: str, message: str) -> None:
        location = f"{where}: {key}" if key else where
        super().__init__(f"{location}: {message}")
        self.where = where
        self.key = key
        self.message = message


def choices_text(choices: Iterable[str]) -> str:
    return "[" + ", ".join(choices) + "]"


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FieldError(field, f"expected one of {choices_text(choices)}, got {value!r}")


def check_int(field: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(field, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise FieldError(field, f"expected an integer >= {minimum}, got {value}")


def check_number(field: str, value: Any, minimum: float = 0.0, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(field, f"expected a number, got {value!r}")
    if not math.isfinite(value):  # .nan compares false with everything, .inf is no size
        bound = ">" if strict else ">="
        raise FieldError(field, f"expected a finite number {bound} {minimum}, got {value}")
    if value < minimum or (strict and value == minimum):
        bound = ">" if strict else ">="
        raise FieldError(field, f"expected a number {bound} {minimum}, got {value}")


def check_name(field: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise FieldError(field, f"expected a non-empty string, got {value!r}")


SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""``yaml.safe_load``'s loader, in C when PyYAML has libyaml (a plan of 4,096 ranks is a
1.5 MB file: 20 s in pure Python, under a second in C). The same safe constructor: plain
YAML types only, never Python objects."""
SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
"""``yaml.safe_dump``'s dumper, in C when available."""


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """``yaml.safe_load`` of a file (:data:`SAFE_LOADER`); a syntax error becomes a
    :class:`ConfigError`."""
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(where, "", f"cannot read: {e.strerror or e}") from e
    try:
        return yaml.load(text, Loader=SAFE_LOADER)  # noqa: S506 - the safe loader
    except yaml.YAMLError:
        pass
    try:  # a bad file: the pure-Python loader's message names the place more precisely
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(where, "", f"not valid YAML: {line}{problem}") from e


def expect_mapping(where: str, key: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(where, key, f"expected a mapping, got {type(value).__name__}")
    return value


def expect_list(where: str, key: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(where, key, f"expected a list, got {type(value).__name__}")
    return value


def build(
    cls: Callable[..., T],
    data: Any,
    where: str,
    key: str,
    convert: Mapping[str, Callable[[Any, str], Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> T:
    """Construct dataclass ``cls`` from the YAML mapping ``data`` found at ``where``/``key``.

    Unknown and missing keys are refused with the list of valid ones. ``convert[k](value,
    keypath)`` turns a YAML value into the field's type (lists into tuples, ...) and raises
    :class:`FieldError` with that full key path on a bad value; ``extra``
    supplies fields that do not come from this mapping. A :class:`FieldError` raised by the
    class's ``__post_init__`` is re-raised as a :class:`ConfigError` with the full key path.
    """
    mapping = expect_mapping(where, key, data)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    settable = [n for n in fields if n not in (extra or {})]
    prefix = f"{key}." if key else ""
    kwargs: dict[str, Any] = dict(extra or {})
    for name, value in mapping.items():
        if name not in settable:
            raise ConfigError(
                where, f"{prefix}{name}", f"unknown key, expected one of {choices_text(settable)}"
            )
        fn = (convert or {}).get(name)
        try:
            kwargs[name] = fn(value, f"{prefix}{name}") if fn else value
        except FieldError as e:  # converters raise with the full key path already
            raise ConfigError(where, e.field, e.message) from e
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(where, key, f"missing required key(s) {choices_text(missing)}")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise ConfigError(where, f"{prefix}{e.field}", e.message) from e


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to a temporary file in the target's folder, then ``os.replace`` it."""
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
