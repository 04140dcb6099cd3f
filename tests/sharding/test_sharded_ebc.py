"""Sharded vs unsharded, on real gloo process groups of 2 and 3 ranks.

Every rank builds the same unsharded EmbeddingBagCollection (the reference) and shards a copy
with a hand-made plan (uneven row cuts, every sharding type alone and all mixed). Each step
rank r feeds its slice of a global batch (unequal local batch sizes) to the sharded module;
the reference runs the whole global batch in one process, its loss the ranks' summed loss
divided by R (the sharded tables' gradients are divided by R, as TorchRec's; the ranks' dense
gradients are averaged, as DDP's). Outputs, the gradient of a dense layer on top, and after 3
fused steps the weights and optimizer states must agree."""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.conftest import TRITON_OK
from tests.sharding.harness import device, run_ranks

BATCH = [3, 5, 2, 4, 1, 6, 2, 3]  # local batch sizes of ranks 0, 1, 2, ...


def _configs(weighted: bool):
    from torchrec import EmbeddingBagConfig, PoolingType

    mean = PoolingType.SUM if weighted else PoolingType.MEAN
    c = EmbeddingBagConfig
    return [
        c(name="rw", num_embeddings=13, embedding_dim=4, feature_names=["f_rw"]),
        c(name="tw", num_embeddings=7, embedding_dim=3, feature_names=["f_tw1", "f_tw2"]),
        c(name="cw", num_embeddings=9, embedding_dim=6, feature_names=["f_cw"], pooling=mean),
        c(name="twrw", num_embeddings=11, embedding_dim=5, feature_names=["f_twrw"], pooling=mean),
        c(name="grid", num_embeddings=10, embedding_dim=4, feature_names=["f_grid"]),
        c(name="dp", num_embeddings=5, embedding_dim=2, feature_names=["f_dp"]),
    ]


