"""fbtriton_dist.EmbeddingBagCollection against torchrec.EmbeddingBagCollection built from the
same configs and state dict: outputs, gradients, torch-optimizer and fused-optimizer steps,
state dicts both ways, bad KJTs, variable batch size, torch.compile and DLRM."""

import copy

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_configs import DataType

import fbtriton_dist
from tests.conftest import TRITON_OK
from tests.helpers import device_for

BACKENDS = ["reference"] + (["triton"] if TRITON_OK else [])


def _configs(name: str) -> list[EmbeddingBagConfig]:
    cfg = EmbeddingBagConfig
    sets = {
        "two-tables": [
            cfg(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
            cfg(name="t2", embedding_dim=8, num_embeddings=6, feature_names=["f2"]),
        ],
        "shared-mixed-mean": [
            cfg(name="users", embedding_dim=3, num_embeddings=12, feature_names=["u1", "u2"]),
            cfg(
                name="item",
                embedding_dim=8,
                num_embeddings=1,
                feature_names=["i"],
                pooling=PoolingType.MEAN,
            ),
            cfg(name="geo", embedding_dim=5, num_embeddings=7, feature_names=["g"]),
        ],
        "fp16-and-fp32": [
            cfg(
                name="a",
                embedding_dim=4,
                num_embeddings=9,
                feature_names=["fa"],
                data_type=DataType.FP16,
            ),
            cfg(name="b", embedding_dim=6, num_embeddings=5, feature_names=["fb", "fc"]),
        ],
        "bf16-and-fp32": [
            cfg(
                name="c",
                embedding_dim=5,
                num_embeddings=11,
                feature_names=["fd", "fe"],
                data_type=DataType.BF16,
            ),
            cfg(name="d", embedding_dim=3, num_embeddings=4, feature_names=["ff"]),
        ],
    }
    return sets[name]


def _kjt(configs, B, *, weighted=False, seed=0, shuffle=True, cover_all_rows=False):
    """A KJT over every feature of ``configs`` (keys shuffled), with empty bags."""
    g = torch.Generator().manual_seed(seed)
    feats = [(f, c.num_embeddings) for c in configs for f in c.feature_names]
    if shuffle:
        feats = [feats[i] for i in torch.randperm(len(feats), generator=g).tolist()]
    lengths, values = [], []
    for _, E in feats:
        ls = torch.randint(0, 5, (B,), generator=g)
        if cover_all_rows:
            ls[0] += E
        ids = torch.randint(0, E, (int(ls.sum()),), generator=g)
        if cover_all_rows:
            ids[:E] = torch.arange(E)
        lengths.append(ls)
        values.append(ids)
    values = torch.cat(values)
    return KeyedJaggedTensor(
        keys=[f for f, _ in feats],
        values=values,
        lengths=torch.cat(lengths),
        weights=torch.rand(values.numel(), generator=g) + 0.5 if weighted else None,
    )


def _pair(name, backend, weighted=False):
    """TorchRec's unsharded EBC stores every non-FP32 table as fp16; a BF16 table's weights are
    therefore first rounded to bf16 (exact in fp16) so that both modules hold the same values."""
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(tables=_configs(name), is_weighted=weighted)
    with torch.no_grad():
        for c in _configs(name):
            if c.data_type == DataType.BF16:
                w = theirs.embedding_bags[c.name].weight
                w.copy_(w.to(torch.bfloat16))
    ours = fbtriton_dist.EmbeddingBagCollection(
        tables=_configs(name), is_weighted=weighted, device=device_for(backend), backend=backend
    )
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _to(kjt, device):
    return kjt.to(torch.device(device)) if device != "cpu" else kjt


def _grad(kt, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(kt.values().shape, generator=g)


# (atol, rtol) by the dtype of the table (our weights). fp32 tables agree to fp32 rounding.
# Outputs of FP16 and BF16 tables: TorchRec holds both as fp16 (see _pair) and pools in fp16, we
# pool in fp32. Gradients: fp16 as TorchRec's; ours of a BF16 table is rounded to bf16.
OUT_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-3, 2e-3)}
GRAD_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (8e-3, 8e-3)}
_DTYPE = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}


