"""The host path of a CPU forward (docs/results/tbe-cpu-host-overhead-2026-12-05.md): a lookup
that needs no gradient skips the autograd Function and the fused optimizer's state, with the
same output and the same input checks; the module's resolved backend follows a new backend."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim

TABLES = [(7, 4), (5, 8)]


def _module(backend: str = "cpu", lr: float = 0.5) -> TableBatchedEmbedding:
    torch.manual_seed(0)
    return TableBatchedEmbedding(TABLES, optimizer=optim.SGD(lr=lr), backend=backend)


def _batch():
    indices = torch.tensor([0, 6, 2, 4, 1, 3, 0])
    offsets = torch.tensor([0, 2, 3, 5, 7])  # T=2 features, B=2 bags
    return indices, offsets


def test_a_forward_without_autograd_equals_a_training_forward_and_checks_the_same():
    tbe, ref = _module(), _module("reference")
    indices, offsets = _batch()
    with torch.no_grad():
        plain = tbe(indices, offsets)
        torch.testing.assert_close(plain, ref(indices, offsets), rtol=1e-6, atol=1e-6)
    # the fused update follows a learning rate set after a forward without autograd
    tbe.set_learning_rate(0.25)
    ref.set_learning_rate(0.25)
    trained = tbe(indices, offsets)
    assert plain.grad_fn is None and trained.grad_fn is not None
    assert torch.equal(plain, trained.detach())
    trained.sum().backward()
    ref(indices, offsets).sum().backward()
    torch.testing.assert_close(tbe.weights.detach(), ref.weights.detach(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(tbe.weights.detach(), _module().weights.detach())
    bad = indices.clone()
    bad[1] = 7  # outside the first table (E=7)
    with torch.no_grad(), pytest.raises(IndexError, match="7"):
        tbe(bad, offsets)


def test_the_resolved_backend_follows_a_new_backend():
    tbe = _module("auto")
    indices, offsets = _batch()
    with torch.no_grad():
        first = tbe(indices, offsets)
        assert tbe.resolved_backend() == "cpu"
        tbe.backend = "reference"
        assert tbe.resolved_backend() == "reference"
        torch.testing.assert_close(tbe(indices, offsets), first, rtol=1e-6, atol=1e-6)
