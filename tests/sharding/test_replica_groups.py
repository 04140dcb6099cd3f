"""Replica groups (2D parallel) on real gloo process groups: a world of R ranks split into
groups of S ranks, each group sharding the tables by a plan for S ranks.

``replica_sync="step"`` must equal the flat plan on the same R ranks (outputs every step, and
after 2 fused steps the weights and optimizer state) for every sharding type, with rowwise
Adagrad (all types in one plan) and Adagrad; ``replica_sync=N`` must equal, after the N-th
step, the average of the replicas' weights and state computed here; a checkpoint of a grouped
run loads into flat plans on 2 and 3 ranks; bad group sizes raise on every rank. One launch
of 6 ranks (groups of 2 and 3) and one of 4 (2 groups of 2; there also the weights averaged
in each 16- and 8-bit replica sync format, within the stated bound of the fp32 average, their
bytes counted by hand, and the errors of bad formats)."""

import copy

import pytest
import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import _configs, _global_batch, _kjt, _plan

BATCH = [3, 2, 4, 1, 2, 3]  # local batch sizes of ranks 0, 1, 2, ...
STEPS = 2


def _shard(world, optimizer, group_size=None, replica_sync="step", process_group=None,
           group_layout="consecutive", weighted=False, planned=False, comm=None):
    """``planned``: the planner's grouped plan (world R, ``group_size`` S in the plan)
    instead of a plan for S ranks and ``group_size=``."""
    import fbtriton_dist
    from fbtriton_dist.planner import ShardingPlan

    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=_configs(weighted), is_weighted=weighted)
    S = group_size or world
    plan = _plan("mixed", S)
    if planned:
        plan = ShardingPlan(world_size=world, local_world_size=S, tables=plan.tables,
                            group_size=S, replica_sync=replica_sync)
        group_size = None
    return fbtriton_dist.shard(ebc, plan, process_group, optimizer=optimizer,
                               group_size=group_size, replica_sync=replica_sync,
                               group_layout=group_layout, comm=comm)


def _train(sharded, rank, world, steps, first=0, weighted=False):
    """``steps`` steps on this rank's slice of the global batch; the outputs of each."""
    sizes = BATCH[:world]
    lo = sum(sizes[:rank])
    outs = []
    for step in range(first, first + steps):
        batch = _global_batch(_configs(weighted), sum(sizes), step, weighted)
        out = sharded(_kjt(*batch, lo, lo + sizes[rank])).values()
        g = torch.Generator().manual_seed(100 + step)
        grad = torch.randn(sum(sizes), out.shape[1], generator=g)[lo : lo + sizes[rank]]
        out.backward(grad)
        outs.append(out.detach().clone())
    return outs


def _local(sharded):
    """This rank's shards: ``{(table, row_start, col_start): (weight, [states])}``."""
    names = [c.name for c in sharded.table_configs()]
    return {
        (names[lt.table], lt.row_start, lt.col_start): (w.numpy().copy(),
                                                        [s.numpy().copy() for s in st])
        for lt, w, st in sharded.local_shards()
    }


def _full(locals_, configs):
    """The whole tables and per-row / per-element states from every rank's ``_local``."""
    weights = {c.name: torch.full((c.num_embeddings, c.embedding_dim), float("nan"))
               for c in configs}
    states = {}
    for pieces in locals_:
        for (name, r0, c0), (w, st) in pieces.items():
            w, st = torch.from_numpy(w), [torch.from_numpy(s) for s in st]
            weights[name][r0 : r0 + w.shape[0], c0 : c0 + w.shape[1]] = w
            for i, s in enumerate(st):
                key = (name, c0, i) if s.dim() == 1 else (name, 0, i)
                E = weights[name].shape[0]
                full = states.setdefault(key, torch.full((E, *s.shape[1:]), float("nan")) if
                                         s.dim() == 1 else torch.full(weights[name].shape,
                                                                      float("nan")))
                if s.dim() == 1:
                    full[r0 : r0 + s.shape[0]] = s
                else:
                    full[r0 : r0 + s.shape[0], c0 : c0 + s.shape[1]] = s
    return weights, states


