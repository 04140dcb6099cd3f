"""``bench tbe --storage --device cuda --fbgemm`` on a machine without a GPU: the refusals name
the device and the reason; the pairs print FBGEMM's time over ours (> 1: ours faster); a tier
our module refuses gets a row saying so and the run goes on; FBGEMM's TBE built from our
weights agrees with ours after one step (the CPU TBE standing in for ``fbgemm_device``), and a
different update fails the comparison."""

import pytest
import torch

from fbtriton_dist.bench import storage, storage_fbgemm

TINY = ["--cache-load-factor", "0.5", "--tables", "1", "--rows", "60", "--dim", "4", "--batch", "4", "--bag", "2",
        "--batches", "2", "--steps", "1", "--warmup", "0", "--repeats", "1",
        "--check-steps", "1"]


def test_cuda_and_fbgemm_are_refused_without_a_gpu_naming_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"--device cuda: no CUDA device here"):
        storage.parse_args(["--storage", "cached", "--device", "cuda"])
    with pytest.raises(SystemExit, match=r"--fbgemm: FBGEMM's UVM tiers .* need CUDA; "
                                         r"expected --device cuda, got --device cpu"):
        storage.parse_args(["--storage", "cached", "--fbgemm"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the other side
    args = storage.parse_args(["--storage", "cached", "--device", "cuda", "--fbgemm"])
    assert (args.device, args.fbgemm, args.tiers) == ("cuda", True, ["device", "cached"])


def test_pairs_are_fbgemms_time_over_ours(capsys):
    rows = [{"tier": "device", "median_ms": 1.0}, {"tier": "cached", "median_ms": 2.0},
            {"tier": "fbgemm_device", "median_ms": 0.5},
            {"tier": "fbgemm_managed_caching", "median_ms": 6.0},
            {"tier": "fbgemm_managed", "median_ms": 9.0},
            {"tier": "host", "refused": "not built yet"},
            {"tier": "cached (graph)", "median_ms": 4.0}]
    pairs = storage_fbgemm.pair_ratios(rows)
    got = {(p["ours"], p["fbgemm"]): p["fbgemm_over_ours"] for p in pairs}
    assert got == {("device", "fbgemm_device"): 0.5, ("cached", "fbgemm_managed_caching"): 3.0,
                   ("cached (graph)", "fbgemm_managed_caching"): 1.5}
    storage_fbgemm.print_pairs(pairs)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("fbgemm ms / ours ms (> 1: ours faster)")
    assert lines[2].split() == ["cached", "fbgemm_managed_caching", "2.000", "6.000", "3.00x"]


def test_hit_rate_reads_fbgemms_unique_ids_and_misses():
    class Caching:  # FBGEMM's counters: calls, ids, unique ids, unique misses, ...
        gather_uvm_cache_stats = True

        def get_uvm_cache_stats(self):
            return torch.tensor([5, 100, 40, 10, 0, 0])

    assert storage_fbgemm.hit_rate(Caching()) == 0.75
    try:
        from fbgemm_gpu.tbe.cache.cache_config import UVMCacheStatsIndex as Index
    except ImportError:
        return
    assert (Index.num_unique_indices, Index.num_unique_misses) == (
        storage_fbgemm.UNIQUE_INDICES, storage_fbgemm.UNIQUE_MISSES)


def test_a_refused_tier_gets_a_row_and_the_run_goes_on(monkeypatch, capsys):
    build = storage.build

    def refusing(setup, tier, *args, **kwargs):  # what modules/tbe.py says of host on CUDA
        if tier == "host":
            raise ValueError("table 't0': storage tier 'host' on CUDA is not built yet")
        return build(setup, tier, *args, **kwargs)

    monkeypatch.setattr(storage, "build", refusing)
    report = storage.main(["--storage", "host,cached", "--device", "cpu", *TINY])
    rows = {r["tier"]: r for r in report["rows"]}
    assert rows["host"] == {"tier": "host", "refused": "table 't0': storage tier 'host' on "
                            "CUDA is not built yet"}
    assert rows["cached"]["median_ms"] > 0 and report["check"] == {"device": [], "cached": []}
    assert "host                   refused: table 't0'" in capsys.readouterr().out


def test_fbgemm_built_from_our_weights_matches_one_step_and_a_different_one_fails():
    pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    setup = storage.Setup(tables=2, rows=50, dim=4, batch=4, bag=3, batches=1)
    batch = storage.make_batches(setup)[0]
    cpu = torch.device("cpu")

    def compare(lr):
        ours = storage.build(setup, "device", 0.1, "lru", "", lr=lr)
        weights = [w.detach().clone() for w in ours.split_embedding_weights()]
        theirs = storage_fbgemm.build("fbgemm_device", [(50, 4)] * 2, weights, lr=storage.LR,
                                      eps=storage.EPS, load_factor=0.1, policy="lfu",
                                      device=cpu)
        assert storage_fbgemm.hit_rate(theirs) is None  # no cache: no hit rate
        return storage_fbgemm.compare(ours, theirs, batch)

    same = compare(storage.LR)
    assert same["failures"] == [] and same["weights_rel_err"] <= storage_fbgemm.REL_TOL
    assert compare(0.06)["failures"][0].startswith("weights_rel_err")
    with pytest.raises(ValueError, match="fbgemm_managed: expected --device cuda"):
        storage_fbgemm.build("fbgemm_managed", [(50, 4)], [], lr=0.1, eps=1e-8,
                             load_factor=0.1, policy="lru", device=cpu)


def test_a_run_with_fbgemm_compares_then_times_it(monkeypatch, capsys):
    """The run's FBGEMM path end to end on the CPU, FBGEMM's CPU TBE standing in for
    ``fbgemm_device`` (the UVM tiers need CUDA): compared with ours, trained the check steps,
    timed, its pair printed."""
    pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    monkeypatch.setattr(storage_fbgemm, "unavailable", lambda device: None)
    monkeypatch.setattr(storage_fbgemm, "PROVIDERS", {"fbgemm_device": "DEVICE"})
    args = storage.parse_args(["--storage", "cached", *TINY])
    args.fbgemm = True  # parse_args refuses it on the CPU
    report = storage.run(args)
    assert report["fbgemm"]["compare"]["failures"] == []
    rows = {r["tier"]: r for r in report["rows"]}
    assert rows["fbgemm_device"]["median_ms"] > 0 and rows["fbgemm_device"]["hit_rate"] is None
    (pair,) = report["pairs"]
    assert pair["fbgemm_over_ours"] == rows["fbgemm_device"]["median_ms"] / rows["device"][
        "median_ms"]
    assert "fbgemm_device vs our device after one step" in capsys.readouterr().out
