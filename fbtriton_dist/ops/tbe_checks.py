"""The TBE lookup's input checks: the shapes, the values on the host (``check_inputs``: the
backends without an in-kernel check), naming a bad value once a kernel flagged a batch, and
the deferred ``bounds_check="warn"`` of a module on CUDA (``BoundsMonitor``).

``layout`` arguments are ``ops.tbe.TBELayout`` objects (not imported here: ``ops/tbe.py``
imports this file).
"""

import collections
import warnings
from typing import Literal

import torch

from fbtriton_dist.host_flags import HostFlags
from fbtriton_dist.ops import cpu_native

BoundsCheck = Literal["error", "warn", "ignore"]


def check_inputs(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    layout,
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
    return find_bad_input(indices, offsets, per_sample_weights, layout, bounds_check)


def check_shapes(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    layout,
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


def find_bad_input(indices, offsets, per_sample_weights, layout, bounds_check):
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
    bags, bad = bad_ids(indices, offsets, layout)
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
    return kept_batch(indices, offsets, per_sample_weights, bags, ~bad)


def kept_batch(indices, offsets, per_sample_weights, bags, keep):
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


def bad_ids(indices, offsets, layout):
    """([N] bag of each id, [N] bool: the id is out of its table's range), on the device."""
    T = layout.num_features
    B = (offsets.numel() - 1) // T
    pos = torch.arange(indices.numel(), device=indices.device, dtype=offsets.dtype)
    bags = torch.searchsorted(offsets[1:], pos, right=True).clamp(max=max(T * B - 1, 0))
    rows = layout.rows[bags // max(B, 1)] if B else torch.zeros_like(indices, dtype=torch.int64)
    return bags, (indices < 0) | (indices.to(torch.int64) >= rows)


def _feature_name(layout, f: int) -> str:
    """``'name'`` of feature ``f`` where the layout knows it, else its index."""
    return repr(layout.feature_names[f]) if layout.feature_names else str(f)


def report_bad_input(batch, flags: list[int]) -> None:
    """A batch the kernel flagged: find and name the bad value (slow path, syncs freely);
    raises for errors and malformed offsets, warns for dropped ids with ``"warn"``."""
    indices, offsets, per_sample_weights, layout, bounds_check = batch
    kept = find_bad_input(indices, offsets, per_sample_weights, layout, bounds_check)
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

    def replay_counts(self, device: torch.device, in_capture: bool = False) -> torch.Tensor:
        """[3] int64 on ``device`` (as the forward kernel's ``err``): ids dropped, N minus the
        first one's position (a max), malformed bags, summed over captured lookups' replays.
        ``in_capture``: asked by a lookup being captured, which cannot allocate it."""
        counts = self._replay.get(device)
        if counts is None:
            if in_capture:
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
                report_bad_input(batch, flags)
            if not everything:
                wait = False
