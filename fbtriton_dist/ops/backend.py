"""The one place that picks what runs an op: the Triton kernels, the fast CPU path or the
PyTorch reference.

``backend="auto"`` (every module's and ``shard()``'s default) is Triton for CUDA tensors and
the fast CPU path (``"cpu"``, ``ops/cpu.py``: vectorised torch ops) for CPU tensors;
``"triton"`` on CPU tensors runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is first imported: tests, small shapes); ``"reference"`` is the slow,
obvious twin everywhere (the spec and the test oracle). Every op in ``ops/`` takes the
resolved name and gets its implementation module from ``implementation``.
"""

import os
from types import ModuleType
from typing import Literal

import torch

Backend = Literal["triton", "cpu", "reference"]
"""A resolved backend: what an op runs."""
BackendChoice = Literal["auto", "triton", "cpu", "reference"]
"""What a user asks for."""
CHOICES: tuple[str, ...] = ("auto", "triton", "cpu", "reference")


def check_choice(backend: str) -> None:
    """Refuse a backend name that is not one of ``CHOICES``."""
    if backend not in CHOICES:
        raise ValueError(f"backend: expected one of {list(CHOICES)}, got {backend!r}")


def resolve(backend: str, device: torch.device | str) -> Backend:
    """``backend`` for tensors on ``device``: ``"auto"`` becomes Triton on CUDA, the fast
    CPU path elsewhere. Raises if Triton cannot run there (``check_backend``)."""
    check_choice(backend)
    device = torch.device(device)
    resolved: Backend = (
        backend if backend != "auto" else ("triton" if device.type == "cuda" else "cpu")
    )
    check_backend(resolved, device)
    return resolved


def check_backend(backend: Backend, device: torch.device) -> None:
    """Refuse Triton on CPU tensors unless the interpreter is on (it must be set before import).
    The fast CPU path is torch ops: it runs anywhere (host-synchronous on CUDA)."""
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors runs the kernels in Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before Python starts (before triton is "
            "imported), or use backend='reference' / 'auto' on CPU"
        )


def implementation(backend: Backend) -> ModuleType:
    """The module holding ``backend``'s twin of every op: ``fbtriton_dist.kernels`` (imports
    triton, only when asked for), ``fbtriton_dist.ops.cpu`` or ``fbtriton_dist.reference``."""
    if backend == "triton":
        from fbtriton_dist import kernels  # noqa: PLC0415 (triton only when asked for)

        return kernels
    if backend == "cpu":
        from fbtriton_dist.ops import cpu  # noqa: PLC0415

        return cpu
    from fbtriton_dist import reference  # noqa: PLC0415

    return reference
