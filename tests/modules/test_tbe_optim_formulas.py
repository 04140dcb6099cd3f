"""The fused optimizers FBGEMM's CPU TBE lacks against their update formulas, written here
again, row by row in float64 (not the reference module): partial-rowwise Adam, LAMB,
partial-rowwise LAMB and LARS-SGD (fbgemm-gpu-cpu 1.8.0's CPU TBE refuses each: "Optimizer ...
is not supported in CPU mode"; FBGEMM has them on CUDA only, whose formulas these are) and
FTRL-Proximal (not in FBGEMM: McMahan et al. 2013, Algorithm 1).

Each case runs 3 steps over mixed D, duplicate (hot) ids, empty bags and per-sample weights on
every backend (the Triton kernels interpreted on CPU): the gradient of each table comes from
``torch.nn.functional.embedding_bag`` with autograd, duplicate ids summed by it; each row of
the batch gets one update, the others none (states too)."""

import math

import pytest
import torch
import torch.nn.functional as F

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for, make_batch, to, upstream_grad

TABLES, FTM, B, MAX_L = [(10, 3), (7, 8), (1, 5), (6, 4)], [0, 1, 0, 2, 3], 4, 5

OPTS = {
    "partial_rowwise_adam": optim.PartialRowWiseAdam(lr=0.05, betas=(0.8, 0.95), eps=1e-6,
                                                     weight_decay=0.02),
    "lamb": optim.LAMB(lr=0.05, betas=(0.85, 0.9), eps=1e-6, weight_decay=0.01),
    "partial_rowwise_lamb": optim.PartialRowWiseLAMB(lr=0.05, betas=(0.7, 0.99), eps=1e-5,
                                                     weight_decay=0.03),
    "lars_sgd": optim.LarsSGD(lr=0.5, eta=0.02, momentum=0.8, weight_decay=0.01),
    "lars_sgd-no-decay": optim.LarsSGD(lr=0.3, eta=0.05, momentum=0.0),
    "ftrl": optim.FTRL(lr=0.2, beta=0.5, l1=0.01, l2=0.1),
    "ftrl-plain": optim.FTRL(lr=0.1),
}


def row_update(name, opt, w, g, t, m, v):
    """One row's update by the formula (float64 rows ``w``, ``g`` [D]; states ``m`` [D] and
    ``v`` [D] or a one-element tensor); returns (w, m, v)."""
    if name.startswith("ftrl"):  # m is z, v is n, per coordinate
        n_new = v + g * g
        sigma = (n_new.sqrt() - v.sqrt()) / opt.lr
        z = m + g - sigma * w
        w = -(z - z.sign() * opt.l1) / ((opt.beta + n_new.sqrt()) / opt.lr + opt.l2)
        return torch.where(z.abs() <= opt.l1, 0.0, w), z, n_new
    if name.startswith("lars_sgd"):
        w_norm, g_norm = w.norm(), g.norm()
        denom = g_norm + opt.weight_decay * w_norm
        rate = opt.lr * opt.eta * w_norm / denom if denom > 0 else 0.0
        m = opt.momentum * m + rate * (g + opt.weight_decay * w)
        return w - m, m, v
    b1, b2 = opt.betas
    m = b1 * m + (1 - b1) * g
    if name.startswith("partial_rowwise"):
        v = b2 * v + (1 - b2) * (g * g).mean()  # one value for the row
    else:
        v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    r = m_hat / (v_hat.sqrt() + opt.eps) + opt.weight_decay * w
    if name.endswith("adam"):
        return w - opt.lr * r, m, v
    ratio = w.norm() / r.norm() if r.norm() > 0 else 0.0  # LAMB's trust ratio
    return w - opt.lr * ratio * r, m, v


