"""Rowwise Adagrad with counter (``optim.RowWiseAdagradWithCounter``: FBGEMM's rowwise Adagrad
with ``weight_decay_mode`` COUNTER or COWCLIP) on the reference and the CPU backend.

fbgemm-gpu-cpu 1.8.0's CPU TBE runs this update (checked: unlike its L2 / DECOUPLE modes of
plain rowwise Adagrad, the counter's decay is applied), so the rows and the three per-row
states are compared with it step by step. Its ``max_counter`` stays 1 on the CPU (it reads
the device copy of the counters, empty there), so those cases never refresh it; the
refresh, the tail-id ratio and the rest are checked against the update written again below,
row by row in float64. Batches: duplicate (hot) ids, empty bags, rows touched at different
steps (and per-sample weights in the comparison with FBGEMM)."""

import math

import pytest
import torch
import torch.nn.functional as F

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.optim_counter import CounterBasedRegularization, CowClipRegularization
from tests.helpers import make_batch, upstream_grad

TABLES, FTM, B, MAX_L = [(12, 4), (5, 8)], [0, 0, 1], 3, 4  # FBGEMM CPU: features adjacent


def _counter(**kw):
    return optim.RowWiseAdagradWithCounter(
        lr=0.3, eps=1e-6, weight_decay=kw.pop("wd", 0.2),
        counter_based_regularization=CounterBasedRegularization(**kw))


def _cowclip(**kw):
    return optim.RowWiseAdagradWithCounter(
        lr=0.3, eps=1e-6, weight_decay=0.2, weight_decay_mode="cowclip",
        cowclip_regularization=CowClipRegularization(**kw))


FBGEMM_CASES = {  # max_counter is never refreshed (FBGEMM's CPU keeps it at 1)
    "decoupled-decrease": _counter(counter_weight_decay_mode="decoupled", counter_halflife=2,
                                   adjustment_iter=2, adjustment_ub=2.0, tail_id_threshold=1.2,
                                   learning_rate_mode="tail_id_lr_decrease"),
    "l2-counter_sgd": _counter(counter_weight_decay_mode="l2", counter_halflife=-1,
                               adjustment_ub=3.0, tail_id_threshold=1.5,
                               learning_rate_mode="counter_sgd"),
    "adagradw": _counter(counter_weight_decay_mode="adagradw", counter_halflife=-1,
                         adjustment_iter=1, wd=0.5),
    "adagradw-2": _counter(counter_weight_decay_mode="adagradw", counter_halflife=-2,
                           adjustment_ub=0.2, wd=0.3),
    "cowclip-l2": _cowclip(counter_weight_decay_mode="l2", counter_halflife=3,
                           weight_norm_coefficient=0.5, lower_bound=0.01),
    "cowclip-decoupled": _cowclip(counter_weight_decay_mode="decoupled", counter_halflife=0,
                                  weight_norm_coefficient=0.05, lower_bound=0.001),
}
FORMULA_CASES = {  # max_counter refreshed every 2 steps; the tail threshold a ratio of it
    "increase-ratio": _counter(counter_weight_decay_mode="decoupled", counter_halflife=2,
                               adjustment_ub=1.5, learning_rate_mode="tail_id_lr_increase",
                               tail_id_threshold=0.5, tail_id_threshold_is_ratio=True,
                               max_counter_update_freq=2),
    "decrease-l2": _counter(counter_weight_decay_mode="l2", counter_halflife=-1,
                            adjustment_ub=2.0, learning_rate_mode="tail_id_lr_decrease",
                            tail_id_threshold=1.0, max_counter_update_freq=2),
}


