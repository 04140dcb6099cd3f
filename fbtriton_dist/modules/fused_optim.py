"""Optimizer classes that name a fused optimizer neither torch nor TorchRec has, for
``apply_optimizer_in_backward`` annotations (``optim.REGISTRY``'s ``TorchClass`` paths point
here): placeholders, as TorchRec's ``torchrec.optim.LAMB`` and the like, whose ``step`` never
runs: the TBE backward applies the update (``optim.FTRL``) to the rows of the batch."""

import torch


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