def table_grads(weights, batch, pooling):
    """Each table's [E, D] float64 gradient of the pooled output (embedding_bag, autograd)
    for upstream gradient ``up``, and the rows each table's features touched."""
    indices, offsets, psw, up = batch
    params = [w.detach().double().requires_grad_() for w in weights]
    outs, touched = [], [set() for _ in TABLES]
    for f, t in enumerate(FTM):
        o = offsets[f * B : (f + 1) * B + 1]
        ids = indices[o[0] : o[-1]]
        touched[t].update(ids.tolist())
        w_f = psw[o[0] : o[-1]].double() if psw is not None else None
        pooled = F.embedding_bag(ids, params[t], o[:-1] - o[0], mode="sum", per_sample_weights=w_f)
        if pooling == "mean":
            pooled = pooled / (o[1:] - o[:-1]).clamp(min=1)[:, None]
        outs.append(pooled)
    torch.cat(outs, dim=1).backward(up.double())
    return [p.grad for p in params], touched


def _expected(name, opt, w0, batches, pooling, dtype):
    """The tables' weights and states after the batches, by ``row_update``."""
    weights = [w.double() for w in w0]
    per_row_v = name.startswith("partial_rowwise")
    m = [torch.zeros(E, D, dtype=torch.float64) for E, D in TABLES]
    v = [torch.zeros(E, 1 if per_row_v else D, dtype=torch.float64) for E, D in TABLES]
    for t_step, batch in enumerate(batches, start=1):
        grads, touched = table_grads(weights, batch, pooling)
        for t in range(len(TABLES)):
            for row in sorted(touched[t]):
                w, mm, vv = row_update(name, opt, weights[t][row], grads[t][row], t_step,
                                        m[t][row], v[t][row])
                weights[t][row], m[t][row], v[t][row] = w, mm, vv
            # the module's rows are rounded to its dtype after every step
            weights[t] = weights[t].to(dtype).double()
    return weights, m, v


CASES = [
    # (optimizer, pooling, weights dtype, weighted, hot)
    ("partial_rowwise_adam", "sum", torch.float32, True, True),
    ("partial_rowwise_adam", "mean", torch.float16, False, True),
    ("lamb", "sum", torch.float32, True, True),
    ("lamb", "mean", torch.bfloat16, True, False),
    ("partial_rowwise_lamb", "sum", torch.float32, False, True),
    ("partial_rowwise_lamb", "mean", torch.float32, True, True),
    ("lars_sgd", "sum", torch.float32, True, True),
    ("lars_sgd", "sum", torch.float16, False, True),
    ("lars_sgd-no-decay", "mean", torch.float32, True, False),
    ("ftrl", "sum", torch.float32, True, True),
    ("ftrl", "mean", torch.float16, False, True),
    ("ftrl-plain", "sum", torch.float32, False, False),
]
TOL = {torch.float32: 2e-5, torch.float16: 8e-3, torch.bfloat16: 3e-2}


def _id(case):
    name, pooling, dtype, weighted, hot = case
    return "-".join([name, pooling, str(dtype)[6:]] + (["weighted"] if weighted else [])
                    + (["hot"] if hot else []))


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_the_update_formula(case, backend):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    name, pooling, dtype, weighted, hot = case
    opt = OPTS[name]
    dev = device_for(backend)
    torch.manual_seed(3)
    tbe = TableBatchedEmbedding(TABLES, FTM, pooling=pooling, optimizer=opt, weights_dtype=dtype,
                                backend=backend, device=dev, stochastic_rounding=False)
    w0 = [w.detach().cpu().clone() for w in tbe.split_embedding_weights()]
    g = torch.Generator().manual_seed(17)
    batches = []
    for step in range(3):
        indices, offsets, psw = make_batch(TABLES, FTM, B, MAX_L, weighted=weighted, hot=hot,
                                           generator=g)
        out = tbe(*to(dev, indices, offsets, psw))
        up = upstream_grad(out, step)
        out.backward(up.to(out.dtype))
        batches.append((indices, offsets, psw, up.cpu().to(out.dtype).float()))
    assert int(offsets.diff().eq(0).sum()) > 0  # some bags are empty
    weights, m, v = _expected(name, opt, w0, batches, pooling, dtype)
    tol = TOL[dtype]
    for ours, theirs, before in zip(tbe.split_embedding_weights(), weights, w0, strict=True):
        torch.testing.assert_close(ours.detach().cpu().double(), theirs, atol=tol, rtol=tol)
        moved = (ours.detach().cpu() != before).any(dim=1)
        assert moved.any()
    states = tbe.split_optimizer_states()
    for t, (E, D) in enumerate(TABLES):
        torch.testing.assert_close(states[t][0].cpu().double().reshape(E, D), m[t],
                                   atol=1e-4 if dtype != torch.float32 else 1e-5, rtol=1e-3)
        if len(states[t]) > 1:
            torch.testing.assert_close(states[t][1].cpu().double().reshape(v[t].shape), v[t],
                                       atol=1e-4 if dtype != torch.float32 else 1e-6, rtol=1e-3)
    assert tbe.step == 3


