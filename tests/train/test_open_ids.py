"""The drifting synthetic source (``data.synthetic.drift``, train/open_ids.py): raw int64 ids of
any value, ``new_ids_per_step`` ids born and as many retired every step, per-id popularity
fixed for its life, ``% E`` for unmanaged tables, batch k a pure function of (seed, rank, k)."""

import pytest
import torch

from fbtriton_dist.planner.tables import table_set_from_dict
from fbtriton_dist.train.config import DataConfig, SyntheticConfig
from fbtriton_dist.train.data import DataPosition
from fbtriton_dist.train.drift_config import DriftConfig
from fbtriton_dist.train.open_ids import DriftingSource, mix64, raw_id
from fbtriton_dist.train.sources import make_source

TABLES = table_set_from_dict({"tables": [
    {"name": "t_user", "num_embeddings": 101, "embedding_dim": 4, "features": ["user"],
     "id_manager": {"capacity": 100}},
    {"name": "t_item", "num_embeddings": 50, "embedding_dim": 4,
     "features": ["item", "item_history"], "pooling_factors": [1, 4]},
    {"name": "t_cat", "num_embeddings": 7, "embedding_dim": 4, "features": ["cat"]},
]})


def source(rank=0, seed=5, new=10, window=200, features=("user", "item", "item_history"),
           batch_size=32):
    drift = DriftConfig(new_ids_per_step=new, window=window, features=features)
    data = DataConfig(num_dense=3, synthetic=SyntheticConfig(zipf=1.1, drift=drift))
    return make_source(TABLES, data, batch_size=batch_size, seed=seed, rank=rank, world_size=2)


def ids(batch, feature):
    return batch.sparse.to_dict()[feature].values()


def same(a, b):
    return (torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
            and torch.equal(a.sparse.values(), b.sparse.values())
            and torch.equal(a.sparse.lengths(), b.sparse.lengths()))


def test_mix64_is_a_bijection_of_int64_and_ids_use_the_whole_range():
    x = torch.arange(-50_000, 50_000, dtype=torch.int64) * 0x10001
    assert torch.unique(mix64(x)).numel() == x.numel()
    r = raw_id(torch.arange(100_000), key=3)
    assert torch.unique(r).numel() == r.numel()
    assert (r < 0).float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert r.abs().max().item() > 2**62


def test_batches_are_pure_functions_of_seed_rank_and_step():
    s = source()
    assert isinstance(s, DriftingSource)
    assert same(s.batch(7), source().batch(7))
    assert not torch.equal(ids(s.batch(7), "user"), ids(source(rank=1).batch(7), "user"))
    assert not torch.equal(ids(s.batch(7), "user"), ids(source(seed=6).batch(7), "user"))
    # resuming at a position gives the batches the uninterrupted stream gives there
    stream = [b for (b, _), _ in zip(s.train_batches(DataPosition()), range(6), strict=False)]
    step = 2 * 32  # samples of one step over both ranks
    later = s.train_batches(DataPosition(samples=4 * step))
    (b4, p4), (b5, p5) = next(later), next(later)
    assert p4.samples == 5 * step
    assert same(b4, stream[4]) and same(b5, stream[5]) and p5.samples == 6 * step
    held_out = s.eval_batches_at(9, 2)
    assert same(held_out[1], s.batch(10, split=1)) and not same(held_out[0], s.batch(9))


def test_managed_tables_get_raw_ids_the_others_hashed_rows():
    s = source()
    b = s.batch(3)
    user = ids(b, "user")
    live = set(s.live_ids("user", 3).tolist())
    assert set(user.tolist()) <= live and user.abs().max() > 101  # raw, beyond the rows
    item, hist = ids(b, "item"), ids(b, "item_history")
    assert 0 <= item.min() and item.max() < 50 and hist.max() < 50
    item_live = s.live_ids("item", 3)
    assert set(item.tolist()) <= set(torch.remainder(item_live, 50).tolist())
    # a table's features share its id stream; tables have their own
    assert torch.equal(s.live_ids("item", 3), s.live_ids("item_history", 3))
    assert not set(s.live_ids("user", 3).tolist()) & set(item_live.tolist())
    cat = ids(b, "cat")  # not drifting: stationary Zipf rows
    assert 0 <= cat.min() and cat.max() < 7


@pytest.mark.parametrize("new", [0, 1, 10, 250])
def test_the_window_moves_new_ids_per_step(new):
    s = source(new=new)
    for k in (0, 5):
        a, b = set(s.live_ids("user", k).tolist()), set(s.live_ids("user", k + 1).tolist())
        assert len(a) == len(b) == 200
        assert len(b - a) == min(new, 200)  # born at step k + 1; as many retired
    # an id keeps its popularity rank while it lives
    ranks = {v: r for r, v in enumerate(s.live_ids("user", 4).tolist())}
    later = {v: r for r, v in enumerate(s.live_ids("user", 6).tolist())}
    assert all(ranks[v] == r for v, r in later.items() if v in ranks)


def test_drift_brings_new_ids_into_the_batches():
    s = source(new=20, window=300, batch_size=256)
    seen = set()
    fresh = []
    for k in range(12):
        batch = set(ids(s.batch(k), "user").tolist())
        fresh.append(len(batch - seen))
        seen |= batch
    assert min(fresh[6:]) > 0  # new ids keep arriving
    assert len(seen) > 300  # more ids than ever live at once
    still = set(ids(source(new=0, window=300, batch_size=256).batch(11), "user").tolist())
    assert still <= set(source(new=0, window=300).live_ids("user", 0).tolist())


def test_labels_follow_the_raw_ids():
    from fbtriton_dist.train.metrics import auc
    from fbtriton_dist.train.open_ids import id_score

    B = 16384
    s = source(new=0, batch_size=B, features=("user",))
    b = s.batch(0)
    # the hidden score of each sample's user (one of four features, beside the dense ones)
    # ranks the labels above chance (0.5 +- 0.005 for unrelated scores)
    user = b.sparse.to_dict()["user"]
    bags = torch.repeat_interleave(torch.arange(B), user.lengths())
    score = torch.zeros(B, dtype=torch.float64).index_add_(0, bags, id_score(user.values(), 0))
    assert auc(score, b.labels) > 0.53
    assert abs(auc(score, b.labels[torch.randperm(B)]) - 0.5) < 0.02
    # dense_weight 0: the labels come from the ids alone, the user's score counts for more
    drift = DriftConfig(new_ids_per_step=0, window=200, features=("user",), dense_weight=0.0)
    data = DataConfig(num_dense=3, synthetic=SyntheticConfig(zipf=1.1, drift=drift))
    ids_only = make_source(TABLES, data, batch_size=B, seed=5, rank=0, world_size=2).batch(0)
    assert torch.equal(ids_only.sparse.values(), b.sparse.values())  # the same samples' ids
    assert auc(score, ids_only.labels) > auc(score, b.labels) + 0.05
