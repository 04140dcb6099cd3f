"""Rowwise Adagrad's weight decay modes (FBGEMM's ``weight_decay_mode`` NONE, L2, DECOUPLE)
against the update written again here, row by row in float64 (not the reference module).

fbgemm-gpu-cpu 1.8.0's CPU TBE takes ``weight_decay`` and ``weight_decay_mode`` but applies no
decay in any mode (checked: its rows and state equal the undecayed update), so only ``"none"``
is compared with it; L2 and decoupled follow FBGEMM's CUDA update, as written below. Each case
runs 3 steps over mixed D, duplicate (hot) ids, empty bags and per-sample weights on every
backend: the reference, the CPU backend with its native C update and with its torch step
(``FBTD_CPU_NATIVE=0``), and the Triton kernels (interpreted on CPU)."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for, make_batch, to, upstream_grad
from tests.modules.test_tbe_optim_formulas import FTM, MAX_L, TABLES, TOL, B, table_grads


def _rowwise_adagrad(opt, w, g, m):
    """One row's update (float64 ``w``, ``g`` [D], ``m`` its accumulator): FBGEMM's rowwise
    Adagrad with its weight decay modes; returns (w, m)."""
    wd = opt.weight_decay
    g_sq = g + wd * w if opt.weight_decay_mode == "l2" else g
    m = m + (g_sq * g_sq).mean()
    rate = opt.lr / (m.sqrt() + opt.eps)
    if opt.weight_decay_mode == "l2":
        return (1 - rate * wd) * w - rate * g, m
    if opt.weight_decay_mode == "decoupled":
        return (1 - opt.lr * wd) * w - rate * g, m
    return w - rate * g, m  # "none": weight_decay is ignored


def _expected(opt, w0, batches, pooling, dtype):
    weights = [w.double() for w in w0]
    m = [torch.zeros(E, dtype=torch.float64) for E, _ in TABLES]
    for batch in batches:
        grads, touched = table_grads(weights, batch, pooling)
        for t in range(len(TABLES)):
            for row in sorted(touched[t]):
                weights[t][row], m[t][row] = _rowwise_adagrad(opt, weights[t][row],
                                                              grads[t][row], m[t][row])
            weights[t] = weights[t].to(dtype).double()  # the module rounds after every step
    return weights, m


OPTS = {
    "l2": optim.RowWiseAdagrad(lr=0.3, eps=1e-6, weight_decay=0.2, weight_decay_mode="l2"),
    "decoupled": optim.RowWiseAdagrad(lr=0.3, eps=1e-6, weight_decay=0.2,
                                      weight_decay_mode="decoupled"),
    "none": optim.RowWiseAdagrad(lr=0.3, eps=1e-6, weight_decay=0.2, weight_decay_mode="none"),
}
CASES = [  # (mode, pooling, weights dtype, weighted, hot)
    ("l2", "sum", torch.float32, True, True),
    ("l2", "mean", torch.float16, False, True),
    ("decoupled", "sum", torch.float32, False, True),
    ("decoupled", "mean", torch.bfloat16, True, False),
    ("none", "sum", torch.float32, True, True),
]
RUNS = [(case, backend) for case in CASES for backend in ("reference", "cpu", "cpu-torch")]
RUNS += [(CASES[1], "triton"), (CASES[2], "triton")]  # the interpreter is slow: one per mode
# whose Triton code differs ("none" is "l2" with a 0 coefficient in the kernels' hyper slots)


def _id(run):
    (mode, pooling, dtype, weighted, hot), backend = run
    return "-".join([backend, mode, pooling, str(dtype)[6:]] + (["weighted"] if weighted else [])
                    + (["hot"] if hot else []))


@pytest.mark.parametrize(("case", "backend"), RUNS, ids=list(map(_id, RUNS)))
def test_matches_the_update_formula(case, backend, monkeypatch):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("FBTD_CPU_NATIVE", "0" if backend == "cpu-torch" else "1")
    backend = backend.removesuffix("-torch")
    mode, pooling, dtype, weighted, hot = case
    opt = OPTS[mode]
    dev = device_for(backend)
    torch.manual_seed(5)
    tbe = TableBatchedEmbedding(TABLES, FTM, pooling=pooling, optimizer=opt, weights_dtype=dtype,
                                backend=backend, device=dev, stochastic_rounding=False)
    w0 = [w.detach().cpu().clone() for w in tbe.split_embedding_weights()]
    g = torch.Generator().manual_seed(23)
    batches = []
    for step in range(3):
        indices, offsets, psw = make_batch(TABLES, FTM, B, MAX_L, weighted=weighted, hot=hot,
                                           generator=g)
        out = tbe(*to(dev, indices, offsets, psw))
        up = upstream_grad(out, step)
        out.backward(up.to(out.dtype))
        batches.append((indices, offsets, psw, up.cpu().to(out.dtype).float()))
    assert int(offsets.diff().eq(0).sum()) > 0  # some bags are empty
    weights, m = _expected(opt, w0, batches, pooling, dtype)
    tol = TOL[dtype]
    for ours, theirs, before in zip(tbe.split_embedding_weights(), weights, w0, strict=True):
        torch.testing.assert_close(ours.detach().cpu().double(), theirs, atol=tol, rtol=tol)
        assert (ours.detach().cpu() != before).any()
    for t, (E, _) in enumerate(TABLES):
        state = tbe.split_optimizer_states()[t][0].cpu().double().reshape(E)
        torch.testing.assert_close(state, m[t], atol=1e-5, rtol=1e-4)


def test_the_modes_differ_and_none_ignores_the_coefficient():
    """Both sides of the mode switch: one step from the same rows gives three different
    results, and ``"none"`` with a coefficient equals no decay at all."""
    results = {}
    for mode in ("none", "l2", "decoupled"):
        for wd in (0.0, 0.5):
            tbe = TableBatchedEmbedding([(4, 4)], optimizer=optim.RowWiseAdagrad(
                lr=0.5, weight_decay=wd, weight_decay_mode=mode), backend="reference")
            with torch.no_grad():
                tbe.split_embedding_weights()[0].copy_(torch.arange(16.0).view(4, 4) / 8)
            out = tbe(torch.tensor([1, 1, 2]), torch.tensor([0, 2, 3]))
            out.backward(torch.ones_like(out))
            results[mode, wd] = tbe.split_embedding_weights()[0].detach().clone()
    assert torch.equal(results["none", 0.5], results["none", 0.0])
    assert torch.equal(results["l2", 0.0], results["none", 0.0])
    assert torch.equal(results["decoupled", 0.0], results["none", 0.0])
    for a, b in [("l2", "none"), ("decoupled", "none"), ("l2", "decoupled")]:
        assert not torch.allclose(results[a, 0.5][1:3], results[b, 0.5][1:3]), (a, b)
    assert torch.equal(results["l2", 0.5][[0, 3]], results["none", 0.0][[0, 3]])  # untouched


def test_none_matches_fbgemm_cpu():
    """``"none"`` (FBGEMM's NONE) with a coefficient against FBGEMM's CPU TBE with the same
    arguments: rows and states after 3 steps."""
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )

    from tests.fbgemm_config import WeightDecayMode

    tables, ftm = [(12, 8), (5, 4)], [0, 0, 1]  # FBGEMM CPU: a table's features adjacent
    opt = optim.RowWiseAdagrad(lr=0.2, eps=1e-6, weight_decay=0.3,
                               weight_decay_mode=WeightDecayMode.NONE)
    assert opt.weight_decay_mode == "none"
    ours = TableBatchedEmbedding(tables, ftm, optimizer=opt, backend="cpu",
                                 stochastic_rounding=False)
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(E, D, EmbeddingLocation.HOST, fb.ComputeDevice.CPU) for E, D in tables],
        feature_table_map=ftm, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.2,
        eps=1e-6, weight_decay=0.3, weight_decay_mode=WeightDecayMode.NONE,
        pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        a.copy_(b)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        indices, offsets, psw = make_batch(tables, ftm, 3, 5, hot=True, weighted=True,
                                           generator=g)
        out, ref = ours(indices, offsets, psw), theirs(indices, offsets, per_sample_weights=psw)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        up = upstream_grad(out, step)
        out.backward(up)
        ref.backward(up)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b.detach(), a, atol=1e-5, rtol=1e-5)
    for a, b in zip(theirs.split_optimizer_states(), ours.split_optimizer_states(), strict=True):
        torch.testing.assert_close(b[0].reshape(a[0].shape), a[0], atol=1e-5, rtol=1e-4)


def test_mode_names_and_bad_values():
    from tests.fbgemm_config import WeightDecayMode

    for given, ours in [(WeightDecayMode.DECOUPLE, "decoupled"), (WeightDecayMode.L2, "l2"),
                        ("DECOUPLE", "decoupled"), ("None", "none"), (0, "none")]:
        assert optim.RowWiseAdagrad(weight_decay_mode=given).weight_decay_mode == ours
    for bad in ("l1", WeightDecayMode.COUNTER, WeightDecayMode.COWCLIP, 7, None):
        with pytest.raises(ValueError, match=r"RowWiseAdagrad.weight_decay_mode: expected one "
                                             r"of \['none', 'l2', 'decoupled'\]"):
            optim.RowWiseAdagrad(weight_decay_mode=bad)
    with pytest.raises(ValueError, match="RowWiseAdagrad.lr: expected a number >= 0, got -1"):
        optim.RowWiseAdagrad(lr=-1)
    with pytest.raises(ValueError, match="RowWiseAdagrad.weight_decay: expected a number >= 0"):
        optim.RowWiseAdagrad(weight_decay=-0.1)
    hyper = dict(zip(optim.HYPER_FIELDS, optim.hyper_parameters(OPTS["none"]), strict=True))
    assert hyper["weight_decay"] == 0.0  # what the kernels read in "none"
    assert dict(zip(optim.HYPER_FIELDS, optim.hyper_parameters(OPTS["l2"]),
                    strict=True))["weight_decay"] == pytest.approx(0.2)


def test_annotation_and_job_take_the_mode():
    """TorchRec's ``apply_optimizer_in_backward(RowWiseAdagrad, ..., {"weight_decay_mode":
    WeightDecayMode.DECOUPLE})`` (FBGEMM's fused-parameter name) and the job's
    ``optimizer.embedding.weight_decay_mode`` give the decoupled config; the collection's step
    is the module's."""
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from fbtriton_dist import EmbeddingBagCollection
    from fbtriton_dist.train.config import EmbeddingOptimizerConfig, FieldError
    from fbtriton_dist.train.job import _embedding_optimizer
    from tests.fbgemm_config import WeightDecayMode

    opt = OPTS["decoupled"]
    kwargs = {"lr": 0.3, "eps": 1e-6, "weight_decay": 0.2,
              "weight_decay_mode": WeightDecayMode.DECOUPLE}
    assert optim.from_torch(RowWiseAdagrad, kwargs, "t") == opt
    assert optim.torch_equivalent(opt) == (RowWiseAdagrad, {**kwargs,
                                                            "weight_decay_mode": "decoupled"})
    assert optim.from_torch(RowWiseAdagrad, {}, "t").weight_decay_mode == "l2"
    job = EmbeddingOptimizerConfig(type="rowwise_adagrad", lr=0.3, eps=1e-6, weight_decay=0.2,
                                   weight_decay_mode="decoupled")
    assert _embedding_optimizer(job) == opt
    with pytest.raises(FieldError, match="weight_decay_mode: expected one of"):
        EmbeddingOptimizerConfig(weight_decay_mode="l1")  # counter: test_tbe_optim_counter.py
    with pytest.raises(FieldError, match="weight_decay_mode: only supported with type: "
                                         "rowwise_adagrad, emainplace_rowwise_adagrad, "
                                         "rowwise_adagrad_with_counter, "
                                         "ensemble_rowwise_adagrad, rowwise_adagrad_global_decay, got type: adam"):
        EmbeddingOptimizerConfig(type="adam", weight_decay_mode="l2")

    configs = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                  feature_names=["f1"])]
    ebc = EmbeddingBagCollection(tables=configs)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), kwargs)
    tbe = TableBatchedEmbedding([(10, 4)], optimizer=opt, backend="reference")
    with torch.no_grad():
        tbe.split_embedding_weights()[0].copy_(ebc.state_dict()["embedding_bags.t1.weight"])
    values, lengths = torch.tensor([1, 1, 7, 0]), torch.tensor([2, 0, 2])
    kjt = KeyedJaggedTensor(keys=["f1"], values=values, lengths=lengths)
    for step in range(2):
        out = ebc(kjt).values()
        ref = tbe(values, torch.tensor([0, 2, 2, 4]))
        up = upstream_grad(out, step)
        out.backward(up)
        ref.backward(up)
    torch.testing.assert_close(ebc.state_dict()["embedding_bags.t1.weight"],
                               tbe.split_embedding_weights()[0], atol=1e-6, rtol=1e-5)