def _every_n(rank, world, group_size):
    """Replicas averaged every 2 steps: this rank's shards after step 1 and 2, and, for a twin
    that never syncs by itself, before and after ``sync_replicas()`` at step 2."""
    from fbtriton_dist import optim

    opt = optim.RowWiseAdagrad(lr=0.3, eps=1e-8)
    every2 = _shard(world, opt, group_size, replica_sync=2)
    _train(every2, rank, world, 1)
    after1 = _local(every2)
    _train(every2, rank, world, 1, first=1)
    after2 = _local(every2)
    report = every2.comm_report()["replica_sync"]
    # the average: an fp32 all-reduce of each TBE's weights and rowwise state over K replicas,
    # 2 (K - 1) / K of its bytes each way in a ring
    K = world // group_size
    report["expected"] = sum(2 * 4 * t.numel() * (K - 1) // K for tbe in every2.tbes
                             for t in (tbe.weights, tbe.momentum1) if t.numel())
    manual = _shard(world, opt, group_size, replica_sync=1000)
    _train(manual, rank, world, 2)
    before = _local(manual)
    manual.sync_replicas()
    return {"after1": after1, "after2": after2, "before": before, "synced": _local(manual),
            "report": report}


def _save_grouped(rank, world, group_size, path):
    """A grouped run (sync every step) saved with torch.distributed.checkpoint after 2 steps,
    and the whole tables after a 3rd (``test_checkpoint._load`` checks them)."""
    import torch.distributed.checkpoint as dcp

    from fbtriton_dist import optim

    sharded = _shard(world, optim.RowWiseAdagrad(lr=0.2), group_size)
    for step in range(3):
        if step == 2:
            sd = sharded.state_dict()
            assert list(sd) == [f"embedding_bags.{c.name}.weight" for c in _configs(False)]
            dcp.save({"model": sd, "fused": sharded.fused_optimizer_state_dict()},
                     checkpoint_id=path)
        _ckpt_step(sharded, rank, world, step)
    full = {k: v.cpu() for k, v in sharded.gather_full_state_dict().items()}
    if rank == 0:
        torch.save(full, f"{path}/expected.pt")


def _ckpt_step(sharded, rank, world, step):
    """``test_checkpoint._step`` for 6 ranks: the same global batch of 10, any split."""
    from tests.sharding.test_checkpoint import GLOBAL_B

    sizes = {6: [2, 2, 2, 2, 1, 1], 4: [3, 3, 2, 2]}[world]
    lo = sum(sizes[:rank])
    batch = _global_batch(_configs(False), GLOBAL_B, step, False)
    out = sharded(_kjt(*batch, lo, lo + sizes[rank])).values()
    g = torch.Generator().manual_seed(50 + step)
    grad = torch.randn(GLOBAL_B, out.shape[1], generator=g)[lo : lo + sizes[rank]]
    out.backward(grad * world)


def _load_flat(rank, world, path, process_group):
    """``test_checkpoint._load`` on the first ``world`` ranks (``process_group``): the grouped
    checkpoint into a flat plan, one more step, the whole tables' largest difference from the
    grouped run's."""
    import torch.distributed.checkpoint as dcp

    from fbtriton_dist import optim
    from tests.sharding.test_checkpoint import _step

    sharded = _shard(world, optim.RowWiseAdagrad(lr=0.2), process_group=process_group)
    state = {"model": sharded.state_dict(), "fused": sharded.fused_optimizer_state_dict()}
    dcp.load(state, checkpoint_id=path, process_group=process_group)
    sharded.load_state_dict(state["model"])
    sharded.load_fused_optimizer_state_dict(state["fused"])
    _step(sharded, rank, world, 2)
    expected = torch.load(f"{path}/expected.pt", weights_only=True)
    full = sharded.gather_full_state_dict()
    return max((full[k] - v).abs().max().item() for k, v in expected.items())


