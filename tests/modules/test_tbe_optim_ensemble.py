"""Ensemble rowwise Adagrad (``optim.EnsembleRowWiseAdagrad``, FBGEMM's
ENSEMBLE_ROWWISE_ADAGRAD). fbgemm-gpu-cpu 1.8.0's CPU TBE refuses it ("not supported in CPU
mode"), but FBGEMM runs it as two parts that do run on the CPU: its rowwise Adagrad update
(EXACT_ROWWISE_ADAGRAD's CPU TBE) and its Python ``ensemble_and_swap`` over whole tables before
each training lookup. The first test drives those two FBGEMM parts, step by step, against the
reference and CPU backends (Triton against the reference: ``test_tbe_module.py``); the second
checks fp16 rows with weight decay against the update written again in float64; the rest the
schedule's bounds, the errors and the configuration paths."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.helpers import device_for, make_batch, to, upstream_grad

TABLES, FTM = [(12, 8), (5, 3)], [0, 0, 1]  # mixed D (3 not a multiple of 4)
FBGEMM_TABLES = [(12, 8), (5, 4)]  # FBGEMM's TBE: every D a multiple of 4
SCHEDULE = dict(step_ema=2, step_swap=3, step_start=3, step_ema_coef=0.3)
"""Over 7 steps: EMAs before steps 2 (k <= step_start: coef 0), 4 and 6 (coef 0.3), swaps
before 3 and 6 (6: both, the swap taking the new average)."""


class _FbgemmEnsemble:
    """What FBGEMM's ``ensemble_and_swap`` reads of its TBE: the step, the tables, the states
    ``[momentum1, momentum2]`` (our slow copies beside a rowwise Adagrad TBE's accumulators)."""

    def __init__(self, tbe, slow):
        self.tbe, self.slow, self.embedding_specs = tbe, slow, tbe.embedding_specs
        self.iter_cpu = torch.zeros(1, dtype=torch.int64)

    def split_embedding_weights(self):
        return self.tbe.split_embedding_weights()

    def split_optimizer_states(self):
        return [[m[0], s] for m, s in zip(self.tbe.split_optimizer_states(), self.slow,
                                          strict=True)]


@pytest.mark.parametrize("backend,step_mode", [("reference", "use_iter"), ("cpu", "none")])
def test_matches_fbgemm_update_and_ensemble_step(backend, step_mode):
    """(Triton against the reference with this optimizer's table steps:
    ``tests/modules/test_tbe_module.py``'s ensemble case, fp16 rows.)"""
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )

    from tests.fbgemm_config import EnsembleModeDefinition, StepMode

    opt = optim.EnsembleRowWiseAdagrad(lr=0.2, eps=1e-6, step_mode=step_mode, **SCHEDULE)
    assert optim.spec_of(opt).fbgemm == "ENSEMBLE_ROWWISE_ADAGRAD"
    mode = EnsembleModeDefinition(step_mode=getattr(StepMode, step_mode.upper()), **SCHEDULE)
    dev = device_for(backend)
    ours = TableBatchedEmbedding(FBGEMM_TABLES, FTM, optimizer=opt, backend=backend, device=dev,
                                 stochastic_rounding=False)
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(E, D, EmbeddingLocation.HOST, fb.ComputeDevice.CPU) for E, D in FBGEMM_TABLES],
        feature_table_map=FTM, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.2,
        eps=1e-6, pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32)
    shim = _FbgemmEnsemble(theirs, [torch.zeros(E, D) for E, D in FBGEMM_TABLES])
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        a.copy_(b.cpu())
    g = torch.Generator().manual_seed(9)
    for step in range(7):
        indices, offsets, _ = make_batch(FBGEMM_TABLES, FTM, 3, 4, hot=True, generator=g)
        shim.iter_cpu.fill_(step + 1)  # FBGEMM's forward: iter += 1, then the table step
        with torch.no_grad():
            fb.SplitTableBatchedEmbeddingBagsCodegen.ensemble_and_swap(shim, _as_dict(mode))
        out = ours(*to(dev, indices, offsets)).cpu()
        ref = theirs(indices, offsets)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        up = upstream_grad(out, step)
        out.backward(up)
        ref.backward(up)
    assert int(offsets.diff().eq(0).sum()) > 0  # an empty bag
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b.detach().cpu(), a, atol=1e-5, rtol=1e-5)
    for t, (m1, slow) in enumerate(shim.split_optimizer_states()):
        mine = ours.split_optimizer_states()[t]
        torch.testing.assert_close(mine[0].cpu(), m1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine[1].cpu(), slow, atol=1e-5, rtol=1e-5)
        # step 6 averaged: use_iter keeps the slow copy, none zeroes it
        assert bool(slow.abs().sum() > 0) is (step_mode == "use_iter")


def _as_dict(mode) -> dict[str, float]:
    """FBGEMM's TBE keeps ``ensemble_mode`` as ``{field: float}``."""
    return {key: float(value) for key, value in mode.__dict__.items()}


