"""Sharding: input dist (bucketize + all-to-all), local lookup, output dist, ``shard()``,
and the ``TrainPipeline`` that overlaps the next batch's input dist with this step."""

from fbtriton_dist.sharding.layout import ShardLayout
from fbtriton_dist.sharding.options import CommOptions
from fbtriton_dist.sharding.pipeline import TrainPipeline
from fbtriton_dist.sharding.sharded_ebc import ShardedEmbeddingBagCollection, shard

__all__ = ["CommOptions", "ShardLayout", "ShardedEmbeddingBagCollection", "TrainPipeline", "shard"]
