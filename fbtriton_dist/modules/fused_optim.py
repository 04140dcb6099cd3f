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


def check_ema_tables(optimizer, tiered: bool) -> None:
    """``optim.EmaInplaceRowWiseAdagrad`` runs over whole tables on the device (not with
    cached storage tiers)."""
    if isinstance(optimizer, optim.EmaInplaceRowWiseAdagrad) and tiered:
        raise ValueError(f"optimizer {type(optimizer).__name__}: expected no cached storage "
                         "tiers (its moving average runs over whole tables), got some")


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
