"""``model.kind: dcnv2`` (``models.DCNv2Model``) against TorchRec's ``DLRM_DCN``: the same
weights copied in, the same outputs and gradients (fp32, tight), on small and awkward shapes;
the job's config for it."""

import pytest
import torch
import torchrec
from torchrec.models.dlrm import DLRM_DCN

from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.planner import ConfigError
from fbtriton_dist.train.config import job_from_dict
from fbtriton_dist.train.mlperf_config import DCNV2_DENSE_ARCH, DCNV2_OVER_ARCH
from fbtriton_dist.train.models import DCNv2Model

# (tables as (rows, features), D, dense_arch, over_arch, cross layers, rank)
SHAPES = {
    "small": ([(50, ["a"]), (7, ["b", "c"])], 8, [16, 8], [32, 16, 1], 3, 4),
    "one_layer_rank1_D3": ([(5, ["a"]), (1, ["b"])], 3, [3], [4, 1], 1, 1),
    "no_cross_layer": ([(20, ["a", "b"])], 4, [6, 4], [5, 1], 0, 2),
}


def _kjt(features, rows_of, B, gen):
    lengths = torch.randint(0, 4, (len(features) * B,), generator=gen)
    lengths[0] = 0  # an empty bag
    values = torch.cat([torch.randint(0, rows_of[f], (int(n),), generator=gen)
                        for f, n in zip([f for f in features for _ in range(B)], lengths,
                                        strict=True)])
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=features, values=values,
                                                        lengths=lengths)


def _copy_linears(ours, theirs):
    """Our MLP's Linear layers take the weights of TorchRec's, in order."""
    mine = [m for m in ours.modules() if isinstance(m, torch.nn.Linear)]
    other = [m for m in theirs.modules() if isinstance(m, torch.nn.Linear)]
    assert len(mine) == len(other)
    for a, b in zip(mine, other, strict=True):
        a.weight.data.copy_(b.weight.data)
        a.bias.data.copy_(b.bias.data)


@pytest.mark.parametrize("B", [1, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_dcnv2_matches_torchrec_dlrm_dcn(shape, B):
    tables, D, dense_arch, over_arch, layers, rank = SHAPES[shape]
    configs = [torchrec.EmbeddingBagConfig(name=f"t{i}", num_embeddings=E, embedding_dim=D,
                                           feature_names=fs)
               for i, (E, fs) in enumerate(tables)]
    features = [f for _, fs in tables for f in fs]
    rows_of = {f: E for E, fs in tables for f in fs}
    torch.manual_seed(0)
    ref = DLRM_DCN(embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=configs),
                   dense_in_features=13, dense_arch_layer_sizes=dense_arch,
                   over_arch_layer_sizes=over_arch, dcn_num_layers=layers,
                   dcn_low_rank_dim=rank)
    ours = DCNv2Model(EmbeddingBagCollection(tables=configs), features=features, num_dense=13,
                      dense_arch=dense_arch, over_arch=over_arch, cross_layers=layers,
                      low_rank=rank)
    ours.ebc.load_state_dict(ref.sparse_arch.embedding_bag_collection.state_dict())
    _copy_linears(ours.dense_arch, ref.dense_arch)
    _copy_linears(ours.over_arch, ref.over_arch)
    cross = ref.inter_arch.crossnet
    for i in range(layers):
        ours.cross.V[i].data.copy_(cross.V_kernels[i].data)
        ours.cross.W[i].data.copy_(cross.W_kernels[i].data)
        ours.cross.bias[i].data.copy_(torch.randn(D * (len(features) + 1)))
        cross.bias[i].data.copy_(ours.cross.bias[i].data)  # not zeros: the bias is used

    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(B, 13, generator=gen)
    kjt = _kjt(features, rows_of, B, gen)
    got, want = ours(dense, kjt), ref(dense, kjt)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (got.square().sum() + got.sum()).backward()
    (want.square().sum() + want.sum()).backward()
    pairs = [(ours.ebc.embedding_bags[f"t{i}"].weight,
              ref.sparse_arch.embedding_bag_collection.embedding_bags[f"t{i}"].weight)
             for i in range(len(tables))]
    pairs += [(a.weight, b.weight) for a, b in zip(
        [m for m in [*ours.dense_arch.modules(), *ours.over_arch.modules()]
         if isinstance(m, torch.nn.Linear)],
        [m for m in [*ref.dense_arch.modules(), *ref.over_arch.modules()]
         if isinstance(m, torch.nn.Linear)], strict=True)]
    for i in range(layers):
        pairs += [(ours.cross.V[i], cross.V_kernels[i]), (ours.cross.W[i], cross.W_kernels[i]),
                  (ours.cross.bias[i], cross.bias[i])]
    for a, b in pairs:
        torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense(), atol=1e-5, rtol=1e-5)


def test_features_in_another_key_order_are_read_by_name():
    configs = [torchrec.EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=2,
                                           feature_names=["a", "b"])]
    torch.manual_seed(0)
    m = DCNv2Model(EmbeddingBagCollection(tables=configs), features=["b", "a"], num_dense=3,
                   dense_arch=[2], over_arch=[2, 1], cross_layers=0, low_rank=1)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    dense = torch.randn(1, 3)
    w = m.ebc.embedding_bags["t"].weight
    x0 = torch.cat([m.dense_arch(dense), w[2:3], w[1:2]], 1)
    torch.testing.assert_close(m(dense, kjt), m.over_arch(x0))


def _job(**model):
    return {"tables": [{"name": "t", "num_embeddings": 10, "embedding_dim": 128,
                        "features": ["a"]}],
            "model": {"kind": "dcnv2", **model}, "train": {"steps": 1}}


def test_dcnv2_layer_sizes_default_to_mlperf():
    cfg = job_from_dict(_job())
    assert cfg.model.dense_arch == DCNV2_DENSE_ARCH == (512, 256, 128)
    assert cfg.model.over_arch == DCNV2_OVER_ARCH == (1024, 1024, 512, 256, 1)
    assert (cfg.model.cross_layers, cfg.model.low_rank) == (3, 512)
    assert job_from_dict(_job(low_rank=64, dense_arch=[64, 128])).model.dense_arch == (64, 128)


def test_dcnv2_needs_every_table_at_the_dense_output_dim():
    with pytest.raises(ConfigError, match="embedding_dim == dense_arch"):
        job_from_dict(_job(dense_arch=[64]))
    with pytest.raises(ConfigError, match="low_rank"):
        job_from_dict(_job(low_rank=0))
