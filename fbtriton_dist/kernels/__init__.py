"""Triton kernels and their launchers. No autograd, modules or process groups here.

The kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before
``triton`` was first imported (the interpreter; slow, for tests on small shapes).
"""

from fbtriton_dist.kernels.bucketize import (
    bucketize,
    bucketize_into,
    segment_copy,
    segment_plan,
)
from fbtriton_dist.kernels.id_remap import HashIndex
from fbtriton_dist.kernels.tbe_backward import BackwardPlan, tbe_backward, tbe_backward_plan
from fbtriton_dist.kernels.tbe_forward import tbe_forward, tbe_linearize

__all__ = [
    "BackwardPlan",
    "HashIndex",
    "bucketize",
    "bucketize_into",
    "segment_copy",
    "segment_plan",
    "tbe_backward",
    "tbe_backward_plan",
    "tbe_forward",
    "tbe_linearize",
]