def _grouped_vs_flat(rank, world, cases=None):
    """The flat plan on ``world`` ranks and, on the same batches, groups synced every step;
    ``cases`` ``{optimizer name: group sizes}``, by default (6 ranks) rowwise Adagrad (groups
    of 2 and 3, and of 2 strided: ranks 0, 3 / 1, 4 / 2, 5), Adagrad (groups of 2) and SGD
    with per-sample weights (groups of 2)."""
    from fbtriton_dist import optim

    cases = cases or {"rowwise_adagrad": (2, 3, "2 strided", "2 planned"), "adagrad": (2,),
                      "sgd_weighted": (2,)}
    opts = {"rowwise_adagrad": optim.RowWiseAdagrad(lr=0.3, eps=1e-8),
            "adagrad": optim.Adagrad(lr=0.3, eps=1e-8), "sgd_weighted": optim.SGD(lr=0.3)}
    out = {}
    for name, sizes in cases.items():
        opt = opts[name]
        weighted = name == "sgd_weighted"
        flat = _shard(world, opt, weighted=weighted)
        outs_flat = _train(flat, rank, world, STEPS, weighted=weighted)
        out[name] = {"flat": _local(flat)}
        for S in sizes:
            strided = S == "2 strided"
            grouped = _shard(world, opt, S if isinstance(S, int) else 2,
                             group_layout="strided" if strided else "consecutive",
                             weighted=weighted, planned=S == "2 planned")
            outs = _train(grouped, rank, world, STEPS, weighted=weighted)
            out[name][S] = {
                "out": max((a - b).abs().max().item() for a, b in zip(outs_flat, outs,
                                                                       strict=True)),
                "local": _local(grouped),
                "report": grouped.comm_report()["replica_sync"],
            }
    return out


def _bad_group_sizes(world):
    """The errors of a group size that does not divide the world and of a plan for another
    size than the group's."""
    import fbtriton_dist
    from fbtriton_dist import optim

    errors = []
    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=_configs(False))
    for S, plan_for in [(world - 2, world - 2), (2, world)]:
        try:
            fbtriton_dist.shard(ebc, _plan("mixed", plan_for), optimizer=optim.SGD(lr=0.1),
                                group_size=S)
        except ValueError as e:
            errors.append(str(e))
    return errors


