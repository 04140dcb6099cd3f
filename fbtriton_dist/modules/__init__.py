"""nn.Modules: TableBatchedEmbedding (flat weights of many tables + optimizer state) and the
drop-ins EmbeddingBagCollection and EmbeddingCollection."""

from fbtriton_dist.modules.tbe import TableBatchedEmbedding

__all__ = [
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "ManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "TableBatchedEmbedding",
]


def __getattr__(name: str):
    if name == "EmbeddingBagCollection":  # imports torchrec: only when asked for
        from fbtriton_dist.modules.ebc import EmbeddingBagCollection

        return EmbeddingBagCollection
    if name == "EmbeddingCollection":
        from fbtriton_dist.modules.ec import EmbeddingCollection

        return EmbeddingCollection
    if name.startswith("ManagedCollision"):
        from fbtriton_dist.modules import managed

        return getattr(managed, name)
    raise AttributeError(name)
