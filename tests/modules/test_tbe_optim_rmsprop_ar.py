"""Rowwise RMSprop with adaptive regularisation (``optim.RowWiseRMSpropAR``, FBGEMM's
``rowwise_rmsprop_ar`` from its public sources; fbgemm-gpu-cpu 1.8.0 has no such optimizer
to run) against its formula, written again here row by row in float64: 5 steps over mixed D,
duplicate (hot) ids, empty bags, per-sample weights, rows that skip steps (gaps of 1 and more:
the decay's clamp and its floor both hit at gaps >= 3), on every backend."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for, make_batch, to, upstream_grad
from tests.modules.test_tbe_optim_formulas import FTM, TABLES, B, table_grads

OPT = optim.RowWiseRMSpropAR(lr=0.1, eps=1e-6, ar_alpha=4.0, ema_beta=0.9, min_shrinkage=0.15)


def _row(opt, w, g, t, v, last):
    """One row's update (float64): returns (w, v, last)."""
    v = opt.ema_beta * v + (1 - opt.ema_beta) * (g * g).mean()
    gap = 1.0 if last == 0 else t - last
    keep = max(opt.min_shrinkage, 1.0 - min(max(opt.lr * opt.ar_alpha * gap, 0.0), 1.0))
    return keep * w - opt.lr / (v.sqrt() + opt.eps) * g, v, float(t)


@pytest.mark.parametrize(("backend", "dtype"), [("reference", torch.float32),
                                                ("cpu", torch.float32), ("cpu", torch.float16),
                                                ("triton", torch.float32)])
def test_matches_the_formula(backend, dtype):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    dev = device_for(backend)
    torch.manual_seed(13)
    tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=OPT, weights_dtype=dtype,
                                backend=backend, device=dev, stochastic_rounding=False)
    weights = [w.detach().cpu().double() for w in tbe.split_embedding_weights()]
    v = [torch.zeros(E, dtype=torch.float64) for E, _ in TABLES]
    last = [[0.0] * E for E, _ in TABLES]
    g = torch.Generator().manual_seed(41)
    gaps = set()
    for step in range(5):
        indices, offsets, psw = make_batch(TABLES, FTM, B, 2, weighted=step % 2 == 1,
                                           hot=True, generator=g)
        out = tbe(*to(dev, indices, offsets, psw))
        up = upstream_grad(out, step)
        out.backward(up.to(out.dtype))
        grads, touched = table_grads(weights, (indices, offsets, psw,
                                               up.cpu().to(out.dtype).float()), "sum")
        for t in range(len(TABLES)):
            for r in sorted(touched[t]):
                gaps.add(step + 1 - last[t][r] if last[t][r] else 0)
                weights[t][r], v[t][r], last[t][r] = _row(OPT, weights[t][r], grads[t][r],
                                                          step + 1, v[t][r], last[t][r])
            weights[t] = weights[t].to(dtype).double()
    assert {0, 1} < gaps and max(gaps) >= 3  # first updates, consecutive and skipped steps
    tol = 2e-5 if dtype == torch.float32 else 8e-3
    for t, (E, _) in enumerate(TABLES):
        torch.testing.assert_close(tbe.split_embedding_weights()[t].detach().cpu().double(),
                                   weights[t], atol=tol, rtol=tol)
        v_ours, last_ours = (s.cpu().double().reshape(E) for s in tbe.split_optimizer_states()[t])
        torch.testing.assert_close(v_ours, v[t], atol=1e-6, rtol=1e-5)
        assert last_ours.tolist() == last[t]


def test_bad_values_and_the_annotation():
    owner = "RowWiseRMSpropAR"
    with pytest.raises(ValueError, match=rf"{owner}.lr: expected a number >= 0, got -1"):
        optim.RowWiseRMSpropAR(lr=-1)
    with pytest.raises(ValueError, match=rf"{owner}.eps: expected a number > 0, got 0"):
        optim.RowWiseRMSpropAR(eps=0)
    with pytest.raises(ValueError, match=rf"{owner}.ema_beta: expected a number in \[0, 1\)"):
        optim.RowWiseRMSpropAR(ema_beta=1.0)
    with pytest.raises(ValueError, match=rf"{owner}.min_shrinkage: expected a number in "
                                         r"\[0, 1\], got 1.5"):
        optim.RowWiseRMSpropAR(min_shrinkage=1.5)
    with pytest.raises(ValueError, match=rf"{owner}.ar_alpha: expected a number >= 0"):
        optim.RowWiseRMSpropAR(ar_alpha=-0.5)
    cls, kwargs = optim.torch_equivalent(OPT)
    assert optim.from_torch(cls, kwargs, "t") == OPT
    from fbtriton_dist.train.config import EmbeddingOptimizerConfig
    from fbtriton_dist.train.job import _embedding_optimizer

    job = EmbeddingOptimizerConfig(type="rowwise_rmsprop_ar", lr=0.1, eps=1e-6, ar_alpha=4.0,
                                   ema_beta=0.9, min_shrinkage=0.15)
    assert _embedding_optimizer(job) == OPT
