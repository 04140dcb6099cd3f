"""A ``host`` tier's training lookup with its batch's distinct rows staged in device memory
(``docs/storage.md``, "The `host` tier on CUDA").

Unstaged, every id of the forward reads its row over PCIe, and the fused backward reads each
distinct row again, with its optimizer state, to update it in place. Staged, a training lookup
of a TBE whose buffers are mapped host memory:

1. finds the batch's distinct rows on the device (a sort of their linear row keys: no host
   sync, so a CUDA graph can record it) and gives each table a compact segment of a stage, a
   buffer in device memory: stage row ``r`` of table ``t`` is the ``j``-th distinct row of the
   table, at element ``S_t + j * D_t`` (``S_t``: the table's segment), its per-row state at
   stage row ``r``;
2. copies those rows and their optimizer states in (one launch, ``kernels/row_stage.py``);
3. runs the lookup and its fused backward on the stage: the same kernels, on a layout whose
   tables start at their segments and whose ids are the rows' places in them (an id out of its
   table's range keeps its value, so the bounds check drops, counts and reports it as before);
4. after the backward, copies the updated rows and states back (one launch).

Each distinct row crosses the link once each way. It is exact: the rows' keys keep their order
(each table's segment lists its rows in id order, the tables in order), so the backward's
stable sort groups and orders the ids as the unstaged lookup does, and the update is the same
arithmetic on the same values. A backward that runs after another one of this module wrote
rows back (two lookups before their backwards, a pipeline's lookup ahead) first copies its
rows in again, so it updates what the unstaged backward would read.

With ``prefetch`` (``TableBatchedEmbedding.prefetch``: the next batch's ids, given before the
current batch's backward) the next batch's stage is made ahead and its rows are copied in on
a side stream while the current step computes and copies its own rows back: the link carries
both directions at once. Rows the next batch shares with a stage not yet written back are
not read then; that stage's write-back copies them across from its updated stage (device to
device), and every later write-back of this module does the same for the rows it shares, so
the stage ahead holds what the host would. The next lookup takes it when its ``indices`` and
``offsets`` are those given to ``prefetch`` (the same tensors or equal ones; those unchanged
since: their version counters) and the module's buffers were not written since but by its
staged write-backs (theirs); anything else drops it (after its copy) and stages as above.
Rows skipped for a stage that never wrote back are read from the host then. The host rows
themselves are never stale: the side stream only writes the stage ahead.

Only what this can reproduce exactly is staged: a fused optimizer whose states are
``momentum1`` / ``momentum2`` (not the counter's, global decay's or the whole-table steps'),
no ``max_norm``, no stochastic rounding of half rows (its noise is drawn per row key);
everything else looks up unstaged. ``FBTD_HOST_STAGE`` (``knobs.py``) turns it off or on
everywhere (the CPU tests).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from fbtriton_dist import knobs, optim
from fbtriton_dist.modules import fused_optim, host_tier
from fbtriton_dist.ops import row_stage
from fbtriton_dist.ops.tbe import FusedOptimizer, TBELayout, capturing

__all__ = ["Ahead", "Clock", "Stage", "Stager", "TablePlan", "stage", "stageable"]


class Clock:
    """Rows written back by a module's staged backwards so far (a stage made before the last
    write is copied in again before its backward), and stages made."""

    def __init__(self) -> None:
        self.writes = 0
        self.made = 0


@dataclass(eq=False)
class TablePlan:
    """Per-table tensors of a layout on one device (made once per layout)."""

    row_start: torch.Tensor  # [Tt] int64 first linear row of each table
    elem_start: torch.Tensor  # [Tt] int64 first element of each table in the flat buffers
    dims: torch.Tensor  # [Tt] int64 D of each table
    feature_table: torch.Tensor  # [T] int64 table of each feature
    num_tables: int

    @staticmethod
    def of(layout: TBELayout, table_offsets, device) -> TablePlan:
        rows = layout.table_rows
        dims = [0] * len(rows)
        for f, t in enumerate(layout.feature_table_map):
            dims[t] = int(layout.dims[f])
        starts = [0]
        for E in rows[:-1]:
            starts.append(starts[-1] + E)

        def tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return TablePlan(tensor(starts), tensor(list(table_offsets[: len(rows)])), tensor(dims),
                         tensor(layout.feature_table_map), len(rows))


def stageable(optimizer, fused: FusedOptimizer, weights: torch.Tensor, max_norm) -> bool:
    """A training lookup with this optimizer can be staged exactly (module docstring)."""
    if fused.counters is not None or max_norm is not None:
        return False
    if isinstance(optimizer, (*fused_optim.WHOLE_TABLE_STEP, optim.RowWiseAdagradGlobalDecay)):
        return False
    if fused.stochastic_rounding and weights.dtype != torch.float32:
        return False
    return all(s.name in ("momentum1", "momentum2") for s in optim.spec_of(optimizer).states)


@dataclass(eq=False)
class Stage:
    """One staged lookup: what its kernels read instead of the module's buffers, and the
    copies in and back."""

    weights: torch.Tensor
    indices: torch.Tensor
    layout: TBELayout
    fused: FusedOptimizer
    count: torch.Tensor  # [1] int64 distinct rows
    host_elem: torch.Tensor
    stage_elem: torch.Tensor
    dims: torch.Tensor
    host_key: torch.Tensor  # [N] int64 linear row of each stage row, ascending; then sentinels
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    kinds: list[int]
    clock: Clock
    seen: int = 0
    serial: int = 0  # its place among the module's stages

    def lookup_arguments(self) -> tuple[torch.Tensor, torch.Tensor, TBELayout, FusedOptimizer]:
        """(weights, indices, layout, fused) of the lookup on the stage."""
        return self.weights, self.indices, self.layout, self.fused

    def copy(self, to_stage: bool, dims: torch.Tensor | None = None,
             programs: int | None = None) -> None:
        """Its rows in from the module's buffers or back (``dims``: the rows' D, 0 for a row
        not to copy; ``programs``: the kernel's grid at most)."""
        row_stage.stage_rows(self.count, self.host_elem, self.stage_elem,
                             self.dims if dims is None else dims, self.host_key, self.pairs,
                             self.kinds, self.layout.max_D, to_stage, programs=programs)

    def shared_with(self, other: Stage) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_other, place): whether each stage row of this stage is a row ``other`` holds,
        and its stage row there (on the device; no host sync)."""
        place = torch.searchsorted(other.host_key, self.host_key)
        place.clamp_(max=other.host_key.numel() - 1)
        rows = torch.arange(self.host_key.numel(), device=self.host_key.device)
        in_other = ((rows < self.count) & (place < other.count)
                    & (other.host_key[place] == self.host_key))
        return in_other, place

    def take_from(self, other: Stage) -> None:
        """Copy the rows this stage shares with ``other`` from ``other``'s stage (after its
        update: device to device)."""
        in_other, place = self.shared_with(other)
        row_stage.stage_rows(self.count, other.stage_elem[place], self.stage_elem,
                             torch.where(in_other, self.dims, 0), place,
                             [(o, s) for (_, o), (_, s) in zip(other.pairs, self.pairs,
                                                               strict=True)],
                             self.kinds, self.layout.max_D, True)

    def attach(self, out: torch.Tensor, stager: Stager) -> None:
        """Copy the rows back after ``out``'s backward (the fused update), and in again
        before it if another staged backward wrote rows since they were copied."""
        node = out.grad_fn
        if node is None or "TBELookup" not in node.name():  # the update's own node, not after
            raise RuntimeError(f"host stage: expected the TBE lookup's output, got one of "
                               f"{node.name() if node is not None else 'no autograd node'}")
        stager.live.add(self)

        def before(grad_outputs):
            if self.seen != self.clock.writes:
                self.copy(to_stage=True)

        def after(grad_inputs, grad_outputs):
            stager.write_back(self)

        node.register_prehook(before)
        node.register_hook(after)


def stage(weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
          layout: TBELayout, fused: FusedOptimizer, optimizer, tables: TablePlan,
          clock: Clock) -> Stage:
    """Find the batch's distinct rows and make their stage (not copied in yet): what the
    lookup reads instead (module docstring)."""
    dev = indices.device
    N = indices.numel()
    T = layout.num_features
    B = (offsets.numel() - 1) // T
    sentinel = layout.num_rows
    ids = indices.to(torch.int64)
    pos = torch.arange(N, device=dev)
    feature = (torch.searchsorted(offsets[1:], pos, right=True) // max(B, 1)).clamp_(max=T - 1)
    valid = (ids >= 0) & (ids < layout.rows[feature])
    keys = torch.where(valid, layout.row_offsets[feature] + ids, sentinel)
    sorted_keys, perm = torch.sort(keys)
    first = torch.ones(N, dtype=torch.bool, device=dev)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    first &= sorted_keys < sentinel
    rank = torch.cumsum(first, 0) - 1  # stage row of each sorted id
    count = rank[-1:] + 1
    row_key = torch.full((N + 1,), sentinel, dtype=torch.int64, device=dev)
    row_key[torch.where(first, rank, N)] = sorted_keys
    row_key = row_key[:N]  # linear row of each stage row; the sentinel past count
    # the stage rows are in key order, so each table's segment starts where its first row
    # would sort (a search, not a count: N adds onto a few counters serialise)
    seg_rows = torch.searchsorted(row_key, tables.row_start)  # R_t: each table's first stage row
    per_table = torch.diff(seg_rows, append=count)
    seg_elems = torch.cumsum(per_table * tables.dims, 0) - per_table * tables.dims  # S_t
    table = (torch.searchsorted(tables.row_start, row_key, right=True) - 1).clamp_(min=0)
    D = tables.dims[table]
    local = pos - seg_rows[table]  # j: the row's place in its table's segment
    host_elem = tables.elem_start[table] + (row_key - tables.row_start[table]) * D
    stage_elem = seg_elems[table] + local * D
    stage_ids = torch.empty(N, dtype=torch.int64, device=dev)
    stage_ids[perm] = local[rank.clamp(min=0)]
    stage_ids = torch.where(valid, stage_ids, ids).to(indices.dtype)

    distinct = min(N, sentinel)  # at most one stage row per id, and per row of the tables
    cap = distinct * layout.max_D
    pairs = [(weights.detach(), torch.empty(cap, dtype=weights.dtype, device=dev))]
    kinds = [row_stage.PER_ELEMENT]
    states = {}
    for s in optim.spec_of(optimizer).states:
        flat = getattr(fused, s.name)
        rows = distinct if s.per_row else cap
        states[s.name] = torch.empty(rows, dtype=flat.dtype, device=dev)
        pairs.append((flat, states[s.name]))
        kinds.append(row_stage.PER_ROW if s.per_row else row_stage.PER_ELEMENT)
    ftab = tables.feature_table
    clock.made += 1
    return Stage(
        weights=pairs[0][1],
        indices=stage_ids,
        layout=dataclasses.replace(layout, w_offsets=seg_elems[ftab], row_offsets=seg_rows[ftab]),
        fused=dataclasses.replace(fused, **states),
        count=count, host_elem=host_elem, stage_elem=stage_elem, dims=D, host_key=row_key,
        pairs=pairs, kinds=kinds, clock=clock, seen=clock.writes, serial=clock.made,
    )


@dataclass(eq=False)
class Ahead:
    """A coming batch's stage, made by ``Stager.prefetch``, its rows being copied in (on a
    side stream on CUDA: ``done``, the copy's event, None once waited for or on the CPU)."""

    stage: Stage
    indices: torch.Tensor
    offsets: torch.Tensor
    versions: tuple  # the ids' and offsets' version counters (``_batch_versions``)
    buffers: tuple  # the module buffers' addresses and version counters (``_buffer_versions``)
    copied: torch.Tensor  # [N] int64 D of each row read ahead, else 0 (the copy's argument)
    skipped: torch.Tensor  # [N] int64 D of each row not read (a live stage held it), else 0
    waiting_on: set[int]  # serials of the live stages whose rows were skipped, not written back
    done: torch.cuda.Event | None

    def wait(self) -> None:
        """The current stream waits for the copy in."""
        if self.done is not None:
            torch.cuda.current_stream(self.stage.weights.device).wait_event(self.done)
            self.done = None


