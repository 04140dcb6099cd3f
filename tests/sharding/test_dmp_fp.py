"""TorchRec's FeatureProcessedEmbeddingBagCollection around our EBC under
DistributedModelParallel with our sharder, on 2 gloo ranks: DMP has no sharder for the
feature-processed module, so it shards our EBC inside it with ours and replicates the
position weights under DDP. Each rank's outputs equal TorchRec's unsharded module's on its
slice of the global batch, and the position weights' (DDP-averaged) gradient equals the
unsharded gradient of the global batch's loss divided by the world size: the per-id weights'
gradients come back from the shards' owners through the input dist."""

import copy

import torch

from tests.sharding.harness import run_ranks

BATCH = [3, 5]  # local batch sizes of ranks 0 and 1
FEATURES = ["f1", "f2", "f3"]


def _batch(lo: int, hi: int):
    """Samples [lo, hi) of the global batch, as a KJT (no per-id weights of its own)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(7)
    lengths, values = [], []
    for _ in FEATURES:
        ls = torch.randint(0, 4, (sum(BATCH),), generator=g)
        vs = torch.randint(0, 6, (int(ls.sum()),), generator=g)
        lengths.append(ls[lo:hi])
        values.append(vs[int(ls[:lo].sum()) : int(ls[:hi].sum())])
    return KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=torch.cat(lengths))


def _dmp_fp(rank, world, processors):
    import torchrec
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.feature_processor_ import (
        PositionWeightedModule,
        PositionWeightedModuleCollection,
    )
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    tables = [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=6,
                           feature_names=["f2", "f3"]),
    ]

    def fp_ebc(ebc):
        fps = (PositionWeightedModuleCollection({f: 4 for f in FEATURES})
               if processors == "collection"
               else {f: PositionWeightedModule(max_feature_length=4) for f in FEATURES})
        return FeatureProcessedEmbeddingBagCollection(ebc, fps)

    class Model(torch.nn.Module):
        def __init__(self, fp):
            super().__init__()
            self.fp = fp

        def forward(self, kjt):
            return self.fp(kjt).values()

    torch.manual_seed(0)
    ref = Model(fp_ebc(torchrec.EmbeddingBagCollection(tables=copy.deepcopy(tables),
                                                        is_weighted=True)))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "position_weight" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    ours = Model(fp_ebc(fbtriton_dist.EmbeddingBagCollection(tables=copy.deepcopy(tables),
                                                             is_weighted=True)))
    ours.load_state_dict(ref.state_dict())
    apply_optimizer_in_backward(torch.optim.SGD,
                                ours.fp._embedding_bag_collection.parameters(), {"lr": 0.1})
    dmp = DistributedModelParallel(ours, sharders=[EmbeddingBagCollectionSharder(local_world_size=world)],
                                   device=torch.device("cpu"))
    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    out = dmp(_batch(lo, hi))
    want = ref(_batch(0, sum(BATCH)))
    out.sum().backward()
    want.sum().backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if "position_weight" in n}
    got = {n.removeprefix("module."): p.grad for n, p in dmp.named_parameters()
           if "position_weight" in n}
    grad_err = max((got[n] - g / world).abs().max().item() if got[n] is not None
                   else float("inf") for n, g in grads.items())
    return (type(dmp.module.fp._embedding_bag_collection).__name__,
            (out - want[lo:hi]).abs().max().item(), grad_err, sorted(got) == sorted(grads))


def _runs():
    return {p: run_ranks(_dmp_fp, 2, p) for p in ("dict", "collection")}


def test_dmp_shards_our_ebc_inside_a_feature_processed_ebc():
    for processors, ranks in _runs().items():
        for rank, (kind, out_err, _, same_names) in enumerate(ranks):
            assert kind != "EmbeddingBagCollection", (processors, rank, kind)  # sharded
            assert out_err < 1e-5, (processors, rank, out_err)
            assert same_names, (processors, rank)


def test_position_weights_train_under_dmp():
    for processors, ranks in _runs().items():
        for rank, (_, _, grad_err, _) in enumerate(ranks):
            assert grad_err < 1e-5, (processors, rank, grad_err)
