"""The training job: job YAML (``config``), data sources (``data``), metrics,
checkpoints, the loop (``loop``) and the entry point ``python -m fbtriton_dist.train``
(``job.main``). See docs/training.md.

Imports are lazy: ``fbtriton_dist.train.config`` never loads torch, so the ``fbtriton-dist``
command parses its arguments without it.
"""

import importlib

__all__ = [
    "JobConfig",
    "Trainer",
    "latest_checkpoint",
    "load_checkpoint",
    "load_job",
    "main",
    "save_checkpoint",
    "train",
]

_HOMES = {
    "JobConfig": "config",
    "load_job": "config",
    "Trainer": "loop",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "main": "job",
    "train": "job",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"fbtriton_dist.train.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'fbtriton_dist.train' has no attribute {name!r}")
