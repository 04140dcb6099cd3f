"""``bench dist --tiny`` on 2 CPU ranks (torchrun, gloo), under a timeout: every provider gives
a row, the measured ones have numbers, and the lean / dedup paths train exactly like the plain
one on the same batches (bf16 on the wire: within a small relative error)."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 120
PLANS, MODELS = ("row_wise", "table_wise"), ("ebc", "dlrm")
PROVIDERS = ("torchrec", "ours_plain", "ours_lean", "ours_lean_bf16", "ours_dedup", "ours_fixed",
             "ours_graph", "ours_graph_overlap", "ours_graph_bf16")
# losses against ours_plain: (rtol, atol); bf16 pooled values and gradients on the wire
TOLERANCE = {"ours_lean": (1e-5, 1e-6), "ours_dedup": (1e-5, 1e-6), "ours_lean_bf16": (3e-2, 1e-2),
             "ours_fixed": (1e-5, 1e-6), "ours_graph": (1e-5, 1e-6),
             "ours_graph_overlap": (1e-5, 1e-6), "ours_graph_bf16": (3e-2, 1e-2)}


def _run(*cmd: str, timeout: float = RUN_TIMEOUT_S) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FBTD_PG_TIMEOUT_S": "60"}
    proc = subprocess.Popen(
        [sys.executable, *cmd],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_dist") / "dist.json"
    out = _run(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "-m",
        "fbtriton_dist.bench",
        "dist",
        "--tiny",
        "--out",
        str(path),
    )
    with open(path, encoding="utf-8") as f:
        return json.load(f), out, path


def _row(results, plan, model, provider):
    rows = [
        r
        for r in results["rows"]
        if (r["plan"], r["model"], r["provider"]) == (plan, model, provider)
    ]
    assert len(rows) == 1, f"{plan}/{model}/{provider}: {len(rows)} rows"
    return rows[0]


def test_every_provider_has_a_row_and_the_measured_ones_have_numbers(tiny):
    results, out, _ = tiny
    setup = results["setup"]
    assert setup["world_size"] == 2 and setup["backend"] == "gloo" and setup["tables"] == 26
    assert "samples/s" in out  # rank 0 printed the table
    for plan in PLANS:
        for model in MODELS:
            for provider in PROVIDERS:
                r = _row(results, plan, model, provider)
                assert r["status"] in ("ok", "skipped"), f"{provider}: {r.get('note')}\n" + r.get(
                    "traceback", ""
                )
                if r["status"] == "skipped":
                    assert r["note"], "a skipped provider says why"
                    continue
                assert r["samples_per_s"] > 0 and r["ms_per_step"] > 0
                assert len(r["losses"]) == setup["steps"]
                assert all(math.isfinite(x) for x in r["losses"])
                assert r["bytes_sent_per_step"] > 0
                assert r["stages_ms"]["backward"] >= 0
                if provider.startswith("ours"):
                    assert r["bytes_source"] == "comm_report"
                    assert {"input_dist", "lookup", "output_dist"} <= set(r["stages_ms"])
            plain = _row(results, plan, model, "ours_plain")
            assert plain["status"] == "ok", plain.get("note")
            stages = {k.split(".")[0] for k in plain["bytes_sent"]}
            assert {"input_dist", "output_dist"} <= stages, plain["bytes_sent"]
            if _row(results, plan, model, "torchrec")["status"] == "ok":
                assert plain["vs_torchrec"] > 0


@pytest.mark.parametrize("provider", list(TOLERANCE))
def test_lean_paths_train_like_the_plain_loop(tiny, provider):
    results, _, _ = tiny
    skipped = []
    for plan in PLANS:
        for model in MODELS:
            r = _row(results, plan, model, provider)
            if r["status"] != "ok":
                skipped.append(r["note"])
                continue
            plain = _row(results, plan, model, "ours_plain")
            rtol, atol = TOLERANCE[provider]
            assert r["losses"] == pytest.approx(plain["losses"], rel=rtol, abs=atol), (plan, model)
            for a, b in zip(r["losses_per_rank"], plain["losses_per_rank"], strict=True):
                assert a == pytest.approx(b, rel=rtol, abs=atol), (plan, model)
    if skipped:
        pytest.skip(f"{provider} not measured: {skipped[0]}")


def test_plot_draws_the_results(tiny, tmp_path):
    pytest.importorskip("matplotlib")
    _, _, path = tiny
    png = tmp_path / "dist.png"
    _run("-m", "fbtriton_dist.bench", "dist", "--plot", str(path), "--png", str(png), timeout=60)
    assert png.stat().st_size > 1000


def test_busy_time_is_the_union_of_device_intervals():
    from fbtriton_dist.bench.dist_measure import busy_stats

    ns = 1_000_000  # 1 ms
    intervals = [
        (0, 4 * ns, "gemm"),
        (2 * ns, 6 * ns, "ncclDevKernel_AllToAll"),  # overlaps the gemm by 2 ms
        (3 * ns, 5 * ns, "tbe_forward"),  # inside both
        (10 * ns, 12 * ns, "ncclKernel_ReduceScatter"),
    ]
    stats = busy_stats(intervals, steps=2)
    assert stats["busy_ms"] == pytest.approx(8 / 2)  # [0, 6) + [10, 12)
    assert stats["nccl_ms"] == pytest.approx(6 / 2)  # [2, 6) + [10, 12)
    assert stats["compute_ms"] == pytest.approx(5 / 2)  # [0, 5)
    assert stats["span_ms"] == pytest.approx(12 / 2)
    assert busy_stats([], steps=3) == {}