def _batches(steps=4, weighted=False):
    """Batches whose rows are touched at different steps (every third step skips table 1's
    feature: empty bags), with hot ids (``weighted``: and per-sample weights)."""
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(steps):
        indices, offsets, psw = make_batch(TABLES, FTM, B, MAX_L, hot=True, generator=g,
                                           weighted=weighted)
        if step % 3 == 1:  # no ids for table 1 this step
            cut = int(offsets[2 * B])
            indices, offsets = indices[:cut], torch.cat([offsets[: 2 * B + 1],
                                                         offsets.new_full((B,), cut)])
            psw = psw[:cut] if psw is not None else None
        out.append((indices, offsets, psw))
    return out


def _run(opt, backend, w0, batches, state_dtypes=None):
    tbe = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend,
                                stochastic_rounding=False, optimizer_state_dtypes=state_dtypes)
    with torch.no_grad():
        tbe.weights.copy_(w0)
    for step, (indices, offsets, psw) in enumerate(batches):
        out = tbe(indices, offsets, psw)
        out.backward(upstream_grad(out, step))
    return tbe


def _w0():
    return TableBatchedEmbedding(TABLES, FTM).weights.detach().clone()


def _split(w0):
    """The flat weights ``w0`` as [E, D] tables (no padding between tables here)."""
    sizes = [E * D for E, D in TABLES]
    return [w.view(E, D) for w, (E, D) in zip(w0.split(sizes), TABLES, strict=True)]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", list(FBGEMM_CASES))
def test_matches_fbgemm_cpu(case, backend):
    """Rows, ``momentum1``, ``prev_iter`` and ``row_counter`` after 4 steps against FBGEMM's
    CPU TBE given the same arguments (FBGEMM's definitions, mapped by ``from_torch``)."""
    fb = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from torchrec.optim import RowWiseAdagrad

    from tests.fbgemm_config import (
        CounterBasedRegularizationDefinition,
        CounterWeightDecayMode,
        CowClipDefinition,
        LearningRateMode,
        TailIdThreshold,
        WeightDecayMode,
    )

    opt = FBGEMM_CASES[case]
    reg = opt.regularization
    wd_mode = getattr(CounterWeightDecayMode, {"decoupled": "DECOUPLE"}.get(
        reg.counter_weight_decay_mode, reg.counter_weight_decay_mode.upper()))
    if opt.weight_decay_mode == "counter":
        definition = dict(counter_based_regularization=CounterBasedRegularizationDefinition(
            counter_weight_decay_mode=wd_mode, counter_halflife=reg.counter_halflife,
            adjustment_iter=reg.adjustment_iter, adjustment_ub=reg.adjustment_ub,
            learning_rate_mode=getattr(LearningRateMode, reg.learning_rate_mode.upper()),
            tail_id_threshold=TailIdThreshold(reg.tail_id_threshold, False)))
        mode = WeightDecayMode.COUNTER
    else:
        definition = dict(cowclip_regularization=CowClipDefinition(
            counter_weight_decay_mode=wd_mode, counter_halflife=reg.counter_halflife,
            weight_norm_coefficient=reg.weight_norm_coefficient, lower_bound=reg.lower_bound))
        mode = WeightDecayMode.COWCLIP
    # TorchRec's annotation with FBGEMM's arguments maps to the same config
    mapped = optim.from_torch(RowWiseAdagrad, {"lr": 0.3, "eps": 1e-6,
                                               "weight_decay": opt.weight_decay,
                                               "weight_decay_mode": mode, **definition}, "t")
    assert mapped == opt
    theirs = fb.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(E, D, EmbeddingLocation.HOST, fb.ComputeDevice.CPU) for E, D in TABLES],
        feature_table_map=FTM, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.3,
        eps=1e-6, weight_decay=opt.weight_decay, weight_decay_mode=mode,
        pooling_mode=PoolingMode.SUM, weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32, **definition)
    w0 = _w0()
    for view, t in zip(theirs.split_embedding_weights(), _split(w0), strict=True):
        view.copy_(t)
    batches = _batches(weighted=True)
    for step, (indices, offsets, psw) in enumerate(batches):
        out = theirs(indices, offsets, per_sample_weights=psw)
        out.backward(upstream_grad(out, step))
    ours = _run(opt, backend, w0, batches)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b.detach(), a, atol=2e-5, rtol=1e-5)
    for a, b in zip(theirs.split_optimizer_states(), ours.split_optimizer_states(), strict=True):
        for x, y in zip(a, b, strict=True):  # momentum1, prev_iter, row_counter
            torch.testing.assert_close(y.reshape(x.shape), x, atol=2e-5, rtol=1e-5)
    assert float(theirs.max_counter) == float(ours.max_counter) == 1.0


