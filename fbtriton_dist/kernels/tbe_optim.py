"""The fused optimizer update of the TBE backward's row kernel: one ``@triton.jit`` helper per
optimizer of ``optim.REGISTRY`` (``_<name>_update``), picked by its constexpr kernel code in
``optimizer_update``; the per-step hyper-parameters (``load_hyper``) and the rounded store of
the new rows (``store_rows``). ``kernels/tbe_backward.py``'s ``_tbe_row_update_kernel`` loads
the rows (and a per-row state) before its gradient loop, then calls these.

Adding an optimizer here: its kernel code as a constexpr global, its name in ``OPTIMIZERS``,
its ``_<name>_update`` and its branch in ``optimizer_update`` (see ``fbtriton_dist/optim.py``).
"""

import torch
import triton
import triton.language as tl

from fbtriton_dist import optim
from fbtriton_dist.kernels.tbe_forward import cast_rne, cast_rtz
from fbtriton_dist.optim_counter import native_counter_parameters

OPT_NONE = optim.NO_OPTIMIZER_CODE  # no optimizer: the row gradients are returned
# the optimizers' kernel codes (optim.REGISTRY), constexpr globals for the jit functions
_SGD = tl.constexpr(optim.spec("sgd").kernel_code)
_ADAGRAD = tl.constexpr(optim.spec("adagrad").kernel_code)
_ROWWISE_ADAGRAD = tl.constexpr(optim.spec("rowwise_adagrad").kernel_code)
_ADAM = tl.constexpr(optim.spec("adam").kernel_code)
_PARTIAL_ROWWISE_ADAM = tl.constexpr(optim.spec("partial_rowwise_adam").kernel_code)
_LAMB = tl.constexpr(optim.spec("lamb").kernel_code)
_PARTIAL_ROWWISE_LAMB = tl.constexpr(optim.spec("partial_rowwise_lamb").kernel_code)
_LARS_SGD = tl.constexpr(optim.spec("lars_sgd").kernel_code)
_FTRL = tl.constexpr(optim.spec("ftrl").kernel_code)
_EMAINPLACE_ROWWISE_ADAGRAD = tl.constexpr(optim.spec("emainplace_rowwise_adagrad").kernel_code)
_ROWWISE_RMSPROP_AR = tl.constexpr(optim.spec("rowwise_rmsprop_ar").kernel_code)
_ENSEMBLE_ROWWISE_ADAGRAD = tl.constexpr(optim.spec("ensemble_rowwise_adagrad").kernel_code)
_ROWWISE_ADAGRAD_GLOBAL_DECAY = tl.constexpr(optim.spec("rowwise_adagrad_global_decay").kernel_code)
_ROWWISE_ADAGRAD_WITH_COUNTER = tl.constexpr(
    optim.spec("rowwise_adagrad_with_counter").kernel_code)
# slots of optim.HYPER_FIELDS that load_hyper does not return (read by the helpers' branches)
_ETA, _MOMENTUM, _BETA, _L1, _L2 = (
    tl.constexpr(optim.HYPER_FIELDS.index(n)) for n in ("eta", "momentum", "beta", "l1", "l2")
)
_AR_ALPHA, _EMA_BETA, _MIN_SHRINKAGE = (
    tl.constexpr(optim.HYPER_FIELDS.index(n)) for n in ("ar_alpha", "ema_beta", "min_shrinkage")
)
OPTIMIZERS = (
    "sgd", "adagrad", "rowwise_adagrad", "adam", "partial_rowwise_adam", "lamb",
    "partial_rowwise_lamb", "lars_sgd", "ftrl", "emainplace_rowwise_adagrad",
    "rowwise_rmsprop_ar", "ensemble_rowwise_adagrad",
    "rowwise_adagrad_global_decay", "rowwise_adagrad_with_counter",
)
"""The registry optimizers with a helper here (the Triton backend's capabilities read it)."""
COUNTER_FIELDS = (
    "cowclip", "decay_mode", "learning_rate_mode", "halflife", "decay_rate", "adjustment_iter",
    "adjustment_ub", "threshold", "threshold_is_ratio", "weight_norm_coefficient",
    "lower_bound", "max_counter",
)
"""Rowwise Adagrad with counter's slots of the hyper-parameter tensor, after
``optim.HYPER_FIELDS`` (``counter_hyper``): its modes (their index in ``optim_counter``'s
tuples), ``decay_rate`` ln 2 / ``counter_halflife`` (0 unless > 0), the tail-id threshold
as given (a ratio is taken of ``max_counter`` here), and the module's ``max_counter`` of the
step (refreshed before the launch, on the device)."""
_C0 = len(optim.HYPER_FIELDS)
_C_COWCLIP, _C_DECAY, _C_LR_MODE, _C_HALFLIFE, _C_DECAY_RATE, _C_ADJ_ITER, _C_UB = (
    tl.constexpr(_C0 + i) for i in range(7)
)
_C_THRESHOLD, _C_IS_RATIO, _C_COEF, _C_LOWER, _C_MAX_COUNTER = (
    tl.constexpr(_C0 + i) for i in range(7, 12)
)


