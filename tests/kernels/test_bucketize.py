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
    # 10 copies of one feature (a replicated table on 10 ranks): two tiles of its ids
    "replicas": ([(12, 2)], [0, 0], 3, [(0, 0, 12)] * 10 + [(1, 0, 6), (1, 6, 12)]),
}


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
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
        # the launch grid given (what the input dist caches) instead of read from sf_feature
        from fbtriton_dist.kernels.bucketize import by_feature

        table = by_feature([f for f, _, _ in sfs]).to(dev)
        padded = kernels.bucketize(*args, B, capacity=len(expected[1]) + 5, table=table)
    else:
        from fbtriton_dist.ops import cpu

        impl = reference if backend == "reference" else cpu
        lengths, ids, w = impl.bucketize(indices, offsets, psw, *cols, B)
        padded = impl.bucketize(indices, offsets, psw, *cols, B, capacity=len(expected[1]) + 5)
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
@pytest.mark.parametrize("config", [None, "32,32,4", "2,8,2"])
def test_bucketize_many_bags_and_long_bags(config, monkeypatch):
    """More samples than one program's bags and bags longer than one step's ids, for the
    default launch config and others (``FBTD_BUCKETIZE``)."""
    from fbtriton_dist import kernels

    if config:
        monkeypatch.setenv("FBTD_BUCKETIZE", config)

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


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_launch_grid_lists_each_feature_with_its_shard_features():
    from fbtriton_dist.kernels.bucketize import by_feature

    table = by_feature([2, 0, 2, 2, 1])
    # K = 3 shard-features at most, padded to 4 with -1; features in order
    assert table.tolist() == [[0, 1, -1, -1, -1], [1, 4, -1, -1, -1], [2, 0, 2, 3, -1]]
    assert by_feature([0, 0]).tolist() == [[0, 0, 1]]
    # more than MAX_K shard-features of one feature (a replica per rank): several rows
    many = by_feature([0] * 19 + [1])
    assert many.tolist() == [[0, *range(0, 8)], [0, *range(8, 16)],
                             [0, 16, 17, 18, -1, -1, -1, -1, -1], [1, 19, *[-1] * 7]]


