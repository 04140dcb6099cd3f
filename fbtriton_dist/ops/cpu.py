"""The fast CPU path: what ``backend="auto"`` runs on CPU tensors (the embedded default, CI, CPU
clusters).

Each op first tries the native C kernels (``ops/cpu_native.py``, compiled at first use:
forward, per-sample weight gradient, and the backward with every fused optimizer updating the
rows in place, one pass each); where they do not apply (no compiler, ``FBTD_CPU_NATIVE=0``,
weights not fp32/fp16/bf16) the vectorised torch ops below run, with the same results within
fp32 rounding.

Same signatures and results as ``fbtriton_dist.reference`` within fp32 rounding (sums are
taken in another order), and deterministic. The tables of one D whose rows line up in one
``[rows, D]`` view of the flat weights form a group (usually every table is in one): its ids
become keys into that view, so that

- the forward is one ``torch.nn.functional.embedding_bag`` per group over every bag of its
  features (fp16/bf16 rows are gathered and summed in fp32); without pooling, one gather;
- the backward sorts the group's keys once (stably, with their bags), sums each unique
  row's gradients with one ``embedding_bag`` over the bags' gradients (a bag per unique row,
  in batch order), and applies the optimizer to the unique rows in chunks that stay in cache:
  a vectorised step per optimizer (the reference's formulas, ``reference.tbe.UPDATES``),
  added to fp32 rows with one ``index_add_`` (each row once).

The input dist's bucketize pairs every id with its key's shard-features at once
(``ops/cpu_bucketize.py``); its other ops (the fixed-shape placement) are the reference's
(the CPU backend object, ``ops/backends/cpu.py``, takes them from there).
The forward checks the ids itself given ``err`` (as the Triton kernel: out-of-range ids
dropped and counted, ``ops.tbe`` then names them): in the native kernel's own pass, or, where
the torch ops run, ``_drop_out_of_range``. The backward and the per-sample weight gradient
get batches without bad ids (``ops.tbe``'s backward leaves out the ids the forward dropped).
"""

import torch
import torch.nn.functional as F

from fbtriton_dist import optim
from fbtriton_dist.ops import cpu_native
from fbtriton_dist.ops.cpu_bucketize import bucketize
from fbtriton_dist.pooling import PoolingMode
from fbtriton_dist.reference.counter import counter_rows, refresh_max_counter
from fbtriton_dist.reference.global_decay import row_update
from fbtriton_dist.reference.tbe import step_seed, stochastic_round

POOL_MEAN, POOL_NONE = PoolingMode.MEAN, PoolingMode.NONE

__all__ = [
    "bucketize",
    "tbe_backward",
    "tbe_forward",
    "tbe_per_sample_weights_grad",
]

CHUNK_ELEMENTS = 2**20
"""Unique rows are reduced and updated in chunks of about this many fp32 gradient elements
(4 MB): big enough that the per-op cost is small, small enough to stay in cache."""


class _Features:
    """Host copies of one batch's per-feature layout: what every loop below reads."""

    def __init__(self, w_offsets, dims, D_offsets, offsets, row_offsets=None):
        self.dims = dims.tolist()
        self.w_base = w_offsets.tolist()
        self.cols = D_offsets.tolist()
        self.row_base = row_offsets.tolist() if row_offsets is not None else self.w_base
        self.T = T = len(self.dims)
        self.B = (offsets.numel() - 1) // T
        self.bounds = offsets[:: self.B].tolist() if self.B else [0] * (T + 1)


