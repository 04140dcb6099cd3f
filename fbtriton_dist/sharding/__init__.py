"""Sharding: input dist (bucketize + all-to-all), local lookup, output dist, ``shard()``,
and the ``TrainPipeline`` that overlaps the next batch's input dist with this step."""

from fbtriton_dist.sharding.comm.options import CommOptions
from fbtriton_dist.sharding.dist.layout import ShardLayout
from fbtriton_dist.sharding.modules.collection import ShardedCollection
from fbtriton_dist.sharding.modules.sharded_ebc import ShardedEmbeddingBagCollection
from fbtriton_dist.sharding.modules.sharded_ec import ShardedEmbeddingCollection
from fbtriton_dist.sharding.pipeline import TrainPipeline
from fbtriton_dist.sharding.shard import shard

__all__ = [
    "CommOptions",
    "ShardLayout",
    "ShardedCollection",
    "ShardedEmbeddingBagCollection",
    "ShardedEmbeddingCollection",
    "TrainPipeline",
    "shard",
]