def _row(opt, t, w, g, m, prev, count, max_counter):
    """One row's update by FBGEMM's formula (float64 row ``w``, summed gradient ``g`` [D];
    floats ``m``, ``prev``, ``count``); returns (w, m, prev, count)."""
    reg, lr, wd = opt.regularization, opt.lr, opt.weight_decay
    h, mode = reg.counter_halflife, reg.counter_weight_decay_mode
    gap = 1.0 if prev == 0 else t - prev
    count = 1 + math.exp(-gap * math.log(2) / h) * count if h > 0 else 1.0 if h == 0 else count + 1
    g2 = g + wd * w if mode == "l2" else g
    m = m + float((g2 * g2).mean())
    plain = lr / (math.sqrt(m) + opt.eps)
    rate, keep = plain, 1.0
    if opt.weight_decay_mode == "cowclip":
        clip = count * max(reg.weight_norm_coefficient * float(w.norm()), reg.lower_bound)
        rate = plain * min(1.0, clip / float(g2.norm())) if float(g2.norm()) > 0 else plain
        keep = {"decoupled": 1 - wd * lr, "l2": 1 - wd * rate}.get(mode, 1.0)
        return keep * w - rate * g, m, float(t), count
    on = reg.adjustment_iter <= 0 or t > reg.adjustment_iter
    threshold = reg.tail_id_threshold
    if reg.tail_id_threshold_is_ratio:
        threshold = math.floor(threshold * max_counter)
    if on and count > threshold and reg.learning_rate_mode != "equal":
        ub = reg.adjustment_ub
        rate = {
            "tail_id_lr_increase": plain * min(max((max_counter / (count + 1)) ** ub, 1.0), 10.0),
            "tail_id_lr_decrease": plain * min(max(((count + 1) / max_counter) ** ub, 0.1), 1.0),
            "counter_sgd": lr / (math.sqrt(ub * count) + opt.eps),
        }[reg.learning_rate_mode]
    if on and mode == "adagradw":
        if h == -1:
            rate = plain * math.sqrt(count)
        elif h == -2:
            rate = min(lr * count, reg.adjustment_ub) / (math.sqrt(m) + opt.eps)
        lazy = (1 - wd * lr) ** (min(gap, t - reg.adjustment_iter) - 1)
        rate, keep = rate * lazy, (1 - wd * lr) * lazy
    elif on and mode == "decoupled":
        keep = 1 - h / count * wd * lr
    elif on and mode == "l2":
        keep = 1 - h / count * wd * plain
    return keep * w - rate * g, m, float(t), count