def _dmp_collection(rank, world):
    """TorchRec's DMPCollection arguments (strided groups of 2, TorchRec's plan for 2 ranks,
    torch's Adagrad through apply_optimizer_in_backward, the dense layer under DDP) against
    the unsharded model on the global batch: outputs, then weights and the dense layer after
    2 steps."""
    import torchrec
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding import CommOptions
    from fbtriton_dist.sharding.dmp import DMPCollection, EmbeddingBagCollectionSharder
    from tests.sharding.test_dmp import _batch, _configs, _Model, _torchrec_plan

    sizes = [2, 1, 2, 1, 1, 1]  # test_dmp's global batch of 8
    configs = _configs()
    torch.manual_seed(0)
    ours = _Model(fbtriton_dist.EmbeddingBagCollection(tables=configs))
    ref = _Model(torchrec.EmbeddingBagCollection(tables=[copy.deepcopy(c) for c in configs]))
    ref.load_state_dict(ours.state_dict())
    for m in (ours, ref):
        apply_optimizer_in_backward(torch.optim.Adagrad, m.ebc.parameters(),
                                    {"lr": 0.3, "eps": 1e-8})
    sharder = EmbeddingBagCollectionSharder(local_world_size=2)
    errors = []
    bf16 = EmbeddingBagCollectionSharder(local_world_size=2,
                                         comm=CommOptions(replica_sync_dtype=torch.bfloat16))
    for bad in ({"node_group_size": 2}, {"plan": None}, {"sharders": [bf16]}):
        try:
            DMPCollection(ours, **{"plan": _torchrec_plan(ours.ebc, sharder, 2),
                                   "sharders": [sharder], **bad},
                          world_size=world, sharding_group_size=2)
        except ValueError as e:
            errors.append(str(e))
    dmp = DMPCollection(ours, torch.device("cpu"), _torchrec_plan(ours.ebc, sharder, 2), world,
                        2, None, sharders=[sharder])
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "top" in n], 0.1)
    ref_opt = torch.optim.SGD(ref.top.parameters(), 0.1)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    report = {}
    for step in range(2):
        out_ref = ref(_batch(configs, step, 0, sum(sizes)))
        (out_ref.sum() / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out = dmp(_batch(configs, step, lo, hi))
        out.sum().backward()
        dense_opt.step()
        dense_opt.zero_grad()
        report[f"step{step}.out"] = (out - out_ref[lo:hi]).abs().max().item()
    dmp.sync()  # replicas already equal: averaging keeps them
    [sharded] = dmp.sharded_collections()
    full = sharded.gather_full_state_dict()
    report["weights"] = max(
        (full[f"embedding_bags.{c.name}.weight"] - ref.ebc.embedding_bags[c.name].weight)
        .abs().max().item() for c in configs)
    report["top"] = max((a - b).abs().max().item() for a, b in
                        zip(dmp.module.top.parameters(), ref.top.parameters(), strict=True))
    return report, errors, dmp.replica_groups.group_index


def _sequence_grouped_vs_flat(rank, world):
    """EmbeddingCollections (a row per id, every sharding type) in 3 groups of 2 synced every
    step against the flat plan on ``world`` ranks: the rows of 2 steps, then the weights."""
    import fbtriton_dist
    from fbtriton_dist import optim
    from tests.sharding.test_sharded_ec import _configs as ec_configs
    from tests.sharding.test_sharded_ec import _feature_batch, _plan_for

    configs = ec_configs()
    sizes = BATCH[:world]
    lo = sum(sizes[:rank])
    torch.manual_seed(0)
    ec = fbtriton_dist.EmbeddingCollection(tables=configs)
    opt = optim.RowWiseAdagrad(lr=0.3, eps=1e-8)
    flat = fbtriton_dist.shard(copy.deepcopy(ec), _plan_for("mixed", world, False), optimizer=opt)
    grouped = fbtriton_dist.shard(ec, _plan_for("mixed", 2, False), optimizer=opt,
                                  group_size=2)
    err = 0.0
    for step in range(2):
        batch = _feature_batch(configs, sum(sizes), step)
        rows = []
        for sharded in (flat, grouped):
            out = sharded(_kjt(*batch, lo, lo + sizes[rank]))
            values = torch.cat([out[k].values().reshape(-1) for k in sorted(out)])
            g = torch.Generator().manual_seed(7 + step + rank)
            values.backward(torch.randn(values.shape, generator=g))
            rows.append(values.detach())
        err = max(err, (rows[0] - rows[1]).abs().max().item())
    full = [m.gather_full_state_dict() for m in (flat, grouped)]
    return max([err, *((full[0][k] - full[1][k]).abs().max().item() for k in full[0])])


def _pipeline_grouped(rank, world):
    """TrainPipeline (its own input-dist group per sharding group) over 3 groups of 2 trains
    as the plain loop: the whole tables after 2 steps."""
    from fbtriton_dist import optim
    from fbtriton_dist.sharding.pipeline import TrainPipeline

    sizes = BATCH[:world]
    lo = sum(sizes[:rank])
    batches, grads = [], []
    for step in range(2):
        batch = _global_batch(_configs(False), sum(sizes), step, False)
        batches.append(_kjt(*batch, lo, lo + sizes[rank]))
        g = torch.Generator().manual_seed(100 + step)
        D = sum(c.embedding_dim * len(c.feature_names) for c in _configs(False))
        grads.append(torch.randn(sum(sizes), D, generator=g)[lo : lo + sizes[rank]])
    opt = optim.RowWiseAdagrad(lr=0.3, eps=1e-8)
    plain = _shard(world, opt, 2)
    _train(plain, rank, world, 2)
    piped = _shard(world, opt, 2)
    upstream = iter(grads)  # the loss of the batches in order

    def loss(model, kjt):
        return (model(kjt).values() * next(upstream)).sum()

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    pipe = TrainPipeline(piped, dummy, "cpu", loss_fn=loss, sparse=lambda b: b)
    it = iter(batches)
    for _ in range(2):
        pipe.progress(it)
    full = [m.gather_full_state_dict() for m in (plain, piped)]
    return max((full[0][k] - full[1][k]).abs().max().item() for k in full[0])


def _six_ranks(rank, world, path):
    """Everything on one set of 6 ranks (starting a rank costs more than all the cases):
    bad group sizes first (every rank raises, nothing hangs), then groups of 2 and 3 vs the
    flat plan, every-2-steps averaging in 3 groups of 2, and a checkpoint of 3 groups of 2
    loaded into flat plans on the first 2 and 3 ranks."""
    import torch.distributed as dist

    errors = _bad_group_sizes(world)
    dmp = _dmp_collection(rank, world)
    sequence = _sequence_grouped_vs_flat(rank, world)
    pipeline = _pipeline_grouped(rank, world)
    flat = _grouped_vs_flat(rank, world)
    every = _every_n(rank, world, 2)
    _save_grouped(rank, world, 2, path)
    dist.barrier()
    loaded = {}
    for ranks in (2, 3):
        pg = dist.new_group(list(range(ranks)))
        if rank < ranks:
            loaded[ranks] = _load_flat(rank, ranks, path, pg)
    return errors, flat, every, loaded, dmp, sequence, pipeline


SYNC_FORMATS = ("int8", "fp8", "bf16", "fp16")


def _bad_sync_dtypes(world):
    """The errors of an unknown replica sync format and of a format with ``"step"`` in
    shard() (DMPCollection's: ``_dmp_collection``), raised on every rank before any
    collective."""
    import fbtriton_dist
    from fbtriton_dist import optim
    from fbtriton_dist.sharding import CommOptions

    errors = []
    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=_configs(False))
    attempts = [
        lambda: CommOptions(replica_sync_dtype="fp4"),
        lambda: fbtriton_dist.shard(ebc, _plan("mixed", 2), optimizer=optim.SGD(lr=0.1),
                                    group_size=2, comm=CommOptions(replica_sync_dtype="int8")),
    ]
    for attempt in attempts:
        try:
            attempt()
        except ValueError as e:
            errors.append(str(e))
    return errors


