"""TableBatchedEmbedding: Triton kernels vs the PyTorch reference vs torch's embedding_bag,
over awkward shapes, 3 training steps, every optimizer, dtype and pooling."""

import pytest
import torch
import torch.nn.functional as F

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import DEVICE, TRITON_OK
from tests.helpers import device_for, make_batch, to, upstream_grad

TABLE_SETS = {
    "one-row-table": ([(1, 5)], [0], 1, 3),
    "mixed-shared": ([(10, 3), (7, 8), (1, 5)], [0, 1, 0, 2], 4, 6),
    "T8": ([(50, 16), (20, 4), (9, 1)], [0, 1, 2, 0, 1, 2, 0, 0], 6, 5),
    "B24-L40": ([(100, 12), (30, 7)], [0, 1], 24, 40),
}
# The Triton cases' T8 and B24-L40 with fewer rows (the CPU path's tests keep the sets above):
# interpreted, the row kernel costs one program per touched row, and the row counts fill no
# path (D=1 and D=7 keep every row unaligned either way). B24-L40: long bags, N > 1024 ids
# (two blocks of the runs kernel) and, with ``hot``, a row hit more than CHUNK=256 times in
# every step (the chunk kernel's partials feed the update; with 100 and 30 rows only the first
# step had one); T8: 8 features on 3 shared tables, D=16, 4 and 1.
TRITON_TABLE_SETS = {
    **TABLE_SETS,
    "T8": ([(12, 16), (6, 4), (9, 1)], [0, 1, 2, 0, 1, 2, 0, 0], 6, 5),
    "B24-L40": ([(9, 12), (5, 7)], [0, 1], 24, 40),
}
OPTIMIZERS = {
    "none": None,
    "sgd": optim.SGD(lr=0.1),
    "adagrad": optim.RowWiseAdagrad(lr=0.1, eps=1e-6),
    "adagrad-l2": optim.RowWiseAdagrad(lr=0.1, weight_decay=0.01),
    "adagrad-decoupled": optim.RowWiseAdagrad(
        lr=0.1, weight_decay=0.01, weight_decay_mode="decoupled"
    ),
    "adam": optim.Adam(lr=0.05, weight_decay=0.01),
    "adagrad-elementwise": optim.Adagrad(lr=0.1),
    "partial-rowwise-adam": optim.PartialRowWiseAdam(lr=0.05, weight_decay=0.01),
    "lamb": optim.LAMB(lr=0.05, weight_decay=0.01),
    "partial-rowwise-lamb": optim.PartialRowWiseLAMB(lr=0.05),
    "lars-sgd": optim.LarsSGD(lr=0.5, eta=0.01, weight_decay=0.01),
    "ftrl": optim.FTRL(lr=0.2, l1=0.01, l2=0.1),
    # an average before every step, a swap before step 2 (its table step: the module's)
    "ensemble": optim.EnsembleRowWiseAdagrad(lr=0.1, weight_decay=0.01, weight_decay_mode="l2",
                                             step_ema=1, step_swap=2, step_ema_coef=0.5),
}
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}

