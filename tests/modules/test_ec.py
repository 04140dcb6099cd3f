"""EmbeddingCollection against torchrec.EmbeddingCollection on the same inputs: construction
and state dicts, outputs (keys, values, lengths, offsets, need_indices), plain gradients and
torch optimizers, fused SGD / rowwise Adagrad / Adam through apply_optimizer_in_backward, over
shared features, empty sequences, hot ids, int32/int64 ids and fp16 weights; every backend;
mixed dims and a batch size per key (ours only); bad input."""

import copy

import pytest
import torch
import torchrec
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import DataType, EmbeddingConfig, KeyedJaggedTensor

import fbtriton_dist
from tests.conftest import TRITON_OK
from tests.helpers import device_for

BACKENDS = ["cpu", "reference"] + (["triton"] if TRITON_OK else [])


def _tables(dtype=DataType.FP32, dims=(8, 8, 8)):
    return [
        EmbeddingConfig(name="item", embedding_dim=dims[0], num_embeddings=40,
                        feature_names=["history", "target"], data_type=dtype),
        EmbeddingConfig(name="users", embedding_dim=dims[1], num_embeddings=1,
                        feature_names=["user"], data_type=dtype),
        EmbeddingConfig(name="shared", embedding_dim=dims[2], num_embeddings=7,
                        feature_names=["history"], data_type=dtype),  # history@item, @shared
    ]


def _kjt(B=4, seed=0, id_dtype=torch.int64, hot=False):
    """Keys in another order than the tables', an unused key, empty sequences."""
    g = torch.Generator().manual_seed(seed)
    keys, rows = ["user", "target", "unused", "history"], [1, 40, 100, 7]
    lengths = torch.randint(0, 5, (len(keys), B), generator=g)
    lengths[0, 1] = 0
    lengths[3, 0] = 0
    values = []
    for k, E in enumerate(rows):
        n = int(lengths[k].sum())
        ids = torch.randint(0, E, (n,), generator=g)
        if hot:
            ids[torch.rand(n, generator=g) < 0.5] = 0
        values.append(ids)
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values).to(id_dtype),
                             lengths=lengths.flatten().to(id_dtype))


def _pair(tables, backend="cpu", need_indices=False):
    """TorchRec's (on the CPU) and ours (Triton on the GPU when there is one), same weights."""
    torch.manual_seed(3)
    theirs = torchrec.EmbeddingCollection(tables=copy.deepcopy(tables), need_indices=need_indices)
    torch.manual_seed(3)
    ours = fbtriton_dist.EmbeddingCollection(tables=copy.deepcopy(tables), backend=backend,
                                             need_indices=need_indices)
    return theirs, ours.to(device_for(backend))


def _run(ours, kjt) -> dict:
    """``ours(kjt)`` on ours' device, the JaggedTensors back on the CPU (differentiably)."""
    out = ours(kjt.to(ours.device))
    return {k: jt.to(torch.device("cpu")) for k, jt in out.items()}


def _loss(out: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    return sum((jt.values().float() * torch.randn(jt.values().shape, generator=g)).sum()
               for jt in out.values())


def test_seeded_build_and_state_dicts_load_strictly_both_ways():
    theirs, ours = _pair(_tables())
    a, b = theirs.state_dict(), ours.state_dict()
    assert list(a) == list(b) == ["embeddings.item.weight", "embeddings.users.weight",
                                  "embeddings.shared.weight"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    other = fbtriton_dist.EmbeddingCollection(tables=_tables())
    other.load_state_dict(a, strict=True)
    theirs.load_state_dict(other.state_dict(), strict=True)
    assert ours.embedding_names_by_table() == theirs.embedding_names_by_table()
    assert ours.embedding_dim() == theirs.embedding_dim() == 8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("need_indices", [False, True])
def test_outputs_and_gradients_match_torchrec(backend, id_dtype, need_indices):
    theirs, ours = _pair(_tables(), backend, need_indices)
    kjt = _kjt(id_dtype=id_dtype, hot=True)
    out_t, out_o = theirs(kjt), _run(ours, kjt)
    assert list(out_t) == list(out_o) == ["history@item", "target", "user", "history@shared"]
    for k, jt in out_t.items():
        mine = out_o[k]
        assert mine.values().dtype == torch.float32
        torch.testing.assert_close(mine.values(), jt.values())
        assert torch.equal(mine.lengths(), jt.lengths()) and torch.equal(mine.offsets(),
                                                                           jt.offsets())
        if need_indices:
            assert torch.equal(mine.weights(), jt.weights())
        else:
            assert mine.weights_or_none() is None
    _loss(out_t).backward()
    _loss(out_o).backward()
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(mine[name].grad.cpu(), p.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, cls", [(DataType.FP32, torch.optim.Adagrad),
                                        (DataType.FP16, torch.optim.SGD)], ids=["fp32", "fp16"])
def test_a_torch_optimizer_trains_it_like_torchrec(backend, dtype, cls):
    """Three steps of a torch optimizer on the plain parameters (torch's Adagrad on fp16
    parameters divides by an fp16 zero, so fp16 takes SGD)."""
    theirs, ours = _pair(_tables(dtype), backend)
    opts = [cls(m.parameters(), lr=0.1) for m in (theirs, ours)]
    for step in range(3):
        kjt = _kjt(seed=step, hot=True)
        for m, opt in zip((theirs, ours), opts, strict=True):
            _loss(m(kjt) if m is theirs else _run(m, kjt)).backward()
            opt.step()
            opt.zero_grad()
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k].cpu(), v, atol=2e-3, rtol=2e-3)