def counter_hyper(opt: optim.RowWiseAdagradWithCounter) -> list[float]:
    """``COUNTER_FIELDS``' values but ``max_counter`` (the caller appends the module's)."""
    values = dict(zip(("cowclip", "decay_mode", "learning_rate_mode", "halflife", "decay_rate",
                       "adjustment_iter", "adjustment_ub", "threshold", "max_counter",
                       "weight_norm_coefficient", "lower_bound"),
                      native_counter_parameters(opt, 1.0), strict=True))
    reg = opt.regularization
    counter = opt.weight_decay_mode == "counter"
    values["threshold"] = reg.tail_id_threshold if counter else 0.0
    values["threshold_is_ratio"] = float(counter and reg.tail_id_threshold_is_ratio)
    return [values[name] for name in COUNTER_FIELDS[:-1]]


def optimizer_code(optimizer: optim.Optimizer | None) -> int:
    """The kernels' integer code for an optimizer config (None: plain gradients)."""
    return OPT_NONE if optimizer is None else optim.spec_of(optimizer).kernel_code


# -- fused optimizer updates: one helper per optimizer of optim.REGISTRY, each taking the rows
# ``w`` and their summed gradients ``g`` ([RUNS, BLOCK_D] fp32; masked columns are 0) and
# returning the new rows (fp32), its states updated in place ----------------------------------


@triton.jit
def _sgd_update(w, g, lr):
    """``w - lr * g``."""
    return w - lr * g


@triton.jit
def _adagrad_update(
    w,
    g,
    mom1_ptr,  # [sum(E_t * D_t)] fp32 accumulator per element
    ptrs,  # [RUNS, BLOCK_D] the rows' elements
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    lr,
    eps,
):
    """``m += g^2``, ``w - lr * g / (sqrt(m) + eps)``."""
    m = tl.load(mom1_ptr + ptrs, mask=dm, other=0.0).to(tl.float32) + g * g
    tl.store(mom1_ptr + ptrs, cast_rne(m, mom1_ptr.dtype.element_ty), mask=dm)
    return w - lr * g / (tl.sqrt(m) + eps)


@triton.jit
def _rowwise_adagrad_update(
    w,
    g,
    m_row,  # [RUNS] fp32 the rows' accumulators, loaded before the gradient loop
    mom1_ptr,  # [sum(E_t)] fp32 accumulator per row
    key,  # [RUNS] linear row of each run
    live,  # [RUNS] runs that update a row
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    D,  # [RUNS] the rows' D
    lr,
    eps,
    weight_decay,
    WD_DECOUPLED: tl.constexpr,  # decoupled weight decay, else L2
):
    """``m += mean(g'^2)`` over the row, ``w = c * w - lr / (sqrt(m) + eps) * g``
    (``optim.RowWiseAdagrad``)."""
    Df = D.to(tl.float32)
    if WD_DECOUPLED:
        g_sq = tl.sum(g * g, axis=1) / Df
    else:
        g_wd = tl.where(dm, g + weight_decay * w, 0.0)
        g_sq = tl.sum(g_wd * g_wd, axis=1) / Df
    m = m_row + g_sq
    tl.store(mom1_ptr + key, cast_rne(m, mom1_ptr.dtype.element_ty), mask=live)
    mult = lr / (tl.sqrt(m) + eps)
    if WD_DECOUPLED:
        corr = 1.0 - lr * weight_decay
    else:
        corr = 1.0 - mult * weight_decay
    return corr[:, None] * w - mult[:, None] * g