# (table set, optimizer, pooling, weights dtype, index dtype, weighted, hot)
CASES = [
    ("one-row-table", "sgd", "sum", torch.float32, torch.int64, False, False),
    ("one-row-table", "adagrad", "mean", torch.float32, torch.int32, True, False),
    ("mixed-shared", "none", "sum", torch.float32, torch.int64, True, False),
    ("mixed-shared", "none", "mean", torch.float32, torch.int32, False, True),
    ("mixed-shared", "sgd", "mean", torch.float32, torch.int32, True, True),
    ("mixed-shared", "adagrad", "sum", torch.float32, torch.int64, True, True),
    ("mixed-shared", "adagrad-l2", "sum", torch.float32, torch.int64, False, False),
    ("mixed-shared", "adagrad-decoupled", "mean", torch.float32, torch.int64, False, True),
    ("mixed-shared", "adam", "sum", torch.float32, torch.int64, True, False),
    ("mixed-shared", "adagrad", "sum", torch.float16, torch.int64, False, True),
    ("mixed-shared", "sgd", "sum", torch.bfloat16, torch.int32, True, False),
    ("T8", "adagrad", "sum", torch.float32, torch.int32, False, True),
    ("T8", "adagrad-elementwise", "mean", torch.float32, torch.int64, True, True),
    ("mixed-shared", "adagrad-elementwise", "sum", torch.bfloat16, torch.int64, False, False),
    ("T8", "adam", "mean", torch.float32, torch.int64, False, False),
    ("T8", "none", "sum", torch.bfloat16, torch.int64, True, False),
    ("T8", "sgd", "sum", torch.float16, torch.int64, False, False),
    ("B24-L40", "adagrad", "sum", torch.float32, torch.int64, True, True),
    ("B24-L40", "adam", "sum", torch.float16, torch.int32, False, True),
    ("B24-L40", "none", "mean", torch.float32, torch.int64, False, False),
    # pooling "none" (sequence embeddings): one output row per id, [N, max_D]
    ("mixed-shared", "none", "none", torch.float32, torch.int64, True, True),
    ("mixed-shared", "adagrad", "none", torch.float16, torch.int32, False, True),
    ("T8", "adam", "none", torch.float32, torch.int64, True, False),
    ("B24-L40", "sgd", "none", torch.bfloat16, torch.int64, False, True),
    ("one-row-table", "adagrad-elementwise", "none", torch.float32, torch.int32, False, False),
    ("mixed-shared", "partial-rowwise-adam", "sum", torch.float32, torch.int64, True, True),
    ("T8", "partial-rowwise-adam", "mean", torch.float16, torch.int32, False, False),
    ("mixed-shared", "lamb", "mean", torch.float32, torch.int32, True, True),
    ("B24-L40", "lamb", "sum", torch.bfloat16, torch.int64, False, True),
    ("T8", "partial-rowwise-lamb", "sum", torch.float32, torch.int64, True, False),
    ("mixed-shared", "partial-rowwise-lamb", "none", torch.float32, torch.int64, False, True),
    ("mixed-shared", "lars-sgd", "sum", torch.float32, torch.int64, True, True),
    ("one-row-table", "lars-sgd", "mean", torch.float16, torch.int64, False, False),
    ("mixed-shared", "ftrl", "sum", torch.float32, torch.int32, True, True),
    ("T8", "ftrl", "mean", torch.bfloat16, torch.int64, False, False),
    ("mixed-shared", "ensemble", "sum", torch.float16, torch.int64, True, True),
]


def _case_id(case) -> str:
    name, opt, pooling, wdt, idt, weighted, hot = case
    parts = [name, opt, pooling, str(wdt).split(".")[1], str(idt).split(".")[1]]
    return "-".join(parts + (["weighted"] if weighted else []) + (["hot"] if hot else []))


def _train(module, batches, steps=3):
    """3 steps: forward, backward of a fixed upstream grad; torch SGD when not fused."""
    sgd = None if module.optimizer is not None else torch.optim.SGD(module.parameters(), lr=0.1)
    outs, grads = [], []
    for step, (indices, offsets, psw) in enumerate(batches[:steps]):
        out = module(indices, offsets, psw)
        out.backward(upstream_grad(out, step).to(out.dtype))
        outs.append(out.detach().float().cpu())
        if sgd is not None:
            grads.append(module.weights.grad.detach().float().cpu().clone())
            sgd.step()
            sgd.zero_grad()
    return outs, grads


