"""Rowwise Adagrad with counter (``optim.RowWiseAdagradWithCounter``, FBGEMM's
``rowwise_adagrad_with_counter``): the update of a batch's unique rows, fp32 as FBGEMM's, and
the module's ``max_counter`` refresh. The spec of the CPU step (``ops/cpu.py`` calls
``counter_rows``); formulas in ``docs/optimizers_counter.md``."""

import math

import torch

from fbtriton_dist import optim


def refresh_max_counter(opt: optim.RowWiseAdagradWithCounter, t: int,
                        row_counter: torch.Tensor, max_counter: torch.Tensor,
                        row_counter_max: torch.Tensor | None = None) -> float:
    """Before the update of step t: where t is a multiple of ``max_counter_update_freq``
    (> 0), ``max_counter`` ([1] fp32, in place) becomes 1 + the largest counter of the module's
    rows (1 without rows), or 1 + ``row_counter_max`` ([1] fp32) where given (a sharded
    table's largest counter over every rank's shards); returns its value."""
    if row_counter is None or max_counter is None:
        raise ValueError("rowwise_adagrad_with_counter: expected the module's prev_iter, "
                         "row_counter and max_counter (ops.tbe.FusedOptimizer.counters), got "
                         "none")
    freq = opt.max_counter_update_freq
    if freq > 0 and t % freq == 0:
        if row_counter_max is not None:
            top = float(row_counter_max.item())
        else:
            top = row_counter.max().item() if row_counter.numel() else 0.0
        max_counter.fill_(top + 1.0)
    return float(max_counter.item())


def counter_rows(opt: optim.RowWiseAdagradWithCounter, w, g, t: int, m, prev, count,
                 max_counter: float):
    """One update of U unique rows: ``w``, ``g`` [U, D] fp32 (rows, summed gradients), ``m``,
    ``prev``, ``count`` [U] fp32 (their ``momentum1``, ``prev_iter``, ``row_counter``), t the
    step (FBGEMM's ``iter``). Returns ``(new rows, m, prev, count)``."""
    reg = opt.regularization
    halflife, mode, wd, lr = reg.counter_halflife, reg.counter_weight_decay_mode, \
        opt.weight_decay, opt.lr
    one = torch.ones_like(m)
    gap = torch.where(prev == 0, one, t - prev)  # steps since the row's last update
    if halflife > 0:
        count = 1.0 + torch.exp(-gap * (math.log(2.0) / halflife)) * count
    elif halflife == 0:
        count = one
    else:
        count = count + 1.0
    freq = halflife / count
    g_wd = g + wd * w if mode == "l2" else g
    g_sq = (g_wd * g_wd).sum(dim=1)
    m = m + g_sq / g.shape[1]
    denom = torch.sqrt(m) + opt.eps
    rate = lr / denom
    corr = one
    if opt.weight_decay_mode == "counter":
        enabled = reg.adjustment_iter <= 0 or t > reg.adjustment_iter
        step = _counter_rate(reg, rate, count, max_counter, lr, opt.eps, enabled)
        if enabled and mode == "adagradw":
            if halflife == -1:
                step = rate * torch.sqrt(count)
            elif halflife == -2:
                step = torch.clamp(lr * count, max=reg.adjustment_ub) / denom
            base = 1.0 - wd * lr
            lazy = torch.pow(torch.full_like(m, base),
                             torch.clamp(gap, max=float(t - reg.adjustment_iter)) - 1.0)
            step, corr = step * lazy, base * lazy
        elif enabled and mode == "decoupled":
            corr = 1.0 - freq * wd * lr
        elif enabled and mode == "l2":
            corr = 1.0 - freq * wd * rate
    else:  # cowclip: the step is clipped to count * max(coef * ||w||, lower_bound)
        w_norm = torch.linalg.vector_norm(w, dim=1)
        clip = count * torch.clamp(reg.weight_norm_coefficient * w_norm, min=reg.lower_bound)
        ratio = clip / torch.sqrt(g_sq)
        step = torch.where(ratio < 1.0, ratio, one) * rate  # a 0/0 ratio: 1, as C's fmin
        if mode == "decoupled":
            corr = torch.full_like(m, 1.0 - wd * lr)
        elif mode == "l2":
            corr = 1.0 - wd * step
    prev = torch.full_like(prev, float(t))
    return corr[:, None] * w - step[:, None] * g, m, prev, count


def _counter_rate(reg, rate, count, max_counter: float, lr: float, eps: float, enabled: bool):
    """COUNTER's per-row step size: ``rate``, scaled on rows whose counter exceeds the tail-id
    threshold as ``learning_rate_mode`` says (from step ``adjustment_iter`` on)."""
    if reg.learning_rate_mode == "equal" or not enabled:
        return rate
    threshold = reg.tail_id_threshold
    if reg.tail_id_threshold_is_ratio:
        threshold = math.floor(threshold * max_counter)
    if reg.learning_rate_mode == "tail_id_lr_increase":
        scaled = rate * torch.clamp(torch.pow(max_counter / (count + 1.0), reg.adjustment_ub),
                                    1.0, 10.0)
    elif reg.learning_rate_mode == "tail_id_lr_decrease":
        scaled = rate * torch.clamp(torch.pow((count + 1.0) / max_counter, reg.adjustment_ub),
                                    0.1, 1.0)
    else:  # counter_sgd
        scaled = lr / (torch.sqrt(reg.adjustment_ub * count) + eps)
    return torch.where(count > threshold, scaled, rate)


def counter_update(opt: optim.RowWiseAdagradWithCounter, w, g, t, momentum1, momentum2,
                   state_rows, elems, *, prev_iter, row_counter, max_counter):
    """``reference.tbe``'s ``UPDATES`` entry: ``counter_rows`` on the rows ``state_rows`` of
    the fp32 states (updated in place); returns the new rows."""
    w, m, prev, count = counter_rows(opt, w, g, t, momentum1[state_rows], prev_iter[state_rows],
                                     row_counter[state_rows], max_counter)
    momentum1[state_rows], prev_iter[state_rows], row_counter[state_rows] = m, prev, count
    return w
