"""The native CPU kernels' threads (``ops/csrc/tbe_pool.c``) on a shared machine: never more
threads than the cores the process may use (its affinity mask), whatever
``torch.get_num_threads()`` says; the same bits and no hang while another process keeps a core
busy. No timing is asserted: only counts, results and that every run finishes."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import cpu_native

pytestmark = [
    pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                       reason="no C compiler: the native kernels cannot be built"),
    pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks here"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# one training step and one lookup, printed as: usable cores, pool threads, a digest of the bits
STEP = textwrap.dedent("""
    import os, sys, torch
    cpus = [int(c) for c in sys.argv[1].split(",")]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(int(sys.argv[2]))
    from fbtriton_dist import TableBatchedEmbedding, optim
    from fbtriton_dist.ops import cpu_native
    g = torch.Generator().manual_seed(0)
    m = TableBatchedEmbedding([(5000, 64), (700, 16)], optimizer=optim.RowWiseAdagrad(lr=0.1),
                              backend="cpu")
    with torch.no_grad():
        m.weights.copy_(torch.randn(m.weights.shape, generator=g))
    B, L = 512, 12
    idx = torch.cat([torch.randint(0, 5000, (B * L,), generator=g),
                     torch.randint(0, 700, (B * L,), generator=g)])
    off = torch.arange(0, 2 * B * L + 1, L)
    for _ in range(int(sys.argv[3])):
        out = m(idx, off)
        out.backward(torch.randn(out.shape, generator=g))
    bits = torch.cat([out.detach().flatten(), m.weights.flatten(), m.momentum1.flatten()])
    print(cpu_native.usable_cpus(), cpu_native.pool_threads(),
          int(bits.view(torch.int32).to(torch.int64).sum()))
""")


def _step(cpus, threads, steps=2, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", STEP, ",".join(map(str, cpus)), str(threads),
                           str(steps)], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    usable, pool, digest = map(int, done.stdout.split()[-3:])
    return usable, pool, digest


def _allowed():
    return sorted(os.sched_getaffinity(0))


@pytest.fixture
def busy_sibling():
    """A process spinning on the first allowed core (as another job holding it)."""
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spin.pid, [_allowed()[0]])
        yield spin
    finally:
        spin.kill()
        spin.wait(timeout=30)


def test_one_allowed_core_runs_no_pool_thread():
    """Pinned to one core (taskset -c 0) with 4 torch threads: no pool thread starts, and the
    bits are those of a 1-thread run."""
    core = _allowed()[:1]
    usable, pool, digest = _step(core, 4)
    assert (usable, pool) == (1, 0)
    assert _step(core, 1)[2] == digest


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed cores")
def test_never_more_threads_than_allowed_cores():
    """Two allowed cores and 8 torch threads: at most one pool thread (the caller is the
    other); the same bits as one thread."""
    cores = _allowed()[:2]
    usable, pool, digest = _step(cores, 8)
    assert usable == 2 and pool <= 1
    assert _step(cores, 1)[2] == digest


def test_usable_cpus_follows_the_affinity_mask():
    """Read at every job: a mask narrowed after the library loaded counts (here, the calling
    thread's own mask)."""
    if cpu_native.library() is None:
        pytest.skip("no native kernels")
    before = os.sched_getaffinity(0)
    try:
        assert cpu_native.usable_cpus() <= len(before)
        os.sched_setaffinity(0, _allowed()[:1])
        assert cpu_native.usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed cores")
def test_a_busy_core_changes_no_bits_and_hangs_nothing(busy_sibling):
    """Another process spins on one of the two cores: 2-thread steps still finish (within the
    timeout) and give the 1-thread bits, pinned to both cores or to the busy one only."""
    cores = _allowed()[:2]
    expected = _step(cores, 1, steps=3)[2]
    assert _step(cores, 2, steps=3)[2] == expected
    assert _step(cores[:1], 2, steps=3)[2] == expected  # sharing the busy core


def test_in_process_threads_agree_with_a_busy_sibling(busy_sibling):
    """In this process, 1, 2 and 3 threads with a spinning sibling: the same forward."""
    if cpu_native.library() is None:
        pytest.skip("no native kernels")
    g = torch.Generator().manual_seed(1)
    m = TableBatchedEmbedding([(4000, 32), (900, 8)], optimizer=optim.SGD(lr=0.1), backend="cpu")
    idx = torch.cat([torch.randint(0, 4000, (4000,), generator=g),
                     torch.randint(0, 900, (4000,), generator=g)])
    off = torch.arange(0, 8001, 10)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.no_grad():
                outs += [m(idx, off) for _ in range(5)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
