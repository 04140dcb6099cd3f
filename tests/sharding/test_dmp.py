"""TorchRec's DistributedModelParallel with our sharder, on 2 gloo ranks.

The model: an EmbeddingBagCollection (ours under DMP, TorchRec's as the reference) and a
Linear on its pooled output; the tables carry TorchRec's ``apply_optimizer_in_backward``
annotation (the fused optimizer), the Linear a plain SGD. Every rank runs the reference on the
whole global batch in one process (TorchRec's own EBC, updated by torch's in-backward hooks)
and DMP on its slice. DDP averages the Linear's gradient over the ranks and the tables'
gradients are divided by R (TorchRec's gradient division), so the reference's loss is the
global batch's sum divided by R. After each of 3 steps: this rank's outputs; after the last:
every table's full weights and optimizer state and the Linear."""

import copy

import pytest
import torch

from tests.sharding.harness import run_ranks

BATCH = [3, 5]  # local batch sizes of ranks 0 and 1
LR_DENSE = 0.1


def _configs():
    from torchrec import EmbeddingBagConfig, PoolingType

    c = EmbeddingBagConfig
    return [
        c(name="tw", num_embeddings=7, embedding_dim=4, feature_names=["f_tw"]),
        c(name="rw", num_embeddings=11, embedding_dim=4, feature_names=["f_rw1", "f_rw2"]),
        c(name="cw", num_embeddings=6, embedding_dim=8, feature_names=["f_cw"],
          pooling=PoolingType.MEAN),
        c(name="twrw", num_embeddings=9, embedding_dim=4, feature_names=["f_twrw"]),
        c(name="dp", num_embeddings=5, embedding_dim=2, feature_names=["f_dp"]),
    ]


class _Model(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        D = sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs())
        self.top = torch.nn.Linear(D, 1)

    def forward(self, kjt):
        return self.top(self.ebc(kjt).values())


