"""``bench tbe --storage`` (``bench/storage.py``): the tiers are checked against device bit for
bit before timing; the printed ratio is the tier's time over device's."""

import pytest

from fbtriton_dist.bench import storage, tbe


def test_ratio_is_the_tiers_time_over_devices(capsys):
    """Known timings in: cached takes twice device's time, so its ratio is 2.00x (> 1:
    slower), and the per-step numbers are the summed stats over the steps."""
    runs = {"device": [1.0, 3.0, 1.0], "cached": [2.0, 2.0, 9.0]}
    stats = {"cached": {"lookups": 100, "misses": 25, "writebacks": 20, "evictions": 20,
                        "prefetched": 30, "prefetch_used": 25, "prefetch_us": 4000,
                        "prefetch_wait_us": 1000}}
    rows = storage.summarise(runs, stats, {"cached": 10})
    by = {r["tier"]: r for r in rows}
    assert by["device"]["ratio"] == 1.0
    assert by["cached"]["ratio"] == 2.0
    assert by["cached"]["hit_rate"] == 0.75 and by["cached"]["fetched_per_step"] == 2.5
    assert by["cached"]["prefetch_exposed_ms_per_step"] == 0.1
    storage.print_rows(rows)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == ["cached"])
    assert line.split()[1:4] == ["2.000", "±350%!", "2.00x"], line
    assert "worker 0.400 ms, waited for 0.100 ms (hidden 0.300 ms)" in line, line


def test_tiny_run_checks_then_times_every_tier(tmp_path, capsys):
    """Through ``bench tbe``: the tiers equal device after the check steps, then each is timed
    (with prefetch), evicting as it goes."""
    report = tbe.main(["--storage", "cached,file", "--cache-load-factor", "0.1", "--tables", "2",
                       "--rows", "300", "--dim", "4", "--batch", "8", "--bag", "3",
                       "--batches", "3", "--steps", "2", "--warmup", "1", "--repeats", "2",
                       "--check-steps", "3", "--prefetch", "--path", str(tmp_path)])
    assert report["check"] == {"device": [], "cached": [], "file": []}
    rows = {r["tier"]: r for r in report["rows"]}
    assert list(rows) == ["device", "cached", "file"]
    for tier in ("cached", "file"):
        assert 0 < rows[tier]["hit_rate"] < 1 and rows[tier]["fetched_per_step"] > 0
        assert rows[tier]["prefetch_used_per_step"] > 0
        assert rows[tier]["ratio"] == rows[tier]["median_ms"] / rows["device"]["median_ms"]
    assert "equal device bit for bit after 3 steps" in capsys.readouterr().out


def test_a_tier_that_differs_stops_the_run_untimed(monkeypatch, capsys):
    build = storage.build

    def wrong(setup, tier, *args, **kwargs):  # the cached tier trains with another rate
        return build(setup, tier, *args, **kwargs, lr=0.06 if tier == "cached" else 0.05)

    monkeypatch.setattr(storage, "build", wrong)
    monkeypatch.setattr(storage, "time_tiers",
                        lambda *a, **k: pytest.fail("timed: the check let a wrong tier through"))
    with pytest.raises(SystemExit) as e:
        storage.main(["--storage", "cached", "--tables", "1", "--rows", "100", "--dim", "2",
                      "--batch", "4", "--bag", "2", "--check-steps", "1"])
    assert e.value.code == 1
    assert "cached: weights: " in capsys.readouterr().err


def test_bad_storage_names():
    with pytest.raises(SystemExit, match=r"--storage: expected a comma list of \['device', "
                                         r"'host', 'cached', 'file'\], got 'cahced'"):
        storage.parse_args(["--storage", "cahced"])


def test_both_slot_maps_are_checked_and_timed():
    """``--slot-map both``: the cached tier with its map on the host and on the device (the
    CUDA path, here on the CPU), each equal to device before timing, each with its row."""
    report = storage.main(["--storage", "cached", "--slot-map", "both", "--tables", "2",
                           "--rows", "300", "--dim", "4", "--batch", "8", "--bag", "3",
                           "--batches", "3", "--steps", "2", "--warmup", "1", "--repeats", "1",
                           "--check-steps", "3"])
    names = ["device", "cached (host map)", "cached (device map)"]
    assert report["check"] == {n: [] for n in names}
    rows = {r["tier"]: r for r in report["rows"]}
    assert list(rows) == names
    assert rows[names[1]]["hit_rate"] == rows[names[2]]["hit_rate"] < 1


def test_graph_rows_are_checked_and_timed():
    """``--graph``: every tier again as a GraphedStep (eager on the CPU), each checked equal
    to device before timing, each with its row."""
    report = storage.main(["--storage", "cached,host", "--graph", "--tables", "2",
                           "--rows", "300", "--dim", "4", "--batch", "8", "--bag", "3",
                           "--batches", "3", "--steps", "2", "--warmup", "1", "--repeats", "1",
                           "--check-steps", "3"])
    names = ["device", "device (graph)", "cached", "cached (graph)", "host", "host (graph)"]
    assert report["check"] == {n: [] for n in names}
    rows = {r["tier"]: r for r in report["rows"]}
    assert list(rows) == names
    assert 0 < rows["cached (graph)"]["hit_rate"] < 1
