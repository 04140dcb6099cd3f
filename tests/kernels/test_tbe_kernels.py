"""The Triton TBE kernels on their own: hot rows, determinism, stochastic rounding."""

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim, reference
from tests.conftest import DEVICE, HAS_CUDA, TRITON_OK

pytestmark = pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")


def test_hot_row_is_split_into_chunks_and_stays_precise():
    """One row hit HITS times in one batch (spread over many bags), plus a few cold rows: the
    chunked reduction must equal the fp64 sum, not a long fp32 chain."""
    from fbtriton_dist.kernels.tbe_backward import CHUNK

    # on the GPU the 100,000 hits; interpreted, 20 chunks and a ragged tail
    hits = 100_000 if HAS_CUDA else 20 * CHUNK + 7
    B = 64
    ids = torch.zeros(hits, dtype=torch.int64)
    ids[::97] = torch.arange(1, ids[::97].numel() + 1) % 5 + 1  # some cold rows among them
    lengths = torch.full((B,), hits // B)
    lengths[-1] += hits - int(lengths.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tbe = TableBatchedEmbedding([(8, 5)], backend="triton", device=DEVICE)
    grad = torch.randn(B, 5, dtype=torch.float64) * 1e3 + 1.0
    out = tbe(ids.to(DEVICE), offsets.to(DEVICE))
    out.backward(grad.float().to(DEVICE))
    exact = torch.zeros(8, 5, dtype=torch.float64)
    bag = torch.repeat_interleave(torch.arange(B), lengths)
    exact.index_add_(0, ids, grad[bag])
    magnitude = torch.zeros(8, 5, dtype=torch.float64).index_add_(0, ids, grad[bag].abs())
    got = tbe.weights.grad.view(8, 5).double().cpu()
    # error relative to sum |g|: blocked fp32 sums stay near eps; one serial fp32 chain over
    # 5,000 terms would sit around sqrt(5000) * eps = 4e-6
    assert torch.all((got - exact).abs() <= 5e-7 * magnitude + 1e-6), (got - exact).abs().max()


def test_backward_is_bit_identical_run_to_run():
    tables, ftm = [(6, 7), (3, 16)], [0, 1, 0]
    g = torch.Generator().manual_seed(5)
    B = 16
    lengths = torch.randint(0, 40, (len(ftm) * B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 3, (int(offsets[-1]),), generator=g)
    grad = torch.randn(B, 30, generator=g) * 100
    results = []
    for _ in range(2):
        tbe = TableBatchedEmbedding(
            tables,
            ftm,
            optimizer=optim.RowWiseAdagrad(lr=0.1),
            backend="triton",
            device=DEVICE,
            seed=1,
        )
        with torch.no_grad():
            tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
        tbe(ids.to(DEVICE), offsets.to(DEVICE)).backward(grad.to(DEVICE))
        results.append((tbe.weights.detach().cpu().clone(), tbe.momentum1.cpu().clone()))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_reference_is_unbiased(dtype):
    x = torch.full((200_000,), 1.0 + 1.0 / 3.0 * 2.0**-7)  # between two bf16/fp16 values
    x[100_000:] = -x[100_000:] * 1e-3
    y = reference.stochastic_round(x, dtype, torch.Generator().manual_seed(0)).float()
    lo = x.to(dtype).float()
    # every result is one of the two neighbours, and the mean is x (RNE would be biased)
    for part in (slice(0, 100_000), slice(100_000, None)):
        assert y[part].unique().numel() == 2
        assert abs(y[part].mean().item() - x[part][0].item()) < 2e-3 * abs(x[part][0].item()) * 0.1
        assert not torch.equal(y[part], lo[part])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_in_fused_update(dtype):
    """A tiny SGD step on half weights: round-to-nearest loses it, stochastic rounding keeps it
    on average, and every result is within one ulp of the exact fp32 update."""
    E, D = 64, 32
    updates = {}
    for sr in (False, True):
        tbe = TableBatchedEmbedding(
            [(E, D)],
            optimizer=optim.SGD(lr=1e-4),
            weights_dtype=dtype,
            backend="triton",
            device=DEVICE,
            stochastic_rounding=sr,
            seed=3,
        )
        with torch.no_grad():
            tbe.weights.fill_(1.0)
        ids = torch.arange(E, device=DEVICE)
        offsets = torch.arange(E + 1, device=DEVICE)  # B = E bags of one id each
        tbe(ids, offsets).backward(torch.ones(E, D, device=DEVICE))
        updates[sr] = tbe.weights.detach().float().cpu() - 1.0
    assert torch.all(updates[False] == 0)  # 1 - 1e-4 rounds back to 1 in fp16/bf16
    ulp = 2.0**-11 if dtype == torch.float16 else 2.0**-8  # spacing just below 1.0
    assert set(updates[True].unique().tolist()) <= {0.0, -ulp}
    mean = updates[True].mean().item()
    assert abs(mean - -1e-4) < 0.25e-4, mean


@pytest.mark.parametrize("optimizer", [None, "rowwise"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_padding_after_the_last_bag_is_ignored(optimizer, backend):
    """A fixed-size batch (``CommOptions(fixed_shapes=True)``): ids after ``offsets[-1]`` are
    padding (any value, out of range too), never looked up and given no gradient; with
    ``bounds_check="ignore"`` the result equals the batch without it."""
    tables, ftm, B = [(6, 7), (5, 16)], [0, 1, 0], 8
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 5, (len(ftm) * B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    ids = torch.randint(0, 5, (n,), generator=g)
    psw = torch.rand(n, generator=g)
    pad_ids = torch.cat([ids, torch.tensor([10**6, -3, 2, 0] * 70)])  # > one block per program
    pad_psw = torch.cat([psw, torch.full((280,), 7.0)])
    grad = torch.randn(B, 30, generator=g)
    results = []
    for x, w in ((ids, psw), (pad_ids, pad_psw)):
        for pooling in ("sum", "mean"):
            tbe = TableBatchedEmbedding(
                tables, ftm, pooling=pooling, backend=backend, device=DEVICE, seed=1,
                bounds_check="ignore",
                optimizer=optim.RowWiseAdagrad(lr=0.1) if optimizer else None,
            )
            with torch.no_grad():
                tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
            weights = w.to(DEVICE) if pooling == "sum" else None
            out = tbe(x.to(DEVICE), offsets.to(DEVICE), weights)
            out.backward(grad.to(DEVICE))
            after = tbe.momentum1 if optimizer else tbe.weights.grad
            results.append((out.detach().cpu(), tbe.weights.detach().cpu(), after.cpu()))
    for a, b in zip(results[:2], results[2:], strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def test_forward_config_loads_ids_ahead_for_16_bit_rows_only(monkeypatch):
    from fbtriton_dist.kernels.tbe_forward import forward_config

    monkeypatch.delenv("FBTD_TBE_FWD", raising=False)
    assert forward_config(128, 4) == (4, 128, 1, 0, False)
    assert forward_config(128, 2) == (8, 128, 1, 0, True)
    assert forward_config(256, 2) == (4, 256, 1, 0, False)
    monkeypatch.setenv("FBTD_TBE_FWD", "2,1")
    assert forward_config(64, 2) == (2, 64, 1, 0, True)


def test_backward_config_override_keeps_the_fields_it_does_not_give(monkeypatch):
    from fbtriton_dist.kernels.tbe_backward import CHUNK, backward_config
    from fbtriton_dist.kernels.tbe_optim import optimizer_code

    monkeypatch.delenv("FBTD_TBE_BWD", raising=False)
    sgd, rowwise = optimizer_code(optim.SGD(lr=0.1)), optimizer_code(optim.RowWiseAdagrad())
    # fp32 rows up to D=128: ids of a run read 4 per step with the middle band of run lengths
    # in the chunk kernel (SGD, plain gradients), 2 per step for stateful optimizers
    assert backward_config(128) == backward_config(128, 4, sgd) == (1, 1, 4, CHUNK // 2, 64, True)
    assert backward_config(128, 4, rowwise) == (1, 1, 2, CHUNK, 64, True)
    assert backward_config(256, 4, sgd) == backward_config(128, 2, sgd) == (
        1, 1, 1, CHUNK, 64, False)
    # the next run's record ahead only for fp32 rows up to D=128
    assert not backward_config(128, weight_bytes=2)[5] and not backward_config(256)[5]
    for env, want in [("2,1", (2, 1, 2, CHUNK, 64)), ("1,1,4", (1, 1, 4, CHUNK, 64)),
                      ("2,1,2,8", (2, 1, 2, 8, 64)), ("1,2", (1, 2, 2, CHUNK, 0)),
                      ("1,1,1,4,0", (1, 1, 1, 4, 0))]:
        monkeypatch.setenv("FBTD_TBE_BWD", env)
        assert backward_config(128, 4, rowwise) == (*want, True), env
    monkeypatch.setenv("FBTD_TBE_BWD", "1,1,1,1,1,1")
    with pytest.raises(ValueError, match="at most 5 fields"):
        backward_config(128)


@pytest.mark.parametrize("config", ["2,1", "1,1,4", "2,1,2,8", "1,1,1,4,64", "1,1,8,16"])
@pytest.mark.parametrize("optimizer", ["rowwise", "adam"])
def test_row_update_launch_configs_agree_with_the_reference(config, optimizer, monkeypatch):
    """``FBTD_TBE_BWD`` (runs per program, warps, ids per step, chunk size, register cap) only
    changes how the work is cut: every config updates weights and state like the reference,
    with hot rows longer than the chunk, one-id runs and empty bags in the batch."""
    monkeypatch.setenv("FBTD_TBE_BWD", config)
    tables, ftm, B = [(9, 8), (4, 16)], [0, 1, 0], 12
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 12, (len(ftm) * B,), generator=g)
    lengths[::5] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.randint(0, 4, (int(offsets[-1]),), generator=g)
    ids[::2] = 1  # a hot row: a run longer than any chunk size above
    grad = torch.randn(B, 32, generator=g)
    results = []
    for backend in ("triton", "reference"):
        opt = optim.RowWiseAdagrad(lr=0.1) if optimizer == "rowwise" else optim.Adam(lr=0.1)
        tbe = TableBatchedEmbedding(tables, ftm, optimizer=opt, backend=backend, device=DEVICE)
        with torch.no_grad():
            tbe.weights.copy_(torch.linspace(-1, 1, tbe.weights.numel()))
        tbe(ids.to(DEVICE), offsets.to(DEVICE)).backward(grad.to(DEVICE))
        state = [tbe.momentum1.cpu()] + ([tbe.momentum2.cpu()] if optimizer == "adam" else [])
        results.append([tbe.weights.detach().cpu(), *state])
    for x, y in zip(*results, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)  # fp32 sums of ~200 ids


# every pair of (id dtype, pooling, check) once: four of the eight combinations (each one is
# interpreted twice, forward and linearize kernels, on up to 3 offsets each)
@pytest.mark.parametrize(("id_dtype", "pooling", "check"), [
    (torch.int32, "sum", False), (torch.int32, "mean", True), (torch.int64, "sum", True),
    (torch.int64, "mean", False)], ids=["int32-sum", "int32-mean-check", "int64-sum-check",
                                        "int64-mean"])
def test_linearize_kernel_writes_what_the_training_forward_writes(check, pooling, id_dtype):
    """``tbe_linearize`` (run on a side stream beside the forward) gives the keys, bag ids and
    mean-pooling counts the forward kernel writes with ``linearize=True``: out-of-range and
    negative ids dropped under ``check`` (else keyed as they come), malformed bags clamped,
    padding after the last bag dropped, empty bags, more bags than one program's."""
    from fbtriton_dist import kernels
    from fbtriton_dist.kernels.tbe_forward import POOL_MEAN, POOL_SUM

    tables, ftm, B = [(9, 8), (1, 4), (5, 16)], [0, 2, 1, 0], 11
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 40, (len(ftm) * B,), generator=g)
    lengths[::3] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    ids = torch.randint(0, 5, (n + 13,), generator=g)  # 13 padding slots after the last bag
    if check:
        ids[::7] = 10**4
        ids[3::11] = -2
    tbe = TableBatchedEmbedding(tables, ftm, backend="triton", device=DEVICE)
    layout = tbe._layout()
    code = POOL_MEAN if pooling == "mean" else POOL_SUM
    cases = [offsets]
    if check:  # a last bag that ends past the ids: clamped to N, and no padding then; a
        # first bag that starts late: the ids before it are dropped
        cases.append(torch.cat([offsets[:-1], offsets[-1:] + 100]))
        cases.append(torch.cat([offsets[:1] + 3, offsets[1:].clamp(min=3)]))
    for bags in cases:
        x, o = ids.to(id_dtype).to(DEVICE), bags.to(DEVICE)
        err = torch.zeros(3, dtype=torch.int64, device=DEVICE) if check else None
        _, *forward = kernels.tbe_forward(
            tbe.weights.detach(), layout.w_offsets, layout.dims, layout.D_offsets, x, o, None,
            pooling=code, max_D=layout.max_D, total_D=layout.total_D,
            output_dtype=torch.float32, rows=layout.rows, row_offsets=layout.row_offsets,
            num_rows=layout.num_rows, err=err, linearize=True, row_align=layout.row_align)
        alone = kernels.tbe_linearize(x, o, layout.rows, layout.row_offsets,
                                      num_rows=layout.num_rows, pooling=code, check=check)
        for a, b in zip(forward, alone, strict=True):
            if a is None:
                assert b is None
            else:
                assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
        if check:
            assert int(err[0]) > 0  # some ids were dropped (and both agree on which)



@pytest.mark.parametrize("D", [8, 12])  # 8: every D is BLOCK_D (FULL, no column mask); 12 not
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_forward_counts_dropped_ids_like_the_reference(D, pooling):
    """The forward counts the ids it drops after its loop (the bag's ids minus the kept ones)
    and looks for the first bad position only in a bag that has one: the counts, the first
    position and the output equal the reference's, with per-sample weights and empty bags."""
    from fbtriton_dist import kernels
    from fbtriton_dist.kernels.tbe_forward import POOL_MEAN, POOL_SUM

    tables, ftm, B = [(9, D), (5, D)], [0, 1, 0], 6
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 11, (len(ftm) * B,), generator=g)
    lengths[::4] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    ids = torch.randint(0, 5, (n,), generator=g)
    ids[5::9] = 10**4
    ids[7::13] = -1
    psw = torch.randn(n, generator=g)
    tbe = TableBatchedEmbedding(tables, ftm, backend="triton", device=DEVICE)
    layout = tbe._layout()
    got = []
    for impl in (kernels, reference):
        err = torch.zeros(3, dtype=torch.int64, device=DEVICE)
        out = impl.tbe_forward(
            tbe.weights.detach(), layout.w_offsets, layout.dims, layout.D_offsets,
            ids.to(DEVICE), offsets.to(DEVICE), psw.to(DEVICE),
            pooling=POOL_MEAN if pooling == "mean" else POOL_SUM, max_D=layout.max_D,
            total_D=layout.total_D, output_dtype=torch.float32, rows=layout.rows, err=err,
            row_align=layout.row_align)
        got.append((out.cpu(), err.cpu()))
    torch.testing.assert_close(got[0][0], got[1][0], rtol=1e-5, atol=1e-5)
    assert int(got[0][1][0]) == int(got[1][1][0]) > 0
    bad = torch.nonzero((ids < 0) | (ids >= torch.tensor([9, 5, 9]).repeat_interleave(B)
                                     .repeat_interleave(lengths))).min()
    assert int(got[0][1][1]) == n - int(bad)
