"""The per-rank thread rule (``ops/cpu_threads.py``): each CPU rank its share of the host's
usable cores, never more; the job applies it unless OMP_NUM_THREADS is set, and
``launch/multinode.sh`` reads it from the module run as a script."""

import os
import subprocess
import sys

import pytest
import torch

from fbtriton_dist.ops.cpu_threads import threads_per_rank, usable_cores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("cores, local, expected", [
    (2, 2, 1),    # the quickstart: 2 gloo ranks on 2 cores, one thread each
    (2, 1, 2),    # one rank takes every core
    (16, 3, 5),   # the share rounds down: 3 x 5 <= 16
    (2, 4, 1),    # more ranks than cores: one each (the ranks oversubscribe, not the threads)
])
def test_each_rank_gets_its_share_of_the_cores_and_at_least_one(cores, local, expected):
    n = threads_per_rank(cores, local)
    assert n == expected
    assert n * local <= cores or n == 1


@pytest.mark.parametrize("cores, local, name", [(0, 1, "cores"), (2, 0, "local_world_size")])
def test_a_count_below_one_is_refused(cores, local, name):
    with pytest.raises(ValueError, match=f"{name}: expected >= 1"):
        threads_per_rank(cores, local)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed cores")
def test_usable_cores_follow_the_affinity_mask():
    before = os.sched_getaffinity(0)
    assert 1 <= usable_cores() <= len(before)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, before)


def _job_threads(monkeypatch, local: str, omp: str | None) -> int:
    from fbtriton_dist.train.job import distributed

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(7)  # a count neither case gives on its own
    try:
        with distributed("cpu"):
            return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_the_job_sizes_each_rank_by_the_rule_unless_omp_num_threads_is_set(monkeypatch):
    cores = usable_cores()
    assert _job_threads(monkeypatch, "2", None) == threads_per_rank(cores, 2)
    assert _job_threads(monkeypatch, "1", None) == cores
    assert _job_threads(monkeypatch, "2", "3") == 7  # the user's OMP_NUM_THREADS: untouched


def test_the_launcher_reads_the_rule_from_the_module_run_as_a_script():
    script = os.path.join(ROOT, "fbtriton_dist", "ops", "cpu_threads.py")
    out = subprocess.run([sys.executable, script, "2"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == str(threads_per_rank(usable_cores(), 2))
    bad = subprocess.run([sys.executable, script, "two"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode != 0 and "expected one positive integer" in bad.stderr
    with open(os.path.join(ROOT, "launch", "multinode.sh"), encoding="utf-8") as f:
        assert "fbtriton_dist/ops/cpu_threads.py" in f.read()
