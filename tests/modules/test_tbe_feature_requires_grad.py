"""``TableBatchedEmbedding.forward``'s ``feature_requires_grad`` (FBGEMM's): the per-sample
weights of a feature flagged 0 get a zero gradient; the rows' fused update is unchanged.
Checked against FBGEMM's CPU TBE (fixed batch) and against the unflagged lookup (VBE)."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for

TABLES, FTM = [(6, 4), (5, 8)], [0, 0, 1]  # FBGEMM CPU: a table's features adjacent
INDICES = torch.tensor([1, 2, 2, 0, 3, 4, 1, 0])
OFFSETS = torch.tensor([0, 2, 3, 5, 5, 7, 8])  # B = 2, an empty bag


def _run(module, flags, device="cpu", **kwargs):
    psw = torch.rand(INDICES.numel(), generator=torch.Generator().manual_seed(0))
    psw = psw.to(device).requires_grad_()
    out = module(INDICES.to(device), OFFSETS.to(device), psw, flags, **kwargs)
    out.backward(torch.arange(out.numel(), dtype=out.dtype, device=device).view_as(out) / 10)
    return psw.grad.cpu(), [w.detach().cpu().clone() for w in module.split_embedding_weights()]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_matches_fbgemm_cpu(backend):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )

    dev = device_for(backend)
    ours = TableBatchedEmbedding(TABLES, FTM, optimizer=optim.RowWiseAdagrad(lr=0.1),
                                 backend=backend, device=dev)
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(E, D, EmbeddingLocation.HOST, fb.ComputeDevice.CPU) for E, D in TABLES],
        feature_table_map=FTM, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1,
        eps=1e-8, pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        a.copy_(b.cpu())
    flags = torch.tensor([1, 0, 1], dtype=torch.int32)
    grad, weights = _run(ours, flags.to(dev), dev)
    grad_fb, weights_fb = _run(theirs, flags)
    torch.testing.assert_close(grad, grad_fb, atol=1e-5, rtol=1e-5)
    assert not grad[3:5].any() and grad[:3].all()  # feature 1's two ids: no gradient
    for a, b in zip(weights, weights_fb, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_vbe_and_bad_flags():
    """With VBE (feature 1 has 3 bags, the others 1): the flagged feature's weights get 0, the
    others the gradient of the unflagged lookup; the rows' update is the same."""
    bsfpr = [[1], [3], [1]]
    indices, offsets = torch.tensor([1, 2, 2, 0, 3, 4]), torch.tensor([0, 2, 3, 3, 5, 6])
    results = []
    for flags in (None, torch.tensor([True, False, True])):
        tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=optim.SGD(lr=0.5), backend="reference")
        with torch.no_grad():
            for t, w in enumerate(tbe.split_embedding_weights()):
                w.copy_(torch.linspace(-1, 1, w.numel()).view_as(w) * (t + 1))
        psw = torch.linspace(0.5, 1.5, 6).requires_grad_()
        out = tbe(indices, offsets, psw, flags, batch_size_per_feature_per_rank=bsfpr)
        out.backward(torch.linspace(-1, 2, out.numel()))
        results.append((psw.grad.clone(), tbe.split_embedding_weights()[0].detach().clone()))
    (g_all, w_all), (g_flag, w_flag) = results
    assert not g_flag[2:5].any() and g_all[2:5].abs().sum() > 0  # feature 1: ids 2..4
    torch.testing.assert_close(g_flag[[0, 1, 5]], g_all[[0, 1, 5]])
    assert torch.equal(w_flag, w_all)
    tbe = TableBatchedEmbedding(TABLES, FTM, backend="reference")
    with pytest.raises(ValueError, match=r"feature_requires_grad: expected a 1-D tensor of 3 "
                                         r"flags \(one per feature\), got shape \(2,\)"):
        tbe(INDICES, OFFSETS, torch.ones(8, requires_grad=True), torch.ones(2))
