"""``host_flags.HostFlags``: device flags read on the host once their copy has landed."""

import pytest
import torch

from fbtriton_dist.host_flags import HostFlags
from tests.conftest import requires_cuda


def test_cpu_flag_set_is_seen_at_once():
    flags = torch.tensor([0, 2, 0])
    copy = HostFlags(3, flags.device).start(flags)
    assert copy.poll(wait=False) == [0, 2, 0]  # no events on CPU: the copy is done
    assert copy.poll(wait=True) == [0, 2, 0]


def test_cpu_flag_not_set_reads_zeros():
    copy = HostFlags(2, "cpu").start(torch.zeros(2, dtype=torch.int64))
    values = copy.poll()
    assert values == [0, 0] and not any(values)


def test_the_copy_is_a_snapshot_and_restarts():
    flags = torch.tensor([1], dtype=torch.int64)
    copy = HostFlags(1, "cpu").start(flags)
    flags.zero_()  # the device tensor changes after start: the copy keeps what it saw
    assert copy.poll() == [1]
    copy.start(flags)
    assert copy.poll() == [0]


def test_clear_zeros_the_host_copy():
    copy = HostFlags(2, "cpu").start(torch.tensor([3, 4]))
    copy.clear()
    assert copy.poll() == [0, 0]


@requires_cuda
@pytest.mark.parametrize("set_flag", [True, False])
def test_cuda_poll_after_the_event(set_flag):
    flags = torch.zeros(3, dtype=torch.int64, device="cuda")
    if set_flag:
        flags[1] = 7
    copy = HostFlags(3, flags.device)
    assert copy.host.is_pinned()
    copy.start(flags)
    assert copy.poll(wait=True) == ([0, 7, 0] if set_flag else [0, 0, 0])
    torch.cuda.synchronize()
    assert copy.poll(wait=False) is not None  # the event has passed
