"""Storage tiers per shard (``Shard.storage``) vs the same plan on ``device``, on 2 gloo ranks.

Four row-wise tables, each with its shards on different tiers: 'a' ``host`` on rank 0 (a
local TableBatchedEmbedding of its own, beside rank 0's other shards) and ``cached`` (LRU) on
rank 1; 'b' device on rank 0 and ``file`` (LFU) on rank 1; 'c' ``cached`` by its table's
storage with its rank-0 shard back on ``device``; 'd' ``cached`` (LFU) on rank 0 and device
on rank 1. Each step's ids move through the rows, so the small caches evict nearly
every step. Outputs, full weights and every rank's fused optimizer state (Adam: two moments)
must be bit-for-bit those of ``device``; the state dict keys are unchanged; a DCP checkpoint
moves from the per-shard tiers to ``device`` and back. The plan's YAML round trip and its
errors are tested in ``tests/planner/test_shard_storage.py``."""

import numpy as np
import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_tiers import (
    BATCH,
    SLOTS,
    _batch,
    _collection,
    _configs,
    _full,
    _local_states,
    _plan,
    _train,
)


def _shard_tier_plan(world, folder):
    """``_plan("row_wise")`` with the per-shard storages of the module docstring."""
    import dataclasses

    from fbtriton_dist.storage import Storage

    def cached(policy, slots=SLOTS):
        return Storage(tier="cached", cache_slots=slots, policy=policy)

    plan = _plan("row_wise", world)
    plan = dataclasses.replace(plan, tables=tuple(
        dataclasses.replace(t, storage=cached("lru")) if t.name == "c" else t
        for t in plan.tables))
    return plan.with_shard_storage({
        "a": {0: "host", 1: cached("lru")},  # rank 0: a TBE of its own for the host shard
        "b": {1: Storage(tier="file", cache_slots=SLOTS, policy="lfu", path=folder)},
        "c": {0: "device"},
        "d": {0: cached("lfu", 5)},  # rank 0 sees 6 of its 18 rows: 5 slots evict
    })


def _models(world, folder):
    import fbtriton_dist

    configs = _configs(False)
    dev = fbtriton_dist.shard(_collection(configs, False, "adam"), _plan("row_wise", world))
    tiered = fbtriton_dist.shard(_collection(configs, False, "adam"),
                                 _shard_tier_plan(world, folder))
    return dev, tiered


def _dcp_move(src, dst, path):
    """Save ``src``'s weights and fused optimizer state with DCP, load them into ``dst``."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": src.state_dict(), "fused": src.fused_optimizer_state_dict()},
             checkpoint_id=path)
    state = {"model": dst.state_dict(), "fused": dst.fused_optimizer_state_dict()}
    dcp.load(state, checkpoint_id=path)
    dst.load_state_dict(state["model"])
    dst.load_fused_optimizer_state_dict(state["fused"])


def _per_shard_vs_device(rank, world, folder):
    dev, tiered = _models(world, f"{folder}/files")
    configs = _configs(False)
    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    same = True
    for step in range(5):
        kjt = _batch(configs, lo, hi, step)
        outs = []
        for m in (dev, tiered):
            out = m(kjt).values()
            g = torch.Generator().manual_seed(100 + step)
            (out * torch.randn(out.shape, generator=g)).sum().backward()
            outs.append(out.detach())
        same &= torch.equal(*outs)
    full = [m.gather_full_state_dict() for m in (dev, tiered)]
    same &= all(torch.equal(full[0][k], full[1][k]) for k in full[0])
    states = [_local_states(m) for m in (dev, tiered)]
    same &= len(states[0]) == len(states[1]) and all(
        torch.equal(a, b) for a, b in zip(*states, strict=True))
    tiers = {k: v["evictions"] for k, v in tiered.cache_stats().items()}
    tbes = len(tiered.tbes)
    keys = (sorted(dev.state_dict()) == sorted(tiered.state_dict())
            and sorted(dev.fused_optimizer_state_dict())
            == sorted(tiered.fused_optimizer_state_dict()))
    # checkpoints across tiers: per-shard tiers -> device, device -> per-shard tiers
    to_dev, to_tiered = _models(world, f"{folder}/files2")
    _dcp_move(tiered, to_dev, f"{folder}/ckpt_tiered")
    _dcp_move(dev, to_tiered, f"{folder}/ckpt_dev")
    fulls = [_full(m) for m in (tiered, to_dev, dev, to_tiered)]
    for m in (dev, to_dev, to_tiered):
        _train(m, rank, world, range(5, 7))
    after = [_full(m) for m in (dev, to_dev, to_tiered)]
    return same, tiers, keys, fulls, after, tbes


def test_per_shard_tiers_train_bit_for_bit_as_device_and_checkpoint_across_tiers(tmp_path):
    reports = run_ranks(_per_shard_vs_device, 2, str(tmp_path), timeout=400)
    for rank, (same, _, keys, _, _, _) in enumerate(reports):
        assert same, rank
        assert keys, rank
    assert [r[5] for r in reports] == [2, 1]  # rank 0's host shard in a TBE of its own
    # the cached shards are where the plan put them, and they evicted
    assert sorted(t.split("[")[0] for t in reports[0][1]) == ["d"], reports[0][1]
    assert sorted(t.split("[")[0] for t in reports[1][1]) == ["a", "b", "c"], reports[1][1]
    assert all(n > 0 for r in reports for n in r[1].values()), [r[1] for r in reports]
    (tiered, to_dev, dev, to_tiered), after = reports[0][3], reports[0][4]
    for k in tiered:  # loaded as saved, both ways
        assert np.array_equal(tiered[k], to_dev[k]), k
        assert np.array_equal(dev[k], to_tiered[k]), k
    for k in after[0]:  # and train on as device does
        assert np.array_equal(after[0][k], after[1][k]), k
        assert np.array_equal(after[0][k], after[2][k]), k
