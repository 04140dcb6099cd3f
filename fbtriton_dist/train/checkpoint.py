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
``flatten_sharded_tensors=False``. The load planner is ``sharding/managed/state.py``'s
``ManagedLoadPlanner`` (the default one otherwise): a managed table's id map saved by other
owners (another world size) is re-inserted at the owner of each id's hash on load.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from fbtriton_dist.sharding.managed.state import ManagedLoadPlanner

__all__ = [
    "checkpoint_steps",
    "clean_stale",
    "fused_optimizer_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "nonfinite_weights",
    "read_meta",
    "remove_run_files",
    "save_checkpoint",
    "usable_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_STALE = re.compile(r"^\.(tmp|old)-step_\d{8,}$")
META = "meta.json"
CHECKSUM_LIMIT = 1 << 30
"""Files of a checkpoint are CRC32-summed at save (and checked at resume) while the whole
checkpoint is below this many bytes; above it only their names and sizes are recorded."""


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
    about: Mapping[str, Any] | None = None,
) -> str:
    """Save into ``directory/step_<step>`` atomically; keep the newest ``keep``; return it.
    ``about``: what the checkpoint holds (the job, its tables, its optimizers: ``job_identity``),
    kept in ``meta.json`` under ``job`` so that a resume into another job says what differs."""
    rank = _rank(process_group)
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = os.path.join(directory, f".tmp-step_{step:08d}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash while saving
        os.makedirs(tmp)
    _barrier(process_group)
    try:
        with _quiet_dcp(process_group):
            dcp.save(
                _state(model, optimizer, dict(train_state)),
                checkpoint_id=tmp,
                process_group=process_group,
                planner=DefaultSavePlanner(flatten_sharded_tensors=False),
                no_dist=process_group is None,
            )
    except (OSError, CheckpointException) as e:  # a full disk: the last good one stays
        os_error = e if isinstance(e, OSError) else next(
            (f[0] for f in e.failures.values() if isinstance(f[0], OSError)), None)
        if os_error is None:
            raise
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(os_error, tmp, directory) from e
    _barrier(process_group)
    if rank == 0:
        try:
            meta = {"step": step, **train_state, "files": _manifest(tmp)}
            if about is not None:
                meta["job"] = dict(about)
            with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _save_error(e, tmp, directory) from e
        if os.path.exists(final):  # saving the same step again: swap, then drop the old one
            old = os.path.join(directory, f".old-step_{step:08d}")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        # keep the newest `keep`, the one just written always among them
        complete = _complete_checkpoints(directory)
        others = [path for _, path in complete if path != final]
        for stale in others[: max(0, len(complete) - keep)]:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier(process_group)
    return final


def _local_tensors(value: Any) -> list[torch.Tensor]:
    """This rank's part of a state-dict value (a ShardedTensor's shards, a DTensor's local
    tensor, a tensor), floating-point only."""
    if hasattr(value, "local_shards"):
        parts = [s.tensor for s in value.local_shards()]
    elif hasattr(value, "to_local"):
        parts = [value.to_local()]
    else:
        parts = [value]
    return [t for t in parts if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.device.type != "meta"]


def table_of(key: str) -> str:
    """The table (``...embedding_bags.<t>.weight``) or dense parameter a state-dict key is."""
    parts = key.split(".")
    for marker in ("embedding_bags", "embeddings"):
        if marker in parts[:-1] and parts[-1] == "weight":
            return f"table {parts[parts.index(marker) + 1]}"
    return f"dense parameter {key}"


def nonfinite_weights(model: nn.Module, group: dist.ProcessGroup | None = None) -> list[str]:
    """The tables and dense parameters holding a nan or inf on some rank (every rank gets
    the same list; empty: all finite). ``not isfinite``, so inf counts as well as nan."""
    bad = sorted({table_of(k) for k, v in model.state_dict().items()
                  if any(not bool(torch.isfinite(t).all()) for t in _local_tensors(v))})
    if group is not None:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, bad, group=group)
        bad = sorted({name for names in gathered for name in names})
    return bad


