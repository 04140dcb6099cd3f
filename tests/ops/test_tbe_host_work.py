"""The host work of one fused training step on the Triton path (docs/kernels.md, "Host work
of a step"): at most the documented host syncs, kernel launches and torch ops; and the
counter (``bench/host_work.py``) sees each kind of sync it looks for, and nothing else."""

import pytest
import torch

from fbtriton_dist.bench.host_work import count_host_work, tiny_step
from tests.conftest import DEVICE, TRITON_OK

pytestmark = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")

SYNCS = {"error": 1, "ignore": 0}
"""Host syncs of a fused step: ``"error"`` reads the forward's bad-id count to raise at the
lookup; nothing else reads the device (``"warn"`` reads it on the CPU, where it costs nothing,
and at the next lookup on CUDA)."""
LAUNCHES = 5
"""forward, linearize, run count, runs, row update (and the chunk kernel past 128 ids)."""
OPS = 12
"""torch ops dispatched around the kernels without a bounds check (the sort, its scan, the step
counter, allocations, one split into views); a bounds check adds zeroing its counts."""
CUDA_OPS = {"error": 5, "ignore": 4}
"""Added on CUDA: the backward's plan is built on a side stream ahead of the step
(``ops/tbe_ahead.py``), so each of its 4 tensors gets a ``record_stream`` on the compute stream;
``"error"`` copies its bad-id count to the host (one ``_to_copy``, the sync counted above)."""


@pytest.mark.parametrize("bounds_check", list(SYNCS))
def test_fused_step_within_the_documented_host_work(bounds_check):
    _, step = tiny_step("adam", bounds_check, device=DEVICE)
    step()
    work = count_host_work(step)
    assert work.syncs <= SYNCS[bounds_check], work.sync_sites
    assert work.launches <= LAUNCHES, work.kernel_names
    cuda = CUDA_OPS[bounds_check] if DEVICE == "cuda" else 0
    assert work.ops <= OPS + (bounds_check != "ignore") + cuda, work.op_names


def test_an_injected_item_in_the_step_is_counted():
    module, step = tiny_step("sgd", "ignore", device=DEVICE)
    step()
    clean = count_host_work(step)
    injected = count_host_work(lambda: (step(), module.step))  # ``step`` reads the counter
    assert clean.syncs == SYNCS["ignore"]
    assert injected.syncs == clean.syncs + 1 > SYNCS["ignore"]
    assert injected.sync_sites[-1].startswith("_local_scalar_dense at fbtriton_dist/modules/")


x = torch.tensor([3, 0, 2, 5])
SYNCING = {
    "item": lambda: x[0].item(),
    "int": lambda: int(x[1]),
    "branch": lambda: 1 if (x > 4).any() else 0,
    "tolist": lambda: x.tolist(),
    "nonzero": lambda: torch.nonzero(x),
    "mask": lambda: x[x > 1],
    "masked_select": lambda: torch.masked_select(x, x > 1),
    "unique": lambda: torch.unique(x),
    "repeat_interleave": lambda: torch.repeat_interleave(x),
}
NOT_SYNCING = {
    "cumsum": lambda: torch.cumsum(x, 0),
    "sort": lambda: torch.sort(x),
    "repeat_interleave sized": lambda: torch.repeat_interleave(x, output_size=10),
    "index by ints": lambda: x[torch.tensor([0, 2])],
    "where": lambda: torch.where(x > 1, x, 0),
}


@pytest.mark.parametrize("name", [*SYNCING, *NOT_SYNCING])
def test_the_counter_sees_syncs_and_only_syncs(name):
    work = count_host_work(SYNCING.get(name) or NOT_SYNCING[name])
    assert work.syncs == (name in SYNCING), work.sync_sites


def test_the_module_makes_its_layout_once_per_layout_buffers():
    module, step = tiny_step("sgd", "ignore", device=DEVICE)
    first = module._layout()
    step()
    assert module._layout() is first
    module.to(DEVICE)  # new layout buffers (every _apply makes them)
    second = module._layout()
    assert second is not first and second.dims is module._dims
    assert (second.max_D, second.total_D, second.row_align) == (8, 20, 4)
