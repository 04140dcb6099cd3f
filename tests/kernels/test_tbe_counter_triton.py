"""Rowwise Adagrad with counter's Triton update (``kernels/tbe_optim.py``
``_rowwise_adagrad_with_counter_update``; in Triton's interpreter without a GPU) against the
reference (``reference/counter.py``) after 3 steps: rows, ``momentum1``, ``prev_iter``,
``row_counter`` and ``max_counter``, for every case of ``tests/modules/test_tbe_optim_counter.py``
(COUNTER with each weight-decay mode, each tail-id learning-rate mode, ``adjustment_iter``,
ADAGRADW's half-lives -1 and -2, a ratio threshold of a refreshed ``max_counter``; COWCLIP L2
and decoupled), plain COUNTER (no decay, equal rates) on fp16 rows, and a ``max_counter``
taken from ``row_counter_max`` (a sharded table's) instead of the module's rows."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.modules import fused_optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for, to, upstream_grad
from tests.modules.test_tbe_optim_counter import (
    FBGEMM_CASES,
    FORMULA_CASES,
    FTM,
    TABLES,
    _batches,
    _w0,
)

pytestmark = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")

CASES = {**FBGEMM_CASES, **FORMULA_CASES, "plain-fp16": optim.RowWiseAdagradWithCounter(
    lr=0.3, eps=1e-6, weight_decay=0.2)}


def _train(opt, backend, w0, batches, wdt=torch.float32, row_counter_max=None):
    device = device_for(backend)
    tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend, weights_dtype=wdt,
                                stochastic_rounding=False, device=device)
    with torch.no_grad():
        tbe.weights.copy_(w0.to(wdt))
    given = None if row_counter_max is None else row_counter_max.to(device)
    fused_optim.set_row_counter_max(tbe, given)
    for step, batch in enumerate(batches):
        out = tbe(*to(device, *batch))
        out.backward(upstream_grad(out, step))
    return tbe


@pytest.mark.parametrize("case", list(CASES))
def test_triton_counter_matches_reference(case):
    opt = CASES[case]
    wdt = torch.float16 if case.endswith("fp16") else torch.float32
    w0, batches = _w0(), _batches(3, weighted=True)
    ref = _train(opt, "reference", w0, batches, wdt)
    tri = _train(opt, "triton", w0, batches, wdt)
    atol = 2e-5 if wdt == torch.float32 else 4e-3
    torch.testing.assert_close(tri.weights.cpu().float(), ref.weights.float(), atol=atol,
                               rtol=1e-5)
    for name in ("momentum1", "prev_iter", "row_counter"):
        torch.testing.assert_close(getattr(tri, name).cpu(), getattr(ref, name), atol=2e-5,
                                   rtol=1e-5)
    assert float(tri.max_counter) == pytest.approx(float(ref.max_counter), rel=1e-6)  # exp's ulp
    assert not torch.equal(tri.weights.cpu().float(), w0)


def test_triton_counter_takes_row_counter_max():
    """``max_counter`` refreshed from a given largest counter (5: 1 + 5 = 6 at every refresh),
    not the module's own rows' (which give another), as the reference does."""
    opt = FORMULA_CASES["increase-ratio"]
    w0, batches = _w0(), _batches(weighted=True)
    given = torch.tensor([5.0])
    ref = _train(opt, "reference", w0, batches, row_counter_max=given)
    tri = _train(opt, "triton", w0, batches, row_counter_max=given)
    own = _train(opt, "reference", w0, batches)
    assert float(tri.max_counter) == float(ref.max_counter) == 6.0 != float(own.max_counter)
    torch.testing.assert_close(tri.weights.cpu(), ref.weights, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(own.weights, ref.weights, atol=1e-5)