def _sync_dtypes(rank, world, group_size):
    """Groups trained apart for 2 steps, then their replicas averaged with the weights in each
    of ``SYNC_FORMATS``: int8 through ``CommOptions(replica_sync_dtype=...)`` and
    ``sync_replicas()``, the others by ``average_replicas`` from the same weights. Before,
    after each, and the bytes each counted next to a hand count from this rank's shards."""
    from fbtriton_dist import optim
    from fbtriton_dist.sharding import CommOptions
    from fbtriton_dist.sharding.comm.replicas import ReplicaTraffic, average_replicas
    from fbtriton_dist.sharding.comm.wire import WireFormat

    opt = optim.RowWiseAdagrad(lr=0.3, eps=1e-8)
    sharded = _shard(world, opt, group_size, replica_sync=1000,
                     comm=CommOptions(replica_sync_dtype="int8"))
    _train(sharded, rank, world, 2)
    before = _local(sharded)
    saved = [(tbe.weights.detach().clone(), tbe.momentum1.clone()) for tbe in sharded.tbes]
    sharded.sync_replicas()
    out = {"before": before, "int8": _local(sharded),
           "int8 bytes": sharded.comm_report()["replica_sync"]}
    for fmt in SYNC_FORMATS[1:]:
        for tbe, (w, m) in zip(sharded.tbes, saved, strict=True):
            tbe.weights.detach().copy_(w)
            tbe.momentum1.copy_(m)
        traffic = ReplicaTraffic()
        average_replicas(sharded.tbes, sharded.replicas, traffic, fmt=WireFormat(fmt))
        out[fmt] = _local(sharded)
        out[f"{fmt} bytes"] = {"sent": traffic.sent, "received": traffic.received}
    # by hand, K = 2 replicas: each hop sends the other replica's slice, the two hops together
    # every row once (values in the format + its row scales); the rowwise state (one fp32 per
    # row) in a ring all-reduce, 2 (K - 1) / K of its bytes
    K = world // group_size
    assert K == 2
    rows = sum(w.shape[0] for w, _ in before.values())
    values = sum(w.size for w, _ in before.values())
    per_value = {"int8": 1, "fp8": 1, "bf16": 2, "fp16": 2}
    per_row = {"int8": 8, "fp8": 4, "bf16": 0, "fp16": 0}
    out["hand"] = {f: values * per_value[f] + rows * per_row[f] + 2 * 4 * rows * (K - 1) // K
                   for f in SYNC_FORMATS}
    return out


