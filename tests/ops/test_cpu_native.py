"""The fast CPU path's native kernels (``ops/cpu_native.py``, ``ops/csrc/tbe_cpu.c``): against
the reference and FBGEMM's CPU TBE over awkward shapes (mixed D, D=1, empty bags, one-row
tables, hot ids, int32/int64 ids, per-sample weights and their gradient, MEAN, unpooled rows,
every optimizer, fp16/bf16 rows), the same bits for any thread count, the one-pass batch
check, refusing out-of-range ids that nothing checked, the compiled library's cache, and the
torch-ops fallback without a compiler or with ``FBTD_CPU_NATIVE=0``.

``used`` records which calls the kernels took (a wrapper returns None where they do not
apply and ``ops/cpu.py`` runs its torch ops): every comparison asserts the path it means."""

import collections
import os
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.ops import cpu_native
from tests.helpers import make_batch, upstream_grad

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler: the native kernels cannot be built (the fallback is tested in "
    "tests/ops/test_tbe_cpu.py's cases, which then run the torch ops)",
)

TABLES = {
    # tables (E, D), feature_table_map, B, max_L
    "mixed": ([(40, 3), (1, 8), (25, 1), (60, 16)], [0, 1, 2, 3, 0, 3], 7, 6),
    "one-row": ([(1, 5)], [0], 1, 4),
    "wide": ([(300, 64), (90, 12)], [0, 1, 0], 33, 24),
    # keys wider than the plan's 2^11 buckets: hot buckets sorted by their low bits
    "many-rows": ([(60000, 4), (3000, 8)], [0, 1, 0], 32, 30),
}
OPTIMIZERS = {
    "none": None,
    "sgd": optim.SGD(lr=0.1),
    "rowwise": optim.RowWiseAdagrad(lr=0.1, eps=1e-6),
    "rowwise-l2": optim.RowWiseAdagrad(lr=0.1, weight_decay=0.02),
    "rowwise-decoupled": optim.RowWiseAdagrad(lr=0.1, weight_decay=0.02,
                                              weight_decay_mode="decoupled"),
    "adagrad": optim.Adagrad(lr=0.1, eps=1e-6),
    "adam": optim.Adam(lr=0.05, weight_decay=0.01),
    "ema": optim.EmaInplaceRowWiseAdagrad(lr=0.1, eps=1e-6, step_ema=2, step_start=1,
                                          step_ema_coef=0.3),
    # the backward reads momentum1 only (the module's catch-up decay reads prev_iter)
    "global-decay": optim.RowWiseAdagradGlobalDecay(lr=0.1, eps=1e-6, weight_decay=0.3),
}
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}
CASES = [
    # (tables, optimizer, pooling, weights dtype, id dtype, weighted, hot)
    ("mixed", "none", "sum", torch.float32, torch.int64, True, True),
    ("mixed", "sgd", "mean", torch.float32, torch.int32, False, True),
    ("mixed", "rowwise", "sum", torch.float32, torch.int64, True, True),
    ("mixed", "rowwise-l2", "mean", torch.float32, torch.int32, True, False),
    ("mixed", "rowwise-decoupled", "sum", torch.float32, torch.int64, False, True),
    ("mixed", "adagrad", "mean", torch.float32, torch.int64, True, True),
    ("mixed", "adam", "sum", torch.float32, torch.int32, True, True),
    ("mixed", "global-decay", "mean", torch.float32, torch.int64, True, True),
    ("mixed", "rowwise", "none", torch.float32, torch.int64, True, True),
    ("mixed", "adam", "none", torch.float32, torch.int32, False, False),
    ("mixed", "rowwise", "sum", torch.float16, torch.int64, True, True),
    ("mixed", "sgd", "mean", torch.bfloat16, torch.int32, True, False),
    ("one-row", "rowwise", "mean", torch.float32, torch.int32, True, True),
    ("one-row", "none", "none", torch.float32, torch.int64, False, False),
    ("wide", "rowwise", "sum", torch.float32, torch.int64, False, True),
    ("wide", "adam", "mean", torch.float32, torch.int64, True, False),
    ("wide", "none", "mean", torch.float16, torch.int32, True, True),
    ("many-rows", "rowwise", "sum", torch.float32, torch.int64, True, True),
    ("many-rows", "none", "mean", torch.float32, torch.int32, False, True),
    ("many-rows", "adam", "sum", torch.bfloat16, torch.int64, False, False),
]