@triton.jit
def _adam_update(
    w,
    g,
    mom1_ptr,  # [sum(E_t * D_t)] fp32 first moment per element
    mom2_ptr,  # second moment: [sum(E_t * D_t)] per element, or [sum(E_t)] per row (ROWWISE_V)
    ptrs,  # [RUNS, BLOCK_D] the rows' elements
    key,  # [RUNS] linear row of each run
    live,  # [RUNS] runs that update a row
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    D,  # [RUNS] the rows' D
    lr,
    eps,
    beta1,
    beta2,
    weight_decay,
    bias_c1,  # 1 - beta1^t
    bias_c2,  # 1 - beta2^t
    ROWWISE_V: tl.constexpr,  # v per row, of the mean of g^2 (partial rowwise)
    TRUST: tl.constexpr,  # scale the step by the row's trust ratio ||w|| / ||r|| (LAMB)
):
    """Lazy Adam with decoupled weight decay (``optim.Adam``), its partial rowwise variant
    (``optim.PartialRowWiseAdam``) and LAMB (``optim.LAMB``, ``optim.PartialRowWiseLAMB``):
    ``r = m / bias_c1 / (sqrt(v / bias_c2) + eps) + weight_decay * w``, ``w - lr * r``, or
    with TRUST ``w - lr * ||w|| / ||r|| * r`` (0 where ||r|| = 0)."""
    m1 = tl.load(mom1_ptr + ptrs, mask=dm, other=0.0).to(tl.float32)  # fp16/bf16 state: fp32
    m1 = beta1 * m1 + (1.0 - beta1) * g
    tl.store(mom1_ptr + ptrs, cast_rne(m1, mom1_ptr.dtype.element_ty), mask=dm)
    if ROWWISE_V:
        g_sq = tl.sum(g * g, axis=1) / D.to(tl.float32)
        m2 = tl.load(mom2_ptr + key, mask=live, other=0.0).to(tl.float32)
        m2 = beta2 * m2 + (1.0 - beta2) * g_sq
        tl.store(mom2_ptr + key, cast_rne(m2, mom2_ptr.dtype.element_ty), mask=live)
        r = (m1 / bias_c1) / (tl.sqrt(m2 / bias_c2) + eps)[:, None] + weight_decay * w
    else:
        m2 = tl.load(mom2_ptr + ptrs, mask=dm, other=0.0).to(tl.float32)
        m2 = beta2 * m2 + (1.0 - beta2) * g * g
        tl.store(mom2_ptr + ptrs, cast_rne(m2, mom2_ptr.dtype.element_ty), mask=dm)
        r = (m1 / bias_c1) / (tl.sqrt(m2 / bias_c2) + eps) + weight_decay * w
    if TRUST:
        r = tl.where(dm, r, 0.0)
        w_norm = tl.sqrt(tl.sum(w * w, axis=1))
        r_norm = tl.sqrt(tl.sum(r * r, axis=1))
        ratio = tl.where(r_norm > 0, w_norm / tl.where(r_norm > 0, r_norm, 1.0), 0.0)
        return w - (lr * ratio)[:, None] * r
    return w - lr * r


