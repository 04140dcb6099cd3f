"""``CommOptions(fixed_shapes=True)`` on real gloo groups: the sync-free input dist.

- every sharding type mixed, weighted and MEAN, uneven batch sizes and a rank without samples,
  several steps whose id counts change: outputs, weights and optimizer state equal to the
  default input dist (bit for bit on the CPU);
- a KeyedJaggedTensor whose values are longer than its lengths use (a static buffer);
- an id out of range: every rank raises, the sending rank names the id;
- a batch size that changes, more ids than ``max_ids``: ValueError before any collective;
- fp16 and fp32 tables (two TBE groups, each padded to its own slots);
- the message layout; the output dist's slice path on row-, table- and column-wise plans.
"""

import copy

import pytest
import torch

from tests.sharding.harness import device, run_ranks
from tests.sharding.test_lean import _reference, _same, _shard
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt


def _local_state(m):
    out = []
    for v in m.state_dict().values():
        out += [s.tensor for s in v.local_shards()] if hasattr(v, "local_shards") else [v]
    out += [s for tbe in m.tbes for st in tbe.split_optimizer_states() for s in st]
    return out


def _equal_to_plain(rank, world, weighted, even=False):
    configs, dev = _configs(weighted), device()
    ref = _reference(configs, weighted, "rowwise_adagrad", dev)
    sizes = [4, 4, 4][:world] if even else [6, 0, 5][:world]
    names = [f for c in configs for f in c.feature_names]
    max_ids = 3 * len(names) * max(sizes)
    plain = _shard(ref, "mixed", world, "rowwise_adagrad")
    fixed = _shard(ref, "mixed", world, "rowwise_adagrad", fixed_shapes=True, max_ids=max_ids)
    lo = sum(sizes[:rank])
    C = torch.randn(sum(sizes), sum(c.embedding_dim * len(c.feature_names) for c in configs),
                    generator=torch.Generator().manual_seed(7)).to(dev)
    identical, counts = True, []
    for step in range(4):
        batch = _global_batch(configs, sum(sizes), step, weighted)
        local = _kjt(*batch, lo, lo + sizes[rank], reverse_keys=rank % 2 == 1).to(dev)
        counts.append(local.values().numel())
        if step == 3:  # a static buffer: values longer than the lengths use
            from torchrec import KeyedJaggedTensor

            pad = 5
            local = KeyedJaggedTensor(
                keys=local.keys(),
                values=torch.cat([local.values(), local.values().new_full((pad,), 10**6)]),
                lengths=local.lengths(),
                weights=torch.cat([local.weights(), local.weights().new_ones(pad)])
                if weighted else None,
            )
        mine = C[lo : lo + sizes[rank]]
        outs = []
        for m in (plain, fixed):
            kjt = local if m is fixed else _kjt(*batch, lo, lo + sizes[rank]).to(dev)
            out = m(kjt).values()
            (out * mine).sum().backward()
            outs.append(out.detach())
        identical &= _same(outs[0], outs[1])
    fixed.poll_input()
    identical &= all(_same(a, b) for a, b in
                     zip(_local_state(plain), _local_state(fixed), strict=True))
    report = fixed.comm_report()
    return identical, counts, report, fixed.input_dist_.send_msgs[0].nbytes


def _equal_cases(rank, world, cases):
    """``_equal_to_plain(weighted, even)`` for each case on one set of ranks."""
    return [_equal_to_plain(rank, world, *case) for case in cases]


@pytest.mark.parametrize("world,cases", [(2, ((True, False), (False, True))),
                                         (3, ((False, False),))], ids=["2", "3"])
def test_fixed_shapes_equal_the_default_input_dist(world, cases):
    """Uneven batches (one empty; weighted on 2 ranks), and even ones (the receiver sums every
    source's ids in one reduction)."""
    per_rank = run_ranks(_equal_cases, world, cases)
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        for rank, (identical, _, _, _) in enumerate(results):
            assert identical, f"rank {rank} {case}: fixed_shapes changed the result"
        assert len({c for _, counts, _, _ in results for c in counts}) > 2  # id counts changed
        reports = [r[2] for r in results]
        for key in ("input_dist.data", "output_dist.forward"):
            assert sum(r[key]["sent"] for r in reports) == sum(
                r[key]["received"] for r in reports), case
        assert sum(r["input_dist.data"]["ids_sent"] for r in reports) == sum(
            r["input_dist.data"]["ids_received"] for r in reports), case


def _bad(rank, world, case):
    configs, dev = _configs(False), device()
    ref = _reference(configs, False, "sgd", dev)
    fixed = _shard(ref, "mixed", world, "sgd", fixed_shapes=True)
    B = BATCH[:world]
    lo = sum(B[:rank])
    batch = _global_batch(configs, sum(B), 0, False)
    local = _kjt(*batch, lo, lo + B[rank]).to(dev)
    fixed(local)  # fixes the shapes
    if case == "bad_id":
        feats, lengths, values, weights = batch
        values = dict(values)
        f = feats[0][0]
        values[f] = values[f].clone()
        values[f][-1] = 10**6 + rank  # the last sample's bag: on the last rank
        local = _kjt(feats, lengths, values, weights, lo, lo + B[rank]).to(dev)
    elif case == "batch_size":
        local = _kjt(*batch, lo, lo + B[rank] - 1).to(dev)
    elif case == "max_ids":
        from torchrec import KeyedJaggedTensor

        v = local.values()
        local = KeyedJaggedTensor(keys=local.keys(), values=torch.cat([v, v[:1]]),
                                  lengths=local.lengths())
    fixed(local)
    fixed.poll_input()
    return "no error"


