"""fbtriton_dist: sharded embedding bags on Triton TBE kernels, a drop-in for TorchRec.

The package imports lazily: ``fbtriton_dist.planner`` and the ``fbtriton-dist plan`` command
never load torch or triton.
"""

import importlib

__version__ = "0.1.0"
__all__ = [
    "EmbeddingBagCollection",
    "ShardedEmbeddingBagCollection",
    "TableBatchedEmbedding",
    "optim",
    "shard",
]


def __getattr__(name: str):
    if name == "TableBatchedEmbedding":
        from fbtriton_dist.modules import TableBatchedEmbedding

        return TableBatchedEmbedding
    if name == "EmbeddingBagCollection":
        from fbtriton_dist.modules.ebc import EmbeddingBagCollection

        return EmbeddingBagCollection
    if name in ("shard", "ShardedEmbeddingBagCollection"):
        from fbtriton_dist import dist

        return getattr(dist, name)
    if name == "optim":
        return importlib.import_module("fbtriton_dist.optim")
    raise AttributeError(f"module 'fbtriton_dist' has no attribute {name!r}")
