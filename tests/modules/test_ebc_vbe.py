"""EmbeddingBagCollection on a KeyedJaggedTensor with a batch size per feature (VBE:
``stride_per_key_per_rank`` and ``inverse_indices``), against TorchRec's own EBC on the same
KJT: the expanded KeyedTensor, the gradients (dense), and the fused SGD / rowwise Adagrad /
Adam updates; and the bad inputs."""

import pytest
import torch
import torchrec
from torchrec import DataType, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import fbtriton_dist
from tests.conftest import TRITON_OK
from tests.helpers import device_for

BACKENDS = ["reference"] + (["triton"] if TRITON_OK else [])
B = 6  # samples; the user features have 2 users (3 candidates each)
KEYS = ["item", "user", "user_hist", "extra"]  # "extra": a key no table reads
STRIDES = {"item": 6, "user": 2, "user_hist": 2, "extra": 6}


def _configs(mean: bool = False, fp16: bool = False) -> list[EmbeddingBagConfig]:
    """Mixed dims; ``user`` read by two tables (``user@u1``, ``user@u2``); a one-row table."""
    pool = {"pooling": PoolingType.MEAN} if mean else {}
    return [
        EmbeddingBagConfig(name="item_t", embedding_dim=4, num_embeddings=20,
                           feature_names=["item"]),
        EmbeddingBagConfig(name="u1", embedding_dim=3, num_embeddings=9,
                           feature_names=["user", "user_hist"], **pool),
        EmbeddingBagConfig(name="u2", embedding_dim=2, num_embeddings=1, feature_names=["user"],
                           **({"data_type": DataType.FP16} if fp16 else {})),
    ]


def _vbe_kjt(seed: int, weighted: bool, dtype=torch.int64) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths, values = [], []
    for k in KEYS:
        n = torch.randint(0, 4, (STRIDES[k],), generator=g)
        n[0] = 0 if k == "user_hist" else n[0]  # an empty bag
        E = {"item": 20, "user": 1, "user_hist": 9, "extra": 1000}[k]
        lengths.append(n)
        values.append(torch.randint(0, E, (int(n.sum()),), generator=g))
    lengths, values = torch.cat(lengths), torch.cat(values)
    inverse = torch.stack([
        torch.arange(B),  # item: one bag per sample
        torch.arange(B) // 3,  # user: 3 candidates per user
        torch.arange(B) // 3,
        torch.arange(B),
    ])
    return KeyedJaggedTensor(
        keys=KEYS, values=values.to(dtype), lengths=lengths.to(dtype),
        weights=torch.rand(values.numel(), generator=g) + 0.5 if weighted else None,
        stride_per_key_per_rank=[[STRIDES[k]] for k in KEYS],
        inverse_indices=(KEYS, inverse),
    )


def _pair(weighted: bool, backend: str, mean: bool = False, fp16: bool = False):
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(tables=_configs(mean, fp16), is_weighted=weighted)
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs(mean, fp16), is_weighted=weighted,
                                                backend=backend, device=device_for(backend))
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("weighted", "mean", "fp16", "dtype"),
    [(False, True, False, torch.int64), (True, False, False, torch.int32),
     (False, False, True, torch.int64)],
)
def test_vbe_forward_and_gradients_match_torchrec(backend, weighted, mean, fp16, dtype):
    theirs, ours = _pair(weighted, backend, mean, fp16)
    kjt = _vbe_kjt(1, weighted, dtype)
    out_t = theirs(kjt)
    out_o = ours(kjt.to(torch.device(device_for(backend))))
    assert out_o.keys() == out_t.keys() == ["item", "user@u1", "user_hist", "user@u2"]
    tol = 1e-2 if fp16 else 1e-5
    torch.testing.assert_close(out_o.values().cpu(), out_t.values(), atol=tol, rtol=tol)
    grad = torch.randn(out_t.values().shape, generator=torch.Generator().manual_seed(2))
    out_t.values().backward(grad)
    out_o.values().backward(grad.to(out_o.values().device))
    for (n, a), (_, b) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad.cpu().float(), a.grad.float(), atol=tol, rtol=tol,
                                   msg=n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam"])
def test_vbe_fused_updates_match_torchrec(backend, opt):
    """3 steps of the fused optimizer (ours) against TorchRec's EBC with the same optimizer in
    backward. Ours is FBGEMM's lazy Adam (a row not in the batch is left alone), TorchRec's
    the dense torch Adam (it moves every row with momentum): the Adam case compares the rows
    that every step's batch holds."""
    theirs, ours = _pair(True, backend)
    cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.2}),
        "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}),
        "adam": (torch.optim.Adam, {"lr": 0.05, "eps": 1e-8}),
    }[opt]
    for m in (theirs, ours):
        apply_optimizer_in_backward(cls, m.parameters(), kwargs)
    in_every_batch = {n: torch.ones(p.shape[0], dtype=torch.bool)
                      for n, p in theirs.state_dict().items()}
    for step in range(3):
        kjt = _vbe_kjt(10 + step, True)
        for name, cfg in zip(in_every_batch, _configs(), strict=True):
            seen = torch.zeros_like(in_every_batch[name])
            for f in cfg.feature_names:
                seen[kjt[f].values()] = True
            in_every_batch[name] &= seen
        grad = torch.randn(B, 4 + 3 + 3 + 2, generator=torch.Generator().manual_seed(step))
        theirs(kjt).values().backward(grad)
        ours(kjt.to(torch.device(device_for(backend)))).values().backward(
            grad.to(device_for(backend)))
    assert all(rows.any() for rows in in_every_batch.values())
    for (n, a), (_, b) in zip(theirs.state_dict().items(), ours.state_dict().items(), strict=True):
        rows = in_every_batch[n] if opt == "adam" else slice(None)
        torch.testing.assert_close(b.cpu()[rows], a[rows], atol=1e-5, rtol=1e-5, msg=n)


