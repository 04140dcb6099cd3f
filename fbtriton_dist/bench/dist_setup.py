"""What ``bench dist`` measures: the tables, the two plans, the batches and the models.

Every provider trains the same model kind on the same tables, plan and pre-generated batches;
this module builds them (see ``fbtriton_dist.bench.dist`` for the measurement).

* tables: the Criteo table set's rows (``configs/tables/criteo_terabyte.yaml``), all scaled by
  one factor so the weights total ``total_gb`` (fp32), one feature per table, D columns.
* plans: ``row_wise`` (every table in blocks of ceil(E/R) rows, TorchRec's cut) and
  ``table_wise`` (tables placed greedily: largest first, on the rank with the fewest bytes among
  those with fewer than ceil(T/R) tables). TorchRec gets the same placement, shard for shard.
* batches: B samples per rank, L ids per bag (or each feature its own fixed L: the tables'
  pooling factors, MLPerf's multi-hot sizes), Zipf(alpha) ids (hot rows scattered over the
  table by a fixed bijection, or the first rows), dense features and labels; on the device.
* models: ``ebc`` (the collection alone; loss = sum(pooled * a fixed random gradient)),
  ``dlrm`` (TorchRec's DLRM over the collection, as the training job builds it; BCE loss) and
  ``ec`` (the same tables as an EmbeddingCollection, a row per id; loss = sum over features of
  rows @ a fixed random [D] vector) and ``dcnv2`` (MLPerf's DLRM-dcnv2: TorchRec's ``DLRM_DCN``
  for TorchRec, our ``DCNv2Model`` for ours, the same weights; ``dist_dcnv2``; BCE loss).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding, load_tables
from fbtriton_dist.train.data import Batch, power_law_rows

GB = 1e9
BIG_PRIME = 2147483647  # 2**31 - 1: coprime with every E below it, so k -> k*P mod E is a bijection


@dataclass(kw_only=True, frozen=True)
class Table:
    """One table of the benchmark: E rows x D columns, one feature."""

    name: str
    feature: str
    num_embeddings: int
    embedding_dim: int
    bag_size: int = 1
    """The feature's pooling factor in the table set (rounded): its ids per bag when the
    batches take the tables' bag sizes."""


def scaled_tables(
    path: str, dim: int, total_gb: float, scale: float | None = None, min_rows: int = 1000
) -> list[Table]:
    """The tables of ``path``, rows scaled by one factor (``scale``, else the one that makes
    E x D x 4 B total about ``total_gb``, never above 1); a table keeps at least
    ``min(E, min_rows)`` rows."""
    specs = load_tables(path).tables
    full = sum(t.num_embeddings for t in specs) * dim * 4
    if scale is None:
        scale = min(1.0, total_gb * GB / full)
    out = []
    for t in specs:
        for i, f in enumerate(t.features):
            E = t.num_embeddings
            rows = max(min(E, min_rows), int(E * scale))
            out.append(
                Table(
                    name=t.name if len(t.features) == 1 else f"{t.name}_{f}",
                    feature=f,
                    num_embeddings=rows,
                    embedding_dim=dim,
                    bag_size=round(t.pooling_factors[i]) if t.pooling_factors else 1,
                )
            )
    return out


def torchrec_configs(tables: Sequence[Table]) -> list:
    import torchrec

    return [
        torchrec.EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=[t.feature],
        )
        for t in tables
    ]


def torchrec_sequence_configs(tables: Sequence[Table]) -> list:
    """The tables as ``torchrec.EmbeddingConfig`` (model ``ec``: a row per id)."""
    import torchrec

    return [
        torchrec.EmbeddingConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=[t.feature],
        )
        for t in tables
    ]


# -- plans ------------------------------------------------------------------------------------
def row_wise_shards(E: int, D: int, R: int) -> tuple[Shard, ...]:
    """TorchRec's row-wise cut: blocks of ceil(E/R) rows on ranks 0, 1, ... (none empty)."""
    block = math.ceil(E / R)
    return tuple(
        Shard(rank=r, row_start=r * block, row_end=min(E, (r + 1) * block), col_start=0, col_end=D)
        for r in range(R)
        if r * block < E
    )