def _expected(opt, w0, batches, m_dtype=torch.float64):
    weights = [t.double() for t in _split(w0)]
    m, prev, count = ([[0.0] * E for E, _ in TABLES] for _ in range(3))
    max_counter, freq = 1.0, opt.max_counter_update_freq
    for t, (indices, offsets, _) in enumerate(batches, start=1):
        if freq > 0 and t % freq == 0:
            max_counter = max(max(c) for c in count) + 1.0
        params = [w.clone().requires_grad_() for w in weights]
        pooled, touched = [], [set() for _ in TABLES]
        for f, table in enumerate(FTM):
            o = offsets[f * B : (f + 1) * B + 1]
            ids = indices[o[0] : o[-1]]
            touched[table].update(ids.tolist())
            pooled.append(F.embedding_bag(ids, params[table], o[:-1] - o[0], mode="sum"))
        out = torch.cat(pooled, dim=1)
        out.backward(upstream_grad(out, t - 1).double())
        for table, rows in enumerate(touched):
            for r in sorted(rows):
                weights[table][r], m[table][r], prev[table][r], count[table][r] = _row(
                    opt, t, weights[table][r], params[table].grad[r], m[table][r],
                    prev[table][r], count[table][r], max_counter)
                # the step used the unrounded accumulator; the stored one is rounded
                m[table][r] = float(torch.tensor(m[table][r]).to(m_dtype))
    return weights, (m, prev, count), max_counter


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("case", [*FORMULA_CASES, "decoupled-decrease", "adagradw-2",
                                  "cowclip-l2"])
def test_matches_the_update_formula(case, backend):
    opt = {**FBGEMM_CASES, **FORMULA_CASES}[case]
    w0, batches = _w0(), _batches(5)
    ours = _run(opt, backend, w0, batches)
    weights, states, max_counter = _expected(opt, w0, batches)
    for a, b in zip(weights, ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b.detach().double(), a, atol=2e-5, rtol=1e-5)
    for t, views in enumerate(ours.split_optimizer_states()):
        for view, state in zip(views, states, strict=True):
            torch.testing.assert_close(view.double(), torch.tensor(state[t], dtype=torch.float64),
                                       atol=2e-5, rtol=1e-5)
    assert float(ours.max_counter) == pytest.approx(max_counter, rel=1e-6)
    if opt.max_counter_update_freq == 2:
        assert max_counter > 2  # refreshed from counters above 1


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bf16_accumulator(backend):
    """``optimizer_state_dtypes={"momentum1": "bf16"}``: the accumulator stored in bf16 (the
    update reads it in fp32), ``prev_iter`` and ``row_counter`` fp32."""
    opt = FBGEMM_CASES["decoupled-decrease"]
    w0, batches = _w0(), _batches(4)
    ours = _run(opt, backend, w0, batches, {"momentum1": "bf16"})
    assert [ours.momentum1.dtype, ours.prev_iter.dtype] == [torch.bfloat16, torch.float32]
    weights, states, _ = _expected(opt, w0, batches, torch.bfloat16)
    for a, b in zip(weights, ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b.detach().double(), a, atol=2e-5, rtol=1e-5)
    for t, views in enumerate(ours.split_optimizer_states()):
        for view, state in zip(views, states, strict=True):
            torch.testing.assert_close(view.double(), torch.tensor(state[t], dtype=torch.float64),
                                       atol=2e-5, rtol=1e-5)


def _one_step_rows(opt, steps=1):
    tbe = TableBatchedEmbedding([(4, 2)], optimizer=opt, backend="reference")
    with torch.no_grad():
        tbe.weights.copy_(torch.arange(8.0) / 8 - 0.3)
    for _ in range(steps):  # rows 1 twice a step (summed), 2 once; 0 and 3 never
        out = tbe(torch.tensor([1, 1, 2]), torch.tensor([0, 3]))
        out.backward(torch.ones_like(out))
    return tbe.split_embedding_weights()[0].detach().clone()


