"""Data sources: synthetic determinism and statistics, the Criteo TSV reader on generated files,
RandomRecDataset wrapping, resuming at a data position."""

import math
import random

import pytest
import torch

from fbtriton_dist.planner import IdDistribution
from fbtriton_dist.planner.stats import inverse_cdf_array
from fbtriton_dist.train.config import job_from_dict
from fbtriton_dist.train.data import (
    CriteoSource,
    DataPosition,
    FeatureSpec,
    RandomRecSource,
    SyntheticSource,
    feature_specs,
    make_source,
    parse_criteo_line,
    power_law_rows,
    zipf_ids,
    zipf_rows,
)

FEATURES = [
    FeatureSpec(name="a", num_rows=1000, pooling_factor=3.0, zipf=1.1),
    FeatureSpec(name="b", num_rows=7, pooling_factor=1.0, zipf=0.0),
]


def same(x, y):
    return (
        torch.equal(x.dense, y.dense)
        and torch.equal(x.labels, y.labels)
        and torch.equal(x.sparse.values(), y.sparse.values())
        and torch.equal(x.sparse.lengths(), y.sparse.lengths())
    )


def synthetic(rank=0, seed=0, B=16, world_size=1):
    return SyntheticSource(
        FEATURES, num_dense=5, batch_size=B, seed=seed, rank=rank, world_size=world_size
    )


def test_synthetic_is_a_function_of_seed_rank_step():
    a, b = synthetic(), synthetic()
    assert same(a.batch(3), b.batch(3))
    assert not same(a.batch(3), a.batch(4))
    assert not same(a.batch(3), synthetic(rank=1).batch(3))
    assert not same(a.batch(3), synthetic(seed=1).batch(3))
    assert not same(a.batch(0), a.batch(0, split=1))
    batch = a.batch(0)
    assert batch.dense.shape == (16, 5) and batch.labels.shape == (16,)
    assert batch.sparse.keys() == ["a", "b"] and batch.sparse.stride() == 16
    assert set(batch.labels.tolist()) <= {0.0, 1.0}


def test_synthetic_resume_sees_the_same_batches():
    src = synthetic(world_size=2)
    stream = src.train_batches(DataPosition())
    first = [next(stream) for _ in range(5)]
    assert first[2][1] == DataPosition(epoch=0, samples=3 * 2 * 16)
    resumed = src.train_batches(first[2][1])
    for (want, _), (got, _) in zip(first[3:], resumed, strict=False):
        assert same(want, got)


def test_zipf_ids_are_skewed_and_in_range():
    g = torch.Generator().manual_seed(0)
    ids = zipf_ids(1000, 50_000, 1.1, g)
    assert ids.min() >= 0 and ids.max() < 1000
    counts = torch.bincount(ids, minlength=1000)
    assert counts[0] == counts.max()
    assert counts[:10].sum() > 0.3 * ids.numel()  # H(10)/H(1000) for alpha 1.1 ~ 0.5
    uniform = zipf_ids(10, 20_000, 0.0, g)
    assert torch.bincount(uniform, minlength=10).min() > 1500
    assert zipf_ids(1, 5, 1.0, g).tolist() == [0] * 5


@pytest.mark.parametrize(("E", "alpha"), [(40_000_000, 1.1), (8_000_000, 1.05), (5000, 1.0),
                                          (1000, 1.2), (3, 0.8), (10**9, 0.9)])
def test_zipf_ids_are_the_planners_law(E, alpha):
    """The same uniforms give the planner's ids (``stats.inverse_cdf_array``, what its
    estimate assumes): every id on the first 1,024 rows exactly, and within a row beyond;
    features drawn together (each id its own E and alpha) give what each alone gives."""
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = power_law_rows(u, E, alpha).numpy()
    want = inverse_cdf_array(IdDistribution(kind="zipf", alpha=alpha), E, u.numpy())
    head = want < 1024
    assert (ours[head] == want[head]).all()
    assert abs(ours - want).max() <= 1
    assert ours.min() >= 0 and ours.max() < E
    feature = torch.tensor([1] * u.numel() + [0] * u.numel())
    both = zipf_rows(torch.cat([u, u]), feature, [7, E], [0.0, alpha])
    assert torch.equal(both[: u.numel()], torch.from_numpy(ours))
    assert torch.equal(both[u.numel():], (u * 7).long())


