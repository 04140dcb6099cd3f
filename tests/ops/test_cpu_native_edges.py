"""The native CPU kernels (``ops/csrc/``) at their edges, where a one-off slip keeps every
random-batch comparison of ``test_cpu_native.py`` passing:

* the backward's plan: every row of a table updated, the last one included, with a table
  size that fills the last of the plan's buckets (64 and 4096 rows, one table or two) and
  ids in every bucket (so every task's last bucket has work), at 1, 2 and 3 threads;
* the forward's id guard, for every D around the kernels' vector widths (8 floats a pass,
  16, 32, 64 per cache line pass, a tail below 8): an id equal to its table's row count
  under ``bounds_check="ignore"`` is refused, never read from the next table;
* the forward's fp32 sums for D = 64 and 128 (constant-D copies of its code) and another D:
  rows added in id order, bit for bit, at 1, 2 and 3 threads, int64 and int32 ids;
* the forward's two touch depths (a run of ids with almost no repeats touches more of the row
  ahead than a repeat-heavy one): both in one batch, the last row of each table named, bags
  shorter than the prefetch distance, the same bits as the rows added in id order;
* fp16 / bf16 row writes round to nearest even: updates landing a quarter, a half (a tie)
  and three quarters of an ulp past a representable value."""

import os
import shutil

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import cpu_native

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler: the native kernels cannot be built",
)


@pytest.fixture
def native(monkeypatch):
    """The kernels on; counts the backward calls they ran (None: the torch ops ran)."""
    monkeypatch.setenv("FBTD_CPU_NATIVE", "1")
    ran = []
    backward = cpu_native.backward

    def spy(*args, **kwargs):
        out = backward(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(cpu_native, "backward", spy)
    return ran


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# ---------------------------------------------------------------- backward: the last bucket


def _every_row_batch(tables, n_ids, L, seed):
    """One feature per table; each table's ids: every row once (the last one included), then
    random rows, shuffled; bags of L ids."""
    g = torch.Generator().manual_seed(seed)
    ids, lengths = [], []
    for E, _ in tables:
        x = torch.cat([torch.arange(E), torch.randint(0, E, (max(n_ids - E, 0),), generator=g)])
        ids.append(x[torch.randperm(x.numel(), generator=g)])
        B = -(-x.numel() // L)
        lengths.append(torch.full((B,), L))
        lengths[-1][-1] = x.numel() - L * (B - 1)
    B = max(len(v) for v in lengths)
    lengths = [torch.cat([v, torch.zeros(B - len(v), dtype=torch.int64)]) for v in lengths]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
    return torch.cat(ids), offsets


@pytest.mark.parametrize("tables", [[(64, 8)], [(4096, 4)], [(40, 4), (24, 16)],
                                    [(4000, 4), (96, 8)], [(63, 8)], [(65, 4)]],
                         ids=lambda t: "+".join(f"{E}x{D}" for E, D in t))
@pytest.mark.parametrize("opt_name", ["sgd", "rowwise", "none"])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_backward_updates_every_row_the_last_one_included(tables, opt_name, n_threads,
                                                          native, threads):
    threads(n_threads)
    opt = {"sgd": optim.SGD(lr=0.5), "rowwise": optim.RowWiseAdagrad(lr=0.5, eps=1e-6),
           "none": None}[opt_name]
    torch.manual_seed(0)
    ref = TableBatchedEmbedding(tables, optimizer=opt, backend="reference")
    fast = TableBatchedEmbedding(tables, optimizer=opt, backend="cpu")
    fast.load_state_dict(ref.state_dict())
    before = ref.weights.detach().clone()
    # 8192 ids a table: the plan cuts them into 4 * threads tasks (1024 ids or more each)
    indices, offsets = _every_row_batch(tables, 8192, 16, seed=len(tables) * 7 + n_threads)
    grads = []
    for m in (ref, fast):
        out = m(indices, offsets)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out) + 0.1)
        if opt is None:
            grads.append(m.weights.grad.clone())
            with torch.no_grad():
                m.weights -= 0.5 * m.weights.grad
    assert native == [True]
    if opt is None:
        torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(fast.weights, ref.weights, atol=1e-4, rtol=1e-5)
    # every row moved, table by table, its last row included
    at = 0
    for E, D in tables:
        rows = (fast.weights.detach() != before)[at : at + E * D].view(E, D)
        assert rows.any(1).all(), f"rows not updated: {(~rows.any(1)).nonzero().flatten()}"
        at += E * D


