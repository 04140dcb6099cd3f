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
