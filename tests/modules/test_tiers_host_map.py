"""The host slot maps of all cached tables in one C call (``modules/tier_host_map.py``):
the same slots, stats and training as table by table (``RowCache.assign``) and as
``device``, with evictions; a bad id in a later table is refused after the earlier tables
are mapped, naming its feature."""

import pytest
import torch

from fbtriton_dist import optim
from fbtriton_dist.modules import tier_host_map, tiers
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.ops import tier_native
from fbtriton_dist.storage import Storage
from tests.helpers import make_batch, upstream_grad

pytestmark = pytest.mark.skipif(tier_native.library() is None,
                                reason="no C compiler: the torch ops run instead")
TABLES, FTM = [(40, 4), (30, 3), (25, 2)], [0, 1, 2]
STORAGE = [Storage(tier="cached", cache_slots=14, policy="lru"), None,
           Storage(tier="cached", cache_slots=12, policy="lfu")]


def build(storage):
    return TableBatchedEmbedding(TABLES, feature_table_map=FTM, backend="cpu", seed=3,
                                 optimizer=optim.Adam(lr=0.2), storage=storage)


def test_one_call_trains_as_table_by_table_and_device(monkeypatch):
    g = torch.Generator().manual_seed(6)
    batches = [make_batch(TABLES, FTM, 4, 3, hot=True, generator=g)[:2] for _ in range(7)]
    device = build(None)
    calls = []
    run = tier_host_map.HostMaps.run
    monkeypatch.setattr(tier_host_map.HostMaps, "run",
                        lambda self, *a: calls.append(1) or run(self, *a))
    runs = {}
    for at_once in (True, False):
        if not at_once:
            monkeypatch.setattr(tiers.TieredTables, "_remap_at_once", lambda *a, **k: None)
        m = build(STORAGE)
        m.load_state_dict(device.state_dict())
        rows = []
        for step, batch in enumerate(batches):
            out = m(*batch)
            (out * upstream_grad(out, step)).sum().backward()
            rows.append(m.resident_rows())
        runs[at_once] = (rows, m.cache_stats(), m.state_dict())
    assert len(calls) == len(batches)  # every lookup of the first module took one call
    for step, batch in enumerate(batches):
        out = device(*batch)
        (out * upstream_grad(out, step)).sum().backward()
    assert runs[True][0] == runs[False][0] and runs[True][1] == runs[False][1]
    assert all(s["evictions"] > 0 and s["writebacks"] > 0 for s in runs[True][1].values())
    want = device.state_dict()
    for _, _, got in runs.values():
        assert all(torch.equal(want[k], got[k]) for k in want if torch.is_tensor(want[k]))


def test_bad_id_in_a_later_table():
    m = build(STORAGE)
    indices = torch.tensor([1, 2, 3, 0, 25])  # feature_2's id 25: out of its 25 rows
    offsets = torch.tensor([0, 2, 3, 5])
    with pytest.raises(ValueError, match=r"feature 'feature_2' of table 'table_2' \(tier "
                                         r"'cached'\): id 25 out of range \[0, 25\)"):
        m(indices, offsets)
    assert m.cache_stats()["table_0"]["lookups"] == 2  # mapped before the bad table
    assert m.cache_stats()["table_2"]["lookups"] == 0