def _case_id(case):
    name, opt, pooling, wdt, idt, weighted, hot = case
    return "-".join([name, opt, pooling, str(wdt)[6:], str(idt)[6:]]
                    + (["weighted"] if weighted else []) + (["hot"] if hot else []))


@pytest.fixture
def used(monkeypatch):
    """Counter of (wrapper, did the kernels run it) over the test."""
    monkeypatch.setenv("FBTD_CPU_NATIVE", "1")
    seen = collections.Counter()

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            result = fn(*args, **kwargs)
            seen[name, result is not None] += 1
            return result

        return wrapped

    for name in ("forward", "backward", "per_sample_weights_grad"):
        monkeypatch.setattr(cpu_native, name, spy(name, getattr(cpu_native, name)))
    return seen


def _module(name, opt, pooling, wdt, backend, **kw):
    tables, ftm, _, _ = TABLES[name]
    torch.manual_seed(5)
    return TableBatchedEmbedding(tables, ftm, pooling=pooling, optimizer=opt, weights_dtype=wdt,
                                 backend=backend, stochastic_rounding=False, **kw)


def _batches(name, idt, weighted, hot, n=3, seed=4):
    tables, ftm, B, max_L = TABLES[name]
    g = torch.Generator().manual_seed(seed)
    return [make_batch(tables, ftm, B, max_L, index_dtype=idt, weighted=weighted, hot=hot,
                       generator=g) for _ in range(n)]


def _train(module, batches):
    """Outputs, per-sample weight gradients and (without a fused optimizer) weight gradients
    of each step; plain gradients are applied by SGD."""
    sgd = None if module.optimizer is not None else torch.optim.SGD(module.parameters(), lr=0.1)
    seen = []
    for step, (indices, offsets, psw) in enumerate(batches):
        psw = psw.clone().requires_grad_() if psw is not None else None
        out = module(indices, offsets, psw)
        out.backward(upstream_grad(out, step))
        seen.append(out.detach().float())
        if psw is not None:
            seen.append(psw.grad)
        if sgd is not None:
            seen.append(module.weights.grad.detach().float().clone())
            sgd.step()
            sgd.zero_grad()
    return seen


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_reference(case, used):
    """3 steps: outputs, per-sample weight and plain gradients, rows, states, step count."""
    name, opt_name, pooling, wdt, idt, weighted, hot = case
    opt = OPTIMIZERS[opt_name]
    ref = _module(name, opt, pooling, wdt, "reference")
    fast = _module(name, opt, pooling, wdt, "cpu")
    fast.load_state_dict(ref.state_dict())
    batches = _batches(name, idt, weighted, hot)
    expected, got = _train(ref, batches), _train(fast, batches)
    atol, rtol = TOL[wdt]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    torch.testing.assert_close(fast.weights.float(), ref.weights.float(), atol=atol, rtol=rtol)
    for a, b in ((ref.momentum1, fast.momentum1), (ref.momentum2, fast.momentum2)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert fast.step == ref.step
    assert used["forward", True] == 3 and used["forward", False] == 0
    assert used["backward", True] == 3 and used["backward", False] == 0
    assert used["per_sample_weights_grad", True] == (3 if weighted else 0)


@pytest.mark.parametrize("name,opt_name", [("wide", "adam"), ("wide", "rowwise-l2"),
                                           ("wide", "none"), ("many-rows", "rowwise")])
def test_the_same_bits_for_any_thread_count(name, opt_name, used):
    """Outputs, gradients, rows and states do not depend on the number of threads."""
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            m = _module(name, OPTIMIZERS[opt_name], "mean", torch.float32, "cpu")
            seen = _train(m, _batches(name, torch.int64, True, True))
            runs.append((seen, m.weights.detach().clone(), m.momentum1.clone(),
                         m.momentum2.clone()))
    finally:
        torch.set_num_threads(before)
    for seen, *tensors in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], seen, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1:], tensors, strict=True))
    assert used["backward", True] == 9


