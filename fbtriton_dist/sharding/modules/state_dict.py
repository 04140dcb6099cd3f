"""The state dict of a sharded collection: TorchRec's keys, sharded values.

``embedding_bags.<table>.weight`` (an EmbeddingCollection's: ``embeddings.<table>.weight``;
``ebc.tables_key`` below) is a ShardedTensor whose local shards are views of the live weights
(so ``torch.distributed.checkpoint`` saves and loads in place, and reshards across
plans and world sizes), or, for a data-parallel table, its full replica. The fused
optimizer's state has the same form (``fused_optimizer_state_dict``). The module's methods
call these functions; they read only its public attributes.
"""

import torch
import torch.distributed as dist

from fbtriton_dist import optim

STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""``optimizer_state_dtypes``' names -> the dtype a state is kept, saved and loaded in."""


def _sharded(ebc, t: int, tensors: list[tuple], size: tuple[int, ...], rowwise: bool = False,
             dtype: torch.dtype | None = None):
    """A ShardedTensor of global ``size`` for table ``t`` from this rank's ``(offsets,
    local tensor)`` pieces; the global metadata comes from the plan (no collective).
    ``dtype``: its dtype (default the table's weights'), the same on every rank, those
    holding no shard of it included."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    kind = ebc.device.type
    metas = []
    for sf, sf_rank, offsets, sizes in _global_pieces(ebc, t, rowwise):
        if ebc.group is not None:  # a placement names a global rank (replica groups: a group's)
            sf_rank = dist.get_global_rank(ebc.group, sf_rank)
        local_rank = sf_rank % ebc.layout.local_world_size
        # a shard behind a row cache is its backing store, in host memory (on any rank)
        cached = kind == "cuda" and ebc.storage_of_piece(
            t, (sf.row_start, sf.row_end), (sf.col_start, sf.col_end)).cached
        where = (f"rank:{sf_rank}/cuda:{local_rank}" if kind == "cuda" and not cached
                 else f"rank:{sf_rank}/{'meta' if kind == 'meta' else 'cpu'}")
        metas.append(ShardMetadata(list(offsets), list(sizes), where))
    local = [
        Shard(tensor, next(m for m in metas if list(m.shard_offsets) == list(offsets)))
        for offsets, tensor in tensors
    ]
    dtype = dtype if dtype is not None else ebc.layout.dtypes[t]
    meta = ShardedTensorMetadata(metas, torch.Size(size), TensorProperties(dtype=dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, meta, process_group=ebc.group
    )


def _global_pieces(ebc, t: int, rowwise: bool):
    """(shard-feature, rank, offsets, sizes) of every shard of table ``t``, for weights
    ([E, D]) or a rowwise state ([E, number of column slices])."""
    slices = sorted({(sf.col_start, sf.col_end) for sf in _table_shards(ebc, t)})
    for sf in _table_shards(ebc, t):
        if not rowwise:
            yield sf, sf.rank, (sf.row_start, sf.col_start), (sf.row_end - sf.row_start, sf.dim)
        else:
            col = slices.index((sf.col_start, sf.col_end))
            yield sf, sf.rank, (sf.row_start, col), (sf.row_end - sf.row_start, 1)


def _table_shards(ebc, t: int):
    """One shard-feature per shard of table ``t`` (its first feature's)."""
    first = ebc.layout.feature_table.index(t)
    return [sf for q in ebc.layout.local for sf in q if sf.feature == first]


def weights_state_dict(ebc, destination=None, prefix=""):
    """``{prefix}embedding_bags.<table>.weight``: a ShardedTensor (this rank's shards are
    views of the live weights, so torch.distributed.checkpoint saves and loads in place),
    or for a data-parallel table its full replica."""
    out = {} if destination is None else destination
    local = ebc.local_views()
    for t, cfg in enumerate(ebc.table_configs()):
        key = f"{prefix}{ebc.tables_key}.{cfg.name}.weight"
        mine = [(lt, v) for lt, v in local if lt.table == t]
        if ebc.layout.table_data_parallel[t]:
            out[key] = mine[0][1]
            continue
        pieces = [((lt.row_start, lt.col_start), v) for lt, v in mine]
        out[key] = _sharded(ebc, t, pieces, (cfg.num_embeddings, cfg.embedding_dim))
    return out


def fused_optimizer_state_dict(ebc) -> dict:
    """The fused optimizer's state in the same form: ``embedding_bags.<table>.weight.<i>``
    per state tensor (rowwise Adagrad: ``[E, column slices]``, one accumulator per row of
    each column slice; Adagrad, Adam: ``[E, D]``), and ``step`` (the step count, for Adam's
    bias correction)."""
    # on the meta device (DMP(device="meta"): shapes only) there is no count to read: 0
    on_meta = bool(ebc.tbes) and ebc.tbes[0].weights.is_meta
    out = {"step": torch.tensor(ebc.tbes[0].step if ebc.tbes and not on_meta else 0)}
    shards = ebc.local_shards()
    for t, cfg in enumerate(ebc.table_configs()):
        mine = [(lt, st) for lt, _, st in shards if lt.table == t]
        slices = sorted({(sf.col_start, sf.col_end) for sf in _table_shards(ebc, t)})
        for i, state in enumerate(optim.spec_of(ebc.optimizer).states):
            rowwise = state.per_row
            size = (cfg.num_embeddings, len(slices) if rowwise else cfg.embedding_dim)
            key = f"{ebc.tables_key}.{cfg.name}.weight.{i}"
            if ebc.layout.table_data_parallel[t]:  # the replica, same shape as sharded
                out[key] = mine[0][1][i].view(-1, 1) if rowwise else mine[0][1][i]
                continue
            pieces = [
                ((lt.row_start, slices.index((lt.col_start, lt.col_end))), st[i].view(-1, 1))
                if rowwise
                else ((lt.row_start, lt.col_start), st[i])
                for lt, st in mine
            ]
            out[key] = _sharded(ebc, t, pieces, size, rowwise,
                                dtype=STATE_DTYPES[ebc.optimizer_state_dtypes.get(state.name,
                                                                                  "fp32")])
    return out


def load_fused_optimizer_state_dict(ebc, state: dict) -> None:
    """Restore ``fused_optimizer_state_dict()`` (after torch.distributed.checkpoint loaded
    into it in place, only the step count is left to set)."""
    for tbe in ebc.tbes:
        tbe.step = int(state["step"])
        tbe.invalidate()  # cached shards: their backing stores were loaded in place


def load_weights(ebc, state_dict, prefix, missing_keys, unexpected_keys, errors) -> None:
    """``nn.Module._load_from_state_dict`` of the sharded weights: copy each of this rank's
    shards from its ``embedding_bags.<table>.weight`` (a ShardedTensor with the same local
    shards, or the full tensor), and list missing, unexpected and mismatched keys."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    local = ebc.local_views()
    for t, cfg in enumerate(ebc.table_configs()):
        key = f"{prefix}{ebc.tables_key}.{cfg.name}.weight"
        if key not in state_dict:
            missing_keys.append(key)
            continue
        value = state_dict[key]
        for lt, view in local:
            if lt.table != t:
                continue
            if isinstance(value, ShardedTensor):
                piece = next(
                    (s.tensor for s in value.local_shards()
                     if list(s.metadata.shard_offsets) == [lt.row_start, lt.col_start]
                     and list(s.metadata.shard_sizes) == list(view.shape)),
                    None,
                )
                if piece is None:
                    errors.append(
                        f"{key}: the ShardedTensor's local shards do not match this rank's "
                        "shards; load it with torch.distributed.checkpoint, which reshards"
                    )
                    continue
            elif tuple(value.shape) == (cfg.num_embeddings, cfg.embedding_dim):
                piece = value[lt.row_start : lt.row_end, lt.col_start : lt.col_end]
            else:
                errors.append(f"{key}: expected shape ({cfg.num_embeddings}, "
                              f"{cfg.embedding_dim}), got {tuple(value.shape)}")
                continue
            if piece.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(piece)
    for tbe in ebc.tbes:  # cached shards: the backing stores were written (here or in place)
        tbe.invalidate()
    known = {f"{prefix}{ebc.tables_key}.{c.name}.weight" for c in ebc.table_configs()}
    unexpected_keys += [k for k in state_dict if k.startswith(prefix) and k not in known
                        and k[len(prefix):].split(".")[0] == ebc.tables_key]


@torch.no_grad()
def gather_full_state_dict(ebc) -> dict[str, torch.Tensor]:
    """``{embedding_bags.<table>.weight: [E, D]}`` on every rank, loadable by TorchRec's
    EmbeddingBagCollection (fp32 sum of each rank's shards; replicas taken once)."""
    local = ebc.local_views()
    out = {}
    for t, cfg in enumerate(ebc.table_configs()):
        dtype = ebc.layout.dtypes[t]
        full = torch.zeros((cfg.num_embeddings, cfg.embedding_dim), dtype=torch.float32,
                           device=ebc.device)
        replica_elsewhere = ebc.layout.table_data_parallel[t] and ebc.rank != 0
        for lt, view in local:
            if lt.table == t and not replica_elsewhere:  # replicas: rank 0's copy only
                full[lt.row_start : lt.row_end, lt.col_start : lt.col_end] = view.float()
        dist.all_reduce(full, group=ebc.group)
        out[f"{ebc.tables_key}.{cfg.name}.weight"] = full.to(dtype)
    return out


