"""Bad input is refused with an error naming the table, the id and the bound; never a crash."""

import warnings

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from tests.conftest import TRITON_OK
from tests.helpers import device_for, to

BACKENDS = ["cpu", "reference"] + (["triton"] if TRITON_OK else [])


def _tbe(backend, **kw):
    return TableBatchedEmbedding(
        [(10, 4), (3, 2)],
        [0, 1],
        table_names=["ads", "geo"],
        backend=backend,
        device=device_for(backend),
        **kw,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_id", [3, -1, 1 << 40])
def test_out_of_range_id_error_names_table_id_and_size(backend, bad_id):
    tbe = _tbe(backend)
    indices = torch.tensor([1, 2, bad_id, 0])
    offsets = torch.tensor([0, 2, 2, 3, 4])  # B=2: feature 1 (table 'geo', E=3) gets the bad id
    with pytest.raises(
        IndexError, match=rf"id {bad_id} .* table 'geo' with 3 rows: expected 0 <= id < 3"
    ):
        tbe(*to(device_for(backend), indices, offsets))


@pytest.mark.parametrize("backend", BACKENDS)
def test_warn_drops_bad_ids(backend):
    tbe = _tbe(backend, bounds_check="warn", optimizer=optim.SGD(lr=0.1))
    clean = _tbe(backend, optimizer=optim.SGD(lr=0.1))
    clean.load_state_dict(tbe.state_dict())
    indices = torch.tensor([1, 2, 7, 0, 11])
    offsets = torch.tensor([0, 2, 2, 4, 5])
    psw = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    with pytest.warns(UserWarning, match="dropping 2 out-of-range ids"):
        out = tbe(*to(device_for(backend), indices, offsets, psw))
        tbe.poll_bounds_check()  # on CUDA the warning is deferred to the next lookup
    expected = clean(
        *to(
            device_for(backend),
            torch.tensor([1, 2, 0]),
            torch.tensor([0, 2, 2, 3, 3]),
            torch.tensor([1.0, 2.0, 4.0]),
        )
    )
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(tbe.weights, clean.weights)


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_warn_drops_bad_ids_inside_the_kernel_like_the_reference_with_mean_pooling():
    """The Triton path drops bad ids in the forward kernel (and its backward skips them,
    dividing by the ids kept); the reference and the fast CPU path rebuild the batch without
    them: same result."""
    g = torch.Generator().manual_seed(3)
    B, L = 6, 7
    indices = torch.randint(-2, 12, (2 * B * L,), generator=g)  # tables of 10 and 3 rows
    offsets = torch.arange(0, 2 * B * L + 1, L)
    psw = torch.rand(2 * B * L, generator=g)
    grad = torch.randn(B, 6, generator=g)
    results = []
    for backend in ("cpu", "reference", "triton"):
        tbe = _tbe(backend, bounds_check="warn", pooling="mean", optimizer=optim.SGD(lr=0.5))
        with torch.no_grad():
            tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
        dev = device_for(backend)
        with pytest.warns(UserWarning, match="out-of-range ids"):
            out = tbe(*to(dev, indices, offsets, psw))
            tbe.poll_bounds_check()
        out.backward(grad.to(dev))
        results.append((out.detach().cpu(), tbe.weights.detach().cpu()))
    for out, weights in results[:1] + results[2:]:  # the fast CPU path and Triton
        torch.testing.assert_close(out, results[1][0])
        torch.testing.assert_close(weights, results[1][1])


@pytest.mark.parametrize(
    "indices, offsets, psw, message",
    [
        (
            torch.tensor([1, 2]),
            torch.tensor([0, 1, 2, 2]),
            None,
            "offsets: expected length T\\*B\\+1",
        ),
        (
            torch.tensor([1, 2]),
            torch.tensor([0, 2, 1, 2, 2]),
            None,
            "non-decreasing.*offsets\\[1\\]=2 > offsets\\[2\\]=1",
        ),
        (
            torch.tensor([1, 2]),
            torch.tensor([0, 1, 1, 1, 1]),
            None,
            "offsets\\[-1\\] == len\\(indices\\) == 2",
        ),
        (torch.tensor([1, 2]), torch.tensor([1, 1, 2, 2, 2]), None, "offsets\\[0\\] == 0"),
        (
            torch.tensor([1, 2]),
            torch.tensor([0, 1, 2, 2, 2]),
            torch.ones(3),
            "per_sample_weights: expected a float tensor of shape \\(2,\\)",
        ),
        (
            torch.tensor([1.0, 2.0]),
            torch.tensor([0, 1, 2, 2, 2]),
            None,
            "indices: expected a 1-D int32/int64",
        ),
    ],
)
def test_malformed_batches_raise_value_error(indices, offsets, psw, message):
    with pytest.raises(ValueError, match=message):
        _tbe("reference")(indices, offsets, psw)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="tables: expected a non-empty list"):
        TableBatchedEmbedding([(0, 4)])
    with pytest.raises(ValueError, match=r"feature_table_map: expected table ids in \[0, 1\)"):
        TableBatchedEmbedding([(5, 4)], feature_table_map=[0, 1])
    with pytest.raises(ValueError, match="pooling: expected one of"):
        TableBatchedEmbedding([(5, 4)], pooling="max")
    with pytest.raises(ValueError, match="RowWiseAdagrad.weight_decay_mode"):
        optim.RowWiseAdagrad(weight_decay_mode="l1")
    with pytest.raises(ValueError, match="Adam.betas"):
        optim.Adam(betas=(0.9, 1.5))


def test_ignore_skips_checks():
    tbe = _tbe("reference", bounds_check="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tbe(torch.tensor([1, 2]), torch.tensor([0, 1, 2, 2, 2]))
