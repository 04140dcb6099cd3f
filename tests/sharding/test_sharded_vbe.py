"""Sharded EmbeddingBagCollection on VBE batches (a batch size per feature, expanded to the
samples by ``inverse_indices``), on real gloo process groups of 2 and 3 ranks.

Every rank holds the same unsharded module (the reference, itself tested against TorchRec's
EBC on VBE KJTs in tests/modules/test_ebc_vbe.py). Each rank feeds its own VBE KJT: different
strides per rank and per feature, in 3 ranks a rank with no samples and a feature with
stride 0; the reference runs all ranks' bags as one VBE KJT (inverse indices shifted). Outputs,
the dense layer's gradient and, after 3 fused steps, weights and optimizer state must agree;
the wire carries the deduplicated rows (bytes counted by hand, below the same samples sent as
a fixed batch); bad strides and inverse indices stop every rank with the feature named. A set
of tables of one D (the expansion's single-gather branch) is checked the same way."""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.sharding.harness import device, run_ranks
from tests.sharding.test_sharded_ebc import _configs, _optimizer, _plan, _state_error

USER = ("f_rw", "f_tw1", "f_cw", "f_dp", "f_grid")  # one bag per user, read by its candidates
SAMPLES = [5, 4, 0]  # samples of ranks 0, 1, 2
USERS = [2, 4, 0]  # users of ranks 0, 1, 2 (rank 1: one user per sample)
ODD = {2: {"f_tw2": 2, "f_rw": 0}}  # rank 2: no samples, bags of f_tw2 that nobody reads


def _strides(configs, rank):
    feats = [f for c in configs for f in c.feature_names]
    strides = {f: USERS[rank] if f in USER else SAMPLES[rank] for f in feats}
    strides.update(ODD.get(rank, {}))
    return strides


def _inverse(f, rank):
    B = SAMPLES[rank]
    if f in USER:  # samples of a user are consecutive, about B / users each
        return torch.arange(B) * USERS[rank] // max(B, 1)
    return torch.arange(B).flip(0) if f == "f_tw2" else torch.arange(B)


