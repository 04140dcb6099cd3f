"""TBE lookup op: validate a batch, then run forward/backward on a backend of the registry
(``ops/backends/``: Triton, the fast CPU path, the reference), asking its capabilities.

Shapes: T features, B bags per feature, N ids. ``indices`` [N], ``offsets`` [T*B+1]
(feature-major), ``per_sample_weights`` [N] or None; output ``[B, sum(D)]``, or without
pooling (``pooling=PoolingMode.NONE``, sequence embeddings) ``[N, max_D]``: id i's row in row
i's first D_f columns, zeros after them (and in padding rows).
"""

import collections
import threading
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from fbtriton_dist import graphs, knobs, optim
from fbtriton_dist.host_flags import HostFlags
from fbtriton_dist.ops import backends, cpu_native, tbe_ahead
from fbtriton_dist.pooling import PoolingMode

Backend = str
"""A resolved backend's name (``backends.names()``); ``backends.get`` gives its object."""

BoundsCheck = Literal["error", "warn", "ignore"]


@dataclass(kw_only=True, frozen=True, eq=False)
class TBELayout:
    """Where each feature's table lives in the flat weights, and where it writes its output."""

    w_offsets: torch.Tensor
    """[T] int64: element offset of feature f's table in the flat weights."""
    dims: torch.Tensor
    """[T] int64: embedding dim D of feature f's table."""
    row_offsets: torch.Tensor
    """[T] int64: first linear row of feature f's table (rows of all tables back to back)."""
    D_offsets: torch.Tensor
    """[T + 1] int64: first output column of feature f."""
    rows: torch.Tensor
    """[T] int64: number of rows E of feature f's table (the bounds check)."""
    max_D: int
    total_D: int
    feature_table_map: list[int]
    table_rows: list[int] = field(default_factory=list)
    """E of each table (not feature): shapes of per-table gradients."""
    table_names: list[str] = field(default_factory=list)
    feature_names: list[str] = field(default_factory=list)
    """Name of each feature (error messages), or empty."""
    row_align: int = 1
    """Every row starts at a multiple of this many elements (a power of two dividing each
    table's D and its offset in ``weights``, at most 16 bytes): the forward kernel then loads
    rows in vectors of that width."""

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    @property
    def num_rows(self) -> int | None:
        """Rows of all tables back to back: the linear key of a dropped id (None: unknown)."""
        return sum(self.table_rows) if self.table_rows else None


@dataclass(kw_only=True, eq=False)
class FusedOptimizer:
    """What backward needs to update rows in place: the optimizer and its state. Everything
    that changes between steps lives in device memory, so that a CUDA graph of a training
    step replays correctly."""

    optimizer: optim.Optimizer
    momentum1: torch.Tensor | None
    momentum2: torch.Tensor | None
    step: torch.Tensor
    """[1] int64 on the weights' device: fused updates taken so far. The backward adds one
    on the device (no host sync) and reads the new value t there: Adam's bias corrections
    ``1 - beta^t``, the stochastic-rounding seed ``reference.step_seed(seed, t)``."""
    stochastic_rounding: bool
    seed: int
    """The module's seed (fixed); each update's rounding seed derives from it and t."""
    max_gradient: float | None = None
    """Gradient clipping (FBGEMM's ``gradient_clipping`` / ``max_gradient``): each element
    of ``grad_output`` is clamped to ``[-max_gradient, max_gradient]`` before the rows'
    gradients are formed (before per-sample weights and mean pooling scale it, as FBGEMM's CPU
    TBE does); None: no clipping. The per-sample weight gradient is not clipped."""
    hyper: torch.Tensor | None = None
    """[12] fp32 on the weights' device, ``optim.hyper_parameters(optimizer)`` (kept in place
    by the module, so a captured step sees a new learning rate); None: built per backward
    (a host-to-device copy, which a CUDA graph cannot capture)."""
    counters: dict[str, torch.Tensor] | None = None
    """rowwise_adagrad_with_counter's ``prev_iter``, ``row_counter`` ([rows] fp32) and
    ``max_counter`` ([1] fp32), and where set ``row_counter_max`` ([1] fp32: the largest row
    counter its refresh takes instead of the module's own), passed to the backend's backward
    by name; None otherwise."""


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on the current stream of ``device``?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_capturable(
    backend: Backend, bounds_check: BoundsCheck, layout: TBELayout, monitor
) -> None:
    """Refuse, naming the option, what a CUDA graph capture cannot record: work that reads
    device values on the host."""
    if not backends.capabilities(backend).capturable or layout.num_rows is None:
        able = [n for n in backends.names() if backends.capabilities(n).capturable]
        raise RuntimeError(
            f"TBE lookup under CUDA graph capture: backend={backend!r} validates and reduces on "
            "the host (device-to-host reads), which a graph cannot record; use backend="
            + " or ".join(repr(n) for n in able)
        )
    if bounds_check == "error":
        raise RuntimeError(
            "TBE lookup under CUDA graph capture: bounds_check='error' reads the kernel's "
            "bad-id count on the host after every lookup, which a graph cannot record; use "
            "bounds_check='warn' (ids are dropped and counted on the device over replays, "
            "reported by poll_bounds_check()) or 'ignore'"
        )
    if bounds_check == "warn" and monitor is None:
        raise RuntimeError(
            "TBE lookup under CUDA graph capture: bounds_check='warn' needs a BoundsMonitor "
            "(the module's) to count dropped ids over replays; pass monitor= or use 'ignore'"
        )


