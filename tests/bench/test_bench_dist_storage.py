"""``bench dist --storage``: sharded tables on tiers against ``device`` in one launch. The
printed ratio is tier ms / device ms (> 1: slower), per round then the median; the check
before timing flags any bit that differs; ``cached+hot`` promotes the hot shards within its
budget; a tiny run on 2 gloo ranks (with ``cached+hot``: tiers per shard) passes the check and
prints, for every tier, the ratio its own rounds give."""

import json
import re
import statistics

import pytest
import torch

from fbtriton_dist.bench.dist_storage import (
    device_shards,
    differences,
    format_rows,
    parse_tiers,
    summarise,
    tier_plan,
)
from tests.bench.test_bench_dist import TORCHRUN, _run


def _round(device_ms, cached_ms):
    cache = {"lookups": 100, "misses": 40, "evictions": 40, "writebacks": 30}
    return {"device": {"ms_per_step": device_ms, "samples_per_s": 1e3 / device_ms,
                       "cache": {}, "steps": 10},
            "cached": {"ms_per_step": cached_ms, "samples_per_s": 1e3 / cached_ms,
                       "cache": cache, "steps": 10}}


def test_the_ratio_is_tier_over_device_paired_per_round():
    # round 1: cached 2x slower; round 2: the machine was busier for both, still 2x; round 3 3x
    rows = summarise([_round(10.0, 20.0), _round(30.0, 60.0), _round(10.0, 30.0)],
                     ["device", "cached"])
    device, cached = rows
    assert device["ratio"] == 1.0 and cached["ratio"] == 2.0  # not 30 / 10 of the medians
    assert cached["hit_rate"] == pytest.approx(0.6) and cached["fetched_per_step"] == 4.0
    assert cached["written_back_per_step"] == 3.0 and "hit_rate" not in device
    assert "prefetch_hidden_ms" not in cached  # nothing read ahead: no prefetch numbers
    ahead = _round(10.0, 20.0)
    ahead["cached"]["cache"].update(prefetched=20, prefetch_used=10, prefetch_us=3000,
                                    prefetch_wait_us=1000)
    (read,) = summarise([ahead], ["device", "cached"], ranks=2)[1:]
    # per step and rank: (3000 - 1000) us hidden, 1000 us exposed over 10 steps x 2 ranks
    assert read["prefetch_hidden_ms"] == pytest.approx(0.1)
    assert read["prefetch_exposed_ms"] == pytest.approx(0.05)
    assert read["prefetched_per_step"] == 2.0 and read["prefetch_used_per_step"] == 1.0
    text = format_rows("row_wise/ebc/ours_plain", rows)
    assert re.search(r"^\s+cached\s+30\.00\s+33\s+2\.00x\s+0\.600\s+4\s+3\s", text, re.M), text
    (faster,) = summarise([_round(20.0, 5.0)], ["device", "cached"])[1:]
    assert faster["ratio"] == 0.25  # a tier faster than device reads < 1
    assert " 0.25x " in format_rows("h", [faster])


def test_tiers_put_device_first_and_refuse_unknown_ones():
    assert parse_tiers("cached,file") == ["device", "cached", "file"]
    assert parse_tiers("file, device,file") == ["device", "file"]
    with pytest.raises(ValueError, match=r"--storage: expected tiers among .*got 'cachd'"):
        parse_tiers("cachd")


