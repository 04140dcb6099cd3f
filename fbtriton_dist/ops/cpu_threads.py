"""How many threads each CPU rank runs: the host's usable cores shared by its local ranks.

Ranks of one host that each run as many threads as the host has cores oversubscribe it
(R ranks x C threads on C cores): the native kernels' pool (``csrc/tbe_pool.c``) and torch's
intra-op pool then wait on threads the OS holds back. The rule is one line,
``threads_per_rank(cores, local_world_size) = max(1, cores // local_world_size)``, and the
training job applies it to ``torch.set_num_threads`` on the CPU unless the user set
``OMP_NUM_THREADS`` (``launch/multinode.sh`` exports the rule's count when it is unset, since
torchrun otherwise sets 1 for every process). ``bench dist --threads`` measures other counts.

    >>> threads_per_rank(2, 2), threads_per_rank(2, 1), threads_per_rank(16, 3)
    (1, 2, 5)

``python -m fbtriton_dist.ops.cpu_threads LOCAL_WORLD_SIZE`` prints the count for this
machine (the usable cores: the affinity mask, capped by the cgroup's CPU quota).
"""

from __future__ import annotations

import math
import os
import sys

__all__ = ["threads_per_rank", "usable_cores"]


def threads_per_rank(cores: int, local_world_size: int) -> int:
    """Threads of each of ``local_world_size`` ranks sharing ``cores`` cores: an equal share,
    at least one (more ranks than cores: one each, the ranks themselves oversubscribe)."""
    if cores < 1:
        raise ValueError(f"cores: expected >= 1, got {cores}")
    if local_world_size < 1:
        raise ValueError(f"local_world_size: expected >= 1 ranks on this host, got "
                         f"{local_world_size}")
    return max(1, cores // local_world_size)


def _cgroup_quota_cpus() -> int | None:
    """CPUs of this process's cgroup quota, rounded up (v2 ``cpu.max``, else v1
    ``cpu.cfs_quota_us / cpu.cfs_period_us``); None without a quota or where unreadable."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, where = line.split(":", 2)
        try:
            if controllers == "":  # cgroup v2
                with open(f"/sys/fs/cgroup{where}/cpu.max", encoding="utf-8") as f:
                    quota, period = f.read().split()[:2]
            elif "cpu" in controllers.split(","):
                base = f"/sys/fs/cgroup/{controllers}{where}"
                if not os.path.exists(base):
                    base = f"/sys/fs/cgroup/cpu{where}"
                with open(f"{base}/cpu.cfs_quota_us", encoding="utf-8") as f:
                    quota = f.read().strip()
                with open(f"{base}/cpu.cfs_period_us", encoding="utf-8") as f:
                    period = f.read().strip()
            else:
                continue
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    return None


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, capped by its cgroup's CPU quota
    (the count the native kernels' pool caps itself at)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_quota_cpus()
    return max(1, min(cores or 1, quota) if quota else (cores or 1))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        raise SystemExit("usage: python -m fbtriton_dist.ops.cpu_threads LOCAL_WORLD_SIZE "
                         f"(expected one positive integer, got {argv})")
    print(threads_per_rank(usable_cores(), int(argv[0])))


if __name__ == "__main__":
    main()
