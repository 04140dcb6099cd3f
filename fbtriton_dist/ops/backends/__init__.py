"""The one registry of backends: what runs the ops of ``ops/`` (the TBE lookup, its backward
with the fused update, the backward plan, the per-sample weight gradient, the bucketize
family, the id remap).

A backend is one object (``base.Backend``) with typed methods for each op and a
``Capabilities`` record of what it supports; ``ops/`` asks the record (``capturable``,
``bounds_check_in_kernel``, ``plan_ahead``, ...) instead of comparing names, and
``check_supported`` refuses, when a module is built, a pooling, optimizer, weight dtype or
device the backend lacks, naming the backend and what it supports.

``backend="auto"`` (every module's and ``shard()``'s default) is the backend ``AUTO`` names
for the tensors' device type (Triton on CUDA), else the fast CPU path ``"cpu"``; any name of
``names()`` overrides it and reaches every op.

This module imports neither torch nor triton (the job config reads ``names()``); a backend's
own module (and torch, triton) loads at its first ``get``.

Adding a backend: a module here defining ``BACKEND`` (a ``base.Backend`` subclass instance
with its ``Capabilities``, overriding the methods it implements) and one line in ``MODULES``;
its kernels live where their layer says (``kernels/``, ``ops/csrc/``, ...).
"""

import importlib

from fbtriton_dist.ops.backends.base import Backend, Capabilities

__all__ = [
    "AUTO",
    "Backend",
    "Capabilities",
    "capabilities",
    "check_choice",
    "check_supported",
    "choices",
    "get",
    "names",
    "pick",
    "resolve",
]

MODULES: dict[str, str] = {
    "triton": "fbtriton_dist.ops.backends.triton",
    "cpu": "fbtriton_dist.ops.backends.cpu",
    "reference": "fbtriton_dist.ops.backends.reference",
}
"""Every backend's name and the module defining its ``BACKEND`` object."""

AUTO: dict[str, str] = {"cuda": "triton"}
"""What ``"auto"`` picks for tensors of a device type; ``AUTO_DEFAULT`` for any other."""
AUTO_DEFAULT = "cpu"

_LOADED: dict[str, Backend] = {}


def names() -> tuple[str, ...]:
    """The backends' names, in registry order."""
    return tuple(MODULES)


def choices() -> tuple[str, ...]:
    """What a user may ask for: ``"auto"`` and every name."""
    return ("auto", *MODULES)


def check_choice(backend: str) -> None:
    """Refuse a backend name that is not one of ``choices()``."""
    if backend not in choices():
        raise ValueError(f"backend: expected one of {list(choices())}, got {backend!r}")


def get(name: str) -> Backend:
    """The backend object called ``name`` (its module loaded at the first call)."""
    found = _LOADED.get(name)
    if found is None:
        if name not in MODULES:
            raise ValueError(f"backend: expected one of {list(names())}, got {name!r}")
        found = _LOADED[name] = importlib.import_module(MODULES[name]).BACKEND
    return found


def capabilities(name: str) -> Capabilities:
    """What backend ``name`` supports."""
    return get(name).capabilities


def _device_type(device) -> str:
    """``"cuda"`` for ``torch.device("cuda:1")`` or ``"cuda:1"`` (no torch import here)."""
    return getattr(device, "type", None) or str(device).split(":")[0]


def pick(backend: str, device) -> str:
    """``backend``, or for ``"auto"`` the one ``AUTO`` names for ``device``'s type."""
    check_choice(backend)
    return backend if backend != "auto" else AUTO.get(_device_type(device), AUTO_DEFAULT)


def resolve(backend: str, device) -> str:
    """The backend that runs ops on tensors of ``device`` (``pick``). Raises where it cannot
    run there (``Backend.check_device``)."""
    name = pick(backend, device)
    get(name).check_device(device)
    return name


STAGING = ("cpu", "meta")
"""Device types a module is often built on and then moved from: ``check_supported`` does not
refuse them (the move checks the new device)."""


def check_supported(
    backend: str,
    *,
    device,
    pooling=None,
    optimizer: str | None = None,
    dtypes=(),
    tiers=(),
    where: str = "TableBatchedEmbedding",
) -> str:
    """Pick ``backend`` for ``device`` and refuse (``ValueError`` naming the backend and what
    it supports) a pooling (``PoolingMode`` or its name), optimizer (a registry name), weight
    or output dtype (torch dtypes or their names), storage tier (names) or device (but a
    ``STAGING`` one) it lacks. Returns the backend's name. Called when a module is built or
    moved, so that nothing fails at the first backward. What only the lookup can tell
    (Triton's interpreter on CPU) is ``Backend.check_device``'s, at the lookup."""
    name = pick(backend, device)
    kind = _device_type(device)
    problems = capabilities(name).problems(
        device=None if kind in STAGING else kind, pooling=pooling, optimizer=optimizer,
        dtypes=dtypes, tiers=tiers,
    )
    if problems:
        chosen = f"backend={name!r}" + (f" (from {backend!r})" if backend != name else "")
        raise ValueError(f"{where}: {chosen} does not support " + "; ".join(problems))
    return name
