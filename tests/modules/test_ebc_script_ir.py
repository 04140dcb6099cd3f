"""fbtriton_dist.EmbeddingBagCollection scripted (torch.jit.script, save/load) and carried in an
exported program to another process and back (``modules.ir``), each against TorchRec's own
EmbeddingBagCollection on the same inputs and weights."""

import io
import subprocess
import sys
import textwrap

import pytest
import torch
import torchrec
from torchrec import DataType, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import fbtriton_dist
from fbtriton_dist.modules import ir

KEYS = ["f2", "x", "f1", "f3"]  # not the config order, and a key no table uses


def _configs(weighted: bool, fp16: bool = False) -> list[EmbeddingBagConfig]:
    """Mixed dims, a feature (f1) read by two tables, a one-row table; unweighted, a MEAN one."""
    mean = {} if weighted else {"pooling": PoolingType.MEAN}
    half = {"data_type": DataType.FP16} if fp16 else {}
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(
            name="t2", embedding_dim=3, num_embeddings=7, feature_names=["f2", "f1"], **mean
        ),
        EmbeddingBagConfig(
            name="one", embedding_dim=2, num_embeddings=1, feature_names=["f3"], **half
        ),
    ]


def _kjt(B: int, seed: int, weighted: bool, dtype=torch.int64) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS), B), generator=g)
    lengths[0, 0] = 0  # an empty bag
    values = [torch.randint(0, 7 if k != "f3" else 1, (int(n),), generator=g)
              for k, n in zip(KEYS, lengths.sum(1), strict=True)]
    values[2][:2] = 6  # a hot id, twice
    N = int(lengths.sum())
    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.cat(values).to(dtype),
        lengths=lengths.reshape(-1).to(dtype),
        weights=torch.rand(N, generator=g) + 0.5 if weighted else None,
    )


def _pair(weighted: bool, fp16: bool = False):
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(tables=_configs(weighted, fp16), is_weighted=weighted)
    ours = fbtriton_dist.EmbeddingBagCollection(
        tables=_configs(weighted, fp16), is_weighted=weighted, backend="reference"
    )
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _close(a, b, fp16: bool = False):
    assert a.keys() == b.keys()
    tol = 1e-2 if fp16 else 1e-5
    torch.testing.assert_close(a.values().float(), b.values().float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "weighted,fp16,dtype",
    [(False, False, torch.int64), (True, False, torch.int32), (False, True, torch.int64)],
)
def test_script_matches_scripted_torchrec(weighted, fp16, dtype):
    theirs, ours = _pair(weighted, fp16)
    scripted_t, scripted_o = torch.jit.script(theirs), torch.jit.script(ours)
    for B in (1, 4):
        kjt = _kjt(B, B, weighted, dtype)
        _close(scripted_o(kjt), scripted_t(kjt), fp16)
        _close(scripted_o(kjt), ours(kjt), fp16)


def test_script_save_load_round_trip():
    theirs, ours = _pair(True)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(ours), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    kjt = _kjt(3, 7, True)
    _close(loaded(kjt), theirs(kjt))


def test_script_refuses_ids_outside_a_table():
    _, ours = _pair(False)
    scripted = torch.jit.script(ours)
    kjt = _kjt(2, 0, False)
    bad = KeyedJaggedTensor(keys=KEYS, values=kjt.values().clone(), lengths=kjt.lengths())
    bad.values()[-1] = 5  # f3 reads the one-row table
    with pytest.raises(Exception, match=r"f3@one: ids in \[0, 5\], outside the table's \[0, 1\)"):
        scripted(bad)


class _Model(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.sparse = torch.nn.ModuleDict({"ebc": ebc})
        self.head = torch.nn.Linear(12, 1)

    def forward(self, kjt):
        return self.head(self.sparse["ebc"](kjt).values())


_CHILD = """
import sys, torch
import fbtriton_dist
from fbtriton_dist.modules import ir
ep = ir.load(sys.argv[1])
kjt, expected = torch.load(sys.argv[2], weights_only=False)
torch.testing.assert_close(ep.module()(kjt), expected, atol=1e-5, rtol=1e-5)
model = ir.decapsulate_ir_modules(torch.export.unflatten(ep))
assert isinstance(model.sparse.ebc, fbtriton_dist.EmbeddingBagCollection), type(model.sparse.ebc)
torch.testing.assert_close(model(kjt), expected, atol=1e-5, rtol=1e-5)
print("child ok")
"""


def test_ir_round_trip_through_another_process(tmp_path):
    """encapsulate -> export (dynamic batch) -> save; another process loads and runs it, and
    decapsulates it into our module; here, decapsulated, it still trains like TorchRec's."""
    theirs_ebc, ours_ebc = _pair(True)
    torch.manual_seed(1)
    theirs = _Model(theirs_ebc)
    ours = _Model(ours_ebc)
    ours.head.load_state_dict(theirs.head.state_dict())
    ours, fqns = ir.encapsulate_ir_modules(ours)
    assert fqns == ("sparse.ebc",)
    kjt = _kjt(4, 0, True)
    shapes = torch.export.ShapesCollection()
    for t in (kjt.values(), kjt.lengths(), kjt.weights()):
        shapes[t] = (torch.export.Dim.AUTO,)
    ep = torch.export.export(
        ours, (kjt,), dynamic_shapes=shapes, strict=False, preserve_module_call_signature=fqns
    )
    ops = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert torch.ops.fbtriton_dist.ebc_portable_lookup.default in ops
    assert torch.ops.fbtriton_dist.ebc_lookup.default not in ops  # no process-local handle
    torch.export.save(ep, tmp_path / "model.pt2")
    other = _kjt(6, 3, True)  # another batch size
    with torch.no_grad():
        torch.save((other, theirs(other)), tmp_path / "expected.pt")
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path / "model.pt2"),
         str(tmp_path / "expected.pt")],
        capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == 0 and "child ok" in child.stdout, child.stderr[-3000:]

    back = ir.decapsulate_ir_modules(torch.export.unflatten(ir.load(tmp_path / "model.pt2")))
    ebc = back.sparse.ebc
    assert isinstance(ebc, fbtriton_dist.EmbeddingBagCollection)
    for name, p in theirs_ebc.state_dict().items():
        torch.testing.assert_close(ebc.state_dict()[name], p)
    loss_t = theirs_ebc(other).values().square().sum()
    loss_o = ebc(other).values().square().sum()
    torch.testing.assert_close(loss_o, loss_t)
    loss_t.backward()
    loss_o.backward()
    for name, p in theirs_ebc.named_parameters():
        torch.testing.assert_close(dict(ebc.named_parameters())[name].grad, p.grad, msg=name)


def test_ir_metadata_that_is_not_ours_is_refused():
    _, ours = _pair(False)
    data = ir.serialize(ours)
    assert ir.deserialize(data).embedding_bag_configs()[1].pooling == PoolingType.MEAN
    with pytest.raises(ValueError, match="ir_metadata: not the JSON"):
        ir.deserialize(torch.tensor([0xFF, 0x00], dtype=torch.uint8))
    with pytest.raises(ValueError, match="ir_metadata: expected format 1, got 7"):
        ir.deserialize(torch.frombuffer(bytearray(b'{"format": 7}'), dtype=torch.uint8))