class Stager:
    """A module's staging: whether a training lookup is staged, its tables' plan (per
    layout), its clock, the stages not written back yet and the one made ahead."""

    PROGRAMS_PER_SM = 4
    """The side stream's copy in: programs per SM at most (room for the step beside it)."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.live: weakref.WeakSet[Stage] = weakref.WeakSet()
        self.ahead: Ahead | None = None
        self.staged = 0  # training lookups staged; stages made ahead, and those taken
        self.prefetched = 0
        self.prefetch_used = 0
        self._plan: tuple[TBELayout, TablePlan] | None = None
        self._side: torch.cuda.Stream | None = None
        self._captured = False

    def _applies(self, tbe, indices: torch.Tensor, layout: TBELayout,
                 fused: FusedOptimizer | None) -> bool:
        mode = knobs.host_stage()
        weights = tbe.weights
        if fused is None or mode == "0" or not host_tier.all_host(tbe.storage):
            return False
        if not indices.numel() or (mode == "auto"
                                   and not host_tier.maps_host_memory(weights.device)):
            return False
        if layout.num_rows is None or torch.compiler.is_compiling():
            return False
        return stageable(tbe.optimizer, fused, weights, tbe.max_norm)

    def _tables(self, tbe, layout: TBELayout) -> TablePlan:
        if self._plan is None or self._plan[0] is not layout:
            self._plan = (layout, TablePlan.of(layout, tbe.table_offsets, tbe.weights.device))
        return self._plan[1]

    def stage(self, tbe, indices: torch.Tensor, offsets: torch.Tensor, layout: TBELayout,
              fused: FusedOptimizer) -> Stage | None:
        """The training lookup's stage of TableBatchedEmbedding ``tbe`` (its ``layout`` and
        ``fused``), its rows copied in, or None where it looks up unstaged: not all tables
        ``host``, not mapped host memory (``FBTD_HOST_STAGE=auto``), staging off, an empty
        batch, under ``torch.compile`` / export, or what ``stageable`` refuses. The stage
        made ahead by ``prefetch`` where this is its batch (module docstring)."""
        if capturing(indices.device):
            self.ahead = None  # the capture began with a device sync: its copy is done
            self._captured = True
        if not self._applies(tbe, indices, layout, fused):
            self.drop_ahead()
            return None
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.wait()
            if self._takes(ahead, indices, offsets, layout, fused):
                staged = ahead.stage
                if ahead.waiting_on:  # a stage whose rows were skipped did not write back
                    staged.copy(to_stage=True, dims=ahead.skipped)
                names = [s.name for s in optim.spec_of(tbe.optimizer).states]
                staged.fused = dataclasses.replace(
                    fused, **{n: st for n, (_, st) in zip(names, staged.pairs[1:], strict=True)})
                staged.seen = self.clock.writes
                self.prefetch_used += 1
                self.staged += 1
                return staged
        staged = stage(tbe.weights, indices, offsets, layout, fused, tbe.optimizer,
                       self._tables(tbe, layout), self.clock)
        staged.copy(to_stage=True)
        self.staged += 1
        return staged

    def stats(self) -> dict[str, int]:
        """Training lookups staged, stages made ahead by ``prefetch``, and those a lookup
        took (cumulative)."""
        return {"staged": self.staged, "prefetched": self.prefetched,
                "prefetch_used": self.prefetch_used}

    def _takes(self, ahead: Ahead, indices, offsets, layout, fused) -> bool:
        """This lookup is of the batch ``ahead`` was made for (the same tensors, unchanged
        since, or equal ones: a compare that waits for the device), and nothing but this
        module's staged write-backs wrote its buffers since."""
        if self._plan is None or self._plan[0] is not layout:
            return False
        names = _state_names(ahead.stage, fused)
        if (ahead.versions != _batch_versions(ahead.indices, ahead.offsets)
                or ahead.buffers != _buffer_versions(
                    [ahead.stage.pairs[0][0], *(getattr(fused, n) for n in names)])):
            return False
        if ahead.indices is indices and ahead.offsets is offsets:
            return True
        return all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                   and torch.equal(a, b)
                   for a, b in ((ahead.indices, indices), (ahead.offsets, offsets)))

    def prefetch(self, tbe, indices: torch.Tensor, offsets: torch.Tensor, layout: TBELayout,
                 fused: FusedOptimizer | None) -> None:
        """Make the stage of a coming batch and start copying its rows in: on a side stream
        on CUDA (at most ``PROGRAMS_PER_SM`` programs per SM), at once on the CPU; rows a
        live stage holds are left to its write-back (module docstring). Nothing where its
        lookup would not be staged, under a capture, or once a capture recorded a staged
        lookup of this module (its replays stage their own rows)."""
        self.drop_ahead()
        if self._captured or capturing(indices.device):
            return
        if not self._applies(tbe, indices, layout, fused):
            return
        staged = stage(tbe.weights, indices, offsets, layout, fused, tbe.optimizer,
                       self._tables(tbe, layout), self.clock)
        dims = staged.dims
        live = list(self.live)
        for other in live:
            in_other, _ = staged.shared_with(other)
            dims = torch.where(in_other, 0, dims)
        done = None
        if indices.is_cuda:
            if self._side is None:
                self._side = torch.cuda.Stream(indices.device)
            self._side.wait_stream(torch.cuda.current_stream(indices.device))
            with torch.cuda.stream(self._side):
                staged.copy(to_stage=True, dims=dims, programs=self._programs(indices.device))
                done = torch.cuda.Event()
                done.record()
        else:
            staged.copy(to_stage=True, dims=dims)
        # every tensor the side stream reads lives until the current stream waited for it
        self.ahead = Ahead(staged, indices, offsets, _batch_versions(indices, offsets),
                           _buffer_versions([flat for flat, _ in staged.pairs]), dims,
                           staged.dims - dims, {other.serial for other in live}, done)
        self.prefetched += 1

    def _programs(self, device: torch.device) -> int:
        """The grid of a copy that runs beside another one (``PROGRAMS_PER_SM`` per SM)."""
        return torch.cuda.get_device_properties(device).multi_processor_count * (
            self.PROGRAMS_PER_SM)

    def write_back(self, staged: Stage) -> None:
        """Copy ``staged``'s rows back (after its update); the stage ahead takes the rows it
        shares."""
        flats = [flat for flat, _ in staged.pairs]
        before = _buffer_versions(flats)
        beside = self.ahead is not None and self.ahead.done is not None  # a copy in runs
        staged.copy(to_stage=False, programs=self._programs(staged.weights.device) if beside
                    else None)
        self.clock.writes += 1
        staged.seen = self.clock.writes
        self.live.discard(staged)
        ahead = self.ahead
        if ahead is None:
            return
        if ahead.buffers == before:  # the torch copy moved the counters: only this write
            ahead.buffers = _buffer_versions(flats)
        ahead.wait()
        ahead.stage.take_from(staged)
        ahead.stage.seen = self.clock.writes
        ahead.waiting_on.discard(staged.serial)

    def drop_ahead(self) -> None:
        """Forget the stage made ahead (after its copy: its buffers are freed on this
        stream)."""
        if self.ahead is not None:
            self.ahead.wait()
            self.ahead = None


def _batch_versions(indices: torch.Tensor, offsets: torch.Tensor) -> tuple[int, int]:
    """A batch's ids' and offsets' version counters (an in-place write moves them)."""
    return indices._version, offsets._version


def _buffer_versions(flats) -> tuple[tuple[int, int], ...]:
    """A module's weights' and states' addresses and version counters."""
    return tuple((t.data_ptr(), t._version) for t in flats)


def _state_names(staged: Stage, fused: FusedOptimizer) -> list[str]:
    """The states ``staged`` holds, in its pairs' order (the optimizer's)."""
    return [s.name for s in optim.spec_of(fused.optimizer).states][: len(staged.pairs) - 1]
