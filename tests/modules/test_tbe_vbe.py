"""Variable batch size per feature (VBE, FBGEMM's ``batch_size_per_feature_per_rank``):
TableBatchedEmbedding against FBGEMM's own CPU TBE given the same VBE batch (the 1-D output,
then the weights and optimizer state after 3 fused steps), on the reference and the Triton
kernels; and against the same bags as a plain fixed batch."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import vbe
from tests.conftest import TRITON_OK
from tests.helpers import device_for

fbgemm = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: E402
    EmbeddingLocation,
    PoolingMode,
)

BACKENDS = ["reference"] + (["triton"] if TRITON_OK else [])
TABLES = [(30, 8), (1, 4), (12, 4)]  # a one-row table; FBGEMM's CPU TBE needs D % 4 == 0
FTM = [0, 0, 1, 2]  # table 0 read by two features
# B[t][r]: 2 ranks; feature 1 has no bags from rank 1, feature 3 none at all from rank 0
BATCH_SIZES = [[3, 1], [2, 0], [5, 2], [0, 4]]
# FBGEMM's VBE takes SGD, rowwise Adagrad and Adam (not elementwise Adagrad)
OPTS = {
    "sgd": optim.SGD(lr=0.1),
    "rowwise_adagrad": optim.RowWiseAdagrad(lr=0.1, eps=1e-6),
    "adam": optim.Adam(lr=0.05, eps=1e-6),
}


def _vbe_batch(seed: int, weighted: bool, index_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    ids, lengths = [], []
    for t, per_rank in enumerate(BATCH_SIZES):
        E = TABLES[FTM[t]][0]
        for n in per_rank:
            L = torch.randint(0, 5, (n,), generator=g)
            for ln in L.tolist():
                bag = torch.randint(0, E, (ln,), generator=g)
                bag[: ln // 2] = E - 1  # a hot row, hit again and again
                ids.append(bag)
            lengths.append(L)
    lengths = torch.cat(lengths)
    offsets = torch.zeros(lengths.numel() + 1, dtype=index_dtype)
    offsets[1:] = lengths.cumsum(0)
    indices = torch.cat(ids).to(index_dtype)
    psw = torch.rand(indices.numel(), generator=g) + 0.5 if weighted else None
    return indices, offsets, psw


def _fbgemm(opt_name: str, pooling: str):
    opt = OPTS[opt_name]
    entry = optim.spec_of(opt)  # the registry names FBGEMM's equivalent
    kwargs = {"eps": opt.eps} if "eps" in entry.hyper else {}
    return fbgemm.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(E, D, EmbeddingLocation.HOST, fbgemm.ComputeDevice.CPU)
                         for E, D in TABLES],
        feature_table_map=FTM,
        optimizer=getattr(EmbOptimType, entry.fbgemm),
        learning_rate=opt.lr,
        pooling_mode=PoolingMode.SUM if pooling == "sum" else PoolingMode.MEAN,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        stochastic_rounding=False,
        **kwargs,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("opt_name", "pooling", "weighted", "index_dtype"),
    [
        ("sgd", "sum", True, torch.int64),
        ("rowwise_adagrad", "sum", False, torch.int32),
        ("rowwise_adagrad", "mean", False, torch.int64),
    ],
)
def test_vbe_matches_fbgemm_cpu(backend, opt_name, pooling, weighted, index_dtype):
    device = device_for(backend)
    ours = TableBatchedEmbedding(TABLES, FTM, pooling=pooling, optimizer=OPTS[opt_name],
                                 backend=backend, device=device, stochastic_rounding=False)
    theirs = _fbgemm(opt_name, pooling)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        a.copy_(b.cpu())
    for step in range(3):
        indices, offsets, psw = _vbe_batch(step, weighted, index_dtype)
        out_t = theirs(indices, offsets, per_sample_weights=psw,
                       batch_size_per_feature_per_rank=BATCH_SIZES)
        move = (lambda x: x.to(device) if x is not None else None)
        out_o = ours(move(indices), move(offsets), move(psw),
                     batch_size_per_feature_per_rank=BATCH_SIZES)
        assert out_o.shape == out_t.shape == (sum(
            b * TABLES[FTM[t]][1] for t, per in enumerate(BATCH_SIZES) for b in per),)
        torch.testing.assert_close(out_o.cpu(), out_t, atol=1e-5, rtol=1e-5)
        grad = torch.randn(out_t.shape, generator=torch.Generator().manual_seed(50 + step))
        out_t.backward(grad)
        out_o.backward(grad.to(device))
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b.cpu(), a, atol=1e-5, rtol=1e-5)
    if opt_name == "sgd":  # FBGEMM lists no states at all for SGD
        return
    for a, b in zip(theirs.split_optimizer_states(), ours.split_optimizer_states(), strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y.cpu(), x.view_as(y), atol=1e-5, rtol=1e-4)


R, T, B_PAD, START = 2, len(FTM), 9, [0, 5]  # B_pad: the widest feature per rank (5 + 4)


def _fixed_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """The VBE bags as a fixed batch of B_PAD samples per feature, by hand: rank r's samples
    from START[r], the rest empty bags."""
    lengths = torch.zeros(T, B_PAD, dtype=torch.int64)
    bags = iter((offsets[1:] - offsets[:-1]).tolist())
    for t in range(T):
        for r in range(R):
            for b in range(BATCH_SIZES[t][r]):
                lengths[t, START[r] + b] = next(bags)
    fixed = torch.zeros(T * B_PAD + 1, dtype=torch.int64)
    fixed[1:] = lengths.reshape(-1).cumsum(0)
    return fixed


def _vbe_blocks(fixed: torch.Tensor) -> torch.Tensor:
    """A fixed batch's pooled [B_PAD, sum(D)] cut into FBGEMM's VBE layout, by hand."""
    dims = [TABLES[f][1] for f in FTM]
    col = [sum(dims[:t]) for t in range(T)]
    return torch.cat([
        fixed[START[r]: START[r] + BATCH_SIZES[t][r], col[t]: col[t] + dims[t]].reshape(-1)
        for r in range(R) for t in range(T)
    ])


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_vbe_equals_the_padded_fixed_batch_and_its_gradients(pooling):
    """Each VBE block is the matching rows of the same bags looked up as a fixed batch (the
    missing samples as empty bags); the weight and per-sample weight gradients agree."""
    tbe = TableBatchedEmbedding(TABLES, FTM, pooling=pooling, backend="reference")
    indices, offsets, psw = _vbe_batch(7, True)
    psw_a, psw_b = psw.clone().requires_grad_(), psw.clone().requires_grad_()
    got = tbe(indices, offsets, psw_a, batch_size_per_feature_per_rank=BATCH_SIZES)
    want = _vbe_blocks(tbe(indices, _fixed_offsets(offsets), psw_b))
    torch.testing.assert_close(got, want)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (gw_a, gp_a) = torch.autograd.grad(got, (tbe.weights, psw_a), g)
    (gw_b, gp_b) = torch.autograd.grad(want, (tbe.weights, psw_b), g)
    torch.testing.assert_close(gw_a, gw_b)
    torch.testing.assert_close(gp_a, gp_b)


def test_vbe_fused_adam_equals_the_fixed_batch():
    """Adam (FBGEMM's CPU TBE has no Adam to compare with): the VBE steps update rows and
    states as the same bags given as a fixed batch do."""
    opt = optim.Adam(lr=0.05, eps=1e-6)
    a = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend="reference")
    b = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend="reference")
    b.load_state_dict(a.state_dict())
    for step in range(3):
        indices, offsets, psw = _vbe_batch(step, True)
        out = a(indices, offsets, psw, batch_size_per_feature_per_rank=BATCH_SIZES)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        out.backward(g)
        _vbe_blocks(b(indices, _fixed_offsets(offsets), psw)).backward(g)
    assert a.step == b.step == 3
    torch.testing.assert_close(a.weights, b.weights)
    torch.testing.assert_close(a.momentum1, b.momentum1)
    torch.testing.assert_close(a.momentum2, b.momentum2)


def test_vbe_bad_batch_sizes_and_offsets_name_the_bound():
    tbe = TableBatchedEmbedding(TABLES, FTM, backend="reference")
    indices, offsets, _ = _vbe_batch(0, False)
    with pytest.raises(ValueError, match=r"expected 18 offsets, got \(17,\)"):
        tbe(indices, offsets[:-1], batch_size_per_feature_per_rank=BATCH_SIZES)
    with pytest.raises(ValueError, match=r"one list per feature \(4\), got 3"):
        tbe(indices, offsets, batch_size_per_feature_per_rank=BATCH_SIZES[:3])
    with pytest.raises(ValueError, match=r"batch_size_per_feature_per_rank\[2\]: expected 2"):
        tbe(indices, offsets, batch_size_per_feature_per_rank=[[3, 1], [2, 0], [5], [0, 4]])
    with pytest.raises(ValueError, match=r"\[1\]: expected 2 batch sizes >= 0"):
        vbe.vbe_layout([[3, 1], [2, -1]], [8, 8], torch.device("cpu"))
