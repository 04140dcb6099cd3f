"""``bench/slot_map_ops.py`` counts a cached step's launches on the torch path (the fused
path's count is ``tests/modules/test_tiers_slot_map_kernels.py``'s)."""

import os

from fbtriton_dist.bench import slot_map_ops


def test_counts_the_torch_path(capsys, monkeypatch):
    monkeypatch.delenv("FBTD_SLOT_MAP", raising=False)
    out = slot_map_ops.main(["--kernels", "0", "--rows", "2000", "--steps", "8"])
    table = capsys.readouterr().out
    assert out["steps"] > 0 and out["launches"] > 100, out  # ~110 + 8 a table: 8 tables
    assert "| map |" in table and "| kernels | 0.0 | 0.0 |" in table
    assert "FBTD_SLOT_MAP" not in os.environ  # the knobs put back