def test_both_sides_of_the_thresholds():
    """A row's counter above ``tail_id_threshold`` gets the adjusted rate, at or below it
    the plain one; nothing is adjusted or decayed up to ``adjustment_iter``, both after."""
    plain = _counter(wd=0.0)  # learning_rate_mode "equal"
    sgd = dict(counter_halflife=-1, learning_rate_mode="counter_sgd", adjustment_ub=4.0, wd=0.0)
    # after one step every touched row's raw count is 1
    assert torch.equal(_one_step_rows(_counter(tail_id_threshold=1.0, **sgd)),
                       _one_step_rows(plain))
    above = _one_step_rows(_counter(tail_id_threshold=0.5, **sgd))
    assert not torch.allclose(above[1:3], _one_step_rows(plain)[1:3])
    assert torch.equal(above[[0, 3]], _one_step_rows(plain)[[0, 3]])  # untouched rows
    decay = dict(counter_weight_decay_mode="decoupled", counter_halflife=2, wd=0.5)
    nodecay = _counter(counter_halflife=2, wd=0.5)
    assert torch.equal(_one_step_rows(_counter(adjustment_iter=1, **decay)),
                       _one_step_rows(nodecay))  # step 1: not after adjustment_iter
    assert not torch.allclose(_one_step_rows(_counter(adjustment_iter=1, **decay), 2),
                              _one_step_rows(nodecay, 2))  # step 2: decayed
    assert not torch.allclose(_one_step_rows(_counter(adjustment_iter=0, **decay)),
                              _one_step_rows(nodecay))  # <= 0: from the first step


