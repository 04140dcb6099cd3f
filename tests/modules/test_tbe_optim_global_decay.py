"""Rowwise Adagrad with global weight decay (``optim.RowWiseAdagradGlobalDecay``: FBGEMM's rowwise
Adagrad with ``weight_decay_mode`` DECOUPLE_GLOBAL) on the reference, CPU and Triton backends.

fbgemm-gpu-cpu 1.8.0's CPU TBE does not run this mode once the decay starts (its forward asks
for a ``..._gwd_pt2_wrapper`` op the CPU build lacks); before ``start_iter`` it is plain
DECOUPLE, and that side is compared with it. The rest is checked against the update written
again below in float64, step by step: rows untouched for some steps then touched (on both sides
of ``start_iter``, and past the ``lower_bound`` clamp), duplicate ids, empty bags, two features
on one table."""

import pytest
import torch
import torch.nn.functional as F

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops.global_decay import global_decay
from fbtriton_dist.optim_gwd import GlobalWeightDecay
from fbtriton_dist.reference import global_decay as reference
from tests.helpers import device_for, to, upstream_grad

TABLES, FTM, B = [(6, 4), (3, 8)], [0, 0, 1], 2  # FBGEMM CPU: D a multiple of 4
LR, WD = 0.5, 0.6  # each step keeps 1 - LR * WD = 0.7 of a row


def _opt(start_iter=3, lower_bound=0.3):
    return optim.RowWiseAdagradGlobalDecay(lr=LR, eps=1e-6, weight_decay=WD, global_weight_decay=
                                           GlobalWeightDecay(start_iter=start_iter,
                                                             lower_bound=lower_bound))


# per step, per feature, per bag: the ids. Table 0 (features 0 and 1): row 0 at steps 1 (before
# start_iter 3), 4 (its first catch-up: none, prev_iter 0) and 9 (4 steps missed: 0.7^4 < 0.3,
# clamped); row 1 at 3 and 6 (2 missed); row 2 at 3 and 4 (none missed), twice in a bag and
# from both features; row 5 only at 2 (before the start: prev_iter stays 0). Empty bags.
SCHEDULE = [
    [[[0], [3]], [[], [4]], [[1, 2], []]],  # step 1
    [[[5], []], [[3], []], [[], []]],
    [[[1, 2, 2], []], [[2], [4]], [[0], [2]]],
    [[[0], [2]], [[], []], [[1], []]],
    [[[], [3]], [[], []], [[], [2]]],
    [[[1], []], [[4], []], [[0], []]],
    [[[], []], [[], []], [[], []]],  # nobody: every bag empty
    [[[3], []], [[], [3]], [[2], []]],
    [[[0, 0], [4]], [[], []], [[1], []]],  # step 9
]


def _batch(step):
    bags = [ids for feature in SCHEDULE[step] for ids in feature]
    offsets = torch.tensor([0, *torch.tensor([len(b) for b in bags]).cumsum(0).tolist()])
    return torch.tensor([i for b in bags for i in b], dtype=torch.int64), offsets


def _w0():
    n = sum(E * D for E, D in TABLES)
    return torch.linspace(-1.0, 1.0, n).sin().add(0.3)


def _run(opt, backend, steps, w0=None, tbe=None, first=0):
    if tbe is None:
        tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend,
                                    stochastic_rounding=False, device=device_for(backend))
        with torch.no_grad():
            tbe.weights.copy_(_w0() if w0 is None else w0)
    outs = []
    for step in range(first, steps):
        out = tbe(*to(tbe.weights.device, *_batch(step)))
        out.backward(upstream_grad(out, step))
        outs.append(out.detach().cpu())
    return tbe, outs