def test_untouched_rows_and_states_stay():
    """Rows not in the batch keep their values and states (lazy), on every step."""
    opt = OPTS["lamb"]
    tbe = TableBatchedEmbedding([(6, 4)], optimizer=opt, backend="cpu")
    before = tbe.split_embedding_weights()[0].detach().clone()
    for _ in range(3):
        out = tbe(torch.tensor([1, 1, 4]), torch.tensor([0, 2, 3]))
        out.backward(torch.ones_like(out))
    after = tbe.split_embedding_weights()[0].detach()
    rest = [0, 2, 3, 5]
    assert torch.equal(after[rest], before[rest])
    assert not torch.equal(after[[1, 4]], before[[1, 4]])
    m, v = tbe.split_optimizer_states()[0]
    assert not m[rest].any() and not v[rest].any() and m[[1, 4]].all()


@pytest.mark.parametrize("name", ["partial_rowwise_adam", "lamb", "partial_rowwise_lamb"])
def test_configs_refuse_bad_values(name):
    cls = optim.spec(name).config
    owner = cls.__name__
    with pytest.raises(ValueError, match=rf"{owner}.lr: expected a number >= 0, got -0.1"):
        cls(lr=-0.1)
    with pytest.raises(ValueError, match=rf"{owner}.eps: expected a number > 0, got 0.0"):
        cls(eps=0.0)
    for betas in [(1.0, 0.9), (0.9, -0.1), (0.9,)]:
        with pytest.raises(ValueError, match=rf"{owner}.betas: expected two numbers in \[0, 1\)"):
            cls(betas=betas)
    with pytest.raises(ValueError, match=rf"{owner}.weight_decay: expected a number >= 0"):
        cls(weight_decay=-1.0)


def test_lars_config_refuses_bad_values():
    with pytest.raises(ValueError, match=r"LarsSGD.lr: expected a number >= 0, got -1"):
        optim.LarsSGD(lr=-1)
    with pytest.raises(ValueError, match=r"LarsSGD.eta: expected a number >= 0"):
        optim.LarsSGD(eta=-0.1)
    with pytest.raises(ValueError, match=r"LarsSGD.momentum: expected a number in \[0, 1\), "):
        optim.LarsSGD(momentum=1.0)
    with pytest.raises(ValueError, match=r"LarsSGD.weight_decay: expected a number >= 0"):
        optim.LarsSGD(weight_decay=-0.5)


def test_ftrl_config_refuses_bad_values():
    with pytest.raises(ValueError, match=r"FTRL.lr: expected a number > 0, got -0.1"):
        optim.FTRL(lr=-0.1)
    with pytest.raises(ValueError, match=r"FTRL.lr: expected a number > 0, got 0"):
        optim.FTRL(lr=0)
    for field in ("beta", "l1", "l2"):
        with pytest.raises(ValueError, match=rf"FTRL.{field}: expected a number >= 0, got -1"):
            optim.FTRL(**{field: -1})


