"""How a ShardedEmbeddingBagCollection talks to other ranks (the issue-9 switches).

Defaults are the plain, exact path; every switch keeps results equal to it (``wire_dtype``
within a stated error bound).
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

    def __post_init__(self) -> None:
        if self.wire_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"wire_dtype: expected one of [None, torch.bfloat16, torch.float16], "
                f"got {self.wire_dtype}"
            )
