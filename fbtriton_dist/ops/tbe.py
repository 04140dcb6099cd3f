"""TBE lookup op: validate a batch, then run forward/backward on a backend of the registry
(``ops/backends/``: Triton, the fast CPU path, the reference), asking its capabilities.

Shapes: T features, B bags per feature, N ids. ``indices`` [N], ``offsets`` [T*B+1]
(feature-major), ``per_sample_weights`` [N] or None; output ``[B, sum(D)]``, or without
pooling (``pooling=PoolingMode.NONE``, sequence embeddings) ``[N, max_D]``: id i's row in row
i's first D_f columns, zeros after them (and in padding rows).
"""

import functools
import threading
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fbtriton_dist import graphs, knobs, optim
from fbtriton_dist.ops import backends, tbe_ahead
from fbtriton_dist.ops.tbe_checks import (
    BoundsCheck,
    BoundsMonitor,
    bad_ids,
    check_inputs,
    check_shapes,
    kept_batch,
    report_bad_input,
)
from fbtriton_dist.pooling import PoolingMode

Backend = str
"""A resolved backend's name (``backends.names()``); ``backends.get`` gives its object."""


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on the current stream of ``device``?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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

    @functools.cached_property
    def num_rows(self) -> int | None:
        """Rows of all tables back to back: the linear key of a dropped id (None: unknown).
        Summed once per layout (read several times a lookup)."""
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


def _backend_forward(impl, weights, indices, offsets, per_sample_weights, layout, pooling,
                     output_dtype, err, check, linearize):
    """The backend's forward of one batch: the output, or with ``linearize`` (output, keys,
    bag ids, counts)."""
    # only a backend that counts non-finite weights itself is asked to (weights_check)
    extra = {"check_weights": True} if check is not None and check.weights else {}
    return impl.tbe_forward(
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
        if ahead:
            linearize = False  # the side stream writes the keys
            fork = tbe_ahead.fork(weights.device)  # the side stream starts here
        result = _backend_forward(impl, weights, indices, offsets, per_sample_weights, layout,
                                  pooling, output_dtype, err, check, linearize)
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
            bags, bad = bad_ids(indices, offsets, layout)
            keep = ~bad
            indices, offsets, per_sample_weights = kept_batch(
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
        err = monitor.replay_counts(weights.device, in_capture)  # summed over replays
    elif bounds_check != "ignore":
        # the kernel drops and counts out-of-range ids (and clamps malformed bags) in err
        if weights.device.type == "cpu":
            err = _host_err()
        else:
            err = torch.zeros(3, dtype=torch.int64, device=weights.device)
        check = _InKernelCheck()
        if bounds_check == "error" and per_sample_weights is not None:
            # a non-finite weight marks the batch bad (no extra sync: err is read anyway);
            # report_bad_input then names it. Counted by the forward where it can.
            check.weights = caps.weights_check_in_kernel
            if not check.weights:
                err[2] = (~torch.isfinite(per_sample_weights)).sum()
        if bounds_check == "warn" and monitor is not None and weights.device.type == "cuda":
            monitor.replay_counts(weights.device)  # allocated now, before any capture
    if plan_ahead is None:
        plan_ahead = knobs.TBE_AHEAD and weights.device.type == "cuda"
    if training:
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
    else:  # no gradient to anyone: the autograd Function's bookkeeping is not needed
        out = _backend_forward(backends.get(backend), weights, indices, offsets,
                               per_sample_weights, layout, pooling, output_dtype, err, check,
                               linearize=False)
    if err is not None and not in_capture:
        batch = (indices, offsets, per_sample_weights, layout, bounds_check)
        if defer:
            monitor.watch(err, batch)  # read at the next lookup: no host sync now
        else:
            flags = err.tolist()
            check.dropped = flags[0]
            if any(flags):
                report_bad_input(batch, flags)
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
        _, bad = bad_ids(indices, offsets, layout)
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
