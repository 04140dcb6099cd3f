"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

A checkpoint is a folder ``<dir>/step_<step:08d>/`` holding DCP's files and ``meta.json``. It is
written into ``<dir>/.tmp-step_<step>/`` and renamed when every rank has finished, so a crash
while saving leaves the older checkpoints as they were; :func:`latest_checkpoint` only ever
sees complete ones.

What is saved, under these top-level keys:

* ``model``: ``model.state_dict()`` (embedding tables as ``...embedding_bags.<t>.weight``,
  dense layers); sharded tables are saved as their shards, and DCP reshards them on load.
* ``fused``: the fused embedding optimizer's state per table (``<module>.<table>.momentum1``,
  ``momentum2``, ``step``).
* ``dense_optim``: the dense optimizer (``get_optimizer_state_dict``: keyed by parameter name).
* ``train``: the step counter and the data position (epoch, samples consumed).

Nothing is read with ``torch.load``; ``meta.json`` is plain JSON.

DCP's default planners "flatten" nested ShardedTensors (an FSDP-2D feature we do not use), and
that step drops a ShardedTensor with no shard on this rank (a table-wise table owned by another
rank). On load the dropped key then looks missing, DCP falls back to its pre-2.4 key format, and
the load fails on the dense optimizer's ``param_groups`` ("Missing key in checkpoint
state_dict: dense_optim.param_groups"). Both planners are therefore built with
``flatten_sharded_tensors=False``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "fused_optimizer_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
META = "meta.json"


def _embedding_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules holding embedding tables with a fused optimizer: ours, unsharded or sharded
    (both offer ``fused_optimizer_state_dict()``)."""
    return [
        (fqn, m) for fqn, m in model.named_modules() if hasattr(m, "fused_optimizer_state_dict")
    ]


def fused_optimizer_state_dict(model: nn.Module) -> dict[str, Any]:
    """``{"<module fqn>.<table>.<state>": tensor or int}`` for every embedding module."""
    out: dict[str, Any] = {}
    for fqn, m in _embedding_modules(model):
        state = m.fused_optimizer_state_dict()
        out.update({f"{fqn}.{k}" if fqn else k: v for k, v in state.items()})
    return out


def _load_fused_scalars(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Tensors were loaded in place; scalars (step counts) come back as new objects."""
    for fqn, m in _embedding_modules(model):
        prefix = f"{fqn}." if fqn else ""
        mine = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        m.load_fused_optimizer_state_dict(mine)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, train: dict[str, Any]) -> dict:
    return {
        "model": model.state_dict(),
        "fused": fused_optimizer_state_dict(model),
        "dense_optim": get_optimizer_state_dict(model, optimizer),
        "train": train,
    }


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group)


@contextlib.contextmanager
def _quiet_dcp(group: dist.ProcessGroup | None):
    """DCP warns that it "assumes a single process" even when told so (``no_dist``), and that
    ShardedTensor (TorchRec's sharded state dict type, which the sharded tables use) is
    deprecated: neither is news to the user."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*deprecating ShardedTensor", category=FutureWarning
        )
        if group is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(
    directory: str,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: Mapping[str, Any],
    *,
    keep: int = 2,
    process_group: dist.ProcessGroup | None = None,
) -> str:
    """Save into ``directory/step_<step>`` atomically; keep the newest ``keep``; return it."""
    rank = _rank(process_group)
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = os.path.join(directory, f".tmp-step_{step:08d}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash while saving
        os.makedirs(tmp)
    _barrier(process_group)
    with _quiet_dcp(process_group):
        dcp.save(
            _state(model, optimizer, dict(train_state)),
            checkpoint_id=tmp,
            process_group=process_group,
            planner=DefaultSavePlanner(flatten_sharded_tensors=False),
            no_dist=process_group is None,
        )
    _barrier(process_group)
    if rank == 0:
        meta = {"step": step, **train_state}
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # saving the same step again: swap, then drop the old one
            old = os.path.join(directory, f".old-step_{step:08d}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        for stale in _complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(stale[1], ignore_errors=True)
    _barrier(process_group)
    return final


def _complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(os.path.join(path, META)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint folder under ``directory``, or None."""
    found = _complete_checkpoints(directory)
    return found[-1][1] if found else None


def load_checkpoint(
    path: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load ``path`` into ``model`` (tables, dense layers, fused optimizer state) and
    ``optimizer``; return the saved train state (``step``, ``epoch``, ``samples``, ...)."""
    with open(os.path.join(path, META), encoding="utf-8") as f:
        meta = json.load(f)
    state = _state(model, optimizer, {k: v for k, v in meta.items() if k != "step"} | {"step": 0})
    with _quiet_dcp(process_group):
        dcp.load(
            state,
            checkpoint_id=path,
            process_group=process_group,
            planner=DefaultLoadPlanner(flatten_sharded_tensors=False),
            no_dist=process_group is None,
        )
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["dense_optim"])
    _load_fused_scalars(model, state["fused"])
    return dict(state["train"])
