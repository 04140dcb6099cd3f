"""``bench id_remap --tiny``: every provider runs both policies on the same drifting stream; our
fast path and the reference read the default row for the same ids; ours/this is this
provider's time over ours (> 1: ours is faster); the stream drifts."""

import json
import types

import pytest
import torch

from fbtriton_dist.bench import id_remap


def test_tiny_rows(tmp_path):
    out = tmp_path / "rows.json"
    id_remap.main(["--tiny", "--intervals", "1", "--out", str(out)])
    rows = json.loads(out.read_text())
    by = {(r["policy"], r["provider"]): r for r in rows}
    for policy in ("lru", "lfu"):
        ours, ref = by[(policy, "ours_cpu")], by[(policy, "ours_reference")]
        assert ours["default_share"] == ref["default_share"] > 0  # the same remap
        assert ours["ids_per_s"] > 0
        for r in (r for r in rows if r["policy"] == policy):  # this one's time over ours
            assert r["ours_over_this"] == pytest.approx(r["ms_per_step"] / ours["ms_per_step"])
            assert r["ours_over_this"] == pytest.approx(ours["ids_per_s"] / r["ids_per_s"])
        if (policy, "torchrec_mch_i1") in by:
            assert 0 <= by[(policy, "torchrec_mch_i1")]["default_share"] <= 1


def test_ours_over_this_from_known_step_times(monkeypatch, tmp_path, capsys):
    """Known step times in (ours 1 ms, the reference 4 ms, TorchRec 2 ms a step, on a fake
    clock): the rows and the printed table say ours is 4x and 2x faster."""
    clock = types.SimpleNamespace(now=0.0)

    def stepper(ms):
        def step(s, ids):
            clock.now += ms / 1e3
            return 0

        return step

    monkeypatch.setattr(id_remap, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(id_remap, "_ours",
                        lambda policy, rows, backend: stepper(1.0 if backend == "cpu" else 4.0))
    monkeypatch.setattr(id_remap, "_torchrec", lambda policy, rows, k: stepper(2.0))
    out = tmp_path / "rows.json"
    id_remap.main(["--tiny", "--intervals", "1", "--policies", "lru", "--out", str(out)])
    got = {r["provider"]: r for r in json.loads(out.read_text())}
    assert {p: r["ours_over_this"] for p, r in got.items()} == pytest.approx(
        {"ours_cpu": 1.0, "ours_reference": 4.0, "torchrec_mch_i1": 2.0})
    assert got["ours_cpu"]["ms_per_step"] == pytest.approx(1.0)
    printed = {x.split()[1]: x.split()[-1] for x in capsys.readouterr().out.splitlines()
               if x.startswith("lru ")}
    assert printed == {"ours_cpu": "1.00", "ours_reference": "4.00", "torchrec_mch_i1": "2.00"}


def test_drifting_ids_bring_new_ids_and_fade_old_ones():
    steps = [set(ids.tolist()) for _, ids in id_remap.drifting_ids(20, 2000, 500, 50, seed=1)]
    assert all(len(s) > 200 for s in steps)
    assert len(steps[-1] - set().union(*steps[:-1])) > 20  # new ids keep arriving
    assert not steps[0] & steps[-1]  # the window moved past the first ids
    again = [ids for _, ids in id_remap.drifting_ids(2, 100, 500, 50, seed=1)]
    assert torch.equal(again[1], next(iter(
        ids for s, ids in id_remap.drifting_ids(2, 100, 500, 50, seed=1) if s == 1)))
