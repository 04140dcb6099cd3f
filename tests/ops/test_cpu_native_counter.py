"""Rowwise Adagrad with counter's native CPU update (``ops/csrc/tbe_cpu_counter.c``) against
the torch ops' step (``FBTD_CPU_NATIVE=0``, ``ops/cpu.py``, the reference's row math) over 4
steps: every counter weight-decay mode, every learning-rate mode, COWCLIP, positive / zero /
negative half-lives, ``adjustment_iter``, a tail-id threshold as a ratio of a refreshed
``max_counter``, fp32 / fp16 / bf16 rows, 1 and 2 threads; mixed D (none a multiple of 8 but
16), a one-row table, empty bags, hot ids, per-sample weights. The two differ only in the
order of the sums over D and in exp / pow (libm vs SLEEF): fp32 rounding. Also the C side's
``CTR_*`` slots and mode codes against ``optim_counter``'s tables."""

import os
import shutil

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim, optim_counter
from fbtriton_dist.optim_counter import CounterBasedRegularization, CowClipRegularization
from tests.helpers import make_batch
from tests.ops.test_cpu_native import TOL, _train, used  # noqa: F401 (the fixture)
from tests.ops.test_native_tables import PKG, header_enums, with_prefix

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="no C compiler: the native kernels cannot be built")

TABLES, FTM = [(40, 6), (1, 3), (60, 16), (30, 9)], [0, 1, 2, 3, 0, 2]


def _counter(**kw):
    return optim.RowWiseAdagradWithCounter(
        lr=0.3, eps=1e-6, weight_decay=kw.pop("wd", 0.2),
        counter_based_regularization=CounterBasedRegularization(**kw))


def _cowclip(**kw):
    return optim.RowWiseAdagradWithCounter(
        lr=0.3, eps=1e-6, weight_decay=0.2, weight_decay_mode="cowclip",
        cowclip_regularization=CowClipRegularization(**kw))


CASES = {  # (optimizer, weights dtype, threads)
    "none-equal": (_counter(), torch.float32, 1),
    "decoupled-decrease-iter": (_counter(
        counter_weight_decay_mode="decoupled", counter_halflife=2, adjustment_iter=2,
        adjustment_ub=2.0, tail_id_threshold=1.2, learning_rate_mode="tail_id_lr_decrease"),
        torch.float32, 2),
    "l2-increase-ratio": (_counter(
        counter_weight_decay_mode="l2", counter_halflife=3, adjustment_ub=1.5,
        learning_rate_mode="tail_id_lr_increase", tail_id_threshold=0.5,
        tail_id_threshold_is_ratio=True, max_counter_update_freq=2), torch.float32, 1),
    "l2-counter_sgd-fp16": (_counter(
        counter_weight_decay_mode="l2", counter_halflife=-1, adjustment_ub=3.0,
        tail_id_threshold=1.5, learning_rate_mode="counter_sgd"), torch.float16, 2),
    "adagradw-1-bf16": (_counter(counter_weight_decay_mode="adagradw", counter_halflife=-1,
                                 adjustment_iter=1, wd=0.5), torch.bfloat16, 1),
    "adagradw-2-halflife0": (_counter(counter_weight_decay_mode="adagradw", counter_halflife=-2,
                                      adjustment_ub=0.2, wd=0.3), torch.float32, 1),
    "adagradw-decrease-sqrt": (_counter(
        counter_weight_decay_mode="adagradw", counter_halflife=0, adjustment_ub=0.5,
        learning_rate_mode="tail_id_lr_decrease", max_counter_update_freq=1), torch.float32, 2),
    "cowclip-l2": (_cowclip(counter_weight_decay_mode="l2", counter_halflife=3,
                            weight_norm_coefficient=0.5, lower_bound=0.01), torch.float32, 1),
    "cowclip-decoupled-fp16": (_cowclip(counter_weight_decay_mode="decoupled", counter_halflife=0,
                                        weight_norm_coefficient=0.05, lower_bound=0.001),
                               torch.float16, 1),
    "cowclip-none-bf16": (_cowclip(counter_halflife=-1, weight_norm_coefficient=0.2),
                          torch.bfloat16, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_native_counter_matches_the_torch_step(name, used, monkeypatch):  # noqa: F811
    opt, wdt, threads = CASES[name]
    g = torch.Generator().manual_seed(3)
    batches = [make_batch(TABLES, FTM, 7, 6, hot=True, weighted=True, generator=g)
               for _ in range(4)]
    assert any(int(off.diff().eq(0).sum()) > 0 for _, off, _ in batches)  # an empty bag
    before = torch.get_num_threads()
    runs = {}
    try:
        torch.set_num_threads(threads)
        for native in ("1", "0"):
            monkeypatch.setenv("FBTD_CPU_NATIVE", native)
            torch.manual_seed(5)
            m = TableBatchedEmbedding(TABLES, FTM, optimizer=opt, weights_dtype=wdt,
                                      backend="cpu", stochastic_rounding=False)
            w0 = m.weights.detach().float().clone()
            seen = _train(m, batches)
            runs[native] = (seen, m.weights.detach().float(), m.momentum1, m.prev_iter,
                            m.row_counter, float(m.max_counter))
    finally:
        torch.set_num_threads(before)
    atol, rtol = TOL[wdt]
    (seen_n, w_n, *states_n, max_n), (seen_t, w_t, *states_t, max_t) = runs["1"], runs["0"]
    for a, b in zip(seen_t, seen_n, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    torch.testing.assert_close(w_n, w_t, atol=atol, rtol=rtol)
    for a, b in zip(states_t, states_n, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    assert torch.equal(states_n[1], states_t[1]) and states_n[1].max() == 4  # prev_iter
    assert max_n == max_t
    assert not torch.equal(w_n, w0)
    assert used["backward", True] == 4 and used["backward", False] == 4


def test_counter_slots_match_optim_counter():
    enums = header_enums((PKG / "ops" / "csrc" / "tbe_cpu_counter.c").read_text())
    slots = with_prefix(enums, "CTR_")
    assert slots.pop("COUNT") == len(optim_counter.NATIVE_COUNTER_FIELDS)
    assert sorted(slots, key=slots.get) == [f.upper() for f in
                                            optim_counter.NATIVE_COUNTER_FIELDS]
    assert sorted(slots.values()) == list(range(len(slots)))
    decay = with_prefix(enums, "DECAY_")
    assert sorted(decay, key=decay.get) == [m.upper()
                                            for m in optim_counter.COUNTER_WEIGHT_DECAY_MODES]
    lr = with_prefix(enums, "LR_")
    assert sorted(lr, key=lr.get) == ["EQUAL", "TAIL_ID_INCREASE", "TAIL_ID_DECREASE",
                                      "COUNTER_SGD"]
    assert [m.replace("_lr", "").upper() for m in optim_counter.LEARNING_RATE_MODES] == \
        sorted(lr, key=lr.get)
    values = dict(zip(optim_counter.NATIVE_COUNTER_FIELDS,
                      optim_counter.native_counter_parameters(CASES["l2-increase-ratio"][0], 9.0),
                      strict=True))
    assert values["threshold"] == 4.0 and values["max_counter"] == 9.0  # floor(0.5 * 9)
    assert values["learning_rate_mode"] == 1 and values["decay_mode"] == 1
    assert values["decay_rate"] == pytest.approx(0.6931471805599453 / 3)
