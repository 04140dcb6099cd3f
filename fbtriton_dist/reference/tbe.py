"""Pure-PyTorch TBE: the spec of kernels/tbe_forward.py and kernels/tbe_backward.py."""

import torch

from fbtriton_dist import optim
from fbtriton_dist.pooling import PoolingMode
from fbtriton_dist.reference.counter import counter_update, refresh_max_counter
from fbtriton_dist.reference.global_decay import row_update

POOL_SUM, POOL_MEAN, POOL_NONE = PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE
"""The ``pooling`` codes (``fbtriton_dist.pooling.PoolingMode``): sum or mean per bag, or none
(one row per id)."""


def _bags(offsets: torch.Tensor, N: int) -> torch.Tensor:
    """Bag id (f * B + b) of every id position; 0 for the padding after the last bag."""
    lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
    bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)
    return torch.nn.functional.pad(bags[:N], (0, max(N - bags.numel(), 0)))


def _in_bags(offsets: torch.Tensor, N: int) -> torch.Tensor:
    """[N] bool: the id positions inside a bag (the rest is padding, see kernels.tbe_forward)."""
    return torch.arange(N, device=offsets.device) < offsets[-1]


def tbe_forward(
    weights: torch.Tensor,
    w_offsets: torch.Tensor,
    dims: torch.Tensor,
    D_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    pooling: int,
    max_D: int,
    total_D: int,
    output_dtype: torch.dtype,
    rows: torch.Tensor | None = None,
    row_offsets: torch.Tensor | None = None,
    num_rows: int = 0,
    err: torch.Tensor | None = None,
    linearize: bool = False,
    row_align: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pooled lookup: ``out[b, D_offsets[f]:D_offsets[f+1]] = sum/mean of bag (f, b)'s rows``;
    ``pooling=POOL_NONE`` (2): one row per id, ``out[i, :D_f]`` = id i's row (times its
    weight), ``[N, max_D]`` with zeros after each feature's D and in padding rows.
    With ``err``, ids outside ``[0, rows[f])`` are dropped and counted (kernels.tbe_forward
    has the whole contract, ``linearize`` included; ``row_align`` is a kernel hint, unused
    here); offsets must be well formed here."""
    T = dims.numel()
    B = (offsets.numel() - 1) // T
    N = indices.numel()
    shape = (N, max_D) if pooling == POOL_NONE else (B, total_D)
    out = torch.zeros(shape, dtype=torch.float32, device=weights.device)
    bags = _bags(offsets, N)
    keep = _in_bags(offsets, N)
    if err is not None and N:
        keep = keep & (indices >= 0) & (indices.to(torch.int64) < rows[bags // max(B, 1)])
        bad = torch.nonzero(~keep).flatten()
        if bad.numel():
            err[0] += bad.numel()
            err[1] = torch.maximum(err[1], N - bad[0])
    lengths = torch.zeros(T * B, dtype=torch.float32, device=weights.device)
    lengths.index_add_(0, bags, keep.to(torch.float32))
    for f in range(T):
        D, base, col = int(dims[f]), int(w_offsets[f]), int(D_offsets[f])
        sel = ((bags // B) == f) & keep
        ids = indices[sel].to(torch.int64)
        rows = weights[base + ids[:, None] * D + torch.arange(D, device=weights.device)]
        rows = rows.to(torch.float32)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[sel].to(torch.float32)[:, None]
        if pooling == POOL_NONE:
            out[torch.nonzero(sel).flatten(), :D] = rows
            continue
        pooled = torch.zeros((B, D), dtype=torch.float32, device=weights.device)
        pooled.index_add_(0, bags[sel] - f * B, rows)
        if pooling == POOL_MEAN:
            pooled = pooled / lengths[f * B : (f + 1) * B].clamp(min=1)[:, None]
        out[:, col : col + D] = pooled
    out = out.to(output_dtype)
    if not linearize:
        return out
    keys = torch.where(keep, row_offsets[bags // max(B, 1)] + indices.to(torch.int64), num_rows)
    counts = lengths if pooling == POOL_MEAN else None
    return out, keys, bags.to(torch.int32), counts


def step_seed(seed: int, t: int) -> int:
    """The stochastic-rounding seed of fused update t (1, 2, ...) of a module seeded ``seed``:
    a function of the two alone, so that a restored or replayed step rounds as the original."""
    return (seed * 1000003 + t) % (2**31 - 1)


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype`` up or down with probability given by the distance: add
    uniform noise of one ulp of ``dtype`` at x, then round toward zero. Unbiased in expectation.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    mantissa, min_exp = (10, -14) if dtype == torch.float16 else (7, -126)
    _, exp = torch.frexp(x)  # x = m * 2^exp with 0.5 <= |m| < 1
    ulp_exp = (torch.clamp(exp - 1, min=min_exp) - mantissa).clamp(min=-126)
    u = torch.rand(x.shape, generator=generator, device=x.device)
    noisy = x + torch.sign(x) * u * torch.pow(2.0, ulp_exp.to(torch.float32))
    return _round_toward_zero(noisy, dtype)


def _round_toward_zero(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = x.to(dtype)  # round to nearest even, then step back where it rounded away from zero
    away = y.to(torch.float32).abs() > x.abs()
    if away.any():
        bits = y.view(torch.int16)
        y = torch.where(away, (bits - 1).view(dtype), y)  # |value| - 1 ulp, same sign
    return y


def tbe_backward(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    w_offsets: torch.Tensor,
    dims: torch.Tensor,
    row_offsets: torch.Tensor,
    D_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    pooling: int,
    max_D: int,
    optimizer: optim.Optimizer | None,
    step: torch.Tensor | None,
    momentum1: torch.Tensor | None,
    momentum2: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    hyper: torch.Tensor | None = None,
    num_rows: int | None = None,
    keys: torch.Tensor | None = None,
    bag_ids: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    row_align: int = 1,
    prev_iter: torch.Tensor | None = None,
    row_counter: torch.Tensor | None = None,
    max_counter: torch.Tensor | None = None,
    row_counter_max: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Same contract as kernels.tbe_backward: update in place, or return
    ``(row_elems, row_dims, row_grads)``. With an optimizer, ``step`` ([1] int64, updates
    taken so far) is advanced by one first and t = its new value: Adam's bias corrections are
    ``1 - beta^t`` and the rounding seed ``step_seed(seed, t)``. The hyper-parameters come
    from ``optimizer`` (``hyper``, the kernels' device copy of them, and ``row_align``, their
    vector width, are not read). ``prev_iter``, ``row_counter`` ([rows] fp32) and
    ``max_counter`` ([1] fp32, refreshed here; from ``row_counter_max`` where given):
    rowwise_adagrad_with_counter's state."""
    device = weights.device
    t = 0
    if optimizer is not None:
        if step is None:
            raise ValueError("step: expected the optimizer's [1] int64 step counter, got None")
        step.add_(1)
        t = int(step.item())
    extra = {}
    if isinstance(optimizer, optim.RowWiseAdagradWithCounter):
        extra = dict(prev_iter=prev_iter, row_counter=row_counter, max_counter=refresh_max_counter(
            optimizer, t, row_counter, max_counter, row_counter_max))
    T = dims.numel()
    B = (offsets.numel() - 1) // T
    N = indices.numel()
    bags = _bags(offsets, N) if bag_ids is None else bag_ids.to(torch.int64)
    sentinel = num_rows if num_rows is not None else 2**62
    if keys is None:
        keys = row_offsets[bags // max(B, 1)] + indices.to(torch.int64)
        keys = torch.where(_in_bags(offsets, N), keys, sentinel)  # padding: no gradient
    keys = keys.to(torch.int64)
    keep = keys < sentinel  # dropped ids and padding get no gradient
    positions = torch.arange(N, device=device)[keep]
    bags, keys = bags[keep], keys[keep]
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights[keep]
    N = keys.numel()
    feats = bags // max(B, 1)
    scale = torch.ones(N, dtype=torch.float32, device=device)
    if per_sample_weights is not None:
        scale = scale * per_sample_weights.to(torch.float32)
    if pooling == POOL_MEAN:
        lengths = (offsets[1:] - offsets[:-1]).to(torch.float32) if counts is None else counts
        scale = scale / lengths[bags]

    # Per table (one representative feature per distinct row offset): sum each row's gradient.
    row_elems, row_dims, row_grads = [], [], []
    generator = torch.Generator(device=device).manual_seed(step_seed(seed, t))
    for base in torch.unique(row_offsets).tolist():
        f_of_table = [f for f in range(T) if int(row_offsets[f]) == base]
        f0 = f_of_table[0]
        D, w_base = int(dims[f0]), int(w_offsets[f0])
        sel = torch.isin(feats, torch.tensor(f_of_table, device=device))
        if not bool(sel.any()):
            continue
        if pooling == POOL_NONE:  # id i's gradient is row i of grad_output
            g = grad_output.to(torch.float32)[positions[sel], :D] * scale[sel][:, None]
        else:
            cols = D_offsets[feats[sel]][:, None] + torch.arange(D, device=device)
            g = grad_output.to(torch.float32)[(bags[sel] % B)[:, None], cols]
            g = g * scale[sel][:, None]
        rows, inverse = torch.unique(keys[sel] - base, return_inverse=True)
        grad = torch.zeros((rows.numel(), D), dtype=torch.float32, device=device)
        grad.index_add_(0, inverse, g)
        elems = w_base + rows[:, None] * D + torch.arange(D, device=device)
        if optimizer is None:
            row_elems.append(elems[:, 0])
            row_dims.append(torch.full_like(rows, D))
            row_grads.append(torch.nn.functional.pad(grad, (0, max_D - D)))
            continue
        w = weights[elems].to(torch.float32)
        w = _apply_optimizer(optimizer, w, grad, t, momentum1, momentum2, base + rows, elems,
                             **extra)
        if stochastic_rounding:
            weights[elems] = stochastic_round(w, weights.dtype, generator)
        else:
            weights[elems] = w.to(weights.dtype)
    if optimizer is not None:
        return None
    if not row_elems:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, torch.empty((0, max_D), dtype=torch.float32, device=device)
    return torch.cat(row_elems), torch.cat(row_dims), torch.cat(row_grads)


def tbe_per_sample_weights_grad(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    w_offsets: torch.Tensor,
    dims: torch.Tensor,
    D_offsets: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    *,
    pooling: int,
) -> torch.Tensor:
    """d out / d per_sample_weights[i] = <grad_output[b, cols(f)], row_i> (/ bag length);
    without pooling, <grad_output[i, :D_f], row_i>."""
    T = dims.numel()
    B = (offsets.numel() - 1) // T
    bags = _bags(offsets, indices.numel())
    grad = torch.zeros(indices.numel(), dtype=torch.float32, device=weights.device)
    for f in range(T):
        D, base, col = int(dims[f]), int(w_offsets[f]), int(D_offsets[f])
        sel = ((bags // B) == f) & _in_bags(offsets, indices.numel())
        ids = indices[sel].to(torch.int64)
        rows = weights[base + ids[:, None] * D + torch.arange(D, device=weights.device)]
        if pooling == POOL_NONE:
            g = grad_output[torch.nonzero(sel).flatten(), :D]
        else:
            g = grad_output[bags[sel] - f * B, col : col + D]
        grad[sel] = (rows.to(torch.float32) * g.to(torch.float32)).sum(dim=1)
    if pooling == POOL_MEAN:
        lengths = (offsets[1:] - offsets[:-1]).to(torch.float32)
        grad = grad / lengths[bags]
    return grad


# -- fused optimizer updates, one per optimizer of optim.REGISTRY (the twins of
# kernels/tbe_optim.py's helpers): rows ``w`` [U, D] fp32 and their gradients ``g`` [U, D]
# summed over the batch, t the step count (>= 1), ``state_rows`` [U] the rows' linear rows
# (per-row states), ``elems`` [U, D] their elements (per-element states); the states are
# updated in place, the new rows returned


def _sgd_update(opt: optim.SGD, w, g, t, momentum1, momentum2, state_rows, elems):
    return w - opt.lr * g


def _adagrad_update(opt: optim.Adagrad, w, g, t, momentum1, momentum2, state_rows, elems):
    m = momentum1[elems] + g * g
    momentum1[elems] = m
    return w - opt.lr * g / (torch.sqrt(m) + opt.eps)


def _rowwise_adagrad_update(
    opt: optim.RowWiseAdagrad, w, g, t, momentum1, momentum2, state_rows, elems
):
    wd = opt.applied_weight_decay  # 0 with weight_decay_mode="none"
    decoupled = opt.weight_decay_mode == "decoupled"
    g_wd = g if decoupled else g + wd * w
    m = momentum1[state_rows] + (g_wd * g_wd).mean(dim=1)
    momentum1[state_rows] = m
    mult = opt.lr / (torch.sqrt(m) + opt.eps)
    corr = torch.full_like(m, 1.0 - opt.lr * wd) if decoupled else 1.0 - mult * wd
    return corr[:, None] * w - mult[:, None] * g


def _adam_direction(opt, w, g, t, momentum1, momentum2, state_rows, elems, rowwise_v: bool):
    """Adam's ``m_hat / (sqrt(v_hat) + eps) + weight_decay * w``, its moments updated in
    place: m per element; v per element, or (``rowwise_v``) per row of the mean of g^2."""
    b1, b2 = opt.betas
    m1 = b1 * momentum1[elems] + (1.0 - b1) * g
    momentum1[elems] = m1
    if rowwise_v:
        m2 = b2 * momentum2[state_rows] + (1.0 - b2) * (g * g).mean(dim=1)
        momentum2[state_rows] = m2
        m2 = m2[:, None]
    else:
        m2 = b2 * momentum2[elems] + (1.0 - b2) * g * g
        momentum2[elems] = m2
    m_hat = m1 / (1.0 - b1**t)
    v_hat = m2 / (1.0 - b2**t)
    return m_hat / (torch.sqrt(v_hat) + opt.eps) + opt.weight_decay * w


def _trust_ratio(w, r):
    """Per row ``||w|| / ||r||`` ([U, 1]), 0 where ``||r|| = 0``."""
    w_norm = torch.linalg.vector_norm(w, dim=1, keepdim=True)
    r_norm = torch.linalg.vector_norm(r, dim=1, keepdim=True)
    return torch.where(r_norm > 0, w_norm / r_norm, torch.zeros_like(r_norm))


def _adam_update(opt: optim.Adam, w, g, t, momentum1, momentum2, state_rows, elems):
    return w - opt.lr * _adam_direction(opt, w, g, t, momentum1, momentum2, state_rows, elems,
                                        rowwise_v=False)


def _partial_rowwise_adam_update(
    opt: optim.PartialRowWiseAdam, w, g, t, momentum1, momentum2, state_rows, elems
):
    return w - opt.lr * _adam_direction(opt, w, g, t, momentum1, momentum2, state_rows, elems,
                                        rowwise_v=True)


def _lamb_update(opt: optim.LAMB, w, g, t, momentum1, momentum2, state_rows, elems):
    r = _adam_direction(opt, w, g, t, momentum1, momentum2, state_rows, elems, rowwise_v=False)
    return w - opt.lr * _trust_ratio(w, r) * r


def _partial_rowwise_lamb_update(
    opt: optim.PartialRowWiseLAMB, w, g, t, momentum1, momentum2, state_rows, elems
):
    r = _adam_direction(opt, w, g, t, momentum1, momentum2, state_rows, elems, rowwise_v=True)
    return w - opt.lr * _trust_ratio(w, r) * r


def _lars_sgd_update(opt: optim.LarsSGD, w, g, t, momentum1, momentum2, state_rows, elems):
    w_norm = torch.linalg.vector_norm(w, dim=1, keepdim=True)
    denom = torch.linalg.vector_norm(g, dim=1, keepdim=True) + opt.weight_decay * w_norm
    rate = torch.where(denom > 0, opt.lr * opt.eta * w_norm / denom, torch.zeros_like(denom))
    m = opt.momentum * momentum1[elems] + rate * (g + opt.weight_decay * w)
    momentum1[elems] = m
    return w - m


def _ftrl_update(opt: optim.FTRL, w, g, t, momentum1, momentum2, state_rows, elems):
    z, n = momentum1[elems], momentum2[elems]
    n_new = n + g * g
    sigma = (torch.sqrt(n_new) - torch.sqrt(n)) / opt.lr
    z = z + g - sigma * w
    momentum1[elems] = z
    momentum2[elems] = n_new
    denom = (opt.beta + torch.sqrt(n_new)) / opt.lr + opt.l2
    w_new = -(z - torch.sign(z) * opt.l1) / denom
    return torch.where(z.abs() <= opt.l1, torch.zeros_like(w), w_new)


def _rowwise_rmsprop_ar_update(
    opt: optim.RowWiseRMSpropAR, w, g, t, momentum1, momentum2, state_rows, elems
):
    b = opt.ema_beta
    v = b * momentum1[state_rows] + (1.0 - b) * (g * g).mean(dim=1)
    momentum1[state_rows] = v
    last = momentum2[state_rows]  # the step of the row's last update, 0 before its first
    gap = torch.where(last == 0, torch.ones_like(last), t - last)
    decay = (opt.lr * opt.ar_alpha * gap).clamp(0.0, 1.0)
    keep = (1.0 - decay).clamp(min=opt.min_shrinkage)
    momentum2[state_rows] = float(t)
    rate = opt.lr / (torch.sqrt(v) + opt.eps)
    return keep[:, None] * w - rate[:, None] * g


UPDATES = {
    "sgd": _sgd_update,
    "adagrad": _adagrad_update,
    "rowwise_adagrad": _rowwise_adagrad_update,
    "adam": _adam_update,
    "partial_rowwise_adam": _partial_rowwise_adam_update,
    "lamb": _lamb_update,
    "partial_rowwise_lamb": _partial_rowwise_lamb_update,
    "lars_sgd": _lars_sgd_update,
    "ftrl": _ftrl_update,
    # rowwise Adagrad's update; its moving average is the module's (modules/fused_optim.py)
    "emainplace_rowwise_adagrad": _rowwise_adagrad_update,
    "rowwise_rmsprop_ar": _rowwise_rmsprop_ar_update,
    "rowwise_adagrad_with_counter": counter_update,  # reference/counter.py
    # rowwise Adagrad's update; its moving average and swap are the module's (fused_optim.py)
    "ensemble_rowwise_adagrad": _rowwise_adagrad_update,
    # rowwise Adagrad's decoupled update; the catch-up decay runs before the lookup
    "rowwise_adagrad_global_decay": lambda opt, *a: _rowwise_adagrad_update(row_update(opt), *a),
}
"""The update of each optimizer, by its registry name."""


def _apply_optimizer(
    optimizer: optim.Optimizer,
    w: torch.Tensor,
    g: torch.Tensor,
    step: int,
    momentum1: torch.Tensor | None,
    momentum2: torch.Tensor | None,
    state_rows: torch.Tensor,
    elems: torch.Tensor,
    **extra,
) -> torch.Tensor:
    """One update of rows ``w`` [U, D] with summed gradients ``g`` [U, D]; returns new rows.
    States stored in fp16 / bf16 (``optimizer_state_dtypes``) are updated in fp32 copies, then
    rounded back to nearest (values the update left are exact in their dtype). ``extra``: the
    fp32 states beyond momentum1 / momentum2 (``prev_iter``, ...), passed on by name."""
    update = UPDATES[optim.spec_of(optimizer).name]
    stored = (momentum1, momentum2)
    m1, m2 = (s.to(torch.float32) if s is not None else None for s in stored)
    w = update(optimizer, w, g, step, m1, m2, state_rows, elems, **extra)
    for state, fp32 in zip(stored, (m1, m2), strict=True):
        if state is not None and state is not fp32:
            state.copy_(fp32)
    return w
