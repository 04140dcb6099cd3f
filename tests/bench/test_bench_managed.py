"""``bench managed --tiny``: every variant trains on the same raw ids; managed tables never put
two ids on one row, hashed ones do; ``hash_bytes`` buys more rows than ``hash_rows``."""

import json

from fbtriton_dist.bench import managed_job


def test_tiny_rows(tmp_path):
    out = tmp_path / "rows.json"
    managed_job.main(["--tiny", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(rows) == set(managed_job.VARIANTS)
    tables = rows["managed"]["tables"]
    assert set(tables) == {"t_user", "t_item", "t_query"}  # the drifting ones
    for variant, r in rows.items():
        assert 0.5 < r["eval_auc"] <= 1.0 and r["train_s"] > 0, variant
        for name, d in r["tables"].items():
            assert d["ids"] == tables[name]["ids"] > 0, (variant, name)  # the same raw ids
            if variant.startswith("managed"):
                assert d["collided"] == 0 and d["rows"] == tables[name]["rows"]
                assert 0 < d["hit_rate"] <= 1
            else:
                assert d["default"] == 0 and "hit_rate" not in d
    for name in tables:
        assert rows["hash_bytes"]["tables"][name]["rows"] > rows["hash_rows"]["tables"][name]["rows"]
        assert rows["hash_rows"]["tables"][name]["rows"] == tables[name]["rows"]
    assert sum(d["collided"] for d in rows["hash_rows"]["tables"].values()) > 0