def test_vbe_under_torch_compile_looks_up_eagerly_between_graphs():
    """``torch.compile`` of a model on VBE batches: the lookup runs eagerly (one graph break),
    outputs and fused rowwise Adagrad updates equal the eager module's bit for bit and
    TorchRec's within fp32 sums."""
    theirs, ours = _pair(True, "reference")
    eager = fbtriton_dist.EmbeddingBagCollection(tables=_configs(), is_weighted=True,
                                                 backend="reference")
    eager.load_state_dict(theirs.state_dict())
    for m in (theirs, ours, eager):
        apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, m.parameters(),
                                    {"lr": 0.2, "eps": 1e-8})
    torch._dynamo.reset()
    compiled = torch.compile(lambda kjt: ours(kjt).values() * 1.5, backend="aot_eager")
    for step in range(3):
        kjt = _vbe_kjt(20 + step, True)
        grad = torch.randn(B, 4 + 3 + 3 + 2, generator=torch.Generator().manual_seed(step))
        out_c, out_e, out_t = compiled(kjt), eager(kjt).values() * 1.5, theirs(kjt).values() * 1.5
        assert torch.equal(out_c, out_e), step
        torch.testing.assert_close(out_c, out_t, atol=1e-5, rtol=1e-5)
        for out in (out_c, out_e, out_t):
            out.backward(grad)
    for (n, a), (_, b), (_, c) in zip(ours.state_dict().items(), eager.state_dict().items(),
                                      theirs.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5, msg=n)


def test_vbe_bad_inputs_name_the_feature_and_bound():
    _, ours = _pair(False, "reference")
    kjt = _vbe_kjt(0, False)
    inverse = kjt.inverse_indices()[1].clone()
    inverse[1, 4] = 2  # user has 2 bags: rows 0..1
    bad = KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths(),
                            stride_per_key_per_rank=[[STRIDES[k]] for k in KEYS],
                            inverse_indices=(KEYS, inverse))
    with pytest.raises(ValueError, match=r"inverse_indices of feature 'user': rows in \[0, 2\], "
                                         r"outside its 2 bags"):
        ours(bad)
    no_inverse = KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths(),
                                   stride_per_key_per_rank=[[STRIDES[k]] for k in KEYS])
    with pytest.raises(ValueError, match="without inverse_indices"):
        ours(no_inverse)
    short = KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths()[:-1],
                              stride_per_key_per_rank=[[STRIDES[k]] for k in KEYS],
                              inverse_indices=kjt.inverse_indices())
    with pytest.raises(ValueError, match="add up to 16 bags, but lengths holds 15"):
        ours(short)
    lacking = KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=kjt.lengths(),
                                stride_per_key_per_rank=[[STRIDES[k]] for k in KEYS],
                                inverse_indices=(["item", "user"], inverse[:2]))
    with pytest.raises(ValueError, match=r"no row for features \['user_hist'\]"):
        ours(lacking)
    lengths = kjt.lengths().clone()  # user's first bag -1, item's first bag the rest: the
    lengths[0] += lengths[6] + 1     # lengths still add up to the values
    lengths[6] = -1
    negative = KeyedJaggedTensor(keys=KEYS, values=kjt.values(), lengths=lengths,
                                 stride_per_key_per_rank=[[STRIDES[k]] for k in KEYS],
                                 inverse_indices=kjt.inverse_indices())
    with pytest.raises(ValueError, match=r"feature 'user': lengths\[0\] = -1 \(bag 0 of 2\) "
                                         "is negative"):
        ours(negative)


def test_an_empty_vbe_batch_gives_no_rows_as_torchrec():
    """No samples at all (a rank of a VBE job with none this step): ``[0, sum(D)]``, as
    TorchRec's EBC; the strides differ per key, so it takes the VBE path."""
    kjt = KeyedJaggedTensor(
        keys=KEYS, values=torch.zeros(0, dtype=torch.int64),
        lengths=torch.zeros(0, dtype=torch.int64),
        stride_per_key_per_rank=[[0] for _ in KEYS],
        inverse_indices=(KEYS, torch.zeros(len(KEYS), 0, dtype=torch.int64)),
    )
    theirs = torchrec.EmbeddingBagCollection(tables=_configs())
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs())
    want, got = theirs(kjt), ours(kjt)
    assert got.keys() == want.keys()
    assert got.values().shape == want.values().shape == (0, 4 + 3 + 3 + 2)
