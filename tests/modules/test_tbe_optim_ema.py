"""EMA-in-place rowwise Adagrad (``optim.EmaInplaceRowWiseAdagrad``, FBGEMM's
EMAINPLACE_ROWWISE_ADAGRAD) against FBGEMM's CPU TBE, which runs it (its rowwise Adagrad
update, then before the lookups of steps ``k % step_ema == 0, k >= step_start`` the moving
average of every table's second half of columns toward its first): rows and states after 5
steps over duplicate (hot) ids, empty bags and per-sample weights, on every backend."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for, make_batch, to, upstream_grad

TABLES, FTM = [(12, 8), (5, 4)], [0, 0, 1]  # FBGEMM CPU: a table's features adjacent
OPT = optim.EmaInplaceRowWiseAdagrad(lr=0.2, eps=1e-6, step_ema=2, step_start=3,
                                     step_ema_coef=0.3)


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

    from tests.fbgemm_config import EmainplaceModeDefinition

    dev = device_for(backend)
    ours = TableBatchedEmbedding(TABLES, FTM, optimizer=OPT, backend=backend, device=dev,
                                 stochastic_rounding=False)
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(E, D, EmbeddingLocation.HOST, fb.ComputeDevice.CPU) for E, D in TABLES],
        feature_table_map=FTM, optimizer=getattr(EmbOptimType, optim.spec_of(OPT).fbgemm),
        learning_rate=0.2, eps=1e-6, pooling_mode=PoolingMode.SUM,
        weights_precision=SparseType.FP32, output_dtype=SparseType.FP32,
        emainplace_mode=EmainplaceModeDefinition(step_ema=2, step_start=3, step_ema_coef=0.3))
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        a.copy_(b.cpu())
    before = [w.clone() for w in theirs.split_embedding_weights()]
    g = torch.Generator().manual_seed(9)
    for step in range(5):
        indices, offsets, psw = make_batch(TABLES, FTM, 3, 4, hot=True, weighted=step % 2 == 0,
                                           generator=g)
        out = ours(*to(dev, indices, offsets, psw)).cpu()
        ref = theirs(indices, offsets, per_sample_weights=psw)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        up = upstream_grad(out, step)
        out.backward(up)
        ref.backward(up)
    assert int(offsets.diff().eq(0).sum()) > 0  # an empty bag
    for a, b, w0 in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), before,
                        strict=True):
        torch.testing.assert_close(b.detach().cpu(), a, atol=1e-5, rtol=1e-5)
        assert not torch.equal(a, w0)
    for a, b in zip(theirs.split_optimizer_states(), ours.split_optimizer_states(), strict=True):
        torch.testing.assert_close(b[0].cpu().reshape(a[0].shape), a[0], atol=1e-5, rtol=1e-4)


def test_the_moving_average_runs_on_schedule_over_whole_tables():
    """Both sides of the schedule: with no gradient on table 1's rows, its rows change only
    before the lookups of steps 4 and 6 (k % 2 == 0, k >= 3), by the formula, half 1 only."""
    tbe = TableBatchedEmbedding([(4, 4), (3, 6)], [0], optimizer=OPT, backend="reference")
    w1 = tbe.split_embedding_weights()[1]
    seen = [w1.detach().clone().double()]
    for _ in range(6):
        out = tbe(torch.tensor([1, 2]), torch.tensor([0, 2]))
        out.backward(torch.ones_like(out))
        seen.append(w1.detach().clone().double())
    for k in range(1, 7):
        expected = seen[k - 1].clone()
        if k in (4, 6):
            expected[:, 3:] += 0.3 * (expected[:, :3] - expected[:, 3:])
        torch.testing.assert_close(seen[k], expected, atol=1e-6, rtol=1e-6)
        assert torch.equal(seen[k][:, :3], seen[0][:, :3])  # the first half never moves
    assert not torch.equal(seen[4], seen[3]) and torch.equal(seen[5], seen[4])
    tbe.eval()  # no moving average outside training
    out = tbe(torch.tensor([1, 2]), torch.tensor([0, 2]))
    out.backward(torch.ones_like(out))
    assert tbe.step == 7 and torch.equal(w1.detach().double(), seen[6])


def test_bad_values_and_odd_dims():
    owner = "EmaInplaceRowWiseAdagrad"
    with pytest.raises(ValueError, match=rf"{owner}.step_ema: expected a number >= 1, got 0"):
        optim.EmaInplaceRowWiseAdagrad(step_ema=0)
    with pytest.raises(ValueError, match=rf"{owner}.step_ema_coef: expected a number in "
                                         r"\[0, 1\], got 1.5"):
        optim.EmaInplaceRowWiseAdagrad(step_ema_coef=1.5)
    with pytest.raises(ValueError, match=rf"{owner}.step_start: expected a number >= 0"):
        optim.EmaInplaceRowWiseAdagrad(step_start=-1)
    with pytest.raises(ValueError, match=rf"{owner}.lr: expected a number >= 0"):
        optim.EmaInplaceRowWiseAdagrad(lr=-0.1)
    with pytest.raises(ValueError, match=rf"{owner}.weight_decay_mode: expected one of"):
        optim.EmaInplaceRowWiseAdagrad(weight_decay_mode="counter")
    tbe = TableBatchedEmbedding([(4, 3)], optimizer=optim.EmaInplaceRowWiseAdagrad(step_ema=1),
                                backend="reference")
    with pytest.raises(ValueError, match=r"expected every table's D even .*got tables "
                                         r"\['0 \(D=3\)'\]"):
        tbe(torch.tensor([1]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="expected no cached storage tiers"):
        TableBatchedEmbedding([(64, 4)], optimizer=OPT, storage=["cached"])


def test_job_and_annotation_take_it():
    from fbtriton_dist.modules.fused_optim import EmaInplaceRowWiseAdagrad
    from fbtriton_dist.train.config import EmbeddingOptimizerConfig, FieldError
    from fbtriton_dist.train.job import _embedding_optimizer

    job = EmbeddingOptimizerConfig(type="emainplace_rowwise_adagrad", lr=0.2, eps=1e-6,
                                   step_ema=2, step_start=3, step_ema_coef=0.3)
    assert _embedding_optimizer(job) == OPT
    with pytest.raises(FieldError, match="step_ema: only supported with type: "
                                         "emainplace_rowwise_adagrad, ensemble_rowwise_adagrad, "
                                         "got type: adam"):
        EmbeddingOptimizerConfig(type="adam", step_ema=2)
    with pytest.raises(FieldError, match="step_ema: expected a number >= 1.0, got 0.5"):
        EmbeddingOptimizerConfig(type="emainplace_rowwise_adagrad", step_ema=0.5)
    cls, kwargs = optim.torch_equivalent(OPT)
    assert cls is EmaInplaceRowWiseAdagrad and optim.from_torch(cls, kwargs, "t") == OPT


def test_traced_collection_refuses_it():
    """The registered lookup ops (FX, torch.compile, torch.export) look up outside the
    module's training forward, where the moving average runs: refused (it would be skipped
    silently), naming the optimizer; the eager collection trains."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tests.modules.test_ebc_tracing import _kjt, _pair

    cls, kwargs = optim.torch_equivalent(optim.EmaInplaceRowWiseAdagrad(step_ema=1000))
    _, model = _pair(False)
    apply_optimizer_in_backward(cls, model.ebc.parameters(), kwargs)
    model(_kjt(3, 0, False))  # eager: fine
    with pytest.raises(ValueError, match="emainplace_rowwise_adagrad: expected an eager "
                                         "collection .* whole-table step"):
        torch.fx.symbolic_trace(model)(_kjt(3, 1, False))