def table_wise_ranks(tables: Sequence[Table], R: int) -> list[int]:
    """A rank per table: largest first, onto the rank with the fewest bytes among those that
    hold fewer than ceil(T/R) tables (every bag costs the same: same L and D)."""
    cap = math.ceil(len(tables) / R)
    count, load = [0] * R, [0] * R
    ranks = [0] * len(tables)
    order = sorted(range(len(tables)), key=lambda i: -tables[i].num_embeddings)
    for i in order:
        r = min((q for q in range(R) if count[q] < cap), key=lambda q: (load[q], q))
        ranks[i] = r
        count[r] += 1
        load[r] += tables[i].num_embeddings * tables[i].embedding_dim
    return ranks


def make_plan(kind: str, tables: Sequence[Table], R: int, H: int) -> ShardingPlan:
    """Our ``ShardingPlan`` of ``kind`` (``row_wise`` or ``table_wise``) for ``R`` ranks."""
    if kind not in ("row_wise", "table_wise"):
        raise ValueError(f"plan: expected one of [row_wise, table_wise], got {kind!r}")
    ranks = table_wise_ranks(tables, R)
    out = []
    for t, rank in zip(tables, ranks, strict=True):
        E, D = t.num_embeddings, t.embedding_dim
        if kind == "row_wise":
            shards = row_wise_shards(E, D, R)
        else:
            shards = (Shard(rank=rank, row_start=0, row_end=E, col_start=0, col_end=D),)
        out.append(
            TableSharding(
                name=t.name, sharding=kind, num_embeddings=E, embedding_dim=D, shards=shards
            )
        )
    plan = ShardingPlan(world_size=R, local_world_size=H, tables=tuple(out))
    plan.validate()
    return plan


def torchrec_module_plan(ebc: nn.Module, plan: ShardingPlan, sharder, device_type: str):
    """The same placement for TorchRec: ``row_wise()`` / ``table_wise(rank)`` per table, FUSED
    compute kernel (FBGEMM's TBE with the optimizer in backward)."""
    from torchrec.distributed.sharding_plan import (
        construct_module_sharding_plan,
        row_wise,
        table_wise,
    )

    per_param = {
        t.name: row_wise(compute_kernel="fused")
        if t.sharding == "row_wise"
        else table_wise(rank=t.shards[0].rank, compute_kernel="fused")
        for t in plan.tables
    }
    return construct_module_sharding_plan(
        ebc,
        per_param,
        sharder=sharder,
        local_size=plan.local_world_size,
        world_size=plan.world_size,
        device_type=device_type,
    )


# -- data -------------------------------------------------------------------------------------
def zipf_rows(E: int, n: int, alpha: float, g: torch.Generator, device, scatter: bool):
    """``n`` ids in [0, E): Zipf(alpha) ranks (``fbtriton_dist.train.data.power_law_rows``,
    the planner's law), rank k -> row ``k * P mod E`` when ``scatter``."""
    u = torch.rand(n, generator=g, device=device, dtype=torch.float64)
    k = power_law_rows(u, E, max(alpha, 0.0))
    return (k * BIG_PRIME) % E if scatter else k


def make_batches(
    tables: Sequence[Table],
    *,
    n: int,
    B: int,
    L: int | Sequence[int],
    alpha: float,
    num_dense: int,
    seed: int,
    rank: int,
    device: torch.device,
    scatter: bool = True,
    candidates_per_user: int = 1,
) -> list[Batch]:
    """``n`` batches of this rank (a function of ``seed`` and ``rank``), on ``device``: fixed
    bags of L ids (int64; lengths int32, as TorchRec's datasets; ``L`` one number, or one per
    table: MLPerf's multi-hot bags), [B, num_dense] dense
    features, 0/1 labels. ``candidates_per_user`` K > 1: VBE batches, the first half of the
    tables' features one bag per user (ceil(B / K) users, K consecutive samples each), the
    others one per sample (``fixed_copies`` gives the same samples as fixed batches)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank * 7919 + 17)
    keys = [t.feature for t in tables]
    K = candidates_per_user
    # K > 1: the first half of the tables are user features, one bag per user (VBE)
    strides = [-(-B // K) if K > 1 and i < len(tables) // 2 else B for i in range(len(tables))]
    bags = [L] * len(tables) if isinstance(L, int) else list(L)
    if len(bags) != len(tables) or min(bags) < 0:
        raise ValueError(f"L: expected one bag size >= 0 per table ({len(tables)}), got {L}")
    lengths = torch.cat([torch.full((s,), bag, dtype=torch.int32, device=device)
                         for s, bag in zip(strides, bags, strict=True)])
    vbe = {}
    if K > 1:
        arange = torch.arange(B, device=device)
        inverse = torch.stack([arange // K if s < B else arange for s in strides])
        vbe = {"stride_per_key_per_rank": [[s] for s in strides],
               "inverse_indices": (keys, inverse)}
    out = []
    for _ in range(n):
        values = torch.cat([zipf_rows(t.num_embeddings, s * bag, alpha, g, device, scatter)
                            for t, s, bag in zip(tables, strides, bags, strict=True)])
        kjt = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, **vbe)
        dense = torch.randn(B, num_dense, generator=g, device=device)
        labels = (torch.rand(B, generator=g, device=device) < 0.5).float()
        out.append(Batch(dense=dense, sparse=kjt, labels=labels))
    return out


def fixed_copies(batches: Sequence[Batch]) -> list[Batch]:
    """The same samples as fixed batches: every VBE feature's bags copied per sample."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from fbtriton_dist.train.data import expand_bags

    out = []
    for b in batches:
        kjt = b.sparse
        if not kjt.variable_stride_per_key():
            out.append(b)
            continue
        inv_keys, inverse = kjt.inverse_indices()
        per_key = torch.split(kjt.lengths(), kjt.stride_per_key())  # (no fbgemm op: plain torch)
        ids = torch.split(kjt.values(), torch.stack([n.sum() for n in per_key]).tolist())
        lengths, values = [], []
        for key, n, v in zip(kjt.keys(), per_key, ids, strict=True):
            rows = inverse[inv_keys.index(key)]
            lengths.append(n[rows])
            values.append(expand_bags(n, v, rows))
        fixed = KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values),
                                  lengths=torch.cat(lengths))
        out.append(Batch(dense=b.dense, sparse=fixed, labels=b.labels))
    return out


