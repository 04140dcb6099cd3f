"""Sharded tables on storage tiers vs the same plan on ``device``, on gloo groups of 2 and 3.

Every rank builds the same collection and shards it twice with one plan: once on ``device``
and once with its tables' shards on ``cached`` (LRU, LFU) or ``file`` (the tier given by the
plan's ``TableSharding.storage`` or by the collection's ``storage=``). Each step shifts the
window of ids the batch draws from, so every shard's small cache evicts (dirty rows written
back) nearly every step. Outputs, the full weights and every rank's fused optimizer state
must be bit-for-bit those of ``device`` (SGD, rowwise Adagrad, Adam), for every sharding type
alone and mixed, pooled (EmbeddingBagCollection) and sequence (EmbeddingCollection). Then:
DCP checkpoints from a tiered model load into a device model on another world size and the
other way round; a data-parallel table on a cached tier is refused naming it."""

import dataclasses

import numpy as np
import pytest
import torch

from tests.sharding.harness import run_ranks

BATCH = [3, 5, 2]  # local batch sizes of ranks 0, 1, 2 (uneven)
E, W, SLOTS = 60, 12, 12  # rows per table; ids of a step in a window of W rows; cache slots
KINDS = ["table_wise", "row_wise", "column_wise", "table_row_wise", "grid_shard"]


def _configs(sequence: bool):
    from torchrec import EmbeddingBagConfig, EmbeddingConfig, PoolingType

    dims = {"a": 4, "b": 6, "c": 5, "d": 4, "dp": 2}
    if sequence:
        return [EmbeddingConfig(name=n, num_embeddings=E, embedding_dim=D,
                                feature_names=[f"f_{n}"]) for n, D in dims.items()]
    pooling = {"b": PoolingType.MEAN}
    return [EmbeddingBagConfig(name=n, num_embeddings=E, embedding_dim=D,
                               feature_names=[f"f_{n}"],
                               pooling=pooling.get(n, PoolingType.SUM))
            for n, D in dims.items()]


def _plan(kind: str, world: int, storage=None):
    """Tables a..d sharded ``kind`` ("mixed": a table-wise, b row-wise, c column-wise, d
    grid), 'dp' data-parallel on device; ``storage``: every sharded table's, in the plan."""
    from tests.sharding.test_sharded_ebc import _plan as plan_of

    mixed = {"a": "table_wise", "b": "row_wise", "c": "column_wise", "d": "grid_shard"}
    base = {k: plan_of(k, world) for k in {*KINDS, "data_parallel"}}
    tables = []
    for name, D in (("a", 4), ("b", 6), ("c", 5), ("d", 4), ("dp", 2)):
        k = "data_parallel" if name == "dp" else (mixed[name] if kind == "mixed" else kind)
        src = base[k].table("rw")  # 13 x 4 in the helper's plan: scale to E x D
        scale = lambda v, n, m: v * m // n  # noqa: E731
        shards = tuple(dataclasses.replace(
            s, row_start=scale(s.row_start, 13, E), row_end=scale(s.row_end, 13, E),
            col_start=scale(s.col_start, 4, D), col_end=scale(s.col_end, 4, D))
            for s in src.shards)
        tables.append(dataclasses.replace(
            src, name=name, sharding=k, num_embeddings=E, embedding_dim=D, shards=shards,
            storage=storage if name != "dp" else None))
    return dataclasses.replace(base["row_wise"], tables=tuple(tables))