def _four_ranks(rank, world, path):
    """4 ranks as 2 groups of 2: the errors of bad replica sync formats first (every rank
    raises, nothing hangs), groups synced every step vs the flat plan (every sharding type),
    every-2-steps averaging, the weights averaged in each replica sync format, and a
    checkpoint of 2 groups of 2 loaded into a flat plan on the first 2 ranks."""
    import torch.distributed as dist

    errors = _bad_sync_dtypes(world)
    flat = _grouped_vs_flat(rank, world, {"rowwise_adagrad": (2,)})
    every = _every_n(rank, world, 2)
    dtypes = _sync_dtypes(rank, world, 2)
    _save_grouped(rank, world, 2, path)
    dist.barrier()
    pg = dist.new_group([0, 1])
    loaded = _load_flat(rank, 2, path, pg) if rank < 2 else None
    return errors, flat, every, dtypes, loaded


def _sync_bound(fmt, xs):
    """Per element, the bound on the error of the average of the replicas' rows ``xs`` (each
    ``[rows, D]``) sent in ``fmt``: mean_k e(x_k) + e(y), e one hop's bound (``wire.py``), y
    the average of the decoded rows, within mean_k e(x_k) of the fp32 average a."""
    a = sum(xs) / len(xs)

    def hop(x, pad):  # one hop's bound on rows y with |y - x| <= pad, element by element
        if fmt == "int8":
            spread = (x + pad).amax(1, keepdim=True) - (x - pad).amin(1, keepdim=True)
            return (spread / 510).expand_as(x)
        mag = x.abs() + pad
        if fmt == "fp8":
            return 2.0**-4 * mag + 2.0**-10 * mag.amax(1, keepdim=True) / 448
        return 2.0**-8 * mag if fmt == "bf16" else 2.0**-11 * mag + 2.0**-25

    first = sum(hop(x, 0.0) for x in xs) / len(xs)
    return (first + hop(a, first)) * (1 + 2.0**-18) + 2.0**-20 * a.abs() + 1e-30, a


def _check_sync_dtypes(results, world, group_size):
    for ranks in _replicas(world, group_size):
        one = [results[r] for r in ranks]
        largest = dict.fromkeys(SYNC_FORMATS, 0.0)
        for key in one[0]["before"]:
            xs = [torch.from_numpy(o["before"][key][0]) for o in one]
            for fmt in SYNC_FORMATS:
                bound, mean = _sync_bound(fmt, xs)
                got = torch.from_numpy(one[0][fmt][key][0])
                err = (got - mean).abs()
                assert bool((err <= bound).all()), (fmt, key, float((err - bound).max()))
                largest[fmt] = max(largest[fmt], float(err.max()))
                for o in one:  # every replica decodes the same bytes: bit-identical
                    assert (o[fmt][key][0] == one[0][fmt][key][0]).all(), (fmt, key)
                    # the rowwise state is averaged in fp32
                    state = sum(torch.from_numpy(p["before"][key][1][0]) for p in one) / len(one)
                    torch.testing.assert_close(torch.from_numpy(o[fmt][key][1][0]), state,
                                               atol=1e-6, rtol=1e-6)
        assert min(largest.values()) > 0, largest  # the weights did travel in the format
    for r in results:
        for fmt in SYNC_FORMATS:
            counted = r[f"{fmt} bytes"]
            assert counted["sent"] == counted["received"] == r["hand"][fmt] > 0, (fmt, counted)


def test_replica_groups_on_4_ranks(tmp_path):
    """4 ranks as 2 groups of 2 (one launch): bad sync formats raise on every rank, step sync
    equals the flat plan, every-N equals the explicit average, the weights averaged in bf16,
    fp16, fp8 and int8 within their bound of the fp32 average with the bytes counted by hand,
    a grouped checkpoint loads into 2 flat ranks."""
    results = run_ranks(_four_ranks, 4, str(tmp_path), timeout=300)
    for rank, (errors, *_) in enumerate(results):
        assert len(errors) == 2, (rank, errors)
        assert "replica_sync_dtype: expected one of [None, fp32, bf16, fp16, fp8, int8]" in \
            errors[0] and "'fp4'" in errors[0], errors[0]
        for e in errors[1:]:
            assert "replica_sync_dtype: expected fp32" in e and "replica_sync='step'" in e, e
        assert "'int8'" in errors[1], errors
    _check_grouped_vs_flat([r[1] for r in results], 4, "rowwise_adagrad", 2)
    _check_every_n([r[2] for r in results], 4, 2)
    _check_sync_dtypes([r[3] for r in results], 4, 2)
    # the planner's every-N average in int8 (per step, over N) is what rank q % 2 counted
    from fbtriton_dist.planner import CostModel, ShardingPlan, evaluate_grouped

    plan = ShardingPlan(world_size=4, local_world_size=2, tables=_plan("mixed", 2).tables,
                        group_size=2, replica_sync=1000)
    cost = evaluate_grouped(plan, _configs(False), model=CostModel(replica_sync_dtype="int8"))
    for rank, r in enumerate(results):
        planned = cost.collectives["replica_sync.average"][rank % 2] * 1000
        assert planned == pytest.approx(r[3]["int8 bytes"]["received"], rel=1e-9), rank
    assert max(r[4] for r in results[:2]) < 1e-6, [r[4] for r in results[:2]]