def _bags(configs, world, step, weighted):
    """Per rank, per feature: (lengths, ids, weights) of its bags."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for r in range(world):
        per = {}
        for c in configs:
            for f in c.feature_names:
                n = _strides(configs, r)[f]
                lengths = torch.randint(0, 4, (n,), generator=g)
                if n:
                    lengths[0] = 0 if f == "f_cw" else lengths[0]  # an empty bag
                ids = torch.randint(0, c.num_embeddings, (int(lengths.sum()),), generator=g)
                ids[: ids.numel() // 2] = 1  # a hot id
                w = torch.rand(ids.numel(), generator=g) + 0.5
                per[f] = (lengths, ids, w if weighted else None)
        out.append(per)
    return out


def _vbe_kjt(per, strides, inverse, keys):
    from torchrec import KeyedJaggedTensor

    weighted = per[keys[0]][2] is not None
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.cat([per[f][1] for f in keys]),
        lengths=torch.cat([per[f][0] for f in keys]),
        weights=torch.cat([per[f][2] for f in keys]) if weighted else None,
        stride_per_key_per_rank=[[strides[f]] for f in keys],
        inverse_indices=(list(keys), torch.stack([inverse[f] for f in keys])),
    )


def _local_kjt(configs, bags, rank, reverse=False):
    feats = [f for c in configs for f in c.feature_names]
    keys = list(reversed(feats)) if reverse else feats
    inverse = {f: _inverse(f, rank) for f in feats}
    return _vbe_kjt(bags[rank], _strides(configs, rank), inverse, keys)


def _global_kjt(configs, bags, world):
    """All ranks' bags as one VBE KJT of every rank's samples, rank after rank."""
    feats = [f for c in configs for f in c.feature_names]
    per, strides, inverse = {}, {}, {}
    for f in feats:
        parts = [bags[r][f] for r in range(world)]
        weighted = parts[0][2] is not None
        per[f] = (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                  torch.cat([p[2] for p in parts]) if weighted else None)
        ns = [_strides(configs, r)[f] for r in range(world)]
        strides[f] = sum(ns)
        inverse[f] = torch.cat([_inverse(f, r) + sum(ns[:r]) for r in range(world)])
    return _vbe_kjt(per, strides, inverse, feats)


def _vbe_vs_unsharded(rank, world, kind, opt_name, weighted, dedup=False):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding.comm.options import CommOptions

    configs = _configs(weighted)
    dev = device()
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=dev)
    cls, kwargs = (torch.optim.Adam, {"lr": 0.05, "eps": 1e-8}) if opt_name == "adam" else (
        _optimizer(opt_name))
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    total_D = sum(c.embedding_dim * len(c.feature_names) for c in configs)
    dense = torch.nn.Linear(total_D, 1, device=dev)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, _plan(kind, world), comm=CommOptions(dedup=dedup))
    dense_s = copy.deepcopy(dense)
    lo, B = sum(SAMPLES[:rank]), SAMPLES[rank]
    report = {}
    for step in range(3):
        bags = _bags(configs, world, step, weighted)
        out_ref = ref(_global_kjt(configs, bags, world).to(dev)).values()
        (dense(out_ref).sum() / world).backward()  # the tables' gradients are divided by R
        out = sharded(_local_kjt(configs, bags, rank, reverse=rank == 1).to(dev)).values()
        assert out.shape == (B, total_D)
        dense_s(out).sum().backward()
        grads = [p.grad.clone() for p in dense_s.parameters()]
        for gr in grads:
            dist.all_reduce(gr)
            gr /= world
        report[f"step{step}.out"] = (out - out_ref[lo : lo + B]).abs().max().item() if B else 0
        report[f"step{step}.dense_grad"] = max(
            (a - p.grad).abs().max().item() for a, p in zip(grads, dense.parameters(), strict=True)
        )
        dense.zero_grad()
        dense_s.zero_grad()
    full = sharded.gather_full_state_dict()
    report["weights"] = max(
        (full[k].float() - v.float()).abs().max().item() for k, v in ref.state_dict().items()
    )
    report["state"] = _state_error(ref, sharded, configs)
    return report


CASES = [
    # (sharding kind, optimizer, weighted, dedup ids on the wire)
    ("row_wise", "rowwise_adagrad", False, False),
    ("table_wise", "adam", True, False),
    ("column_wise", "adagrad", False, True),
    ("table_row_wise", "sgd", False, False),
    ("grid_shard", "sgd", True, False),
    ("data_parallel", "rowwise_adagrad", False, False),
    ("mixed", "adagrad", False, True),
    ("mixed", "sgd", True, False),
]


def _all_cases(rank, world):
    """Every case on one set of ranks (a rank start-up costs more than a case)."""
    return {case: _vbe_vs_unsharded(rank, world, *case) for case in CASES}


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_vbe_matches_unsharded(world):
    for rank, reports in enumerate(run_ranks(_all_cases, world)):
        for case, report in reports.items():
            for key, err in report.items():
                assert err < 2e-5, f"rank {rank} {case} {key}: {err}"


def _expanded(kjt):
    """The same samples as a fixed batch: every sample gets its own copy of its bag."""
    from torchrec import KeyedJaggedTensor

    keys, (inv_keys, inv) = kjt.keys(), kjt.inverse_indices()
    lengths, values = [], []
    for k, jt in zip(keys, kjt.split([1] * len(keys)), strict=True):
        rows = inv[inv_keys.index(k)]
        offsets = jt.offsets()
        for b in rows.tolist():
            lengths.append(offsets[b + 1] - offsets[b])
            values.append(jt.values()[offsets[b] : offsets[b + 1]])
    none = torch.zeros(0, dtype=torch.int64)
    return KeyedJaggedTensor(keys=keys, values=torch.cat([none, *values]),
                             lengths=torch.stack(lengths) if lengths else none, stride=inv.shape[1])


def _padded(n_bytes):
    return -(-n_bytes // 8) * 8


def _traffic_and_bad_input(rank, world):
    import torchrec

    import fbtriton_dist
    from fbtriton_dist.sharding.comm.options import CommOptions

    configs = _configs(False)
    plan = _plan("row_wise", world)
    torch.manual_seed(0)
    sharded = fbtriton_dist.shard(fbtriton_dist.EmbeddingBagCollection(tables=configs), plan,
                                  optimizer=fbtriton_dist.optim.SGD())
    bags = _bags(configs, world, 0, False)
    vbe = _local_kjt(configs, bags, rank)
    out = {"vbe_out": sharded(vbe).values().detach().tolist()}
    report = sharded.comm_report()
    # by hand: every table is row-wise over all ranks, so every rank holds one shard-feature
    # of every feature; a message to q holds my bags' lengths (int32, only the real bags of
    # each feature) and my ids in q's rows (int32); q sends me each feature's rows at my stride
    strides, feats = _strides(configs, rank), [f for c in configs for f in c.feature_names]
    dims = {f: c.embedding_dim for c in configs for f in c.feature_names}
    table = {f: c.name for c in configs for f in c.feature_names}
    sent = ids_sent = 0
    for q in range(world):
        if q == rank:
            continue
        n = 0
        for f in feats:
            shard = plan.table(table[f]).shards[q]
            ids = bags[rank][f][1]
            n += int(((ids >= shard.row_start) & (ids < shard.row_end)).sum())
        ids_sent += n
        sent += _padded(4 * sum(strides.values())) + _padded(4 * n)
    out["hand"] = {
        "ids_sent": ids_sent, "data_sent": sent,
        "out_received": 4 * (world - 1) * sum(strides[f] * dims[f] for f in feats),
    }
    out["vbe"] = report
    fixed = _expanded(vbe)
    out["fixed_out"] = sharded(fixed).values().detach().tolist()
    out["fixed"] = sharded.comm_report()

    def bad(kjt, module=sharded):
        try:
            module(kjt)
        except (ValueError, RuntimeError) as e:
            return str(e)
        return "no error"

    def kjt_with(**changes):
        args = {"keys": vbe.keys(), "values": vbe.values(), "lengths": vbe.lengths(),
                "stride_per_key_per_rank": vbe.stride_per_key_per_rank(),
                "inverse_indices": vbe.inverse_indices()}
        if rank == 1:
            args |= changes
        return torchrec.KeyedJaggedTensor(**args)

    keys, (_, inv) = vbe.keys(), vbe.inverse_indices()
    out_of_range = inv.clone()
    if rank == 1:
        out_of_range[0, -1] = strides[keys[0]]  # one past feature f_rw's bags
    out["bad_inverse"] = bad(kjt_with(inverse_indices=(keys, out_of_range)))
    too_many = [[s + 1] if i == 1 else [s] for i, (s,) in
                enumerate(vbe.stride_per_key_per_rank())]
    out["bad_strides"] = bad(kjt_with(stride_per_key_per_rank=too_many))
    out["bad_shape"] = bad(kjt_with(inverse_indices=(keys, inv[:, None])))
    fixed_shapes = fbtriton_dist.shard(
        fbtriton_dist.EmbeddingBagCollection(tables=configs), plan,
        optimizer=fbtriton_dist.optim.SGD(), comm=CommOptions(fixed_shapes=True))
    out["fixed_shapes"] = bad(vbe, fixed_shapes)
    out["after"] = sharded(vbe).values().detach().tolist()  # the group still works
    return out


def test_vbe_wire_bytes_by_hand_and_below_the_fixed_batch_and_bad_input_stops_every_rank():
    world = 3
    results = run_ranks(_traffic_and_bad_input, world)
    for rank, r in enumerate(results):
        vbe, hand = r["vbe"], r["hand"]
        assert torch.allclose(torch.tensor(r["vbe_out"]), torch.tensor(r["fixed_out"]),
                              atol=1e-6), rank
        assert r["after"] == r["vbe_out"], rank
        assert vbe["input_dist.data"]["ids_sent"] == hand["ids_sent"], rank
        assert vbe["input_dist.data"]["sent"] == hand["data_sent"], rank
        assert vbe["output_dist.forward"]["received"] == hand["out_received"], rank
        assert vbe["output_dist.backward"]["sent"] == hand["out_received"], rank
    reports = [(r["vbe"], r["fixed"]) for r in results]
    for key, mine in (("input_dist.data", "sent"), ("output_dist.forward", "received")):
        assert sum(v[key]["sent"] for v, _ in reports) == sum(v[key]["received"] for v, _ in reports)
        # rank 0 has 2 users of 5 samples: fewer of its ids and of its rows on the wire than
        # the same samples as a fixed batch; in all too (rank 1 has one bag per sample, rank 2
        # bags nobody reads)
        assert reports[0][0][key][mine] < reports[0][1][key][mine], key
        assert sum(v[key]["sent"] for v, _ in reports) < sum(f[key]["sent"] for _, f in reports)
    assert results[0]["vbe"]["input_dist.data"]["ids_sent"] < results[0]["fixed"][
        "input_dist.data"]["ids_sent"]
    for rank, r in enumerate(results):
        if rank == 1:
            assert "inverse_indices of feature 'f_rw': rows in [0, 4], outside its 4 bags" in (
                r["bad_inverse"]), r["bad_inverse"]
            assert "add up to" in r["bad_strides"] and "but lengths holds" in r["bad_strides"]
            assert "inverse_indices: expected [7 keys, B]" in r["bad_shape"], r["bad_shape"]
        else:
            for key in ("bad_inverse", "bad_strides", "bad_shape"):
                assert "rank(s) [1] found bad input" in r[key], (rank, key, r[key])
        assert "CommOptions(fixed_shapes=True)" in r["fixed_shapes"], r["fixed_shapes"]


# -- every table of one D: the expansion is one gather over [P, T, D] ---------------------------
SAME_D = [("a", 13, ["f_a1", "f_a2"]), ("b", 9, ["f_b"]), ("c", 11, ["f_c"])]
SAME_D_STRIDES = [{"f_a1": 2, "f_a2": 5, "f_b": 3, "f_c": 5},  # rank 0: 5 samples
                  {"f_a1": 3, "f_a2": 4, "f_b": 1, "f_c": 4}]  # rank 1: 4 samples


def _same_d_inverse(f, rank):
    """Every feature its own map of samples to bags (a swap or a transpose changes rows)."""
    B, n = SAME_D_STRIDES[rank]["f_c"], SAME_D_STRIDES[rank][f]
    b = torch.arange(B)
    return {"f_a1": b * n // B, "f_a2": b.flip(0), "f_b": (b * 2 + rank) % n, "f_c": b}[f]


def _same_d_vs_unsharded(rank, world, dims=(4, 4, 4)):
    from torchrec import EmbeddingBagConfig, PoolingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding

    configs = [EmbeddingBagConfig(name=n, num_embeddings=E, embedding_dim=D, feature_names=fs,
                                  pooling=PoolingType.MEAN if n == "c" else PoolingType.SUM)
               for (n, E, fs), D in zip(SAME_D, dims, strict=True)]
    da, db, dc = dims
    feats = [f for _, _, fs in SAME_D for f in fs]
    plan = ShardingPlan(world_size=2, local_world_size=2, tables=(
        TableSharding(name="a", sharding="row_wise", num_embeddings=13, embedding_dim=da, shards=(
            Shard(rank=0, row_start=0, row_end=5, col_start=0, col_end=da),
            Shard(rank=1, row_start=5, row_end=13, col_start=0, col_end=da))),
        TableSharding(name="b", sharding="table_wise", num_embeddings=9, embedding_dim=db,
                      shards=(Shard(rank=1, row_start=0, row_end=9, col_start=0, col_end=db),)),
        TableSharding(name="c", sharding="column_wise", num_embeddings=11, embedding_dim=dc,
                      shards=(Shard(rank=0, row_start=0, row_end=11, col_start=0, col_end=2),
                              Shard(rank=1, row_start=0, row_end=11, col_start=2, col_end=dc))),
    ))
    dev = device()
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, device=dev)
    cls, kwargs = _optimizer("adagrad")  # per element: column shards keep the same state
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, plan)
    B = [s["f_c"] for s in SAME_D_STRIDES]
    lo = sum(B[:rank])
    report = {}
    for step in range(2):
        g = torch.Generator().manual_seed(7 + step)
        bags = []
        for r in range(world):
            per = {}
            for _, E, fs in SAME_D:
                for f in fs:
                    lengths = torch.randint(1, 4, (SAME_D_STRIDES[r][f],), generator=g)
                    per[f] = (lengths, torch.randint(0, E, (int(lengths.sum()),), generator=g),
                              None)
            bags.append(per)
        inverse = {f: [_same_d_inverse(f, r) for r in range(world)] for f in feats}
        glob = {f: (torch.cat([bags[r][f][0] for r in range(world)]),
                    torch.cat([bags[r][f][1] for r in range(world)]), None) for f in feats}
        shift = {f: [sum(s[f] for s in SAME_D_STRIDES[:r]) for r in range(world)] for f in feats}
        kjt_all = _vbe_kjt(glob, {f: sum(s[f] for s in SAME_D_STRIDES) for f in feats},
                           {f: torch.cat([inverse[f][r] + shift[f][r] for r in range(world)])
                            for f in feats}, feats)
        kjt = _vbe_kjt(bags[rank], SAME_D_STRIDES[rank],
                       {f: inverse[f][rank] for f in feats}, feats)
        out_ref = ref(kjt_all.to(dev)).values()
        out = sharded(kjt.to(dev)).values()
        report[f"step{step}.out"] = (out - out_ref[lo : lo + B[rank]]).abs().max().item()
        grad = torch.linspace(-1, 1, out_ref.numel(), device=dev).view_as(out_ref)
        out_ref.backward(grad)
        # the sharded tables' gradients are divided by R (TorchRec's convention): R x the
        # rank's part of the global gradient gives the unsharded step on the global batch
        out.backward(grad[lo : lo + B[rank]] * world)
    full = sharded.gather_full_state_dict()
    for k, v in ref.state_dict().items():
        report[k] = (full[k] - v).abs().max().item()
    report["state"] = _state_error(ref, sharded, configs)
    return report


def test_sharded_vbe_with_every_table_of_one_d():
    """Tables of one D take the single-gather expansion (a [B, T] index into [P, T, D]); the
    other tests' tables all differ in D. Each feature has its own stride and inverse map, so
    rows expanded from the wrong feature or sample change the outputs and the updates."""
    for rank, report in enumerate(run_ranks(_same_d_vs_unsharded, 2)):
        for key, err in report.items():
            assert err < 2e-5, f"rank {rank} {key}: {err}"