def _save_error(e: OSError, tmp: str, directory: str) -> OSError:
    """An OSError that says which save failed and which checkpoint is still good."""
    kept = latest_checkpoint(directory) or "none (this was the first)"
    what = "no space left on device" if e.errno == errno.ENOSPC else str(e)
    return OSError(e.errno, f"checkpoint save into {tmp} failed: {what}; the unfinished save "
                            f"was removed, the last good checkpoint is kept: {kept}")


def _manifest(folder: str) -> dict[str, list]:
    """``{file: [bytes, crc32 or None]}`` of every file in ``folder`` (recursively)."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    summed = sum(files.values()) <= CHECKSUM_LIMIT
    return {rel: [size, _crc(os.path.join(folder, rel)) if summed else None]
            for rel, size in sorted(files.items())}


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of the complete checkpoints under ``directory``, oldest first."""
    return [step for step, _ in _complete_checkpoints(directory)]


def clean_stale(directory: str) -> list[str]:
    """Remove the ``.tmp-step_*`` / ``.old-step_*`` folders interrupted saves left (a crash,
    SIGINT, a full disk); return their names. Only at the start of a job (rank 0)."""
    if not os.path.isdir(directory):
        return []
    stale = sorted(n for n in os.listdir(directory) if _STALE.match(n))
    for name in stale:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return stale


def remove_run_files(run_dir: str, checkpoint_dir: str, names: list[str]) -> None:
    """``--overwrite``: delete a run's own files: ``names`` in ``run_dir`` and every
    checkpoint (complete or not) in ``checkpoint_dir``; nothing else there is touched."""
    for name in names:
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    if os.path.isdir(checkpoint_dir):
        for name in os.listdir(checkpoint_dir):
            if _STEP_DIR.match(name) or _STALE.match(name):
                shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)


def check_checkpoint(path: str) -> str | None:
    """What is wrong with the checkpoint folder ``path`` against what its save recorded
    (``meta.json``: every file, its size and, below ``CHECKSUM_LIMIT``, its CRC32), or None."""
    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return f"{META} is missing (an unfinished or damaged save)"
    except (OSError, ValueError) as e:
        return f"{META} cannot be read ({type(e).__name__}: {e})"
    files = meta.get("files")
    if not isinstance(files, dict):
        return None  # saved before manifests were recorded: nothing to check against
    for rel, (size, crc) in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if os.path.getsize(full) != size:
            return f"{rel} has {os.path.getsize(full)} bytes, the save wrote {size} (truncated?)"
        if crc is not None and _crc(full) != crc:
            return f"{rel} does not match its CRC32 from the save (corrupted)"
    return None


def usable_checkpoint(directory: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest checkpoint under ``directory`` that ``check_checkpoint`` passes, or None;
    the newer ones skipped, each with what is wrong with it). A ``step_*`` folder without
    ``meta.json`` counts too: it is named, not silently passed over."""
    if not os.path.isdir(directory):
        return None, []
    found = sorted((int(m.group(1)), os.path.join(directory, n))
                   for n in os.listdir(directory) if (m := _STEP_DIR.match(n)))
    skipped = []
    for _, path in reversed(found):
        problem = check_checkpoint(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


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


def read_meta(path: str) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint folder ``path``."""
    with open(os.path.join(path, META), encoding="utf-8") as f:
        return json.load(f)


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
    # files: the manifest; job: what the checkpoint holds (neither is in DCP's state)
    train = {k: v for k, v in meta.items() if k not in ("step", "files", "job")}
    state = _state(model, optimizer, train | {"step": 0})
    with _quiet_dcp(process_group):
        dcp.load(
            state,
            checkpoint_id=path,
            process_group=process_group,
            planner=ManagedLoadPlanner(flatten_sharded_tensors=False),  # maps: any owners
            no_dist=process_group is None,
        )
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["dense_optim"])
    _load_fused_scalars(model, state["fused"])
    return dict(state["train"])
