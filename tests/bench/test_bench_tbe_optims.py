"""``bench tbe``'s fused-optimizer phases (``bench/tbe_optims.py``): the phase table maps every
optimizer of the registry to FBGEMM's by name, with the same hyper-parameters and the state
bytes of its registry entry; a tiny run times two new phases for ours and FBGEMM's CPU TBE,
which offers one of them and says "not offered" for the other; the comparison with FBGEMM
catches an update that differs, and its weights limit allows fp32 rounding of a tiny step
(LARS-SGD) but not a wrong rate."""

import dataclasses
import json

import pytest

from fbtriton_dist import optim
from fbtriton_dist.bench import tbe, tbe_cases, tbe_optims
from fbtriton_dist.modules import TableBatchedEmbedding

FAST = ["--warmup", "1", "--iters", "1", "--min-iters", "1", "--pipelined", "1", "--repeats", "1"]


def test_the_phase_table_maps_every_optimizer_to_fbgemm_with_its_hyper_parameters():
    assert tbe.DEFAULT_PHASES == ("fwd", "fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad")
    assert tbe.PHASES[:3] == tbe.DEFAULT_PHASES
    assert set(tbe.PHASES) == {"fwd"} | {f"fwd_bwd_{n}" for n in optim.REGISTRY}
    for name, spec in optim.REGISTRY.items():
        entry = tbe_optims.phase(f"fwd_bwd_{name}")
        assert (entry.name, entry.fbgemm, type(entry.config)) == (name, spec.fbgemm, spec.config)
        if name != "ensemble_rowwise_adagrad":  # its slow copy: the whole-table step's
            assert entry.row_state_bytes(8) == 2 * spec.state_bytes(1, 8)
    assert tbe_optims.phase("fwd_bwd_adam").fbgemm_kwargs() == dict(
        learning_rate=0.01, eps=1e-8, beta1=0.9, beta2=0.999, weight_decay=0.0)
    assert tbe_optims.phase("fwd_bwd_lars_sgd").fbgemm_kwargs() == dict(
        learning_rate=0.01, eta=0.001, momentum=0.9, weight_decay=0.0)
    assert tbe_optims.phase("fwd_bwd_emainplace_rowwise_adagrad").fbgemm_kwargs() == dict(
        learning_rate=0.01, eps=1e-8, weight_decay=0.0,
        emainplace_mode=dict(step_ema=10, step_start=0, step_ema_coef=0.6))
    ensemble = tbe_optims.phase("fwd_bwd_ensemble_rowwise_adagrad")
    assert ensemble.fbgemm_kwargs() == dict(
        learning_rate=0.01, eps=1e-8, weight_decay=0.0, ensemble_mode=dict(
            step_ema=10000, step_swap=10000, step_start=0, step_ema_coef=0.6,
            step_mode="use_iter"))
    assert ensemble.row_state_bytes(8) == 2 * 4  # momentum1; momentum2 is [E, D]
    # per step: 10 x 8 elements, fp32 rows: EMA (4 + 2 x 4) / 10000, swap (4 + 4) / 10000
    assert ensemble.ema_bytes([(10, 8)], 4) == 80 * 12 / 10000 + 80 * 8 / 10000
    decayed = tbe_optims.OptimPhase("p", "rowwise_adagrad", optim.RowWiseAdagrad(
        weight_decay=0.1, weight_decay_mode="decoupled"), "EXACT_ROWWISE_ADAGRAD")
    assert decayed.fbgemm_kwargs()["weight_decay_mode"] == "DECOUPLE"
    assert "weight_decay_mode" not in tbe_optims.phase("fwd_bwd_rowwise_adagrad").fbgemm_kwargs()
    with pytest.raises(ValueError, match=r"FTRL\.beta"):  # a field FBGEMM has no keyword for
        tbe_optims.OptimPhase("p", "ftrl", optim.FTRL(), "X").fbgemm_kwargs()
    with pytest.raises(ValueError, match="expected a phase of"):
        tbe_optims.phase("fwd_bwd_adamw")
    # bytes: Adam's two per-element moments, partial-rowwise Adam's one per element + one per row
    assert tbe_optims.phase("fwd_bwd_adam").row_state_bytes(8) == 2 * 2 * 4 * 8
    assert tbe_optims.phase("fwd_bwd_partial_rowwise_adam").row_state_bytes(8) == 2 * 4 * 9
    s0 = tbe.SHAPES["S0"]
    batch = tbe.Batch(None, None, None, [100] * 32, [90] * 32)
    extra = tbe.model_bytes(s0, batch, "fwd_bwd_adam", 4) - tbe.model_bytes(
        s0, batch, "fwd_bwd_sgd", 4)
    assert extra == 32 * 90 * 2 * 2 * 4 * 128


