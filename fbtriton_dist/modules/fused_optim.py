"""Optimizer classes that name a fused optimizer neither torch nor TorchRec has, for
``apply_optimizer_in_backward`` annotations (``optim.REGISTRY``'s ``TorchClass`` paths point
here): placeholders, as TorchRec's ``torchrec.optim.LAMB`` and the like, whose ``step`` never
runs: the TBE backward applies the update (``optim.FTRL``) to the rows of the batch. Also
the whole-table step of ``optim.EmaInplaceRowWiseAdagrad`` (``ema_inplace``)."""

from collections.abc import Sequence

import torch

from fbtriton_dist import optim


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


def check_ema_tables(optimizer, tiered: bool) -> None:
    """``optim.EmaInplaceRowWiseAdagrad`` runs over whole tables on the device, and
    ``optim.RowWiseAdagradWithCounter``'s ``max_counter`` reads every row's counter: neither
    with cached storage tiers."""
    why = {optim.EmaInplaceRowWiseAdagrad: "its moving average runs over whole tables",
           optim.RowWiseAdagradWithCounter: "its max_counter reads every row's counter"}
    if type(optimizer) in why and tiered:
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected no cached storage "
                         f"tiers ({why[type(optimizer)]}), got some")


@torch.no_grad()
def ema_inplace(optimizer, tables: Sequence[torch.Tensor], k: int) -> None:
    """Before the lookup of training step ``k``: ``optim.EmaInplaceRowWiseAdagrad``'s moving
    average, in place on every ``[E, D]`` table (``w[:, D/2:]`` moves ``step_ema_coef`` of the
    way toward ``w[:, :D/2]``) when ``optimizer.ema_due(k)``; nothing for other optimizers."""
    if not isinstance(optimizer, optim.EmaInplaceRowWiseAdagrad) or not optimizer.ema_due(k):
        return
    odd = [f"{t} (D={table.shape[1]})" for t, table in enumerate(tables) if table.shape[1] % 2]
    if odd:  # checked here, when it runs, as FBGEMM does
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected every table's D "
                         f"even (its second half is the first's moving average), got tables "
                         f"{odd}")
    for table in tables:
        half = table.shape[1] // 2
        table[:, half:].lerp_(table[:, :half], optimizer.step_ema_coef)


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
