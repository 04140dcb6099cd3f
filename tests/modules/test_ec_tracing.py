"""fbtriton_dist.EmbeddingCollection where a TorchRec user's tools touch it, against
torchrec.EmbeddingCollection on the same inputs and weights: torch.fx.symbolic_trace (and
TorchRec's), torch.compile(fullgraph=True), non-strict torch.export (then run on a batch whose
ids split otherwise between the keys), the meta device; plain gradients and fused updates."""

import copy

import pytest
import torch
import torchrec
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import KeyedJaggedTensor

import fbtriton_dist
from tests.modules.test_ebc_tracing import _FUSED_NEEDS_2_13
from tests.modules.test_ec import _kjt, _tables


class _Model(torch.nn.Module):
    """Every feature's rows against a fixed vector of its own: a scalar."""

    def __init__(self, ec, dims):
        super().__init__()
        self.ec = ec
        g = torch.Generator().manual_seed(5)
        for i, D in enumerate(dims):
            self.register_buffer(f"w{i}", torch.randn(D, generator=g))
        self.n = len(dims)

    def forward(self, kjt):
        out = self.ec(kjt)
        total = torch.zeros(())
        for i, jt in enumerate(out.values()):
            total = total + (jt.values() @ getattr(self, f"w{i}")).sum()
        return total


def _pair(fused=None):
    tables = _tables()
    dims = [t.embedding_dim for t in tables for _ in t.feature_names]
    torch.manual_seed(3)
    theirs = _Model(torchrec.EmbeddingCollection(tables=copy.deepcopy(tables)), dims)
    torch.manual_seed(3)
    ours = _Model(fbtriton_dist.EmbeddingCollection(tables=copy.deepcopy(tables)), dims)
    if fused is not None:
        for m in (theirs, ours):
            _apply_optimizer_in_backward(torch.optim.SGD, m.ec.parameters(), {"lr": 0.1})
    return theirs, ours


def _traced(ours, how, kjt):
    if how == "fx":
        return torch.fx.symbolic_trace(ours)
    if how == "torchrec_fx":
        from torchrec.fx import symbolic_trace

        return symbolic_trace(ours)
    if how == "compile":
        torch._dynamo.reset()
        return torch.compile(ours, fullgraph=True, backend="aot_eager")
    return torch.export.export(ours, (kjt,), strict=False).module()


HOWS = ["fx", "torchrec_fx", "compile", "export"]


def _regrouped(kjt):
    """The same number of ids and samples, split otherwise between the keys: one id moved
    from the last key's first non-empty bag to the first key's first bag (all ids 0, a row
    of every table)."""
    keys, B = kjt.keys(), kjt.stride()
    lengths = kjt.lengths().view(len(keys), B).clone()
    b = int(torch.nonzero(lengths[-1])[0])
    lengths[-1, b] -= 1
    lengths[0, 0] += 1
    out = KeyedJaggedTensor(keys=keys, values=torch.zeros_like(kjt.values()),
                            lengths=lengths.flatten())
    assert out.length_per_key() != kjt.length_per_key()
    assert sum(out.length_per_key()) == kjt.values().numel()
    return out


@pytest.mark.parametrize("how", HOWS)
def test_traced_forward_and_gradients_match_torchrec(how):
    theirs, ours = _pair()
    kjt = _kjt(hot=True)
    graph = _traced(ours, how, kjt)
    for batch in (kjt, _regrouped(kjt)) if how == "export" else (kjt,):
        for m in (theirs, ours):
            m.zero_grad()
        want, got = theirs(batch), graph(batch)
        torch.testing.assert_close(got, want)
        want.backward()
        got.backward()
        mine = dict(ours.named_parameters())
        for name, p in theirs.named_parameters():
            torch.testing.assert_close(mine[name].grad, p.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("how", ["fx", pytest.param("compile", marks=_FUSED_NEEDS_2_13)])
def test_traced_fused_sgd_updates_like_torchrec(how):
    theirs, ours = _pair(fused="sgd")
    kjt = _kjt(hot=True)
    graph = _traced(ours, how, kjt)
    for step in range(2):
        batch = _kjt(seed=step, hot=True)
        theirs(batch).backward()
        graph(batch).backward()
    for k, v in theirs.state_dict().items():
        if k.startswith("ec."):
            torch.testing.assert_close(ours.state_dict()[k], v, atol=1e-6, rtol=1e-5)
    assert ours.ec._tbes[0].step == 2


def test_meta_forward_gives_torchrec_shapes():
    tables = _tables()
    theirs = torchrec.EmbeddingCollection(tables=copy.deepcopy(tables), device=torch.device("meta"))
    ours = fbtriton_dist.EmbeddingCollection(tables=copy.deepcopy(tables), device="meta")
    kjt = _kjt()
    kjt.length_per_key()  # cached on the host: the KJT moved to meta keeps it
    meta = kjt.to(torch.device("meta"))
    want, got = theirs(meta), ours(meta)
    assert list(got) == list(want)
    for k, jt in want.items():
        assert got[k].values().shape == jt.values().shape and got[k].values().is_meta, k
        assert got[k].lengths().shape == jt.lengths().shape, k
