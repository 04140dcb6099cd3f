"""Optimizer classes that name a fused optimizer neither torch nor TorchRec has, for
``apply_optimizer_in_backward`` annotations (``optim.REGISTRY``'s ``TorchClass`` paths point
here): placeholders, as TorchRec's ``torchrec.optim.LAMB`` and the like, whose ``step`` never
runs: the TBE backward applies the update (``optim.FTRL``) to the rows of the batch. Also
the whole-table steps before a training lookup (``whole_table_step``) of
``optim.EmaInplaceRowWiseAdagrad`` (``ema_inplace``) and ``optim.EnsembleRowWiseAdagrad``
(``ensemble_and_swap``)."""

from collections.abc import Callable, Sequence

import torch

from fbtriton_dist import optim, optim_ensemble
from fbtriton_dist.ops import global_decay as global_decay_op
from fbtriton_dist.ops.tbe import capturing


class FTRL(torch.optim.Optimizer):
    """Names ``fbtriton_dist.optim.FTRL`` (FTRL-Proximal, fused only): its keywords are that
    config's fields, with its defaults."""

    def __init__(self, params, lr: float = 0.05, beta: float = 1.0, l1: float = 0.0,
                 l2: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "l1": l1, "l2": l2})

    def step(self, closure=None):
        raise NotImplementedError(
            "fbtriton_dist.modules.fused_optim.FTRL is applied fused in the TBE backward "
            "(a collection or TableBatchedEmbedding reads the annotation); it has no step"
        )


class EmaInplaceRowWiseAdagrad(torch.optim.Optimizer):
    """Names ``fbtriton_dist.optim.EmaInplaceRowWiseAdagrad`` (FBGEMM's
    EMAINPLACE_ROWWISE_ADAGRAD, fused only): its keywords are that config's fields."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8, weight_decay: float = 0.0,
                 step_ema: float = 10.0, step_start: float = 0.0, step_ema_coef: float = 0.6,
                 weight_decay_mode: str = "l2") -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay,
                                  "step_ema": step_ema, "step_start": step_start,
                                  "step_ema_coef": step_ema_coef,
                                  "weight_decay_mode": weight_decay_mode})

    def step(self, closure=None):
        raise NotImplementedError(
            "fbtriton_dist.modules.fused_optim.EmaInplaceRowWiseAdagrad is applied fused in the "
            "TBE (a collection or TableBatchedEmbedding reads the annotation); it has no step"
        )


class EnsembleRowWiseAdagrad(torch.optim.Optimizer):
    """Names ``fbtriton_dist.optim.EnsembleRowWiseAdagrad`` (FBGEMM's ENSEMBLE_ROWWISE_ADAGRAD,
    fused only): its keywords are that config's fields, or FBGEMM's: ``ensemble_mode`` (an
    ``EnsembleModeDefinition`` or a mapping of its fields) in place of the ``step_*`` ones."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8, weight_decay: float = 0.0,
                 weight_decay_mode="none", **schedule) -> None:
        unknown = sorted(set(schedule) - {*optim_ensemble.MODE_FIELDS, "ensemble_mode"})
        if unknown:
            raise ValueError(f"EnsembleRowWiseAdagrad: expected keywords among lr, eps, "
                             f"weight_decay, weight_decay_mode, ensemble_mode, "
                             f"{', '.join(optim_ensemble.MODE_FIELDS)}; got {unknown[0]!r}")
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay,
                                  "weight_decay_mode": weight_decay_mode,
                                  **optim_ensemble.ensemble_kwargs(schedule)})

    def step(self, closure=None):
        raise NotImplementedError(
            "fbtriton_dist.modules.fused_optim.EnsembleRowWiseAdagrad is applied fused in the "
            "TBE (a collection or TableBatchedEmbedding reads the annotation); it has no step"
        )


class RowWiseRMSpropAR(torch.optim.Optimizer):
    """Names ``fbtriton_dist.optim.RowWiseRMSpropAR`` (fused only): its keywords are that
    config's fields, with its defaults."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-8, ar_alpha: float = 0.0,
                 ema_beta: float = 0.99, min_shrinkage: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "ar_alpha": ar_alpha,
                                  "ema_beta": ema_beta, "min_shrinkage": min_shrinkage})

    def step(self, closure=None):
        raise NotImplementedError(
            "fbtriton_dist.modules.fused_optim.RowWiseRMSpropAR is applied fused in the TBE "
            "backward (a collection or TableBatchedEmbedding reads the annotation); it has no "
            "step"
        )


class RowWiseAdagradWithCounter(torch.optim.Optimizer):
    """Names ``fbtriton_dist.optim.RowWiseAdagradWithCounter`` (fused only): its keywords are
    that config's fields (FBGEMM's), with its defaults. TorchRec's ``RowWiseAdagrad`` with
    ``weight_decay_mode`` COUNTER or COWCLIP maps to the same config."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-10, weight_decay: float = 0.0,
                 weight_decay_mode="counter", counter_based_regularization=None,
                 cowclip_regularization=None) -> None:
        super().__init__(params, {
            "lr": lr, "eps": eps, "weight_decay": weight_decay,
            "weight_decay_mode": weight_decay_mode,
            "counter_based_regularization": counter_based_regularization,
            "cowclip_regularization": cowclip_regularization})

    def step(self, closure=None):
        raise NotImplementedError(
            "fbtriton_dist.modules.fused_optim.RowWiseAdagradWithCounter is applied fused in "
            "the TBE backward (a collection or TableBatchedEmbedding reads the annotation); it "
            "has no step"
        )