# ---------------------------------------------------------------- forward: the id guard


VARIANTS = [  # (weights dtype, id dtype, weighted): each a kernel of its own
    (torch.float32, torch.int64, False),
    (torch.float32, torch.int32, False),
    (torch.float32, torch.int64, True),
    (torch.float32, torch.int32, True),
    (torch.float16, torch.int64, False),
    (torch.bfloat16, torch.int32, True),
]


@pytest.mark.parametrize("D", [1, 4, 7, 8, 9, 16, 24, 33, 64, 100, 128])
@pytest.mark.parametrize("variant", VARIANTS,
                         ids=lambda v: f"{str(v[0])[6:]}-{str(v[1])[6:]}" + "-w" * v[2])
@pytest.mark.parametrize("pooling", ["sum", "none"])
def test_an_id_equal_to_the_rows_is_refused_not_read_from_the_next_table(D, variant, pooling,
                                                                         native):
    wdt, idt, weighted = variant
    E = 5
    m = TableBatchedEmbedding([(E, D), (3, D)], pooling=pooling, weights_dtype=wdt,
                              backend="cpu", bounds_check="ignore", stochastic_rounding=False)
    offsets = torch.tensor([0, 2, 2, 3, 3], dtype=idt)  # B=2: feature 0's bag 0 has the bad id
    psw = torch.ones(3) if weighted else None
    for bad in (E, E + 1, -1):
        indices = torch.tensor([1, bad, 2], dtype=idt)
        with pytest.raises(IndexError, match="out of range"):
            m(indices, offsets, psw)
    good = m(torch.tensor([1, E - 1, 2], dtype=idt), offsets, psw)  # the last row is good
    w = m.weights.detach().float().view(-1)
    rows = w[: E * D].view(E, D)
    want = rows[1] + rows[E - 1] if pooling == "sum" else torch.stack([rows[1], rows[E - 1]])
    got = good[0, :D] if pooling == "sum" else good[:2, :D]
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_fixed_width_rows_sum_in_id_order_at_any_thread_count(native):
    """fp32 rows of D 128 and 64 (the forward's constant-D copies) and 96 (its general code),
    int64 and int32 ids, bags of 0 .. 40 ids (past the 20-id prefetch distance): each bag is its
    rows added in id order in fp32, bit for bit, at 1, 2 and 3 threads."""
    assert cpu_native.library() is not None
    g = torch.Generator().manual_seed(3)
    tables, B = [(300, 128), (200, 64), (100, 96), (50, 128)], 24
    m = TableBatchedEmbedding(tables, backend="cpu")
    with torch.no_grad():
        m.weights.copy_(torch.randn(m.weights.shape, generator=g))
    lengths = torch.randint(0, 41, (len(tables) * B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.cat([torch.randint(0, tables[k // B][0], (int(n),), generator=g)
                         for k, n in enumerate(lengths)])
    w, want, base = m.weights.detach().view(-1), [], 0
    for f, (E, D) in enumerate(tables):
        rows = w[base: base + E * D].view(E, D)
        for b in range(B):
            acc = torch.zeros(D)
            for i in indices[offsets[f * B + b]: offsets[f * B + b + 1]]:
                acc = acc + rows[i]
            want.append(acc)
        base += E * D
    want = torch.cat([torch.stack(want[f * B: (f + 1) * B]) for f in range(len(tables))], 1)
    before = torch.get_num_threads()
    try:
        for idt in (torch.int64, torch.int32):
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                with torch.no_grad():
                    got = m(indices.to(idt), offsets.to(idt))
                assert torch.equal(got, want), (idt, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_touch_depths_sum_in_id_order(wdt, native, threads):
    """Features of D 128 (fp32: the constant-D copy) and 96 (the general code): one whose ids
    are all distinct (the deep touch), one whose ids name 6 rows (the shallow one), bags of 0 ..
    25 ids, the last row named; with per-sample weights too, at 1 and 2 threads."""
    assert cpu_native.library() is not None
    g = torch.Generator().manual_seed(5)
    tables, B = [(2000, 128), (2000, 128), (900, 96), (900, 96)], 40
    m = TableBatchedEmbedding(tables, backend="cpu", weights_dtype=wdt)
    with torch.no_grad():
        m.weights.copy_(torch.randn(m.weights.shape, generator=g))
    lengths = torch.randint(0, 26, (len(tables) * B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = []
    for f, (E, _) in enumerate(tables):
        n = int(lengths[f * B: (f + 1) * B].sum())
        if f % 2 == 0:  # distinct rows, the last one among them
            x = torch.randperm(E, generator=g)[:n]
            x[n // 2] = E - 1
        else:  # 6 rows, the last one among them
            x = torch.tensor([0, 7, 8, 9, 11, E - 1])[torch.randint(0, 6, (n,), generator=g)]
        ids.append(x)
    indices = torch.cat(ids)
    psw = torch.rand(indices.numel(), generator=g) + 0.5
    w, base, want, want_w = m.weights.detach().view(-1).float(), 0, [], []
    for f, (E, D) in enumerate(tables):
        rows = w[base: base + E * D].view(E, D)
        for b in range(B):
            acc, acc_w = torch.zeros(D), torch.zeros(D)
            for i in range(int(offsets[f * B + b]), int(offsets[f * B + b + 1])):
                acc, acc_w = acc + rows[indices[i]], acc_w + psw[i] * rows[indices[i]]
            want.append(acc)
            want_w.append(acc_w)
        base += E * D
    want, want_w = (torch.cat([torch.stack(v[f * B: (f + 1) * B]) for f in range(len(tables))], 1)
                    for v in (want, want_w))
    for n in (1, 2):
        threads(n)
        with torch.no_grad():
            assert torch.equal(m(indices, offsets), want), n
            assert torch.equal(m(indices, offsets, psw), want_w), n


# ---------------------------------------------------------------- fp16 / bf16 row writes


ULP_AT_ONE = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _round_cases(wdt):
    """(row before, fp32 row after one SGD step of lr 1): every base ``±(1 + k ulp)``, k 0..7
    (even and odd mantissas), plus a quarter, a half (a tie) and three quarters of an ulp."""
    ulp = ULP_AT_ONE[wdt]
    base, new = [], []
    for sign in (1.0, -1.0):
        for k in range(8):
            for frac in (0.25, 0.5, 0.75):
                b = sign * (1 + k * ulp)
                base.append(b)
                new.append(b + sign * frac * ulp)
    return torch.tensor(base), torch.tensor(new)


def _truncated(x: torch.Tensor, wdt) -> torch.Tensor:
    """``x`` rounded toward zero to ``wdt`` (what a truncating write stores): rounded to
    nearest, then one ulp back where that went away from zero (sign and magnitude bits)."""
    near = x.to(wdt)
    over = near.float().abs() > x.abs()
    return torch.where(over, near.view(torch.int16) - 1, near.view(torch.int16)).view(wdt)


@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [3, 8, 48])
def test_half_row_writes_round_to_nearest_even(wdt, D, native):
    base, new = _round_cases(wdt)
    assert torch.equal(base.to(wdt).float(), base)  # the bases are representable
    n = base.numel()
    E = -(-n // D)
    m = TableBatchedEmbedding([(E, D)], optimizer=optim.SGD(lr=1.0), weights_dtype=wdt,
                              backend="cpu", stochastic_rounding=False)
    w0 = torch.zeros(E * D)
    w0[:n] = base
    g = torch.zeros(E * D)
    g[:n] = base - new  # w - lr * g = new, exact in fp32
    with torch.no_grad():
        m.weights.copy_(w0.to(wdt))
    out = m(torch.arange(E), torch.arange(E + 1))  # bag e: row e
    out.backward(g.view(E, D))
    assert native == [True]
    got = m.weights.detach()[:n]
    want = new.to(wdt)  # torch rounds to nearest even
    # the cases tell the roundings apart: truncation, and ties rounded away from zero
    assert not torch.equal(_truncated(new, wdt), want)
    ties = torch.arange(n) % 3 == 1
    assert (want[ties].float().abs() < new[ties].abs()).any()
    assert (want[ties].float().abs() > new[ties].abs()).any()
    bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero().flatten()
    assert bad.numel() == 0, [(float(base[i]), float(new[i]), float(got[i]), float(want[i]))
                              for i in bad[:6]]
