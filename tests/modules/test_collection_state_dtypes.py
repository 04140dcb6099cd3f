"""``optimizer_state_dtypes`` on the collections: an EmbeddingBagCollection /
EmbeddingCollection built with bf16 Adam moments trains exactly as one TableBatchedEmbedding
of the same tables, weights and state dtypes (the same kernels), and keeps its states bf16."""

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import fbtriton_dist
from fbtriton_dist import TableBatchedEmbedding, optim

BF16 = {"momentum1": "bf16", "momentum2": "bf16"}
ADAM = (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95)})
B = 3


def _kjt(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 3, (3 * B,), generator=g)
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths)


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_collection_with_bf16_moments_matches_the_tbe(kind):
    torch.manual_seed(0)
    if kind == "ebc":
        configs = [EmbeddingBagConfig(name="t0", num_embeddings=5, embedding_dim=4,
                                      feature_names=["a", "b"]),
                   EmbeddingBagConfig(name="t1", num_embeddings=6, embedding_dim=4,
                                      feature_names=["c"])]
        coll = fbtriton_dist.EmbeddingBagCollection(tables=configs, backend="cpu",
                                                    optimizer_state_dtypes=BF16)
        key = "embedding_bags"
    else:
        configs = [EmbeddingConfig(name="t0", num_embeddings=5, embedding_dim=4,
                                   feature_names=["a", "b"]),
                   EmbeddingConfig(name="t1", num_embeddings=6, embedding_dim=4,
                                   feature_names=["c"])]
        coll = fbtriton_dist.EmbeddingCollection(tables=configs, backend="cpu",
                                                 optimizer_state_dtypes=BF16)
        key = "embeddings"
    apply_optimizer_in_backward(ADAM[0], coll.parameters(), ADAM[1])
    sd = coll.state_dict()
    tbe = TableBatchedEmbedding(
        [(5, 4), (6, 4)], [0, 0, 1], pooling="sum" if kind == "ebc" else "none",
        optimizer=optim.from_torch(ADAM[0], dict(ADAM[1]), "tbe"), backend="cpu",
        weights=torch.cat([sd[f"{key}.t0.weight"].flatten(), sd[f"{key}.t1.weight"].flatten()]),
        init_weights=False, optimizer_state_dtypes=BF16)
    for step in range(2):
        kjt = _kjt(step)
        out = coll(kjt)
        out = out.values() if kind == "ebc" else torch.cat([out[k].values() for k in "abc"])
        ref = tbe(kjt.values(), kjt.offsets())
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9 + step))
        out.backward(grad)
        ref.backward(grad)
    state = coll.fused_optimizer_state_dict()
    for t, (name, theirs) in enumerate(zip(["t0", "t1"], tbe.split_optimizer_states(),
                                           strict=True)):
        torch.testing.assert_close(coll.state_dict()[f"{key}.{name}.weight"],
                                   tbe.split_embedding_weights()[t], rtol=0, atol=0)
        for i, expected in enumerate(theirs):
            mine = state[f"{key}.{name}.weight.{i}"]
            assert mine.dtype == torch.bfloat16 and expected.dtype == torch.bfloat16
            torch.testing.assert_close(mine, expected, rtol=0, atol=0)
            assert mine.abs().sum() > 0  # the states moved


def test_bad_state_dtypes_name_the_key():
    configs = [EmbeddingBagConfig(name="t0", num_embeddings=5, embedding_dim=4,
                                  feature_names=["a"])]
    with pytest.raises(ValueError, match=r"optimizer_state_dtypes\['momentum1'\]: expected one "
                                         r"of \[fp32, fp16, bf16\], got 'int8'"):
        fbtriton_dist.EmbeddingBagCollection(tables=configs,
                                             optimizer_state_dtypes={"momentum1": "int8"})
