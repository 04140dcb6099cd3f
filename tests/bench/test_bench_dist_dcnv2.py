"""``bench dist --models dcnv2``: MLPerf's DLRM-dcnv2, TorchRec's ``DLRM_DCN`` against our
``DCNv2Model`` on MLPerf's tables and multi-hot bags, from the same initial weights (2 CPU
ranks, gloo, under a timeout); the per-feature bags of the batch generator; the defaults."""

import json

import pytest

from fbtriton_dist.train.mlperf_config import MLPERF_BAG_SIZES, MLPERF_ROWS
from tests.bench.test_bench_dist import TORCHRUN, _run


def test_dcnv2_ours_against_torchrec_from_the_same_weights(tmp_path):
    """Row-wise (every table cut over both ranks): both providers measured, samples/s per rank
    reported, the ratio ours / TorchRec; the first warm-up step's loss (the initial weights')
    the same on every rank, and the later steps' close (the same rowwise Adagrad updates)."""
    path = tmp_path / "dcnv2.json"
    out = _run(*TORCHRUN, "-m", "fbtriton_dist.bench", "dist", "--tiny", "--models", "dcnv2",
               "--plans", "row_wise", "--providers", "torchrec", "ours_lean", "--batches", "2",
               "--steps", "2", "--split-steps", "1", "--out", str(path))
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    setup = results["setup"]
    assert setup["bag_sizes"] == list(MLPERF_BAG_SIZES) and setup["ids_per_sample"] == 214
    assert setup["tables"] == 26 and setup["rows"][5] == MLPERF_ROWS[5]  # 3 rows: not scaled
    assert setup["dense"]["cross_layers"] == 3 and setup["dense"]["low_rank"] == 8
    assert "per rank" in out and "(214 ids a sample)" in out
    rows = {r["provider"]: r for r in results["rows"]}
    assert set(rows) == {"torchrec", "ours_lean"}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("note"), r.get("traceback"))
        assert r["model"] == "dcnv2"
        assert r["samples_per_s_per_rank"] == pytest.approx(r["samples_per_s"] / 2)
    ours, theirs = rows["ours_lean"], rows["torchrec"]
    assert ours["vs_torchrec"] == pytest.approx(ours["samples_per_s"] / theirs["samples_per_s"])
    for a, b in zip(ours["warmup_losses_per_rank"], theirs["warmup_losses_per_rank"],
                    strict=True):
        assert len(a) == len(b) == 2  # warm-up: one pass over the 2 distinct batches
        assert a[0] == pytest.approx(b[0], rel=1e-5, abs=1e-6)
        assert a[1:] == pytest.approx(b[1:], rel=1e-4, abs=1e-5)
    assert ours["losses_per_rank"] == [pytest.approx(x, rel=1e-4, abs=1e-5)
                                       for x in theirs["losses_per_rank"]]
    assert ours["warmup_losses_per_rank"][0][0] != pytest.approx(
        ours["warmup_losses_per_rank"][1][0], rel=1e-3)  # the ranks' batches differ


def test_batches_take_each_features_bag_size():
    import torch

    from fbtriton_dist.bench.dist import MLPERF_TABLES
    from fbtriton_dist.bench.dist_setup import Table, make_batches, scaled_tables

    assert [t.bag_size for t in scaled_tables(MLPERF_TABLES, 16, 0.004)] == list(
        MLPERF_BAG_SIZES)
    tables = [Table(name=f"t{i}", feature=f"f{i}", num_embeddings=E, embedding_dim=4)
              for i, E in enumerate((5, 7, 3))]
    kw = dict(n=1, B=3, alpha=1.1, num_dense=2, seed=0, rank=0, device=torch.device("cpu"))
    batch = make_batches(tables, L=[2, 0, 5], **kw)[0].sparse.to_dict()
    for t, L in zip(tables, (2, 0, 5), strict=True):
        jt = batch[t.feature]
        assert jt.lengths().tolist() == [L] * 3
        assert jt.values().numel() == 3 * L
        assert ((jt.values() >= 0) & (jt.values() < t.num_embeddings)).all()
    assert make_batches(tables, L=4, **kw)[0].sparse.lengths().tolist() == [4] * 9
    with pytest.raises(ValueError, match="one bag size >= 0 per table"):
        make_batches(tables, L=[1, 2], **kw)


def test_dcnv2_defaults_are_mlperfs():
    from fbtriton_dist.bench.dist import DEFAULT_TABLES, MLPERF_TABLES, parse_args

    args = parse_args(["--models", "dcnv2"])
    assert (args.tables, args.bag_size, args.dim) == (MLPERF_TABLES, "tables", 128)
    assert (args.dense_arch, args.over_arch) == ([512, 256, 128], [1024, 1024, 512, 256, 1])
    assert (args.cross_layers, args.low_rank) == (3, 512)
    args = parse_args(["--models", "dlrm"])
    assert (args.tables, args.bag_size) == (DEFAULT_TABLES, 20)
    assert parse_args(["--models", "dcnv2", "--bag-size", "7"]).bag_size == 7
    for bad in (["--bag-size", "many"], ["--bag-size", "-1"], ["--low-rank", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--models", "dcnv2", *bad])
