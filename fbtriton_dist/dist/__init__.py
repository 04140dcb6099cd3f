"""Sharding: input dist (bucketize + all-to-all), local lookup, output dist, ``shard()``,
and the ``TrainPipeline`` that overlaps the next batch's input dist with this step."""

from fbtriton_dist.dist.layout import ShardLayout
from fbtriton_dist.dist.options import CommOptions
from fbtriton_dist.dist.pipeline import TrainPipeline
from fbtriton_dist.dist.sharded_ebc import ShardedEmbeddingBagCollection, shard

__all__ = ["CommOptions", "ShardLayout", "ShardedEmbeddingBagCollection", "TrainPipeline", "shard"]