@triton.jit
def _lars_sgd_update(
    w,
    g,
    mom1_ptr,  # [sum(E_t * D_t)] fp32 momentum per element
    ptrs,  # [RUNS, BLOCK_D] the rows' elements
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    lr,
    eta,
    momentum,
    weight_decay,
):
    """``lr' = lr * eta * ||w|| / (||g|| + weight_decay * ||w||)`` per row (0 where the
    denominator is 0), ``m = momentum * m + lr' * (g + weight_decay * w)``, ``w - m``
    (``optim.LarsSGD``)."""
    w_norm = tl.sqrt(tl.sum(w * w, axis=1))
    denom = tl.sqrt(tl.sum(g * g, axis=1)) + weight_decay * w_norm
    rate = tl.where(denom > 0, lr * eta * w_norm / tl.where(denom > 0, denom, 1.0), 0.0)
    m = momentum * tl.load(mom1_ptr + ptrs, mask=dm, other=0.0).to(tl.float32) + rate[:, None] * (
        g + weight_decay * w
    )
    tl.store(mom1_ptr + ptrs, cast_rne(m, mom1_ptr.dtype.element_ty), mask=dm)
    return w - m


@triton.jit
def _ftrl_update(
    w,
    g,
    mom1_ptr,  # [sum(E_t * D_t)] fp32 z per element
    mom2_ptr,  # [sum(E_t * D_t)] fp32 n per element
    ptrs,  # [RUNS, BLOCK_D] the rows' elements
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    lr,  # alpha
    beta,
    l1,
    l2,
):
    """FTRL-Proximal (``optim.FTRL``): ``n' = n + g^2``, ``z += g - (sqrt(n') - sqrt(n)) /
    lr * w``, ``w = 0`` where ``|z| <= l1``, else ``-(z - sign(z) l1) / ((beta + sqrt(n')) /
    lr + l2)``."""
    z = tl.load(mom1_ptr + ptrs, mask=dm, other=0.0).to(tl.float32)
    n = tl.load(mom2_ptr + ptrs, mask=dm, other=0.0).to(tl.float32)
    n_new = n + g * g
    z = z + g - (tl.sqrt(n_new) - tl.sqrt(n)) / lr * w
    tl.store(mom1_ptr + ptrs, cast_rne(z, mom1_ptr.dtype.element_ty), mask=dm)
    tl.store(mom2_ptr + ptrs, cast_rne(n_new, mom2_ptr.dtype.element_ty), mask=dm)
    denom = (beta + tl.sqrt(n_new)) / lr + l2
    shrunk = tl.where(z < 0, z + l1, z - l1)
    keep = tl.abs(z) > l1
    return tl.where(keep, -shrunk / tl.where(keep, denom, 1.0), 0.0)


@triton.jit
def _rowwise_rmsprop_ar_update(
    w,
    g,
    m_row,  # [RUNS] fp32 the rows' v, loaded before the gradient loop
    mom1_ptr,  # [sum(E_t)] v per row
    mom2_ptr,  # [sum(E_t)] the step of each row's last update (0: none yet)
    key,  # [RUNS] linear row of each run
    live,  # [RUNS] runs that update a row
    D,  # [RUNS] the rows' D
    lr,
    eps,
    t,  # the step count
    ar_alpha,
    ema_beta,
    min_shrinkage,
):
    """``v = ema_beta v + (1 - ema_beta) mean(g^2)``, ``lambda = clamp(lr ar_alpha (t - p),
    0, 1)`` (gap 1 where p = 0), ``w = max(min_shrinkage, 1 - lambda) w - lr / (sqrt(v) + eps)
    g``, ``p = t`` (``optim.RowWiseRMSpropAR``)."""
    v = ema_beta * m_row + (1.0 - ema_beta) * tl.sum(g * g, axis=1) / D.to(tl.float32)
    tl.store(mom1_ptr + key, cast_rne(v, mom1_ptr.dtype.element_ty), mask=live)
    last = tl.load(mom2_ptr + key, mask=live, other=0.0).to(tl.float32)
    tf = t.to(tl.float32)
    gap = tl.where(last == 0.0, 1.0, tf - last)
    decay = tl.minimum(tl.maximum(lr * ar_alpha * gap, 0.0), 1.0)
    keep = tl.maximum(min_shrinkage, 1.0 - decay)
    tl.store(mom2_ptr + key, cast_rne(last * 0.0 + tf, mom2_ptr.dtype.element_ty), mask=live)
    rate = lr / (tl.sqrt(v) + eps)
    return keep[:, None] * w - rate[:, None] * g