class RowWiseAdagradGlobalDecay(torch.optim.Optimizer):
    """Names ``fbtriton_dist.optim.RowWiseAdagradGlobalDecay`` (fused only): its keywords are
    that config's fields (FBGEMM's), with its defaults. TorchRec's ``RowWiseAdagrad`` with
    ``weight_decay_mode`` DECOUPLE_GLOBAL maps to the same config."""

    def __init__(self, params, lr: float = 0.01, eps: float = 1e-10, weight_decay: float = 0.0,
                 weight_decay_mode="decoupled_global", global_weight_decay=None) -> None:
        super().__init__(params, {"lr": lr, "eps": eps, "weight_decay": weight_decay,
                                  "weight_decay_mode": weight_decay_mode,
                                  "global_weight_decay": global_weight_decay})

    def step(self, closure=None):
        raise NotImplementedError(
            "fbtriton_dist.modules.fused_optim.RowWiseAdagradGlobalDecay is applied fused in "
            "the TBE backward (a collection or TableBatchedEmbedding reads the annotation); it "
            "has no step"
        )


def global_decay(tbe, indices: torch.Tensor, offsets: torch.Tensor) -> None:
    """Before the lookup of a training step of ``tbe`` (a ``TableBatchedEmbedding`` with
    ``optim.RowWiseAdagradGlobalDecay``): the rows of the batch pay the decay they missed
    (``ops/global_decay.py``; t = the module's step + 1, FBGEMM's ``iter``)."""
    if capturing(tbe.weights.device):
        raise RuntimeError("RowWiseAdagradGlobalDecay: the catch-up decay reads the batch's "
                           "feature bounds on the host; it cannot be captured in a CUDA graph")
    features = [(tbe.table_offsets[t], tbe.table_row_offsets[t], *tbe.slot_tables[t])
                for t in tbe.feature_table_map]
    global_decay_op.global_decay(tbe.weights, tbe.prev_iter, indices, offsets, features,
                                 tbe.step + 1, tbe.optimizer)


def check_ema_tables(optimizer, tiered: bool) -> None:
    """``optim.EmaInplaceRowWiseAdagrad`` runs over whole tables on the device, and
    ``optim.RowWiseAdagradWithCounter``'s ``max_counter`` reads every row's counter: neither
    with cached storage tiers (nor ``optim.RowWiseAdagradGlobalDecay``, whose catch-up runs
    before the cache maps ids to slots)."""
    why = {optim.EmaInplaceRowWiseAdagrad: "its moving average runs over whole tables",
           optim.EnsembleRowWiseAdagrad: "its moving average and swap run over whole tables",
           optim.RowWiseAdagradWithCounter: "its max_counter reads every row's counter",
           optim.RowWiseAdagradGlobalDecay: "its prev_iter would follow cache slots, not rows"}
    if type(optimizer) in why and tiered:
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected no cached storage "
                         f"tiers ({why[type(optimizer)]}), got some")


@torch.no_grad()
def ema_inplace(optimizer, tables: Callable[[], Sequence[torch.Tensor]], k: int) -> None:
    """Before the lookup of training step ``k``: ``optim.EmaInplaceRowWiseAdagrad``'s moving
    average, in place on every ``[E, D]`` table of ``tables()`` (``w[:, D/2:]`` moves
    ``step_ema_coef`` of the way toward ``w[:, :D/2]``) when ``optimizer.ema_due(k)``; nothing
    for other optimizers. ``tables`` is called only then: per-table views are ops per table."""
    if not isinstance(optimizer, optim.EmaInplaceRowWiseAdagrad) or not optimizer.ema_due(k):
        return
    tables = tables()
    odd = [f"{t} (D={table.shape[1]})" for t, table in enumerate(tables) if table.shape[1] % 2]
    if odd:  # checked here, when it runs, as FBGEMM does
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected every table's D "
                         f"even (its second half is the first's moving average), got tables "
                         f"{odd}")
    for table in tables:
        half = table.shape[1] // 2
        table[:, half:].lerp_(table[:, :half], optimizer.step_ema_coef)


