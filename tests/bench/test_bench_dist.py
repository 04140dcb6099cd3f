"""``bench dist --tiny`` on 2 CPU ranks (torchrun, gloo), under a timeout: every provider gives
a row, ours are all measured (only TorchRec, a peer, may be skipped, when it is not importable,
and the run says why), and the lean / dedup paths train exactly like the plain one on the same
batches (bf16 on the wire: within a small relative error). A broken import in our own code
fails the run."""

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


def _run(*cmd: str, timeout: float = RUN_TIMEOUT_S, ok: bool = True) -> str:
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
    assert (proc.returncode == 0) == ok, f"exit status {proc.returncode}:\n{out[-6000:]}"
    return out


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_dist") / "dist.json"
    out = _run(*TORCHRUN, "-m", "fbtriton_dist.bench", "dist", "--tiny", "--out", str(path))
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
                if provider == "torchrec" and r["status"] == "skipped":  # a peer: may be absent
                    assert "not importable" in r["note"], r["note"]
                    assert f"{plan} {model} torchrec: skipped: {r['note']}" in out  # says why
                    continue
                assert r["status"] == "ok", f"{provider}: {r.get('note')}\n" + r.get(
                    "traceback", ""
                )
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
    for plan in PLANS:
        for model in MODELS:
            r = _row(results, plan, model, provider)
            assert r["status"] == "ok", (plan, model, r.get("note"))  # ours are never skipped
            plain = _row(results, plan, model, "ours_plain")
            rtol, atol = TOLERANCE[provider]
            assert r["losses"] == pytest.approx(plain["losses"], rel=rtol, abs=atol), (plan, model)
            for a, b in zip(r["losses_per_rank"], plain["losses_per_rank"], strict=True):
                assert a == pytest.approx(b, rel=rtol, abs=atol), (plan, model)


def test_vbe_batches_send_fewer_ids_and_bytes_and_train_like_the_same_fixed_samples(tmp_path):
    """``--vbe 8``: half of the tables are user features (one bag per 8 samples); each provider
    runs on the VBE batches and on the same samples as fixed batches. Ours send fewer ids and
    bytes on VBE batches, by the expected share, and train to the same losses; the fixed-shape
    provider takes fixed batches only."""
    path = tmp_path / "vbe.json"
    out = _run(*TORCHRUN, "-m", "fbtriton_dist.bench", "dist", "--tiny", "--vbe", "8",
               "--plans", "row_wise", "--models", "ebc", "--providers", "ours_plain",
               "ours_lean", "ours_fixed", "--out", str(path))
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    assert "VBE vs the same samples as fixed batches" in out
    rows = {(r["provider"], r["batch"]): r for r in results["rows"]}
    assert set(rows) == {("ours_plain", "vbe"), ("ours_plain", "fixed"), ("ours_lean", "vbe"),
                         ("ours_lean", "fixed"), ("ours_fixed", "fixed")}
    for provider in ("ours_plain", "ours_lean"):
        vbe, fixed = rows[(provider, "vbe")], rows[(provider, "fixed")]
        assert vbe["status"] == fixed["status"] == "ok", vbe.get("note")
        # 13 of 26 tables at 1/8 of the bags, L ids each: 9/16 of the ids (Zipf ids land on
        # the other rank about as often)
        share = vbe["ids_sent_per_step"] / fixed["ids_sent_per_step"]
        assert 0.45 < share < 0.7, share
        assert vbe["bytes_sent_per_step"] < 0.75 * fixed["bytes_sent_per_step"]
        for key in ("input_dist.data", "output_dist.forward", "output_dist.backward"):
            assert vbe["bytes_sent"][key] < fixed["bytes_sent"][key], key
        assert vbe["losses"] == pytest.approx(fixed["losses"], rel=1e-5, abs=1e-6)


def test_an_embedding_collection_step_against_torchrec(tmp_path):
    """``--models ec``: the tables as an EmbeddingCollection (a row per id), ours against
    TorchRec's sharded EmbeddingCollection; the lean and dedup paths train like the plain
    one; the fixed-shape provider has no sequence mode and gives no row."""
    path = tmp_path / "ec.json"
    _run(*TORCHRUN, "-m", "fbtriton_dist.bench", "dist", "--tiny", "--models", "ec",
         "--providers", "torchrec", "ours_plain", "ours_lean", "ours_dedup", "ours_fixed",
         "--out", str(path))
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    for plan in PLANS:
        rows = {r["provider"]: r for r in results["rows"] if r["plan"] == plan}
        assert set(rows) == {"torchrec", "ours_plain", "ours_lean", "ours_dedup"}, plan
        for name, r in rows.items():
            if name == "torchrec" and r["status"] == "skipped":
                continue
            assert r["status"] == "ok", (plan, name, r.get("note"), r.get("traceback"))
            assert r["model"] == "ec" and all(math.isfinite(x) for x in r["losses"])
        plain = rows["ours_plain"]
        assert plain["bytes_sent"]["output_dist.forward"] > 0
        for name in ("ours_lean", "ours_dedup"):
            assert rows[name]["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", ["CommOptions", "TrainPipeline"])
