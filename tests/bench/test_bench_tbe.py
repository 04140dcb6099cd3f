"""The TBE benchmark cannot rot: its tiny CPU run, its JSON, its bytes model and the
PNG chart mode run in CI; its correctness checks pass on this code and stop the run, untimed,
on a planted wrong result."""

import json
import re

import pytest
import torch

from fbtriton_dist.bench import tbe
from fbtriton_dist.bench.timing import (
    SPREAD_FLAG,
    iqr_spread,
    paired_ratio,
    spread,
    union_length,
)

SHAPES = ["S2", "S5", "S6"]  # fp16, two D groups (torch_fused's two calls), Zipf ids
FAST = ["--warmup", "1", "--iters", "1", "--min-iters", "1", "--pipelined", "1", "--repeats", "1"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tbe.json"
    tbe.main(["--tiny", "--device", "cpu", "--shapes", ",".join(SHAPES), *FAST, "--out", str(out)])
    return out, json.loads(out.read_text())


def test_tiny_cpu_rows(report):
    _, data = report
    assert data["copy_gbs"] > 0 and data["device"] == "cpu"
    providers = tbe.DEFAULT_PROVIDERS["cpu"]
    assert data["providers"] == providers
    got = {(r["shape"], r["provider"], r["phase"]): r for r in data["rows"]}
    expected = {
        (s, p, ph)
        for s in SHAPES
        for p in providers
        for ph in tbe.DEFAULT_PHASES  # what runs without --phases
        if not (ph == "fwd" and p in tbe.FWD_OF)  # sparse variants share the dense forward
    }
    assert set(got) == expected
    for key, r in got.items():
        assert "error" not in r and "skipped" not in r, (key, r)
        assert r["busy_source"] == "wall" and r["busy_ms"] > 0 and r["median_ms"] > 0, key
        assert r["bytes"] > 0 and r["gbs_busy"] > 0 and r["pct_copy_busy"] > 0, key
        assert set(r["ratios"]) == {p for (s, p, ph) in got if (s, ph) == key[::2]} - {key[1]}
    graphed = [r for (_, p, _), r in got.items() if p == "ours_graph"]
    assert graphed and all(r["note"].startswith("eager") for r in graphed)  # no CUDA: labelled
    derived = {(d["shape"], d["provider"], d["phase"]) for d in data["derived"]}
    assert ("S5", "torch_fused_sparse", "bwd_sgd") in derived
    assert ("S6", "reference", "bwd_rowwise_adagrad") in derived
    assert data["shapes"]["S5"]["T"] == 2 and data["shapes"]["S6"]["zipf"] == 1.15


def test_check_and_fbgemm_comparison_pass_then_the_shape_is_timed(tmp_path):
    """``bench tbe --tiny --device cpu --check`` on this code: ours (the native CPU kernels)
    agrees with the reference on every timed phase, ours with FBGEMM's CPU TBE, and then
    every phase is timed."""
    out = tmp_path / "tbe.json"
    args = ["--tiny", "--device", "cpu", "--check", "--shapes", "S0", "--providers"]
    tbe.main([*args, "ours,reference,fbgemm", *FAST, "--out", str(out)])
    data = json.loads(out.read_text())
    check = data["check"]["S0"]
    assert check["ok"] and check["failures"] == [] and check["rows_touched"] > 0, check
    assert [(c["providers"], c["backend"], c["phase"]) for c in check["checked"]] == [
        (["ours"], "auto", phase) for phase in tbe.DEFAULT_PHASES]
    assert check["ours.fwd_bwd_rowwise_adagrad.weights_max_abs_err"] < 1e-5
    compared = data["correctness"]["S0"]
    if "skipped" in compared:  # FBGEMM is a peer: without it there is nothing to compare with
        assert "not importable" in compared["skipped"]
    else:
        assert compared["ok"] and compared["failures"] == [] and compared["rows_compared"] > 0
    for provider in ("ours", "reference"):
        timed = {r["phase"] for r in data["rows"] if r["provider"] == provider and r["median_ms"]}
        assert timed == set(tbe.DEFAULT_PHASES) and "failed" not in data


def _spy_native(monkeypatch, bug=None):
    """Count the native kernels' calls that ran (a wrapper returns None where they do not
    apply); ``bug``: ``forward`` adds 0.1 to their pooled output, ``state`` doubles the fused
    rowwise-Adagrad state after their backward."""
    from fbtriton_dist.ops import cpu_native

    monkeypatch.setenv("FBTD_CPU_NATIVE", "1")
    ran = {"forward": 0, "backward": 0}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            ran[name] += out is not None
            if out is not None and bug == "forward" and name == "forward":
                out = out + 0.1
            if out is not None and bug == "state" and kwargs.get("momentum1") is not None:
                kwargs["momentum1"].mul_(2.0)
            return out

        return wrapped

    for name in ran:
        monkeypatch.setattr(cpu_native, name, spy(name, getattr(cpu_native, name)))
    return ran


@pytest.mark.parametrize("shape, phases", [
    ("S0", "fwd"), ("S0", "fwd_bwd_rowwise_adagrad"), ("S0", "fwd,fwd_bwd_sgd"),
    ("S2", "fwd_bwd_rowwise_adagrad"),  # fp16 rows
])
def test_check_runs_the_native_kernels_on_the_timed_phases(monkeypatch, tmp_path, shape, phases):
    """On the CPU, ``--check`` checks the providers it times as they are timed: ``ours`` and
    ``ours_checked`` on the native kernels, on exactly the phases timed (the forward: one
    call; a fused step: 3 forwards and backwards); timing left out here."""
    ran = _spy_native(monkeypatch)
    monkeypatch.setattr(tbe, "run_shape", lambda *a: [])
    out = tmp_path / "tbe.json"
    tbe.main(["--tiny", "--device", "cpu", "--check", "--shapes", shape, "--providers",
              "ours,reference,ours_checked", "--phases", phases, *FAST, "--out", str(out)])
    check = json.loads(out.read_text())["check"][shape]
    want = phases.split(",")
    assert check["ok"], check
    assert [(c["providers"], c["bounds_check"], c["phase"]) for c in check["checked"]] == [
        ([p], bounds, ph) for p, bounds in (("ours", "warn"), ("ours_checked", "error"))
        for ph in want]
    steps = sum(1 if ph == "fwd" else 3 for ph in want)
    assert ran == {"forward": 2 * steps, "backward": 2 * (steps - want.count("fwd"))}


@pytest.mark.parametrize("bug, says", [
    ("forward", r"ours \(backend 'auto'\) fwd: forward of step0: ours\.fwd\."
                r"step0_forward_max_rel_err"),
    ("state", r"ours \(backend 'auto'\) fwd_bwd_rowwise_adagrad: rowwise-Adagrad state "
              r"\(momentum1\) after 3 steps: ours\.fwd_bwd_rowwise_adagrad\.momentum_max_rel_err"),
])
def test_check_catches_a_wrong_native_kernel(monkeypatch, tmp_path, capsys, bug, says):
    """A wrong native forward, or a wrong fused rowwise-Adagrad step, stops the run untimed
    (the check used to run the Triton interpreter, which the CPU rows never time)."""
    _spy_native(monkeypatch, bug)
    monkeypatch.setattr(tbe, "run_shape", lambda *a: pytest.fail("timed: the check let the wrong kernel through"))
    with pytest.raises(SystemExit) as exc:
        tbe.main(["--tiny", "--device", "cpu", "--check", "--shapes", "S0", "--providers",
                  "ours,reference", *FAST])
    assert exc.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "provider ours (backend='auto') vs the reference backend: check failed" in err, err
    assert re.search(says, err), err


def test_printed_speedups_are_the_others_time_over_this_ones(capsys):
    """Known timings in: ``ratios[other]`` is other's time / this one's (> 1: this one is
    faster), in the rows and in the printed table; the FBGEMM line is FBGEMM's median over
    ours."""
    def row(provider, busy, median, phase="fwd"):
        return dict(shape="S0", provider=provider, phase=phase, busy_ms=busy, median_ms=median,
                    pipelined_ms=None, bytes=1e6, gbs_busy=1.0, pct_copy_busy=1.0,
                    gbs_median=1.0, pct_copy_median=1.0, peak_gb=None)

    rows = [row("ours", 1.0, 2.0), row("fbgemm", 4.0, 3.0), row("reference", 10.0, 8.0),
            row("ours", 2.0, 2.0, "fwd_bwd_sgd"), row("fbgemm", 1.0, 1.0, "fwd_bwd_sgd")]
    tbe._add_ratios(rows)
    assert rows[0]["ratios"] == {"fbgemm": {"busy": 4.0, "median": 1.5},
                                 "reference": {"busy": 10.0, "median": 4.0}}
    assert rows[1]["ratios"]["ours"] == {"busy": 0.25, "median": 2.0 / 3.0}
    assert rows[3]["ratios"] == {"fbgemm": {"busy": 0.5, "median": 0.5}}  # ours slower here
    tbe.print_shape_table(rows, [], "wall")
    tbe.print_vs_fbgemm(rows)
    lines = capsys.readouterr().out.splitlines()
    ours_fwd = next(x for x in lines if x.split()[:2] == ["fwd", "ours"])
    assert ours_fwd.endswith("fbgemm 4.00/1.50 reference 10.00/4.00"), ours_fwd
    ours_sgd = next(x for x in lines if x.split()[:2] == ["fwd_bwd_sgd", "ours"])
    assert ours_sgd.endswith("fbgemm 0.50/0.50"), ours_sgd
    e2e = [x for x in lines if "e2e median" in x]
    assert e2e[0].endswith("fwd: fbgemm 3.000 ms; ours 2.000 ms = 1.50x"), e2e
    assert e2e[1].endswith("fwd_bwd_sgd: fbgemm 1.000 ms; ours 2.000 ms = 0.50x"), e2e


def _plant(monkeypatch, bug: str, on_backend: str) -> None:
    """A wrong TBE wherever the bench builds one for ``on_backend`` (run on the reference, so the
    test needs no interpreter): ``forward`` adds 0.1 to every pooled value, ``accumulator``
    doubles the rowwise-Adagrad state before every step, ``raises`` cannot be built."""
    from fbtriton_dist.bench import tbe_cases

    class Planted(tbe_cases.TableBatchedEmbedding):
        def __init__(self, *args, backend="auto", **kwargs):
            planted = backend == on_backend
            if planted and bug == "raises":
                raise RuntimeError("planted: this TBE cannot be built")
            super().__init__(*args, backend="reference" if planted else backend, **kwargs)
            self.planted = planted

        def forward(self, *args, **kwargs):
            if self.planted and bug == "accumulator" and torch.is_grad_enabled():
                with torch.no_grad():
                    self.momentum1.mul_(2.0)
            out = super().forward(*args, **kwargs)
            return out + 0.1 if self.planted and bug == "forward" else out

    monkeypatch.setattr(tbe_cases, "TableBatchedEmbedding", Planted)


CHECKED = (r"S0 \(.*\): provider ours,ours_graph \(backend='auto'\) vs the reference backend: "
           r"check failed")
COMPARED = r"S0 \(.*\): provider reference \(backend='reference'\) vs fbgemm: check failed"


@pytest.mark.parametrize(
    "bug, on_backend, flags, says",
    [
        ("forward", "auto", ["--check"], CHECKED + r".*\n  ours/ours_graph \(backend 'auto'\) "
         r"fwd: forward of step0: ours/ours_graph\.fwd\.step0_forward_max_rel_err [0-9.e-]+ "
         r"> 0\.0001"),
        ("accumulator", "auto", ["--check"], CHECKED + r"(.|\n)*\n  ours/ours_graph "
         r"\(backend 'auto'\) fwd_bwd_rowwise_adagrad: weights after 3 fused steps: "
         r"ours/ours_graph\.fwd_bwd_rowwise_adagrad\.weights_max_abs_err [0-9.e-]+ > 1e-05"),
        ("raises", "auto", ["--check"], CHECKED + r".*\n  the check raised RuntimeError: "
         r"planted: this TBE cannot be built"),
        ("forward", "reference", ["--providers", "reference,fbgemm"], COMPARED
         + r".*\n  forward output \(max err / max \|FBGEMM's\|\): fwd_rel_err [0-9.e-]+ > 1e-05"),
    ],
    ids=["check-forward", "check-accumulator", "check-raises", "fbgemm-forward"],
)
def test_a_wrong_result_fails_the_run_and_nothing_is_timed(
    monkeypatch, tmp_path, capsys, bug, on_backend, flags, says
):
    if "fbgemm" in " ".join(flags):
        pytest.importorskip("fbgemm_gpu")
    _plant(monkeypatch, bug, on_backend)
    timed = []
    measure = tbe.Timer.measure
    monkeypatch.setattr(tbe.Timer, "measure", lambda self, fn: timed.append(fn) or measure(self, fn))
    out = tmp_path / "tbe.json"
    with pytest.raises(SystemExit) as exc:
        tbe.main(["--tiny", "--device", "cpu", "--shapes", "S0,S1", *flags, *FAST, "--out", str(out)])
    assert exc.value.code not in (0, None)
    assert timed == []
    err = capsys.readouterr().err
    assert re.search(says, err), err
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["failed"] == err.strip() and "S1" not in data["shapes"]


def test_plot(report, tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = report
    png = tmp_path / "tbe.png"
    tbe.main(["--plot", str(path), "--png", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bytes_model_matches_baselines():
    """BASELINES.md: S1 moves 704.6 MB forward and 2053 MB forward+backward (SGD)."""
    s1 = tbe.SHAPES["S1"]
    n = s1.B * s1.L
    unique = [40128] * 31 + [1_284_104 - 31 * 40128]  # 1,284,104 unique rows in all
    batch = tbe.Batch(None, None, None, [n] * 32, unique)
    assert tbe.model_bytes(s1, batch, "fwd", 4) == 704_643_072
    assert round(tbe.model_bytes(s1, batch, "fwd_bwd_sgd", 4) / 1e6) == 2053


def test_shapes_and_tiny():
    assert list(tbe.SHAPES) == [f"S{i}" for i in range(7)] + ["C0", "C1"]
    c0, c1 = tbe.SHAPES["C0"], tbe.SHAPES["C1"]  # the fast-CPU-path issue's shapes
    assert (c0.tables, c0.B, c0.L, c0.zipf) == ([(100_000, 64)] * 8, 512, 20, None)
    assert (c1.tables, c1.B, c1.L, c1.zipf) == ([(200_000, 128)] * 4, 1024, 10, 1.1)
    assert tbe.SHAPES["S4"].weight_bytes == 8 * 10_000_000 * 256 * 2
    for s in tbe.SHAPES.values():
        t = s.tiny()
        assert len(t.tables) <= 2 and t.B <= 8 and all(E <= 1000 for E, _ in t.tables)
        assert {D for _, D in t.tables} == {D for _, D in s.tables}
        b = tbe.make_batch(t, torch.device("cpu"))
        T = len(t.tables)
        assert b.offsets.shape == (T * t.B + 1,) and b.indices.dtype == torch.int64
        assert int(b.offsets[-1]) == b.indices.numel() == T * t.B * t.L


def test_union_length():
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert union_length([]) == 0


def test_bucketize_sweep_configs_agree_on_a_small_batch():
    """``tbe_sweep --bucketize``: every launch config gives the same output, on both the plain
    bucketize and the fixed-shape send path (with its check: no flag on a valid batch), cut
    for one rank and for two row-wise ranks. Timing is the GPU's; here it is left out."""
    from fbtriton_dist.bench.tbe_sweep import bucketize_sweep

    rows = bucketize_sweep(["8,16,1", "4,8,1"], torch.device("cpu"), B=5, L=3,
                           rows=(100, 7, 1, 50), time=lambda fn, iters: {})
    assert len(rows) == 8  # 2 cuts x 2 configs x 2 paths
    assert all(r["same"] for r in rows)
    assert {r["phase"] for r in rows} == {"bucketize", "bucketize_into+check"}


def test_pooling_none_rows_and_the_sequence_check(tmp_path):
    """``bench tbe --pooling none`` (sequence lookups, a row per id) on the CPU: ours, the
    reference and torch's F.embedding timed on every phase; with ``--check`` ours agrees with
    the reference first."""
    out = tmp_path / "tbe_none.json"
    tbe.main(["--tiny", "--device", "cpu", "--pooling", "none", "--check", "--shapes", "S0,S5",
              "--providers", "ours,reference,torch", *FAST, "--out", str(out)])
    data = json.loads(out.read_text())
    assert all(c["ok"] for c in data["check"].values()), data["check"]
    rows = {(r["shape"], r["provider"], r["phase"]): r for r in data["rows"]}
    for shape in ("S0", "S5"):
        for provider in ("ours", "reference"):
            for phase in tbe.DEFAULT_PHASES:
                r = rows[(shape, provider, phase)]
                assert "error" not in r and r["median_ms"] > 0, (shape, provider, phase, r)
        assert any(p.startswith("torch") and "error" not in r and r.get("median_ms")
                   for (s, p, _), r in rows.items() if s == shape), shape
    assert "failed" not in data


# ---------------------------------------------------------------- thread counts, repeats


def _timed(provider, phase, threads, median, spread_=None):
    return dict(shape="C0", provider=provider, phase=phase, threads=threads, busy_ms=median,
                median_ms=median, spread=spread_, spread_flag=False, cpu_util=1.0)


def test_best_count_and_ratios_are_each_providers_lowest_and_theirs_over_ours(capsys):
    """Known timings in: each provider's best count is its lowest median; ``vs_ours`` is the
    other's time over ours', at each count and each at its own best (> 1: ours faster); the
    markdown table prints the best-vs-best ratio in bold."""
    rows = [_timed("ours", "fwd", 1, 4.0), _timed("ours", "fwd", 2, 2.0),
            _timed("fbgemm", "fwd", 1, 3.0), _timed("fbgemm", "fwd", 2, 30.0),
            _timed("ours", "fwd_bwd_sgd", 1, 1.0), _timed("ours", "fwd_bwd_sgd", 2, 5.0),
            _timed("fbgemm", "fwd_bwd_sgd", 1, 0.5)]  # fbgemm at one count only
    best = {(e["phase"], e["provider"]): e for e in tbe.best_counts(rows)}
    ours, fb = best[("fwd", "ours")], best[("fwd", "fbgemm")]
    assert (ours["best_threads"], ours["best_ms"]) == (2, 2.0)
    assert (fb["best_threads"], fb["best_ms"]) == (1, 3.0)
    assert "vs_ours" not in ours
    assert fb["vs_ours"] == {"best": 1.5, "by_threads": {1: 0.75, 2: 15.0}}
    sgd = best[("fwd_bwd_sgd", "fbgemm")]["vs_ours"]
    assert sgd == {"best": 0.5, "by_threads": {1: 0.5}}  # fbgemm faster: below 1
    assert [e["phase"] for e in tbe.best_counts(rows)] == ["fwd"] * 2 + ["fwd_bwd_sgd"] * 2
    tbe.print_threads_table(tbe.best_counts(rows), [1, 2])
    out = capsys.readouterr().out
    assert "| C0 | fwd | fbgemm / ours | 0.75x | 15.00x | **1.50x** (fbgemm @ 1 / ours @ 2) |" in out
    assert "| C0 | fwd_bwd_sgd | fbgemm / ours | 0.50x | - | **0.50x** (fbgemm @ 1 / ours @ 1) |" in out
    assert "| C0 | fwd | ours | 4.000 - | 2.000 - | 2.000 @ 2 thr |" in out
    # the per-count ratios of the rows compare providers at the same count only
    tbe._add_ratios(rows)
    assert rows[1]["ratios"] == {"fbgemm": {"busy": 15.0, "median": 15.0}}
    assert rows[4]["ratios"] == {"fbgemm": {"busy": 0.5, "median": 0.5}}
    assert rows[5]["ratios"] == {}


def test_spread_is_max_minus_min_over_the_median_and_the_row_is_the_median_repeat():
    assert spread([10.0, 12.0, 11.0]) == pytest.approx(2.0 / 11.0)
    assert spread([3.0, 3.0]) == 0.0
    assert spread([5.0]) is None and spread([]) is None
    assert SPREAD_FLAG == 0.20
    runs = [dict(median_ms=m, busy_ms=m, wall_s=1.0, pipelined_ms=None) for m in (10.0, 13.0, 9.0)]
    row = tbe._row(dict(provider="ours", threads=2), {"bytes": 1e6}, runs, copy_gbs=1.0)
    assert row["median_ms"] == 10.0 and row["repeats_ms"] == [10.0, 13.0, 9.0]
    assert row["spread"] == pytest.approx(0.4) and row["spread_flag"] is True
    assert row["wall_s"] == 3.0 and row["gbs_median"] == pytest.approx(0.1)
    calm = tbe._row({}, {"bytes": 1e6}, runs[:1] + runs[:1], copy_gbs=1.0)
    assert calm["spread"] == 0.0 and calm["spread_flag"] is False
    assert tbe._spread(row) == "±40%!" and tbe._spread(calm) == "±0%" and tbe._spread({}) == "-"


def test_iqr_spread_and_the_per_repeat_ratio():
    """The interquartile spread barely moves for one outlying repeat where max - min does;
    the paired ratio takes each provider's best count within each repeat, then the median
    repeat, and is left out unless both have the same repeats (>= 2) at every count."""
    calm, burst = [10.0, 10.5, 11.0, 10.2, 10.8], [10.0, 10.5, 11.0, 10.2, 30.0]
    assert iqr_spread(calm) == pytest.approx(0.6 / 10.5)
    assert iqr_spread(burst) == pytest.approx(0.8 / 10.5) and spread(burst) > 1.9
    assert iqr_spread([1.0, 2.0]) is None
    ours = {1: [2.0, 4.0, 2.0], 2: [1.0, 5.0, 3.0]}  # best per repeat: 1, 4, 2
    fb = {1: [3.0, 4.0, 3.0], 2: [6.0, 8.0, 1.0]}  # 3, 4, 1
    assert paired_ratio(fb, ours) == {"median": 1.0, "min": 0.5, "max": 3.0, "n": 3}
    assert paired_ratio({1: [3.0, 4.0]}, ours) is None and paired_ratio({1: [1.0]}, {1: [1.0]}) is None
    rows = [dict(_timed(p, "fwd", t, sorted(v[t])[1]), repeats_ms=v[t])
            for p, v in (("ours", ours), ("fbgemm", fb)) for t in (1, 2)]
    vs = {e["provider"]: e for e in tbe.best_counts(rows)}["fbgemm"]["vs_ours"]
    assert vs["paired"]["median"] == 1.0 and vs["best"] == pytest.approx(3.0 / 2.0)


def test_threads_parsing_and_its_errors(monkeypatch):
    assert tbe.parse_threads("1,2", 2) == [1, 2]
    assert tbe.parse_threads("2", 4) == [2]
    assert tbe.parse_threads(" 2,1,2", 2) == [2, 1]
    for raw in ("0", "-1", "1,0", "1,x", "", "1,,2"):
        with pytest.raises(SystemExit, match=r"--threads: expected a comma list of thread "
                           r"counts from 1 to the 2 usable cores"):
            tbe.parse_threads(raw, 2)
    with pytest.raises(SystemExit, match=r"--threads: 3 is more than the 2 usable cores "
                       r"\(len\(os.sched_getaffinity\(0\)\)\); expected counts from 1 to 2"):
        tbe.parse_threads("1,3", 2)
    monkeypatch.setattr(tbe, "usable_cores", lambda: 2)  # the bound main() checks against
    with pytest.raises(SystemExit, match="5 is more than the 2 usable cores"):
        tbe.main(["--tiny", "--device", "cpu", "--shapes", "S0", "--threads", "1,5", *FAST])
    with pytest.raises(SystemExit, match="--repeats: expected a count >= 1"):
        tbe.main(["--tiny", "--device", "cpu", "--shapes", "S0", *FAST, "--repeats", "0"])


def test_tiny_run_at_two_thread_counts(monkeypatch, tmp_path, capsys):
    """``--threads 1,2 --repeats 2 --check``: the check runs once per shape, before timing; every
    provider and phase has a row at each count with both repeats and their spread; ``best`` has
    each provider's best count and, for the others, their time over ours'. The thread count
    is restored afterwards."""
    monkeypatch.setattr(tbe, "usable_cores", lambda: 2)  # a one-core runner still runs 2
    checks = []
    check = tbe.check
    monkeypatch.setattr(tbe, "check", lambda *a: checks.append(a[0].name) or check(*a))
    providers = ["ours", "reference"]
    try:
        import fbgemm_gpu  # noqa: F401
        providers.append("fbgemm")
    except ImportError:
        pass
    phases = ["fwd", "fwd_bwd_rowwise_adagrad"]
    before = torch.get_num_threads()
    out = tmp_path / "tbe.json"
    tbe.main(["--tiny", "--device", "cpu", "--check", "--shapes", "S0", "--providers",
              ",".join(providers), "--phases", ",".join(phases), "--threads", "1,2",
              *FAST, "--repeats", "2", "--out", str(out)])
    assert torch.get_num_threads() == before
    assert checks == ["S0"]
    data = json.loads(out.read_text())
    assert data["threads"] == [1, 2] and data["repeats"] == 2 and data["check"]["S0"]["ok"]
    rows = {(r["provider"], r["phase"], r["threads"]): r for r in data["rows"]}
    assert set(rows) == {(p, ph, t) for p in providers for ph in phases for t in (1, 2)}
    for key, r in rows.items():
        assert r["median_ms"] > 0 and len(r["repeats_ms"]) == 2 and r["spread"] >= 0, key
        assert r["cpu_util"] > 0 and r["median_ms"] in r["repeats_ms"], key
        assert r["spread_flag"] == (r["spread"] > SPREAD_FLAG), key
    best = {(e["provider"], e["phase"]): e for e in data["best"]}
    assert set(best) == {(p, ph) for p in providers for ph in phases}
    for (p, ph), e in best.items():
        assert set(e["by_threads"]) == {"1", "2"}  # JSON keys
        assert e["best_ms"] == min(m["median_ms"] for m in e["by_threads"].values())
        assert e["best_ms"] == e["by_threads"][str(e["best_threads"])]["median_ms"]
        if p != "ours":
            ours = best[("ours", ph)]
            assert e["vs_ours"]["best"] == pytest.approx(e["best_ms"] / ours["best_ms"])
            assert set(e["vs_ours"]["by_threads"]) == {"1", "2"}
    printed = capsys.readouterr().out
    assert "| S0 | fwd | reference / ours |" in printed and "**" in printed
    assert {(d["provider"], d["threads"]) for d in data["derived"]} == {
        (p, t) for p in providers for t in (1, 2)}
