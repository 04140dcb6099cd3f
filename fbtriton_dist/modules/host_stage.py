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

Only what this can reproduce exactly is staged: a fused optimizer whose states are
``momentum1`` / ``momentum2`` (not the counter's, global decay's or the whole-table steps'),
no ``max_norm``, no stochastic rounding of half rows (its noise is drawn per row key);
everything else looks up unstaged. ``FBTD_HOST_STAGE`` (``knobs.py``) turns it off or on
everywhere (the CPU tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fbtriton_dist import knobs, optim
from fbtriton_dist.modules import fused_optim, host_tier
from fbtriton_dist.ops import row_stage
from fbtriton_dist.ops.tbe import FusedOptimizer, TBELayout

__all__ = ["Clock", "Stage", "Stager", "TablePlan", "stage", "stageable"]


class Clock:
    """Rows written back by a module's staged backwards so far: a stage made before the last
    write is copied in again before its backward."""

    def __init__(self) -> None:
        self.writes = 0


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
    host_key: torch.Tensor
    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    kinds: list[int]
    clock: Clock
    seen: int = 0

    def lookup_arguments(self) -> tuple[torch.Tensor, torch.Tensor, TBELayout, FusedOptimizer]:
        """(weights, indices, layout, fused) of the lookup on the stage."""
        return self.weights, self.indices, self.layout, self.fused

    def copy(self, to_stage: bool) -> None:
        row_stage.stage_rows(self.count, self.host_elem, self.stage_elem, self.dims,
                             self.host_key, self.pairs, self.kinds, self.layout.max_D, to_stage)

    def attach(self, out: torch.Tensor) -> None:
        """Copy the rows back after ``out``'s backward (the fused update), and in again
        before it if another staged backward wrote rows since they were copied."""
        node = out.grad_fn
        if node is None or "TBELookup" not in node.name():  # the update's own node, not after
            raise RuntimeError(f"host stage: expected the TBE lookup's output, got one of "
                               f"{node.name() if node is not None else 'no autograd node'}")

        def before(grad_outputs):
            if self.seen != self.clock.writes:
                self.copy(to_stage=True)

        def after(grad_inputs, grad_outputs):
            self.copy(to_stage=False)
            self.clock.writes += 1
            self.seen = self.clock.writes

        node.register_prehook(before)
        node.register_hook(after)


def stage(weights: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
          layout: TBELayout, fused: FusedOptimizer, optimizer, tables: TablePlan,
          clock: Clock) -> Stage:
    """Find the batch's distinct rows, copy them and their states into a new stage, and
    return what the lookup reads instead (module docstring)."""
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
    staged = Stage(
        weights=pairs[0][1],
        indices=stage_ids,
        layout=dataclasses.replace(layout, w_offsets=seg_elems[ftab], row_offsets=seg_rows[ftab]),
        fused=dataclasses.replace(fused, **states),
        count=count, host_elem=host_elem, stage_elem=stage_elem, dims=D, host_key=row_key,
        pairs=pairs, kinds=kinds, clock=clock, seen=clock.writes,
    )
    staged.copy(to_stage=True)
    return staged


class Stager:
    """A module's staging: whether a training lookup is staged, its tables' plan (per
    layout), its clock."""

    def __init__(self) -> None:
        self.clock = Clock()
        self._plan: tuple[TBELayout, TablePlan] | None = None

    def stage(self, tbe, indices: torch.Tensor, offsets: torch.Tensor, layout: TBELayout,
              fused: FusedOptimizer) -> Stage | None:
        """The training lookup's stage of TableBatchedEmbedding ``tbe`` (its ``layout`` and
        ``fused``), or None where it looks up unstaged: not all tables ``host``, not mapped
        host memory (``FBTD_HOST_STAGE=auto``), staging off, an empty batch, under
        ``torch.compile`` / export, or what ``stageable`` refuses."""
        mode = knobs.host_stage()
        weights = tbe.weights
        if mode == "0" or not host_tier.all_host(tbe.storage) or not indices.numel():
            return None
        if mode == "auto" and not host_tier.maps_host_memory(weights.device):
            return None
        if layout.num_rows is None or torch.compiler.is_compiling():
            return None
        if not stageable(tbe.optimizer, fused, weights, tbe.max_norm):
            return None
        if self._plan is None or self._plan[0] is not layout:
            self._plan = (layout, TablePlan.of(layout, tbe.table_offsets, weights.device))
        return stage(weights, indices, offsets, layout, fused, tbe.optimizer, self._plan[1],
                     self.clock)
