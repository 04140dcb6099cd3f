"""The autograd boundary: input validation, dispatch to a backend of the registry
(``ops/backends/``: the Triton kernels, the fast CPU path, the reference).

Imports are lazy: ``fbtriton_dist.ops.backends`` (the registry's names, which the job config
reads) loads without torch.
"""

import importlib

__all__ = ["TBELayout", "check_inputs", "tbe_lookup"]

_HOMES = {"TBELayout": "tbe", "check_inputs": "tbe", "tbe_lookup": "tbe"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"fbtriton_dist.ops.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'fbtriton_dist.ops' has no attribute {name!r}")