def _slotted_case(weighted):
    """Three destinations (the middle one gets nothing), shard-features listed destination by
    destination, each destination's pieces at scattered places of one buffer."""
    tables, ftm, B = [(40, 4), (9, 2)], [0, 1, 0], 37
    sfs = [(0, 0, 20), (2, 0, 20), (1, 0, 9), (0, 20, 40), (2, 20, 40)]
    dest = [0, 0, 0, 2, 2]
    indices, offsets, psw = make_batch(tables, ftm, B, 40, weighted=weighted, hot=True)
    sf_start = {0: 0, 2: 3}
    id_at, w_at, len_at = {0: 4000, 2: 100}, {0: 3900, 2: 50}, {0: 5, 2: 400}
    args = dict(
        sf_first=torch.tensor([sf_start[q] * B for q in dest]),
        sf_id_start=torch.tensor([id_at[q] for q in dest]),
        sf_w_start=torch.tensor([w_at[q] for q in dest]),
        sf_len_start=torch.tensor([len_at[q] + (s - sf_start[q]) * B
                                   for s, q in enumerate(dest)]),
    )
    cols = [torch.tensor(c, dtype=torch.int64) for c in zip(*sfs, strict=True)]
    return indices, offsets, psw, cols, B, sfs, dest, args


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_bucketize_into_places_each_destination(backend, weighted, id_dtype):
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    indices, offsets, psw, cols, B, sfs, dest, args = _slotted_case(weighted)
    expected_lengths, expected_ids, expected_w = _loop(indices, offsets, psw, sfs, B)
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    buf_ids = torch.full((9000,), -7, dtype=id_dtype, device=dev)
    buf_w = torch.full((9000,), -7.0, device=dev)
    buf_len = torch.full((1000,), -7, dtype=torch.int32, device=dev)
    if backend == "triton":
        from fbtriton_dist import kernels as impl
    else:
        impl = reference
    moved = [t.to(dev) if t is not None else None for t in (indices, offsets, psw, *cols)]
    lengths = impl.bucketize_into(*moved, B, buf_ids, buf_w if weighted else None, buf_len,
                                  **{k: v.to(dev) for k, v in args.items()})
    assert lengths.cpu().tolist() == expected_lengths
    # destination by destination: its ids in bucketize order at its place, nothing else touched
    want_ids = torch.full((9000,), -7, dtype=id_dtype)
    want_w = torch.full((9000,), -7.0)
    want_len = torch.full((1000,), -7, dtype=torch.int32)
    at = 0
    for q, id_at, w_at, len_at in ((0, 4000, 3900, 5), (2, 100, 50, 400)):
        mine = [s for s, d in enumerate(dest) if d == q]
        n = sum(expected_lengths[s * B + b] for s in mine for b in range(B))
        want_ids[id_at : id_at + n] = torch.tensor(expected_ids[at : at + n], dtype=id_dtype)
        want_w[w_at : w_at + n] = torch.tensor(expected_w[at : at + n])
        flat = [expected_lengths[s * B + b] for s in mine for b in range(B)]
        want_len[len_at : len_at + len(flat)] = torch.tensor(flat, dtype=torch.int32)
        at += n
    assert torch.equal(buf_ids.cpu(), want_ids)
    assert torch.equal(buf_len.cpu(), want_len)
    if weighted:
        assert torch.equal(buf_w.cpu(), want_w)
    else:
        assert (buf_w == -7.0).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_segment_copy_moves_every_segment(backend, weighted, n):
    """R=3 sources of n segments each (some empty, one source empty), ids past a source's
    last segment are not copied; each segment lands at its destination."""
    if backend == "triton" and not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(n)
    R, capacity = 3, 1500
    counts = torch.randint(0, 400 // n + 1, (R, n), generator=g)
    counts[1] = 0
    counts[0, 0] = 0
    src_base = torch.tensor([10, 2000, 4000])
    src = torch.randint(0, 10**6, (6000,), generator=g)
    src_w = torch.rand(6000, generator=g)
    # destinations: a random order of the segments, back to back, after 7 slots
    order = torch.randperm(R * n, generator=g)
    flat = counts.reshape(-1)
    dst = torch.empty(R * n, dtype=torch.int64)
    dst[order] = 7 + torch.cumsum(flat[order], 0) - flat[order]
    dst = dst.view(R, n)
    dev = DEVICE if backend == "triton" else torch.device("cpu")
    out = torch.full((2000,), -1, dtype=torch.int32, device=dev)
    out_w = torch.full((2000,), -1.0, device=dev)
    if backend == "triton":
        from fbtriton_dist import kernels as impl
    else:
        impl = reference
    impl.segment_copy(src.to(dev), src_w.to(dev) if weighted else None, src_base.to(dev),
                      (src_base + 3).to(dev), torch.cumsum(counts, 1).to(dev), dst.to(dev),
                      out, out_w if weighted else None, capacity)
    want = torch.full((2000,), -1, dtype=torch.int32)
    want_w = torch.full((2000,), -1.0)
    for r in range(R):
        at = int(src_base[r])
        for i in range(n):
            c, d = int(counts[r, i]), int(dst[r, i])
            want[d : d + c] = src[at : at + c].to(torch.int32)
            want_w[d : d + c] = src_w[at + 3 : at + 3 + c]
            at += c
    assert torch.equal(out.cpu(), want)
    if weighted:
        assert torch.equal(out_w.cpu(), want_w)


@pytest.mark.parametrize("R, groups", [(1, [1]), (2, [3, 2]), (3, [1, 4, 1]), (5, [7])])
def test_segment_plan_matches_the_reference(R, groups):
    """Where each (source, segment) lands: feature-major inside each TBE group, groups at their
    bases; empty segments and an empty source included."""
    if not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    from fbtriton_dist import kernels

    n = sum(groups)
    g = torch.Generator().manual_seed(R * 10 + n)
    counts = torch.randint(0, 50, (R, n), generator=g)
    counts[:, 0] = 0
    counts[R - 1] = 0 if R > 1 else counts[R - 1]
    first, base = [], []
    for k, size in enumerate(groups):
        first += [sum(groups[:k])] * size
        base += [k * 10_000] * size
    first, base = torch.tensor(first), torch.tensor(base)
    want = reference.segment_plan(counts, first, base)
    got = kernels.segment_plan(counts.to(DEVICE), first.to(DEVICE), base.to(DEVICE))
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x.cpu(), y)
    # spelled out for the first source: segment i of a group starts after the group's
    # earlier segments from every source
    i = n - 1
    gi = len(groups) - 1
    lo = sum(groups[:gi])
    assert int(want[1][0, i]) == gi * 10_000 + int(counts[:, lo:i].sum())


