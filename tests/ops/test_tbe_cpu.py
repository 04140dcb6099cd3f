"""The fast CPU path (``backend="cpu"``, what ``"auto"`` runs on CPU tensors), on its native
kernels and on its torch ops (``path``), against the reference over the TBE module's cases, and
what it promises beyond them: determinism, stochastic rounding within one ulp, plain and sparse
gradients, groups of tables that share no view, and ``"auto"`` picking it. The native kernels'
own cases are in test_cpu_native.py."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import backend as backends
from fbtriton_dist.ops import cpu
from tests.helpers import make_batch, upstream_grad
from tests.modules.test_tbe_module import CASES, OPTIMIZERS, TABLE_SETS, TOL, _build, _case_id


def _train(module, batches):
    sgd = None if module.optimizer is not None else torch.optim.SGD(module.parameters(), lr=0.1)
    outs, grads = [], []
    for step, (indices, offsets, psw) in enumerate(batches):
        out = module(indices, offsets, psw)
        out.backward(upstream_grad(out, step).to(out.dtype))
        outs.append(out.detach().float())
        if sgd is not None:
            grads.append(module.weights.grad.detach().float().clone())
            sgd.step()
            sgd.zero_grad()
    return outs, grads


def _batches(name, idt=torch.int64, weighted=False, hot=False, n=3, seed=3):
    tables, ftm, B, max_L = TABLE_SETS[name]
    g = torch.Generator().manual_seed(seed)
    return [
        make_batch(tables, ftm, B, max_L, index_dtype=idt, weighted=weighted, hot=hot, generator=g)
        for _ in range(n)
    ]


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """The CPU backend's native kernels (ops/cpu_native.py, where a compiler builds them) or its
    torch ops (FBTD_CPU_NATIVE=0, what runs without one)."""
    monkeypatch.setenv("FBTD_CPU_NATIVE", "1" if request.param == "native" else "0")
    return request.param


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cpu_path_matches_reference(case, path):
    """3 steps: outputs, plain gradients, weights, optimizer states and the step counter."""
    name, opt_name, pooling, wdt, idt, weighted, hot = case
    tables, ftm, _, _ = TABLE_SETS[name]
    batches = _batches(name, idt, weighted, hot)
    ref = _build(tables, ftm, OPTIMIZERS[opt_name], pooling, wdt, "reference")
    fast = _build(tables, ftm, OPTIMIZERS[opt_name], pooling, wdt, "cpu")
    fast.load_state_dict(ref.state_dict())
    ref_out, ref_grads = _train(ref, batches)
    fast_out, fast_grads = _train(fast, batches)
    atol, rtol = TOL[wdt]
    for a, b in zip(ref_out + ref_grads, fast_out + fast_grads, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    torch.testing.assert_close(fast.weights.float(), ref.weights.float(), atol=atol, rtol=rtol)
    for a, b in ((ref.momentum1, fast.momentum1), (ref.momentum2, fast.momentum2)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert fast.step == ref.step == (3 if opt_name != "none" else 0)


def test_auto_is_the_cpu_path_on_cpu_tensors():
    assert backends.resolve("auto", "cpu") == "cpu"
    assert backends.implementation("cpu") is cpu
    assert TableBatchedEmbedding([(4, 2)]).resolved_backend() == "cpu"


@pytest.mark.parametrize("opt_name", ["adagrad", "adam", "none"])
def test_deterministic(opt_name, path):
    """Two modules, same seed and batches: bitwise the same outputs, weights and states."""
    tables, ftm, _, _ = TABLE_SETS["T8"]
    batches = _batches("T8", weighted=True, hot=True)
    runs = []
    for _ in range(2):
        m = _build(tables, ftm, OPTIMIZERS[opt_name], "sum", torch.float32, "cpu")
        outs, grads = _train(m, batches)
        runs.append((outs + grads, m.weights.detach().clone(), m.momentum1.clone()))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_is_within_one_ulp_and_seeded(dtype, path):
    """Rounded rows lie within one ulp of the reference's unrounded update (its nearest
    rounding), and the same seed rounds the same way."""
    tables, ftm, _, _ = TABLE_SETS["mixed-shared"]
    batches = _batches("mixed-shared", hot=True)
    opt = optim.RowWiseAdagrad(lr=0.1)
    mods = {}
    for key, backend, sr in (("ref", "reference", False), ("a", "cpu", True), ("b", "cpu", True)):
        torch.manual_seed(7)
        mods[key] = TableBatchedEmbedding(tables, ftm, optimizer=opt, weights_dtype=dtype,
                                          backend=backend, stochastic_rounding=sr, seed=5)
    mods["a"].load_state_dict(mods["ref"].state_dict())
    mods["b"].load_state_dict(mods["ref"].state_dict())
    for step, (indices, offsets, psw) in enumerate(batches[:1]):
        for m in mods.values():
            out = m(indices, offsets, psw)
            out.backward(upstream_grad(out, step))
    assert torch.equal(mods["a"].weights, mods["b"].weights)
    ulp = torch.finfo(dtype).eps * mods["ref"].weights.float().abs().clamp(min=1e-3)
    assert ((mods["a"].weights.float() - mods["ref"].weights.float()).abs() <= ulp * 1.01).all()


def test_tables_that_share_no_view_and_padding_after_the_bags(path):
    """A table whose first element is not a multiple of its D gets its own view (a second
    group of the same D); ids after the last bag (padding) are ignored."""
    # elements 0, 12, 52, 68: tables 1 and 2 (D=8) each get their own view, 0 and 3 share one
    tables, ftm = [(3, 4), (5, 8), (2, 8), (7, 4)], [0, 1, 2, 3, 1]
    B = 4
    indices, offsets, psw = make_batch(tables, ftm, B, 5, weighted=True, hot=True,
                                       generator=torch.Generator().manual_seed(1))
    padded = torch.cat([indices, torch.tensor([99, 99])])
    ref = _build(tables, ftm, optim.RowWiseAdagrad(lr=0.1), "mean", torch.float32, "reference")
    fast = _build(tables, ftm, optim.RowWiseAdagrad(lr=0.1), "mean", torch.float32, "cpu")
    fast.load_state_dict(ref.state_dict())
    layout = fast._layout()
    groups = cpu._groups(cpu._Features(layout.w_offsets, layout.dims, layout.D_offsets,
                                       offsets, layout.row_offsets))
    assert sorted((g.D, g.start, len(g.tables)) for g in groups) == [(4, 0, 2), (8, 12, 1),
                                                                      (8, 52, 1)]
    out_r = ref(indices, offsets, psw)
    kw = dict(pooling=1, max_D=8, total_D=layout.total_D, output_dtype=torch.float32,
              row_offsets=layout.row_offsets)
    out_pad = cpu.tbe_forward(fast.weights.detach(), layout.w_offsets, layout.dims,
                              layout.D_offsets, padded, offsets, torch.cat([psw, psw[:2]]), **kw)
    torch.testing.assert_close(out_pad, out_r.detach())
    out_f = fast(indices, offsets, psw)
    grad = upstream_grad(out_r, 0)
    out_r.backward(grad)
    out_f.backward(grad)
    torch.testing.assert_close(fast.weights, ref.weights)
    torch.testing.assert_close(fast.momentum1, ref.momentum1)


def test_chunks_cover_every_row_once(monkeypatch):
    """The torch ops' updates in chunks of a few rows (many chunks) equal one update of every
    row."""
    monkeypatch.setenv("FBTD_CPU_NATIVE", "0")
    tables, ftm, _, _ = TABLE_SETS["B24-L40"]
    batches = _batches("B24-L40", weighted=True, hot=True, n=2)
    whole = _build(tables, ftm, OPTIMIZERS["adam"], "sum", torch.float32, "cpu")
    chunked = _build(tables, ftm, OPTIMIZERS["adam"], "sum", torch.float32, "cpu")
    chunked.load_state_dict(whole.state_dict())
    _train(whole, batches)
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 3 * 12)  # 3 rows of the D=12 table per chunk
    _train(chunked, batches)
    assert torch.equal(chunked.weights, whole.weights)
    assert torch.equal(chunked.momentum2, whole.momentum2)