def test_planner_and_job_read_the_new_entries():
    from fbtriton_dist.planner import OPTIMIZERS, state_bytes
    from fbtriton_dist.train.config import EmbeddingOptimizerConfig, FieldError
    from fbtriton_dist.train.job import _embedding_optimizer

    E, D = 10, 8
    expected_bytes = {
        "partial_rowwise_adam": 4 * E * D + 4 * E,  # m per element, v per row
        "lamb": 2 * 4 * E * D,
        "partial_rowwise_lamb": 4 * E * D + 4 * E,
        "lars_sgd": 4 * E * D,  # the momentum buffer
        "ftrl": 2 * 4 * E * D,  # z and n
    }
    for name, size in expected_bytes.items():
        assert name in OPTIMIZERS
        assert state_bytes(name, E, D) == size, name
    fused = _embedding_optimizer(EmbeddingOptimizerConfig(
        type="partial_rowwise_lamb", lr=0.2, eps=1e-6, betas=(0.8, 0.9), weight_decay=0.1))
    assert fused == optim.PartialRowWiseLAMB(lr=0.2, eps=1e-6, betas=(0.8, 0.9),
                                             weight_decay=0.1)
    assert _embedding_optimizer(EmbeddingOptimizerConfig(type="lamb")) == optim.LAMB(lr=0.01)
    assert math.isclose(optim.LAMB().eps, 1e-8)
    lars = _embedding_optimizer(EmbeddingOptimizerConfig(type="lars_sgd", lr=0.3, eta=0.01,
                                                         momentum=0.5, weight_decay=0.1))
    assert lars == optim.LarsSGD(lr=0.3, eta=0.01, momentum=0.5, weight_decay=0.1)
    ftrl = _embedding_optimizer(EmbeddingOptimizerConfig(type="ftrl", lr=0.3, beta=2.0, l1=0.1))
    assert ftrl == optim.FTRL(lr=0.3, beta=2.0, l1=0.1, l2=0.0)
    with pytest.raises(FieldError, match="l1: only supported with type: ftrl, got type: lamb"):
        EmbeddingOptimizerConfig(type="lamb", l1=0.1)
    with pytest.raises(FieldError, match="eta: only supported with type: lars_sgd, got type: adam"):
        EmbeddingOptimizerConfig(type="adam", eta=0.1)


@pytest.mark.parametrize("name", ["partial_rowwise_adam", "lamb", "partial_rowwise_lamb",
                                  "lars_sgd", "ftrl"])
def test_a_collection_takes_it_from_its_annotation(name):
    """``apply_optimizer_in_backward`` with the class ``optim.torch_equivalent`` names
    (TorchRec's placeholder, or ours for FTRL): the collection's fused step is the module's."""
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from fbtriton_dist import EmbeddingBagCollection

    opt = OPTS[name]
    cls, kwargs = optim.torch_equivalent(opt)
    assert optim.from_torch(cls, kwargs, "t") == opt
    configs = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                  feature_names=["f1"]),
               EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=6,
                                  feature_names=["f2"])]
    ebc = EmbeddingBagCollection(tables=configs)
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    tbe = TableBatchedEmbedding([(10, 4), (6, 8)], [0, 1], optimizer=opt, backend="reference",
                                stochastic_rounding=False)
    with torch.no_grad():
        for w, t in zip(tbe.split_embedding_weights(), ("t1", "t2"), strict=True):
            w.copy_(ebc.state_dict()[f"embedding_bags.{t}.weight"])
    values, lengths = torch.tensor([1, 1, 7, 0, 5, 5]), torch.tensor([2, 1, 0, 3])
    kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=values, lengths=lengths)
    for step in range(2):
        out = ebc(kjt).values()
        ref = tbe(values, torch.tensor([0, 2, 3, 3, 6]))
        up = upstream_grad(out, step)
        out.backward(up)
        ref.backward(up)
    for w, t in zip(tbe.split_embedding_weights(), ("t1", "t2"), strict=True):
        torch.testing.assert_close(ebc.state_dict()[f"embedding_bags.{t}.weight"], w,
                                   atol=1e-6, rtol=1e-5)