def test_fbgemm_optimizer_names_members_or_says_not_offered():
    fb = tbe_cases.import_fbgemm() if _has_fbgemm() else pytest.skip("fbgemm_gpu not installed")
    from fbgemm_gpu.config import FeatureGateName

    for entry in tbe_optims.OPTIM_PHASES.values():
        if entry.fbgemm is None:
            with pytest.raises(tbe_optims.NotOffered, match=f"FBGEMM has no {entry.name}"):
                tbe_optims.fbgemm_optimizer(entry, fb)
        elif (entry.name == "ensemble_rowwise_adagrad"
              and not FeatureGateName.TBE_ENSEMBLE_ROWWISE_ADAGRAD.is_enabled()):
            with pytest.raises(tbe_optims.NotOffered, match="feature gate "
                                                            "TBE_ENSEMBLE_ROWWISE_ADAGRAD is off"):
                tbe_optims.fbgemm_optimizer(entry, fb)
        else:
            assert tbe_optims.fbgemm_optimizer(entry, fb)["optimizer"].name == entry.fbgemm


def _has_fbgemm() -> bool:
    try:
        tbe_cases.import_fbgemm()
    except ImportError:
        return False
    return True


def test_tiny_run_of_two_new_phases_against_fbgemm(tmp_path, capsys):
    """Adagrad (FBGEMM's CPU TBE runs EXACT_ADAGRAD) and Adam (it refuses ADAM on CPU):
    checked against the reference and FBGEMM, then timed; FBGEMM's Adam row says why not."""
    if not _has_fbgemm():
        pytest.skip("fbgemm_gpu not installed")
    out = tmp_path / "tbe.json"
    tbe.main(["--tiny", "--device", "cpu", "--check", "--shapes", "S0", "--providers",
              "ours,fbgemm", "--phases", "fwd_bwd_adagrad,fwd_bwd_adam", *FAST,
              "--out", str(out)])
    data = json.loads(out.read_text())
    check, vs = data["check"]["S0"], data["correctness"]["S0"]
    assert check["ok"] and vs["ok"], (check, vs)
    assert check["ours.fwd_bwd_adam.momentum2_state_rel_err"] <= 1e-4
    assert 0 <= vs["fwd_bwd_adagrad.weights_err"] <= 1e-4
    assert vs["fwd_bwd_adagrad.momentum1_rel_err"] <= 1e-4
    assert vs["fwd_bwd_adam"].startswith("fbgemm: not offered (FBGEMM's CPU TBE")
    rows = {(r["provider"], r["phase"]): r for r in data["rows"]}
    assert set(rows) == {(p, ph) for p in ("ours", "fbgemm")
                         for ph in ("fwd_bwd_adagrad", "fwd_bwd_adam")}
    for key in [("ours", "fwd_bwd_adagrad"), ("ours", "fwd_bwd_adam"),
                ("fbgemm", "fwd_bwd_adagrad")]:
        assert rows[key]["median_ms"] > 0, key
    assert rows[("fbgemm", "fwd_bwd_adam")]["skipped"].startswith("fbgemm: not offered")
    assert "fbgemm: not offered" in capsys.readouterr().out


