"""TorchRec's DistributedModelParallel with our EmbeddingCollectionSharder, on 2 gloo ranks:
our EmbeddingCollection (or TorchRec's, sharded into ours) under DMP against TorchRec's own
EmbeddingCollection run on the whole global batch in one process, with torch's Adagrad in
backward on both; every sharding type; outputs per step, weights and state dict keys after 3
steps. Without our sharder DMP would replicate ours under DDP: the first forward refuses."""

import copy

import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_dmp import BATCH, _batch

ADAGRAD = (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-8})


def _configs():
    from torchrec import EmbeddingConfig

    c = EmbeddingConfig
    return [
        c(name="tw", num_embeddings=7, embedding_dim=4, feature_names=["f_tw"]),
        c(name="rw", num_embeddings=11, embedding_dim=4, feature_names=["f_rw1", "f_rw2"]),
        c(name="cw", num_embeddings=6, embedding_dim=4, feature_names=["f_cw"]),
        c(name="dp", num_embeddings=5, embedding_dim=4, feature_names=["f_dp"]),
    ]


class _Model(torch.nn.Module):
    def __init__(self, ec):
        super().__init__()
        self.ec = ec
        g = torch.Generator().manual_seed(7)
        self.register_buffer("w", torch.randn(4, generator=g))

    def forward(self, kjt):
        out = self.ec(kjt)
        return out, sum((jt.values() @ self.w).sum() for jt in out.values())


def _plan(ec, sharder, world):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    per_table = {"tw": sp.table_wise(rank=1), "rw": sp.row_wise(),
                 "cw": sp.column_wise(ranks=[0, 1]), "dp": sp.data_parallel()}
    module_plan = sp.construct_module_sharding_plan(
        ec, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu")
    return ShardingPlan({"ec": module_plan})


def _dmp_vs_torchrec(rank, world):
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import (
        DMPShardedEmbeddingCollection,
        EmbeddingCollectionSharder,
    )

    configs = _configs()
    report = {}
    for source in ("ours", "torchrec"):
        torch.manual_seed(0)
        ref = _Model(torchrec.EmbeddingCollection(tables=copy.deepcopy(configs)))
        if source == "ours":
            model = _Model(fbtriton_dist.EmbeddingCollection(tables=copy.deepcopy(configs)))
            model.load_state_dict(ref.state_dict())
            sharder = EmbeddingCollectionSharder(local_world_size=world)
        else:
            model = copy.deepcopy(ref)
            sharder = EmbeddingCollectionSharder(local_world_size=world,
                                                 module_type=torchrec.EmbeddingCollection)
        apply_optimizer_in_backward(ADAGRAD[0], ref.ec.parameters(), ADAGRAD[1])
        apply_optimizer_in_backward(ADAGRAD[0], model.ec.parameters(), ADAGRAD[1])
        dmp = DistributedModelParallel(model, sharders=[sharder],
                                       plan=_plan(model.ec, sharder, world))
        sharded = dmp.module.ec
        assert isinstance(sharded, DMPShardedEmbeddingCollection), type(sharded)
        lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
        for step in range(3):
            want, want_loss = ref(_batch(configs, step, 0, sum(BATCH)))
            (want_loss / world).backward()  # the sharded gradients are divided by R
            got, got_loss = dmp(_batch(configs, step, lo, hi))
            got_loss.backward()
            err = 0.0
            for name, jt in got.items():
                lengths = want[name].lengths()
                a, b = int(lengths[:lo].sum()), int(lengths[:hi].sum())
                if jt.values().numel():
                    err = max(err, (jt.values() - want[name].values()[a:b]).abs().max().item())
            report[f"{source}.step{step}.out"] = err
        full = sharded.sharded.gather_full_state_dict()
        report[f"{source}.weights"] = max(
            (full[f"embeddings.{c.name}.weight"] - ref.ec.embeddings[c.name].weight)
            .abs().max().item() for c in configs)
        expected = sorted([*(f"ec.embeddings.{c.name}.weight" for c in configs), "w"])
        report[f"{source}.keys"] = float(sorted(dmp.state_dict()) != expected)
    # without our sharder: replicated under DDP, refused at the first forward
    model = _Model(fbtriton_dist.EmbeddingCollection(tables=copy.deepcopy(configs)))
    apply_optimizer_in_backward(ADAGRAD[0], model.ec.parameters(), ADAGRAD[1])
    dmp = DistributedModelParallel(model)
    try:
        dmp(_batch(configs, 0, 0, BATCH[rank]))
        error = ""
    except RuntimeError as e:
        error = str(e)
    return report, error


def test_dmp_with_our_ec_sharder_matches_torchrec_after_3_fused_steps():
    for rank, (report, error) in enumerate(run_ranks(_dmp_vs_torchrec, 2)):
        for key, err in report.items():
            assert err < 2e-5, f"rank {rank} {key}: {err}"
        assert "EmbeddingCollectionSharder()" in error and "replicate" in error, error