def test_fixed_shapes_bad_id_stops_every_rank_and_names_it():
    with pytest.raises(RuntimeError) as info:
        run_ranks(_bad, 2, "bad_id", timeout=120)
    text = str(info.value)
    assert "1000001" in text and "out of range" in text  # the sender names it
    assert "found bad input" in text  # the other rank says who


@pytest.mark.parametrize("case,message", [("batch_size", "batch size"),
                                          ("max_ids", "capacity")])
def test_fixed_shapes_refuses_a_changed_shape(case, message):
    with pytest.raises(RuntimeError) as info:
        run_ranks(_bad, 2, case, timeout=120)
    assert message in str(info.value) and "fixed_shapes" in str(info.value)


def test_fixed_message_layout():
    from fbtriton_dist.sharding.dist.fixed import fixed_message

    m = fixed_message(3, 5, torch.int32, True)
    assert m.pieces == {"meta": (0, torch.int64, 1), "lengths": (8, torch.int32, 3),
                        "ids": (24, torch.int32, 5), "weights": (48, torch.float32, 5)}
    assert m.nbytes == 72
    from fbtriton_dist.sharding import CommOptions

    with pytest.raises(ValueError, match="dedup"):
        CommOptions(fixed_shapes=True, dedup=True)
    with pytest.raises(ValueError, match="max_ids"):
        CommOptions(max_ids=10)


def _output_paths(rank, world):
    configs, dev = _configs(False), device()
    ref = _reference(configs, False, "sgd", dev)
    out = {}
    for kind in ("row_wise", "table_wise", "column_wise", "mixed"):
        m = _shard(ref, kind, world, "sgd")
        plan = m.output_dist_.out._slices(BATCH[:world])
        out[kind] = None if plan is None else plan[-2:]  # (sends x as it is, one sum)
    return out


def _check_output_dist_sends_slices_for_row_table_and_column_wise(results):
    """The equality tests above and in test_sharded_ebc run these plans: here, that the output
    dist took its slice path for them (row-wise: the partials as they are, summed by one
    exchange_sum)."""
    for paths in results:
        assert paths["row_wise"] == (True, True)
        assert paths["column_wise"] is not None and paths["column_wise"][1] is False
    # these tiny tables all sit on one rank: the other sends nothing (the flat path then)
    assert any(paths["table_wise"] is not None for paths in results)


def _two_dtypes(rank, world):
    """fp16 and fp32 tables: one TBE group per dtype, each padded to its own id slots."""
    import dataclasses

    from torchrec.modules.embedding_configs import DataType

    dev = device()
    configs = [dataclasses.replace(c, data_type=DataType.FP16) if c.name in ("rw", "tw") else c
               for c in _configs(True)]
    ref = _reference(configs, True, "rowwise_adagrad", dev)
    sizes = BATCH[:world]
    names = [f for c in configs for f in c.feature_names]
    mods = []
    for comm in ({}, {"fixed_shapes": True, "max_ids": 3 * len(names) * max(sizes)}):
        torch.manual_seed(5)  # the same stochastic-rounding seeds in both
        mods.append(_shard(ref, "mixed", world, "rowwise_adagrad", **comm))
    lo = sum(sizes[:rank])
    identical = len(mods[1].tbes) == 2
    for step in range(3):
        batch = _global_batch(configs, sum(sizes), step, True)
        local = _kjt(*batch, lo, lo + sizes[rank]).to(dev)
        outs = []
        for m in mods:
            out = m(local).values()
            out.sum().backward()
            outs.append(out.detach())
        identical &= _same(outs[0], outs[1])
    identical &= all(_same(a, b) for a, b in
                     zip(_local_state(mods[0]), _local_state(mods[1]), strict=True))
    return identical




def _static_copy(rank, world):
    """What the overlapped CUDA graph keeps between replays: a copy of one fixed-shape input
    dist output in buffers of its own (each TBE group's ids, offsets, weights and the own
    lengths), which the next batch's output is copied into."""
    import dataclasses

    from torchrec.modules.embedding_configs import DataType

    from fbtriton_dist.sharding.pipeline import _dist_tensors, _static_dist_out

    configs = [dataclasses.replace(c, data_type=DataType.FP16) if c.name in ("rw", "tw") else c
               for c in _configs(True)]
    ref = _reference(configs, True, "sgd", device())
    sizes = BATCH[:world]
    names = [f for c in configs for f in c.feature_names]
    m = _shard(ref, "mixed", world, "sgd", fixed_shapes=True,
               max_ids=3 * len(names) * max(sizes))
    lo = sum(sizes[:rank])
    outs = [m.input_dist(_kjt(*_global_batch(configs, sum(sizes), step, True), lo,
                              lo + sizes[rank]).to(device())) for step in range(2)]
    static = _static_dist_out(outs[0])
    pairs = _dist_tensors(outs[0], static)
    ok = len(m.tbes) == 2 and len(pairs) == 1 + 3 * 2  # lengths, then (ids, offsets, w) x 2
    ok &= all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in pairs)
    lk = static.lookup
    ok &= lk.indices is lk.groups[0][0] and lk.offsets is lk.groups[0][1]
    ok &= lk.per_sample_weights is lk.groups[0][2]
    for a, b in _dist_tensors(outs[1], static):  # the next batch becomes the current one
        b.copy_(a)
    ok &= all(torch.equal(a, b) for a, b in _dist_tensors(outs[1], static))
    return ok


