"""Rowwise Adagrad with global weight decay (``optim.RowWiseAdagradGlobalDecay``, FBGEMM's
DECOUPLE_GLOBAL): the lazy catch-up decay of the rows a batch touches, written plainly (the
spec of ``ops/global_decay.py``), and the per-step row update the backends run for it.
Formulas: ``docs/optimizers_global_decay.md``."""

from collections.abc import Sequence

import torch

from fbtriton_dist import optim


def decay_factor(prev_iter: float, t: int, lr: float, weight_decay: float,
                 lower_bound: float) -> float:
    """The factor a row last updated at step ``prev_iter`` (0: never since the decay started)
    pays at step ``t``: 1 if ``prev_iter`` is 0, else ``max(lower_bound, (1 - lr *
    weight_decay)^max(t - prev_iter - 1, 0))``: the decay of the steps it missed (its own step
    t decays it through the update)."""
    if prev_iter == 0:
        return 1.0
    return max(lower_bound, (1.0 - lr * weight_decay) ** max(t - prev_iter - 1, 0))


def lazy_decay_applies(opt: optim.RowWiseAdagradGlobalDecay, t: int) -> bool:
    """Does the lookup of training step ``t`` (the module's step + 1, FBGEMM's ``iter``) run
    the catch-up: from ``start_iter`` on, with a decay (FBGEMM: ``weight_decay > 0``)?"""
    return t >= opt.global_weight_decay.start_iter and opt.weight_decay > 0


@torch.no_grad()
def global_decay(weights: torch.Tensor, prev_iter: torch.Tensor, indices: torch.Tensor,
                 offsets: torch.Tensor, features: Sequence[tuple[int, int, int, int]], t: int,
                 opt: optim.RowWiseAdagradGlobalDecay) -> None:
    """Before the lookup of training step ``t``: each valid id of the batch (``indices`` [N],
    ``offsets`` [T*B+1], feature-major) multiplies its row of the flat ``weights`` by
    ``decay_factor`` and sets its ``prev_iter`` ([rows] fp32) to t, in place; out-of-range
    ids are left to the lookup's bounds check. ``features``: per feature, ``(first element,
    first state row, rows, D)`` of its table. A no-op where ``lazy_decay_applies`` is false."""
    if not lazy_decay_applies(opt, t):
        return
    T = len(features)
    B = (offsets.numel() - 1) // T if T else 0
    lb = opt.global_weight_decay.lower_bound
    for i in range(indices.numel()):
        bag = int(torch.searchsorted(offsets, torch.tensor(i, dtype=offsets.dtype),
                                     right=True)) - 1
        e0, r0, rows, D = features[bag // B]
        row = int(indices[i])
        if not 0 <= row < rows:
            continue
        f = decay_factor(float(prev_iter[r0 + row]), t, opt.lr, opt.weight_decay, lb)
        w = weights[e0 + row * D: e0 + (row + 1) * D]
        w.copy_((w.double() * f).to(w.dtype))
        prev_iter[r0 + row] = float(t)


def row_update(opt: optim.RowWiseAdagradGlobalDecay) -> optim.RowWiseAdagrad:
    """The per-step row update of ``opt``: rowwise Adagrad with decoupled decay (its
    correction ``1 - lr * weight_decay``, FBGEMM's for DECOUPLE and DECOUPLE_GLOBAL)."""
    return optim.RowWiseAdagrad(lr=opt.lr, eps=opt.eps, weight_decay=opt.weight_decay,
                                weight_decay_mode="decoupled")
