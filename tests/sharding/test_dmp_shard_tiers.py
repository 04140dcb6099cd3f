"""Tiers per shard and TorchRec's ``DistributedModelParallel``: DMP's plan is TorchRec's, one
``ParameterSharding`` (one compute kernel, one tier) per table, so our plan with a tier per
shard cannot reach our sharders through it. Given our plan, DMP refuses it naming every shard
with a tier of its own (never one tier for all). (TorchRec's compute kernels as table tiers:
``tests/sharding/test_sharded_tiers.py``.)"""

import pytest
import torch
import torchrec

from fbtriton_dist import EmbeddingBagCollection
from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder


def _plan(shard_storage=None):
    plan = ShardingPlan.from_dict({
        "version": 1, "world_size": 2, "local_world_size": 2, "tables": [
            {"name": "t", "sharding": "row_wise", "num_embeddings": 10, "embedding_dim": 4,
             "storage": {"tier": "cached", "cache_load_factor": 0.5},
             "shards": [{"rank": 0, "rows": [0, 4], "cols": [0, 4]},
                        {"rank": 1, "rows": [4, 10], "cols": [0, 4]}]}]})
    return plan if shard_storage is None else plan.with_shard_storage({"t": shard_storage})


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[torchrec.EmbeddingBagConfig(
            name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])])


def _dmp(plan):
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    return DistributedModelParallel(_Model(), env=ShardingEnv.from_local(1, 0),
                                    device=torch.device("cpu"), plan=plan,
                                    sharders=[EmbeddingBagCollectionSharder()])


def test_dmp_refuses_our_plan_naming_each_shard_tier():
    with pytest.raises(ValueError, match=r"tiers per shard of table 't' shard 0 \(rank 0: rows "
                                         r"0\.\.4, cols 0\.\.4\) on 'device' \(its table on "
                                         r"'cached'\)$"):
        _dmp(_plan({0: "device"}))
    with pytest.raises(ValueError, match=r"shard 0 .* on 'device' .*; table 't' shard 1 \(rank "
                                         r"1: rows 4\.\.10, cols 0\.\.4\) on 'file'"):
        _dmp(_plan({0: "device", 1: {"tier": "file", "path": "/tmp/rows"}}))
    # without tiers per shard: refused too (the wrong kind of plan), nothing named
    with pytest.raises(ValueError, match=r"expected TorchRec's ShardingPlan .* got "
                                         r"fbtriton_dist's ShardingPlan; shard the model with "
                                         r"fbtriton_dist.shard\(model, plan\), which takes it$"):
        _dmp(_plan())