# -- models -----------------------------------------------------------------------------------
class EmbeddingsOnly(nn.Module):
    """The collection alone (models ``ebc``, ``ec``); its forward returns the collection's
    output (the pooled KeyedTensor, or ``{feature: JaggedTensor}``)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, dense: torch.Tensor, sparse):
        return self.ebc(sparse)


class TrainModel(nn.Module):
    """``forward(batch) -> (loss, (loss, logits or pooled, labels))``, TorchRec's train-model
    convention (``DLRMTrain``). ``ebc``: loss = sum(pooled * grad), ``grad`` a fixed [B, sum(D)]
    tensor (not a buffer: data parallelism must not broadcast it)."""

    def __init__(self, model: nn.Module, kind: str, grad: torch.Tensor | None) -> None:
        super().__init__()
        self.model = model
        self.kind = kind
        self._grad = grad

    def forward(self, batch: Batch):
        if self.kind in ("dlrm", "dcnv2"):
            logits = self.model(batch.dense, batch.sparse).squeeze(-1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            return loss, (loss.detach(), logits.detach(), batch.labels)
        if self.kind == "ec":  # every feature's rows [ids, D] against one fixed [D] vector
            rows = self.model(batch.dense, batch.sparse)
            loss = sum((jt.values() @ self._grad).sum() for jt in rows.values())
            return loss, (loss.detach(), loss.detach(), batch.labels)
        pooled = self.model(batch.dense, batch.sparse).values()
        loss = (pooled * self._grad).sum()
        return loss, (loss.detach(), pooled.detach(), batch.labels)


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """The model kind and its dense sizes (``dense_arch[-1]`` = D); ``dcnv2``: the cross
    network's layers and rank too."""

    kind: str
    num_dense: int
    dense_arch: tuple[int, ...]
    over_arch: tuple[int, ...]
    cross_layers: int = 3
    low_rank: int = 512


def embedding_fqn(kind: str, ours: bool = False) -> str:
    """Where the collection sits in ``TrainModel`` (``dcnv2``: TorchRec's ``DLRM_DCN`` keeps it
    where its DLRM does, our ``DCNv2Model`` in ``ebc``)."""
    if kind == "dlrm" or (kind == "dcnv2" and not ours):
        return "model.sparse_arch.embedding_bag_collection"
    return "model.ebc"


