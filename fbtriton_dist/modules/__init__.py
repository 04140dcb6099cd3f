"""nn.Modules: TableBatchedEmbedding (flat weights of many tables + optimizer state) and the
drop-in EmbeddingBagCollection."""

from fbtriton_dist.modules.tbe import TableBatchedEmbedding

__all__ = ["EmbeddingBagCollection", "TableBatchedEmbedding"]


def __getattr__(name: str):
    if name == "EmbeddingBagCollection":  # imports torchrec: only when asked for
        from fbtriton_dist.modules.ebc import EmbeddingBagCollection

        return EmbeddingBagCollection
    raise AttributeError(name)
