"""The fast CPU backend (``ops/cpu.py``): native C kernels compiled at first use
(``ops/cpu_native.py``, ``ops/csrc/``), vectorised torch ops where they do not apply. Its
torch ops run on any device (host-synchronous on CUDA); the ops ``ops/cpu.py`` does not have
(the fixed-shape placement of the input dist) are the reference's (``Backend.twin``).

Its optimizers are those with a vectorised torch step (``ops/cpu.py``'s ``_STEPS``): the
backward runs the native C kernels for the optimizers the C side implements
(``cpu_native.NATIVE_OPTIMIZERS``, ``NATIVE_OPTIMIZERS`` below) and the torch step for the
others, so a registry optimizer without a torch step is refused when a module is built.
"""

from fbtriton_dist import optim
from fbtriton_dist.ops import cpu, cpu_native
from fbtriton_dist.ops.backends.base import Backend, Capabilities


class CPUBackend(Backend):
    def tbe_backward(self, *args, rows=None, **kwargs):
        """The native kernels check each id against its table's ``rows``."""
        return cpu.tbe_backward(*args, rows=rows, **kwargs)


BACKEND = CPUBackend(
    "cpu",
    Capabilities(
        devices=("cpu", "cuda"),
        # the torch steps run what the native kernels lack (cpu_native.backward declines it)
        optimizers=tuple(name for name in optim.NAMES if name in cpu.STEP_OPTIMIZERS),
        # the native forward (and, where it does not run, the torch ops) drops and counts
        # out-of-range ids in err: no separate pass over the batch before the lookup
        bounds_check_in_kernel=True,
        weights_check_in_kernel=True,
        native_input_check=True,  # layouts without table rows (num_rows None) still take it
        tiers=("device", "host", "cached", "file"),
    ),
    "fbtriton_dist.ops.cpu",
)

NATIVE_OPTIMIZERS: tuple[str, ...] = tuple(
    name for name in BACKEND.capabilities.optimizers if name in cpu_native.NATIVE_OPTIMIZERS
)
"""The backend's optimizers that its native C kernels update (the rest take the torch step)."""