def _assert_close_by_dtype(actual, expected, tol, dtype, what):
    atol, rtol = tol[dtype]
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what} ({dtype}): {m}"
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name", ["two-tables", "shared-mixed-mean", "fp16-and-fp32", "bf16-and-fp32"]
)
def test_forward_and_gradients_match_torchrec(name, backend):
    weighted = name == "two-tables"  # TorchRec refuses weights with MEAN pooling
    theirs, ours = _pair(name, backend, weighted)
    kjt = _kjt(_configs(name), B=5, weighted=weighted)
    kt_t, kt_o = theirs(kjt), ours(_to(kjt, device_for(backend)))
    assert kt_o.keys() == kt_t.keys()
    assert kt_o.length_per_key() == kt_t.length_per_key()
    configs = {c.name: c for c in _configs(name)}
    dtype_of = {f: _DTYPE[c.data_type] for c in configs.values() for f in c.feature_names}
    out_t, out_o = kt_t.to_dict(), kt_o.to_dict()
    for f in kt_t.keys():  # each feature's columns at the tolerance of its table's dtype
        _assert_close_by_dtype(out_o[f].cpu(), out_t[f], OUT_TOL, dtype_of[f], f"output {f!r}")
    grad = _grad(kt_t, 0)
    kt_t.values().backward(grad)
    kt_o.values().backward(grad.to(kt_o.values().device))
    for (n_t, p_t), (n_o, p_o) in zip(
        theirs.named_parameters(), ours.named_parameters(), strict=True
    ):
        assert n_t == n_o
        assert p_o.dtype == _DTYPE[configs[n_o.split(".")[1]].data_type], n_o
        _assert_close_by_dtype(p_o.grad.float().cpu(), p_t.grad.float(), GRAD_TOL, p_o.dtype, n_o)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
def test_torch_optimizer_three_steps(opt, backend):
    theirs, ours = _pair("shared-mixed-mean", backend)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.5),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.5),
    }
    opts = [make[opt](m.parameters()) for m in (theirs, ours)]
    for step in range(3):
        kjt = _kjt(_configs("shared-mixed-mean"), B=4 + step, seed=step)
        for m, o in zip((theirs, ours), opts, strict=True):
            kt = m(_to(kjt, device_for(backend)) if m is ours else kjt)
            kt.values().backward(_grad(kt, step).to(kt.values().device))
            o.step()
            o.zero_grad()
    for (_, a), (_, b) in zip(theirs.state_dict().items(), ours.state_dict().items(), strict=True):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)


def _in_backward(name):
    from torchrec.optim import RowWiseAdagrad

    return {
        "sgd": (torch.optim.SGD, {"lr": 0.3}),
        "adagrad": (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-8}),
        "rowwise-adagrad": (RowWiseAdagrad, {"lr": 0.3, "eps": 1e-8}),
        "adam": (torch.optim.Adam, {"lr": 0.05}),
    }[name]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["two-tables", "shared-mixed-mean"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "rowwise-adagrad", "adam"])