def test_segment_plan_refuses_a_table_too_big_for_one_program():
    if not TRITON_OK:
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    from fbtriton_dist import kernels
    from fbtriton_dist.kernels.bucketize import plan_fits

    assert plan_fits(8, 2048) and not plan_fits(9, 2048)
    counts = torch.zeros((16, 2048), dtype=torch.int64, device=DEVICE)
    z = torch.zeros(2048, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"segment_plan: a \[16, 2048\] table"):
        kernels.segment_plan(counts, z, z)


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("bad", [None, "too_big", "negative", "past_the_ids", "reversed_bag",
                                 "double_cover"])
def test_bucketize_into_check_writes_the_failure_flag(bad):
    """``check=(cover, meta, meta_at)``: the kernels check every id (it must land in exactly
    ``cover`` of its feature's shard-features) and every bag, and write 0/1 into each
    destination's meta slot; the ids and lengths written are those of the unchecked call."""
    from fbtriton_dist import kernels
    from fbtriton_dist.kernels.bucketize import by_feature

    indices, offsets, psw, cols, B, sfs, dest, args = _slotted_case(weighted=False)
    n = indices.numel()
    cover = [1, 1, 1]  # per feature (one grid row each): row-wise shards, one per id
    if bad == "too_big":
        indices[n // 2] = 40  # feature 0 or 2 (table of 40 rows): no shard holds it
    elif bad == "negative":
        indices[3] = -1
    elif bad == "past_the_ids":
        indices = indices[:-3]  # the lengths promise 3 ids more than there are
    elif bad == "reversed_bag":
        offsets = offsets.clone()
        offsets[5] = offsets[7] + 1  # bag 5 ends before it starts (offsets decrease)
    elif bad == "double_cover":
        cover = [2, 1, 2]  # what a plan with two column shards per id would expect
    table = by_feature(cols[0].tolist())
    assert [r[0] for r in table.tolist()] == [0, 1, 2]
    moved = [t.to(DEVICE) for t in (indices, offsets, *cols)]
    results = []
    for check in (False, True):
        buf_ids = torch.full((9000,), -7, dtype=torch.int32, device=DEVICE)
        buf_len = torch.full((1000,), -7, dtype=torch.int32, device=DEVICE)
        meta = torch.full((10,), -7, dtype=torch.int64, device=DEVICE)
        meta_at = torch.tensor([1, 5, 8], device=DEVICE)
        extra = dict(check=(torch.tensor(cover, device=DEVICE), meta, meta_at)) if check else {}
        bags = moved[1] if check else moved[1].clamp(max=moved[0].numel())
        lengths = kernels.bucketize_into(moved[0], bags, None, *moved[2:], B, buf_ids, None,
                                         buf_len, **{k: v.to(DEVICE) for k, v in args.items()},
                                         table=table.to(DEVICE), **extra)
        results.append((lengths.cpu(), buf_ids.cpu(), buf_len.cpu()))
    if bad != "reversed_bag":  # (the unchecked call's own clamping differs there)
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
    want = torch.full((10,), -7, dtype=torch.int64)
    want[[1, 5, 8]] = 0 if bad is None else 1
    assert torch.equal(meta.cpu(), want)


@pytest.mark.skipif(not TRITON_OK, reason="Triton needs CUDA or TRITON_INTERPRET=1")
def test_bucketize_into_never_writes_past_a_destination_s_capacity():
    """Negative lengths make bags overlap, so more ids are counted than a destination holds:
    the extra ids are dropped, not written into the next message (its meta, where the failure
    flag is) or past the buffer, and every destination's flag says the batch was bad."""
    from fbtriton_dist import kernels
    from fbtriton_dist.kernels.bucketize import by_feature

    B, C = 2, 4  # 2 features x 2 bags; 4 id slots per destination
    values = torch.full((4,), 1, dtype=torch.int64)
    lengths = torch.tensor([4, -4, 4, -4])  # f0: [0,4) [4,0); f1 the same
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    # destination-major shard-features: destination 0 rows [0,5) of f0 and f1, 1 rows [5,10)
    sf_feature, lo, hi = (torch.tensor(v) for v in ([0, 1, 0, 1], [0, 0, 5, 5], [5, 5, 10, 10]))
    # message q (int32): meta (int64) | 2B lengths | C ids = 10 int32, at 0 and 10
    sf_first = torch.tensor([0, 0, 2 * B, 2 * B])
    sf_id_start = torch.tensor([2 + 2 * B] * 2 + [12 + 2 * B] * 2)
    sf_len_start = torch.tensor([2, 2 + B, 12, 12 + B])
    buf = torch.full((20 + 32,), -7, dtype=torch.int32, device=DEVICE)  # 32 slots of slack
    send = buf[:20]
    meta = send.view(torch.int64)
    meta_at = torch.tensor([0, 5], device=DEVICE)
    table = by_feature(sf_feature.tolist())
    moved = [t.to(DEVICE) for t in (values, offsets, sf_feature, lo, hi, sf_first,
                                    sf_id_start, sf_len_start)]
    kernels.bucketize_into(moved[0], moved[1], None, *moved[2:5], B, send, None, send,
                           moved[5], moved[6], moved[6], moved[7], table=table.to(DEVICE),
                           check=(torch.ones(table.shape[0], dtype=torch.int64, device=DEVICE),
                                  meta, meta_at), capacity=C)
    assert meta[meta_at].tolist() == [1, 1]
    assert (buf[20:] == -7).all()  # nothing past the buffer
    assert (buf[2 + 2 * B : 2 + 2 * B + C] == 1).all()  # destination 0: C ids (row 1)
    assert (buf[12 + 2 * B : 12 + 2 * B + C] == -7).all()  # destination 1 got no ids


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_cpu_bucketize_matches_the_reference_on_random_layouts(id_dtype, monkeypatch):
    """The fast CPU path's layered binary search against the reference: random row ranges
    (cuts, copies, overlaps, empty ones), empty bags, ids outside every range (they land
    nowhere, negative ones included), weights, capacity padding."""
    from fbtriton_dist.ops import cpu, cpu_bucketize

    monkeypatch.setattr(cpu_bucketize, "IDS_PER_SF", 10**9)  # never the reference here
    g = torch.Generator().manual_seed(4)
    for trial in range(40):
        K, B = int(torch.randint(1, 5, (), generator=g)), int(torch.randint(1, 6, (), generator=g))
        E = 30
        lengths = torch.randint(0, 5, (K * B,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        values = torch.randint(-3, E + 3, (int(lengths.sum()),), generator=g).to(id_dtype)
        psw = torch.rand(values.numel(), generator=g) if trial % 2 else None
        S = int(torch.randint(1, 9, (), generator=g))
        sf_key = torch.randint(0, K, (S,), generator=g)
        a = torch.randint(0, E, (S,), generator=g)
        b = torch.randint(0, E + 1, (S,), generator=g)
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        args = (values, offsets, psw, sf_key, lo, hi, B)
        want = reference.bucketize(*args, capacity=values.numel() * S + 2)
        got = cpu.bucketize(*args, capacity=values.numel() * S + 2)
        for x, y in zip(got, want, strict=True):
            if y is None:
                assert x is None
            else:
                assert torch.equal(x, y), trial
