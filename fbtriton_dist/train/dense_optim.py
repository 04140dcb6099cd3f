"""A dense Adagrad that a CUDA graph can replay (``train.pipeline: graph``).

torch's ``Adagrad`` counts its steps in host tensors, so a replayed ``step()`` would not count
(and it has no ``capturable`` flag as Adam has). :class:`CapturableAdagrad` applies the same
update as torch's single-tensor Adagrad (``lr_decay`` 0, as the job builds it), with the step
count on the parameters' device; its state (``step``, ``sum``) and param groups have
Adagrad's keys, so a checkpoint of one loads into the other.
"""

from __future__ import annotations

import torch

__all__ = ["CapturableAdagrad"]


class CapturableAdagrad(torch.optim.Optimizer):
    """``torch.optim.Adagrad(params, lr, weight_decay=..., eps=...)`` (no ``lr_decay``, no
    ``maximize``, dense gradients), capture-safe: no host reads, the step count on the device.
    ``lr`` is read at each ``step()`` call: under a CUDA graph, the value at capture."""

    def __init__(self, params, lr: float = 1e-2, weight_decay: float = 0.0,
                 eps: float = 1e-10) -> None:
        if lr < 0 or weight_decay < 0 or eps < 0:
            raise ValueError(f"CapturableAdagrad: expected lr, weight_decay, eps >= 0, got "
                             f"{lr}, {weight_decay}, {eps}")
        defaults = {"lr": lr, "lr_decay": 0, "weight_decay": weight_decay,
                    "initial_accumulator_value": 0, "eps": eps, "foreach": None,
                    "maximize": False, "differentiable": False, "fused": None}
        super().__init__(params, defaults)
        for group in self.param_groups:  # made up front, as torch's Adagrad does
            for p in group["params"]:
                state = self.state[p]
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("lr_decay", 0) or group.get("maximize", False):
                raise ValueError("CapturableAdagrad: expected lr_decay 0 and maximize False, "
                                 f"got {group.get('lr_decay')}, {group.get('maximize')}")
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                count = state["step"]
                if count.device != p.device:  # loaded from torch's Adagrad (a host count)
                    state["step"] = count = count.to(device=p.device, dtype=torch.float32)
                count.add_(1)
                grad = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                state["sum"].addcmul_(grad, grad, value=1)
                std = state["sum"].sqrt().add_(eps)
                p.addcdiv_(grad, std, value=-lr)
        return loss
