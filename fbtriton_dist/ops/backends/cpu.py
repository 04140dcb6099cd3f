"""The fast CPU backend (``ops/cpu.py``): native C kernels compiled at first use
(``ops/cpu_native.py``, ``ops/csrc/``), vectorised torch ops where they do not apply. Its
torch ops run on any device (host-synchronous on CUDA); the ops ``ops/cpu.py`` does not have
(the fixed-shape placement of the input dist) are the reference's (``Backend.twin``).

Its optimizers are those both paths implement: the C side's (``cpu_native.NATIVE_OPTIMIZERS``)
that also have a torch step (``ops/cpu.py``'s ``_STEPS``), so that a registry optimizer the C
code lacks is refused when a module is built.
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
        # without the C source the native kernels never run: the torch steps decide
        optimizers=tuple(
            name for name in optim.NAMES
            if name in (cpu_native.NATIVE_OPTIMIZERS or cpu.STEP_OPTIMIZERS)
            and name in cpu.STEP_OPTIMIZERS
        ),
        native_input_check=True,
        tiers=("device", "host", "cached", "file"),
    ),
    "fbtriton_dist.ops.cpu",
)
