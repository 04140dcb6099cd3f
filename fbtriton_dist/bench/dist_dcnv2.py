"""Model ``dcnv2`` of ``bench dist``: MLPerf's DLRM-dcnv2, TorchRec's against ours, from the
same weights.

* TorchRec: its own ``torchrec.models.dlrm.DLRM_DCN`` over its EmbeddingBagCollection (sharded
  by its DistributedModelParallel, as model ``dlrm``);
* ours: ``fbtriton_dist.train.models.DCNv2Model`` over our EmbeddingBagCollection (sharded by
  ``fbtriton_dist.shard``), its dense weights copied from a ``DLRM_DCN`` drawn from the same
  seed (the mapping of ``tests/train/test_dcnv2.py``: the MLPs' Linear layers in order, the
  cross network's ``V``, ``W`` and bias per layer);
* the tables: every provider writes the same initial rows into its shards
  (:func:`fill_shard`: uniform in +-sqrt(1/E), TorchRec's default range, each value a hash of
  its table, row, column and the seed, so any cut of a table gets the same rows), so the first
  step's loss is the same for TorchRec and ours.

The table set (``--tables``' default with ``dcnv2``: ``dist.MLPERF_TABLES``) is
``configs/tables/mlperf_dcnv2.yaml``:
the reference's 26 tables and each feature's multi-hot bag size (its pooling factor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

FILL_ELEMENTS = 1 << 22
"""Values hashed at once by :func:`fill_shard` (a few int64 temporaries of this size)."""
_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B


def torchrec_dlrm_dcn(spec, ebc: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """TorchRec's ``DLRM_DCN`` over ``ebc``, its dense weights drawn after ``manual_seed(seed)``
    on ``device``."""
    from torchrec.models.dlrm import DLRM_DCN

    torch.manual_seed(seed)
    model = DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=spec.num_dense,
        dense_arch_layer_sizes=list(spec.dense_arch),
        over_arch_layer_sizes=list(spec.over_arch),
        dcn_num_layers=spec.cross_layers,
        dcn_low_rank_dim=spec.low_rank,
        dense_device=device,
    )
    model.inter_arch.to(device)  # it builds its cross network on the CPU whatever dense_device
    return model


def dense_pairs(ours: nn.Module, ref: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(our parameter, TorchRec's) for every dense parameter of a ``DCNv2Model`` and a
    ``DLRM_DCN`` of the same sizes."""

    def linears(m: nn.Module) -> list[nn.Linear]:
        return [x for x in m.modules() if isinstance(x, nn.Linear)]

    pairs = []
    for mine, theirs in ((ours.dense_arch, ref.dense_arch), (ours.over_arch, ref.over_arch)):
        a, b = linears(mine), linears(theirs)
        if len(a) != len(b):
            raise ValueError(f"dcnv2: expected as many Linear layers as DLRM_DCN's ({len(b)}), "
                             f"got {len(a)}")
        for x, y in zip(a, b, strict=True):
            pairs += [(x.weight, y.weight), (x.bias, y.bias)]
    cross = ref.inter_arch.crossnet
    if len(ours.cross.V) != len(cross.V_kernels):
        raise ValueError(f"dcnv2: expected {len(cross.V_kernels)} cross layers, got "
                         f"{len(ours.cross.V)}")
    for i in range(len(ours.cross.V)):
        pairs += [(ours.cross.V[i], cross.V_kernels[i]), (ours.cross.W[i], cross.W_kernels[i]),
                  (ours.cross.bias[i], cross.bias[i])]
    for a, b in pairs:
        if a.shape != b.shape:
            raise ValueError(f"dcnv2: expected DLRM_DCN's shape {tuple(b.shape)}, got "
                             f"{tuple(a.shape)}")
    return pairs


def build_dcnv2(spec, ebc: nn.Module, device: torch.device, *, ours: bool, seed: int):
    """TorchRec's ``DLRM_DCN`` (``ours`` False) or our ``DCNv2Model`` with its dense weights
    (both over ``ebc``, on the meta device)."""
    if not ours:
        return torchrec_dlrm_dcn(spec, ebc, device, seed)
    import torchrec

    from fbtriton_dist.train.models import DCNv2Model

    configs = ebc.embedding_bag_configs()
    ref = torchrec_dlrm_dcn(
        spec, torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta")),
        device, seed)
    model = DCNv2Model(ebc, features=[f for c in configs for f in c.feature_names],
                       num_dense=spec.num_dense, dense_arch=spec.dense_arch,
                       over_arch=spec.over_arch, cross_layers=spec.cross_layers,
                       low_rank=spec.low_rank, dense_device=device)
    with torch.no_grad():
        for a, b in dense_pairs(model, ref):
            a.copy_(b)
    return model


# -- the same initial rows for every provider ---------------------------------------------------
def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of every element of ``x`` (int64 in [0, 2**32))."""
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    return x ^ (x >> 16)


@torch.no_grad()
def fill_shard(view: torch.Tensor, table: int, num_embeddings: int, row_start: int,
               col_start: int, seed: int) -> None:
    """Write rows ``row_start ..`` and columns ``col_start ..`` of table number ``table`` (E =
    ``num_embeddings``) into ``view`` [rows, cols]: uniform in +-sqrt(1/E), each value a hash
    of (seed, table, row, column), so a table's rows do not depend on how it is cut."""
    if view.dim() != 2:
        raise ValueError(f"fill_shard: expected a [rows, cols] view, got {tuple(view.shape)}")
    rows, cols = view.shape
    if rows == 0 or cols == 0:
        return
    device = view.device
    salt = _mix(torch.tensor([(seed * 131 + table) & _M32], device=device))
    col = torch.arange(col_start, col_start + cols, device=device, dtype=torch.int64) * 7919
    bound = num_embeddings ** -0.5
    step = max(1, FILL_ELEMENTS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        row = torch.arange(row_start + r0, row_start + r1, device=device, dtype=torch.int64)
        x = _mix((row[:, None] * 1_000_003 + col[None, :] + salt) & _M32)
        u = x.to(torch.float32) * (1.0 / 2**32)
        view[r0:r1].copy_((u * 2.0 - 1.0) * bound)


def fill_ours(sharded: nn.Module, tables: Sequence, seed: int) -> None:
    """:func:`fill_shard` every local shard of our sharded collection (tables by name)."""
    index = {t.name: i for i, t in enumerate(tables)}
    configs = sharded.table_configs()
    for t, view in sharded.local_views():
        cfg = configs[t.table]
        fill_shard(view, index[cfg.name], cfg.num_embeddings, t.row_start, t.col_start, seed)


def fill_torchrec(dmp: nn.Module, fqn: str, tables: Sequence, seed: int) -> None:
    """:func:`fill_shard` every local shard of TorchRec's sharded collection at ``fqn``: its
    state dict's ShardedTensor shards are views of FBGEMM's weights."""
    state = dmp.state_dict()
    for i, t in enumerate(tables):
        key = f"{fqn}.embedding_bags.{t.name}.weight"
        if key not in state:
            raise ValueError(f"dcnv2: expected {key} in TorchRec's state dict, got "
                             f"{sorted(state)[:5]} ...")
        weight = state[key]
        if not hasattr(weight, "local_shards"):
            raise ValueError(f"dcnv2: expected a ShardedTensor at {key}, got {type(weight)}")
        for shard in weight.local_shards():
            r0, c0 = shard.metadata.shard_offsets
            fill_shard(shard.tensor, i, t.num_embeddings, r0, c0, seed)
