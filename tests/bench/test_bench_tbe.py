"""The TBE benchmark cannot rot: its tiny CPU run, its JSON, its bytes model and the
PNG chart mode run in CI; its correctness checks pass on this code and stop the run, untimed,
on a planted wrong result."""

import json
import re

import pytest
import torch

from fbtriton_dist.bench import tbe
from fbtriton_dist.bench.timing import union_length

SHAPES = ["S2", "S5", "S6"]  # fp16, two D groups (torch_fused's two calls), Zipf ids
FAST = ["--warmup", "1", "--iters", "1", "--min-iters", "1", "--pipelined", "1"]


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
        for ph in tbe.PHASES
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
    """``bench tbe --tiny --device cpu --check`` on this code: the Triton kernels (interpreted)
    agree with the reference, ours with FBGEMM's CPU TBE, and then every phase is timed."""
    out = tmp_path / "tbe.json"
    args = ["--tiny", "--device", "cpu", "--check", "--shapes", "S0", "--providers"]
    tbe.main([*args, "reference,fbgemm", *FAST, "--out", str(out)])
    data = json.loads(out.read_text())
    check = data["check"]["S0"]
    assert check["ok"] and check["failures"] == [] and check["rows_touched"] > 0, check
    assert check["weights_max_abs_err"] < 1e-5
    compared = data["correctness"]["S0"]
    if "skipped" in compared:  # FBGEMM is a peer: without it there is nothing to compare with
        assert "not importable" in compared["skipped"]
    else:
        assert compared["ok"] and compared["failures"] == [] and compared["rows_compared"] > 0
    timed = {r["phase"] for r in data["rows"] if r["provider"] == "reference" and r["median_ms"]}
    assert timed == set(tbe.PHASES) and "failed" not in data


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


CHECKED = r"S0 \(.*\): provider ours \(backend='triton'\) vs the reference backend: check failed"
COMPARED = r"S0 \(.*\): provider reference \(backend='reference'\) vs fbgemm: check failed"


@pytest.mark.parametrize(
    "bug, on_backend, flags, says",
    [
        ("forward", "triton", ["--check"], CHECKED + r".*\n  forward of step 0: "
         r"step0_forward_max_abs_err 0\.1 > 0\.0001"),
        ("accumulator", "triton", ["--check"], CHECKED + r"(.|\n)*\n  weights after 3 fused "
         r"rowwise-Adagrad steps: weights_max_abs_err [0-9.e-]+ > 1e-05"),
        ("raises", "triton", ["--check"], CHECKED + r".*\n  the check raised RuntimeError: "
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
            for phase in tbe.PHASES:
                r = rows[(shape, provider, phase)]
                assert "error" not in r and r["median_ms"] > 0, (shape, provider, phase, r)
        assert any(p.startswith("torch") and "error" not in r and r.get("median_ms")
                   for (s, p, _), r in rows.items() if s == shape), shape
    assert "failed" not in data