def test_a_broken_import_in_our_own_code_fails_the_run(tmp_path, name):
    """Our own fast path cannot be skipped: with ``fbtriton_dist.sharding.NAME`` unimportable,
    ``ours_lean`` is an error (the ImportError named), ``ours_plain`` is still measured, and
    the run exits non-zero."""
    path = tmp_path / "dist.json"
    out = _run(*TORCHRUN, "-m", "tests.bench.dist_driver", name, "--", "--tiny", "--plans",
               "row_wise", "--models", "ebc", "--providers", "ours_plain", "ours_lean",
               "--out", str(path), ok=False)
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    lean = _row(results, "row_wise", "ebc", "ours_lean")
    assert lean["status"] == "error", lean
    assert lean["note"].startswith("ImportError: cannot import name") and name in lean["note"]
    assert _row(results, "row_wise", "ebc", "ours_plain")["status"] == "ok"
    assert results["failed"] == [f"row_wise/ebc/ours_lean: error: {lean['note']}"]
    assert "bench dist: 1 failed:\n  row_wise/ebc/ours_lean: error: ImportError" in out


def test_only_a_peer_may_be_skipped():
    from fbtriton_dist.bench.dist import failure

    row = dict(plan="row_wise", model="ebc", status="skipped", note="not importable: x")
    assert failure(dict(row, provider="torchrec")) is None
    assert failure(dict(row, provider="ours_lean")) == (
        "row_wise/ebc/ours_lean: skipped: not importable: x"
    )
    assert failure(dict(row, provider="torchrec", status="error", note="E")) == (
        "row_wise/ebc/torchrec: error: E"
    )
    assert failure(dict(row, provider="ours_plain", status="ok")) is None


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


def test_job_preset_takes_the_quickstart_tables_batch_and_model_and_flags_win():
    from fbtriton_dist.bench.dist import parse_args

    job = os.path.join(ROOT, "configs", "jobs", "quickstart.yaml")
    args = parse_args(["--job", job])
    names = [t.name for t in args.job_tables]
    assert names == ["t_user", "t_item_item", "t_item_item_history", "t_category", "t_query"]
    assert [t.bag_size for t in args.job_tables] == [1, 1, 8, 2, 4]
    assert [t.num_embeddings for t in args.job_tables] == [20000, 50000, 50000, 500, 10000]
    assert (args.batch_size, args.dim, args.bag_size) == (256, 16, "tables")
    assert (args.dense_arch, args.over_arch, args.lr, args.zipf) == ([32, 16], [32, 16, 1],
                                                                      0.05, 1.05)
    flags = parse_args(["--job", job, "--batch-size", "64", "--lr", "0.1"])
    assert (flags.batch_size, flags.lr, flags.dim) == (64, 0.1, 16)


def test_thread_counts_default_to_the_rule_and_refuse_counts_below_one():
    from fbtriton_dist.bench.dist_cpu import thread_counts
    from fbtriton_dist.ops.cpu_threads import threads_per_rank, usable_cores

    assert thread_counts(None, 2) == [threads_per_rank(usable_cores(), 2)]
    assert thread_counts("1,2", 2) == [1, 2]
    for bad in ("0", "1,x", ""):
        with pytest.raises(ValueError, match="--threads: expected comma-separated counts >= 1"):
            thread_counts(bad, 2)


def test_best_thread_count_is_each_providers_fastest_and_ratios_use_it():
    from fbtriton_dist.bench.dist_report import best_threads

    def row(provider, threads, sps):
        return dict(plan="row_wise", model="dlrm", batch="fixed", provider=provider,
                    status="ok", threads_per_rank=threads, samples_per_s=sps,
                    ms_per_step=1e3 / sps, oversubscribed=threads > 1)

    rows = [row("torchrec", 1, 100.0), row("ours_lean", 1, 150.0), row("torchrec", 2, 120.0),
            row("ours_lean", 2, 90.0), dict(row("ours_plain", 1, 1e9), status="error")]
    best = {b["provider"]: b for b in best_threads(rows)}
    assert set(best) == {"torchrec", "ours_lean"}
    assert (best["torchrec"]["threads_per_rank"], best["ours_lean"]["threads_per_rank"]) == (2, 1)
    assert best["ours_lean"]["vs_torchrec_best"] == pytest.approx(150.0 / 120.0)


def test_interleaved_rounds_rotate_the_providers_and_take_medians():
    from fbtriton_dist.bench.dist_interleave import order, summarize

    names = ["torchrec", "ours_lean_serial", "ours_lean"]
    assert [order(names, r)[0] for r in range(4)] == [*names, names[0]]
    assert sorted(order(names, 2)) == sorted(names)
    rows = summarize({"a": [10.0, 30.0, 20.0, 40.0], "b": [5.0]}, samples_per_step=512)
    assert rows["a"]["ms_median"] == 25.0 and rows["a"]["ms_q1"] <= 25.0 <= rows["a"]["ms_q3"]
    assert rows["a"]["samples_per_s"] == pytest.approx(512 / 0.025)
    assert rows["b"]["ms_median"] == rows["b"]["ms_q1"] == 5.0
