"""KJT semantics of fbtriton_dist.EmbeddingBagCollection against torchrec's on the same inputs:
keys no table uses, a feature two tables share (``feature@table``), duplicated and missing keys,
non-finite per-sample weights, and seeded initialisation in TorchRec's order."""

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

import fbtriton_dist
from tests.conftest import TRITON_OK
from tests.helpers import device_for

BACKENDS = ["reference"] + (["triton"] if TRITON_OK else [])


def _shared(dtype=DataType.FP32):
    """Feature 's' read by two tables (and feature 'a' twice by one table in ``_twice``)."""
    c = EmbeddingBagConfig
    return [
        c(name="t1", num_embeddings=5, embedding_dim=2, feature_names=["a", "s"]),
        c(name="t2", num_embeddings=6, embedding_dim=3, feature_names=["s", "b"], data_type=dtype),
        c(name="t3", num_embeddings=4, embedding_dim=1, feature_names=["c"]),
    ]


def _kjt(keys, B, *, seed=0, weighted=False, E=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(keys) * B,), generator=g)
    values = torch.randint(0, E, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _pair(configs, backend, weighted=False):
    theirs = torchrec.EmbeddingBagCollection(tables=configs(), is_weighted=weighted)
    ours = fbtriton_dist.EmbeddingBagCollection(
        tables=configs(), is_weighted=weighted, device=device_for(backend), backend=backend
    )
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _same_output(theirs, ours, kjt, backend):
    kt_t = theirs(kjt)
    kt_o = ours(kjt.to(torch.device(device_for(backend))))
    assert kt_o.keys() == kt_t.keys()
    assert kt_o.length_per_key() == kt_t.length_per_key()
    torch.testing.assert_close(kt_o.values().cpu(), kt_t.values(), atol=1e-6, rtol=1e-6)
    return kt_o


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_no_table_uses_are_ignored(backend):
    theirs, ours = _pair(_shared, backend, weighted=True)
    # extra keys first, between and last; their ids are out of every table's range
    kjt = _kjt(["zz", "s", "x", "a", "b", "c", "y"], B=3, weighted=True, E=4)
    values = kjt.values().clone()
    ends = kjt.length_per_key()
    first = [sum(ends[:k]) for k in range(len(ends))]
    for k in (0, 2, 6):
        values[first[k] : first[k] + ends[k]] = 1000
    kjt = KeyedJaggedTensor(keys=kjt.keys(), values=values, lengths=kjt.lengths(),
                            weights=kjt.weights())
    out = _same_output(theirs, ours, kjt, backend)
    assert out.keys() == ["a", "s@t1", "s@t2", "b", "c"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_feature_is_named_feature_at_table(backend):
    theirs, ours = _pair(_shared, backend)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    out = _same_output(theirs, ours, _kjt(["c", "b", "s", "a"], B=4, seed=1), backend)
    assert out.keys() == ["a", "s@t1", "s@t2", "b", "c"]
    assert out.length_per_key() == [2, 2, 3, 3, 1]
    # gradients reach both tables from the one key
    out.values().sum().backward()
    grads = [ours.embedding_bags[t].weight.grad for t in ("t1", "t2")]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_feature_listed_twice_by_one_table_is_named_as_torchrec():
    def twice():
        c = EmbeddingBagConfig
        return [c(name="t1", num_embeddings=5, embedding_dim=2, feature_names=["a", "a"]),
                c(name="t2", num_embeddings=4, embedding_dim=3, feature_names=["b"])]

    theirs, ours = _pair(twice, "reference")
    out = _same_output(theirs, ours, _kjt(["b", "a"], B=2, seed=2), "reference")
    assert out.keys() == ["a@t1", "a@t1", "b"]


@pytest.mark.parametrize(
    "keys, message",
    [
        (["a", "s", "a", "b", "c"], r"expected each key once, got \['a'\] more than once"),
        (["s", "a", "x"], r"missing features \['b', 'c'\]"),
    ],
)
def test_duplicated_and_missing_keys_say_so(keys, message):
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_shared())
    with pytest.raises(ValueError, match=message):
        ours(_kjt(keys, B=2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_naming_the_feature(backend, bad):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    theirs, ours = _pair(_shared, backend, weighted=True)
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.5})
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    keys = ["a", "s", "b", "c"]
    lengths = torch.tensor([1, 1, 1, 1, 2, 1, 1, 1])  # B=2; feature 'b' sample 0 has 2 ids
    weights = torch.ones(9)
    weights[5] = bad  # the second id of bag ('b', 0)
    kjt = KeyedJaggedTensor(keys=keys, values=torch.zeros(9, dtype=torch.int64),
                            lengths=lengths, weights=weights)
    with pytest.raises(ValueError, match=r"feature 'b' of table 't2', sample 0\): expected finite"):
        ours(kjt.to(torch.device(device_for(backend)))).values().sum().backward()
    for k, v in ours.state_dict().items():  # nothing was updated
        assert torch.equal(v, before[k]), k
    # the same batch, finite, goes through; a NaN weight on a key no table uses is ignored
    weights[5] = 1.0
    extra = KeyedJaggedTensor(keys=[*keys, "x"], values=torch.zeros(10, dtype=torch.int64),
                              lengths=torch.cat([lengths, torch.tensor([1, 0])]),
                              weights=torch.cat([weights, torch.tensor([bad])]))
    _same_output(theirs, ours, extra, backend)


def test_non_finite_weights_pass_without_the_check():
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_shared(), is_weighted=True,
                                                bounds_check="ignore", backend="reference")
    kjt = _kjt(["a", "s", "b", "c"], B=2, weighted=True)
    w = kjt.weights().clone()
    w[0] = float("nan")
    kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=w)
    assert ours(kjt).values().isnan().any()


