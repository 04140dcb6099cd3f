"""The ``host`` tier's staged training lookups (modules/host_stage.py, kernels/row_stage.py):
a batch's distinct rows copied into device memory, looked up and updated there, copied back.
They train as the ``device`` tier bit for bit. On the CPU ``FBTD_HOST_STAGE=1`` stages the
host tables there too (the copies by torch ops; the kernel under the interpreter); on CUDA
the default stages the mapped host tables."""

import pytest
import torch

from fbtriton_dist import optim
from fbtriton_dist.graphs import GraphedStep
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.ops import row_stage
from fbtriton_dist.storage import Storage
from tests.conftest import DEVICE, TRITON_OK, requires_cuda
from tests.helpers import device_for
from tests.test_graphs import _step as graph_step

TABLES, FTM = [(30, 4), (1, 8), (20, 12)], [0, 0, 1, 2]  # mixed D, a one-row table
ROWS = [TABLES[t][0] for t in FTM]
B = 3


def build(tier, opt, backend="auto", device="cpu", bounds_check="warn", **kw):
    return TableBatchedEmbedding(TABLES, FTM, optimizer=opt, backend=backend, seed=3,
                                 storage=[Storage(tier=tier)] * len(TABLES), device=device,
                                 bounds_check=bounds_check, **kw)


def pair(opt, backend="auto", device="cpu", **kw):
    a = build("device", opt, backend, device, **kw)
    b = build("host", opt, backend, device, **kw)
    b.load_state_dict(a.state_dict())
    return a, b


def batch(step, dtype=torch.int64, device="cpu", bad=False):
    """Empty bags, hot and duplicate ids, every table's last row; ``bad``: an id past its
    table (dropped under ``bounds_check="warn"``)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 5, (len(FTM) * B,), generator=g)
    lengths[1] = 0
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.cat([torch.randint(0, ROWS[f], (int(lengths[f * B:(f + 1) * B].sum()),),
                                   generator=g) for f in range(len(FTM))])
    ids[: min(3, ids.numel())] = 0  # hot
    last = offsets[4 * B - 1]
    if offsets[4 * B] > last:
        ids[last] = ROWS[3] - 1
    if bad:
        ids[-1] = ROWS[-1] + 5
    psw = torch.rand(ids.numel(), generator=g)
    return ids.to(dtype).to(device), offsets.to(device), psw.to(device)


def train_same(a, b, steps, dtype=torch.int64, device="cpu"):
    for step in range(steps):
        ids, offsets, psw = batch(step, dtype, device, bad=step == 1)
        outs = []
        for m in (a, b):
            out = m(ids, offsets, psw)
            (out * torch.arange(out.numel(), device=device).view(out.shape)).sum().backward()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1]), step
    assert_same(a, b)


def assert_same(a, b):
    assert torch.equal(a.weights.cpu(), b.weights.cpu())
    for name in ("momentum1", "momentum2"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    assert a.step == b.step


OPTIMIZERS = [
    optim.RowWiseAdagrad(lr=0.1),
    optim.Adam(lr=0.05, weight_decay=0.01),
    optim.PartialRowWiseAdam(lr=0.05),
    optim.SGD(lr=0.1),
]
BACKENDS = ["cpu", "reference", *(["triton"] if TRITON_OK else [])]


@pytest.mark.filterwarnings("ignore:.*out of range")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_staged_trains_as_device(backend, opt, monkeypatch):
    """Outputs, weights, every state and the step equal the device tier's after 3 fused steps
    (an out-of-range id dropped in one), every lookup staged."""
    monkeypatch.setenv("FBTD_HOST_STAGE", "1")
    if backend == "triton" and not isinstance(opt, (optim.RowWiseAdagrad, optim.Adam)):
        pytest.skip("interpreted Triton: two optimizers (per-row and per-element states)")
    device = device_for(backend)
    a, b = pair(opt, backend, device)
    train_same(a, b, 3, torch.int32 if isinstance(opt, optim.SGD) else torch.int64, device)
    assert b._stager.clock.writes == 3


def test_more_ids_than_rows(monkeypatch):
    """A batch of more ids than the tables have rows (every row, many times): the stage holds
    one row per table row, not one per id."""
    monkeypatch.setenv("FBTD_HOST_STAGE", "1")
    a, b = pair(optim.RowWiseAdagrad(lr=0.1))
    g = torch.Generator().manual_seed(5)
    offsets = torch.arange(len(FTM) * B + 1) * 40
    ids = torch.cat([torch.randint(0, ROWS[f], (B * 40,), generator=g) for f in range(len(FTM))])
    assert ids.numel() > sum(E for E, _ in TABLES)
    for m in (a, b):
        (m(ids, offsets) ** 2).sum().backward()
    assert b._stager.clock.writes == 1
    assert_same(a, b)


def test_two_lookups_before_their_backwards(monkeypatch):
    """The second backward writes rows back first: the first copies them in again before its
    update (the rows overlap), as the unstaged backward reads them in place."""
    monkeypatch.setenv("FBTD_HOST_STAGE", "1")
    a, b = pair(optim.Adam(lr=0.1))
    for step in range(2):
        (ids1, off1, _), (ids2, off2, _) = batch(2 * step), batch(2 * step + 1)
        for m in (a, b):
            (m(ids1, off1).sum() + 3 * m(ids2, off2).pow(2).sum()).backward()
    assert b._stager.clock.writes == 4
    assert_same(a, b)


@pytest.mark.parametrize("case", ["off", "inference", "counter", "max_norm", "device"])
def test_what_is_not_staged(case, monkeypatch):
    """Staging off, no-grad lookups, optimizers and options it cannot reproduce exactly, and
    tables not all host look up unstaged (and still train as the device tier)."""
    monkeypatch.setenv("FBTD_HOST_STAGE", "0" if case == "off" else "1")
    opt = (optim.RowWiseAdagradWithCounter(lr=0.1) if case == "counter"
           else optim.RowWiseAdagrad(lr=0.1))
    kw = {"max_norm": 1.0} if case == "max_norm" else {}
    a, b = pair(opt, **kw)
    if case == "device":
        b = build("device", opt)
        b.load_state_dict(a.state_dict())
    if case == "inference":
        with torch.no_grad():
            assert torch.equal(a(*batch(0)), b(*batch(0)))
    else:
        train_same(a, b, 2)
    assert b._stager.clock.writes == 0


def test_bad_id_error_names_the_id_and_its_table(monkeypatch):
    """``bounds_check="error"``: the staged lookup raises the unstaged lookup's message (the
    original id and its table's rows), and copies nothing back."""
    monkeypatch.setenv("FBTD_HOST_STAGE", "1")
    a, b = pair(optim.SGD(lr=0.1), bounds_check="error")
    ids, offsets, _ = batch(0, bad=True)
    messages = []
    for m in (a, b):
        with pytest.raises(IndexError) as err:
            m(ids, offsets)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "25" in messages[0]
    assert b._stager.clock.writes == 0
    assert_same(a, b)


@pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kinds", [(1,), (1, 2), (1, 1, 2)])
def test_stage_rows_kernel_equals_torch(kinds):
    """The copy kernel in and back (mixed D above and below a vector, rows past ``count``
    untouched) equals the torch ops, per-element and per-row states alike."""
    g = torch.Generator().manual_seed(0)
    dims = torch.tensor([4, 12, 4, 300, 8, 12])
    cap = dims.numel()
    count = torch.tensor([cap - 1])
    host_elem = torch.tensor([0, 40, 8, 100, 52, 400])
    stage_elem = torch.cat([torch.zeros(1, dtype=torch.int64), dims.cumsum(0)[:-1]])
    host_key = torch.tensor([0, 7, 2, 11, 9, 3])

    def flat(kind, n):
        return torch.randn(n if kind == row_stage.PER_ELEMENT else 16, generator=g)

    results = []
    for use_kernel in (True, False):
        g.manual_seed(1)
        dev = DEVICE if use_kernel else "cpu"
        pairs = [(flat(k, 800).to(dev), torch.zeros(800 if k == 1 else cap, device=dev))
                 for k in kinds]
        meta = [t.to(dev) for t in (count, host_elem, stage_elem, dims, host_key)]
        row_stage.stage_rows(*meta, pairs, list(kinds), 300, True, triton_kernel=use_kernel)
        staged = [s.cpu().clone() for _, s in pairs]
        for _, s in pairs:
            s.mul_(2)
        row_stage.stage_rows(*meta, pairs, list(kinds), 300, False, triton_kernel=use_kernel)
        results.append((staged, [f.cpu() for f, _ in pairs]))
    for x, y in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert torch.equal(x, y)
    w = results[1][1][0]
    assert w[400:412].abs().sum() > 0 and not torch.equal(w[100:400], w[100:400] * 0)


# ------------------------------------------------------------------------ GPU only


@requires_cuda
@pytest.mark.parametrize("opt", OPTIMIZERS[:2], ids=lambda o: type(o).__name__)
def test_cuda_host_tier_stages_by_default(opt):
    """On CUDA the host tier's mapped tables are staged by default, eagerly and in a
    GraphedStep, and train as the device tier bit for bit."""
    a, b = pair(opt, device="cuda")
    train_same(a, b, 3, device="cuda")
    assert b._stager.clock.writes == 3
    graphed = GraphedStep(graph_step(b), warmup=1)
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        ids = torch.cat([torch.randint(0, ROWS[f], (B * 2,), generator=g) for f in range(4)])
        offsets = torch.arange(len(FTM) * B + 1) * 2
        grad = torch.randn(B, sum(TABLES[t][1] for t in FTM), generator=g)
        args = [x.cuda() for x in (ids, offsets, grad)]
        assert torch.equal(graphed(*args), graph_step(a)(*args))
    assert graphed.replays == 3
    assert_same(a, b)