def test_the_comparison_with_fbgemm_catches_a_different_update():
    """Both sides of the rule: ours built with FBGEMM's rate agrees with FBGEMM after one step;
    built with twice the rate, the rows differ beyond the tolerance and the phase is named."""
    if not _has_fbgemm():
        pytest.skip("fbgemm_gpu not installed")
    import torch  # noqa: PLC0415

    shape = tbe.SHAPES["S0"].tiny()
    batch = tbe.make_batch(shape, torch.device("cpu"))

    def compare(scale):
        def build_ours(one, config):
            cfg = optim.Adagrad(lr=config.lr * scale, eps=config.eps)
            return TableBatchedEmbedding(one.tables, optimizer=cfg, init_weights=False)

        return tbe_optims.compare_with_fbgemm(shape, batch, torch.device("cpu"),
                                              ["fwd_bwd_adagrad"], "auto",
                                              tbe_cases.fbgemm_tbe, build_ours)

    values, limits = compare(1.0)
    assert tbe_cases.failures(values, limits) == []
    values, limits = compare(2.0)
    failed = tbe_cases.failures(values, limits)
    assert len(failed) == 1 and failed[0].startswith("fwd_bwd_adagrad: table 0's touched rows")


def test_the_weights_limit_allows_fp32_rounding_of_a_tiny_lars_step_but_not_a_wrong_rate():
    """Both sides of ``weights_err_limit``: LARS-SGD at the phase's setting (lr 0.01, eta 1e-3:
    each row moves by 1e-5 of its norm) in fp32 against the same formula in float64 rounded
    once differs by one fp32 spacing of the weights, which is above 1e-4 of the update but
    within the limit; with eta 1% off, the rows differ beyond it."""
    import torch  # noqa: PLC0415

    from fbtriton_dist.reference.tbe import UPDATES  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    n, D = 2048, 128
    w = torch.rand(n, D, generator=gen) * 0.2 - 0.1  # the bench's uniform(-0.1, 0.1)
    g = tbe_optims.exact_sum_grad(torch.randn(n, D, generator=gen))
    rows = torch.arange(n)
    w64, g64 = w.double(), g.double()
    exact = (w64 - 0.01 * 0.001 * w64.norm(dim=1, keepdim=True) / g64.norm(dim=1, keepdim=True)
             * g64).float()  # FBGEMM's formula with momentum 0 and no decay, rounded once
    limit = tbe_optims.weights_err_limit(w.double(), exact.double())

    def err(eta):
        opt = dataclasses.replace(tbe_optims.CONFIGS["lars_sgd"], eta=eta)
        ours = UPDATES["lars_sgd"](opt, w, g, 1, torch.zeros(n, D), None, rows, rows)
        update = (exact.double() - w64).abs().max()
        return ((ours.double() - exact.double()).abs().max() / update).item()

    assert tbe_optims.CONFIGS["lars_sgd"].eta == 0.001
    assert 1e-4 < err(0.001) <= limit < 1e-2
    assert err(0.00101) > limit


def test_check_gradients_sum_exactly_in_any_order():
    """Why the checks round their upstream gradients: summed in two orders, randn values
    differ in fp32, the rounded ones do not (and stay within 2^-11 of the originals)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    def in_order(x):  # one fp32 addition after another
        return np.add.accumulate(x.numpy(), dtype=np.float32)[-1]

    g = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    q = tbe_optims.exact_sum_grad(g)
    assert in_order(g) != in_order(g.flip(0))
    assert in_order(q) == in_order(q.flip(0))
    assert (q - g).abs().max() <= 2**-11


def test_an_optimizer_without_a_config_here_gets_its_defaults_at_our_rate(monkeypatch):
    monkeypatch.delitem(tbe_optims.CONFIGS, "lars_sgd")
    assert tbe_optims._config("lars_sgd") == optim.LarsSGD(lr=tbe_optims.LR)
    assert tbe_optims._config("adam") == tbe_optims.CONFIGS["adam"]


def test_states_that_do_not_fit_skip_the_phase_and_leave_sgd():
    import torch  # noqa: PLC0415

    class Module:  # a TableBatchedEmbedding whose device has no room for Adam's moments
        optimizer = None

        def set_optimizer(self, optimizer):
            if isinstance(optimizer, optim.Adam):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32 GiB\nmore")
            self.optimizer = optimizer

    m = Module()
    assert tbe_optims.switch_optimizer(m, "fwd_bwd_lamb") is None
    assert m.optimizer == tbe_optims.CONFIGS["lamb"]
    why = tbe_optims.switch_optimizer(m, "fwd_bwd_adam")
    assert why == ("skipped: the fwd_bwd_adam states do not fit: CUDA out of memory. Tried to "
                   "allocate 32 GiB")
    assert m.optimizer == optim.SGD(lr=tbe_optims.LR)