def _batch(configs, step, lo, hi):
    """Samples [lo, hi) of step's global batch, as a KJT."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 + step)
    B = sum(BATCH)
    keys, lengths, values = [], [], []
    for c in configs:
        for f in c.feature_names:
            ls = torch.randint(0, 4, (B,), generator=g)
            vs = torch.randint(0, c.num_embeddings, (int(ls.sum()),), generator=g)
            a, b = int(ls[:lo].sum()), int(ls[:hi].sum())
            keys.append(f)
            lengths.append(ls[lo:hi])
            values.append(vs[a:b])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))


def _torchrec_plan(ebc, sharder, world):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    per_table = {
        "tw": sp.table_wise(rank=1),
        "rw": sp.row_wise(),
        "cw": sp.column_wise(ranks=[0, 1]),
        "twrw": sp.table_row_wise(host_index=0),
        "dp": sp.data_parallel(),
    }
    module_plan = sp.construct_module_sharding_plan(
        ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    return ShardingPlan({"ebc": module_plan})


def _planner_plan(model, sharder, world):
    """TorchRec's EmbeddingShardingPlanner over our module (through the sharder), each table
    constrained to its sharding type (unconstrained, it makes these tiny tables
    data-parallel)."""
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    kinds = {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise",
             "twrw": "table_row_wise", "dp": "data_parallel"}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=world, compute_device="cpu"),
        constraints={t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()},
    )
    return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)


def _dmp_vs_unsharded(rank, world):
    """Both plans in one process (one start-up of torchrec per rank)."""
    return {by: _one_dmp_run(rank, world, by) for by in ("hand", "torchrec_planner")}


def _one_dmp_run(rank, world, planned_by):
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import (
        DMPShardedEmbeddingBagCollection,
        EmbeddingBagCollectionSharder,
    )

    configs = _configs()
    # torch's Adagrad: the fused update (FBGEMM's exact Adagrad) is the same arithmetic.
    # (torchrec.optim.RowWiseAdagrad as a torch optimizer is not: another row-wise rule)
    fused = (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-8})
    torch.manual_seed(0)
    ours = _Model(fbtriton_dist.EmbeddingBagCollection(tables=configs))
    ref = _Model(torchrec.EmbeddingBagCollection(tables=copy.deepcopy(configs)))
    ref.load_state_dict(ours.state_dict())
    apply_optimizer_in_backward(*fused[:1], ours.ebc.parameters(), fused[1])
    apply_optimizer_in_backward(*fused[:1], ref.ebc.parameters(), fused[1])

    sharder = EmbeddingBagCollectionSharder(local_world_size=world)
    plan = (_torchrec_plan(ours.ebc, sharder, world) if planned_by == "hand"
            else _planner_plan(ours, sharder, world))
    dmp = DistributedModelParallel(ours, sharders=[sharder], plan=plan)
    sharded = dmp.module.ebc
    assert isinstance(sharded, DMPShardedEmbeddingBagCollection)
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "top" in n], LR_DENSE)
    ref_opt = torch.optim.SGD(ref.top.parameters(), LR_DENSE)

    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    report = {}
    for step in range(3):
        out_ref = ref(_batch(configs, step, 0, sum(BATCH)))
        (out_ref.sum() / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out = dmp(_batch(configs, step, lo, hi))
        out.sum().backward()
        dmp.fused_optimizer.step()  # a no-op: the tables were updated in backward
        dense_opt.step()
        dense_opt.zero_grad()
        report[f"step{step}.out"] = (out - out_ref[lo:hi]).abs().max().item()
    full = sharded.sharded.gather_full_state_dict()
    report["weights"] = max(
        (full[f"embedding_bags.{c.name}.weight"] - ref.ebc.embedding_bags[c.name].weight)
        .abs().max().item()
        for c in configs
    )
    report["top"] = max(
        (a - b).abs().max().item()
        for a, b in zip(dmp.module.top.parameters(), ref.top.parameters(), strict=True)
    )
    report["state"] = _state_error(dmp.fused_optimizer.state_dict()["state"], ref, configs)
    keys = sorted(dmp.state_dict())
    # DMP's load_state_dict takes a full (TorchRec) state dict into the shards
    zeros = {k: torch.zeros_like(v) for k, v in ref.state_dict().items()}
    result = dmp.load_state_dict(zeros)
    report["load.keys"] = float(bool(result.missing_keys or result.unexpected_keys))
    report["load.values"] = max(
        v.abs().max().item() for v in sharded.sharded.gather_full_state_dict().values()
    )
    sharding = {t.name: t.sharding for t in sharded.sharded.plan.tables}
    return report, keys, sharding


def _state_error(state, ref, configs):
    """Max difference between the DMP fused optimizer's Adagrad sums (this rank's shards) and
    the reference's torch Adagrad ``sum``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    err = 0.0
    for c in configs:
        p = ref.ebc.embedding_bags[c.name].weight
        full = p._in_backward_optimizers[0].state[p]["sum"]
        mine = state[f"ebc.embedding_bags.{c.name}.weight"]["momentum1"]
        if not isinstance(mine, ShardedTensor):  # a data-parallel table's replica
            err = max(err, (mine - full).abs().max().item())
            continue
        for piece in mine.local_shards():
            (r, col), (nr, nc) = piece.metadata.shard_offsets, piece.metadata.shard_sizes
            err = max(err, (piece.tensor - full[r : r + nr, col : col + nc]).abs().max().item())
    return err


def test_dmp_with_our_sharder_matches_unsharded_after_3_fused_steps():
    """A hand-made TorchRec plan (construct_module_sharding_plan) and one from TorchRec's
    EmbeddingShardingPlanner, each table of its own sharding type."""
    tables = [c.name for c in _configs()]
    for rank, runs in enumerate(run_ranks(_dmp_vs_unsharded, 2)):
        for planned_by, (report, keys, sharding) in runs.items():
            for key, err in report.items():
                assert err < 2e-5, f"rank {rank} {planned_by} {key}: {err}"
            assert keys == sorted([*(f"ebc.embedding_bags.{t}.weight" for t in tables),
                                   "top.bias", "top.weight"])
            assert sharding == {"tw": "table_wise", "rw": "row_wise", "cw": "column_wise",
                                "twrw": "table_row_wise", "dp": "data_parallel"}, planned_by