def test_apply_optimizer_in_backward_runs_fused(opt, name, backend):
    """TorchRec users' annotation: TorchRec runs torch's optimizer on dense gradients in a
    hook; we run the fused TBE update. Every row is hit every step so that lazy (FBGEMM) Adam
    and dense torch Adam agree."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    theirs, ours = _pair(name, backend)
    cls, kwargs = _in_backward(opt)
    for m in (theirs, ours):
        apply_optimizer_in_backward(cls, m.parameters(), kwargs)
    for step in range(3):
        kjt = _kjt(_configs(name), B=3, seed=step, cover_all_rows=opt == "adam")
        for m in (theirs, ours):
            kt = m(_to(kjt, device_for(backend)) if m is ours else kjt)
            kt.values().backward(_grad(kt, step).to(kt.values().device))
    assert all(p.grad is None for p in ours.parameters())  # no dense gradient was built
    assert all(tbe.optimizer is not None for tbe in ours._tbes)
    for (_, a), (_, b) in zip(theirs.state_dict().items(), ours.state_dict().items(), strict=True):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-4)


def test_state_dict_round_trips_both_ways():
    theirs = torchrec.EmbeddingBagCollection(tables=_configs("shared-mixed-mean"))
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs("shared-mixed-mean"))
    assert (
        list(ours.state_dict())
        == list(theirs.state_dict())
        == [
            "embedding_bags.users.weight",
            "embedding_bags.item.weight",
            "embedding_bags.geo.weight",
        ]
    )
    assert [v.shape for v in ours.state_dict().values()] == [
        v.shape for v in theirs.state_dict().values()
    ]
    ours.load_state_dict(theirs.state_dict(), strict=True)
    kjt = _kjt(_configs("shared-mixed-mean"), B=3)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values())
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(2.0)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values())


def test_weights_rebound_after_assign_and_data_swap():
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs("two-tables"))
    theirs = torchrec.EmbeddingBagCollection(tables=_configs("two-tables"))
    ours.load_state_dict(theirs.state_dict(), assign=True)
    kjt = _kjt(_configs("two-tables"), B=3)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values())
    ours.embedding_bags["t2"].weight.data = torch.ones(6, 8)
    theirs.embedding_bags["t2"].weight.data = torch.ones(6, 8)
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values())


def test_configs_honoured_and_meta_device():
    calls = []
    cfgs = [
        EmbeddingBagConfig(
            name="x",
            embedding_dim=4,
            num_embeddings=50,
            feature_names=["fx"],
            weight_init_min=0.5,
            weight_init_max=0.6,
        ),
        EmbeddingBagConfig(
            name="y",
            embedding_dim=2,
            num_embeddings=3,
            feature_names=["fy"],
            init_fn=lambda w: calls.append(w.shape) or torch.nn.init.constant_(w, 7.0),
            data_type=DataType.BF16,
        ),
    ]
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=cfgs, is_weighted=True)
    w = ebc.embedding_bags["x"].weight
    assert w.min() >= 0.5 and w.max() <= 0.6
    assert calls == [torch.Size([3, 2])] and torch.all(ebc.embedding_bags["y"].weight == 7.0)
    assert ebc.embedding_bags["y"].weight.dtype == torch.bfloat16
    assert ebc.is_weighted() and ebc.embedding_bag_configs() is not None
    meta = fbtriton_dist.EmbeddingBagCollection(tables=_configs("two-tables"), device="meta")
    assert meta.embedding_bags["t1"].weight.is_meta


def test_variable_batch_size_and_key_order():
    theirs, ours = _pair("two-tables", "reference")
    for B, shuffle in ((3, True), (7, False), (1, True)):
        kjt = _kjt(_configs("two-tables"), B=B, seed=B, shuffle=shuffle)
        torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values())
        assert ours(kjt).values().shape[0] == B


@pytest.mark.parametrize(
    "keys, lengths, values, message",
    [
        (["f1"], [1, 0], [3], r"missing features \['f2'\]"),
        (["f1", "f2", "f1"], [1, 0, 1, 0, 0, 0], [3, 2], r"\['f1'\] more than once"),
        (
            ["f1", "f2"],
            [1, 2, 1, 0],
            [3, 2, 1],
            r"feature 'f2': lengths add up to 4 ids in all, but values holds 3",
        ),
        (  # the lengths add up to the values; only the sign of one is wrong
            ["f1", "f2"],
            [2, -1, 1, 1],
            [3, 2, 1],
            r"feature 'f1': lengths\[1\] = -1 \(bag 1 of 2\) is negative",
        ),
    ],
)
def test_bad_kjt_names_the_feature(keys, lengths, values, message):
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs("two-tables"))
    kjt = KeyedJaggedTensor(keys=keys, values=torch.tensor(values), lengths=torch.tensor(lengths))
    with pytest.raises(ValueError, match=message):
        ours(kjt)


def test_out_of_range_id_names_the_table():
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs("two-tables"))
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2"], values=torch.tensor([3, 6]), lengths=torch.tensor([1, 1])
    )
    with pytest.raises(IndexError, match=r"id 6 .* table 't2' with 6 rows"):
        ours(kjt)


def test_unsupported_in_backward_optimizer_is_refused():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs("two-tables"))
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.1, "momentum": 0.9})
    with pytest.raises(ValueError, match=r"momentum=0.9\) has no fused equivalent"):
        ours(_kjt(_configs("two-tables"), B=2))


class _Model(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.head = torch.nn.Linear(12, 1)

    def forward(self, kjt):
        return self.head(torch.relu(self.ebc(kjt).values())).sum()


def test_torch_compile_of_a_model_holding_it():
    """The EBC's lookup compiles as the registered op (tests/modules/test_ebc_tracing.py has
    fullgraph=True against TorchRec)."""
    torch.manual_seed(0)
    eager = _Model(fbtriton_dist.EmbeddingBagCollection(tables=_configs("two-tables")))
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    kjt = _kjt(_configs("two-tables"), B=4)
    loss_e, loss_c = eager(kjt), compiled(kjt)
    loss_e.backward()
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e)
    for (n, a), (_, b) in zip(
        eager.named_parameters(), compiled_model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(b.grad, a.grad, msg=n)


def test_dlrm_trains_and_matches_torchrec_step_by_step():
    from torchrec.models.dlrm import DLRM

    D, dense_in = 8, 5
    cfgs = lambda: [  # noqa: E731
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=E, feature_names=[f"f{i}"])
        for i, E in enumerate([20, 7, 33])
    ]
    torch.manual_seed(0)
    ref = DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=cfgs()),
        dense_in_features=dense_in,
        dense_arch_layer_sizes=[16, D],
        over_arch_layer_sizes=[16, 1],
    )
    ours = DLRM(
        embedding_bag_collection=fbtriton_dist.EmbeddingBagCollection(tables=cfgs()),
        dense_in_features=dense_in,
        dense_arch_layer_sizes=[16, D],
        over_arch_layer_sizes=[16, 1],
    )
    ours.load_state_dict(ref.state_dict(), strict=True)
    opts = [torch.optim.Adagrad(m.parameters(), lr=0.1) for m in (ref, ours)]
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(dense_in, generator=g)
    losses = {id(ref): [], id(ours): []}
    for step in range(50):
        dense = torch.randn(64, dense_in, generator=g)
        kjt = _kjt(cfgs(), B=64, seed=step)
        labels = ((dense @ w_true) > 0).float()
        for m, o in zip((ref, ours), opts, strict=True):
            logits = m(dense, kjt).squeeze(1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
            o.zero_grad()
            loss.backward()
            o.step()
            losses[id(m)].append(loss.item())
    torch.testing.assert_close(
        torch.tensor(losses[id(ours)]), torch.tensor(losses[id(ref)]), atol=1e-4, rtol=1e-4
    )
    first, last = sum(losses[id(ours)][:10]) / 10, sum(losses[id(ours)][-10:]) / 10
    assert last < 0.8 * first, (first, last)


def test_to_and_half_rebind_the_tables():
    theirs, ours = _pair("two-tables", "reference")
    kjt = _kjt(_configs("two-tables"), B=3)
    ours.half()
    assert all(p.dtype == torch.float16 for p in ours.parameters())
    assert ours._tbes[0].weights.dtype == torch.float16
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), atol=2e-3, rtol=2e-3)
    ours.float()
    kt = ours(kjt)
    kt.values().sum().backward()
    assert ours.embedding_bags["t1"].weight.grad is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_move_runs_triton():
    theirs, _ = _pair("shared-mixed-mean", "reference")
    ours = fbtriton_dist.EmbeddingBagCollection(tables=_configs("shared-mixed-mean"))  # auto
    ours.load_state_dict(theirs.state_dict())
    ours = ours.cuda()
    assert ours._tbes[0].resolved_backend() == "triton"
    kjt = _kjt(_configs("shared-mixed-mean"), B=4)
    torch.testing.assert_close(
        ours(kjt.to(torch.device("cuda"))).values().cpu(), theirs(kjt).values()
    )


def test_kjt_reorder_matches_torchrec_permute_with_weights_and_repeats():
    from fbtriton_dist.sparse import kjt_to_batch

    kjt = _kjt(_configs("shared-mixed-mean"), B=4, weighted=True, seed=3)
    names = ["g", "u1", "i", "u2", "u1"]  # any order, one feature twice
    batch = kjt_to_batch(kjt, names, weighted=True)
    expected = kjt.permute([kjt.keys().index(f) for f in names])
    assert torch.equal(batch.indices, expected.values())
    assert torch.equal(batch.per_sample_weights, expected.weights())
    assert torch.equal(batch.offsets, expected.offsets())
    assert batch.batch_size == 4


def test_fused_optimizer_state_dict_round_trip():
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    def build():
        ebc = fbtriton_dist.EmbeddingBagCollection(tables=_configs("two-tables"))
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
        return ebc

    a = build()
    for step in range(2):
        a(_kjt(_configs("two-tables"), B=3, seed=step)).values().sum().backward()
    state = a.fused_optimizer_state_dict()
    assert sorted(state) == ["embedding_bags.t1.weight.0", "embedding_bags.t2.weight.0", "step"]
    assert state["embedding_bags.t1.weight.0"].shape == (10, 1) and int(state["step"]) == 2
    b = build()
    b.load_state_dict(a.state_dict())
    mine = b.fused_optimizer_state_dict()
    for k, v in state.items():
        mine[k].copy_(v)  # what torch.distributed.checkpoint does in place
    b.load_fused_optimizer_state_dict(mine)
    kjt = _kjt(_configs("two-tables"), B=3, seed=9)
    for m in (a, b):
        m(kjt).values().sum().backward()
    for (_, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(y, x, atol=0, rtol=0)
