"""``bench dist`` on CPU ranks: a training job's tables and batch (``--job``), threads per rank
(``--threads``) and where a step's CPU time goes (the profiler's top operators).

* ``--job configs/jobs/quickstart.yaml``: the job's tables (unscaled; a table of several
  features becomes one table per feature, as the Criteo set's), each feature's bags of its
  pooling factor, its per-rank batch, its DLRM's arches, dense features, the embedding
  optimizer's learning rate and its synthetic ids' Zipf exponent; flags given on the command
  line win. The job's pooling modes are not copied (every bag is summed) and every table
  draws its ids from one Zipf law.
* ``--threads 1,2``: each provider measured at each count of threads per rank
  (``torch.set_num_threads`` on every rank; the native kernels' pool follows it). The default
  is the job's rule, ``ops.cpu_threads.threads_per_rank(usable cores, local ranks)``; a count
  whose ranks x threads exceeds the host's usable cores is measured and marked
  ``oversubscribed``.
* CPU profile: ``profile_steps`` steps under ``torch.profiler`` (CPU activity): each
  operator's self time per step, the largest first, and the time inside gloo's collectives
  (``gloo_ms``: operators whose name has ``gloo``; a rank that waits for its peer waits there).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from fbtriton_dist.ops.cpu_threads import threads_per_rank, usable_cores

from .dist_providers import Runner


def apply_job(args: argparse.Namespace, given: set[str]) -> list:
    """Fill ``args`` from the job file ``args.job`` (every field not in ``given``) and return
    the bench tables (``dist_setup.Table``)."""
    from fbtriton_dist.train.config import load_job

    from .dist_setup import Table

    job = load_job(args.job)
    tables = []
    for t in job.tables.tables:
        for i, feature in enumerate(t.features):
            pf = t.pooling_factors[i] if t.pooling_factors else 1
            tables.append(Table(
                name=t.name if len(t.features) == 1 else f"{t.name}_{feature}",
                feature=feature,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                bag_size=max(1, round(pf)),
            ))
    dims = {t.embedding_dim for t in tables}
    if len(dims) != 1:
        raise ValueError(f"--job {args.job}: expected one embedding_dim for every table (a "
                         f"DLRM), got {sorted(dims)}")
    synthetic = getattr(job.data, "synthetic", None)
    defaults = {
        "dim": dims.pop(),
        "batch_size": job.train.batch_size,
        "bag_size": "tables",
        "num_dense": job.data.num_dense,
        "dense_arch": ",".join(map(str, job.model.dense_arch)),
        "over_arch": ",".join(map(str, job.model.over_arch)),
        "lr": job.optimizer.embedding.lr,
        "zipf": getattr(synthetic, "zipf", None),
    }
    for key, value in defaults.items():
        if key not in given and value is not None:
            setattr(args, key, value)
    return tables


def thread_counts(text: str | None, local_world_size: int) -> list[int]:
    """The ``--threads`` counts (comma separated, each >= 1), default the job's rule."""
    if text is None:
        return [threads_per_rank(usable_cores(), local_world_size)]
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"--threads: expected comma-separated counts >= 1, got {text!r}")
    return counts


def set_threads(n: int, local_world_size: int) -> dict[str, Any]:
    """``torch.set_num_threads(n)``; what a row records about it."""
    torch.set_num_threads(n)
    cores = usable_cores()
    return {"threads_per_rank": n, "usable_cores": cores,
            "rule_threads": threads_per_rank(cores, local_world_size),
            "oversubscribed": n * local_world_size > cores}


def cpu_profile(runner: Runner, steps: int, top: int = 15) -> dict[str, Any]:
    """``steps`` steps under the profiler (CPU activity): per step, the wall time, the time in
    gloo's collectives, the calls of each collective (``c10d::*``) and the ``top`` operators
    by self CPU time ``[name, ms, calls]``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.step()
        wall = time.perf_counter() - t0
    per = max(steps, 1)
    events = prof.key_averages()
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    gloo = sum(e.self_cpu_time_total for e in events if "gloo" in e.key.lower())
    return {
        "wall_ms": round(1e3 * wall / per, 4),
        "gloo_ms": round(gloo / 1e3 / per, 4),
        "collectives": {e.key: round(e.count / per, 2) for e in events
                        if e.key.startswith("c10d::")},
        "top": [[e.key[:80], round(e.self_cpu_time_total / 1e3 / per, 4),
                 round(e.count / per, 2)] for e in ranked],
    }