def _dmp_without_our_sharder(rank, world):
    """DMP with its default sharders: ours gets no plan and would be replicated under DDP;
    its first forward refuses. Then TorchRec's EBC sharded into ours by our sharder."""
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    configs = _configs()
    adagrad = {"lr": 0.3, "eps": 1e-8}
    model = _Model(fbtriton_dist.EmbeddingBagCollection(tables=configs))
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), adagrad)
    dmp = DistributedModelParallel(model)
    planned = type(dmp.module.ebc) is not fbtriton_dist.EmbeddingBagCollection
    try:
        dmp(_batch(configs, 0, 0, BATCH[rank]))
        error = None
    except RuntimeError as e:
        error = str(e)

    torch.manual_seed(1)
    theirs = _Model(torchrec.EmbeddingBagCollection(tables=copy.deepcopy(configs)))
    apply_optimizer_in_backward(torch.optim.Adagrad, theirs.ebc.parameters(), adagrad)
    ref = copy.deepcopy(theirs)
    sharder = EmbeddingBagCollectionSharder(local_world_size=world,
                                            module_type=torchrec.EmbeddingBagCollection)
    dmp = DistributedModelParallel(theirs, sharders=[sharder],
                                   plan=_torchrec_plan(theirs.ebc, sharder, world))
    lo, hi = sum(BATCH[:rank]), sum(BATCH[: rank + 1])
    out = dmp(_batch(configs, 0, lo, hi))
    err = (out - ref(_batch(configs, 0, 0, sum(BATCH)))[lo:hi]).abs().max().item()
    return planned, error, type(dmp.module.ebc.sharded).__name__, err


def test_dmp_without_our_sharder_refuses_and_points_to_it():
    for planned, error, sharded_type, err in run_ranks(_dmp_without_our_sharder, 2):
        assert not planned  # TorchRec's planner and default sharders do not know ours
        assert error is not None and "EmbeddingBagCollectionSharder" in error
        assert "fbtriton_dist.shard(" in error and "replicate" in error
        assert sharded_type == "ShardedEmbeddingBagCollection"  # TorchRec's EBC, sharded as ours
        assert err < 2e-5


# -- TorchRec's plan -> ours, without ranks --------------------------------------------------
def _module_plan(per_table, world=2):
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed import sharding_plan as sp

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    configs = [
        EmbeddingBagConfig(name="a", num_embeddings=11, embedding_dim=8, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", num_embeddings=1, embedding_dim=4, feature_names=["fb"]),
    ]
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs)
    gens = {"row_wise": sp.row_wise(), "table_wise": sp.table_wise(rank=1),
            "column_wise": sp.column_wise(ranks=[1, 0]), "data_parallel": sp.data_parallel()}
    plan = sp.construct_module_sharding_plan(
        ebc, {t: gens[k] for t, k in per_table.items()}, sharder=EmbeddingBagCollectionSharder(),
        local_size=world, world_size=world, device_type="cpu",
    )
    return configs, plan


def _blocks(table):
    return [(s.rank, s.row_start, s.row_end, s.col_start, s.col_end) for s in table.shards]


def test_torchrec_parameter_shardings_become_our_shards():
    from fbtriton_dist.sharding.dmp import to_fbtd_plan

    configs, tr = _module_plan({"a": "row_wise", "b": "row_wise"})
    plan = to_fbtd_plan(configs, tr, 2, 2)
    assert _blocks(plan.table("a")) == [(0, 0, 6, 0, 8), (1, 6, 11, 0, 8)]
    assert _blocks(plan.table("b")) == [(0, 0, 1, 0, 4)]  # TorchRec's empty shard dropped
    configs, tr = _module_plan({"a": "column_wise", "b": "table_wise"})
    plan = to_fbtd_plan(configs, tr, 2, 1)
    assert plan.table("a").sharding == "column_wise"
    assert _blocks(plan.table("a")) == [(1, 0, 11, 0, 4), (0, 0, 11, 4, 8)]
    assert _blocks(plan.table("b")) == [(1, 0, 1, 0, 4)]
    configs, tr = _module_plan({"a": "data_parallel", "b": "table_wise"})
    assert _blocks(to_fbtd_plan(configs, tr, 2, 2).table("a")) == [(0, 0, 11, 0, 8),
                                                                  (1, 0, 11, 0, 8)]


