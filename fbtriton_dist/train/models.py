"""The job's own models: the sequence model of ``model.kind: sequence`` and the DCNv2 model
of ``model.kind: dcnv2`` (MLPerf's DLRM-dcnv2, below). ``model.kind: dlrm`` is TorchRec's DLRM.

The sequence model: a candidate item attends to the user's
behaviour sequences (target attention, as in DIN), beside pooled features and dense inputs.

    dense [B, num_dense] --dense MLP------------------------------------+
    KJT --EmbeddingBagCollection (pooled tables)--> [B, sum D_pooled]   +--> over MLP --> logit
        --EmbeddingCollection (sequence tables) --> target rows, history rows --+
             history rows h_i of sample b, target t_b: a_i = softmax_i(h_i . t_b / sqrt(D)),
             interest_b = sum_i a_i h_i; the MLP sees [t_b, interest_b, t_b * interest_b]

Sequences stay jagged (no padding): the softmax runs per sample over its own rows with
segment ops, so an empty history gives a zero interest vector. The target feature may hold
several ids per sample (their rows are averaged; none: zeros).
"""

from collections.abc import Sequence

import torch
from torch import nn


def _mlp(sizes: Sequence[int], last_plain: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if not (last_plain and i == len(sizes) - 2):
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _sample_of_rows(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """[n] the sample (bag) each of the jagged rows belongs to."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device),
                                   lengths, output_size=n)


def segment_mean(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, D]`` mean of each sample's rows (zeros for an empty one)."""
    B = lengths.numel()
    sample = _sample_of_rows(lengths, rows.shape[0])
    total = rows.new_zeros((B, rows.shape[1])).index_add(0, sample, rows)
    return total / lengths.clamp(min=1).to(rows.dtype)[:, None]


def target_attention(history: torch.Tensor, lengths: torch.Tensor,
                     target: torch.Tensor) -> torch.Tensor:
    """``[B, D]``: each sample's history rows ([N, D], ``lengths`` [B]) averaged with the
    softmax over its rows of their scaled dot product with its target ([B, D])."""
    B, D = target.shape
    sample = _sample_of_rows(lengths, history.shape[0])
    scores = (history * target.index_select(0, sample)).sum(1) / D**0.5
    top = scores.new_full((B,), float("-inf")).scatter_reduce(
        0, sample, scores.detach(), "amax", include_self=True)
    weights = torch.exp(scores - top.index_select(0, sample))
    norm = weights.new_zeros(B).index_add(0, sample, weights)
    weights = weights / norm.index_select(0, sample)
    return history.new_zeros((B, D)).index_add(0, sample, history * weights[:, None])


class TargetAttentionModel(nn.Module):
    """``forward(dense [B, num_dense], kjt) -> logits [B, 1]``.

    Args:
        ebc: the pooled tables (an EmbeddingBagCollection) or None.
        ec: the sequence tables (an EmbeddingCollection), holding ``target`` and ``history``.
        target: the candidate item's feature; history: the behaviour-sequence features (the
            target's D).
        num_dense, dense_arch, over_arch: the dense MLP's input width and layer sizes, the
            over MLP's layer sizes (ending in 1).
    """

    def __init__(self, ebc: nn.Module | None, ec: nn.Module, *, target: str,
                 history: Sequence[str], num_dense: int, dense_arch: Sequence[int],
                 over_arch: Sequence[int], pooled_dim: int, target_dim: int,
                 dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.ebc, self.ec = ebc, ec
        self.target, self.history = target, list(history)
        self.dense_arch = _mlp([num_dense, *dense_arch], last_plain=False).to(dense_device)
        width = dense_arch[-1] + pooled_dim + target_dim * (1 + 2 * len(self.history))
        self.over_arch = _mlp([width, *over_arch], last_plain=True).to(dense_device)

    def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        parts = [self.dense_arch(dense)]
        if self.ebc is not None:
            parts.append(self.ebc(kjt).values())
        rows = self.ec(kjt)
        target = segment_mean(rows[self.target].values(), rows[self.target].lengths())
        parts.append(target)
        for h in self.history:
            interest = target_attention(rows[h].values(), rows[h].lengths(), target)
            parts += [interest, target * interest]
        return self.over_arch(torch.cat(parts, dim=1))


class LowRankCross(nn.Module):
    """DCNv2's cross network with low-rank weights, ``num_layers`` layers over ``[B, N]``:
    ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l`` with ``V_l`` [r, N], ``W_l`` [N, r]
    (xavier-normal) and ``b_l`` [N] (zeros), as ``torchrec.modules.crossnet.LowRankCrossNet``."""

    def __init__(self, width: int, num_layers: int, low_rank: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        if low_rank < 1 or num_layers < 0:
            raise ValueError(f"expected low_rank >= 1 and num_layers >= 0, got {low_rank}, "
                             f"{num_layers}")

        def normal(*shape: int) -> nn.Parameter:
            return nn.Parameter(nn.init.xavier_normal_(torch.empty(*shape, device=device)))

        self.V = nn.ParameterList([normal(low_rank, width) for _ in range(num_layers)])
        self.W = nn.ParameterList([normal(width, low_rank) for _ in range(num_layers)])
        self.bias = nn.ParameterList(
            [nn.Parameter(torch.zeros(width, device=device)) for _ in range(num_layers)])

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for V, W, b in zip(self.V, self.W, self.bias, strict=True):
            x = x0 * (nn.functional.linear(nn.functional.linear(x, V), W) + b) + x
        return x

    def extra_repr(self) -> str:
        return f"layers={len(self.V)}, low_rank={self.V[0].shape[0] if len(self.V) else 0}"


class DCNv2Model(nn.Module):
    """MLPerf's DLRM-dcnv2 (TorchRec's ``DLRM_DCN``) over an EmbeddingBagCollection:
    ``forward(dense [B, num_dense], kjt) -> logits [B, 1]``.

        dense --dense MLP (ReLU after every layer)--> [B, D] --+
        kjt --EmbeddingBagCollection--> F pooled rows [B, F*D] +--> x0 [B, (F+1)*D]
        x0 --low-rank cross network--> [B, (F+1)*D] --over MLP (last layer plain)--> logit

    Args:
        ebc: the tables, every one of dim D (``dense_arch[-1]``).
        features: the F pooled features in the order the cross network reads them (the
            collection's config order, as TorchRec's ``SparseArch``).
        num_dense, dense_arch, over_arch: as the DLRM's (``over_arch`` ends in 1).
        cross_layers, low_rank: the cross network's depth and rank (MLPerf: 3 and 512).
    """

    def __init__(self, ebc: nn.Module, *, features: Sequence[str], num_dense: int,
                 dense_arch: Sequence[int], over_arch: Sequence[int], cross_layers: int,
                 low_rank: int, dense_device: torch.device | None = None) -> None:
        super().__init__()
        self.ebc, self.features = ebc, list(features)
        width = (len(self.features) + 1) * dense_arch[-1]
        self.dense_arch = _mlp([num_dense, *dense_arch], last_plain=False).to(dense_device)
        self.cross = LowRankCross(width, cross_layers, low_rank, device=dense_device)
        self.over_arch = _mlp([width, *over_arch], last_plain=True).to(dense_device)

    def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        pooled = self.ebc(kjt)
        if list(pooled.keys()) == self.features:
            rows = [pooled.values()]
        else:  # another column order (keys in another order): by name
            by_name = pooled.to_dict()
            rows = [by_name[f] for f in self.features]
        x0 = torch.cat([self.dense_arch(dense), *rows], dim=1)
        return self.over_arch(self.cross(x0))
