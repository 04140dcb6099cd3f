"""nn.Modules: TableBatchedEmbedding (flat weights of many tables + optimizer state)."""

from fbtriton_dist.modules.tbe import TableBatchedEmbedding

__all__ = ["TableBatchedEmbedding"]