def test_stochastic_rounding_is_seeded_and_within_one_ulp(used):
    """bf16 rows rounded stochastically: the same seed gives the same bits, within one ulp of
    the reference's unrounded update; another seed rounds some rows the other way."""
    mods = {}
    for key, backend, sr, seed in (("ref", "reference", False, 5), ("a", "cpu", True, 5),
                                   ("b", "cpu", True, 5), ("c", "cpu", True, 6)):
        mods[key] = TableBatchedEmbedding([(300, 64)], optimizer=optim.RowWiseAdagrad(lr=0.1),
                                          weights_dtype=torch.bfloat16, backend=backend,
                                          stochastic_rounding=sr, seed=seed)
    for m in list(mods.values())[1:]:
        m.load_state_dict(mods["ref"].state_dict())
    indices, offsets, _ = make_batch([(300, 64)], [0], 16, 8, generator=torch.Generator())
    for m in mods.values():
        out = m(indices, offsets)
        out.backward(upstream_grad(out, 0))
    assert torch.equal(mods["a"].weights, mods["b"].weights)
    assert not torch.equal(mods["a"].weights, mods["c"].weights)
    ref = mods["ref"].weights.float()
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp(min=1e-3)
    assert ((mods["a"].weights.float() - ref).abs() <= ulp * 1.01).all()
    assert used["backward", True] == 3


# ---------------------------------------------------------------- against FBGEMM's CPU TBE

def _fbgemm(tables, ftm, opt, pooling):
    tbe = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )

    from tests.fbgemm_config import EmainplaceModeDefinition

    spec = optim.spec_of(opt)
    return tbe.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(E, D, EmbeddingLocation.HOST, tbe.ComputeDevice.CPU) for E, D in tables],
        feature_table_map=ftm,
        optimizer=getattr(EmbOptimType, spec.fbgemm),
        learning_rate=opt.lr,
        pooling_mode={"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}[pooling],
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        stochastic_rounding=False,
        **({"eps": opt.eps} if "eps" in spec.hyper else {}),
        **({"emainplace_mode": EmainplaceModeDefinition(
            step_ema=opt.step_ema, step_start=opt.step_start, step_ema_coef=opt.step_ema_coef)}
           if isinstance(opt, optim.EmaInplaceRowWiseAdagrad) else {}),
    )


@pytest.mark.parametrize(
    "opt_name,pooling,idt,weighted",
    [("sgd", "sum", torch.int64, True), ("rowwise", "sum", torch.int32, True),
     ("rowwise", "mean", torch.int64, False), ("adagrad", "sum", torch.int64, False),
     ("ema", "sum", torch.int32, True)],
)
def test_matches_fbgemm_cpu(opt_name, pooling, idt, weighted, used):
    """FBGEMM's CPU TBE on the same rows (D % 4 == 0, as it needs; a one-row table; empty
    bags; hot ids; features of a table adjacent): outputs, rows and states over 3 steps."""
    tables, ftm, B, max_L = [(500, 64), (1, 8), (70, 12), (200, 4)], [0, 0, 1, 2, 3], 24, 16
    opt = OPTIMIZERS[opt_name]
    theirs = _fbgemm(tables, ftm, opt, pooling)
    ours = TableBatchedEmbedding(tables, ftm, pooling=pooling, optimizer=opt, backend="cpu",
                                 stochastic_rounding=False)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        a.copy_(b)
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        indices, offsets, psw = make_batch(tables, ftm, B, max_L, index_dtype=idt,
                                           weighted=weighted, hot=True, generator=g)
        out_ours, out_theirs = ours(indices, offsets, psw), theirs(indices, offsets, psw)
        torch.testing.assert_close(out_ours, out_theirs, atol=1e-5, rtol=1e-5)
        grad = upstream_grad(out_ours, step)
        out_ours.backward(grad)
        out_theirs.backward(grad)
    for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    if opt_name != "sgd":  # FBGEMM lists no states for SGD
        for a, b in zip(theirs.split_optimizer_states(), ours.split_optimizer_states(),
                        strict=True):
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(y.reshape(x.shape), x, atol=1e-5, rtol=1e-4)
    assert used["forward", True] == 3 and used["backward", True] == 3


@pytest.mark.parametrize("wdt,threads", [(torch.float32, 1), (torch.float16, 2)],
                         ids=["fp32-1thr", "fp16-2thr"])