def _row_cuts(E, R):
    """Uneven cuts: rank r gets about (r + 1) parts."""
    weights = [r + 1 for r in range(R)]
    cuts = [0]
    for w in weights[:-1]:
        cuts.append(min(E - (R - len(cuts)), cuts[-1] + max(1, E * w // sum(weights))))
    return [*cuts, E]


def _plan(kind: str, R: int, H: int | None = None):
    """Every table sharded ``kind`` (or each its natural way: "mixed") on R ranks, H per host
    (default one host): table-row-wise tables and grid slices go to hosts in turn."""
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding

    H = H or R
    hosts = [list(range(h, h + H)) for h in range(0, R, H)]

    def rows(E, D, c0=0, c1=None, ranks=tuple(range(R))):
        cuts = _row_cuts(E, len(ranks))
        return [
            Shard(
                rank=r,
                row_start=cuts[i],
                row_end=cuts[i + 1],
                col_start=c0,
                col_end=D if c1 is None else c1,
            )
            for i, r in enumerate(ranks)
        ]

    def table(i, name, E, D, sharding):
        host = hosts[i % len(hosts)]
        if sharding == "row_wise":
            shards = rows(E, D)
        elif sharding == "table_row_wise":
            shards = rows(E, D, ranks=host)
        elif sharding == "table_wise":
            shards = [Shard(rank=R - 1, row_start=0, row_end=E, col_start=0, col_end=D)]
        elif sharding == "column_wise":
            shards = [
                Shard(rank=0, row_start=0, row_end=E, col_start=0, col_end=D // 2),
                Shard(rank=R - 1, row_start=0, row_end=E, col_start=D // 2, col_end=D),
            ]
        elif sharding == "grid_shard":
            next_host = hosts[(i + 1) % len(hosts)]
            shards = rows(E, D, 0, D // 2, ranks=host) + rows(E, D, D // 2, D, ranks=next_host)
        else:
            shards = [
                Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D) for r in range(R)
            ]
        return TableSharding(
            name=name, sharding=sharding, num_embeddings=E, embedding_dim=D, shards=tuple(shards)
        )

    natural = {
        "rw": "row_wise",
        "tw": "table_wise",
        "cw": "column_wise",
        "twrw": "table_row_wise",
        "grid": "grid_shard",
        "dp": "data_parallel",
    }
    tables = []
    for i, cfg in enumerate(_configs(False)):
        sharding = natural[cfg.name] if kind == "mixed" else kind
        tables.append(table(i, cfg.name, cfg.num_embeddings, cfg.embedding_dim, sharding))
    return ShardingPlan(world_size=R, local_world_size=H, tables=tuple(tables))


def _global_batch(configs, B_global, step, weighted):
    g = torch.Generator().manual_seed(step)
    feats = [(f, c.num_embeddings) for c in configs for f in c.feature_names]
    lengths = {f: torch.randint(0, 4, (B_global,), generator=g) for f, _ in feats}
    lengths[feats[0][0]][0] = 0  # an empty bag
    values = {f: torch.randint(0, E, (int(lengths[f].sum()),), generator=g) for f, E in feats}
    for f, _ in feats:  # a hot id
        if values[f].numel() > 2:
            values[f][: values[f].numel() // 2] = 1
    weights = {f: torch.rand(values[f].numel(), generator=g) + 0.5 for f, _ in feats}
    return feats, lengths, values, (weights if weighted else None)


def _kjt(feats, lengths, values, weights, lo, hi, reverse_keys=False):
    """The KJT of samples [lo, hi) of the global batch."""
    from torchrec import KeyedJaggedTensor

    keys, ls, vs, ws = [], [], [], []
    order = list(reversed(feats)) if reverse_keys else feats
    for f, _ in order:
        a, b = int(lengths[f][:lo].sum()), int(lengths[f][:hi].sum())
        keys.append(f)
        ls.append(lengths[f][lo:hi])
        vs.append(values[f][a:b])
        if weights is not None:
            ws.append(weights[f][a:b])
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(vs),
        lengths=torch.cat(ls),
        weights=torch.cat(ws) if weights is not None else None,
    )


def _optimizer(name):
    from torchrec.optim import RowWiseAdagrad

    from fbtriton_dist import optim

    fused = {  # the annotations of optim.torch_equivalent (TorchRec's placeholders, ours)
        "partial_rowwise_adam": optim.PartialRowWiseAdam(lr=0.05, weight_decay=0.01),
        "lamb": optim.LAMB(lr=0.05),
        "ftrl": optim.FTRL(lr=0.2, l1=0.01, l2=0.1),
        "rowwise_rmsprop_ar": optim.RowWiseRMSpropAR(lr=0.1, ar_alpha=2.0, ema_beta=0.9),
    }
    if name in fused:
        return optim.torch_equivalent(fused[name])
    return {
        "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.3, "eps": 1e-8}),
        "adagrad": (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-8}),
        "sgd": (torch.optim.SGD, {"lr": 0.3}),
    }[name]


def _sharded_vs_unsharded(rank, world, kind, opt_name, weighted, H=None):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    configs = _configs(weighted)
    dev = device()
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=dev)
    cls, kwargs = _optimizer(opt_name)
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    total_D = sum(c.embedding_dim * len(c.feature_names) for c in configs)
    dense = torch.nn.Linear(total_D, 1, device=dev)
    to_shard = copy.deepcopy(ref)  # (a deep copy drops the optimizer annotation: add it again)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, _plan(kind, world, H))
    dense_s = copy.deepcopy(dense)
    sizes = BATCH[:world]
    lo = sum(sizes[:rank])
    report = {}
    for step in range(3):
        batch = _global_batch(configs, sum(sizes), step, weighted)
        out_ref = ref(_kjt(*batch, 0, sum(sizes)).to(dev)).values()
        (dense(out_ref).sum() / world).backward()
        local = _kjt(*batch, lo, lo + sizes[rank], reverse_keys=rank % 2 == 1)
        out = sharded(local.to(dev)).values()
        dense_s(out).sum().backward()
        grads = [p.grad.clone() for p in dense_s.parameters()]
        for gr in grads:
            dist.all_reduce(gr)
            gr /= world
        report[f"step{step}.out"] = (out - out_ref[lo : lo + sizes[rank]]).abs().max().item()
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
    return report if H is None else (report, sharded.comm_report())


def _state_error(ref, sharded, configs):
    """Max difference between each local shard's optimizer state and the reference's slice."""
    ref_states = {}
    for tbe in ref._tbes:
        for name, states in zip(tbe.table_names, tbe.split_optimizer_states(), strict=True):
            ref_states[name] = states
    err = 0.0
    local = sharded.local_views()
    shard_states = [s for tbe in sharded.tbes for s in tbe.split_optimizer_states()]
    for (lt, _), states in zip(local, shard_states, strict=True):
        for mine, full in zip(states, ref_states[configs[lt.table].name], strict=True):
            piece = full[lt.row_start : lt.row_end]
            if full.dim() == 2:
                piece = piece[:, lt.col_start : lt.col_end]
            err = max(err, (mine - piece).abs().max().item() if mine.numel() else 0.0)
    return err


CASES = [
    # (sharding kind, optimizer, weighted): rowwise Adagrad on column slices keeps one
    # accumulator per slice (as TorchRec/FBGEMM do), so column/grid use per-element optimizers
    ("row_wise", "rowwise_adagrad", False),
    ("table_wise", "rowwise_adagrad", True),
    ("column_wise", "adagrad", False),
    ("table_row_wise", "rowwise_adagrad", False),
    ("grid_shard", "sgd", True),
    ("data_parallel", "rowwise_adagrad", False),
    ("mixed", "adagrad", False),
    ("mixed", "sgd", True),
    # trust ratios and per-row moments over whole rows: row-wise, table-wise shards
    ("row_wise", "lamb", False),
    ("table_wise", "partial_rowwise_adam", True),
    ("table_row_wise", "ftrl", False),
    ("row_wise", "rowwise_rmsprop_ar", True),  # two per-row states (v, the last step)
]


def _all_cases(rank, world):
    """Every case on one set of ranks (starting the ranks costs more than a case)."""
    return {case: _sharded_vs_unsharded(rank, world, *case) for case in CASES}


def _on_world(rank, world):
    """What the world-size tests check, on one start-up of the ranks: every case sharded vs
    unsharded, one step's comm bytes, TorchRec's DLRM sharded and a meta-device build."""
    return _all_cases(rank, world), _traffic(rank, world), _dlrm_and_meta(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_matches_unsharded_counts_comm_bytes_and_shards_torchrec_dlrm(world):
    """One start-up of the ranks per world size for three checks (each below)."""
    cases, traffic, dlrm = zip(*run_ranks(_on_world, world), strict=True)
    _check_sharded_matches_unsharded(cases)
    _check_comm_bytes_per_collective(traffic)
    _check_torchrec_dlrm_and_meta_init(dlrm)


def _check_sharded_matches_unsharded(per_rank):
    for rank, reports in enumerate(per_rank):
        assert set(reports) == set(CASES)
        for case, report in reports.items():
            for key, err in report.items():
                assert err < 2e-5, f"rank {rank} {case} {key}: {err}"


def _two_hosts(rank, world):
    """World 4 as 2 hosts of 2 ranks: all sharding types mixed (MEAN, unequal batches), then
    every table table-row-wise, keeping that step's comm report."""
    mixed, _ = _sharded_vs_unsharded(rank, world, "mixed", "adagrad", False, H=2)
    twrw, report = _sharded_vs_unsharded(rank, world, "table_row_wise", "rowwise_adagrad", False, H=2)
    return mixed, twrw, report


def test_two_hosts_sum_inside_the_host_then_send_one_block_across():
    world, H = 4, 2
    results = run_ranks(_two_hosts, world)
    for rank, (mixed, twrw, _) in enumerate(results):
        for key, err in [*mixed.items(), *twrw.items()]:
            assert err < 2e-5, f"rank {rank} {key}: {err}"
    # every table is table-row-wise on one host: a rank receives from the other host exactly
    # one [B, D] block per feature of each table held there (not one per holder)
    configs, plan = _configs(False), _plan("table_row_wise", world, H)
    reports = [r for _, _, r in results]
    for rank, report in enumerate(reports):
        far = [c for c in configs if plan.table(c.name).shards[0].rank // H != rank // H]
        expected = sum(4 * BATCH[rank] * c.embedding_dim * len(c.feature_names) for c in far)
        assert report["output_dist.forward.inter_host"]["received"] == expected, rank
    for key in ("output_dist.forward.inter_host", "output_dist.host_reduce_scatter",
                "output_dist.forward", "output_dist.backward"):
        assert sum(r[key]["sent"] for r in reports) == sum(r[key]["received"] for r in reports)
    assert all(r["output_dist.host_reduce_scatter"]["received"] > 0 for r in reports)


def _bad_id_on_one_rank(rank, world):
    from torchrec import KeyedJaggedTensor

    import fbtriton_dist

    configs = _configs(False)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs, device=device())
    sharded = fbtriton_dist.shard(ebc, _plan("mixed", world), optimizer=fbtriton_dist.optim.SGD())
    names = [f for c in configs for f in c.feature_names]
    values = torch.zeros(len(names), dtype=torch.int64)
    if rank == 1:
        values[0] = 13  # table 'rw' has 13 rows
    kjt = KeyedJaggedTensor(
        keys=names, values=values, lengths=torch.ones(len(names), dtype=torch.int64)
    )
    sharded(kjt.to(device()))


def _rank_dies(rank, world):
    import os

    import fbtriton_dist

    sharded = fbtriton_dist.shard(
        fbtriton_dist.EmbeddingBagCollection(tables=_configs(False), device=device()),
        _plan("mixed", world),
        optimizer=fbtriton_dist.optim.SGD(),
    )
    if rank == 0:
        os._exit(3)  # dies without a word, before the first collective
    feats, lengths, values, _ = _global_batch(_configs(False), 4, 0, False)
    sharded(_kjt(feats, lengths, values, None, 0, 4).to(device()))


def test_bad_id_on_one_rank_stops_every_rank():
    with pytest.raises(RuntimeError) as info:
        run_ranks(_bad_id_on_one_rank, 3, timeout=120)
    text = str(info.value)
    assert "id 13 of feature 'f_rw' (sample 0) is out of range for table 'rw' with 13 rows" in text
    assert text.count("rank(s) [1] found bad input") == 2


def test_a_dead_rank_makes_the_others_fail_within_the_timeout():
    with pytest.raises(RuntimeError) as info:
        run_ranks(_rank_dies, 2, timeout=120, pg_timeout=10)
    text = str(info.value)
    assert "rank 0 died with exit code 3" in text
    assert "--- rank 1 ---" in text  # rank 1 raised (gloo timeout or closed connection)


def _traffic(rank, world):
    import fbtriton_dist

    configs = _configs(False)
    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs, device=device())
    plan = _plan("row_wise", world)
    sharded = fbtriton_dist.shard(ebc, plan, optimizer=fbtriton_dist.optim.SGD())
    sizes = BATCH[:world]
    lo = sum(sizes[:rank])
    feats, lengths, values, _ = _global_batch(configs, sum(sizes), 0, False)
    sharded(_kjt(feats, lengths, values, None, lo, lo + sizes[rank]).to(device()))
    # ids of my samples whose row lives on another rank, counted by hand from the plan
    expected = 0
    for f, _ in feats:
        table = next(c.name for c in configs if f in c.feature_names)
        a, b = int(lengths[f][:lo].sum()), int(lengths[f][: lo + sizes[rank]].sum())
        for shard in plan.table(table).shards:
            if shard.rank != rank:
                ids = values[f][a:b]
                expected += int(((ids >= shard.row_start) & (ids < shard.row_end)).sum())
    return sharded.comm_report(), expected


def _check_comm_bytes_per_collective(results):
    reports = [r for r, _ in results]
    for rank, (report, expected_ids) in enumerate(results):
        assert report["input_dist.data"]["ids_sent"] == expected_ids, rank
        # int32 lengths and ids, each piece padded to 8 bytes, per destination
        assert report["input_dist.data"]["sent"] >= 4 * expected_ids, rank
        assert report["input_dist.total"]["planner_estimate"] > 0
        assert report["output_dist.total"]["planner_estimate"] > 0
    for key in ("input_dist.header", "input_dist.data", "output_dist.forward", "output_dist.backward",
                "output_dist.host_reduce_scatter", "output_dist.host_all_gather"):
        assert sum(r[key]["sent"] for r in reports) == sum(r[key]["received"] for r in reports), key


def _dlrm_and_meta(rank, world):
    import torchrec
    from torchrec.models.dlrm import DLRM

    import fbtriton_dist
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding

    configs = [
        torchrec.EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=E, feature_names=[f"f_{n}"])
        for n, E in (("a", 11), ("b", 6))
    ]
    cuts = _row_cuts(11, world)
    plan = ShardingPlan(world_size=world, local_world_size=world, tables=(
        TableSharding(name="a", sharding="row_wise", num_embeddings=11, embedding_dim=4, shards=tuple(
            Shard(rank=r, row_start=cuts[r], row_end=cuts[r + 1], col_start=0, col_end=4)
            for r in range(world))),
        TableSharding(name="b", sharding="table_wise", num_embeddings=6, embedding_dim=4,
                      shards=(Shard(rank=world - 1, row_start=0, row_end=6, col_start=0, col_end=4),)),
    ))
    torch.manual_seed(0)
    # the reference runs on the CPU (TorchRec's own modules need fbgemm's CUDA ops on a GPU)
    ref = DLRM(embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=configs),
               dense_in_features=3, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    model = copy.deepcopy(ref).to(device())
    model = fbtriton_dist.shard(model, plan, optimizer=fbtriton_dist.optim.SGD())  # TorchRec's EBC, nested
    inner = model.sparse_arch.embedding_bag_collection
    assert type(inner).__name__ == "ShardedEmbeddingBagCollection"
    sizes = BATCH[:world]
    lo = sum(sizes[:rank])
    feats, lengths, values, _ = _global_batch(configs, sum(sizes), 1, False)
    dense = torch.randn(sum(sizes), 3, generator=torch.Generator().manual_seed(2))
    want = ref(dense, _kjt(feats, lengths, values, None, 0, sum(sizes)))[lo : lo + sizes[rank]]
    local = _kjt(feats, lengths, values, None, lo, lo + sizes[rank]).to(device())
    got = model(dense[lo : lo + sizes[rank]].to(device()), local).cpu()
    err = (got - want).abs().max().item()
    # built on the meta device: shards are initialised in place from each table's init_fn
    meta = fbtriton_dist.EmbeddingBagCollection(tables=configs, device="meta")
    sharded = fbtriton_dist.shard(meta, plan, device=device(), optimizer=fbtriton_dist.optim.SGD())
    views = sharded.local_views()
    bound = 1 / 11**0.5
    in_range = all(bool((v.abs() <= bound + 1e-6).all()) for lt, v in views if lt.table == 0)
    nonzero = all(bool(v.abs().sum() > 0) for _, v in views)
    return err, in_range, nonzero


def _check_torchrec_dlrm_and_meta_init(results):
    for err, in_range, nonzero in results:
        assert err < 1e-5 and in_range and nonzero


def _keys_case(rank, world, fixed, backend):
    """An extra key (ids out of every table, NaN weights) and a feature two tables share,
    against TorchRec's EBC on the global batch; then a NaN weight on rank 1's feature 'u'."""
    import torchrec
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    import fbtriton_dist
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding
    from fbtriton_dist.sharding.comm.options import CommOptions

    configs = [EmbeddingBagConfig(name="a", num_embeddings=7, embedding_dim=3,
                                  feature_names=["s", "u"]),
               EmbeddingBagConfig(name="b", num_embeddings=5, embedding_dim=2,
                                  feature_names=["s"])]
    plan = ShardingPlan(world_size=2, local_world_size=2, tables=(
        TableSharding(name="a", sharding="row_wise", num_embeddings=7, embedding_dim=3,
                      shards=(Shard(rank=0, row_start=0, row_end=3, col_start=0, col_end=3),
                              Shard(rank=1, row_start=3, row_end=7, col_start=0, col_end=3))),
        TableSharding(name="b", sharding="table_wise", num_embeddings=5, embedding_dim=2,
                      shards=(Shard(rank=1, row_start=0, row_end=5, col_start=0, col_end=2),)),
    ))
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=True)
    ours = fbtriton_dist.EmbeddingBagCollection(tables=configs, is_weighted=True)
    ours.load_state_dict(theirs.state_dict())
    sharded = fbtriton_dist.shard(ours, plan, optimizer=fbtriton_dist.optim.SGD(lr=0.1),
                                  backend=backend, comm=CommOptions(fixed_shapes=fixed))
    B = 2
    g = torch.Generator().manual_seed(1)
    lengths = {k: torch.randint(1, 3, (2 * B,), generator=g) for k in ("x", "u", "s")}
    values = {k: torch.randint(0, 5, (int(n.sum()),), generator=g) for k, n in lengths.items()}
    values["x"] += 1000
    weights = {k: torch.rand(v.numel(), generator=g) + 0.5 for k, v in values.items()}
    weights["x"][:] = float("nan")

    def kjt(lo, hi, keys):
        parts = [(lengths[k][lo:hi], *(d[k][int(lengths[k][:lo].sum()):int(lengths[k][:hi].sum())]
                                       for d in (values, weights))) for k in keys]
        return KeyedJaggedTensor(keys=keys, lengths=torch.cat([p[0] for p in parts]),
                                 values=torch.cat([p[1] for p in parts]),
                                 weights=torch.cat([p[2] for p in parts]))

    expected = theirs(kjt(0, 2 * B, ["u", "x", "s"]))
    lo = rank * B
    out = sharded(kjt(lo, lo + B, ["x", "u", "s"] if rank else ["s", "x", "u"]).to(device()))
    error = (out.values().cpu() - expected.values()[lo : lo + B]).abs().max().item()
    report = {"keys": out.keys(), "expected_keys": expected.keys(), "error": error,
              "dims": (out.length_per_key(), expected.length_per_key())}
    if rank == 1:
        weights["u"][int(lengths["u"][:lo].sum())] = float("nan")  # bag ('u', local sample 0)
    try:
        sharded(kjt(lo, lo + B, ["x", "u", "s"]).to(device()))
        if fixed:
            sharded.poll_input()
        report["raised"] = None
    except (ValueError, RuntimeError) as e:
        report["raised"] = (type(e).__name__, str(e))
    return report


def _keys_cases(rank, world, cases):
    return [_keys_case(rank, world, fixed, backend) for fixed, backend in cases]


def test_extra_keys_shared_features_and_non_finite_weights():
    # the default input dist, and the fixed-shape one with its in-kernel check (one spawn)
    cases = [(False, "auto"), (True, "triton" if TRITON_OK else "auto")]
    reports = run_ranks(_keys_cases, 2, cases)
    for rank, r in ((rank, r) for rank, per_case in enumerate(reports) for r in per_case):
        assert r["keys"] == r["expected_keys"] == ["s@a", "u", "s@b"], rank
        assert r["dims"][0] == r["dims"][1], rank
        assert r["error"] < 1e-6, (rank, r["error"])
        kind, text = r["raised"]
        if rank == 1:
            assert kind == "ValueError", text
            assert "per-sample weight nan of feature 'u' (sample 0)" in text, text
        else:
            assert kind == "RuntimeError" and "rank(s) [1]" in text, text
