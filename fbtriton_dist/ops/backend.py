"""The backend choice's older names, kept for callers that import them from here: everything
is owned by the registry in ``ops/backends/`` (``fbtriton_dist.ops.backends``).

``backend="auto"`` (every module's and ``shard()``'s default) is Triton for CUDA tensors and
the fast CPU path (``"cpu"``, ``ops/cpu.py``) for CPU tensors; ``"triton"`` on CPU tensors
runs the kernels in Triton's interpreter; ``"reference"`` is the slow, obvious twin.
"""

from types import ModuleType

from fbtriton_dist.ops.backends import check_choice, choices, get, resolve

Backend = str
"""A resolved backend: one of ``backends.names()``."""
BackendChoice = str
"""What a user asks for: one of ``backends.choices()``."""
CHOICES: tuple[str, ...] = choices()

__all__ = ["CHOICES", "Backend", "BackendChoice", "check_backend", "check_choice",
           "implementation", "resolve"]


def check_backend(backend: str, device) -> None:
    """Refuse tensors of ``device`` that ``backend`` cannot run on (``Backend.check_device``)."""
    get(backend).check_device(device)


def implementation(backend: str) -> ModuleType:
    """The module holding ``backend``'s twin of every op (``Backend.module``)."""
    return get(backend).module()
