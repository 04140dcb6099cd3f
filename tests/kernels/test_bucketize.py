"""Input-dist bucketize: the Triton kernel and the PyTorch reference against a plain loop."""

import pytest
import torch

from fbtriton_dist import reference
from tests.conftest import DEVICE, TRITON_OK
from tests.helpers import make_batch


def _loop(indices, offsets, psw, sfs, B):
    lengths, ids, ws = [], [], []
    for f, lo, hi in sfs:
        for b in range(B):
            a, e = int(offsets[f * B + b]), int(offsets[f * B + b + 1])
            for p in range(a, e):
                if lo <= int(indices[p]) < hi:
                    ids.append(int(indices[p]) - lo)
                    ws.append(float(psw[p]) if psw is not None else 0.0)
            lengths.append(len(ids) - sum(lengths))
    return lengths, ids, ws


# (tables, feature_table_map, B, shard-features as (feature, row_start, row_end))
CASES = {
    "row-cuts": ([(20, 4), (7, 3)], [0, 1], 5, [(0, 0, 6), (1, 0, 7), (0, 6, 20)]),
    "column-copies-and-shared": (
        [(30, 4), (9, 2)],
        [0, 0, 1],
        7,
        [(2, 0, 9), (0, 0, 30), (1, 10, 30), (2, 0, 9), (0, 0, 10)],
    ),
    "empty-ranges-B1": ([(5, 2)], [0], 1, [(0, 0, 5), (0, 5, 5)]),
}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_bucketize_matches_loop(name, weighted, backend):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    tables, ftm, B, sfs = CASES[name]
    indices, offsets, psw = make_batch(tables, ftm, B, 9, weighted=weighted, hot=True)
    expected = _loop(indices, offsets, psw, sfs, B)
    cols = [torch.tensor(c, dtype=torch.int64) for c in zip(*sfs, strict=True)]
    if backend == "triton":
        from fbtriton_dist import kernels

        dev = DEVICE
        args = [t.to(dev) if t is not None else None for t in (indices, offsets, psw, *cols)]
        lengths, ids, w = kernels.bucketize(*args, B)
        padded = kernels.bucketize(*args, B, capacity=len(expected[1]) + 5)
    else:
        lengths, ids, w = reference.bucketize(indices, offsets, psw, *cols, B)
        padded = reference.bucketize(indices, offsets, psw, *cols, B, capacity=len(expected[1]) + 5)
    assert lengths.cpu().tolist() == expected[0]
    assert ids.cpu().tolist() == expected[1]
    # sized by a bound instead of a sync: same lengths, the ids first, room after them
    assert padded[0].cpu().tolist() == expected[0] and padded[1].numel() == len(expected[1]) + 5
    assert padded[1][: len(expected[1])].cpu().tolist() == expected[1]
    if weighted:
        torch.testing.assert_close(w.cpu(), torch.tensor(expected[2]))
        torch.testing.assert_close(padded[2][: len(expected[1])].cpu(), torch.tensor(expected[2]))
    else:
        assert w is None


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_bucketize_many_bags_and_long_bags():
    """More samples than one program's 32 and bags longer than one 32-id step."""
    from fbtriton_dist import kernels

    tables, ftm, B = [(50, 4)], [0, 0], 37
    sfs = [(0, 0, 25), (1, 0, 25), (0, 25, 50), (1, 25, 50)]
    indices, offsets, psw = make_batch(tables, ftm, B, 70, weighted=True, hot=True)
    expected = _loop(indices, offsets, psw, sfs, B)
    cols = [torch.tensor(c, dtype=torch.int64).to(DEVICE) for c in zip(*sfs, strict=True)]
    lengths, ids, w = kernels.bucketize(indices.to(DEVICE), offsets.to(DEVICE), psw.to(DEVICE),
                                        *cols, B)
    assert max(expected[0]) > 32
    assert lengths.cpu().tolist() == expected[0]
    assert ids.cpu().tolist() == expected[1]
    assert w.cpu().tolist() == pytest.approx(expected[2], rel=0, abs=0)
