"""MLPerf DLRM-dcnv2's data: the multi-hot Criteo reader (``train/multihot.py``) on small files
in the reference's format written here (values, order, rank sharding, resume position, the
eval halves, refusals), the synthetic source's fixed MLPerf bags, ``table_scale``, and a job
on the files that stops at its target AUC."""

import json
import zipfile

import numpy as np
import pytest
import torch

from fbtriton_dist.planner import ConfigError
from fbtriton_dist.train.config import MultiHotConfig, job_from_dict
from fbtriton_dist.train.data import DataPosition, FeatureSpec, SyntheticSource
from fbtriton_dist.train.job import main
from fbtriton_dist.train.mlperf_config import MLPERF_BAG_SIZES, MLPERF_ROWS
from fbtriton_dist.train.multihot import MultiHotSource, npz_memmap, rank_range

BAGS = [2, 1, 3]
ROWS = [1000, 5, 64]  # E: ids are taken % E
FEATURES = [FeatureSpec(name=f"f{i}", num_rows=E, pooling_factor=L, zipf=0.0)
            for i, (E, L) in enumerate(zip(ROWS, BAGS, strict=True))]


def write_day(folder, day, n, seed, compressed=False):
    """Day ``day`` in the reference's format; returns its arrays (dense, [ids per feature],
    labels)."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, 13)).astype(np.float32)
    labels = rng.integers(0, 2, (n, 1)).astype(np.int32)
    sparse = [rng.integers(0, 2**31 - 1, (n, L)).astype(np.int32) for L in BAGS]
    np.save(folder / f"day_{day}_dense.npy", dense)
    np.save(folder / f"day_{day}_labels.npy", labels)
    save = np.savez_compressed if compressed else np.savez
    save(folder / f"day_{day}_sparse_multi_hot.npz", **{str(f): a for f, a in enumerate(sparse)})
    return dense, sparse, labels


@pytest.fixture
def days(tmp_path):
    """Days 0 (7 rows) and 1 (6 rows) for training, day 2 (9 rows) for evaluation."""
    out = {d: write_day(tmp_path, d, n, seed=d) for d, n in [(0, 7), (1, 6), (2, 9)]}
    return tmp_path, out


def _source(folder, B, rank=0, world=1, **cfg):
    c = MultiHotConfig(dir=str(folder), train_days=(0, 1), eval_days=(2,), **cfg)
    return MultiHotSource(FEATURES, c, batch_size=B, rank=rank, world_size=world)


def _rows(days, which, a, b):
    """Rows [a, b) of the days ``which`` concatenated: dense, ids per feature, labels."""
    dense = np.concatenate([days[d][0] for d in which])[a:b]
    sparse = [np.concatenate([days[d][1][f] for d in which])[a:b] for f in range(len(BAGS))]
    labels = np.concatenate([days[d][2] for d in which])[a:b].reshape(-1)
    return dense, sparse, labels


def _check(batch, rows):
    dense, sparse, labels = rows
    B = dense.shape[0]
    torch.testing.assert_close(batch.dense, torch.from_numpy(dense))
    torch.testing.assert_close(batch.labels, torch.from_numpy(labels.astype(np.float32)))
    kjt = batch.sparse
    assert kjt.keys() == ["f0", "f1", "f2"]
    assert kjt.lengths().tolist() == [L for L in BAGS for _ in range(B)]
    want = np.concatenate([(s.astype(np.int64) % E).reshape(-1) for s, E in zip(sparse, ROWS,
                                                                               strict=True)])
    assert kjt.values().tolist() == want.tolist()
    assert kjt.values().dtype == torch.int64


def test_batches_read_the_rows_in_order_across_days(days):
    folder, arrays = days
    src = _source(folder, B=4)
    got = list(src.train_batches(DataPosition()))
    assert src.steps_per_epoch == 3 and len(got) == 3  # 13 rows: 3 batches of 4, 1 dropped
    for k, (batch, pos) in enumerate(got):
        _check(batch, _rows(arrays, (0, 1), 4 * k, 4 * k + 4))  # batch 1 spans the two days
        assert pos == DataPosition(samples=4 * (k + 1))


def test_ranks_read_disjoint_contiguous_parts(days):
    folder, arrays = days
    assert [rank_range(13, r, 2) for r in range(2)] == [(0, 7), (7, 13)]
    assert [rank_range(13, r, 3) for r in range(3)] == [(0, 5), (5, 9), (9, 13)]
    for rank, start in [(0, 0), (1, 7)]:
        src = _source(folder, B=3, rank=rank, world=2)
        got = list(src.train_batches(DataPosition()))
        assert len(got) == 2  # floor(13 // 2 / 3) on every rank
        for k, (batch, pos) in enumerate(got):
            _check(batch, _rows(arrays, (0, 1), start + 3 * k, start + 3 * k + 3))
            assert pos.samples == 2 * 3 * (k + 1)  # samples of all ranks


def test_resume_continues_with_the_next_batch(days):
    folder, _ = days
    for rank in range(2):
        src = _source(folder, B=3, rank=rank, world=2)
        whole = list(src.train_batches(DataPosition()))
        resumed = list(src.train_batches(whole[0][1]))
        assert len(resumed) == 1 and resumed[0][1] == whole[1][1]
        assert torch.equal(resumed[0][0].dense, whole[1][0].dense)
        assert torch.equal(resumed[0][0].sparse.values(), whole[1][0].sparse.values())


@pytest.mark.parametrize("part,lo,hi", [("val", 0, 5), ("test", 5, 9), ("all", 0, 9)])
def test_eval_reads_its_half_of_the_eval_days(days, part, lo, hi):
    folder, arrays = days
    for rank in range(2):
        src = _source(folder, B=2, rank=rank, world=2, eval_part=part)
        start, _ = rank_range(hi - lo, rank, 2)
        batches = src.eval_batches("all")
        assert len(batches) == (hi - lo) // 2 // 2  # the same count on every rank
        for k, batch in enumerate(batches):
            a = lo + start + 2 * k
            _check(batch, _rows(arrays, (2,), a, a + 2))
        assert len(src.eval_batches(1)) == min(1, len(batches))


def test_arrays_are_memory_mapped(days):
    folder, arrays = days
    a = npz_memmap(str(folder / "day_0_sparse_multi_hot.npz"), "2.npy")
    assert isinstance(a, np.memmap) and np.array_equal(a, arrays[0][1][2])
    src = _source(folder, B=4)
    assert isinstance(src.train.days[0].dense, np.memmap)


def test_bad_files_are_refused_by_name(tmp_path):
    write_day(tmp_path, 0, 4, seed=0, compressed=True)
    write_day(tmp_path, 2, 4, seed=2)
    with pytest.raises(ValueError, match="day_1_dense.npy not found"):
        MultiHotSource(FEATURES, MultiHotConfig(dir=str(tmp_path), train_days=(1,),
                                                eval_days=(2,)), batch_size=2)
    with pytest.raises(ValueError, match="compressed"):
        MultiHotSource(FEATURES, MultiHotConfig(dir=str(tmp_path), train_days=(0,),
                                                eval_days=(2,)), batch_size=2)
    with zipfile.ZipFile(tmp_path / "day_2_sparse_multi_hot.npz") as z:
        assert "2.npy" in z.namelist()
    with pytest.raises(ValueError, match="no array '3.npy'"):
        MultiHotSource([*FEATURES, FEATURES[0]], MultiHotConfig(
            dir=str(tmp_path), train_days=(2,), eval_days=(2,),
            features=("f0", "f1", "f2", "f0")), batch_size=2)


def test_synthetic_fixed_bags_have_mlperfs_sizes():
    features = [FeatureSpec(name=f"cat_{i}", num_rows=max(1, E // 1000), pooling_factor=L,
                            zipf=1.05)
                for i, (E, L) in enumerate(zip(MLPERF_ROWS, MLPERF_BAG_SIZES, strict=True))]
    B = 16
    src = SyntheticSource(features, num_dense=13, batch_size=B, seed=0, fixed_bags=True)
    kjt = src.batch(0).sparse
    assert kjt.lengths().tolist() == [L for L in MLPERF_BAG_SIZES for _ in range(B)]
    assert MLPERF_BAG_SIZES[20] == 100 and sum(MLPERF_BAG_SIZES) == 214
    for f, jt in zip(features, kjt.to_dict().values(), strict=True):
        assert 0 <= int(jt.values().min()) and int(jt.values().max()) < f.num_rows
    poisson = SyntheticSource(features, num_dense=13, batch_size=B, seed=0)
    assert poisson.batch(0).sparse.lengths().tolist() != kjt.lengths().tolist()


def test_table_scale_shrinks_rows_and_is_checked():
    job = {"tables": "configs/tables/mlperf_dcnv2.yaml", "model": {"kind": "dcnv2"},
           "train": {"steps": 1}}
    root = __file__.rsplit("/tests/", 1)[0]
    full = job_from_dict(job, base_dir=root)
    assert [t.num_embeddings for t in full.tables.tables] == list(MLPERF_ROWS)
    assert [t.pooling_factors[0] for t in full.tables.tables] == list(MLPERF_BAG_SIZES)
    small = job_from_dict({**job, "table_scale": 1e-3}, base_dir=root)
    assert [t.num_embeddings for t in small.tables.tables][:3] == [40000, 40, 18]
    assert min(t.num_embeddings for t in small.tables.tables) == 1
    with pytest.raises(ConfigError, match="table_scale"):
        job_from_dict({**job, "table_scale": 2}, base_dir=root)
    with pytest.raises(ConfigError, match="needs data.source: multihot"):
        job_from_dict({**job, "train": {"steps": 1, "eval_batches": "all"}}, base_dir=root)


def test_a_job_on_the_files_stops_at_its_target_and_resumes(days, tmp_path, capsys):
    folder, _ = days
    tables = [{"name": f"t{i}", "num_embeddings": E, "embedding_dim": 4, "features": [f"f{i}"],
               "pooling_factors": L} for i, (E, L) in enumerate(zip(ROWS, BAGS, strict=True))]
    job = {"seed": 0, "deterministic": True, "tables": tables,
           "model": {"kind": "dcnv2", "dense_arch": [8, 4], "over_arch": [8, 1],
                     "cross_layers": 2, "low_rank": 3},
           "data": {"source": "multihot", "prefetch": 0,
                    "multihot": {"dir": str(folder), "train_days": "0-1", "eval_days": [2],
                                 "eval_part": "all"}},
           "train": {"epochs": 1, "batch_size": 2, "eval_every_epochs": 0.5,
                     "eval_batches": "all", "target_auc": 0.0},
           "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    assert main(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
               if x]
    summary = records[-1]
    # 13 rows, B = 2: 6 steps an epoch, evaluated every 3; AUC >= 0 at the first evaluation
    assert summary["steps"] == 3 and summary["target_step"] == 3
    assert summary["time_to_target_s"] > 0 and "target 0.0 at step 3" in out
    assert [r["samples"] for r in records if r["kind"] == "eval"] == [8]  # 9 rows: 4 of 2
    job["train"]["target_auc"] = 1.01
    path.write_text(json.dumps(job))
    assert main(["--config", str(path), "--resume"]) == 0
    summary = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .split("\n") if x][-1]
    assert summary["steps"] == 6 and summary["target_step"] == "not reached"


def test_a_nan_auc_never_reaches_the_target():
    from types import SimpleNamespace

    from fbtriton_dist.train.loop import Trainer

    t = Trainer.__new__(Trainer)
    t.cfg = SimpleNamespace(train=SimpleNamespace(target_auc=0.5), name="x")
    t.env, t.target, t.step = SimpleNamespace(rank=1), {}, 7
    for auc, reached in [(float("nan"), False), (0.49, False), (0.5, True)]:
        t.last_eval = {"auc": auc}
        assert t._reached_target(1.0) is reached
    assert t.target == {"target_step": 7, "time_to_target_s": 1.0}
