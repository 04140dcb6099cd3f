"""Input-dist ops: cut each bag's ids by the shard that owns their row, and place what the
other ranks sent into the lookup batch. Each op runs its backend's method (``ops/backends/``:
the Triton kernels, the fast CPU path or the reference twin); the differences between them (the
kernels' launch grid, their in-kernel check, the reference's need for values without padding)
end there, so the input dist in ``sharding/`` only says which backend.

Shapes: K KJT keys (bags feature-major, ``offsets`` [K*B+1]), S shard-features (a feature's
rows on one shard), each pointing at its key (``sf_key`` [S]) with its row range
``[lo[s], hi[s])``.

``bucketize`` is also one registered op, ``torch.ops.fbtriton_dist.bucketize``, with a fake
(meta) implementation: traced (FX, ``torch.compile``, ``torch.export``) or on meta tensors the
call goes through it, so a graph sees one op whose id count is a dynamic size (or
``capacity``). The ops that write into communication buffers stay eager.
"""

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from fbtriton_dist.ops import backends

Backend = str
"""A resolved backend's name (``backends.names()``)."""


def bucketize_grid(sf_key: list[int], device: torch.device, backend: Backend):
    """The backend's bucketize launch grid for these shard-features (on ``device``; Triton's),
    built once per key order so that no step reads it from the device; None where it has
    none."""
    return backends.get(backend).bucketize_grid(sf_key, device)


def grid_cover(grid, cover_per_key: list[int], device: torch.device):
    """[G] int64 for the kernels' in-kernel check: per row of ``grid``, how many of its
    shard-features a valid id of its key lands in (``cover_per_key``); None when some key
    spans several rows (more shard-features than one row holds), where the torch check is
    used. One host read of the grid."""
    if grid is None:
        return None
    rows = [row[0] for row in grid.tolist()]
    if any(rows.count(k) != 1 for k in rows):
        return None
    return torch.tensor([cover_per_key[k] for k in rows], dtype=torch.int64, device=device)


def bucketize(
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    sf_key: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    B: int,
    *,
    backend: Backend,
    capacity: int | None = None,
    grid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """For every shard-feature s and sample b, the ids of bag (``sf_key[s]``, b) inside
    ``[lo[s], hi[s])``, rebased to ``lo[s]``: ``(lengths [S*B], ids, weights)``
    (``reference.bucketize.bucketize``). Bags past the values are clamped to them (a
    malformed batch stays in bounds; the caller's check reports it). With ``capacity`` the
    ids are that long, and the kernels need no host sync to size them."""
    if _traced(values):
        if capacity is None and values.device.type == "meta" and not is_fake(values):
            raise ValueError(
                "bucketize on meta tensors: the number of ids depends on their values; give "
                "capacity (or trace with fake tensors)"
            )
        lengths, ids, w = torch.ops.fbtriton_dist.bucketize(
            values, offsets, weights, sf_key, lo, hi, B, backend, capacity, grid
        )
        return lengths, ids, w if weights is not None else None
    return _bucketize(values, offsets, weights, sf_key, lo, hi, B, backend, capacity, grid)


def _bucketize(values, offsets, weights, sf_key, lo, hi, B, backend, capacity, grid):
    clamped = offsets.clamp(max=values.numel())
    return backends.get(backend).bucketize(
        values, clamped, weights, sf_key, lo, hi, B, capacity=capacity, table=grid
    )


def _traced(values: Tensor) -> bool:
    if torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        return True
    return values.device.type == "meta" or is_fake(values)


@torch.library.custom_op("fbtriton_dist::bucketize", mutates_args=())
def _bucketize_op(
    values: Tensor,
    offsets: Tensor,
    weights: Tensor | None,
    sf_key: Tensor,
    lo: Tensor,
    hi: Tensor,
    B: int,
    backend: str,
    capacity: int | None,
    grid: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``bucketize`` as an op: (lengths [S*B] int64, ids, weights; [0] float32 unweighted)."""
    lengths, ids, w = _bucketize(values, offsets, weights, sf_key, lo, hi, B, backend, capacity,
                                 grid)
    return lengths, ids, w if w is not None else values.new_zeros(0, dtype=torch.float32)


@_bucketize_op.register_fake
def _(values, offsets, weights, sf_key, lo, hi, B, backend, capacity, grid):
    n = capacity if capacity is not None else torch.library.get_ctx().new_dynamic_size()
    lengths = values.new_empty(sf_key.shape[0] * B, dtype=torch.int64)
    w = weights.new_empty(n) if weights is not None else values.new_empty(0, dtype=torch.float32)
    return lengths, values.new_empty(n, dtype=torch.int64), w


def bucketize_into(
    values: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    sf_key: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    B: int,
    send: torch.Tensor,
    places: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    id_dtype: torch.dtype,
    *,
    backend: Backend,
    capacity: int,
    grid: torch.Tensor | None = None,
    check: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``bucketize`` written straight into the uint8 send buffer ``send``: every
    destination's int32 lengths, ids (``id_dtype``) and float32 weights at their places
    (``places`` = (first bag, id start, weight start, lengths start) per shard-feature,
    ``reference.bucketize.bucketize_into``). ``values`` may be longer than the bags use (a
    static buffer). Returns the lengths [S*B] int64.

    ``check`` = (cover [G] from ``grid_cover``, meta int64 view of ``send``, meta_at [R]):
    the kernels check every id and bag themselves and write each destination's failure flag
    (Triton only). ``capacity``: id slots of each destination; ids past it are not written.
    The reference wants no values after the last bag: it cuts them off (a host read)."""
    outs = (send.view(id_dtype), send.view(torch.float32) if weights is not None else None,
            send.view(torch.int32), *places)
    return backends.get(backend).bucketize_into(
        values, offsets, weights, sf_key, lo, hi, B, *outs, grid=grid, check=check,
        capacity=capacity,
    )


def segment_plan(
    counts: torch.Tensor, group_first: torch.Tensor, group_base: torch.Tensor, *, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``segment_copy`` puts the segments of R sources (``counts`` [R, n] ids of
    segment i from source r): ``(ends [R, n], dst_start [R, n])``
    (``reference.bucketize.segment_plan``). The kernel holds the whole table in one
    program; bigger tables take the reference's torch ops (no host sync either way)."""
    return backends.get(backend).segment_plan(counts, group_first, group_base)


def segment_copy(
    src: torch.Tensor,
    src_w: torch.Tensor | None,
    src_base: torch.Tensor,
    src_w_base: torch.Tensor,
    ends: torch.Tensor,
    dst_start: torch.Tensor,
    out: torch.Tensor,
    out_w: torch.Tensor | None,
    capacity: int,
    *,
    backend: Backend,
) -> None:
    """Copy every source's segments to their places in ``out`` (and weights to ``out_w``),
    with the plan of ``segment_plan`` (``reference.bucketize.segment_copy``; no host sync)."""
    backends.get(backend).segment_copy(
        src, src_w, src_base, src_w_base, ends, dst_start, out, out_w, capacity
    )
