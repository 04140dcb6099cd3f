"""The catch-up decay of ``optim.RowWiseAdagradGlobalDecay`` (FBGEMM's DECOUPLE_GLOBAL) before a
training lookup: vectorised torch ops per feature, on any device (spec:
``reference/global_decay.py``). Unlike FBGEMM, which scales the rows inside its forward and
backward kernels, the decayed rows are written back before the lookup; the lookup and the
fused update (rowwise Adagrad, decoupled) then read them, which gives the same rows."""

from collections.abc import Sequence

import torch

from fbtriton_dist import optim
from fbtriton_dist.reference.global_decay import lazy_decay_applies


@torch.no_grad()
def global_decay(weights: torch.Tensor, prev_iter: torch.Tensor, indices: torch.Tensor,
                 offsets: torch.Tensor, features: Sequence[tuple[int, int, int, int]], t: int,
                 opt: optim.RowWiseAdagradGlobalDecay) -> None:
    """As ``reference.global_decay.global_decay`` (same arguments; the factor in fp32, as
    FBGEMM's ``powf``). Reads the per-feature bounds of ``offsets`` on the host (one sync)."""
    if not lazy_decay_applies(opt, t) or indices.numel() == 0:
        return
    T = len(features)
    B = (offsets.numel() - 1) // T
    bounds = offsets[::B].tolist() if B else [0] * (T + 1)
    base = torch.tensor(1.0 - opt.lr * opt.weight_decay, dtype=torch.float32,
                        device=weights.device)
    lb = opt.global_weight_decay.lower_bound
    flat = weights.detach()
    for f, (e0, r0, rows, D) in enumerate(features):
        ids = indices[bounds[f]:bounds[f + 1]].to(torch.int64)
        ids = ids[(ids >= 0) & (ids < rows)]
        if ids.numel() == 0:
            continue
        state_rows = ids + r0
        prev = prev_iter[state_rows]
        missed = (t - prev - 1).clamp_min(0)
        factor = torch.where(prev == 0, torch.ones_like(prev),
                             base.pow(missed).clamp_min(lb))
        table = flat[e0:e0 + rows * D].view(rows, D)
        table[ids] = (table[ids].to(torch.float32) * factor[:, None]).to(table.dtype)
        prev_iter[state_rows] = float(t)