def check_inputs(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    layout: TBELayout,
    bounds_check: BoundsCheck,
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate one batch (two device round trips at most). Returns the batch to look up: the
    same tensors, or, with ``bounds_check="warn"``, copies without the out-of-range ids.
    ``native``: CPU tensors are first checked in one pass of the fast CPU path's native
    kernel (``cpu_native.check``); only a batch it flags takes the checks that name the value.
    """
    check_shapes(indices, offsets, per_sample_weights, layout)
    if bounds_check == "ignore":
        return indices, offsets, per_sample_weights
    if bounds_check not in ("error", "warn"):
        raise ValueError(
            f"bounds_check: expected one of ['error', 'warn', 'ignore'], got {bounds_check!r}"
        )
    if native and cpu_native.check(
        indices, offsets, layout.rows, per_sample_weights if bounds_check == "error" else None
    ) == 0:
        return indices, offsets, per_sample_weights
    return _find_bad_input(indices, offsets, per_sample_weights, layout, bounds_check)


def check_shapes(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    layout: TBELayout,
) -> None:
    """The checks that need no look at the values (no device work)."""
    T = layout.num_features
    for name, t in (("indices", indices), ("offsets", offsets)):
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"{name}: expected a 1-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}"
            )
    if (offsets.numel() - 1) % T != 0 or offsets.numel() < 1:
        raise ValueError(
            f"offsets: expected length T*B+1 with T={T} features, got {offsets.numel()} "
            f"({offsets.numel() - 1} is not a multiple of {T})"
        )
    if per_sample_weights is not None:
        if per_sample_weights.shape != indices.shape or not per_sample_weights.is_floating_point():
            raise ValueError(
                f"per_sample_weights: expected a float tensor of shape {tuple(indices.shape)} "
                f"(one per id), got {per_sample_weights.dtype} {tuple(per_sample_weights.shape)}"
            )


def _find_bad_input(indices, offsets, per_sample_weights, layout, bounds_check):
    """The value checks on the device, two round trips (the offsets, then the ids): raise,
    or warn and drop bad ids. The ids are checked against each feature's row count without a
    search per id; only a batch with bad ids pays for finding each one's bag."""
    T = layout.num_features
    N = indices.numel()
    B = (offsets.numel() - 1) // T
    decreasing = offsets[1:] < offsets[:-1]
    flags = torch.stack([offsets[0] != 0, offsets[-1] != N, decreasing.any()]).tolist()
    if flags[0] or flags[1]:
        raise ValueError(
            f"offsets: expected offsets[0] == 0 and offsets[-1] == len(indices) == {N}, got "
            f"offsets[0]={int(offsets[0])}, offsets[-1]={int(offsets[-1])}"
        )
    if flags[2]:
        i = int(torch.nonzero(decreasing)[0])
        raise ValueError(
            f"offsets: expected non-decreasing values, got offsets[{i}]={int(offsets[i])} > "
            f"offsets[{i + 1}]={int(offsets[i + 1])}"
        )
    bad = _any_bad_id(indices, offsets, layout) if B else indices.new_zeros((), dtype=torch.bool)
    # under "error", a NaN/inf per-sample weight is refused (it would poison the rows)
    nonfinite = (
        ~torch.isfinite(per_sample_weights)
        if bounds_check == "error" and per_sample_weights is not None
        else torch.zeros(0, dtype=torch.bool, device=indices.device)
    )
    flags = [False, False, False, *torch.stack([bad, nonfinite.any()]).tolist()]
    if not (flags[3] or flags[4]):
        return indices, offsets, per_sample_weights
    bags, bad = _bad_ids(indices, offsets, layout)
    if flags[4]:
        p = int(torch.nonzero(nonfinite)[0])
        f, b = divmod(int(bags[p]), B)
        t = layout.feature_table_map[f]
        name = layout.table_names[t] if layout.table_names else f"table_{t}"
        raise ValueError(
            f"per_sample_weights[{p}] = {float(per_sample_weights[p])} (feature "
            f"{_feature_name(layout, f)} of table '{name}', sample {b}): expected finite weights"
        )
    if not flags[3]:
        return indices, offsets, per_sample_weights

    where = torch.nonzero(bad).flatten()
    p = int(where[0])
    f, b = divmod(int(bags[p]), B)
    t = layout.feature_table_map[f]
    name = layout.table_names[t] if layout.table_names else f"table_{t}"
    what = (
        f"id {int(indices[p])} at indices[{p}] (feature {_feature_name(layout, f)}, sample {b}) "
        "is out of range for "
        f"table '{name}' with {int(layout.rows[f])} rows: expected 0 <= id < {int(layout.rows[f])}"
    )
    if bounds_check == "error":
        raise IndexError(what)
    warnings.warn(f"dropping {where.numel()} out-of-range ids; first: {what}", stacklevel=3)
    return _kept_batch(indices, offsets, per_sample_weights, bags, ~bad)


def _kept_batch(indices, offsets, per_sample_weights, bags, keep):
    """The batch of the ids ``keep`` [N] bool marks (``bags`` [N]: each id's bag)."""
    kept_per_bag = torch.zeros(offsets.numel() - 1, dtype=torch.int64, device=indices.device)
    kept_per_bag.index_add_(0, bags, keep.to(torch.int64))
    new_offsets = torch.zeros_like(offsets)
    new_offsets[1:] = torch.cumsum(kept_per_bag, 0)
    psw = per_sample_weights[keep] if per_sample_weights is not None else None
    return indices[keep], new_offsets, psw


def _any_bad_id(indices, offsets, layout) -> torch.Tensor:
    """[] bool: is some id outside its feature's rows? For well-formed offsets (feature f's
    ids are ``offsets[f * B]`` .. ``offsets[(f + 1) * B]``): each feature's smallest and
    largest id (a few features), or each id against its feature's bound (many)."""
    T = layout.num_features
    B = (offsets.numel() - 1) // T
    if T <= 64 and indices.device.type == "cpu":
        bounds = offsets[::B].tolist()
        used = [f for f in range(T) if bounds[f + 1] > bounds[f]]
        if not used:
            return torch.zeros((), dtype=torch.bool)
        lo_hi = [torch.aminmax(indices[bounds[f] : bounds[f + 1]]) for f in used]
        rows = layout.rows[used]
        lo, hi = torch.stack([t[0] for t in lo_hi]), torch.stack([t[1] for t in lo_hi])
        return ((lo < 0) | (hi.to(torch.int64) >= rows)).any()
    bound = torch.repeat_interleave(layout.rows, offsets[::B].diff(), output_size=indices.numel())
    return ((indices < 0) | (indices.to(torch.int64) >= bound)).any()


def _bad_ids(indices, offsets, layout):
    """([N] bag of each id, [N] bool: the id is out of its table's range), on the device."""
    T = layout.num_features
    B = (offsets.numel() - 1) // T
    pos = torch.arange(indices.numel(), device=indices.device, dtype=offsets.dtype)
    bags = torch.searchsorted(offsets[1:], pos, right=True).clamp(max=max(T * B - 1, 0))
    rows = layout.rows[bags // max(B, 1)] if B else torch.zeros_like(indices, dtype=torch.int64)
    return bags, (indices < 0) | (indices.to(torch.int64) >= rows)


def _feature_name(layout: TBELayout, f: int) -> str:
    """``'name'`` of feature ``f`` where the layout knows it, else its index."""
    return repr(layout.feature_names[f]) if layout.feature_names else str(f)


_NUM_INPUTS = 16  # _TBELookup.forward's inputs before *grad_targets


@dataclass(kw_only=True, eq=False)
class _InKernelCheck:
    """A lookup's in-kernel bounds check: what its forward is asked, what the lookup learns."""

    weights: bool = False
    """The forward counts non-finite per-sample weights too (``weights_check_in_kernel``)."""
    dropped: int = 0
    """Ids the forward dropped (``err[0]``, set once the lookup reads ``err``): a backward
    that re-reads the batch (no keys mark them) leaves them out."""


_HOST_ERR = threading.local()


def _host_err() -> torch.Tensor:
    """A zeroed ``err`` for a lookup on CPU tensors, one per thread: read before the lookup
    returns and kept by nothing, so not allocated per lookup (zeroing costs less; a fresh one
    per call also made large forwards slower in some runs, docs/results/
    tbe-cpu-host-overhead-2026-12-05.md)."""
    err = getattr(_HOST_ERR, "err", None)
    if err is None:
        err = _HOST_ERR.err = torch.zeros(3, dtype=torch.int64)
        return err
    return err.zero_()


class _TBELookup(torch.autograd.Function):
    """Glue: forward = lookup; backward = row-reduced gradient (or fused update in place)."""

    @staticmethod
    def forward(
        ctx,
        weights,
        anchor,
        per_sample_weights,
        indices,
        offsets,
        layout,
        pooling,
        output_dtype,
        backend,
        fused,
        sparse,
        table_offsets,
        err,
        training,
        plan_ahead,
        check,
        *grad_targets,
    ):
        ctx.weights = weights
        ctx.args = (layout, pooling, backend, fused, sparse, table_offsets)
        ctx.num_targets = len(grad_targets)
        impl = backends.get(backend)
        linearize = training and layout.num_rows is not None
        ctx.plan, ctx.ahead_check = None, None
        ahead = linearize and plan_ahead and impl.capabilities.plan_ahead
        # only a backend that counts non-finite weights itself is asked to (weights_check)
        extra = {"check_weights": True} if check is not None and check.weights else {}
        if ahead:
            linearize = False  # the side stream writes the keys
            fork = tbe_ahead.fork(weights.device)  # the side stream starts here
        result = impl.tbe_forward(
            weights,
            layout.w_offsets,
            layout.dims,
            layout.D_offsets,
            indices,
            offsets,
            per_sample_weights,
            pooling=pooling,
            max_D=layout.max_D,
            total_D=layout.total_D,
            output_dtype=output_dtype,
            rows=layout.rows,
            row_offsets=layout.row_offsets,
            num_rows=layout.num_rows or 0,
            err=err,
            linearize=linearize,
            row_align=layout.row_align,
            **extra,
        )
        out, saved = result, (None, None, None)
        if isinstance(result, tuple):
            out, saved = result[0], result[1:]
        # a backward that re-reads the batch (no keys mark the ids the forward dropped) learns
        # from the lookup's read of err whether there are any: no host read here
        ctx.check = check if training and saved[0] is None and not ahead else None
        if ahead:  # queued after the forward (tbe_ahead's comment says why)
            plan, done, consumed = tbe_ahead.plan_ahead(
                impl, layout, pooling, indices, offsets, per_sample_weights,
                check=err is not None, fork=fork)
            ctx.plan, ctx.ahead_check = (plan, done), err is not None
        if ctx.plan is not None and ctx.plan[1] is not None:
            main = torch.cuda.current_stream(weights.device)
            main.wait_event(consumed)  # the side stream no longer reads the batch
            if capturing(weights.device) and not graphs.defer_join(weights.device, done):
                main.wait_event(done)  # a capture must end joined; no scope to do it later
        ctx.save_for_backward(indices, offsets, per_sample_weights, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        indices, offsets, per_sample_weights, keys, bag_ids, counts = ctx.saved_tensors
        layout, pooling, backend, fused, sparse, table_offsets = ctx.args
        weights = ctx.weights
        keep = None
        if ctx.check is not None and ctx.check.dropped:
            # the forward dropped ids: the backward gets the batch without them, and its
            # per-sample weight gradient is scattered back (a host read of err, as the
            # lookup's; never under capture: such a backend is not capturable)
            bags, bad = _bad_ids(indices, offsets, layout)
            keep = ~bad
            indices, offsets, per_sample_weights = _kept_batch(
                indices, offsets, per_sample_weights, bags, keep)
            if pooling == PoolingMode.NONE:  # a gradient row per id kept
                grad_output = grad_output[keep]
        if capturing(weights.device) and (not fused or ctx.needs_input_grad[2]):
            raise RuntimeError(
                "TBE backward under CUDA graph capture: "
                + (
                    "the per_sample_weights gradient is computed with host reads"
                    if fused
                    else "without a fused optimizer, the weight gradient is sized on the host "
                    "(one device-to-host read of the unique-row count)"
                )
                + ", which a graph cannot record; capture a fused optimizer's step with "
                "per_sample_weights that do not require grad"
            )
        grad_psw = None
        if ctx.needs_input_grad[2]:  # before a fused update changes the rows
            grad_psw = _psw_grad_of(backend)(
                grad_output,
                weights.detach(),
                layout.w_offsets,
                layout.dims,
                layout.D_offsets,
                indices,
                offsets,
                pooling=pooling,
            ).to(per_sample_weights.dtype)
            if keep is not None:  # the ids the forward dropped get none
                grad_psw = grad_psw.new_zeros(keep.shape).masked_scatter_(keep, grad_psw)
        impl = backends.get(backend)
        common = dict(
            pooling=pooling,
            max_D=layout.max_D,
            step=fused.step if fused else None,
            hyper=fused.hyper if fused else None,
            momentum1=fused.momentum1 if fused and fused.momentum1.numel() else None,
            momentum2=fused.momentum2 if fused and fused.momentum2.numel() else None,
            stochastic_rounding=fused.stochastic_rounding if fused else False,
            seed=fused.seed if fused else 0,
        )
        if fused is not None and fused.counters:
            common.update(fused.counters)
        if keys is not None:
            common.update(num_rows=layout.num_rows, keys=keys, bag_ids=bag_ids, counts=counts)
        if ctx.plan is not None:  # sorted on the side stream since the forward
            plan, done = ctx.plan
            ctx.plan = None  # freed after this backward, not kept with the graph
            tbe_ahead.use_plan(plan, done, weights.device)
            common.update(plan=plan, num_rows=layout.num_rows)
        elif ctx.ahead_check is not None:  # a retained graph's next backward: plan again
            plan, _, _ = tbe_ahead.plan_ahead(impl, layout, pooling, indices, offsets,
                                              per_sample_weights, check=ctx.ahead_check,
                                              here=True)
            common.update(plan=plan, num_rows=layout.num_rows)
        # rows: for backends whose kernels check each id against its table's rows
        common.update(row_align=layout.row_align, rows=layout.rows)
        if fused is not None and fused.max_gradient is not None:
            grad_output = grad_output.clamp(-fused.max_gradient, fused.max_gradient)
        result = impl.tbe_backward(
            grad_output,
            weights.detach(),
            layout.w_offsets,
            layout.dims,
            layout.row_offsets,
            layout.D_offsets,
            indices,
            offsets,
            per_sample_weights,
            optimizer=fused.optimizer if fused else None,
            **common,
        )
        grad_w, grad_targets = None, [None] * ctx.num_targets
        # fused: the rows and fused.step were updated in place, no weight gradient
        if not fused and ctx.num_targets:
            flat = _rows_to_grad(result, weights, sparse=False)
            grad_targets = [
                flat[a:b].view(E, -1) if ctx.needs_input_grad[_NUM_INPUTS + t] else None
                for t, (a, b, E) in enumerate(
                    zip(table_offsets[:-1], table_offsets[1:], layout.table_rows, strict=True)
                )
            ]
        elif not fused and ctx.needs_input_grad[0]:
            grad_w = _rows_to_grad(result, weights, sparse)
        return (grad_w, None, grad_psw, *[None] * (_NUM_INPUTS - 3), *grad_targets)


def _psw_grad_of(backend: Backend):
    """Who computes the per-sample weights' gradient: the backend's (the reference's unless it
    has its own; host reads, never under a CUDA graph capture)."""
    return backends.get(backend).tbe_per_sample_weights_grad


def _rows_to_grad(result, weights: torch.Tensor, sparse: bool) -> torch.Tensor:
    """Dense (or sparse COO) flat weight gradient from per-row gradients."""
    row_elems, row_dims, row_grads = result
    width = row_grads.shape[1]
    cols = torch.arange(width, device=weights.device)
    mask = cols[None, :] < row_dims[:, None]
    elems = (row_elems[:, None] + cols[None, :])[mask]
    values = row_grads[mask].to(weights.dtype)
    if sparse:
        return torch.sparse_coo_tensor(elems[None, :], values, weights.shape, is_coalesced=True)
    grad = torch.zeros_like(weights)
    grad[elems] = values
    return grad


def tbe_lookup(
    weights: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    layout: TBELayout,
    pooling: int,
    output_dtype: torch.dtype,
    backend: Backend,
    bounds_check: BoundsCheck = "error",
    fused: FusedOptimizer | None = None,
    anchor: torch.Tensor | None = None,
    sparse: bool = False,
    grad_targets: Sequence[torch.Tensor] | None = None,
    table_offsets: Sequence[int] | None = None,
    monitor: "BoundsMonitor | None" = None,
    plan_ahead: bool | None = None,
) -> torch.Tensor:
    """Pooled embedding lookup of T features; ``[B, sum(D)]``.

    Example: two features on tables of D=4 and D=8, B=2::

        out = tbe_lookup(w, indices=[3, 1, 1, 0, 2], offsets=[0, 2, 2, 4, 5], ...)  # [2, 12]

    ``fused`` makes backward update the rows in place (``anchor`` must require grad so that
    autograd reaches it); otherwise ``weights`` gets a dense or ``sparse`` gradient, or, given
    ``grad_targets`` (one ``[E_t, D_t]`` tensor per table) and ``table_offsets`` (where each
    table starts in ``weights``, then the end), each target gets its table's dense gradient.

    Bounds are checked inside the forward kernel: out-of-range ids are dropped and counted.
    ``"error"`` then reads the count (one small device-to-host copy) and raises naming the id;
    ``"warn"`` with a ``monitor`` on CUDA reads it at the next lookup, without a host sync.

    Under CUDA graph capture (``torch.cuda.graph``, ``graphs.GraphedStep``) the lookup and its
    fused backward record no host work: ``"warn"`` counts dropped ids in the monitor's device
    counter over replays (``BoundsMonitor.poll()`` reports them), ``"ignore"`` checks nothing;
    ``"error"``, the reference backend, plain (not fused) gradients and a per-sample-weight
    gradient read device values on the host and raise a ``RuntimeError`` naming the option.

    ``plan_ahead``: make a training batch's backward plan (its sorted row keys) on a side
    stream beside the forward (Triton backend). None: on CUDA unless ``FBTD_TBE_AHEAD=0``;
    True on the CPU makes it in the forward, in order (no stream there).
    """
    backends.get(backend).check_device(weights.device)
    check_shapes(indices, offsets, per_sample_weights, layout)
    if bounds_check not in ("error", "warn", "ignore"):
        raise ValueError(
            f"bounds_check: expected one of ['error', 'warn', 'ignore'], got {bounds_check!r}"
        )
    in_capture = capturing(weights.device)
    if in_capture:
        check_capturable(backend, bounds_check, layout, monitor)
        if fused is not None and fused.counters is not None:
            raise RuntimeError(
                "TBE lookup under CUDA graph capture: rowwise_adagrad_with_counter's backward "
                "copies its parameters from the host at every step; run it without capture"
            )
        if fused is not None and fused.hyper is None:
            raise RuntimeError(
                "TBE lookup under CUDA graph capture: FusedOptimizer.hyper is None (it would be "
                "copied from the host at every backward); pass the device tensor of "
                "optim.hyper_parameters(optimizer), as TableBatchedEmbedding does"
            )
    elif monitor is not None:
        monitor.poll(wait=False)
    targets = tuple(grad_targets) if grad_targets is not None and fused is None else ()
    training = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (weights, anchor, per_sample_weights, *targets)
    )
    err, check = None, None
    caps = backends.capabilities(backend)
    # a warning read at a later lookup (no host sync now): backends without host reads only
    defer = (bounds_check == "warn" and monitor is not None and weights.device.type == "cuda"
             and caps.capturable)
    if not caps.bounds_check_in_kernel or layout.num_rows is None:
        indices, offsets, per_sample_weights = check_inputs(
            indices, offsets, per_sample_weights, layout, bounds_check,
            native=caps.native_input_check,
        )
    elif in_capture and bounds_check == "warn":
        err = monitor.replay_counts(weights.device)  # summed over replays, never zeroed
    elif bounds_check != "ignore":
        # the kernel drops and counts out-of-range ids (and clamps malformed bags) in err
        if weights.device.type == "cpu":
            err = _host_err()
        else:
            err = torch.zeros(3, dtype=torch.int64, device=weights.device)
        check = _InKernelCheck()
        if bounds_check == "error" and per_sample_weights is not None:
            # a non-finite weight marks the batch bad (no extra sync: err is read anyway);
            # _report_bad_input then names it. Counted by the forward where it can.
            check.weights = caps.weights_check_in_kernel
            if not check.weights:
                err[2] = (~torch.isfinite(per_sample_weights)).sum()
        if bounds_check == "warn" and monitor is not None and weights.device.type == "cuda":
            monitor.replay_counts(weights.device)  # allocated now, before any capture
    if plan_ahead is None:
        plan_ahead = knobs.TBE_AHEAD and weights.device.type == "cuda"
    out = _TBELookup.apply(
        weights,
        anchor,
        per_sample_weights,
        indices,
        offsets,
        layout,
        pooling,
        output_dtype,
        backend,
        fused,
        sparse,
        table_offsets,
        err,
        training,
        plan_ahead,
        check,
        *targets,
    )
    if err is not None and not in_capture:
        batch = (indices, offsets, per_sample_weights, layout, bounds_check)
        if defer:
            monitor.watch(err, batch)  # read at the next lookup: no host sync now
        else:
            flags = err.tolist()
            check.dropped = flags[0]
            if any(flags):
                _report_bad_input(batch, flags)
    return out


def tbe_lookup_backward(
    grad_output: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    *,
    layout: TBELayout,
    pooling: int,
    backend: Backend,
    bounds_check: BoundsCheck = "error",
    fused: FusedOptimizer | None = None,
    table_offsets: Sequence[int] | None = None,
    psw_grad: bool = False,
    rows: bool = True,
) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """The backward of a ``tbe_lookup`` of this batch made earlier without autograd (a
    registered op's backward, which keeps no autograd context): ``_TBELookup.backward`` on
    what its forward would have saved. Returns (``[N]`` per-sample weight gradient or None,
    one ``[E_t, D_t]`` weight gradient per table, or None when ``fused`` updated the rows in
    place). Ids that ``bounds_check="warn"`` dropped get no gradient. ``rows=False``: only
    the per-sample weight gradient (rows neither updated nor given a gradient).

    Example: ``g_psw, g_tables = tbe_lookup_backward(grad [B, sum(D)], w, indices, offsets,
    psw, layout=..., pooling=0, backend="reference", table_offsets=[0, 40, 88])``.
    """
    if capturing(weights.device):
        raise RuntimeError(
            "TBE backward under CUDA graph capture: the registered op (torch.compile, FX) "
            "re-reads the batch on the host; capture the eager module instead"
        )
    check_shapes(indices, offsets, per_sample_weights, layout)
    keep = None
    if bounds_check == "warn":  # the forward dropped these ids (and warned)
        _, bad = _bad_ids(indices, offsets, layout)
        if bool(bad.any()):
            keep = ~bad
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                indices, offsets, kept_psw = check_inputs(
                    indices, offsets, per_sample_weights, layout, "warn"
                )
            full_psw, per_sample_weights = per_sample_weights, kept_psw
    if not rows:
        grads = [None] * 3
        if psw_grad:
            grads[2] = _psw_grad_of(backend)(
                grad_output, weights.detach(), layout.w_offsets, layout.dims, layout.D_offsets,
                indices, offsets, pooling=pooling,
            ).to(per_sample_weights.dtype)
        num_targets = 0
    else:
        num_targets = 0 if fused is not None else len(layout.table_rows)
        grads = _TBELookup.backward(_context(
            indices, offsets, per_sample_weights, weights, layout, pooling, backend, fused,
            table_offsets, psw_grad, num_targets,
        ), grad_output)
    grad_psw = grads[2]
    if grad_psw is not None and keep is not None:
        grad_psw = torch.zeros_like(full_psw).masked_scatter_(keep, grad_psw)
    return grad_psw, (list(grads[_NUM_INPUTS:]) if num_targets else None)


def _context(indices, offsets, per_sample_weights, weights, layout, pooling, backend, fused,
             table_offsets, psw_grad, num_targets):
    """What ``_TBELookup.forward`` leaves its backward, for a batch looked up without it."""
    return types.SimpleNamespace(
        saved_tensors=(indices, offsets, per_sample_weights, None, None, None),
        args=(layout, pooling, backend, fused, False, table_offsets),
        weights=weights,
        num_targets=num_targets,
        plan=None,
        ahead_check=None,
        check=None,
        needs_input_grad=(False, False, psw_grad, *[False] * (_NUM_INPUTS - 3),
                          *[True] * num_targets),
    )


def _report_bad_input(batch, flags: list[int]) -> None:
    """A batch the kernel flagged: find and name the bad value (slow path, syncs freely);
    raises for errors and malformed offsets, warns for dropped ids with ``"warn"``."""
    indices, offsets, per_sample_weights, layout, bounds_check = batch
    kept = _find_bad_input(indices, offsets, per_sample_weights, layout, bounds_check)
    if flags[0] and kept[0] is indices:  # the batch changed since: say what the kernel saw
        warnings.warn(
            f"dropped {flags[0]} out-of-range ids (first at indices[{indices.numel() - flags[1]}])",
            stacklevel=3,
        )


class BoundsMonitor:
    """The deferred ``bounds_check="warn"`` of a module on CUDA: a batch's flags are copied to
    pinned host memory without waiting, and a later lookup (or ``poll()``) warns about the
    ids that batch dropped, as FBGEMM's WARNING mode does. Lookups never wait for the GPU
    unless DEPTH batches are still in flight. Errors are never deferred.

    Lookups captured in a CUDA graph cannot copy anything to the host: they count into one
    device buffer per device (``replay_counts``) that every replay adds to; ``poll()`` (with
    ``wait``) reads it and warns about the ids dropped since the last poll, or raises for
    malformed offsets. It is allocated by the first eager lookup on the device, so that the
    capture (which runs after eager warm-up steps) does not record its zeroing."""

    DEPTH = 8

    def __init__(self) -> None:
        self._free: list[HostFlags] = []
        self._pending: collections.deque = collections.deque()
        self._replay: dict[torch.device, torch.Tensor] = {}
        self._replay_seen: dict[torch.device, list[int]] = {}

    def replay_counts(self, device: torch.device) -> torch.Tensor:
        """[3] int64 on ``device`` (as the forward kernel's ``err``): ids dropped, N minus the
        first one's position (a max), malformed bags, summed over captured lookups' replays."""
        counts = self._replay.get(device)
        if counts is None:
            if capturing(device):
                raise RuntimeError(
                    "TBE lookup under CUDA graph capture with bounds_check='warn': run one "
                    "eager lookup on this device before capturing (graphs.GraphedStep's "
                    "warm-up does), so that the dropped-id counter exists outside the graph"
                )
            counts = self._replay[device] = torch.zeros(3, dtype=torch.int64, device=device)
            self._replay_seen[device] = [0, 0, 0]
        return counts

    def watch(self, err: torch.Tensor, batch) -> None:
        self._drain(wait=len(self._pending) >= self.DEPTH)
        copy = self._free.pop() if self._free else HostFlags(3, err.device)
        self._pending.append((copy.start(err), batch))

    def poll(self, wait: bool = True) -> None:
        """Warn about (or raise for) the watched batches; ``wait``: also those still running,
        and what captured lookups counted over their replays (a host read)."""
        self._drain(wait=wait, everything=wait)
        if wait:
            self._drain_replays()

    def _drain_replays(self) -> None:
        for device, counts in self._replay.items():
            now, seen = counts.tolist(), self._replay_seen[device]
            self._replay_seen[device] = now
            dropped, malformed = now[0] - seen[0], now[2] - seen[2]
            if malformed:
                raise ValueError(
                    f"offsets: {malformed} malformed bags (decreasing offsets, or outside "
                    "[0, len(indices)]) in CUDA graph replays since the last poll; they were "
                    "clamped there: run the step eagerly to name them"
                )
            if dropped:
                warnings.warn(
                    f"dropped {dropped} out-of-range ids in CUDA graph replays since the last "
                    "poll (bounds_check='warn'); run the step eagerly to name them",
                    stacklevel=3,
                )

    def _drain(self, wait: bool, everything: bool = False) -> None:
        while self._pending:
            copy, batch = self._pending[0]
            flags = copy.poll(wait)
            if flags is None:
                return
            self._pending.popleft()
            self._free.append(copy)
            if any(flags):
                _report_bad_input(batch, flags)
            if not everything:
                wait = False