def _expected(opt, steps):
    """The rows, accumulators, ``prev_iter`` and pooled outputs after ``steps`` steps, in
    float64: before the lookup of step t >= start_iter each touched row is multiplied by
    ``max(lower_bound, 0.7^(t - prev - 1))`` (1 where prev is 0) and prev becomes t; the
    lookup reads the decayed rows; then each touched row gets ``m += mean(g^2)``, ``w = 0.7 w
    - lr g / (sqrt(m) + eps)``."""
    sizes = [E * D for E, D in TABLES]
    weights = [w.double().view(E, D).clone() for w, (E, D)
               in zip(_w0().split(sizes), TABLES, strict=True)]
    m = [torch.zeros(E, dtype=torch.float64) for E, _ in TABLES]
    prev = [torch.zeros(E, dtype=torch.float64) for E, _ in TABLES]
    gwd, outs = opt.global_weight_decay, []
    for t in range(1, steps + 1):
        indices, offsets = _batch(t - 1)
        touched = [set() for _ in TABLES]
        for f, table in enumerate(FTM):
            touched[table].update(indices[offsets[f * B]: offsets[(f + 1) * B]].tolist())
        if t >= gwd.start_iter:
            for table, rows in enumerate(touched):
                for r in rows:
                    p = float(prev[table][r])
                    if p != 0:
                        weights[table][r] *= max(gwd.lower_bound, 0.7 ** max(t - p - 1, 0))
                    prev[table][r] = t
        params = [w.clone().requires_grad_() for w in weights]
        pooled = []
        for f, table in enumerate(FTM):
            o = offsets[f * B: (f + 1) * B + 1]
            pooled.append(F.embedding_bag(indices[o[0]: o[-1]], params[table], o[:-1] - o[0],
                                          mode="sum"))
        out = torch.cat(pooled, dim=1)
        out.backward(upstream_grad(out, t - 1).double())
        outs.append(out.detach())
        for table, rows in enumerate(touched):
            for r in rows:
                g = params[table].grad[r]
                m[table][r] += (g * g).mean()
                rate = LR / (m[table][r].sqrt() + 1e-6)
                weights[table][r] = (1 - LR * WD) * weights[table][r] - rate * g
    return weights, m, prev, outs


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_matches_the_update_formula(backend):
    opt, steps = _opt(), len(SCHEDULE)
    tbe, outs = _run(opt, backend, steps)
    weights, m, prev, expected_outs = _expected(opt, steps)
    for got, want in zip(outs, expected_outs, strict=True):  # the lookups read decayed rows
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)
    for t, (w, states) in enumerate(zip(tbe.split_embedding_weights(),
                                        tbe.split_optimizer_states(), strict=True)):
        torch.testing.assert_close(w.detach().cpu().double(), weights[t], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(states[0].cpu().double(), m[t], atol=2e-5, rtol=1e-5)
        assert torch.equal(states[1].cpu().double(), prev[t])  # prev_iter: exact step numbers
    # the schedule's cases happened: row 0 clamped at 9, row 5 never caught up, row 4 of
    # table 0 last seen at step 9 (prev 9)
    assert prev[0].tolist() == [9, 6, 4, 8, 9, 0] and 0.7 ** 4 < 0.3


def test_start_iter_and_lower_bound_both_sides():
    """A row touched at steps 1 and 4 (start_iter 3): no catch-up at 4 (prev_iter 0 until the
    decay started); one touched at 3 and 6: 0.7^2; at 3 and 9 with lower_bound 0.3: 0.7^5
    clamped to 0.3, with lower_bound 0.1 not clamped. Checked on the factors directly."""
    f = reference.decay_factor
    assert f(0.0, 4, LR, WD, 0.3) == 1.0
    assert f(3.0, 6, LR, WD, 0.3) == pytest.approx(0.49)
    assert f(3.0, 9, LR, WD, 0.3) == 0.3 and f(3.0, 9, LR, WD, 0.1) == pytest.approx(0.7 ** 5)
    assert f(5.0, 6, LR, WD, 0.0) == 1.0  # the step right after: nothing missed
    assert not reference.lazy_decay_applies(_opt(start_iter=3), 2)
    assert reference.lazy_decay_applies(_opt(start_iter=3), 3)
    no_decay = optim.RowWiseAdagradGlobalDecay(lr=LR, weight_decay=0.0)
    assert not reference.lazy_decay_applies(no_decay, 10)  # FBGEMM: only with weight_decay > 0


def test_op_matches_its_reference_twin():
    """``ops.global_decay`` (vectorised) against ``reference.global_decay`` (one id at a time):
    duplicate ids, two features on one table, an id out of range (7: left to the bounds check,
    its state row 7 untouched), an empty bag, fp16 rows."""
    opt = _opt(start_iter=1, lower_bound=0.2)
    indices = torch.tensor([0, 2, 2, 7, 2, 1, 0])
    offsets = torch.tensor([0, 2, 4, 5, 6, 7, 7])
    features = [(0, 0, 6, 4), (0, 0, 6, 4), (24, 6, 3, 8)]
    for dtype in (torch.float32, torch.float16):
        w = _w0().to(dtype)
        prev = torch.tensor([0.0, 3, 2, 0, 0, 0, 1, 5, 0])
        w2, prev2 = w.clone(), prev.clone()
        global_decay(w, prev, indices, offsets, features, 6, opt)
        reference.global_decay(w2, prev2, indices, offsets, features, 6, opt)
        assert torch.equal(prev, prev2) and prev.tolist() == [6, 6, 6, 0, 0, 0, 6, 5, 0]
        torch.testing.assert_close(w, w2, atol=1e-3 if dtype == torch.float16 else 1e-6,
                                   rtol=1e-3 if dtype == torch.float16 else 1e-6)
        assert not torch.equal(w, _w0().to(dtype))


def test_before_start_iter_matches_fbgemm_cpu():
    """Before ``start_iter`` FBGEMM's DECOUPLE_GLOBAL is its DECOUPLE on the touched rows and
    leaves ``prev_iter`` at 0: fbgemm-gpu-cpu's TBE against ours, 3 steps. Its CPU TBE decays
    the D=4 table but not the D=8 one (checked: those rows equal a run without decay), so rows
    are compared on the D=4 table; ``momentum1`` and ``prev_iter`` on both."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from tests.fbgemm_config import GlobalWeightDecayDefinition, WeightDecayMode

    fb = SplitTableBatchedEmbeddingBagsCodegen(
        [(E, D, EmbeddingLocation.HOST, ComputeDevice.CPU) for E, D in TABLES],
        feature_table_map=FTM, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR,
        eps=1e-6, weight_decay=WD, weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL,
        global_weight_decay=GlobalWeightDecayDefinition(start_iter=100, lower_bound=0.3))
    sizes = [E * D for E, D in TABLES]
    with torch.no_grad():
        for dst, src in zip(fb.split_embedding_weights(), _w0().split(sizes), strict=True):
            dst.copy_(src.view_as(dst))
    for step in range(3):
        out = fb(*_batch(step))
        out.backward(upstream_grad(out, step))
    ours, _ = _run(_opt(start_iter=100), "cpu", 3)
    torch.testing.assert_close(ours.split_embedding_weights()[0].detach(),
                               fb.split_embedding_weights()[0], atol=1e-6, rtol=1e-6)
    for a, b in zip(fb.split_optimizer_states(), ours.split_optimizer_states(), strict=True):
        torch.testing.assert_close(b[0], a[0], atol=1e-6, rtol=1e-6)  # momentum1
        assert not a[1].any() and not b[1].any()  # prev_iter: 0 before the decay starts


def test_eval_and_no_grad_lookups_leave_rows_alone():
    """Only a training lookup pays the catch-up (FBGEMM: ``self.training``): an eval-mode or
    ``no_grad`` lookup reads the stored rows and changes no state."""
    tbe, _ = _run(_opt(start_iter=1), "cpu", 4)
    before = (tbe.weights.detach().clone(), tbe.prev_iter.clone(), tbe.step)
    with torch.no_grad():
        tbe(*_batch(5))
    tbe.eval()
    tbe(*_batch(5))
    assert torch.equal(tbe.weights, before[0]) and torch.equal(tbe.prev_iter, before[1])
    assert tbe.step == before[2] == 4


def test_state_dict_resumes_exactly():
    """The module's state dict holds ``momentum1``, ``prev_iter`` (FBGEMM's names) and the step
    (FBGEMM's ``iter``): a module loaded after 4 steps takes the next 5 as the uninterrupted
    one does."""
    opt = _opt()
    whole, _ = _run(opt, "cpu", len(SCHEDULE))
    first, _ = _run(opt, "cpu", 4)
    state = first.state_dict()
    assert {"momentum1", "prev_iter"} <= set(state) and state["_extra_state"]["step"] == 4
    resumed = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend="cpu",
                                    stochastic_rounding=False)
    resumed.load_state_dict(state)
    _run(opt, "cpu", len(SCHEDULE), tbe=resumed, first=4)
    assert torch.equal(resumed.weights, whole.weights)
    assert torch.equal(resumed.prev_iter, whole.prev_iter)
    assert torch.equal(resumed.momentum1, whole.momentum1)


def test_config_mappings_and_job_yaml():
    """Bad values name their key; TorchRec's RowWiseAdagrad annotation with FBGEMM's
    DECOUPLE_GLOBAL arguments, our annotation class and the job's ``weight_decay_mode:
    decoupled_global`` + ``global_weight_decay:`` give the same config; the planner counts
    ``momentum1`` (at the job's dtype) + ``prev_iter`` (fp32); cached tiers are refused."""
    from torchrec.optim import RowWiseAdagrad

    from fbtriton_dist.planner import ConfigError, state_bytes
    from fbtriton_dist.storage import Storage
    from fbtriton_dist.train.config import job_from_dict
    from fbtriton_dist.train.job import _embedding_optimizer, _state_dtypes
    from tests.fbgemm_config import GlobalWeightDecayDefinition, WeightDecayMode

    for kwargs, message in (
            ({"global_weight_decay": {"lower_bound": 1.5}},
             r"global_weight_decay.lower_bound: expected a number in \[0, 1\], got 1.5"),
            ({"global_weight_decay": {"start_iter": 2.5}},
             r"global_weight_decay.start_iter: expected an integer, got 2.5"),
            ({"weight_decay": -1.0}, r"RowWiseAdagradGlobalDecay.weight_decay: expected a "
                                     r"number >= 0"),
            ({"weight_decay_mode": "decoupled"}, r"weight_decay_mode: expected "
                                                 r"'decoupled_global'")):
        with pytest.raises(ValueError, match=message):
            optim.RowWiseAdagradGlobalDecay(**kwargs)
    with pytest.raises(ValueError, match=r"decoupled_global: RowWiseAdagradGlobalDecay"):
        optim.RowWiseAdagrad(weight_decay_mode=WeightDecayMode.DECOUPLE_GLOBAL)

    opt = optim.RowWiseAdagradGlobalDecay(lr=0.3, eps=1e-6, weight_decay=0.2,
                                          global_weight_decay={"start_iter": 5,
                                                               "lower_bound": 0.1})
    kwargs = {"lr": 0.3, "eps": 1e-6, "weight_decay": 0.2,
              "weight_decay_mode": WeightDecayMode.DECOUPLE_GLOBAL,
              "global_weight_decay": GlobalWeightDecayDefinition(start_iter=5, lower_bound=0.1)}
    assert optim.from_torch(RowWiseAdagrad, kwargs, "t") == opt
    cls, back = optim.torch_equivalent(opt)
    assert cls.__name__ == "RowWiseAdagradGlobalDecay" and optim.from_torch(cls, back, "t") == opt

    tables = [{"name": "t0", "num_embeddings": 100, "embedding_dim": 8, "features": ["f0"]}]
    section = {"type": "rowwise_adagrad", "lr": 0.3, "eps": 1e-6, "weight_decay": 0.2,
               "weight_decay_mode": "decoupled_global", "state_dtype": "bf16",
               "global_weight_decay": {"start_iter": 5, "lower_bound": 0.1}}
    base = {"tables": tables, "model": {"dense_arch": [8], "over_arch": [4, 1]},
            "train": {"steps": 2}}
    cfg = job_from_dict({**base, "optimizer": {"embedding": section}})
    assert cfg.optimizer.embedding.optimizer_name == "rowwise_adagrad_global_decay"
    assert _embedding_optimizer(cfg.optimizer.embedding) == opt
    assert _state_dtypes(cfg) == {"momentum1": "bf16"}  # prev_iter: step numbers, fp32
    assert state_bytes("rowwise_adagrad_global_decay", 10, 8, "bf16") == 10 * (2 + 4)
    bad = {**section, "global_weight_decay": {"lower_bound": "x"}}
    with pytest.raises(ConfigError, match=r"optimizer.embedding.global_weight_decay.lower_bound: "
                                          r"expected a number in \[0, 1\], got 'x'"):
        job_from_dict({**base, "optimizer": {"embedding": bad}})
    plain = {k: v for k, v in section.items() if k != "weight_decay_mode"}
    with pytest.raises(ConfigError, match=r"optimizer.embedding.global_weight_decay: only "
                                          r"supported with weight_decay_mode: decoupled_global"):
        job_from_dict({**base, "optimizer": {"embedding": plain}})
    with pytest.raises(ValueError, match=r"expected no cached storage tiers"):
        TableBatchedEmbedding(TABLES, FTM, optimizer=opt,
                              storage=[Storage(tier="cached", cache_slots=2), Storage()])


def test_traced_collection_refuses_it():
    """The registered lookup ops (FX, torch.compile, torch.export) do not run the catch-up:
    refused, not trained without it."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tests.modules.test_ebc_tracing import _kjt, _pair

    cls, kwargs = optim.torch_equivalent(_opt())
    _, model = _pair(False)
    apply_optimizer_in_backward(cls, model.ebc.parameters(), kwargs)
    model(_kjt(3, 0, False))  # eager: fine
    with pytest.raises(ValueError, match="rowwise_adagrad_global_decay: expected an eager "
                                         "collection"):
        torch.fx.symbolic_trace(model)(_kjt(3, 1, False))


def test_job_checkpoint_resumes_the_decay(tmp_path):
    """A job with ``weight_decay_mode: decoupled_global`` resumed from its step-5 checkpoint
    (``prev_iter`` and the step saved with the tables) repeats the uninterrupted run's losses."""
    from tests.train.test_job import losses, main, write_job

    opt = {"embedding": {"type": "rowwise_adagrad", "lr": 0.05, "weight_decay": 0.5,
                         "weight_decay_mode": "decoupled_global",
                         "global_weight_decay": {"start_iter": 3, "lower_bound": 0.2}},
           "dense": {"type": "adam", "lr": 0.01}}
    common = {"logging__log_every": 1, "train__steps": 10, "train__eval_every": 0,
              "train__eval_batches": 0, "checkpoint__every": 5, "optimizer": opt}
    full, half = write_job(tmp_path, "full", **common), write_job(tmp_path, "half", **common)
    assert main(["--config", str(full)]) == 0
    assert main(["--config", str(half), "--steps", "5"]) == 0
    assert main(["--config", str(half), "--resume"]) == 0
    want, got = losses(tmp_path / "full"), losses(tmp_path / "half")
    assert sorted(got) == list(range(1, 11))
    for step in range(6, 11):
        assert got[step] == pytest.approx(want[step], abs=1e-6, rel=0), step


def test_unpooled_lookups_run_the_same_catch_up():
    """``pooling="none"`` (the EmbeddingCollection's TBE) runs the same catch-up: after the
    schedule its ``prev_iter`` is the pooled module's (it depends on the ids only)."""
    pooled, _ = _run(_opt(), "cpu", len(SCHEDULE))
    tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=_opt(), backend="cpu", pooling="none",
                                stochastic_rounding=False)
    for step in range(len(SCHEDULE)):
        out = tbe(*_batch(step))
        out.backward(torch.ones_like(out))
    assert torch.equal(tbe.prev_iter, pooled.prev_iter) and tbe.step == len(SCHEDULE)
