"""The autograd boundary: input validation, dispatch to kernels (CUDA) or reference (CPU)."""

from fbtriton_dist.ops.tbe import TBELayout, check_inputs, tbe_lookup

__all__ = ["TBELayout", "check_inputs", "tbe_lookup"]
