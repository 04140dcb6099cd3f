"""Where a job's ``file``-tier tables keep their files: a folder of each run's own under the
table's directory (``docs/storage.md``, "Jobs and the planner").

A ``file`` table's directory is its table-set ``storage.path``, or ``sharding.file_dir`` for
a table the planner put on ``file`` (``storage: auto``). A module replaces the files it
finds there at construction, so two runs sharing a directory would overwrite each other's
rows: the job builds its tables in ``<directory>/<run folder>`` (:func:`run_folder`, named
after the run folder and its absolute path), the same for every rank of the run and for its
resumes, never another run's. The plan (``plan.yaml`` of the run) keeps the directory the
table set or the planner named. A directory that cannot be written is refused before any
table is built, naming the key. Never imports torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Mapping

from fbtriton_dist.planner import ConfigError, ShardingPlan

__all__ = ["check_file_dirs", "run_folder", "with_run_folders"]


def run_folder(run_dir: str) -> str:
    """The folder name of the run in ``run_dir`` under a ``file`` table's directory: the run
    folder's name and a hash of its absolute path (two runs named alike in different places
    get different folders)."""
    full = os.path.abspath(run_dir)
    name = os.path.basename(full.rstrip(os.sep)) or "run"
    return f"{name}-{hashlib.sha256(full.encode()).hexdigest()[:12]}"


def with_run_folders(plan: ShardingPlan, run_dir: str) -> ShardingPlan:
    """``plan`` with every ``file`` directory replaced by the run's folder in it: a table's,
    and a shard's of its own (a plan file's tier per shard)."""
    sub = run_folder(run_dir)

    def moved(st):
        if st is None or st.tier != "file":
            return st
        return dataclasses.replace(st, path=os.path.join(st.path, sub))

    tables = tuple(
        dataclasses.replace(t, storage=moved(t.storage), shards=tuple(
            dataclasses.replace(s, storage=moved(s.storage)) for s in t.shards))
        for t in plan.tables)
    return dataclasses.replace(plan, tables=tables)


def check_file_dirs(plan: ShardingPlan, keys: Mapping[str, str], where: str = "<job>") -> None:
    """Make the directory of every ``file`` table and shard of ``plan`` (after
    :func:`with_run_folders`) and check that a file can be written there; else a
    ``ConfigError`` naming the table's key (``keys``: table name -> its key, e.g.
    ``sharding.file_dir``; default ``tables.<name>.storage.path``; a shard's own:
    ``sharding.plan``), the directory and why."""
    for t in plan.tables:
        places = [(t.storage, keys.get(t.name, f"tables.{t.name}.storage.path"), "")]
        places += [(s.storage, "sharding.plan", f" shard {i} ({s.describe()})")
                   for i, s in enumerate(t.shards)]
        for st, key, what in places:
            if st is None or st.tier != "file":
                continue
            folder = st.path
            try:
                os.makedirs(folder, exist_ok=True)
                fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.")
                os.close(fd)
                os.unlink(probe)
            except OSError as e:
                raise ConfigError(where, key, (
                    f"expected a writable directory for the files of table '{t.name}'{what} "
                    f"(tier 'file'), got {os.path.dirname(folder)!r} (this run's folder in it: "
                    f"{os.path.basename(folder)!r}): {type(e).__name__}: {e.strerror or e}")
                ) from None