def _check_grouped_vs_flat(results, world, name, case):
    configs = _configs(False)
    group_size = case if isinstance(case, int) else 2
    K = world // group_size

    def local_rank(r):  # consecutive: group r // S; strided: group r % (R / S)
        return r // K if case == "2 strided" else r % group_size

    assert max(r[name][case]["out"] for r in results) < 1e-5, name
    flat_w, flat_s = _full([r[name]["flat"] for r in results], configs)
    # each group holds every shard: group 0's ranks make the whole tables
    group0 = [0, K] if case == "2 strided" else list(range(group_size))
    grp_w, grp_s = _full([results[r][name][case]["local"] for r in group0], configs)
    for k in flat_w:
        assert not flat_w[k].isnan().any() and not grp_w[k].isnan().any()
        torch.testing.assert_close(grp_w[k], flat_w[k], atol=1e-5, rtol=1e-5, msg=k)
    assert set(grp_s) == set(flat_s)
    for k in flat_s:
        torch.testing.assert_close(grp_s[k], flat_s[k], atol=1e-5, rtol=1e-5, msg=str(k))
    # the replicas (same local rank) stay identical
    for r in range(world):
        mine = results[r][name][case]["local"]
        first = results[group0[local_rank(r)]][name][case]["local"]
        assert mine.keys() == first.keys()
        for key, (w, _) in mine.items():
            assert (w == first[key][0]).all(), key
    assert all(r[name][case]["report"]["received"] > 0 for r in results)


def _replicas(world, group_size):
    return [list(range(local, world, group_size)) for local in range(group_size)]


def _check_every_n(results, world, group_size):
    for ranks in _replicas(world, group_size):
        one = [results[r] for r in ranks]
        for key in one[0]["before"]:
            # after step 1 the replicas differ (each group trained on its own batch) ...
            assert any((o["after1"][key][0] != one[0]["after1"][key][0]).any() for o in one)
            # ... sync_replicas() gives their average, weights and optimizer state ...

            def tensors(o, name, key=key):
                w, states = o[name][key]
                return [w, *states]

            for i, _ in enumerate(tensors(one[0], "before")):
                mean = torch.from_numpy(sum(tensors(o, "before")[i] for o in one) / len(one))
                for o in one:
                    got = tensors(o, "synced")[i]
                    torch.testing.assert_close(torch.from_numpy(got), mean, atol=1e-6,
                                               rtol=1e-6, msg=str(key))
                    # ... and replica_sync=2 did the same by itself after step 2
                    assert (tensors(o, "after2")[i] == got).all(), key
    for r in results:
        report = r["report"]
        assert report["received"] == report["sent"] == report["expected"] > 0, report
        assert report["per_step"] == report["received"] / 2


