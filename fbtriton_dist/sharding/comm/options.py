"""How a sharded collection talks to other ranks, and how its gradients are scaled.

The wire switches (``wire_dtype``, ``dedup``, ``fixed_shapes``) keep results equal to the
default path (``wire_dtype`` within a stated error bound). ``gradient_division`` sets what a
learning rate means: by default the embedding gradients are divided by the world size, as
TorchRec does, so R ranks take the update the unsharded module takes on the global batch.
"""

from dataclasses import dataclass

import torch


@dataclass(kw_only=True, frozen=True)
class CommOptions:
    """Communication options of a sharded collection (``shard(..., comm=CommOptions(...))``)."""

    wire_dtype: torch.dtype | None = None
    """Pooled embeddings (output dist, forward) and their gradients (backward) travel in this
    dtype (torch.bfloat16 or torch.float16) and are summed in fp32: one rounding per hop,
    ``|error| <= hops * u * sum|terms|`` (u = 2^-8 bf16, 2^-11 fp16; one hop, two for
    table-row-wise / grid, which sum inside the host first). Data-parallel gradients stay
    exact. None: fp32 on the wire (exact)."""
    dedup: bool = False
    """Send each destination its distinct ids once plus an inverse map (int16 up to 32,768
    distinct ids, else int32) in the input all-to-all, per message only where that is smaller
    than the ids themselves (ids repeat within a batch under Zipf). The receiver expands the
    ids back before the lookup, so results are bit-identical and the TBE still reads one row
    per id: dedup saves wire bytes, not lookups (``comm_report()['input_dist.dedup']``)."""

    fixed_shapes: bool = False
    """Give every input all-to-all message a size fixed at the first batch (its lengths and
    ``max_ids`` id slots times the most shards an id lands in), so that a step has no host
    sync and the same shapes every time: the host runs ahead of the GPU, and the step can be
    captured in a CUDA graph (``TrainPipeline(cuda_graph=True)``). Costs wire bytes (unused
    slots travel too); the batch size must stay the same; bad ids are reported a few steps
    late (``fbtriton_dist.sharding.dist.fixed``). Not with ``dedup``."""
    max_ids: int | None = None
    """With ``fixed_shapes``: the most ids one rank's batch may hold (default: the first
    batch's count)."""

    gradient_division: bool | None = None
    """Divide the gradient of every sharded table (data-parallel ones included) by the world
    size R of the process group in backward, as TorchRec's output dist does
    (``torchrec.distributed.comm_ops.set_gradient_division``) and as DDP averages the dense
    gradients: each rank's loss is the mean over its own samples, and R ranks then take the
    same step as the unsharded module on the global batch with the loss as its mean (uneven
    batches: when each rank's loss is its sum over its samples times R / global batch).
    False: the gradients of all ranks are summed (a learning rate then acts R times larger
    on R ranks). None (default): True; under TorchRec's ``DistributedModelParallel`` our
    sharders read TorchRec's switch instead (``comm_ops.get_gradient_division()``, when the
    model is sharded)."""

    def __post_init__(self) -> None:
        if self.gradient_division is not None and not isinstance(self.gradient_division, bool):
            raise ValueError(f"gradient_division: expected True, False or None, got "
                             f"{self.gradient_division!r}")
        if self.fixed_shapes and self.dedup:
            raise ValueError("CommOptions: fixed_shapes and dedup do not combine (dedup sizes "
                             "each message by its distinct ids, which changes every batch)")
        if self.max_ids is not None and not self.fixed_shapes:
            raise ValueError("CommOptions: max_ids is the capacity of fixed_shapes; set "
                             "fixed_shapes=True with it")
        if self.wire_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"wire_dtype: expected one of [None, torch.bfloat16, torch.float16], "
                f"got {self.wire_dtype}"
            )
