"""Sharding: input dist (bucketize + all-to-all), local lookup, output dist, ``shard()``."""

from fbtriton_dist.dist.layout import ShardLayout
from fbtriton_dist.dist.sharded_ebc import ShardedEmbeddingBagCollection, shard

__all__ = ["ShardLayout", "ShardedEmbeddingBagCollection", "shard"]
