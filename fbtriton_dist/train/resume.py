"""What a checkpoint holds, and whether a job may resume from it (torch-free).

Each checkpoint's ``meta.json`` records, under ``job``, the job's name, its tables (rows and
dimension) and its optimizers (:func:`job_identity`). ``--resume`` compares them with the job
being resumed before anything is loaded or written (:func:`identity_problem`): a checkpoint
of another job or table set, or with another optimizer's state, is refused with what it
holds, instead of DCP's size-mismatch traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import JobConfig

__all__ = ["job_identity", "identity_problem"]


def job_identity(cfg: JobConfig) -> dict[str, Any]:
    """The job, its tables (``[rows, dim]`` by name) and optimizer types, for ``meta.json``."""
    return {
        "name": cfg.name,
        "tables": {t.name: [t.num_embeddings, t.embedding_dim] for t in cfg.tables.tables},
        "embedding_optimizer": cfg.optimizer.embedding.type,
        "dense_optimizer": cfg.optimizer.dense.type,
    }


def _tables_text(tables: Mapping[str, Any]) -> str:
    return ", ".join(f"{n} {r}x{d}" for n, (r, d) in tables.items())


def identity_problem(path: str, saved: Any, cfg: JobConfig) -> str | None:
    """Why the checkpoint ``path``, holding ``saved`` (its ``meta.json``'s ``job``; None for
    a checkpoint saved before it was recorded: not checked), cannot be resumed by ``cfg``."""
    if not isinstance(saved, Mapping):
        return None
    mine = job_identity(cfg)
    holds = (f"checkpoint {path} holds job {saved.get('name')!r} with tables "
             f"[{_tables_text(saved.get('tables') or {})}]")
    if saved.get("tables") != mine["tables"]:
        theirs = saved.get("tables") or {}
        diff = sorted(set(theirs) ^ set(mine["tables"]))
        diff += [n for n in mine["tables"] if n in theirs and theirs[n] != mine["tables"][n]]
        return (f"--resume: {holds}; this job {cfg.name!r} has tables "
                f"[{_tables_text(mine['tables'])}] (differing: {', '.join(diff)}): resume it "
                "with the job file it was saved with, or start a new run (another "
                "logging.run_dir, or --overwrite)")
    for key in ("embedding_optimizer", "dense_optimizer"):
        if saved.get(key) is not None and saved.get(key) != mine[key]:
            section = "optimizer." + key.split("_")[0] + ".type"
            return (f"--resume: {holds} and {saved.get(key)} optimizer state; this job's "
                    f"{section} is {mine[key]}: that state cannot be moved into it (resume with "
                    f"{section}={saved.get(key)}, or start a new run)")
    return None