def test_ema_inplace_matches_the_torch_step(wdt, threads, used, monkeypatch):
    """EMA-in-place rowwise Adagrad's native update (rowwise Adagrad's, L2 decay on) against
    the torch ops' step (``FBTD_CPU_NATIVE=0``) over 4 steps, the moving average run twice:
    mixed even D (none a multiple of 8 but 64), a one-row table, empty bags, hot ids."""
    tables, ftm = [(40, 6), (1, 2), (60, 18), (30, 64)], [0, 1, 2, 3, 0, 2]
    opt = optim.EmaInplaceRowWiseAdagrad(lr=0.1, eps=1e-6, weight_decay=0.02, step_ema=2,
                                         step_start=1, step_ema_coef=0.3)
    g = torch.Generator().manual_seed(3)
    batches = [make_batch(tables, ftm, 7, 6, hot=True, weighted=True, generator=g)
               for _ in range(4)]
    assert any(int(off.diff().eq(0).sum()) > 0 for _, off, _ in batches)  # an empty bag
    before = torch.get_num_threads()
    runs = {}
    try:
        torch.set_num_threads(threads)
        for native in ("1", "0"):
            monkeypatch.setenv("FBTD_CPU_NATIVE", native)
            torch.manual_seed(5)
            m = TableBatchedEmbedding(tables, ftm, optimizer=opt, weights_dtype=wdt,
                                      backend="cpu", stochastic_rounding=False)
            w0 = m.weights.detach().float().clone()
            runs[native] = (_train(m, batches), m.weights.detach().float(), m.momentum1)
    finally:
        torch.set_num_threads(before)
    atol, rtol = TOL[wdt]
    (seen_n, w_n, m_n), (seen_t, w_t, m_t) = runs["1"], runs["0"]
    for a, b in zip(seen_t, seen_n, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
    torch.testing.assert_close(w_n, w_t, atol=atol, rtol=rtol)
    torch.testing.assert_close(m_n, m_t, atol=1e-5, rtol=1e-4)
    assert not torch.equal(w_n, w0)
    assert used["backward", True] == 4 and used["backward", False] == 4


def test_a_forked_child_runs_the_kernels():
    """The kernels' threads do not survive fork: a child of a process that used them starts
    its own, and gets the parent's result (it does not hang on the parent's pool)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = TableBatchedEmbedding([(300, 64)], backend="cpu")
        indices, offsets, _ = make_batch([(300, 64)], [0], 64, 8, generator=torch.Generator())
        with torch.no_grad():
            expected = m(indices, offsets)
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 if it computes the same, without the parent's pool
            try:
                with torch.no_grad():
                    os._exit(0 if torch.equal(m(indices, offsets), expected) else 1)
            finally:
                os._exit(2)
        deadline = time.monotonic() + 120
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the native kernels")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- bad batches


def test_check_names_what_is_wrong():
    """``check``'s bits: well formed, offsets[0] != 0, offsets[-1] != N, decreasing, an id out
    of its feature's rows (int32 and int64), a non-finite weight."""
    rows = torch.tensor([4, 2])
    ids, offs = torch.tensor([3, 0, 1, 1]), torch.tensor([0, 2, 2, 3, 4])  # T=2, B=2
    psw = torch.ones(4)
    assert cpu_native.check(ids, offs, rows, psw) == 0
    assert cpu_native.check(ids.int(), offs.int(), rows, None) == 0
    assert cpu_native.check(ids, torch.tensor([1, 2, 2, 3, 4]), rows, None) == cpu_native.BAD_FIRST
    assert cpu_native.check(ids, torch.tensor([0, 2, 2, 3, 3]), rows, None) == cpu_native.BAD_LAST
    bits = cpu_native.check(ids, torch.tensor([0, 3, 2, 3, 4]), rows, None)
    assert bits == cpu_native.BAD_ORDER
    for bad in (torch.tensor([3, 0, 2, 1]), torch.tensor([3, 0, 1, -1]), torch.tensor([4, 0, 1, 1])):
        assert cpu_native.check(bad, offs, rows, None) == cpu_native.BAD_ID
        assert cpu_native.check(bad.int(), offs.int(), rows, None) == cpu_native.BAD_ID
    assert cpu_native.check(ids, offs, rows, torch.tensor([1.0, float("nan"), 1, 1])) == (
        cpu_native.BAD_WEIGHT)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_check_finds_one_bad_spot_in_a_large_batch(threads):
    """Over many tasks (each a range of bags, a feature's run of well-formed bags checked as one
    run of ids): one bad id or one decreasing offset anywhere, in either id width, is found;
    a good batch passes."""
    T, B, L = 3, 700, 5
    rows = torch.tensor([50, 7, 300])
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 2 * L, (T * B,), generator=g)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    feature = torch.arange(T).repeat_interleave(B).repeat_interleave(lengths)
    ids = (torch.rand(int(offs[-1]), generator=g) * rows[feature]).long()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for wide in (torch.int64, torch.int32):
            assert cpu_native.check(ids.to(wide), offs.to(wide), rows, None) == 0
            for i in (0, len(ids) // 3, len(ids) - 1):
                bad = ids.clone()
                bad[i] = rows[feature[i]]
                assert cpu_native.check(bad.to(wide), offs.to(wide), rows, None) == (
                    cpu_native.BAD_ID)
            for k in (5, B + 1, 2 * B + 3):  # a decreasing offset within a feature
                bad_offs = offs.clone()
                bad_offs[k] = bad_offs[k + 1] + 1
                assert cpu_native.check(ids.to(wide), bad_offs.to(wide), rows, None) == (
                    cpu_native.BAD_ORDER)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad_id", [7, -1, 2**40])
def test_unchecked_bad_ids_are_refused_not_read(bad_id, used):
    """``bounds_check="ignore"`` lets a bad id through: the kernels raise instead of reading or
    writing outside the tables (forward, and a backward of a batch looked up elsewhere)."""
    m = TableBatchedEmbedding([(5, 4), (3, 8)], optimizer=optim.SGD(lr=0.1), backend="cpu",
                              bounds_check="ignore")
    indices, offsets = torch.tensor([1, bad_id, 2]), torch.tensor([0, 2, 2, 3, 3])  # B=2
    with pytest.raises(IndexError, match="out of range"):
        m(indices, offsets)
    layout = m._layout()
    before = m.weights.detach().clone()
    with pytest.raises(IndexError, match="out of range"):
        cpu_native.backward(torch.ones(2, 12), m.weights.detach(), layout.w_offsets, layout.dims,
                            layout.row_offsets, layout.D_offsets, indices, offsets, None,
                            pooling=0, max_D=8, optimizer=m.optimizer, t=1, momentum1=None,
                            momentum2=None, stochastic_rounding=False, seed=0,
                            rows=layout.rows)
    if bad_id != 7:  # beyond the buffers: refused even without the tables' row counts
        with pytest.raises(IndexError, match="out of range"):
            cpu_native.backward(torch.ones(2, 12), m.weights.detach(), layout.w_offsets,
                                layout.dims, layout.row_offsets, layout.D_offsets, indices,
                                offsets, None, pooling=0, max_D=8, optimizer=m.optimizer, t=1,
                                momentum1=None, momentum2=None, stochastic_rounding=False,
                                seed=0)
    assert torch.equal(m.weights, before)
    with pytest.raises(ValueError, match="offsets"):
        m(torch.tensor([1, 2, 0]), torch.tensor([0, 2, 9, 3, 3]))


def test_checked_batches_still_name_the_bad_id():
    """With the one-pass check in front, ``"error"`` still names the id, its feature and the
    bound, and ``"warn"`` drops it (the kernels then see only good ids)."""
    m = TableBatchedEmbedding([(5, 4)], backend="cpu", bounds_check="error")
    with pytest.raises(IndexError, match=r"id 9 at indices\[1\].*expected 0 <= id < 5"):
        m(torch.tensor([1, 9]), torch.tensor([0, 1, 2]))
    w = TableBatchedEmbedding([(5, 4)], backend="cpu", bounds_check="warn")
    w.load_state_dict(m.state_dict())
    with pytest.warns(UserWarning, match="dropping 1 out-of-range"):
        out = w(torch.tensor([1, 9]), torch.tensor([0, 1, 2]))
    torch.testing.assert_close(out, torch.stack([m.weights.view(5, 4)[1], torch.zeros(4)]))


# ---------------------------------------------------------------- build, cache and fallback


def test_processes_building_at_once_all_load_it_and_a_later_load_takes_the_cache(
        tmp_path, monkeypatch):
    """Two processes build into one empty cache directory at the same time: both load a whole
    library (each compiles to its own temporary file, renamed into place); one file is left,
    named under a hash, no temporary file; this process then loads it from the cache without
    building. (One test: every build of the library costs seconds of a core.)"""
    code = ("import torch\nfrom fbtriton_dist.ops import cpu_native\n"
            "lib = cpu_native.library()\nassert lib is not None\n"
            "out = cpu_native.forward(torch.ones(8), torch.tensor([0]), torch.tensor([2]), "
            "torch.tensor([0, 2]), torch.tensor([1, 3]), torch.tensor([0, 2]), None, pooling=0, "
            "max_D=2, total_D=2)\nassert out.tolist() == [[2.0, 2.0]], out\n")
    env = dict(os.environ, FBTD_CPU_NATIVE="1", FBTD_CPU_NATIVE_CACHE=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("tbe_cpu-") and built[0].endswith(".so")
    monkeypatch.setenv("FBTD_CPU_NATIVE", "1")
    monkeypatch.setenv("FBTD_CPU_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_compile", lambda *a: pytest.fail("rebuilt"))
    cpu_native.reset()
    try:
        assert cpu_native.library() is not None  # loaded from the cache
    finally:
        cpu_native.reset()


def _torch_path_matches_reference(used):
    ref = _module("mixed", OPTIMIZERS["rowwise"], "sum", torch.float32, "reference")
    fast = _module("mixed", OPTIMIZERS["rowwise"], "sum", torch.float32, "cpu")
    fast.load_state_dict(ref.state_dict())
    batches = _batches("mixed", torch.int64, True, True, n=2)
    for a, b in zip(_train(ref, batches), _train(fast, batches), strict=True):
        torch.testing.assert_close(b, a)
    torch.testing.assert_close(fast.weights, ref.weights)
    torch.testing.assert_close(fast.momentum1, ref.momentum1)
    assert used["forward", True] == 0 and used["forward", False] == 2
    assert used["backward", True] == 0 and used["backward", False] == 2


def test_without_a_compiler_it_warns_once_and_runs_the_torch_ops(tmp_path, monkeypatch, used):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FBTD_CPU_NATIVE_CACHE", str(tmp_path))
    cpu_native.reset()
    try:
        with pytest.warns(RuntimeWarning, match="native kernels are unavailable.*no C compiler"):
            assert cpu_native.library() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process
            assert cpu_native.library() is None
            _torch_path_matches_reference(used)
    finally:
        cpu_native.reset()


def test_a_failing_build_falls_back(tmp_path, monkeypatch, used):
    """A compiler that fails every flag set: one warning with its complaint, the torch ops."""
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'cc: no way' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("FBTD_CPU_NATIVE_CACHE", str(tmp_path))
    cpu_native.reset()
    try:
        with pytest.warns(RuntimeWarning, match="could not build.*no way"):
            assert cpu_native.library() is None
        _torch_path_matches_reference(used)
        assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))
    finally:
        cpu_native.reset()


def test_sources_not_installed_warn_naming_them(tmp_path, monkeypatch, used):
    """An install without the package data (csrc/*.c, *.h): a warning that says so, the torch
    ops."""
    monkeypatch.setattr(cpu_native, "CSRC", tmp_path)
    monkeypatch.setattr(cpu_native, "SOURCES", tuple(tmp_path / p.name for p in cpu_native.SOURCES))
    monkeypatch.setattr(cpu_native, "HEADERS", tuple(tmp_path / p.name for p in cpu_native.HEADERS))
    monkeypatch.setenv("FBTD_CPU_NATIVE_CACHE", str(tmp_path))
    cpu_native.reset()
    try:
        with pytest.warns(RuntimeWarning, match="tbe_cpu.c.*installed without its data files"):
            assert cpu_native.library() is None
        assert "installed without its data files" in cpu_native.describe()
        _torch_path_matches_reference(used)
    finally:
        cpu_native.reset()


def test_the_knob_turns_the_kernels_off(monkeypatch, used):
    monkeypatch.setenv("FBTD_CPU_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_native.library() is None
        _torch_path_matches_reference(used)