@triton.jit
def _pow_pos(x, y):
    """``x ** y`` for x > 0 (1 where y = 0)."""
    return tl.where(y == 0.0, 1.0, tl.exp2(y * tl.log2(tl.where(x > 0.0, x, 1.0))))


@triton.jit
def _rowwise_adagrad_with_counter_update(
    w,
    g,
    m_row,  # [RUNS] fp32 the rows' accumulators, loaded before the gradient loop
    mom1_ptr,  # [sum(E_t)] accumulator per row
    prev_ptr,  # [sum(E_t)] fp32 the step of each row's last update (0: none yet)
    count_ptr,  # [sum(E_t)] fp32 each row's decayed occurrence count
    key,  # [RUNS] linear row of each run
    live,  # [RUNS] runs that update a row
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    D,  # [RUNS] the rows' D
    lr,
    eps,
    weight_decay,
    t,  # the step count (this update included)
    hyper_ptr,  # its COUNTER_FIELDS after optim.HYPER_FIELDS
):
    """Rowwise Adagrad with counter (``optim.RowWiseAdagradWithCounter``, FBGEMM's COUNTER /
    COWCLIP): the counter, ``m += mean(g'^2)``, the step size and decay of the mode, ``w = c w
    - step g`` (``reference/counter.py``; the modes are values of the hyper tensor, picked
    with ``tl.where``)."""
    cowclip = tl.load(hyper_ptr + _C_COWCLIP)
    decay = tl.load(hyper_ptr + _C_DECAY)  # none, l2, decoupled, adagradw: 0..3
    lr_mode = tl.load(hyper_ptr + _C_LR_MODE)  # equal, increase, decrease, counter_sgd: 0..3
    halflife = tl.load(hyper_ptr + _C_HALFLIFE)
    adj_iter = tl.load(hyper_ptr + _C_ADJ_ITER)
    ub = tl.load(hyper_ptr + _C_UB)
    max_counter = tl.load(hyper_ptr + _C_MAX_COUNTER)
    tf = t.to(tl.float32)
    prev = tl.load(prev_ptr + key, mask=live, other=0.0)
    n = tl.load(count_ptr + key, mask=live, other=0.0)
    gap = tl.where(prev == 0.0, 1.0, tf - prev)  # steps since the row's last update
    decayed = 1.0 + tl.exp(-gap * tl.load(hyper_ptr + _C_DECAY_RATE)) * n
    n = tl.where(halflife > 0, decayed, tl.where(halflife == 0, 1.0, n + 1.0))
    freq = halflife / n
    g_wd = tl.where(dm, tl.where(decay == 1.0, g + weight_decay * w, g), 0.0)
    g_sq = tl.sum(g_wd * g_wd, axis=1)
    m = m_row + g_sq / D.to(tl.float32)
    tl.store(mom1_ptr + key, cast_rne(m, mom1_ptr.dtype.element_ty), mask=live)
    tl.store(prev_ptr + key, prev * 0.0 + tf, mask=live)
    tl.store(count_ptr + key, n, mask=live)
    denom = tl.sqrt(m) + eps
    rate = lr / denom
    enabled = (adj_iter <= 0.0) | (tf > adj_iter)
    # COUNTER: rows above the tail-id threshold scale their rate by learning_rate_mode
    threshold = tl.load(hyper_ptr + _C_THRESHOLD)
    threshold = tl.where(tl.load(hyper_ptr + _C_IS_RATIO) != 0.0,
                         tl.floor(threshold * max_counter), threshold)
    up = tl.minimum(tl.maximum(_pow_pos(max_counter / (n + 1.0), ub), 1.0), 10.0)
    down = tl.minimum(tl.maximum(_pow_pos((n + 1.0) / max_counter, ub), 0.1), 1.0)
    scaled = tl.where(lr_mode == 1.0, rate * up, tl.where(
        lr_mode == 2.0, rate * down, lr / (tl.sqrt(ub * n) + eps)))
    step = tl.where(enabled & (lr_mode != 0.0), tl.where(n > threshold, scaled, rate), rate)
    base = 1.0 - weight_decay * lr
    lazy = _pow_pos(base, tl.minimum(gap, tf - adj_iter) - 1.0)  # the decay missed, paid now
    adagradw = enabled & (decay == 3.0)
    aw_step = tl.where(halflife == -1.0, rate * tl.sqrt(n), tl.where(
        halflife == -2.0, tl.minimum(lr * n, ub) / denom, step))
    corr = tl.where(adagradw, lazy * base, tl.where(
        enabled & (decay == 2.0), 1.0 - freq * weight_decay * lr, tl.where(
            enabled & (decay == 1.0), 1.0 - freq * weight_decay * rate, 1.0)))
    step = tl.where(adagradw, aw_step * lazy, step)
    # COWCLIP: the step clipped to n max(coef ||w||, lower_bound) / ||g'|| (0 / 0: 1)
    w_norm = tl.sqrt(tl.sum(w * w, axis=1))
    clip = n * tl.maximum(w_norm * tl.load(hyper_ptr + _C_COEF), tl.load(hyper_ptr + _C_LOWER))
    ratio = clip / tl.sqrt(g_sq)
    cw_step = tl.where(ratio < 1.0, ratio, 1.0) * rate
    cw_corr = tl.where(decay == 2.0, base, tl.where(decay == 1.0, 1.0 - weight_decay * cw_step,
                                                    1.0))
    step = tl.where(cowclip != 0.0, cw_step, step)
    corr = tl.where(cowclip != 0.0, cw_corr, corr)
    return corr[:, None] * w - step[:, None] * g


