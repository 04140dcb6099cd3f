"""``bench id_remap --tiny``: every provider runs both policies on the same drifting stream; our
fast path and the reference read the default row for the same ids; the stream drifts."""

import json

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
        assert ours["ids_per_s"] > 0 and ours["ours_over_this"] == 1.0
        if (policy, "torchrec_mch_i1") in by:
            assert 0 <= by[(policy, "torchrec_mch_i1")]["default_share"] <= 1


def test_drifting_ids_bring_new_ids_and_fade_old_ones():
    steps = [set(ids.tolist()) for _, ids in id_remap.drifting_ids(20, 2000, 500, 50, seed=1)]
    assert all(len(s) > 200 for s in steps)
    assert len(steps[-1] - set().union(*steps[:-1])) > 20  # new ids keep arriving
    assert not steps[0] & steps[-1]  # the window moved past the first ids
    again = [ids for _, ids in id_remap.drifting_ids(2, 100, 500, 50, seed=1)]
    assert torch.equal(again[1], next(iter(
        ids for s, ids in id_remap.drifting_ids(2, 100, 500, 50, seed=1) if s == 1)))