def test_bag_lengths_follow_the_pooling_factor():
    batch = synthetic(B=4000).batch(0)
    lengths = batch.sparse.length_per_key()
    assert abs(lengths[0] / 4000 - 3.0) < 0.15
    assert abs(lengths[1] / 4000 - 1.0) < 0.1


def test_labels_are_learnable_from_the_inputs():
    """A logistic fit on the dense features alone already beats chance clearly."""
    batch = synthetic(B=4000).batch(0)
    w = torch.linalg.lstsq(batch.dense, batch.labels - 0.5).solution
    agree = ((batch.dense @ w > 0).float() == batch.labels).float().mean()
    assert agree > 0.65


def test_feature_specs_take_exponents_from_tables_and_overrides():
    cfg = job_from_dict(
        {
            "tables": [
                {
                    "name": "t",
                    "num_embeddings": 50,
                    "embedding_dim": 4,
                    "features": ["x", "y"],
                    "pooling_factors": [2, 5],
                    "id_distribution": {"kind": "zipf", "alpha": 1.3},
                },
                {"name": "u", "num_embeddings": 9, "embedding_dim": 4, "features": ["z"]},
            ],
            "model": {"dense_arch": [4]},
            "data": {"synthetic": {"zipf": 0.7, "zipf_per_feature": {"y": 2.0}}},
            "train": {"steps": 1},
        }
    )
    specs = feature_specs(cfg.tables, cfg.data)
    assert [(s.name, s.num_rows, s.pooling_factor, s.zipf) for s in specs] == [
        ("x", 50, 2.0, 1.3),
        ("y", 50, 5.0, 2.0),
        ("z", 9, 1.0, 0.7),
    ]


def test_random_rec_wrapped_and_resumable():
    from fbtriton_dist.train.config import RandomRecConfig

    src = RandomRecSource(FEATURES, RandomRecConfig(), num_dense=3, batch_size=8, seed=1)
    stream = list(zip(range(4), src.train_batches(DataPosition()), strict=False))
    batches = [b for _, (b, _) in stream]
    assert batches[0].dense.shape == (8, 3) and batches[0].labels.dtype == torch.float32
    assert batches[0].sparse.keys() == ["a", "b"]
    assert int(batches[0].sparse.values().max()) < 1000
    resumed, pos = next(src.train_batches(DataPosition(samples=2 * 8)))
    assert same(resumed, batches[2]) and pos.samples == 3 * 8
    assert len(src.eval_batches(2)) == 2


# -- Criteo -----------------------------------------------------------------------------------
def criteo_line(rng: random.Random, label=None, missing=0.2) -> str:
    label = rng.randint(0, 1) if label is None else label
    dense = ["" if rng.random() < missing else str(rng.randint(-2, 500)) for _ in range(13)]
    cats = ["" if rng.random() < missing else f"{rng.getrandbits(32):08x}" for _ in range(26)]
    return "\t".join([str(label), *dense, *cats]) + "\n"


@pytest.fixture
def criteo_files(tmp_path):
    rng = random.Random(0)
    paths = []
    for i, n in enumerate((23, 18)):
        p = tmp_path / f"day_{i}.tsv"
        p.write_text("".join(criteo_line(rng) for _ in range(n)))
        paths.append(str(p))
    return paths


CRITEO_FEATURES = [
    FeatureSpec(name=f"cat_{j}", num_rows=10 + j, pooling_factor=1.0, zipf=0.0) for j in range(26)
]