@triton.jit
def optimizer_update(
    w,  # [RUNS, BLOCK_D] fp32 the rows (masked columns 0)
    g,  # [RUNS, BLOCK_D] fp32 their gradients summed over the batch
    m_row,  # [RUNS] fp32 the rows' state 0 where it is per row (ROW_STATE), else unused
    key,  # [RUNS] int64 linear row of each run
    live,  # [RUNS] runs that update a row
    ptrs,  # [RUNS, BLOCK_D] the rows' elements (of the weights and per-element states)
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    D,  # [RUNS] the rows' D
    mom1_ptr,  # state 0 (momentum1), fp32
    mom2_ptr,  # state 1 (momentum2, or rowwise_adagrad_with_counter's prev_iter), fp32
    mom3_ptr,  # state 2 (rowwise_adagrad_with_counter's row_counter), fp32
    lr,  # load_hyper's values from here on
    eps,
    weight_decay,
    beta1,
    beta2,
    bias_c1,
    bias_c2,
    t,  # the step count (this update included)
    hyper_ptr,  # [len(optim.HYPER_FIELDS)] fp32: the slots load_hyper does not read
    OPTIMIZER: tl.constexpr,  # kernel code (optim.REGISTRY)
    WD_DECOUPLED: tl.constexpr,  # rowwise adagrad: decoupled weight decay, else L2
):
    """The new rows ([RUNS, BLOCK_D] fp32) by the optimizer of kernel code OPTIMIZER, its
    states updated in place: its helper, given what it reads."""
    if OPTIMIZER == _SGD:
        w = _sgd_update(w, g, lr)
    elif OPTIMIZER == _ADAGRAD:
        w = _adagrad_update(w, g, mom1_ptr, ptrs, dm, lr, eps)
    elif OPTIMIZER == _ROWWISE_ADAGRAD:
        w = _rowwise_adagrad_update(
            w, g, m_row, mom1_ptr, key, live, dm, D, lr, eps, weight_decay, WD_DECOUPLED
        )
    elif OPTIMIZER == _EMAINPLACE_ROWWISE_ADAGRAD:  # its moving average is the module's
        w = _rowwise_adagrad_update(
            w, g, m_row, mom1_ptr, key, live, dm, D, lr, eps, weight_decay, WD_DECOUPLED
        )
    elif OPTIMIZER == _ENSEMBLE_ROWWISE_ADAGRAD:  # its moving average and swap: the module's
        w = _rowwise_adagrad_update(
            w, g, m_row, mom1_ptr, key, live, dm, D, lr, eps, weight_decay, WD_DECOUPLED
        )
    elif OPTIMIZER == _ROWWISE_ADAGRAD_GLOBAL_DECAY:  # decoupled; the catch-up: the module's
        w = _rowwise_adagrad_update(
            w, g, m_row, mom1_ptr, key, live, dm, D, lr, eps, weight_decay, True
        )
    elif OPTIMIZER == _ADAM:
        w = _adam_update(
            w, g, mom1_ptr, mom2_ptr, ptrs, key, live, dm, D, lr, eps, beta1, beta2,
            weight_decay, bias_c1, bias_c2, False, False,
        )
    elif OPTIMIZER == _PARTIAL_ROWWISE_ADAM:
        w = _adam_update(
            w, g, mom1_ptr, mom2_ptr, ptrs, key, live, dm, D, lr, eps, beta1, beta2,
            weight_decay, bias_c1, bias_c2, True, False,
        )
    elif OPTIMIZER == _LAMB:
        w = _adam_update(
            w, g, mom1_ptr, mom2_ptr, ptrs, key, live, dm, D, lr, eps, beta1, beta2,
            weight_decay, bias_c1, bias_c2, False, True,
        )
    elif OPTIMIZER == _PARTIAL_ROWWISE_LAMB:
        w = _adam_update(
            w, g, mom1_ptr, mom2_ptr, ptrs, key, live, dm, D, lr, eps, beta1, beta2,
            weight_decay, bias_c1, bias_c2, True, True,
        )
    elif OPTIMIZER == _LARS_SGD:
        eta = tl.load(hyper_ptr + _ETA)
        momentum = tl.load(hyper_ptr + _MOMENTUM)
        w = _lars_sgd_update(w, g, mom1_ptr, ptrs, dm, lr, eta, momentum, weight_decay)
    elif OPTIMIZER == _FTRL:
        beta = tl.load(hyper_ptr + _BETA)
        l1 = tl.load(hyper_ptr + _L1)
        l2 = tl.load(hyper_ptr + _L2)
        w = _ftrl_update(w, g, mom1_ptr, mom2_ptr, ptrs, dm, lr, beta, l1, l2)
    elif OPTIMIZER == _ROWWISE_RMSPROP_AR:
        ar_alpha = tl.load(hyper_ptr + _AR_ALPHA)
        ema_beta = tl.load(hyper_ptr + _EMA_BETA)
        min_shrinkage = tl.load(hyper_ptr + _MIN_SHRINKAGE)
        w = _rowwise_rmsprop_ar_update(w, g, m_row, mom1_ptr, mom2_ptr, key, live, D, lr, eps,
                                       t, ar_alpha, ema_beta, min_shrinkage)
    elif OPTIMIZER == _ROWWISE_ADAGRAD_WITH_COUNTER:
        w = _rowwise_adagrad_with_counter_update(w, g, m_row, mom1_ptr, mom2_ptr, mom3_ptr, key,
                                                 live, dm, D, lr, eps, weight_decay, t,
                                                 hyper_ptr)
    else:
        tl.static_assert(False, "unknown optimizer code")
    return w


