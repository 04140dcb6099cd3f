"""Slow, obvious pure-PyTorch twins of every kernel, with the same signatures.

They are the specification, the CPU backend and the test oracle.
"""

from fbtriton_dist.reference.bucketize import (
    bucketize,
    bucketize_into,
    segment_copy,
    segment_plan,
)
from fbtriton_dist.reference.tbe import (
    POOL_MEAN,
    POOL_NONE,
    POOL_SUM,
    step_seed,
    stochastic_round,
    tbe_backward,
    tbe_forward,
    tbe_per_sample_weights_grad,
)

__all__ = [
    "POOL_MEAN",
    "POOL_NONE",
    "POOL_SUM",
    "bucketize",
    "bucketize_into",
    "segment_copy",
    "segment_plan",
    "step_seed",
    "stochastic_round",
    "tbe_backward",
    "tbe_forward",
    "tbe_per_sample_weights_grad",
]
