"""The job's data source: the drifting one (``open_ids.DriftingSource``) when
``data.synthetic.drift`` is set, MLPerf's multi-hot files (``multihot.MultiHotSource``) with
``data.source: multihot``, else the one ``data.make_source`` picks. A module of its own
because ``open_ids`` and ``multihot`` build on ``data`` (``data`` cannot import them back)."""

from __future__ import annotations

from typing import Any

from fbtriton_dist.planner import TableSet

from . import data as _data
from .config import DataConfig
from .multihot import MultiHotSource
from .open_ids import DriftingSource

__all__ = ["make_source"]


def make_source(
    tables: TableSet,
    data: DataConfig,
    *,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    **kwargs: Any,
):
    """The source of ``data`` for this rank; ``kwargs`` go to ``data.make_source``."""
    drift = data.synthetic.drift
    if data.source == "multihot" and data.multihot is not None:
        return MultiHotSource(_data.feature_specs(tables, data), data.multihot,
                              batch_size=batch_size, rank=rank, world_size=world_size,
                              resolve=kwargs.get("resolve", lambda p: p))
    if data.source != "synthetic" or drift is None:
        return _data.make_source(tables, data, batch_size=batch_size, seed=seed, rank=rank,
                                 world_size=world_size, **kwargs)
    return DriftingSource(
        _data.feature_specs(tables, data), drift, raw_features=_data.managed_features(tables),
        tables={f: t.name for t in tables.tables for f in t.features},
        num_dense=data.num_dense, batch_size=batch_size, seed=seed, rank=rank,
        world_size=world_size, noise=data.synthetic.noise,
    )