def _on_two_ranks(rank, world):
    return _output_paths(rank, world), _two_dtypes(rank, world), _static_copy(rank, world)


def test_output_paths_two_table_dtypes_and_a_static_copy_of_a_fixed_input_dist_output():
    """Three checks on one start-up of 2 ranks: the output dist's slice paths; fixed shapes
    with fp16 and fp32 tables (one TBE group each) equal to the default; the static copy of a
    fixed-shape input dist output."""
    paths, two_dtypes, static_copy = zip(*run_ranks(_on_two_ranks, 2), strict=True)
    _check_output_dist_sends_slices_for_row_table_and_column_wise(paths)
    assert all(two_dtypes)
    assert all(static_copy)


def _shared_feature(rank, world, kernels):
    """Feature ``f`` feeds two tables (``a``: 10 rows, row-wise on both ranks; ``b``: 5 rows,
    table-wise on the last, with ``g``): an id of ``f`` must be valid for both, so it lands in
    two shard-features, and the fixed-shape check counts both (``cover`` 2 for ``f``).
    ``kernels``: the Triton backend, so the send side runs the kernels with their own check
    (as on CUDA; on the CPU under the interpreter). A good batch, then a bad one (an id of
    ``f`` valid for ``a`` only, on rank 1): (good batch right, its shape, the error)."""
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    import fbtriton_dist
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding
    from fbtriton_dist.sharding import CommOptions

    dev = device()
    configs = [
        EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=4, feature_names=["f"]),
        EmbeddingBagConfig(name="b", num_embeddings=5, embedding_dim=3,
                           feature_names=["f", "g"]),
    ]
    plan = ShardingPlan(world_size=world, local_world_size=world, tables=(
        TableSharding(name="a", sharding="row_wise", num_embeddings=10, embedding_dim=4,
                      shards=(Shard(rank=0, row_start=0, row_end=6, col_start=0, col_end=4),
                              Shard(rank=1, row_start=6, row_end=10, col_start=0, col_end=4))),
        TableSharding(name="b", sharding="table_wise", num_embeddings=5, embedding_dim=3,
                      shards=(Shard(rank=1, row_start=0, row_end=5, col_start=0, col_end=3),)),
    ))
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, device=dev)
    sgd = fbtriton_dist.optim.SGD()
    backend = "triton" if kernels else "auto"
    plain = fbtriton_dist.shard(copy.deepcopy(ref), plan, optimizer=sgd)
    fixed = fbtriton_dist.shard(copy.deepcopy(ref), plan, optimizer=sgd, backend=backend,
                                comm=CommOptions(fixed_shapes=True))
    def batch(bad: bool):
        # two samples per rank; f's ids are valid for both tables (< 5) except in the bad one
        f_ids = [[1, 4], [0, 3, 2]] if rank == 0 else [[2], [4, 4]]
        if bad and rank == 1:
            f_ids[0] = [7]  # a row of a, past b's 5 rows
        g_ids = [[0], [1, 2]]
        values = torch.tensor([i for bag in f_ids + g_ids for i in bag])
        lengths = torch.tensor([len(bag) for bag in f_ids + g_ids])
        return KeyedJaggedTensor(keys=["f", "g"], values=values, lengths=lengths).to(dev)

    kjt = batch(False)
    outs = [m(kjt).values().detach() for m in (plain, fixed)]
    want = ref(kjt).values().detach()  # the unsharded collection on this rank's samples
    good = torch.equal(outs[0], outs[1]) and torch.allclose(outs[1], want, atol=1e-6)
    error = "no error"
    try:
        for _ in range(2):  # the flag is read a few steps later
            fixed(batch(True))
        fixed.poll_input()
    except Exception as e:  # every rank stops
        error = f"{type(e).__name__}: {e}"
    return good, tuple(outs[1].shape), error


@pytest.mark.parametrize("kernels", [False, True])
def test_fixed_shapes_with_a_feature_two_tables_share(kernels):
    if kernels and device().type == "cuda":
        pytest.skip("on CUDA the kernels run in every case")
    got = run_ranks(_shared_feature, 2, kernels, timeout=120)
    assert [g[:2] for g in got] == [(True, (2, 10))] * 2  # f:a, f:b, g:b
    for _, _, error in got:  # both ranks stop on rank 1's bad id
        assert "out of range" in error or "found bad input" in error, error