def test_hot_tier_promotes_the_hot_shards_within_the_budget():
    """``cached+hot``: 2 row-wise tables of 1,000 x 4 on 2 ranks, 10 % caches; a shard is
    500 x 20 B = 10,000 B on device, 4,900 B cached (50 slots x 20 B + its slot map: 500 x 4 B
    + 50 x 38 B): 9,800 B a rank, one promotion more 14,900 B, within 95 % of 16,000 B."""
    from fbtriton_dist.bench.dist_setup import Table, make_plan
    from fbtriton_dist.planner import IdDistribution

    tables = [Table(name=f"t_{i}", num_embeddings=1000, embedding_dim=4, feature=f"f_{i}")
              for i in range(2)]
    plan = make_plan("row_wise", tables, 2, 2)
    kw = {"load_factor": 0.1, "policy": "lru", "path": None, "min_rows": 10,
          "stats": {t.name: IdDistribution(kind="zipf", alpha=1.1) for t in tables}}
    hot, names = tier_plan(plan, "cached+hot", hot_budget_bytes=16_000, **kw)
    assert names == ["t_0", "t_1"] and hot.table("t_1").storage.tier == "cached"
    assert device_shards(hot, names) == ["t_0[0] (rank 0: rows 0..500, cols 0..4)",
                                         "t_0[1] (rank 1: rows 500..1000, cols 0..4)"]
    # one budget per rank: rank 0's hot shard alone, its table's rank-1 shard stays cached
    one, _ = tier_plan(plan, "cached+hot", hot_budget_bytes=[16_000, 15_000], **kw)
    assert device_shards(one, names) == ["t_0[0] (rank 0: rows 0..500, cols 0..4)"]
    assert one.table("t_0").shards[1].storage is None  # the table's: cached
    cold, _ = tier_plan(plan, "cached+hot", hot_budget_bytes=15_000, **kw)  # 14,250 B: none
    assert cold == tier_plan(plan, "cached", **kw)[0] and device_shards(cold, names) == []
    with pytest.raises(ValueError, match=r"--storage cached\+hot: expected --hot-budget-mb"):
        tier_plan(plan, "cached+hot", **kw)


def test_hot_tiers_need_a_budget_per_rank_or_one(capsys):
    from fbtriton_dist.bench.dist import parse_args

    base = ["--tiny", "--storage", "cached+hot"]
    assert parse_args([*base, "--hot-budget-mb", "32,8"]).hot_budget_mb == [32.0, 8.0]
    assert parse_args([*base, "--hot-budget-mb", "4"]).storage == ["device", "cached+hot"]
    for bad in ([], ["--hot-budget-mb", "0"], ["--hot-budget-mb", "8,x"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])
    err = capsys.readouterr().err
    assert "--storage cached+hot: expected --hot-budget-mb" in err
    assert "expected MiB > 0, one or one per rank comma separated, got '8,x'" in err


def test_the_check_flags_one_bit_and_passes_equal_states():
    want = {"w#0": torch.arange(6.0).reshape(2, 3), "fused.m": torch.ones(2)}
    same = {k: v.clone() for k, v in want.items()}
    assert differences(want, same) == []
    off = {k: v.clone() for k, v in want.items()}
    off["w#0"][1, 2] = torch.nextafter(off["w#0"][1, 2], torch.tensor(10.0))
    (line,) = differences(want, off)
    assert line.startswith("w#0: 1 of 6 values differ")
    assert differences(want, {"w#0": want["w#0"]})[0].startswith("keys differ")


def test_tiny_run_passes_the_check_and_prints_tier_over_device(tmp_path):
    out_json = tmp_path / "storage.json"
    out = _run(*TORCHRUN, "-m", "fbtriton_dist.bench", "dist", "--tiny", "--tables",
               "configs/tables/storage_bench.yaml", "--storage", "cached,file,cached+hot",
               "--hot-budget-mb", "1", "--models", "ebc",
               "--plans", "row_wise", "--tier-min-rows", "1000", "--repeats", "2",
               "--split-steps", "1", "--path", str(tmp_path / "rows"), "--out", str(out_json))
    (entry,) = json.loads(out_json.read_text())["storage"]
    assert entry["check"] == "bit for bit as device" and len(entry["tiered_tables"]) == 4
    assert [r["tier"] for r in entry["rows"]] == ["device", "cached", "file", "cached+hot"]
    # 1 MiB a rank: room for one 7,813-row shard (531 kB on device, 114 kB cached) beside
    # the rank's 4 caches; the check above covered it (tiers per shard, bit for bit)
    hot = entry["promoted"]["cached+hot"]
    assert [h.split(" (rank ")[1][0] for h in hot] == ["0", "1"], hot
    for r in entry["rows"]:
        want = statistics.median(rnd[r["tier"]]["ms_per_step"] / rnd["device"]["ms_per_step"]
                                 for rnd in entry["rounds"])
        assert r["ratio"] == pytest.approx(want)
        printed = re.search(rf"^\s*{re.escape(r['tier'])}\s+\S+\s+\S+\s+(\S+)x\s", out,
                            re.M)
        assert printed and float(printed.group(1)) == pytest.approx(r["ratio"], abs=0.006), out
        if r["tier"] != "device":
            assert 0 <= r["hit_rate"] <= 1 and r["stages_ms"]["lookup"] > 0
    assert (tmp_path / "rows" / "rank1" / "file").is_dir()  # each rank's own file-tier folder