FUSED = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
    "adam": (torch.optim.Adam, {"lr": 0.05}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_optimizer_matches_torchrec_with_the_same_optimizer(backend, name):
    """apply_optimizer_in_backward on both: ours fuses the update into the TBE backward,
    TorchRec's steps each table's torch optimizer. Adam is compared on batches that touch
    every row (ours is lazy, FBGEMM's convention: rows a batch misses keep their moments)."""
    cls, kwargs = FUSED[name]
    theirs, ours = _pair(_tables(), backend)
    for m in (theirs, ours):
        _apply_optimizer_in_backward(cls, m.parameters(), kwargs)
    ours_tbe = ours._tbes[0]
    for step in range(3):
        kjt = _kjt(seed=step, hot=True)
        if name == "adam":
            every = {"user": 1, "target": 40, "unused": 0, "history": 7}
            kjt = KeyedJaggedTensor(
                keys=list(every),
                values=torch.cat([torch.arange(n) for n in every.values()]),
                lengths=torch.tensor([n for n in every.values()]),  # one sample: every row
            )
        _loss(theirs(kjt)).backward()
        _loss(_run(ours, kjt)).backward()
    assert ours_tbe.optimizer is not None and ours_tbe.step == 3
    for k, v in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k].cpu(), v, atol=1e-5, rtol=1e-5)
    assert all(p.grad is None for p in ours.parameters())


def test_mixed_dims_and_a_batch_size_per_key():
    """Ours allows tables of different dims (TorchRec's does not) and a KJT whose keys have
    different numbers of samples: each feature's rows are F.embedding of its ids."""
    tables = _tables(dims=(8, 4, 12))
    ours = fbtriton_dist.EmbeddingCollection(tables=tables)
    with pytest.raises(ValueError, match="different dims"):
        ours.embedding_dim()
    kjt = KeyedJaggedTensor(
        keys=["user", "target", "history"],
        values=torch.tensor([0, 5, 6, 39, 1, 2, 3, 4, 0]),
        lengths=torch.tensor([1, 2, 1, 0, 3, 2]),
        stride_per_key_per_rank=[[1], [3], [2]],
        inverse_indices=(["user", "target", "history"],
                         torch.tensor([[0, 0, 0], [0, 1, 2], [0, 1, 1]])),
    )
    out = ours(kjt)
    w = {cfg.name: ours.embeddings[cfg.name].weight for cfg in tables}
    expect = {
        "user": (w["users"], [0], [1]),
        "target": (w["item"], [5, 6, 39], [2, 1, 0]),
        "history@item": (w["item"], [1, 2, 3, 4, 0], [3, 2]),
        "history@shared": (w["shared"], [1, 2, 3, 4, 0], [3, 2]),
    }
    for key, (table, ids, lengths) in expect.items():
        torch.testing.assert_close(out[key].values(), table[torch.tensor(ids)])
        assert out[key].lengths().tolist() == lengths


def test_meta_build_then_to_empty_and_reset():
    with torch.device("meta"):
        ours = fbtriton_dist.EmbeddingCollection(tables=_tables())
    assert ours.embeddings["item"].weight.is_meta
    ours.to_empty(device="cpu")
    ours.reset_parameters()
    w = ours.embeddings["item"].weight
    assert not w.is_meta and float(w.abs().max()) <= 1.0 / 40**0.5 + 1e-6
    out = ours(_kjt())
    torch.testing.assert_close(out["target"].values(), w[_kjt().to_dict()["target"].values()])


def test_bad_input_is_named():
    ours = fbtriton_dist.EmbeddingCollection(tables=_tables())
    kjt = _kjt()
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().clone(), lengths=kjt.lengths())
    bad.values()[0] = 1  # a "user" id: that table has one row
    with pytest.raises(IndexError, match=r"id 1 .*feature 'user'.*table 'users' with 1 rows"):
        ours(bad)
    with pytest.raises(ValueError, match=r"missing features \['user'\]"):
        ours(KeyedJaggedTensor(keys=["target", "history"], values=torch.tensor([1, 2]),
                               lengths=torch.tensor([1, 0, 1, 0])))
    with pytest.raises(ValueError, match="lengths add up to 3 ids in all, but values holds 2"):
        ours(KeyedJaggedTensor(keys=["user", "target", "history"], values=torch.tensor([0, 2]),
                               lengths=torch.tensor([1, 1, 1])))
    with pytest.raises(ValueError, match=r"feature 'target': lengths\[0\] = -1 \(bag 0 of 1\) "
                                         "is negative"):  # adds up to the values all the same
        ours(KeyedJaggedTensor(keys=["user", "target", "history"], values=torch.tensor([0, 0]),
                               lengths=torch.tensor([2, -1, 1])))