def test_parse_criteo_line_hashes_and_fills_missing():
    cols = ["1", "0", "", "-5", "99", *[""] * 9, "a", "", "FFFFFFFF", *["0"] * 23]
    label, dense, cats = parse_criteo_line("\t".join(cols) + "\n", [7] * 26)
    assert label == 1.0
    assert dense[:4] == [0.0, 0.0, 0.0, pytest.approx(math.log(100.0))]
    assert cats[:3] == [10 % 7, None, 0xFFFFFFFF % 7] and cats[3] == 0


@pytest.mark.parametrize(
    "line, message",
    [
        ("1\t2\n", "expected 40 tab-separated columns, got 2"),
        ("2" + "\t" * 39 + "\n", "expected label 0 or 1, got '2'"),
        ("1\tx" + "\t" * 38 + "\n", "could not convert string to float: 'x'"),
        ("1" + "\t" * 14 + "zz" + "\t" * 25 + "\n", "categorical column C1: 'zz' is not a 64-bit hex id"),
    ],
)
def test_parse_criteo_line_errors_name_the_line(line, message):
    with pytest.raises(ValueError) as e:
        parse_criteo_line(line, [5] * 26, "day_0.tsv:7")
    assert str(e.value).startswith("day_0.tsv:7: ") and message in str(e.value)


def criteo_source(files, rank=0, world_size=1, B=4):
    from fbtriton_dist.train.config import CriteoConfig

    cfg = CriteoConfig(train=tuple(files), eval=(files[1],))
    return CriteoSource(CRITEO_FEATURES, cfg, batch_size=B, rank=rank, world_size=world_size)


def test_criteo_batches_match_the_lines(criteo_files):
    lines = [line for p in criteo_files for line in open(p)]
    src = criteo_source(criteo_files, B=4)
    batches = [b for b, _ in src.train_batches(DataPosition())]
    assert len(batches) == 41 // 4  # the last partial group is dropped
    b = batches[1]
    sizes = [10 + j for j in range(26)]
    for i in range(4):
        label, dense, cats = parse_criteo_line(lines[4 + i], sizes)
        assert b.labels[i] == label
        assert torch.allclose(b.dense[i], torch.tensor(dense))
        for j, v in enumerate(cats):
            bag = b.sparse[f"cat_{j}"].to_dense()[i].tolist()
            assert bag == ([] if v is None else [v])
    assert all(int(b.sparse.values().max()) < 35 for b in batches)


def test_criteo_lines_are_sharded_by_rank_and_resumable(criteo_files):
    whole = [b for b, _ in criteo_source(criteo_files, B=2).train_batches(DataPosition())]
    ranks = [criteo_source(criteo_files, rank=r, world_size=2, B=1) for r in range(2)]
    streams = [list(s.train_batches(DataPosition())) for s in ranks]
    assert len(streams[0]) == len(streams[1]) == 41 // 2
    for k in range(len(streams[0])):
        for r in range(2):  # rank r gets line 2k + r: row r of the 1-rank batch of 2
            assert streams[r][k][0].labels.tolist() == whole[k].labels[r : r + 1].tolist()
        assert streams[0][k][1] == DataPosition(samples=2 * (k + 1))
    pos = streams[0][5][1]
    resumed = list(ranks[1].train_batches(pos))
    assert len(resumed) == len(streams[1]) - 6
    assert same(resumed[0][0], streams[1][6][0])
    assert len(ranks[0].eval_batches(100)) == 18 // 2


def test_criteo_reader_streams_a_file_as_it_is_written(tmp_path):
    """The first batch comes while the file is still being written (a named pipe whose
    writer waits for it): the reader never needs a whole file in memory."""
    import os
    import threading

    fifo = tmp_path / "day_0.tsv"
    os.mkfifo(fifo)
    rng = random.Random(1)
    first_seen, waited_out = threading.Event(), []

    def write():
        with open(fifo, "w") as f:
            f.write("".join(criteo_line(rng) for _ in range(4)))
            f.flush()
            if not first_seen.wait(20):  # a reader that reads to the end would wait here
                waited_out.append(True)
            f.write("".join(criteo_line(rng) for _ in range(5)))

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    from fbtriton_dist.train.config import CriteoConfig

    src = CriteoSource(CRITEO_FEATURES, CriteoConfig(train=(str(fifo),)), batch_size=4)
    stream = src.train_batches(DataPosition())
    _, pos = next(stream)
    first_seen.set()
    rest = list(stream)
    writer.join(30)
    assert not waited_out and pos.samples == 4
    assert [p.samples for _, p in rest] == [8]  # the last line, a partial batch, is dropped