@torch.no_grad()
def ensemble_and_swap(optimizer, tables: Sequence[torch.Tensor],
                      slow: Sequence[torch.Tensor], k: int) -> None:
    """Before the lookup of training step ``k``: ``optim.EnsembleRowWiseAdagrad``'s step over
    every ``[E, D]`` table and its slow copy ``momentum2`` (``slow``, ``[E, D]`` each), in
    place, in the slow copy's dtype (FBGEMM's order: the moving average from the rows as they
    were, then the swap, then ``step_mode="none"``'s reset)."""
    ema, swap, coef = optimizer.schedule(k)
    if not (ema or swap):
        return
    for table, s in zip(tables, slow, strict=True):
        rows = table.to(s.dtype)
        if ema:
            s.lerp_(rows, 1.0 - coef)
        if swap:
            table.copy_(s)
        if ema and optimizer.step_mode == "none":
            s.zero_()


WHOLE_TABLE_STEP = (optim.EmaInplaceRowWiseAdagrad, optim.EnsembleRowWiseAdagrad)
"""The fused optimizers with a step over whole tables before each training lookup."""


def refuse_whole_table_steps(optimizers: Sequence, where: str) -> None:
    """Raise ValueError where one of ``optimizers`` (configs or None) has a whole-table step:
    ``where`` (a CUDA graph) would skip it, as its schedule is chosen on the host by the step
    count before each training lookup."""
    names = sorted({optim.spec_of(o).name for o in optimizers if isinstance(o, WHOLE_TABLE_STEP)})
    if names:
        raise ValueError(
            f"{where}: expected fused optimizers without a whole-table step, got {names} (its "
            "moving average / swap is chosen on the host by the step count before each "
            "training lookup; a replayed CUDA graph would skip it): train them eagerly")


def whole_table_step(tbe, k: int) -> None:
    """Before the lookup of training step ``k`` of ``tbe`` (a ``TableBatchedEmbedding``): the
    whole-table step of its optimizer, if it has one (EMA in place, ensemble)."""
    if isinstance(tbe.optimizer, optim.EmaInplaceRowWiseAdagrad):
        ema_inplace(tbe.optimizer, tbe.split_slot_weights, k)
    elif isinstance(tbe.optimizer, optim.EnsembleRowWiseAdagrad):
        if not any(tbe.optimizer.schedule(k)[:2]):
            return  # nothing due: no per-table views (ops per table)
        slow = [states[1] for states in tbe.split_optimizer_states()]
        ensemble_and_swap(tbe.optimizer, tbe.split_slot_weights(), slow, k)


def counter_tensors(tbe) -> dict[str, torch.Tensor] | None:
    """``optim.RowWiseAdagradWithCounter``'s state besides ``momentum1``, for the backward
    (``ops.tbe.FusedOptimizer.counters``): the module's ``prev_iter``, ``row_counter`` and
    ``max_counter`` buffers, and ``row_counter_max`` where set (``set_row_counter_max``);
    None for other optimizers."""
    if not isinstance(tbe.optimizer, optim.RowWiseAdagradWithCounter):
        return None
    out = {"prev_iter": tbe.prev_iter, "row_counter": tbe.row_counter,
           "max_counter": tbe.max_counter}
    if tbe.row_counter_max is not None:
        out["row_counter_max"] = tbe.row_counter_max
    return out


def set_row_counter_max(tbe, value: torch.Tensor | None) -> None:
    """Rowwise Adagrad with counter: the largest row counter that ``tbe``'s next
    ``max_counter`` refreshes use instead of its own rows' (``value``, [1] fp32; None: its
    own). A sharded table's shard gets its table's over every rank's shards before each step
    that refreshes it (the sharding layer's all-reduce), so the shards scale their rates as
    the unsharded table does."""
    if value is not None and (value.numel() != 1 or value.dtype != torch.float32):
        raise ValueError(f"row_counter_max: expected a [1] fp32 tensor, got {value.dtype} of "
                         f"shape {tuple(value.shape)}")
    tbe.row_counter_max = value


def counter_extra_state(tbe) -> dict[str, float]:
    """The module's extra state beyond its step: ``max_counter`` (with the counter optimizer,
    as FBGEMM keeps it in its state dict; the per-row states are buffers)."""
    if not isinstance(tbe.optimizer, optim.RowWiseAdagradWithCounter):
        return {}
    return {"max_counter": float(tbe.max_counter.item())}


def set_counter_extra_state(tbe, state: dict) -> None:
    """Restore ``counter_extra_state`` (1, FBGEMM's start, where the state has none)."""
    tbe.max_counter.fill_(float(state.get("max_counter", 1.0)))
