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
    """Pooled embeddings and their gradients travel in this dtype (torch.bfloat16 or
    torch.float16) and are summed in fp32; None keeps the output dtype (exact)."""
    dedup: bool = False
    """Send each destination its unique (feature, id) pairs once, plus an inverse map, in the
    input all-to-all; pays when ids repeat within a batch (Zipf)."""

    def __post_init__(self) -> None:
        if self.wire_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(
                f"wire_dtype: expected one of [None, torch.bfloat16, torch.float16], "
                f"got {self.wire_dtype}"
            )