def build_model(spec: ModelSpec, ebc: nn.Module, device: torch.device, grad, *,
                ours: bool = False, seed: int = 0) -> TrainModel:
    """``TrainModel`` of ``spec.kind`` over ``ebc`` (ours or TorchRec's, on the meta device);
    ``dcnv2``: our ``DCNv2Model`` when ``ours``, else TorchRec's ``DLRM_DCN``, the same dense
    weights either way (drawn from ``seed``)."""
    if spec.kind == "dcnv2":
        from .dist_dcnv2 import build_dcnv2

        inner = build_dcnv2(spec, ebc, device, ours=ours, seed=seed)
    elif spec.kind == "dlrm":
        from torchrec.models.dlrm import DLRM

        inner = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=spec.num_dense,
            dense_arch_layer_sizes=list(spec.dense_arch),
            over_arch_layer_sizes=list(spec.over_arch),
            dense_device=device,
        )
    elif spec.kind in ("ebc", "ec"):
        inner = EmbeddingsOnly(ebc)
    else:
        raise ValueError(f"model: expected one of [ebc, dlrm, ec, dcnv2], got {spec.kind!r}")
    return TrainModel(inner, spec.kind, grad)


def fixed_row_grad(tables: Sequence[Table], B: int, L: int, seed: int, rank: int,
                   device) -> torch.Tensor:
    """The ``ec`` model's gradient of every row: one [D] vector, N(0, 1) / sqrt(B L)."""
    g = torch.Generator(device=device).manual_seed(seed * 31 + rank + 7)
    return torch.randn(tables[0].embedding_dim, generator=g, device=device) / math.sqrt(B * L)


def fixed_grad(tables: Sequence[Table], B: int, seed: int, rank: int, device) -> torch.Tensor:
    """The ``ebc`` model's output gradient: [B, sum(D)], N(0, 1) / sqrt(B), per rank."""
    g = torch.Generator(device=device).manual_seed(seed * 31 + rank + 5)
    width = sum(t.embedding_dim for t in tables)
    return torch.randn(B, width, generator=g, device=device) / math.sqrt(B)


# -- bytes TorchRec sends (an estimate from the batch and the plan) ------------------------------
def torchrec_bytes(batch: Batch, plan: ShardingPlan, tables: Sequence[Table], rank: int,
                   sequence: bool = False) -> dict:
    """Bytes this rank sends per collective in one TorchRec step, estimated from the KJT and
    the pooled sizes: ids and lengths to their owners (row-wise: lengths of every bag to every
    rank), pooled partials reduce-scattered (row-wise) or sent to their samples' rank
    (table-wise), and their gradients back; a VBE batch at each feature's own batch size.
    ``sequence`` (an EmbeddingCollection): a row per id instead of a pooled one per bag, taking
    the other ranks' batches to be like this one."""
    kjt = batch.sparse
    R = plan.world_size
    id_size, len_size = kjt.values().element_size(), kjt.lengths().element_size()
    per_key = kjt.to_dict()
    ids = lengths = fwd = bwd = 0
    for t, ts in zip(tables, plan.tables, strict=True):
        values = per_key[t.feature].values()
        B = per_key[t.feature].lengths().numel()  # VBE: the feature's own bags
        row_bytes = t.embedding_dim * 4
        if sequence and ts.sharding == "row_wise":
            cuts = torch.tensor([s.row_start for s in ts.shards[1:]], device=values.device)
            far = int((torch.bucketize(values, cuts, right=True) != rank).sum())
            ids += far * id_size
            lengths += (len(ts.shards) - (1 if rank < len(ts.shards) else 0)) * B * len_size
            fwd += far * row_bytes  # the rows of the other ranks' ids held here, as many
            bwd += far * row_bytes  # the gradients of this rank's rows held elsewhere
        elif sequence and ts.shards[0].rank != rank:
            ids += values.numel() * id_size
            lengths += B * len_size
            bwd += values.numel() * row_bytes
        elif sequence:
            fwd += (R - 1) * values.numel() * row_bytes
        elif ts.sharding == "row_wise":
            cuts = torch.tensor([s.row_start for s in ts.shards[1:]], device=values.device)
            owner = torch.bucketize(values, cuts, right=True)
            ids += int((owner != rank).sum()) * id_size
            lengths += (len(ts.shards) - (1 if rank < len(ts.shards) else 0)) * B * len_size
            fwd += (R - 1) * B * t.embedding_dim * 4  # reduce-scatter of [R*B, D] partials
            bwd += (R - 1) * B * t.embedding_dim * 4  # all-gather of the [B, D] gradient
        elif ts.shards[0].rank != rank:
            ids += values.numel() * id_size
            lengths += B * len_size
            bwd += B * t.embedding_dim * 4  # the gradient of this rank's samples, to the owner
        else:
            fwd += (R - 1) * B * t.embedding_dim * 4  # pooled bags of the other ranks' samples
    return {
        "input_dist.lengths": float(lengths),
        "input_dist.ids": float(ids),
        "output_dist.forward": float(fwd),
        "output_dist.backward": float(bwd),
    }