class _Group:
    """Tables of one D whose rows are rows of one ``[rows, D]`` view of the flat weights (and
    of a per-element state) from element ``start``: every table whose first element is a
    multiple of D shares the view from 0; any other table has its own. An id of a feature
    becomes the key ``key_base`` of its table + id."""

    def __init__(self, D: int, start: int):
        self.D, self.start = D, start
        self.tables: list[tuple[int, int, list[int]]] = []
        """(key_base, first linear row, its features)."""
        self.features: list[int] = []
        """The group's features, in feature order."""

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        rows = (flat.numel() - self.start) // self.D
        return flat[self.start : self.start + rows * self.D].view(rows, self.D)

    def key_base(self, f: int) -> int:
        return next(kb for kb, _, feats in self.tables if f in feats)

    def batch(self, layout: _Features, indices, offsets, per_sample_weights):
        """The group's ids as (keys [n] int64, [nf * B + 1] offsets of its bags, weights [n]
        or None, the ids' positions in ``indices`` or None where they are ``indices[:n]``):
        bag k * B + b is sample b of the group's k-th feature."""
        B, device = layout.B, indices.device
        feats = self.features
        if feats == list(range(layout.T)):  # every feature: the batch as it is
            n = layout.bounds[-1]
            bases = torch.tensor([self.key_base(f) for f in feats], device=device)
            counts = torch.tensor(
                [layout.bounds[f + 1] - layout.bounds[f] for f in feats], device=device
            )
            keys = indices[:n].to(torch.int64)
            if bool(bases.any()):
                keys = keys + torch.repeat_interleave(bases, counts, output_size=n)
            psw = per_sample_weights[:n] if per_sample_weights is not None else None
            return keys, offsets, psw, None
        keys, offs, psw, where, first = [], [offsets.new_zeros(1)], [], [], 0
        for f in feats:
            a, e = layout.bounds[f], layout.bounds[f + 1]
            keys.append(indices[a:e].to(torch.int64) + self.key_base(f))
            offs.append(offsets[f * B + 1 : (f + 1) * B + 1] - a + first)
            where.append(torch.arange(a, e, device=device))
            if per_sample_weights is not None:
                psw.append(per_sample_weights[a:e])
            first += e - a
        return torch.cat(keys), torch.cat(offs), torch.cat(psw) if psw else None, torch.cat(where)

    def columns(self, out: torch.Tensor, layout: _Features):
        """``out`` [B, total_D]'s columns of the group's features as ``[nf * B, D]`` (bag
        k * B + b is row b of feature k's columns): a copy, or, with ``out`` None, the
        feature's column slices to fill."""
        B, D = layout.B, self.D
        cols = [layout.cols[f] for f in self.features]
        if out.shape[1] == D * len(cols) and cols == list(range(0, out.shape[1], D)):
            return out.reshape(B, len(cols), D).transpose(0, 1).reshape(-1, D)
        return torch.cat([out[:, c : c + D] for c in cols])

    def place(self, pooled: torch.Tensor, out: torch.Tensor, layout: _Features) -> None:
        """Write ``pooled`` [nf * B, D] into its features' columns of ``out``."""
        B, D = layout.B, self.D
        cols = [layout.cols[f] for f in self.features]
        if out.shape[1] == D * len(cols) and cols == list(range(0, out.shape[1], D)):
            out.view(B, len(cols), D).copy_(pooled.view(len(cols), B, D).transpose(0, 1))
            return
        for k, c in enumerate(cols):
            out[:, c : c + D] = pooled[k * B : (k + 1) * B]

    def state_shift(self, device) -> tuple[torch.Tensor, torch.Tensor] | int:
        """Linear row - key of each table (a number when the group has one table; else the
        tables' key bases and shifts, for a searchsorted)."""
        if len(self.tables) == 1:
            key_base, base, _ = self.tables[0]
            return base - key_base
        key_bases = torch.tensor([kb for kb, _, _ in self.tables], device=device)
        shift = torch.tensor([b - kb for kb, b, _ in self.tables], device=device)
        return key_bases, shift