def test_torchrec_plans_we_cannot_take_are_refused():
    import dataclasses as dc

    from fbtriton_dist.sharding.dmp import to_fbtd_plan

    configs, tr = _module_plan({"a": "row_wise", "b": "table_wise"})
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        to_fbtd_plan(configs, {"a": tr["a"]}, 2, 2)
    bogus = {**tr, "a": dc.replace(tr["a"], sharding_type="table_wise_bogus")}
    with pytest.raises(ValueError, match="table 'a': expected a sharding type in"):
        to_fbtd_plan(configs, bogus, 2, 2)
    no_spec = {**tr, "b": dc.replace(tr["b"], sharding_spec=None)}
    with pytest.raises(ValueError, match="table 'b' \\(table_wise\\): expected a sharding_spec"):
        to_fbtd_plan(configs, no_spec, 2, 2)
    with pytest.raises(ValueError, match="rank"):  # a shard on rank 1 of a 1-rank job
        to_fbtd_plan(configs, tr, 1, 1)


def test_dmp_on_the_meta_device_builds_like_torchrecs(tmp_path):
    """DMP(device="meta") (shapes only, as for planning or a later load): our sharded module
    and its fused optimizer view are built with no step count to read, and DMP's state dict
    and fused optimizer have TorchRec's keys and global sizes. One rank, in this process;
    ``init_data_parallel=False`` as TorchRec wants on meta (its DDP wrap reads the dense
    parameters)."""
    import torch.distributed as dist
    import torchrec
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as Theirs
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    meta = torch.device("meta")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        seen = {}
        for side, cls, sharder in (
            ("ours", fbtriton_dist.EmbeddingBagCollection,
             EmbeddingBagCollectionSharder(local_world_size=1)),
            ("torchrec", torchrec.EmbeddingBagCollection, Theirs()),
        ):
            tables = [c for c in _configs() if c.name in ("tw", "rw", "cw")]
            model = _Model(cls(tables=copy.deepcopy(tables), device=meta))
            apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
            from torchrec.distributed import sharding_plan as sp
            from torchrec.distributed.types import ShardingPlan

            per_table = {"tw": sp.table_wise(rank=0), "rw": sp.row_wise(),
                         "cw": sp.column_wise(ranks=[0, 0])}
            plan = ShardingPlan({"ebc": sp.construct_module_sharding_plan(
                model.ebc, per_table, sharder=sharder, local_size=1, world_size=1,
                device_type="cpu")})
            dmp = DistributedModelParallel(model, sharders=[sharder], plan=plan, device=meta,
                                           init_data_parallel=False)
            state = dmp.state_dict()
            seen[side] = (
                {k: tuple(v.size()) for k, v in state.items()},
                sorted(dmp.fused_optimizer.state_dict()["state"]),
                sorted(k for k, v in state.items() if isinstance(v, ShardedTensor)),
            )
        assert seen["ours"] == seen["torchrec"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("torchrec_division,comm_division,want", [
    (True, None, True), (False, None, False), (False, True, True), (True, False, False),
])
def test_our_sharders_follow_torchrecs_gradient_division_switch(
    tmp_path, torchrec_division, comm_division, want
):
    """``CommOptions(gradient_division=None)`` (the default) under DMP takes TorchRec's
    ``comm_ops.set_gradient_division`` at shard time; True / False override it. One rank, in
    this process (what the switch does to a step: tests/sharding/test_grad_scale.py)."""
    import torch.distributed as dist
    from torchrec.distributed import comm_ops
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding import CommOptions
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    before = comm_ops.get_gradient_division()
    try:
        comm_ops.set_gradient_division(torchrec_division)
        model = _Model(fbtriton_dist.EmbeddingBagCollection(tables=_configs()[:2]))
        apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.1})
        sharder = EmbeddingBagCollectionSharder(
            local_world_size=1, comm=CommOptions(gradient_division=comm_division))
        from torchrec.distributed import sharding_plan as sp
        from torchrec.distributed.types import ShardingPlan

        plan = ShardingPlan({"ebc": sp.construct_module_sharding_plan(
            model.ebc, {"tw": sp.table_wise(rank=0), "rw": sp.row_wise()}, sharder=sharder,
            local_size=1, world_size=1, device_type="cpu")})
        dmp = DistributedModelParallel(model, sharders=[sharder], plan=plan)
        assert dmp.module.ebc.sharded.comm.gradient_division is want
    finally:
        comm_ops.set_gradient_division(before)
        dist.destroy_process_group()
