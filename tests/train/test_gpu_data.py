"""Batches made ahead on CUDA are pinned (skipped without CUDA; ``pytest tests/train -k gpu``):
page-locked host memory, so ``to(cuda, non_blocking=True)`` overlaps the step before it, and
the copies are the batches themselves, VBE ones included."""

import pytest
import torch

from fbtriton_dist.train.data import DataPosition, FeatureSpec, SyntheticSource
from fbtriton_dist.train.loop import _pinned, ahead
from tests.conftest import requires_cuda

pytestmark = [requires_cuda, pytest.mark.gpu]

FEATURES = [FeatureSpec(name="a", num_rows=100, pooling_factor=3.0, zipf=1.1),
            FeatureSpec(name="b", num_rows=7, pooling_factor=1.0, zipf=0.0)]


def tensors(batch):
    kjt = batch.sparse
    out = [batch.dense, batch.labels, kjt.values(), kjt.lengths()]
    inverse = kjt.inverse_indices_or_none()
    return out + ([inverse[1]] if inverse is not None else [])


@pytest.mark.parametrize("K", [1, 4], ids=["fixed", "vbe"])
def test_gpu_batches_made_ahead_are_pinned_and_copy_back_unchanged(K):
    src = SyntheticSource(FEATURES, num_dense=3, batch_size=16, seed=0, candidates_per_user=K,
                          user_features=["a"])
    made = list(zip(range(3), src.train_batches(DataPosition()), strict=False))
    want = [b for _, (b, _) in made]
    got = list(ahead(iter([item for _, item in made]), 2, prepare=_pinned))
    assert [p for _, p in got] == [p for _, (_, p) in made]
    for (pinned, _), batch in zip(got, want, strict=True):
        assert all(t.is_pinned() for t in tensors(pinned))
        on_gpu = pinned.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        for a, b in zip(tensors(on_gpu), tensors(batch), strict=True):
            assert a.is_cuda and torch.equal(a.cpu(), b)
        assert on_gpu.sparse.variable_stride_per_key() == (K > 1)


@pytest.mark.parametrize("K", [1, 4], ids=["fixed", "vbe"])
def test_synthetic_batches_made_on_the_gpu_by_the_data_thread_equal_those_made_here(K):
    """``device: cuda``: the data thread draws the batch on the GPU on its own stream; what
    the training stream reads after ``to()`` is the batch made in order on this thread (batch
    k a pure function of (seed, rank, k) on CUDA), and the stream is not left to reuse it."""
    make = lambda: SyntheticSource(FEATURES, num_dense=3, batch_size=64, seed=3,  # noqa: E731
                                   candidates_per_user=K, user_features=["a"], device="cuda")
    src = make()
    want = [make().batch(k).to("cuda") for k in range(4)]
    made = src.train_batches(DataPosition())
    got = [b for (b, _), _ in zip(ahead(made, 2, prepare=_pinned), range(4), strict=False)]
    for batch, ref in zip(got, want, strict=True):
        assert batch.ready is not None and batch.labels.is_cuda
        on = batch.to("cuda", non_blocking=True)
        assert on.ready is None
        for a, b in zip(tensors(on), tensors(ref), strict=True):
            assert a.is_cuda and torch.equal(a, b)
        kjt = on.sparse
        assert kjt.variable_stride_per_key() == (K > 1)
        feature = kjt.to_dict()
        assert int(feature["a"].values().max()) < 100 and int(feature["b"].values().max()) < 7
    # the law matches the CPU's: mean bag length near the pooling factor, hot rows hottest
    big = SyntheticSource(FEATURES, num_dense=3, batch_size=4096, seed=0, device="cuda")
    on_cpu = SyntheticSource(FEATURES, num_dense=3, batch_size=4096, seed=0)
    for b in (big.batch(0).to("cuda"), on_cpu.batch(0)):
        a = b.sparse.to_dict()["a"]
        assert abs(float(a.lengths().float().mean()) - 3.0) < 0.15
        counts = torch.bincount(a.values().cpu(), minlength=100)
        assert counts[0] > counts[10] > counts[90]
