"""Graphs of our collections that outlive the module they were made from, next to TorchRec's:
``copy.deepcopy`` of an FX-traced or ``torch.compile``d model (run, then trained: the copy
updates its own weights and fused-optimizer state only), ``torch.export`` then
``torch.export.unflatten``, and ``torch.export.save`` -> ``load`` in another process, each
against the eager outputs of TorchRec's module with the same weights."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import fbtriton_dist

KEYS = ["f3", "f1", "f2"]  # not the config order
ROOT = Path(__file__).resolve().parents[2]


class _Bags(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


class _Sequences(torch.nn.Module):
    def __init__(self, ec):
        super().__init__()
        self.ec = ec

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.ec(kjt)
        return torch.cat([out[k].values() for k in sorted(out.keys())])


def _pair(kind: str):
    """(TorchRec's model, ours) with the same weights; two groups of tables (EBC: SUM and
    MEAN; EC: fp32 only, dims 4 and 3)."""
    torch.manual_seed(0)
    if kind == "ebc":
        tables = [
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
            EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=6,
                               feature_names=["f2", "f3"], pooling=PoolingType.MEAN),
        ]
        theirs = _Bags(torchrec.EmbeddingBagCollection(tables=copy.deepcopy(tables)))
        ours = _Bags(fbtriton_dist.EmbeddingBagCollection(tables=copy.deepcopy(tables),
                                                          backend="reference"))
    else:
        tables = [
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
            EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=6,
                            feature_names=["f2", "f3"]),
        ]
        theirs = _Sequences(torchrec.EmbeddingCollection(tables=copy.deepcopy(tables)))
        ours = _Sequences(fbtriton_dist.EmbeddingCollection(tables=copy.deepcopy(tables),
                                                            backend="reference"))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _kjt(B: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * B,), generator=g)
    lengths[0] = 0
    return KeyedJaggedTensor(keys=KEYS, values=torch.randint(0, 6, (int(lengths.sum()),),
                                                             generator=g), lengths=lengths)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _adagrad(*models) -> None:
    for m in models:
        apply_optimizer_in_backward(torch.optim.Adagrad, m.parameters(), {"lr": 0.3, "eps": 1e-8})


def _train(model, steps: int) -> None:
    for step in range(steps):
        model(_kjt(3, 10 + step)).pow(2).sum().backward()


def _assert_weights(got: dict, want: dict) -> None:
    """TorchRec's keys agree (a traced graph with a fused optimizer also holds its state)."""
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)


KINDS = ["ebc", "ec"]


def _compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="aot_eager", fullgraph=True)


HOWS = {"fx": torch.fx.symbolic_trace, "compile": _compiled}


OLD_AOT = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


@pytest.mark.parametrize("how", [
    "fx",
    pytest.param("compile", marks=pytest.mark.xfail(
        OLD_AOT, strict=True, reason="torch < 2.13: AOT autograd refuses the copy's fused "
        "update of a leaf parameter in the backward (a leaf Variable that requires grad is "
        "being used in an in-place operation); torch 2.13 accepts it")),
])
@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_of_a_graph_trains_its_own_weights(kind, how):
    """A deep copy of a traced / compiled model runs, and two fused Adagrad steps on it give
    TorchRec's weights after the same steps (the momentum and step counter travel with the
    copy); the original model's weights and optimizer state stay as they were."""
    theirs, ours = _pair(kind)
    _adagrad(theirs, ours)
    graph = HOWS[how](ours)
    kjt = _kjt(4, 0)
    torch.testing.assert_close(graph(kjt), theirs(kjt))  # the graph runs before the copy
    before, state_before = _weights(ours), copy.deepcopy(ours.state_dict())
    other = copy.deepcopy(graph)
    torch.testing.assert_close(other(kjt), theirs(kjt))
    _train(theirs, 2)
    _train(other, 2)
    module = other._orig_mod if how == "compile" else other
    _assert_weights(_weights(module), _weights(theirs))
    _assert_weights(_weights(ours), before)
    _assert_weights(ours.state_dict(), state_before)
    torch.testing.assert_close(graph(kjt), ours(kjt))  # the original graph still runs


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_of_a_plain_graph_gets_gradients_of_its_own(kind):
    """Without a fused optimizer the copy's parameters, not the original's, get gradients."""
    theirs, ours = _pair(kind)
    other = copy.deepcopy(torch.fx.symbolic_trace(ours))
    kjt = _kjt(3, 1)
    other(kjt).pow(2).sum().backward()
    theirs(kjt).pow(2).sum().backward()
    assert all(p.grad is None for p in ours.parameters())
    grads = {n: p.grad for n, p in theirs.named_parameters()}
    for n, p in other.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-5, msg=n)


@pytest.mark.parametrize("kind", KINDS)
def test_export_then_unflatten_runs_like_torchrec(kind):
    theirs, ours = _pair(kind)
    kjt = _kjt(4, 2)
    for model in (theirs, ours):
        ep = torch.export.export(model, (kjt,), strict=False)
        unflat = torch.export.unflatten(ep)
        torch.testing.assert_close(unflat(kjt), theirs(kjt), atol=1e-6, rtol=1e-6)


# ``fbtriton_dist`` imports lazily: the collections' modules register the lookup ops
_LOADER = """
import sys, torch, torchrec
import fbtriton_dist.modules.ec  # (and .ebc)
for program, batch, out in zip(*[iter(sys.argv[1:])] * 3, strict=True):
    ep = torch.export.load(program)
    kjt = torchrec.KeyedJaggedTensor(**torch.load(batch))
    torch.save(ep.module()(kjt), out)
"""


def test_export_save_load_in_another_process(tmp_path):
    """Export TorchRec's model and ours (no IR serializer: the program as it is), save, load in
    a fresh process and run there: outputs equal TorchRec's eager ones. Every kind's programs
    load in one process (one start-up of torch)."""
    (tmp_path / "load.py").write_text(_LOADER)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args, want = [], {}
    for kind in KINDS:
        theirs, ours = _pair(kind)
        kjt = _kjt(4, 3)
        batch = tmp_path / f"{kind}.kjt.pt"
        torch.save({"keys": kjt.keys(), "values": kjt.values(), "lengths": kjt.lengths()}, batch)
        want[kind] = theirs(kjt)
        for name, model in (("theirs", theirs), ("ours", ours)):
            program = tmp_path / f"{kind}.{name}.pt2"
            torch.export.save(torch.export.export(model, (kjt,), strict=False), program)
            args += [program, batch, tmp_path / f"{kind}.{name}.out"]
    run = subprocess.run([sys.executable, tmp_path / "load.py", *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for kind in KINDS:
        for name in ("theirs", "ours"):
            torch.testing.assert_close(torch.load(tmp_path / f"{kind}.{name}.out"), want[kind],
                                       atol=1e-6, rtol=1e-6, msg=f"{kind} {name}")
