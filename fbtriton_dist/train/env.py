"""``Env``: where this process runs. Built by ``job.distributed``, read by the job and the loop
(it sits below both, so the loop needs nothing from the job)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Env"]


@dataclass(frozen=True)
class Env:
    """Where this process runs: its rank, the world, its device and process group."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    process_group: dist.ProcessGroup | None