def _groups(layout: _Features) -> list[_Group]:
    tables: dict[int, list[int]] = {}  # one table per distinct first row
    for f in range(layout.T):
        tables.setdefault(layout.row_base[f], []).append(f)
    groups: dict[tuple[int, int], _Group] = {}
    for base in sorted(tables):
        feats = tables[base]
        D, w_base = layout.dims[feats[0]], layout.w_base[feats[0]]
        start = 0 if w_base % D == 0 else w_base
        group = groups.setdefault((D, start), _Group(D, start))
        group.tables.append(((w_base - start) // D, base, feats))
        group.features.extend(feats)
    for group in groups.values():
        group.tables.sort()
        group.features.sort()
    return list(groups.values())


def _pool(view, keys, offs, psw, mean: bool) -> torch.Tensor:
    """``[bags, D]`` fp32 sums (or means) of the bags ``offs`` of rows ``keys`` of ``view``."""
    if view.dtype != torch.float32:  # gather in the weights' dtype, sum in fp32
        view = view.index_select(0, keys).to(torch.float32)
        keys = torch.arange(view.shape[0], device=view.device)
    if psw is None:
        return F.embedding_bag(keys, view, offs, mode="mean" if mean else "sum",
                               include_last_offset=True)
    out = F.embedding_bag(keys, view, offs, mode="sum", per_sample_weights=psw.to(torch.float32),
                          include_last_offset=True)
    if mean:
        out = out / (offs[1:] - offs[:-1]).clamp(min=1).to(torch.float32)[:, None]
    return out


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
    row_offsets: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    err: torch.Tensor | None = None,
    check_weights: bool = False,
    **_kernel_hints,
) -> torch.Tensor:
    """``reference.tbe_forward`` (pooled ``[B, total_D]``, or ``[N, max_D]`` rows without
    pooling). ``err`` ([3] int64, zeroed; needs ``rows``): the bounds check of the Triton
    kernel's ``err``: ids outside ``rows`` [T] are dropped (a mean divides by the ids kept;
    their unpooled rows are zeros) and counted in ``err[0]``, ``err[1]`` gets N minus the first
    one's position, malformed bags are counted in ``err[2]`` (their output is then not
    defined: the caller raises), and, ``check_weights`` (``bounds_check="error"``), the
    non-finite per-sample weights too. The kernels' ``linearize`` / ``row_align`` are not
    used."""
    if rows is None:
        err = None
    out = cpu_native.forward(weights, w_offsets, dims, D_offsets, indices, offsets,
                             per_sample_weights, pooling=pooling, max_D=max_D, total_D=total_D,
                             rows=rows, err=err, check_weights=check_weights)
    if out is not None:
        return out if output_dtype == torch.float32 else out.to(output_dtype)
    keep = None
    if err is not None:
        if check_weights and per_sample_weights is not None:
            err[2] += (~torch.isfinite(per_sample_weights)).sum()
        checked = _drop_out_of_range(indices, offsets, per_sample_weights, rows, err)
        if checked is None:  # malformed offsets: counted, the caller raises
            shape = (indices.numel(), max_D) if pooling == POOL_NONE else (
                (offsets.numel() - 1) // dims.numel(), total_D)
            return torch.zeros(shape, dtype=output_dtype, device=weights.device)
        indices, offsets, per_sample_weights, keep = checked
    layout = _Features(w_offsets, dims, D_offsets, offsets, row_offsets)
    if pooling == POOL_NONE:
        out = _sequence_forward(weights, layout, indices, offsets, per_sample_weights, max_D,
                                output_dtype)
        if keep is None:
            return out
        full = out.new_zeros((keep.numel(), max_D))
        full[keep] = out
        return full
    out = torch.empty((layout.B, total_D), dtype=torch.float32, device=weights.device)
    for group in _groups(layout):
        keys, offs, psw, _ = group.batch(layout, indices, offsets, per_sample_weights)
        group.place(_pool(group.view(weights), keys, offs, psw, pooling == POOL_MEAN), out,
                    layout)
    return out if output_dtype == torch.float32 else out.to(output_dtype)


def _drop_out_of_range(indices, offsets, per_sample_weights, rows, err):
    """The forward's bounds check where the native kernel does not run, counted in ``err`` as
    the kernels count: None for malformed offsets (counted in ``err[2]``), else the batch
    without the ids outside their feature's ``rows`` (counted in ``err[0]``, ``err[1]``) and
    the [N] bool mask of the ids kept (None: every id)."""
    T, N = rows.numel(), indices.numel()
    B = (offsets.numel() - 1) // T
    offs = offsets.to(torch.int64)
    decreasing = int((offs[1:] < offs[:-1]).sum())
    if decreasing or int(offs[0]) != 0 or int(offs[-1]) != N:
        err[2] += max(decreasing, 1)
        return None
    if B == 0 or N == 0:
        return indices, offsets, per_sample_weights, None
    bound = torch.repeat_interleave(rows.to(torch.int64), offs[::B].diff(), output_size=N)
    bad = (indices < 0) | (indices.to(torch.int64) >= bound)
    dropped = int(bad.sum())
    if not dropped:
        return indices, offsets, per_sample_weights, None
    first = int(torch.nonzero(bad)[0])
    err[0] += dropped
    err[1] = max(int(err[1]), N - first)
    keep = ~bad
    kept = torch.zeros(T * B, dtype=torch.int64, device=indices.device)
    kept.index_add_(0, _bag_of_ids(offs, N), keep.to(torch.int64))
    new_offsets = torch.zeros_like(offsets)
    new_offsets[1:] = torch.cumsum(kept, 0)
    psw = per_sample_weights[keep] if per_sample_weights is not None else None
    return indices[keep], new_offsets, psw, keep


def _sequence_forward(weights, layout, indices, offsets, per_sample_weights, max_D,
                      output_dtype) -> torch.Tensor:
    """``[N, max_D]``: row i is id i's row (times its weight), zeros after its D and in
    padding rows (ids after the last bag)."""
    n = layout.bounds[-1]
    out = torch.zeros((indices.numel(), max_D), dtype=output_dtype, device=weights.device)
    for group in _groups(layout):
        keys, _, psw, where = group.batch(layout, indices, offsets, per_sample_weights)
        rows = group.view(weights).index_select(0, keys)
        if psw is not None:
            rows = rows.to(torch.float32) * psw.to(torch.float32)[:, None]
        if where is None and group.D == max_D:
            out[:n] = rows
        elif where is None:
            out[:n, : group.D] = rows
        else:
            out[where, : group.D] = rows.to(output_dtype)
    return out


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
    prev_iter: torch.Tensor | None = None,
    row_counter: torch.Tensor | None = None,
    max_counter: torch.Tensor | None = None,
    row_counter_max: torch.Tensor | None = None,
    **_kernel_hints,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``reference.tbe_backward``: with an optimizer, every touched row is updated in place
    (``step`` advanced first; stochastic rounding seeded as the reference's, drawn per chunk,
    so rounded rows differ from the reference's draws); without, returns
    ``(row_elems, row_dims, row_grads)``."""
    device = weights.device
    t = 0
    if optimizer is not None:
        if step is None:
            raise ValueError("step: expected the optimizer's [1] int64 step counter, got None")
        step.add_(1)
        t = int(step.item())
    extra = {}  # the counter optimizer's max_counter, refreshed before the update
    if isinstance(optimizer, optim.RowWiseAdagradWithCounter):
        extra["max_counter"] = refresh_max_counter(optimizer, t, row_counter, max_counter,
                                                   row_counter_max)
    buffers = {"momentum1": momentum1, "momentum2": momentum2, "prev_iter": prev_iter,
               "row_counter": row_counter}
    done = cpu_native.backward(
        grad_output, weights, w_offsets, dims, row_offsets, D_offsets, indices, offsets,
        per_sample_weights, pooling=pooling, max_D=max_D, optimizer=optimizer, t=t,
        momentum1=momentum1, momentum2=momentum2, stochastic_rounding=stochastic_rounding,
        seed=seed, rows=_kernel_hints.get("rows"), prev_iter=prev_iter,
        row_counter=row_counter, max_counter=extra.get("max_counter"),
    )
    if done is not None:
        return None if done is True else done
    layout = _Features(w_offsets, dims, D_offsets, offsets, row_offsets)
    generator = torch.Generator(device=device).manual_seed(step_seed(seed, t))
    row_elems, row_dims, row_grads = [], [], []
    for group in _groups(layout):
        keys, offs, psw, where = group.batch(layout, indices, offsets, per_sample_weights)
        if keys.numel() == 0:
            continue
        if pooling == POOL_NONE:  # id i's gradient is row i of grad_output
            bags = where if where is not None else torch.arange(keys.numel(), device=device)
            bag_grads = grad_output[:, : group.D].to(torch.float32)
        else:
            bags = _bag_of_ids(offs, keys.numel())
            bag_grads = group.columns(grad_output.to(torch.float32), layout)
        if pooling == POOL_MEAN:
            bag_grads = bag_grads / (offs[1:] - offs[:-1]).clamp(min=1).to(torch.float32)[:, None]
        runs = _Runs(keys, bags, psw, bag_grads.contiguous())
        chunk = CHUNK_ELEMENTS // group.D if optimizer is not None else runs.rows.numel()
        shift = group.state_shift(device) if optimizer is not None else 0
        for lo, hi, a, b in runs.chunks(chunk):
            rows, grad = runs.reduce(lo, hi, a, b)
            if optimizer is None:
                row_elems.append(group.start + rows * group.D)
                row_dims.append(torch.full_like(rows, group.D))
                row_grads.append(F.pad(grad, (0, max_D - group.D)))
                continue
            _update(optimizer, group, rows, grad, t, weights, buffers, shift,
                    generator if stochastic_rounding else None, extra)
    if optimizer is not None:
        return None
    if not row_elems:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, torch.empty((0, max_D), dtype=torch.float32, device=device)
    return torch.cat(row_elems), torch.cat(row_dims), torch.cat(row_grads)


def _bag_of_ids(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """[n] the bag of each of the n ids of bags ``offsets``."""
    return torch.repeat_interleave(
        torch.arange(offsets.numel() - 1, device=offsets.device), offsets[1:] - offsets[:-1],
        output_size=n,
    )


class _Runs:
    """A group's ids sorted stably by key with their bags (``keys``, ``bags``, ``weights``),
    each unique key (``rows`` [U]) with the start of its run (``starts`` [U + 1]), and the
    bags' gradients ``bag_grads`` [bags, D] (without pooling, a bag is one id's position)."""

    def __init__(self, keys, bags, weights, bag_grads):
        self.keys, order = torch.sort(keys, stable=True)
        self.bags = bags.index_select(0, order)
        self.weights = (
            weights.index_select(0, order).to(torch.float32) if weights is not None else None
        )
        self.bag_grads = bag_grads
        self.rows, counts = torch.unique_consecutive(self.keys, return_counts=True)
        self.starts = torch.zeros(self.rows.numel() + 1, dtype=torch.int64, device=keys.device)
        torch.cumsum(counts, 0, out=self.starts[1:])

    def chunks(self, rows_per_chunk: int):
        """(first, end unique key, first, end sorted id) of each chunk of unique keys."""
        U = self.rows.numel()
        bounds = list(range(0, U, max(rows_per_chunk, 1))) + [U]
        ids = self.starts[bounds].tolist()
        return [(bounds[i], bounds[i + 1], ids[i], ids[i + 1]) for i in range(len(bounds) - 1)]

    def reduce(self, lo: int, hi: int, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique keys lo..hi, ``[hi - lo, D]`` fp32 their summed gradients; their ids are
        the sorted ids a..b): one ``embedding_bag`` over the bags' gradients with a bag per
        key sums each key's gradients in batch order."""
        starts = self.starts[lo : hi + 1] - a if a else self.starts[lo : hi + 1]
        w = self.weights[a:b] if self.weights is not None else None
        grad = F.embedding_bag(self.bags[a:b], self.bag_grads, starts, mode="sum",
                               per_sample_weights=w, include_last_offset=True)
        return self.rows[lo:hi], grad


def _update(optimizer, group: _Group, rows, grad, t, weights, buffers, shift,
            generator, extra) -> None:
    """One fused update of some of the group's unique rows, in place (``buffers``: the state
    buffers by name; ``extra``: keywords of the step). fp32 weights without stochastic
    rounding add the step (``index_add_``, each row once); others gather the rows in fp32,
    add it and round back."""
    spec = optim.spec_of(optimizer)
    view = group.view(weights)
    # the states with buffers here (global decay's prev_iter: not here)
    held = [s for s in spec.states if buffers[s.name] is not None]
    places = []  # (the state, where the rows' values are in it), per state
    for state, buffer in ((s, buffers[s.name]) for s in held):
        if not state.per_row:
            places.append((group.view(buffer), rows))
        elif isinstance(shift, int):
            places.append((buffer, rows + shift))
        else:
            key_bases, shifts = shift
            places.append((buffer, rows + shifts[torch.searchsorted(key_bases, rows,
                                                                    right=True) - 1]))
    gathered = any(full.dtype != torch.float32 for full, _ in places)
    if gathered:  # fp16 / bf16 states: the rows' values in fp32, updated, rounded back
        local = torch.arange(rows.numel(), device=rows.device)
        work = [(full[where].float(), local) for full, where in places]
    else:
        local, work = rows, places
    states = []
    for state, (full, where) in zip(held, work, strict=True):
        states += [where if state.per_row else None, full]
    fast = weights.dtype == torch.float32 and generator is None
    w = None
    if not fast or _NEEDS_ROWS[spec.name](optimizer):
        w = view.index_select(0, rows).to(torch.float32)
    delta = _STEPS[spec.name](optimizer, grad, w, t, local, *states, **extra)
    if gathered:
        for (full, where), (values, _) in zip(places, work, strict=True):
            full.index_copy_(0, where, values.to(full.dtype))
    if fast:
        view.index_add_(0, rows, delta)
        return
    w = w + delta
    w = stochastic_round(w, weights.dtype, generator) if generator is not None else w
    view.index_copy_(0, rows, w.to(weights.dtype))


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
    row_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference.tbe_per_sample_weights_grad``: ``<grad of id i's bag, row_i>`` (/ length)."""
    grad = cpu_native.per_sample_weights_grad(grad_output, weights, w_offsets, dims, D_offsets,
                                              indices, offsets, pooling=pooling)
    if grad is not None:
        return grad
    layout = _Features(w_offsets, dims, D_offsets, offsets, row_offsets)
    grad = torch.zeros(indices.numel(), dtype=torch.float32, device=weights.device)
    for group in _groups(layout):
        keys, offs, _, where = group.batch(layout, indices, offsets, None)
        if keys.numel() == 0:
            continue
        if pooling == POOL_NONE:
            bags = where if where is not None else torch.arange(keys.numel(), device=keys.device)
            bag_grads = grad_output[:, : group.D].to(torch.float32)
        else:
            bags = _bag_of_ids(offs, keys.numel())
            bag_grads = group.columns(grad_output.to(torch.float32), layout)
        if pooling == POOL_MEAN:
            bag_grads = bag_grads / (offs[1:] - offs[:-1]).clamp(min=1).to(torch.float32)[:, None]
        rows = group.view(weights).index_select(0, keys).to(torch.float32)
        dots = torch.linalg.vecdot(rows, bag_grads.index_select(0, bags))
        if where is None:
            grad[: dots.numel()] = dots
        else:
            grad.index_copy_(0, where, dots)
    return grad


# -- the fused updates, one per optimizer of optim.REGISTRY, the reference's
# (``reference.tbe.UPDATES``) as steps: each gets the rows' summed gradients ``g`` [U, D], the
# rows themselves ``w`` [U, D] fp32 (only where ``_NEEDS_ROWS`` says so, else None), t (>= 1)
# and ``rows`` [U] (their rows in the states' views), then per state its index and tensor
# (a per-row state: [U] linear rows and the whole [rows] state; a per-element one: None and
# the [rows, D] view); it updates the states in place and returns the step w_new - w


def _sgd_step(opt: optim.SGD, g, w, t, rows):
    return g.mul_(-opt.lr)


def _adagrad_step(opt: optim.Adagrad, g, w, t, rows, _, m1):
    m = m1.index_select(0, rows).addcmul_(g, g)
    m1.index_copy_(0, rows, m)
    return (g * -opt.lr).div_(m.sqrt_().add_(opt.eps))


def _rowwise_adagrad_step(opt: optim.RowWiseAdagrad, g, w, t, rows, state_rows, m1):
    wd = opt.applied_weight_decay  # 0 with weight_decay_mode="none"
    decoupled = opt.weight_decay_mode == "decoupled"
    g_wd = g if decoupled or wd == 0 else g + wd * w
    m = m1.index_select(0, state_rows) + torch.linalg.vecdot(g_wd, g_wd) / g.shape[1]
    m1.index_copy_(0, state_rows, m)
    mult = opt.lr / (torch.sqrt(m) + opt.eps)
    step = g_wd.mul_(-mult[:, None]) if g_wd is g else g_wd * -mult[:, None]
    if decoupled and wd:
        step.add_(w, alpha=-opt.lr * wd)
    return step


def _adam_step(opt: optim.Adam, g, w, t, rows, _, m1, __, m2):
    b1, b2 = opt.betas
    mom1 = m1.index_select(0, rows).mul_(b1).add_(g, alpha=1.0 - b1)
    mom2 = m2.index_select(0, rows).mul_(b2).addcmul_(g, g, value=1.0 - b2)
    m1.index_copy_(0, rows, mom1)
    m2.index_copy_(0, rows, mom2)
    m_hat = mom1 / (1.0 - b1**t)
    v_hat = mom2 / (1.0 - b2**t)
    step = m_hat.div_(v_hat.sqrt_().add_(opt.eps))
    if opt.weight_decay:
        step.add_(w, alpha=opt.weight_decay)
    return step.mul_(-opt.lr)


def _adam_family_step(opt, g, w, t, rows, _, m1, state_rows, m2, *, rowwise_v: bool,
                      trust: bool):
    """Partial-rowwise Adam, LAMB and partial-rowwise LAMB (``reference.tbe``'s
    ``_adam_direction``, then the trust ratio): m per element; v per element, or
    (``rowwise_v``) per row of the mean of g^2 (its state index ``state_rows``)."""
    b1, b2 = opt.betas
    mom1 = m1.index_select(0, rows).mul_(b1).add_(g, alpha=1.0 - b1)
    m1.index_copy_(0, rows, mom1)
    if rowwise_v:
        v = torch.linalg.vecdot(g, g).div_(g.shape[1])
        mom2 = m2.index_select(0, state_rows).mul_(b2).add_(v, alpha=1.0 - b2)
        m2.index_copy_(0, state_rows, mom2)
        denom = (mom2 / (1.0 - b2**t)).sqrt_().add_(opt.eps)[:, None]
    else:
        mom2 = m2.index_select(0, rows).mul_(b2).addcmul_(g, g, value=1.0 - b2)
        m2.index_copy_(0, rows, mom2)
        denom = (mom2 / (1.0 - b2**t)).sqrt_().add_(opt.eps)
    r = mom1.div_(1.0 - b1**t).div_(denom)
    if opt.weight_decay:
        r.add_(w, alpha=opt.weight_decay)
    if not trust:
        return r.mul_(-opt.lr)
    w_norm = torch.linalg.vector_norm(w, dim=1, keepdim=True)
    r_norm = torch.linalg.vector_norm(r, dim=1, keepdim=True)
    ratio = torch.where(r_norm > 0, w_norm / r_norm, torch.zeros_like(r_norm))
    return r.mul_(ratio.mul_(-opt.lr))


def _partial_rowwise_adam_step(opt, g, w, t, rows, *states):
    return _adam_family_step(opt, g, w, t, rows, *states, rowwise_v=True, trust=False)


def _lamb_step(opt, g, w, t, rows, _, m1, __, m2):
    return _adam_family_step(opt, g, w, t, rows, None, m1, None, m2, rowwise_v=False,
                             trust=True)


def _partial_rowwise_lamb_step(opt, g, w, t, rows, *states):
    return _adam_family_step(opt, g, w, t, rows, *states, rowwise_v=True, trust=True)


def _lars_sgd_step(opt: optim.LarsSGD, g, w, t, rows, _, m1):
    w_norm = torch.linalg.vector_norm(w, dim=1, keepdim=True)
    denom = torch.linalg.vector_norm(g, dim=1, keepdim=True) + opt.weight_decay * w_norm
    rate = torch.where(denom > 0, opt.lr * opt.eta * w_norm / denom, torch.zeros_like(denom))
    if opt.weight_decay:
        g = g.add(w, alpha=opt.weight_decay)
    mom = m1.index_select(0, rows).mul_(opt.momentum).add_(g.mul_(rate))
    m1.index_copy_(0, rows, mom)
    return mom.neg_()


def _ftrl_step(opt: optim.FTRL, g, w, t, rows, _, m1, __, m2):
    z, n = m1.index_select(0, rows), m2.index_select(0, rows)
    n_new = n.addcmul(g, g)
    sigma = (n_new.sqrt() - n.sqrt_()).div_(opt.lr)
    z.add_(g).sub_(sigma.mul_(w))
    m1.index_copy_(0, rows, z)
    m2.index_copy_(0, rows, n_new)
    denom = n_new.sqrt_().add_(opt.beta).div_(opt.lr).add_(opt.l2)
    w_new = (z - torch.sign(z) * opt.l1).div_(denom).neg_()
    w_new = torch.where(z.abs() <= opt.l1, torch.zeros_like(w_new), w_new)
    return w_new.sub_(w)


def _rowwise_rmsprop_ar_step(opt: optim.RowWiseRMSpropAR, g, w, t, rows, state_rows, m1,
                             _, m2):
    b = opt.ema_beta
    v = m1.index_select(0, state_rows).mul_(b).add_(torch.linalg.vecdot(g, g) / g.shape[1],
                                                    alpha=1.0 - b)
    m1.index_copy_(0, state_rows, v)
    last = m2.index_select(0, state_rows)
    gap = torch.where(last == 0, torch.ones_like(last), t - last)
    keep = (1.0 - (opt.lr * opt.ar_alpha * gap).clamp_(0.0, 1.0)).clamp_(min=opt.min_shrinkage)
    m2.index_copy_(0, state_rows, torch.full_like(last, float(t)))
    step = g * (-opt.lr / (v.sqrt_().add_(opt.eps)))[:, None]
    if w is not None:  # ar_alpha > 0: w_new - w has the decay's part
        step.add_(w * (keep - 1.0)[:, None])
    return step


def _rowwise_adagrad_with_counter_step(opt: optim.RowWiseAdagradWithCounter, g, w, t, rows,
                                       state_rows, m1, _, prev, __, count, *, max_counter):
    new, m, p, c = counter_rows(opt, w, g, t, m1.index_select(0, state_rows),
                                prev.index_select(0, state_rows),
                                count.index_select(0, state_rows), max_counter)
    for full, values in ((m1, m), (prev, p), (count, c)):
        full.index_copy_(0, state_rows, values)
    return new.sub_(w)


_STEPS = {
    "sgd": _sgd_step,
    "adagrad": _adagrad_step,
    "rowwise_adagrad": _rowwise_adagrad_step,
    "adam": _adam_step,
    "partial_rowwise_adam": _partial_rowwise_adam_step,
    "lamb": _lamb_step,
    "partial_rowwise_lamb": _partial_rowwise_lamb_step,
    "lars_sgd": _lars_sgd_step,
    "ftrl": _ftrl_step,
    "emainplace_rowwise_adagrad": _rowwise_adagrad_step,  # + the module's moving average
    "rowwise_rmsprop_ar": _rowwise_rmsprop_ar_step,
    "rowwise_adagrad_with_counter": _rowwise_adagrad_with_counter_step,  # reference/counter.py
    # rowwise Adagrad's step on momentum1 (the slow copy, momentum2, is the module's moving
    # average and swap, before the lookup)
    "ensemble_rowwise_adagrad": lambda opt, *a: _rowwise_adagrad_step(opt, *a[:6]),
    # rowwise Adagrad's decoupled step; the catch-up decay runs before the lookup
    "rowwise_adagrad_global_decay": lambda opt, *a: _rowwise_adagrad_step(row_update(opt),
                                                                          *a[:6]),
}
"""The step of each optimizer, by its registry name."""

_NEEDS_ROWS = {
    "sgd": lambda opt: False,
    "adagrad": lambda opt: False,
    "rowwise_adagrad": lambda opt: opt.applied_weight_decay != 0,
    "adam": lambda opt: opt.weight_decay != 0,
    "partial_rowwise_adam": lambda opt: opt.weight_decay != 0,
    "lamb": lambda opt: True,  # the trust ratio
    "partial_rowwise_lamb": lambda opt: True,
    "lars_sgd": lambda opt: True,
    "ftrl": lambda opt: True,  # sigma * w, and the new rows replace the old
    "emainplace_rowwise_adagrad": lambda opt: opt.applied_weight_decay != 0,
    "rowwise_rmsprop_ar": lambda opt: opt.ar_alpha != 0,  # else the decay factor is 1
    "rowwise_adagrad_with_counter": lambda opt: True,
    "ensemble_rowwise_adagrad": lambda opt: opt.applied_weight_decay != 0,
    "rowwise_adagrad_global_decay": lambda opt: opt.weight_decay != 0,
}
"""Does the step read the rows (weight decay, a trust ratio)?"""

STEP_OPTIMIZERS: tuple[str, ...] = tuple(_STEPS)
"""The optimizers the torch ops step (the CPU backend's capabilities read it)."""