def test_replica_groups_on_6_ranks(tmp_path):
    """6 ranks as 3 groups of 2 and 2 groups of 3 (one launch: starting ranks dominates)."""
    results = run_ranks(_six_ranks, 6, str(tmp_path), timeout=400)
    for rank, (errors, *_) in enumerate(results):
        assert len(errors) == 2, (rank, errors)
        assert "divisor of the world size 6" in errors[0] and "got 4" in errors[0], errors[0]
        assert "group size 2" in errors[1] and "for 6 ranks" in errors[1], errors[1]
    flat = [r[1] for r in results]
    _check_grouped_vs_flat(flat, 6, "rowwise_adagrad", 2)
    _check_grouped_vs_flat(flat, 6, "rowwise_adagrad", 3)
    _check_grouped_vs_flat(flat, 6, "rowwise_adagrad", "2 strided")
    _check_grouped_vs_flat(flat, 6, "rowwise_adagrad", "2 planned")  # the planner's plan
    _check_grouped_vs_flat(flat, 6, "adagrad", 2)
    _check_grouped_vs_flat(flat, 6, "sgd_weighted", 2)
    _check_every_n([r[2] for r in results], 6, 2)
    for world in (2, 3):
        errors = [r[3][world] for r in results[:world]]
        assert max(errors) < 1e-6, (world, errors)
    for rank, (report, errors, group) in enumerate(r[4] for r in results):
        assert group == rank % 3  # TorchRec's default groups: strided
        assert all(err < 2e-5 for err in report.values()), (rank, report)
        assert "node_group_size" in errors[0] and "plan" in errors[1], errors
        assert "replica_sync_dtype: expected fp32" in errors[2] and "'bf16'" in errors[2], errors
    assert max(r[5] for r in results) < 1e-5, [r[5] for r in results]
    assert max(r[6] for r in results) < 1e-6, [r[6] for r in results]


def test_job_keys_group_size_and_replica_sync(tmp_path):
    """``sharding.group_size`` / ``replica_sync``: read, checked, and the job's plan is the
    grouped plan (world R, one group's plan for S ranks; ``auto``: tests/train/
    test_group_size_auto.py)."""
    from fbtriton_dist.planner import ConfigError
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.planning import plan_job
    from tests.train.test_job import write_job

    flat = load_job(write_job(tmp_path))
    assert (flat.sharding.group_size, flat.sharding.replica_sync) == (None, "step")
    assert plan_job(flat, 4, 4).plan.world_size == 4 and plan_job(flat, 4, 4).group_size == 4
    cfg = load_job(write_job(tmp_path, sharding={"group_size": 2, "replica_sync": 3}))
    assert (cfg.sharding.group_size, cfg.sharding.replica_sync) == (2, 3)
    planned = plan_job(cfg, 4, 4)
    plan = planned.plan
    assert planned.group_size == 2 and "groups: 2 x 2 ranks" in planned.report
    assert (plan.world_size, plan.group_size, plan.replica_sync) == (4, 2, 3)
    assert (plan.group_plan().world_size, plan.group_plan().local_world_size) == (2, 2)
    assert load_job(write_job(tmp_path, sharding={"group_size": "auto"})).sharding.group_size \
        == "auto"
    # replica_sync_dtype: the job's CommOptions and the planner's cost of the average (D = 8:
    # int8 rows of 8 + 8 bytes against fp32's 32)
    import dataclasses

    from fbtriton_dist.planner import evaluate_grouped

    assert cfg.sharding.replica_sync_dtype == "fp32"
    int8 = plan_job(load_job(write_job(tmp_path, sharding={
        "group_size": 2, "replica_sync": 3, "replica_sync_dtype": "int8"})), 4, 4)
    assert int8.planner.cost_model.replica_sync_dtype == "int8"
    fp32 = evaluate_grouped(int8.plan, int8.specs, int8.stats, dataclasses.replace(
        int8.planner.cost_model, replica_sync_dtype="fp32"))
    for a, b in zip(int8.cost.collectives["replica_sync.average"],
                    fp32.collectives["replica_sync.average"], strict=True):
        assert 0 < a < b
    with pytest.raises(ConfigError, match=r"group_size.*divisor of the world size 4.*got 3"):
        plan_job(load_job(write_job(tmp_path, sharding={"group_size": 3})), 4, 4)
    bad = [({"group_size": "often"}, "group_size: expected an integer >= 1 .* or auto"),
           ({"group_size": 0}, "group_size: expected an integer >= 1"),
           ({"replica_sync": "often"}, "replica_sync: expected step or an integer >= 1"),
           ({"replica_sync": 0}, "replica_sync: expected step or an integer >= 1"),
           ({"replica_sync": 2, "replica_sync_dtype": "fp4"},
            r"replica_sync_dtype: expected one of \[fp32, bf16, fp16, fp8, int8\], got 'fp4'"),
           ({"replica_sync_dtype": "int8"}, "replica_sync_dtype: expected fp32 with "
                                            "replica_sync: step")]
    for sharding, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_job(write_job(tmp_path, sharding=sharding))