def _table_step64(opt, w, s, k):
    """The whole-table step before the lookup of step ``k``, in float64, written from the
    docs: rows ``w`` and slow copy ``s`` [E, D]; returns (w, s, ema?, swap?)."""
    coef = 0.0 if k <= opt.step_start else opt.step_ema_coef
    ema, swap = k % opt.step_ema == 0, k % opt.step_swap == 0
    if ema:
        s = coef * s + (1 - coef) * w
    if swap:
        w = s.clone()
    if ema and opt.step_mode == "none":
        s = torch.zeros_like(s)
    return w, s, ema, swap


def _row_grads64(t, indices, offsets, up, B):
    """Table t's summed row gradients [E, D] (float64) and the rows the batch touched."""
    E, D = TABLES[t]
    grad, touched, col = torch.zeros(E, D, dtype=torch.float64), torch.zeros(E, dtype=bool), 0
    for f, tf in enumerate(FTM):
        for b in range(B) if tf == t else ():
            for i in indices[offsets[f * B + b]:offsets[f * B + b + 1]]:
                grad[i] += up[b, col:col + D].double()
                touched[i] = True
        col += TABLES[tf][1]
    return grad, touched


def test_fp16_rows_with_weight_decay_against_the_formula():
    """fp16 rows, ``decoupled`` and ``l2`` decay, ``step_mode="none"`` (the slow copy zeroed
    after each average: the swap before step 3 zeroes every row), duplicate ids and an empty
    bag: each step from the module's stored state, in float64, within fp16 rounding."""
    for wd_mode, backend in (("decoupled", "reference"), ("l2", "cpu")):
        opt = optim.EnsembleRowWiseAdagrad(lr=0.1, eps=1e-6, weight_decay=0.05,
                                           weight_decay_mode=wd_mode, step_mode="none",
                                           **SCHEDULE)
        torch.manual_seed(1)
        tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend,
                                    weights_dtype=torch.float16, stochastic_rounding=False)
        g = torch.Generator().manual_seed(5)
        schedule, empty = [], 0
        for step in range(6):
            w0 = [t.detach().double().clone() for t in tbe.split_embedding_weights()]
            st0 = [[x.double().clone() for x in ss] for ss in tbe.split_optimizer_states()]
            indices, offsets, _ = make_batch(TABLES, FTM, 3, 3, hot=True, generator=g)
            empty += int(offsets.diff().eq(0).sum())
            out = tbe(indices, offsets)
            up = upstream_grad(out, step)
            out.backward(up)
            for t in range(len(TABLES)):
                w, s, ema, swap = _table_step64(opt, w0[t], st0[t][1], step + 1)
                grad, hit = _row_grads64(t, indices, offsets, up, 3)
                gw = grad + opt.weight_decay * w if wd_mode == "l2" else grad
                m = st0[t][0].clone()
                m[hit] += (gw[hit] ** 2).mean(dim=1)
                rate = opt.lr / (m.sqrt() + opt.eps)
                corr = (torch.full_like(m, 1 - opt.lr * opt.weight_decay)
                        if wd_mode == "decoupled" else 1 - opt.weight_decay * rate)
                w = torch.where(hit[:, None], corr[:, None] * w - rate[:, None] * grad, w)
                got = tbe.split_optimizer_states()[t]
                torch.testing.assert_close(tbe.split_embedding_weights()[t].detach().double(), w,
                                           atol=8e-3, rtol=8e-3)
                torch.testing.assert_close(got[0].double(), m, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(got[1].double(), s, atol=1e-6, rtol=1e-6)
            schedule.append((ema, swap))
        assert schedule == [(False, False), (True, False), (False, True), (True, False),
                            (False, False), (True, True)]
        assert empty > 0


def test_schedule_both_sides_and_bad_values():
    opt = optim.EnsembleRowWiseAdagrad(**SCHEDULE)
    assert [opt.schedule(k) for k in (2, 3, 4, 6)] == [
        (True, False, 0.0), (False, True, 0.0), (True, False, 0.3), (True, True, 0.3)]
    owner = "EnsembleRowWiseAdagrad"
    for kwargs, message in [
        (dict(step_ema=0), r"step_ema: expected a number >= 1, got 0"),
        (dict(step_swap=0.5), r"step_swap: expected a number >= 1, got 0.5"),
        (dict(step_start=-1), r"step_start: expected a number >= 0, got -1"),
        (dict(step_ema_coef=1.5), r"step_ema_coef: expected a number in \[0, 1\], got 1.5"),
        (dict(lr=-0.1), r"lr: expected a number >= 0, got -0.1"),
        (dict(step_mode="iter"), r"step_mode: expected one of \[none, use_counter, use_iter\]"),
        (dict(weight_decay_mode="counter"), r"weight_decay_mode: expected one of \[none, l2, "
                                            r"decoupled\]"),
    ]:
        with pytest.raises(ValueError, match=rf"{owner}\.{message}"):
            optim.EnsembleRowWiseAdagrad(**kwargs)
    with pytest.raises(ValueError, match="expected no cached storage tiers"):
        TableBatchedEmbedding([(64, 4)], optimizer=opt, storage=["cached"])
    with pytest.raises(ValueError, match=r"optimizer_state_dtypes: expected keys among "
                                         r"\['momentum2'\] \(the states of ensemble_rowwise_"
                                         r"adagrad not kept in fp32\), got \['momentum1'\]"):
        TableBatchedEmbedding([(4, 4)], optimizer=opt, optimizer_state_dtypes={"momentum1":
                                                                                "fp16"})
    tbe = TableBatchedEmbedding([(4, 4)], optimizer=opt,
                                optimizer_state_dtypes={"momentum2": "fp16"})
    assert tbe.momentum2.dtype == torch.float16 and tbe.momentum1.dtype == torch.float32


def test_annotation_job_and_planner_take_it():
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    from fbtriton_dist.modules.fused_optim import EnsembleRowWiseAdagrad
    from fbtriton_dist.planner import state_bytes
    from fbtriton_dist.train.config import EmbeddingOptimizerConfig, FieldError, job_from_dict
    from fbtriton_dist.train.job import _embedding_optimizer, _state_dtypes
    from tests.fbgemm_config import EnsembleModeDefinition, StepMode

    want = optim.EnsembleRowWiseAdagrad(lr=0.2, weight_decay=0.1, weight_decay_mode="decoupled",
                                        step_mode="none", **SCHEDULE)
    fbgemm_kwargs = {"lr": 0.2, "weight_decay": 0.1,
                     "weight_decay_mode": WeightDecayMode.DECOUPLE,
                     "ensemble_mode": EnsembleModeDefinition(step_mode=StepMode.NONE, **SCHEDULE)}
    EnsembleRowWiseAdagrad([torch.zeros(1, requires_grad=True)], **fbgemm_kwargs)
    assert optim.from_torch(EnsembleRowWiseAdagrad, fbgemm_kwargs, "t") == want
    cls, kwargs = optim.torch_equivalent(want)
    assert cls is EnsembleRowWiseAdagrad and optim.from_torch(cls, kwargs, "t") == want
    with pytest.raises(ValueError, match="step_ema: expected it once"):
        optim.from_torch(cls, {**kwargs, "ensemble_mode": {"step_ema": 3}}, "t")
    with pytest.raises(ValueError, match="expected keywords among .* got 'momentum'"):
        EnsembleRowWiseAdagrad([torch.zeros(1, requires_grad=True)], momentum=0.9)
    job = EmbeddingOptimizerConfig(type="ensemble_rowwise_adagrad", lr=0.2, weight_decay=0.1,
                                   weight_decay_mode="decoupled", step_mode="none",
                                   **SCHEDULE)
    assert _embedding_optimizer(job) == want
    with pytest.raises(FieldError, match="step_swap: only supported with type: "
                                         "ensemble_rowwise_adagrad, got type: adam"):
        EmbeddingOptimizerConfig(type="adam", step_swap=2)
    with pytest.raises(FieldError, match="step_swap: expected a number >= 1.0, got 0.5"):
        EmbeddingOptimizerConfig(type="ensemble_rowwise_adagrad", step_swap=0.5)
    with pytest.raises(FieldError, match="step_mode: expected one of"):
        EmbeddingOptimizerConfig(type="ensemble_rowwise_adagrad", step_mode="iter")
    section = {"type": "ensemble_rowwise_adagrad", "lr": 0.2, "weight_decay": 0.1,
               "weight_decay_mode": "decoupled", "step_mode": "none", "state_dtype": "fp16",
               **SCHEDULE}
    cfg = job_from_dict({"tables": [{"name": "t0", "num_embeddings": 100, "embedding_dim": 8,
                                     "features": ["f0"]}],
                         "model": {"dense_arch": [8], "over_arch": [4, 1]},
                         "train": {"steps": 2}, "optimizer": {"embedding": section}})
    assert _embedding_optimizer(cfg.optimizer.embedding) == want
    assert _state_dtypes(cfg) == {"momentum2": "fp16"}  # momentum1 stays fp32, as FBGEMM's
    # the planner: momentum1 fp32 per row, momentum2 per element at the job's state dtype
    assert state_bytes("ensemble_rowwise_adagrad", 10, 8) == 10 * 4 + 10 * 8 * 4
    assert state_bytes("ensemble_rowwise_adagrad", 10, 8, "fp16") == 10 * 4 + 10 * 8 * 2


def test_traced_collection_refuses_it():
    """The registered lookup ops (FX, torch.compile, torch.export) look up without the
    module's training forward, so the whole-table step would not run: refused."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tests.modules.test_ebc_tracing import _kjt, _pair

    cls, kwargs = optim.torch_equivalent(optim.EnsembleRowWiseAdagrad(step_ema=1))
    _, model = _pair(False)
    apply_optimizer_in_backward(cls, model.ebc.parameters(), kwargs)
    model(_kjt(3, 0, False))  # eager: fine
    with pytest.raises(ValueError, match="ensemble_rowwise_adagrad: expected an eager "
                                         "collection .* whole-table step"):
        torch.fx.symbolic_trace(model)(_kjt(3, 1, False))
