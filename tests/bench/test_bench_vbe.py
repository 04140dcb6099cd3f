"""``bench vbe --tiny --device cpu``: every provider times both ways, VBE sends fewer ids, and
the two ways agree before timing (a planted difference stops the run)."""

import json

import pytest

from fbtriton_dist.bench import vbe

FAST = ["--warmup", "1", "--iters", "2"]


def test_tiny_cpu_rows(tmp_path):
    out = tmp_path / "vbe.json"
    vbe.main(["--tiny", "--device", "cpu", *FAST, "--out", str(out)])
    data = json.loads(out.read_text())
    rows = {r["provider"]: r for r in data["rows"]}
    assert {"ours_fixed", "ours_vbe"} <= set(rows)
    for name in {p.rsplit("_", 1)[0] for p in rows}:
        fixed, v = rows[f"{name}_fixed"], rows[f"{name}_vbe"]
        # T=2 user features of 16/4 users, T=2 item features of 16 samples, 3 ids a bag
        assert fixed["ids"] == 2 * 2 * 16 * 3 and v["ids"] == (2 * 4 + 2 * 16) * 3
        assert fixed["median_ms"] > 0 and v["vbe_over_fixed"] > 0
    assert not list(tmp_path.glob("*.tmp"))


def test_a_wrong_expansion_stops_the_run(monkeypatch, tmp_path):
    real = vbe.expand
    monkeypatch.setattr(vbe, "expand", lambda out, *a: real(out, *a) + 0.01)
    with pytest.raises(SystemExit, match="differs from the fixed one"):
        vbe.main(["--tiny", "--device", "cpu", *FAST, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