@triton.jit
def load_hyper(hyper_ptr, step_ptr):
    """The fused update's per-step values, from device memory (a captured step replays them
    fresh): ``(lr, eps, weight_decay, t, beta1, beta2, bias_c1, bias_c2)``, t the step count
    (this update included) and ``bias_c = 1 - beta^t``. An optimizer that reads none of the
    betas leaves their loads unused, and the compiler drops them."""
    lr = tl.load(hyper_ptr)
    eps = tl.load(hyper_ptr + 1)
    weight_decay = tl.load(hyper_ptr + 4)
    t = tl.load(step_ptr)
    beta1 = tl.load(hyper_ptr + 2)
    beta2 = tl.load(hyper_ptr + 3)
    bias_c1 = _one_minus_pow(tl.load(hyper_ptr + 5), t)
    bias_c2 = _one_minus_pow(tl.load(hyper_ptr + 6), t)
    return lr, eps, weight_decay, t, beta1, beta2, bias_c1, bias_c2


@triton.jit
def _one_minus_pow(log_b, t):
    """``1 - b^t`` (Adam's bias correction) from ``log(b)`` and the step t >= 1, in fp32
    without the cancellation of ``1 - exp(x)`` near x = 0: ``-expm1(x)``, x = t log(b), by its
    Taylor series while |x| < 0.5 (truncation < 1e-8 relative), else ``1 - exp(x)`` (exact
    enough there; log(b) = -inf, b = 0, gives 1)."""
    x = t.to(tl.float32) * log_b
    s = 1.0 + x * (1.0 / 8.0)
    s = 1.0 + x * (1.0 / 7.0) * s
    s = 1.0 + x * (1.0 / 6.0) * s
    s = 1.0 + x * (1.0 / 5.0) * s
    s = 1.0 + x * (1.0 / 4.0) * s
    s = 1.0 + x * (1.0 / 3.0) * s
    s = 1.0 + x * (1.0 / 2.0) * s
    return tl.where(x > -0.5, -(x * s), 1.0 - tl.exp(x))


