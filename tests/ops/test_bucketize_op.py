"""``ops.bucketize`` as a registered op: torch.library's own checks (schema, fake against real,
autograd registration), meta shapes, and FX / torch.compile(fullgraph) of a caller against
the eager call."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fbtriton_dist.ops import bucketize as ops
from tests.conftest import DEVICE, TRITON_OK
from tests.helpers import make_batch

BACKENDS = ["reference"] + (["triton"] if TRITON_OK else [])
SFS = [(0, 0, 6), (1, 0, 7), (0, 6, 20)]  # (feature, row start, row end)
B = 4


def _inputs(weighted: bool, device: str = "cpu"):
    indices, offsets, psw = make_batch([(20, 4), (7, 3)], [0, 1], B, 5, weighted=weighted,
                                       hot=True, generator=torch.Generator().manual_seed(3))
    cols = [torch.tensor(c, dtype=torch.int64) for c in zip(*SFS, strict=True)]
    return [t.to(device) if t is not None else None for t in (indices, offsets, psw, *cols)]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("capacity", [None, 64])
def test_opcheck(weighted, capacity):
    args = _inputs(weighted)
    torch.library.opcheck(
        torch.ops.fbtriton_dist.bucketize.default,
        (*args, B, "reference", capacity, None),
    )


def test_meta_and_fake_shapes():
    args = [t.to("meta") if t is not None else None for t in _inputs(True)]
    lengths, ids, w = ops.bucketize(*args, B, backend="reference", capacity=64)
    assert lengths.device.type == "meta" and lengths.shape == (len(SFS) * B,)
    assert ids.dtype == torch.int64 and ids.shape == w.shape == (64,)
    with pytest.raises(ValueError, match="bucketize on meta tensors: .* give capacity"):
        ops.bucketize(*args, B, backend="reference")
    real = _inputs(True)
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = [mode.from_tensor(t) if t is not None else None for t in real]
        lengths, ids, w = ops.bucketize(*fake, B, backend="reference")
    assert lengths.shape == (len(SFS) * B,)
    assert isinstance(ids.shape[0], torch.SymInt) and w.shape == ids.shape


class _CountPerShard(torch.nn.Module):
    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    def forward(self, values, offsets, weights, sf_key, lo, hi):
        lengths, ids, w = ops.bucketize(values, offsets, weights, sf_key, lo, hi, B,
                                        backend=self.backend, capacity=values.numel())
        return lengths.view(len(SFS), B).sum(1), ids, w


@pytest.mark.parametrize("backend", BACKENDS)
def test_fx_and_compile_match_eager(backend):
    device = DEVICE if backend == "triton" else "cpu"
    args = _inputs(True, device)
    caller = _CountPerShard(backend)
    expected = caller(*args)
    traced = torch.fx.symbolic_trace(caller)
    assert any(n.target is torch.ops.fbtriton_dist.bucketize for n in traced.graph.nodes)
    compiled = torch.compile(caller, backend="aot_eager", fullgraph=True)
    for got in (traced(*args), compiled(*args)):
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b)