def _batch(configs, lo, hi, step):
    """Samples [lo, hi) of the step's global batch: bags of 0..2 ids from rows
    [7 * step, 7 * step + W) (mod E)."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(step)
    B = sum(BATCH)
    keys, lengths, values = [], [], []
    for c in configs:
        ls = torch.randint(0, 3, (B,), generator=g)
        vs = (7 * step + torch.randint(0, W, (int(ls.sum()),), generator=g)) % E
        a, b = int(ls[:lo].sum()), int(ls[:hi].sum())
        keys.append(c.feature_names[0])
        lengths.append(ls[lo:hi])
        values.append(vs[a:b])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _optimizer(name):
    from torchrec.optim import RowWiseAdagrad

    name = name.removesuffix("_bf16")  # "adam_bf16": Adam, its moments stored in bf16
    return {"sgd": (torch.optim.SGD, {"lr": 0.3}),
            "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.3, "eps": 1e-8}),
            "adam": (torch.optim.Adam, {"lr": 0.05, "eps": 1e-8})}[name]


def _collection(configs, sequence, opt, storage=None):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    cls = fbtriton_dist.EmbeddingCollection if sequence else fbtriton_dist.EmbeddingBagCollection
    torch.manual_seed(0)
    dtypes = {"momentum1": "bf16", "momentum2": "bf16"} if opt.endswith("_bf16") else None
    m = cls(tables=configs, storage=storage, optimizer_state_dtypes=dtypes)
    cls, kwargs = _optimizer(opt)
    apply_optimizer_in_backward(cls, m.parameters(), kwargs)
    return m


def _flat(out, sequence):
    if sequence:
        return torch.cat([out[k].values().flatten() for k in sorted(out)])
    return out.values().flatten()


def _local_states(sharded):
    """Every tensor of this rank's fused optimizer state, in key order."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = []
    for _k, v in sorted(sharded.fused_optimizer_state_dict().items()):
        out += [s.tensor for s in v.local_shards()] if isinstance(v, ShardedTensor) else [v]
    return out


def _storage(tier, policy, folder, rank):
    from fbtriton_dist.storage import Storage

    path = f"{folder}/rank{rank}" if tier == "file" else None
    return Storage(tier=tier, cache_slots=SLOTS, policy=policy, path=path)


def _tiered_vs_device(rank, world, cases, folder):
    import fbtriton_dist

    report = []
    for kind, opt, tier, policy, sequence, via in cases:
        configs = _configs(sequence)
        storage = _storage(tier, policy, folder, rank)
        dev = fbtriton_dist.shard(_collection(configs, sequence, opt), _plan(kind, world))
        if via == "plan":
            tiered = fbtriton_dist.shard(_collection(configs, sequence, opt),
                                         _plan(kind, world, storage))
        else:  # the collection's own storage= (its weights: the whole tables, not the caches)
            own = {c.name: storage for c in configs if c.name != "dp"}
            tiered = fbtriton_dist.shard(_collection(configs, sequence, opt, own),
                                         _plan(kind, world))
        lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
        same, evicted = True, 0
        for step in range(5):
            kjt = _batch(configs, lo, hi, step)
            outs = []
            for m in (dev, tiered):
                out = _flat(m(kjt), sequence)
                g = torch.Generator().manual_seed(100 + step)
                (out * torch.randn(out.shape, generator=g)).sum().backward()
                outs.append(out.detach())
            same &= torch.equal(*outs)
            evicted += sum(s["evictions"] for s in tiered.cache_stats().values())
        full = [m.gather_full_state_dict() for m in (dev, tiered)]
        same &= all(torch.equal(full[0][k], full[1][k]) for k in full[0])
        states = [_local_states(m) for m in (dev, tiered)]
        same &= len(states[0]) == len(states[1]) and all(
            torch.equal(a, b) for a, b in zip(*states, strict=True))
        report.append((kind, opt, tier, policy, sequence, via, same, evicted))
    return report


def _cases(sequence, opts=("sgd", "rowwise_adagrad", "adam")):
    tiers = [("cached", "lru", "plan"), ("file", "lfu", "module"), ("cached", "lfu", "module")]
    out = []
    for i, kind in enumerate([*KINDS, "mixed"]):
        for j, opt in enumerate(opts):
            tier, policy, via = tiers[(i + j) % len(tiers)]
            out.append((kind, opt, tier, policy, sequence, via))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_pooled_and_sequence_tiers_match_device_bit_for_bit(world, tmp_path):
    """Pooled (EmbeddingBagCollection) and sequence (EmbeddingCollection) cases in one start-up
    of the ranks; and bf16 moments, kept in bf16 by the backing stores."""
    cases = [*_cases(False), ("mixed", "adam_bf16", "cached", "lru", False, "plan"),
             *_cases(True, ("rowwise_adagrad", "adam"))]
    reports = run_ranks(_tiered_vs_device, world, cases, str(tmp_path), timeout=500)
    for rank, report in enumerate(reports):
        for *case, same, _ in report:
            assert same, (rank, case)
    for i, case in enumerate(cases):  # the caches evicted somewhere
        assert sum(r[i][-1] for r in reports) > 0, case