@triton.jit
def store_rows(
    weights_ptr,  # [sum(E_t * D_t)] flat weights
    ptrs,  # [RUNS, BLOCK_D] the rows' elements
    dm,  # [RUNS, BLOCK_D] live rows' columns < D
    w,  # [RUNS, BLOCK_D] fp32 new rows
    key,  # [RUNS] linear row of each run (the rounding noise's counter)
    seed,
    t,  # the step count (the rounding seed's clock)
    STOCHASTIC: tl.constexpr,
    MANTISSA: tl.constexpr,
    MIN_EXP: tl.constexpr,
    RUNS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Round the new rows to the weights' dtype (stochastically, or to nearest) and store."""
    if STOCHASTIC:
        # add uniform noise of one ulp of the target dtype, then round toward zero
        bits = w.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        ulp_exp = tl.maximum(tl.maximum(exp, MIN_EXP) - MANTISSA, -126)
        ulp = ((ulp_exp + 127) << 23).to(tl.float32, bitcast=True)
        step_seed = (seed.to(tl.int64) * 1000003 + t) % 2147483647
        noise = _uniform16(step_seed, key, RUNS, BLOCK_D) * ulp
        w = tl.where(w < 0, w - noise, w + noise)
        w_new = cast_rtz(w, weights_ptr.dtype.element_ty)
    else:
        w_new = cast_rne(w, weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + ptrs, w_new, mask=dm)


@triton.jit
def _uniform16(seed, key, RUNS: tl.constexpr, BLOCK_D: tl.constexpr):
    """[RUNS, BLOCK_D] uniform in [0, 1) with 16-bit resolution (finer than the 13 / 16 bits
    that rounding fp32 to fp16 / bf16 drops, so the rounding stays exactly unbiased): one
    Philox call gives 128 bits, enough for 8 columns, a fraction of tl.rand's cost."""
    if BLOCK_D >= 8:
        off = key[:, None] * (BLOCK_D // 8) + tl.arange(0, BLOCK_D // 8)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, off.to(tl.int32))
        lo = tl.join(tl.join(r0 & 0xFFFF, r0 >> 16), tl.join(r1 & 0xFFFF, r1 >> 16))
        hi = tl.join(tl.join(r2 & 0xFFFF, r2 >> 16), tl.join(r3 & 0xFFFF, r3 >> 16))
        u = tl.reshape(tl.join(lo, hi), [RUNS, BLOCK_D])
        return (u & 0xFFFF).to(tl.float32) * (1.0 / 65536.0)
    else:
        offs = key[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        return tl.rand(seed, offs.to(tl.int32))


def half_format(dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, smallest normal exponent) of a weight dtype, for stochastic rounding."""
    return {torch.float16: (10, -14), torch.bfloat16: (7, -126)}.get(dtype, (23, -126))