def test_config_refuses_bad_values():
    cases = [
        (dict(lr=-1), r"RowWiseAdagradWithCounter.lr: expected a number >= 0"),
        (dict(weight_decay_mode="l2"), r"weight_decay_mode: expected one of \[counter, cowclip"),
        (dict(counter_based_regularization={"counter_halflife": 1.5}),
         r"counter_based_regularization.counter_halflife: expected an integer, got 1.5"),
        (dict(counter_based_regularization={"adjustment_ub": -1}),
         r"counter_based_regularization.adjustment_ub: expected a number >= 0"),
        (dict(counter_based_regularization={"tail_id_threshold": 2,
                                            "tail_id_threshold_is_ratio": True}),
         r"tail_id_threshold: expected a number in \[0.0, 1.0\], got 2"),
        (dict(counter_based_regularization={"learning_rate_mode": "fast"}),
         r"learning_rate_mode: expected one of \[equal, tail_id_lr_increase"),
        (dict(counter_based_regularization={"halflife": 2}),
         r"counter_based_regularization.halflife: unknown key"),
        (dict(weight_decay_mode="cowclip", cowclip_regularization={"lower_bound": -0.1}),
         r"cowclip_regularization.lower_bound: expected a number >= 0"),
        (dict(weight_decay_mode="cowclip", counter_based_regularization={}),
         r"counter_based_regularization: expected None with weight_decay_mode='cowclip'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            optim.RowWiseAdagradWithCounter(**kwargs)
    with pytest.raises(ValueError, match=r"RowWiseAdagrad.weight_decay_mode: .*counter / cowclip"):
        optim.RowWiseAdagrad(weight_decay_mode="counter")
    with pytest.raises(ValueError, match=r"optimizer_state_dtypes\['prev_iter'\]: expected one "
                                         r"of \[fp32\], got 'fp16'"):
        TableBatchedEmbedding(TABLES, FTM, optimizer=_counter(),
                              optimizer_state_dtypes={"prev_iter": "fp16"})


def test_state_dict_resumes_exactly():
    """The module's state dict holds ``prev_iter``, ``row_counter`` and ``max_counter``: a
    module loaded after 3 steps takes the next 3 as the uninterrupted one does."""
    opt = FORMULA_CASES["increase-ratio"]  # max_counter refreshed at steps 2, 4, 6
    w0, batches = _w0(), _batches(6)
    whole = _run(opt, "cpu", w0, batches)
    first = _run(opt, "cpu", w0, batches[:3])
    state = first.state_dict()
    assert {"momentum1", "prev_iter", "row_counter"} <= set(state)
    assert state["_extra_state"]["max_counter"] == float(first.max_counter) > 1
    resumed = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend="cpu",
                                    stochastic_rounding=False)
    resumed.load_state_dict(state)
    for step, (indices, offsets, _) in enumerate(batches[3:], start=3):
        out = resumed(indices, offsets)
        out.backward(upstream_grad(out, step))
    assert torch.equal(resumed.weights, whole.weights)
    for name in optim.STATE_BUFFERS:
        assert torch.equal(getattr(resumed, name), getattr(whole, name))
    assert float(resumed.max_counter) == float(whole.max_counter)


def test_torchrec_annotation_and_job_yaml():
    """TorchRec's RowWiseAdagrad annotation with FBGEMM's COUNTER arguments, our placeholder
    class and the job's ``weight_decay_mode: counter`` + ``counter:`` give the same config;
    the planner counts its three per-row states; a bad YAML value names its key path."""
    from torchrec.optim import RowWiseAdagrad

    from fbtriton_dist.planner import ConfigError, state_bytes
    from fbtriton_dist.train.config import job_from_dict
    from fbtriton_dist.train.job import _embedding_optimizer, _state_dtypes
    from tests.fbgemm_config import (
        CounterBasedRegularizationDefinition,
        CounterWeightDecayMode,
        WeightDecayMode,
    )

    opt = _counter(counter_weight_decay_mode="decoupled", counter_halflife=5)
    definition = CounterBasedRegularizationDefinition(
        counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE, counter_halflife=5)
    kwargs = {"lr": 0.3, "eps": 1e-6, "weight_decay": 0.2,
              "weight_decay_mode": WeightDecayMode.COUNTER,
              "counter_based_regularization": definition}
    assert optim.from_torch(RowWiseAdagrad, kwargs, "t") == opt
    cls, back = optim.torch_equivalent(opt)
    assert cls.__name__ == "RowWiseAdagradWithCounter" and optim.from_torch(cls, back, "t") == opt
    tables = [{"name": "t0", "num_embeddings": 100, "embedding_dim": 8, "features": ["f0"]}]
    section = {"type": "rowwise_adagrad", "lr": 0.3, "eps": 1e-6, "weight_decay": 0.2,
               "weight_decay_mode": "counter", "state_dtype": "bf16",
               "counter": {"counter_weight_decay_mode": "decoupled", "counter_halflife": 5}}
    base = {"tables": tables, "model": {"dense_arch": [8], "over_arch": [4, 1]},
            "train": {"steps": 2}}
    cfg = job_from_dict({**base, "optimizer": {"embedding": section}})
    assert cfg.optimizer.embedding.optimizer_name == "rowwise_adagrad_with_counter"
    assert _embedding_optimizer(cfg.optimizer.embedding) == opt
    assert _state_dtypes(cfg) == {"momentum1": "bf16"}  # the step numbers and counts: fp32
    assert state_bytes("rowwise_adagrad_with_counter", 10, 8, "bf16") == 10 * (2 + 4 + 4)
    bad = {**section, "counter": {"counter_halflife": "x"}}
    with pytest.raises(ConfigError, match=r"optimizer.embedding.counter.counter_halflife: "
                                          r"expected an integer, got 'x'"):
        job_from_dict({**base, "optimizer": {"embedding": bad}})
    with pytest.raises(ConfigError, match=r"optimizer.embedding.cowclip: only supported with "
                                          r"weight_decay_mode: cowclip"):
        job_from_dict({**base, "optimizer": {"embedding": {**section, "cowclip": {}}}})



def test_traced_collection_refuses_it():
    """The registered lookup ops (FX, torch.compile, torch.export) pass a collection's step
    and momenta, not the counter's per-row state: refused, not trained on copies."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from tests.modules.test_ebc_tracing import _kjt, _pair

    cls, kwargs = optim.torch_equivalent(_counter())
    _, model = _pair(False)
    apply_optimizer_in_backward(cls, model.ebc.parameters(), kwargs)
    model(_kjt(3, 0, False))  # eager: fine
    with pytest.raises(ValueError, match="rowwise_adagrad_with_counter: expected an eager "
                                         "collection"):
        torch.fx.symbolic_trace(model)(_kjt(3, 1, False))