# -- the pipeline reads the next batch's rows ahead ----------------------------------------------
def _pipeline_vs_plain(rank, world, folder):
    """A plain loop and ``TrainPipeline`` (the next batch's input dist and, after this
    batch's forward, its missing rows read ahead) from the same start on 5 batches whose
    caches evict every step: per case, whether outputs, full weights and fused optimizer
    states are equal bit for bit, and the piped model's rows taken from the prefetch."""
    import fbtriton_dist
    from fbtriton_dist.sharding import TrainPipeline
    from tests.sharding.test_lean import _Batch

    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    report = []
    for kind, opt, tier, policy, sequence in (("mixed", "rowwise_adagrad", "cached", "lru", False),
                                              ("table_row_wise", "adam", "file", "lfu", True)):
        configs = _configs(sequence)
        storage = _storage(tier, policy, f"{folder}/{int(sequence)}", rank)
        plain, piped = (fbtriton_dist.shard(_collection(configs, sequence, opt),
                                            _plan(kind, world, storage)) for _ in range(2))
        outs = {id(plain): [], id(piped): []}

        def loss_fn(m, b, outs=outs, sequence=sequence):
            out = _flat(m(b.sparse), sequence)
            outs[id(m)].append(out.detach())
            g = torch.Generator().manual_seed(100 + int(b.dense))
            return (out * torch.randn(out.shape, generator=g)).sum()

        batches = [_Batch(torch.tensor(step), _batch(configs, lo, hi, step), torch.zeros(1))
                   for step in range(5)]
        for b in batches:
            loss_fn(plain, b).backward()
        pipe = TrainPipeline(piped, None, "cpu", loss_fn=loss_fn)
        assert pipe.worker is None  # a tiered collection's input dist stays on this thread
        it = iter(batches)
        for _ in batches:
            pipe.progress(it)
        same = len(outs[id(piped)]) == 5 and all(
            torch.equal(a, b) for a, b in zip(outs[id(plain)], outs[id(piped)], strict=True))
        full = [m.gather_full_state_dict() for m in (plain, piped)]
        same &= all(torch.equal(full[0][k], full[1][k]) for k in full[0])
        same &= all(torch.equal(a, b) for a, b in zip(
            _local_states(plain), _local_states(piped), strict=True))
        stats = [sum(s[k] for s in piped.cache_stats().values())
                 for k in ("evictions", "prefetched", "prefetch_used")]
        plain_prefetched = sum(s["prefetched"] for s in plain.cache_stats().values())
        report.append((kind, sequence, same, *stats, plain_prefetched))
    return report


def _check_train_pipeline_reads_rows_ahead_and_matches_the_plain_loop_bit_for_bit(reports):
    for rank, report in enumerate(reports):
        for kind, sequence, same, *_ in report:
            assert same, (rank, kind, sequence)
    for i, (kind, sequence, *_) in enumerate(reports[0]):
        evicted, prefetched, used, plain_prefetched = (
            sum(r[i][j] for r in reports) for j in range(3, 7))
        assert evicted > 0 and prefetched > 0 and used > 0, (kind, sequence)
        assert plain_prefetched == 0, (kind, sequence)


# -- checkpoints --------------------------------------------------------------------------------
def _model(world, tier, folder, rank):
    import fbtriton_dist

    storage = _storage(tier, "lru", folder, rank) if tier != "device" else None
    return fbtriton_dist.shard(_collection(_configs(False), False, "adam"),
                               _plan("mixed", world, storage))


