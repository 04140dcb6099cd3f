"""Sharded ``host`` tables: each rank's host shards get a local TBE of their own (the layout
groups shard-features by (dtype, host tier)), allocated in mapped host memory where the tier
maps it; they train as ``device`` bit for bit. The ranks run the mapped path on the CPU by
replacing ``host_tier._maps_host_memory`` (a host shard sharing a TBE with a device shard
would then be refused)."""

import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_tiers import BATCH, _batch, _collection, _configs, _flat, _plan

HOST = ("a", "c", "d")  # table-wise, column-wise, grid; b (row-wise) and dp stay on device


def _host_vs_device(rank, world):
    from fbtriton_dist.modules import host_tier

    host_tier._maps_host_memory = lambda device: True  # noqa: SLF001 (this rank's process)
    return [_one(rank, world, sequence) for sequence in (False, True)]


def _one(rank, world, sequence):
    import fbtriton_dist
    from fbtriton_dist.modules import host_tier
    from fbtriton_dist.ops.host_mapped import is_host_mapped

    configs = _configs(sequence)
    dev = fbtriton_dist.shard(_collection(configs, sequence, "adam"), _plan("mixed", world))
    host = fbtriton_dist.shard(_collection(configs, sequence, "adam", dict.fromkeys(HOST, "host")),
                               _plan("mixed", world))
    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    same = True
    for step in range(3):
        kjt = _batch(configs, lo, hi, step)
        outs = []
        for m in (dev, host):
            out = _flat(m(kjt), sequence)
            g = torch.Generator().manual_seed(100 + step)
            (out * torch.randn(out.shape, generator=g)).sum().backward()
            outs.append(out.detach())
        same &= torch.equal(*outs)
    full = [m.gather_full_state_dict() for m in (dev, host)]
    same &= list(full[0]) == list(full[1])
    same &= all(torch.equal(full[0][k], full[1][k]) for k in full[0])
    tbes = [(host_tier.all_host(t.storage), is_host_mapped(t.weights), is_host_mapped(t.momentum1))
            for t in host.tbes]
    return same, tbes, len(dev.tbes)


def test_sharded_host_tables_own_tbes_and_train_as_device():
    """EmbeddingBagCollection, then EmbeddingCollection, on 2 ranks."""
    for rank, report in enumerate(run_ranks(_host_vs_device, 2, timeout=300)):
        for kind, (same, tbes, plain) in zip(("ebc", "ec"), report, strict=True):
            assert same, (rank, kind)
            assert any(h for h, _, _ in tbes) and len(tbes) > plain, (rank, kind, tbes)
            assert all(h == w == m for h, w, m in tbes), (rank, kind, tbes)