def _build(tables, ftm, opt, pooling, wdt, backend, device="cpu"):
    torch.manual_seed(7)
    return TableBatchedEmbedding(
        tables,
        ftm,
        pooling=pooling,
        optimizer=opt,
        weights_dtype=wdt,
        backend=backend,
        stochastic_rounding=False,
        device=device,
    )


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_matches_reference(case):
    name, opt_name, pooling, wdt, idt, weighted, hot = case
    tables, ftm, B, max_L = TRITON_TABLE_SETS[name]
    g = torch.Generator().manual_seed(3)
    batches = [
        make_batch(tables, ftm, B, max_L, index_dtype=idt, weighted=weighted, hot=hot, generator=g)
        for _ in range(3)
    ]
    ref = _build(tables, ftm, OPTIMIZERS[opt_name], pooling, wdt, "reference")
    tri = _build(tables, ftm, OPTIMIZERS[opt_name], pooling, wdt, "triton", DEVICE)
    tri.load_state_dict(ref.state_dict())
    ref_out, ref_grads = _train(ref, batches)
    tri_out, tri_grads = _train(
        tri, [tuple(t if t is None else t.to(DEVICE) for t in b) for b in batches]
    )
    atol, rtol = TOL[wdt]
    for a, b in zip(ref_out + ref_grads, tri_out + tri_grads, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    torch.testing.assert_close(
        tri.weights.detach().float().cpu(), ref.weights.detach().float(), atol=atol, rtol=rtol
    )
    for a, b in ((ref.momentum1, tri.momentum1), (ref.momentum2, tri.momentum2)):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-4)
    assert tri.step == ref.step == (3 if opt_name != "none" else 0)


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_matches_torch_embedding_bag(backend, pooling):
    """Forward and weight gradient (autograd) against torch.nn.functional.embedding_bag."""
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    tables, ftm = [(10, 3), (7, 8), (1, 5)], [0, 1, 0, 2]
    B = 5
    indices, offsets, psw = make_batch(tables, ftm, B, 6, weighted=True)
    dev = device_for(backend)
    tbe = TableBatchedEmbedding(tables, ftm, pooling=pooling, backend=backend, device=dev)
    out = tbe(*to(dev, indices, offsets, psw))
    grad = upstream_grad(out, 0)
    out.backward(grad)
    out, grad = out.cpu(), grad.cpu()

    weights = [w.cpu().clone().requires_grad_() for w in tbe.split_embedding_weights()]
    expected = []
    for f, t in enumerate(ftm):
        o = offsets[f * B : (f + 1) * B + 1]
        ids = indices[o[0] : o[-1]]
        w_f = psw[o[0] : o[-1]] if psw is not None else None
        pooled = F.embedding_bag(
            ids, weights[t], (o[:-1] - o[0]), mode="sum", per_sample_weights=w_f
        )
        if pooling == "mean":  # torch's MEAN takes no weights: sum(w_i row_i) / L
            pooled = pooled / (o[1:] - o[:-1]).clamp(min=1)[:, None]
        expected.append(pooled)
    expected = torch.cat(expected, dim=1)
    torch.testing.assert_close(out.detach(), expected.detach(), atol=1e-6, rtol=1e-5)
    expected.backward(grad)
    ours = [
        tbe.weights.grad.cpu()[tbe.table_offsets[t] : tbe.table_offsets[t + 1]].view(E, D)
        for t, (E, D) in enumerate(tables)
    ]
    for a, b in zip(ours, weights, strict=True):
        torch.testing.assert_close(a, b.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_sparse_grad_and_per_sample_weight_grad(backend):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    tables, ftm = [(10, 3), (7, 8)], [0, 1, 0]
    indices, offsets, psw = make_batch(tables, ftm, 4, 5, weighted=True, hot=True)
    dev = device_for(backend)
    indices, offsets, psw = to(dev, indices, offsets, psw)
    dense = TableBatchedEmbedding(tables, ftm, pooling="mean", backend=backend, device=dev)
    sparse = TableBatchedEmbedding(
        tables, ftm, pooling="mean", backend=backend, sparse=True, device=dev
    )
    sparse.load_state_dict(dense.state_dict())
    psw_d, psw_s = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    for m, p in ((dense, psw_d), (sparse, psw_s)):
        out = m(indices, offsets, p)
        out.backward(upstream_grad(out, 0))
    assert sparse.weights.grad.is_sparse
    torch.testing.assert_close(sparse.weights.grad.to_dense(), dense.weights.grad)
    torch.testing.assert_close(psw_s.grad, psw_d.grad)
    # d out / d psw by finite difference of the (linear) lookup
    with torch.no_grad():
        i = 2
        bump = psw.clone()
        bump[i] += 1.0
        delta = dense(indices, offsets, bump) - dense(indices, offsets, psw)
        expected = (delta * upstream_grad(delta, 0)).sum()
    torch.testing.assert_close(psw_d.grad[i], expected, atol=1e-5, rtol=1e-4)
    # torch's own sparse-aware optimizer takes the sparse gradient
    torch.optim.SGD(sparse.parameters(), lr=0.1).step()


def test_split_views_state_dict_and_repr():
    tbe = TableBatchedEmbedding([(4, 3), (2, 8)], [0, 1, 1], optimizer=optim.Adam())
    w = tbe.split_embedding_weights()
    assert [tuple(x.shape) for x in w] == [(4, 3), (2, 8)]
    w[1][0].fill_(2.0)
    assert torch.all(tbe.weights[12:20] == 2.0)
    states = tbe.split_optimizer_states()
    assert [[tuple(s.shape) for s in st] for st in states] == [[(4, 3), (4, 3)], [(2, 8), (2, 8)]]
    sd = tbe.state_dict()
    assert {"weights", "momentum1", "momentum2", "_extra_state"} <= set(sd)
    other = TableBatchedEmbedding([(4, 3), (2, 8)], [0, 1, 1], optimizer=optim.Adam())
    other.load_state_dict(sd)
    assert torch.equal(other.weights, tbe.weights)
    adagrad = TableBatchedEmbedding([(4, 3), (2, 8)], optimizer=optim.RowWiseAdagrad())
    assert [[tuple(s.shape) for s in st] for st in adagrad.split_optimizer_states()] == [
        [(4,)],
        [(2,)],
    ]
    assert "RowWiseAdagrad" in repr(adagrad)
    # a fused module's weights are not for torch optimizers
    assert not adagrad.weights.requires_grad


def test_fused_step_counts_and_set_learning_rate():
    tbe = TableBatchedEmbedding([(5, 4)], optimizer=optim.SGD(lr=1.0))
    indices, offsets = torch.tensor([1, 1]), torch.tensor([0, 2])
    before = tbe.split_embedding_weights()[0][1].clone()
    tbe(indices, offsets).sum().backward()
    # duplicate ids reduced first: one update of -lr * (1 + 1)
    torch.testing.assert_close(tbe.split_embedding_weights()[0][1], before - 2.0)
    tbe.set_learning_rate(0.5)
    tbe(indices, offsets).sum().backward()
    torch.testing.assert_close(tbe.split_embedding_weights()[0][1], before - 3.0)
    assert tbe.step == 2
    with torch.no_grad():  # inference does not step
        tbe(indices, offsets)
    assert tbe.step == 2


@pytest.mark.parametrize(
    ("tables", "dtype", "align"),
    [
        ([(10, 128), (7, 64)], torch.float32, 4),  # 16-byte vectors of fp32
        ([(10, 128), (7, 64)], torch.float16, 8),
        ([(3, 6), (5, 8)], torch.float32, 2),  # D=6: pairs
        ([(3, 8), (5, 7)], torch.float32, 1),  # D=7: scalars
        ([(3, 4), (1, 8)], torch.bfloat16, 4),  # the 2nd table starts at element 12
    ],
)
def test_row_alignment_is_what_every_table_allows(tables, dtype, align):
    """The forward loads rows in vectors of ``row_align`` elements: it must divide every D and
    every table's first element (else a vector would straddle two rows)."""
    tbe = TableBatchedEmbedding(tables, weights_dtype=dtype, output_dtype=torch.float32,
                                backend="reference")
    assert tbe._layout().row_align == align


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_max_norm_renormalises_rows_as_torch(backend, pooling):
    """``max_norm``: the rows of the batch are renormalised in place before the lookup, as
    ``F.embedding_bag(max_norm=)`` does (shared tables, duplicate ids, empty bags, an id
    repeated across features); then a fused SGD step on the renormalised rows."""
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    tables, ftm, B = [(10, 3), (7, 8), (1, 5)], [0, 1, 0, 2], 4
    indices, offsets, psw = make_batch(tables, ftm, B, 5, weighted=True, hot=True)
    dev = device_for(backend)
    tbe = TableBatchedEmbedding(tables, ftm, pooling=pooling, optimizer=optim.SGD(lr=0.1),
                                backend=backend, device=dev, max_norm=0.05)
    weights = [w.detach().cpu().clone() for w in tbe.split_embedding_weights()]
    assert max(w.norm(dim=1).max() for w in weights) > 0.05  # some rows get renormalised
    out = tbe(*to(dev, indices, offsets, psw))
    expected, params = [], [w.clone().requires_grad_() for w in weights]
    for f, t in enumerate(ftm):
        o = offsets[f * B : (f + 1) * B + 1]
        with torch.no_grad():  # F.embedding_bag's renormalisation, then its lookup
            F.embedding_bag(indices[o[0] : o[-1]], params[t], o[:-1] - o[0], max_norm=0.05)
    for f, t in enumerate(ftm):
        o = offsets[f * B : (f + 1) * B + 1]
        pooled = F.embedding_bag(indices[o[0] : o[-1]], params[t], o[:-1] - o[0], mode="sum",
                                 per_sample_weights=psw[o[0] : o[-1]])
        if pooling == "mean":
            pooled = pooled / (o[1:] - o[:-1]).clamp(min=1)[:, None]
        expected.append(pooled)
    expected = torch.cat(expected, dim=1)
    torch.testing.assert_close(out.detach().cpu(), expected.detach(), atol=1e-6, rtol=1e-5)
    grad = upstream_grad(out, 0)
    out.backward(grad)
    expected.backward(grad.cpu())
    for ours, p in zip(tbe.split_embedding_weights(), params, strict=True):
        torch.testing.assert_close(ours.detach().cpu(), (p - 0.1 * p.grad).detach(), atol=1e-6,
                                   rtol=1e-5)
    with pytest.raises(ValueError, match=r"max_norm: expected None or a number > 0, got -1"):
        TableBatchedEmbedding(tables, ftm, max_norm=-1)