def _train(m, rank, world, steps):
    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    for step in steps:
        out = m(_batch(_configs(False), lo, hi, step)).values()
        # times R: the gradients are divided by R, so every world size takes the same step
        (out * world).sum().backward()


def _full(m):
    """Full weights and optimizer states on rank 0 (ShardedTensor.gather)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = dict(m.gather_full_state_dict())
    for k, v in m.fused_optimizer_state_dict().items():
        if isinstance(v, ShardedTensor):
            full = torch.empty(v.size(), dtype=v.dtype) if dist.get_rank() == 0 else None
            v.gather(0, full)
            v = full
        out[f"opt.{k}"] = v
    # numpy: pickled by value (a tensor would travel as a shared-memory handle of a process
    # that is gone when the parent reads it)
    return {k: v.numpy().copy() for k, v in out.items()} if dist.get_rank() == 0 else None


def _save(rank, world, tier, folder, path):
    import torch.distributed.checkpoint as dcp

    m = _model(world, tier, folder, rank)
    _train(m, rank, world, range(3))
    dcp.save({"model": m.state_dict(), "fused": m.fused_optimizer_state_dict()},
             checkpoint_id=path)
    full = _full(m)
    _train(m, rank, world, range(3, 5))  # trained on after the save: the load must not see it
    return full if rank == 0 else None


def _load(rank, world, tier, folder, path):
    import torch.distributed.checkpoint as dcp

    m = _model(world, tier, folder, rank)
    _train(m, rank, world, range(1))  # the load replaces this (and what the caches hold)
    state = {"model": m.state_dict(), "fused": m.fused_optimizer_state_dict()}
    dcp.load(state, checkpoint_id=path)
    m.load_state_dict(state["model"])
    m.load_fused_optimizer_state_dict(state["fused"])
    loaded = _full(m)
    _train(m, rank, world, range(3, 5))
    after = _full(m)  # a collective: every rank
    return (loaded, after) if rank == 0 else None


def _saves(rank, world, calls):
    """``_save`` for each argument tuple, in one start-up of the ranks."""
    return [_save(rank, world, *args) for args in calls]


def _loads(rank, world, calls):
    """``_load`` for each argument tuple, in one start-up of the ranks."""
    return [_load(rank, world, *args) for args in calls]


MOVES = [("cached", "device"), ("device", "file"), ("file", "cached")]


def test_checkpoint_moves_between_tiers_and_from_2_to_3_ranks(tmp_path):
    """Each (save tier, load tier) of MOVES: saved on 2 ranks, loaded on 3; the saves share
    one start-up of 2 ranks, the loads (and the device references) one of 3."""
    ckpts = [str(tmp_path / f"ckpt{i}") for i in range(len(MOVES))]
    saves = run_ranks(_saves, 2, [(save_tier, str(tmp_path / f"save{i}"), ckpts[i])
                                  for i, (save_tier, _) in enumerate(MOVES)], timeout=500)[0]
    # per move: its load tier, then the reference on device from the same checkpoint
    calls = []
    for i, (_, load_tier) in enumerate(MOVES):
        calls += [(load_tier, str(tmp_path / f"load{i}"), ckpts[i]),
                  ("device", str(tmp_path / f"ref{i}"), ckpts[i])]
    loads = run_ranks(_loads, 3, calls, timeout=500)[0]
    for i, move in enumerate(MOVES):
        saved, (loaded, after), (_, ref) = saves[i], loads[2 * i], loads[2 * i + 1]
        assert sorted(saved) == sorted(loaded), move
        for k in saved:
            assert np.array_equal(saved[k], loaded[k]), (move, k)
        # two more steps on 3 ranks from the loaded state = two more on device from the saved
        for k in ref:
            assert np.array_equal(ref[k], after[k]), (move, k)


# -- refused ------------------------------------------------------------------------------------
def _dp_on_a_tier(rank, world):
    import fbtriton_dist
    from fbtriton_dist.storage import Storage

    configs = _configs(False)
    m = _collection(configs, False, "sgd", {"dp": Storage(tier="cached")})
    try:
        fbtriton_dist.shard(m, _plan("mixed", world))
    except ValueError as e:
        return str(e)
    return None


def _check_a_data_parallel_table_on_a_cached_tier_is_refused_naming_it(texts):
    for text in texts:
        assert text is not None and "['dp']" in text and "data_parallel" in text, text


def test_torchrec_compute_kernels_map_to_tiers():
    from torchrec.distributed.types import CacheParams, ParameterSharding

    from fbtriton_dist.sharding.dmp import _storage_of
    from fbtriton_dist.storage import Storage

    def ps(kernel, **kw):
        return ParameterSharding(sharding_type="table_wise", compute_kernel=kernel, ranks=[0],
                                 **kw)

    assert _storage_of("t", ps("fused")) is None
    assert _storage_of("t", ps("fused_uvm")) == Storage(tier="host")
    assert _storage_of("t", ps("fused_uvm_caching", cache_params=CacheParams(
        load_factor=0.25))) == Storage(tier="cached", cache_load_factor=0.25)
    assert _storage_of("t", ps("fused_uvm_caching")) == Storage(tier="cached")


def test_plan_yaml_keeps_each_table_storage(tmp_path):
    from fbtriton_dist.planner import ShardingPlan
    from fbtriton_dist.storage import Storage

    plan = _plan("mixed", 2, Storage(tier="file", path=str(tmp_path / "a b,c"), policy="lfu",
                                     cache_load_factor=0.125))
    plan.save_yaml(tmp_path / "plan.yaml")
    assert ShardingPlan.load_yaml(tmp_path / "plan.yaml") == plan
    assert "storage" not in _plan("mixed", 2).to_yaml()  # old plans: unchanged


# -- TorchRec's DMP -----------------------------------------------------------------------------
def _dmp(rank, world, folder):
    """DMP with our sharder over a device collection, the same collection with its tables on
    ``cached`` (``storage=``; TorchRec's planning helper reads their whole shapes), and the
    device collection under a TorchRec plan whose compute kernels are ``fused_uvm_caching``:
    the same outputs and weights."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import CacheParams, ShardingPlan

    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    configs = _configs(False)
    storage = _storage("cached", "lru", folder, rank)
    per_table = {"a": sp.table_wise(rank=1), "b": sp.column_wise(ranks=[0, 1]),
                 "c": sp.row_wise(), "d": sp.table_row_wise(host_index=0),
                 "dp": sp.data_parallel()}
    dmps = []
    for case in ("device", "module", "kernel"):
        own = {c.name: storage for c in configs if c.name != "dp"} if case == "module" else None
        ebc = _collection(configs, False, "rowwise_adagrad", own)
        sharder = EmbeddingBagCollectionSharder(local_world_size=world)
        module_plan = sp.construct_module_sharding_plan(
            ebc, per_table, sharder=sharder, local_size=world, world_size=world,
            device_type="cpu")
        if case == "kernel":
            for name in "abcd":
                module_plan[name] = dataclasses.replace(
                    module_plan[name], compute_kernel="fused_uvm_caching",
                    cache_params=CacheParams(load_factor=0.5))
        dmp = DistributedModelParallel(ebc, sharders=[sharder],
                                       plan=ShardingPlan({"": module_plan}))
        dmps.append(dmp)
    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    same = True
    for step in range(4):
        kjt = _batch(configs, lo, hi, step)
        outs = []
        for dmp in dmps:
            out = dmp(kjt).values()
            (out * (step + 1.0)).sum().backward()
            outs.append(out.detach())
        same &= torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    inner = [d.module.sharded for d in dmps]
    full = [m.gather_full_state_dict() for m in inner]
    same &= all(torch.equal(full[0][k], f[k]) for f in full[1:] for k in full[0])
    return same, [m.tiered() for m in inner], [sorted(m.cache_stats()) for m in inner]


def _check_dmp_shards_cached_tables_from_the_module_or_torchrec_kernels(results):
    for rank, (same, tiered, caches) in enumerate(results):
        assert same, rank
        assert tiered == [False, True, True], (rank, tiered)
        assert caches[1] == caches[2], rank  # the same shards are cached either way


def _plan_puts_cached_tables_on_device(rank, world, folder):
    import fbtriton_dist
    from fbtriton_dist.storage import Storage

    configs = _configs(False)
    own = {c.name: _storage("cached", "lru", folder, rank) for c in configs if c.name != "dp"}
    ref = fbtriton_dist.shard(_collection(configs, False, "sgd"), _plan("mixed", world))
    m = fbtriton_dist.shard(_collection(configs, False, "sgd", own),
                            _plan("mixed", world, Storage()))
    a, b = ref.gather_full_state_dict(), m.gather_full_state_dict()
    return not m.tiered() and all(torch.equal(a[k], b[k]) for k in a)


def _compiled_vs_eager(rank, world, folder):
    """``torch.compile`` of a sharded model with cached shards (their lookup runs eagerly
    between the graphs) against the eager one, pooled and sequence: per case, whether outputs,
    full weights and fused optimizer states are equal bit for bit, the evictions and the
    number of graphs compiled."""
    import fbtriton_dist

    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    report = []
    for sequence in (False, True):
        configs = _configs(sequence)
        storage = _storage("cached", "lru", folder, rank)
        eager, tiered = (fbtriton_dist.shard(_collection(configs, sequence, "adam"),
                                             _plan("mixed", world, storage)) for _ in range(2))
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(lambda kjt, m=tiered, s=sequence: _flat(m(kjt), s) * 2,
                                 backend=backend)
        same = True
        for step in range(4):
            kjt = _batch(configs, lo, hi, step)
            outs = [_flat(eager(kjt), sequence) * 2, compiled(kjt)]
            for out in outs:
                g = torch.Generator().manual_seed(100 + step)
                (out * torch.randn(out.shape, generator=g)).sum().backward()
            same &= torch.equal(outs[0].detach(), outs[1].detach())
        full = [m.gather_full_state_dict() for m in (eager, tiered)]
        same &= all(torch.equal(full[0][k], full[1][k]) for k in full[0])
        states = [_local_states(m) for m in (eager, tiered)]
        same &= all(torch.equal(a, b) for a, b in zip(*states, strict=True))
        evicted = sum(s["evictions"] for s in tiered.cache_stats().values())
        report.append((sequence, same, evicted, len(graphs)))
    return report


def _on_two_ranks(rank, world, folder):
    return (_pipeline_vs_plain(rank, world, f"{folder}/pipeline"), _dp_on_a_tier(rank, world),
            _dmp(rank, world, f"{folder}/dmp"),
            _plan_puts_cached_tables_on_device(rank, world, f"{folder}/plan"),
            _compiled_vs_eager(rank, world, f"{folder}/compile"))


def test_pipeline_ahead_refused_dp_tier_dmp_plan_storage_and_compile_on_one_start_up(tmp_path):
    """Five checks on one start-up of 2 ranks: TrainPipeline reads rows ahead and matches the
    plain loop bit for bit; a data-parallel table on a cached tier is refused naming it; DMP
    shards cached tables from the module or TorchRec's kernels; the plan's storage wins over
    the collection's (whole tables copied); ``torch.compile`` trains cached shards as the
    eager model does, bit for bit."""
    pipeline, dp, dmp, plan, compiled = zip(
        *run_ranks(_on_two_ranks, 2, str(tmp_path), timeout=500), strict=True)
    _check_train_pipeline_reads_rows_ahead_and_matches_the_plain_loop_bit_for_bit(pipeline)
    _check_a_data_parallel_table_on_a_cached_tier_is_refused_naming_it(dp)
    _check_dmp_shards_cached_tables_from_the_module_or_torchrec_kernels(dmp)
    assert all(plan)
    for rank, report in enumerate(compiled):
        for sequence, same, _, graphs in report:
            assert same and graphs > 0, (rank, sequence)
    for i in range(2):  # the caches evicted somewhere
        assert sum(r[i][2] for r in compiled) > 0
