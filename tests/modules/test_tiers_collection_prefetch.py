"""``prefetch(kjt)`` of the unsharded collections (``EmbeddingBagCollection``,
``EmbeddingCollection``): each step reads the next batch's missing rows ahead between its
forward and its backward; training is bit for bit the training without it, while the caches
evict every step and the lookups load rows from the prefetch."""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from tests.modules.test_tiers_collections import (
    BAGS,
    SEQS,
    STEPS,
    assert_same,
    ebc,
    ec,
    kjt,
    loss,
    storage_for,
)


def prefetch_stats(m):
    stats = [s for tbe, _ in m.tbe_groups() for s in tbe.cache_stats().values()]
    return {k: sum(s[k] for s in stats) for k in ("evictions", "prefetched", "prefetch_used")}


def train(plain, ahead, batches):
    for step in range(len(batches) - 1):
        out = plain(batches[step])
        out_ahead = ahead(batches[step])
        ahead.prefetch(batches[step + 1])  # read on the worker during this step's backward
        if isinstance(out, dict):
            assert all(torch.equal(out[k].values(), out_ahead[k].values()) for k in out)
        else:
            assert torch.equal(out.values(), out_ahead.values())
        loss(out, step).backward()
        loss(out_ahead, step).backward()


@pytest.mark.parametrize("tier", ["cached", "file"])
def test_ebc_prefetch_trains_as_without(tier, tmp_path):
    plain = ebc(storage_for(tier, tmp_path / "plain"), "adam")
    ahead = ebc(storage_for(tier, tmp_path / "ahead"), "adam")
    train(plain, ahead, [kjt(BAGS, step) for step in range(STEPS + 1)])
    assert_same(plain, ahead)
    stats = prefetch_stats(ahead)
    assert stats["evictions"] >= STEPS and 0 < stats["prefetch_used"] <= stats["prefetched"]
    assert prefetch_stats(plain)["prefetched"] == 0


def test_ec_prefetch_trains_as_without(tmp_path):
    plain, ahead = ec(storage_for("cached", tmp_path)), ec(storage_for("cached", tmp_path))
    train(plain, ahead, [kjt(SEQS, step) for step in range(STEPS + 1)])
    assert_same(plain, ahead)
    stats = prefetch_stats(ahead)
    assert stats["evictions"] > 0 and 0 < stats["prefetch_used"] <= stats["prefetched"]


def vbe_kjt(step):
    """A batch size per feature (2 or 4 bags), weighted, with the KJT's inverse indices."""
    strides = {"f0": 4, "f1": 2, "f2": 4, "f3": 2}
    g = torch.Generator().manual_seed(step)
    lengths, values = [], []
    for cfg in BAGS:
        for f in cfg.feature_names:
            n = torch.randint(0, 3, (strides[f],), generator=g)
            lengths.append(n)
            values.append(torch.randint(0, cfg.num_embeddings, (int(n.sum()),), generator=g))
    values = torch.cat(values)
    inverse = torch.stack([torch.arange(4) // (4 // strides[f]) for f in strides])
    return KeyedJaggedTensor(
        keys=list(strides), values=values, lengths=torch.cat(lengths),
        weights=torch.rand(values.numel(), generator=g) + 0.5,
        stride_per_key_per_rank=[[n] for n in strides.values()],
        inverse_indices=(list(strides), inverse))


def test_ebc_vbe_prefetch_trains_as_without(tmp_path):
    plain = ebc(storage_for("cached", tmp_path), "adam", weighted=True)
    ahead = ebc(storage_for("cached", tmp_path), "adam", weighted=True)
    train(plain, ahead, [vbe_kjt(step) for step in range(STEPS + 1)])
    assert_same(plain, ahead)
    stats = prefetch_stats(ahead)
    assert stats["evictions"] > 0 and 0 < stats["prefetch_used"] <= stats["prefetched"]