@pytest.mark.parametrize("dtype", [DataType.FP32, DataType.FP16])
def test_seeded_init_equals_torchrec_bit_for_bit(dtype):
    """TorchRec's EBC builds an nn.EmbeddingBag per table (an N(0, 1) draw each), then runs
    every table's init_fn; ours draws the same, in the same order, and nothing else."""
    torch.manual_seed(123)
    theirs = torchrec.EmbeddingBagCollection(tables=_shared(dtype))
    after_theirs = torch.rand(4)
    torch.manual_seed(123)
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_shared(dtype))
    after_ours = torch.rand(4)
    assert torch.equal(after_ours, after_theirs)  # the global RNG is left where TorchRec leaves it
    for name, w in theirs.state_dict().items():
        assert ours.state_dict()[name].dtype == w.dtype
        assert torch.equal(ours.state_dict()[name], w), name


def test_seeded_init_with_a_bf16_table_keeps_the_stream():
    """TorchRec 1.8 stores a BF16 table as fp16; ours keeps bf16, drawn by torch's bf16 kernels
    (other values). The draws stay in step: every other table and what follows match."""
    torch.manual_seed(5)
    theirs = torchrec.EmbeddingBagCollection(tables=_shared(DataType.BF16))
    after_theirs = torch.rand(4)
    torch.manual_seed(5)
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_shared(DataType.BF16))
    assert torch.equal(torch.rand(4), after_theirs)
    assert ours.embedding_bags["t2"].weight.dtype == torch.bfloat16
    for name in ("t1", "t3"):
        assert torch.equal(ours.embedding_bags[name].weight, theirs.embedding_bags[name].weight)


def test_seeded_init_with_init_fn():
    def configs():
        c = EmbeddingBagConfig
        return [c(name="n", num_embeddings=6, embedding_dim=4, feature_names=["f"],
                  init_fn=lambda w: torch.nn.init.normal_(w, std=0.1)),
                c(name="u", num_embeddings=3, embedding_dim=2, feature_names=["g"],
                  weight_init_min=-2.0, weight_init_max=2.0)]

    torch.manual_seed(9)
    theirs = torchrec.EmbeddingBagCollection(tables=configs())
    torch.manual_seed(9)
    ours = fbtriton_dist.EmbeddingBagCollection(tables=configs())
    for name, w in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], w), name