def test_criteo_resume_skips_lines_across_files(criteo_files):
    """A position past the first file's 23 lines resumes in the second at the exact line."""
    whole = list(criteo_source(criteo_files, B=3).train_batches(DataPosition()))
    resumed = list(criteo_source(criteo_files, B=3).train_batches(whole[7][1]))
    assert whole[7][1].samples == 24 and len(resumed) == len(whole) - 8
    assert all(same(a[0], b[0]) and a[1] == b[1] for a, b in zip(resumed, whole[8:], strict=True))


def test_make_source_picks_the_configured_source(criteo_files, tmp_path):
    tables = [
        {"name": f"t{j}", "num_embeddings": 5, "embedding_dim": 4, "features": [f"c{j}"]}
        for j in range(26)
    ]
    data = {"source": "criteo", "criteo": {"train": [criteo_files[0]]}}
    cfg = job_from_dict(
        {"tables": tables, "model": {"dense_arch": [4]}, "data": data, "train": {"epochs": 1}}
    )
    src = make_source(cfg.tables, cfg.data, batch_size=4, seed=0, rank=0, world_size=1)
    assert isinstance(src, CriteoSource) and src.eval_batches(3) == []
    batch, _ = next(src.train_batches(DataPosition()))
    assert batch.sparse.keys() == [f"c{j}" for j in range(26)]


def test_synthetic_vbe_batches_share_each_users_bags():
    """``candidates_per_user`` K: user features have one bag per user (ceil(B / K)), items one
    per sample, the KJT carries the inverse indices; with ``vbe=False`` the same samples come
    as a fixed batch, and an EBC gives the same rows for both."""
    import torchrec

    import fbtriton_dist

    feats = [*FEATURES, FeatureSpec(name="c", num_rows=50, pooling_factor=2.0, zipf=1.05)]
    make = lambda **kw: SyntheticSource(feats, num_dense=5, batch_size=10, seed=4,  # noqa: E731
                                        user_features=["a", "c"], **kw)
    vbe, fixed = make(candidates_per_user=4).batch(2), make(candidates_per_user=4, vbe=False).batch(2)
    kjt = vbe.sparse
    assert kjt.variable_stride_per_key() and kjt.stride_per_key() == [3, 10, 3]
    keys, inverse = kjt.inverse_indices()
    assert keys == ["a", "b", "c"]
    assert inverse[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2] == inverse[2].tolist()
    assert inverse[1].tolist() == list(range(10))
    assert not fixed.sparse.variable_stride_per_key() and fixed.sparse.stride() == 10
    assert torch.equal(vbe.labels, fixed.labels) and torch.equal(vbe.dense, fixed.dense)
    assert fixed.sparse.values().numel() > kjt.values().numel()
    one = make(candidates_per_user=1).batch(2)  # K = 1: the default stream, user features or not
    assert not one.sparse.variable_stride_per_key() and one.sparse.stride() == 10
    assert same(one, SyntheticSource(feats, num_dense=5, batch_size=10, seed=4).batch(2))
    configs = [torchrec.EmbeddingBagConfig(name=f.name, num_embeddings=f.num_rows,
                                           embedding_dim=3, feature_names=[f.name]) for f in feats]
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs)
    assert torch.allclose(ebc(kjt).values(), ebc(fixed.sparse).values(), atol=1e-6)
    with pytest.raises(ValueError, match="user_features: \\['z'\\] are not features"):
        SyntheticSource(feats, num_dense=5, batch_size=4, seed=0, user_features=["z"],
                        candidates_per_user=2)
