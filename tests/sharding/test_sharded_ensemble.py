"""Ensemble rowwise Adagrad on 2 gloo ranks, row-wise: our annotation with FBGEMM's
``ensemble_mode`` argument, sharded, matches the unsharded collection after 4 steps that
average (before steps 2 and 4) and swap (before step 3) every rank's rows and slow copies:
weights, ``momentum1`` ([E] per row) and ``momentum2`` (the slow copy, [E, D]), each sharded
with its rows."""

import copy

import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt, _plan


def _run(rank, world):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.modules.fused_optim import EnsembleRowWiseAdagrad
    from tests.fbgemm_config import EnsembleModeDefinition

    kwargs = {"lr": 0.2, "eps": 1e-6, "ensemble_mode": EnsembleModeDefinition(
        step_ema=2, step_swap=3, step_start=1, step_ema_coef=0.3)}
    configs = _configs(False)[:2]
    plan = _plan("row_wise", world).subset([c.name for c in configs])
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs)
    apply_optimizer_in_backward(EnsembleRowWiseAdagrad, ref.parameters(), kwargs)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(EnsembleRowWiseAdagrad, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, plan)
    sizes = BATCH[:world]
    lo, B = sum(sizes[:rank]), sum(sizes)
    for step in range(4):
        batch = _global_batch(configs, B, step, False)
        out_ref = ref(_kjt(*batch, 0, B)).values()
        grad = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7 + step))
        out_ref.backward(grad / world)  # the sharded gradients are divided by the world size
        sharded(_kjt(*batch, lo, lo + sizes[rank])).values().backward(grad[lo:lo + sizes[rank]])
    full = sharded.gather_full_state_dict()
    report = {"weights": max((full[k] - v).abs().max().item()
                             for k, v in ref.state_dict().items())}
    ref_state, state = ref.fused_optimizer_state_dict(), sharded.fused_optimizer_state_dict()
    report["shapes"] = sorted((k.rsplit(".", 1)[1], tuple(v.size())) for k, v in state.items()
                              if k != "step")
    err, slow = 0.0, 0.0
    for key, value in state.items():
        if key == "step":
            continue
        for s in value.local_shards():
            r0, c0 = s.metadata.shard_offsets
            r1, c1 = r0 + s.tensor.shape[0], c0 + s.tensor.shape[1]
            err = max(err, (s.tensor - ref_state[key][r0:r1, c0:c1]).abs().max().item())
            if key.endswith(".1"):
                slow = max(slow, s.tensor.abs().max().item())
    report["state_err"], report["slow_max"] = err, slow
    report["kind"] = type(sharded.optimizer).__name__
    return report


def test_sharded_ensemble_matches_unsharded():
    for report in run_ranks(_run, 2, timeout=240):
        assert report["kind"] == "EnsembleRowWiseAdagrad", report
        assert report["weights"] < 1e-5, report
        assert report["state_err"] < 1e-5 and report["slow_max"] > 0, report
        # 2 tables: momentum1 [E, 1] (per row), momentum2 [E, D] (the slow copy)
        assert [(n, size[1] > 1) for n, size in report["shapes"]] == [
            ("0", False), ("0", False), ("1", True), ("1", True)], report


def test_dmp_fused_optimizer_names_the_slow_copy_as_torchrec(tmp_path):
    """Under TorchRec's DMP (one rank, in this process), the fused optimizer's state of each
    table is keyed as TorchRec keys FBGEMM's ENSEMBLE_ROWWISE_ADAGRAD states: ``momentum1``
    and ``sparse_ema`` (FBGEMM's ``get_optimizer_state`` name of its ``momentum2``)."""
    import torch.distributed as dist
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.modules.fused_optim import EnsembleRowWiseAdagrad
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder
    from tests.fbgemm_config import EnsembleModeDefinition
    from tests.sharding.test_dmp import _batch, _Model
    from tests.sharding.test_dmp import _configs as dmp_configs

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        configs = dmp_configs()[:2]
        model = _Model(fbtriton_dist.EmbeddingBagCollection(tables=configs))
        apply_optimizer_in_backward(EnsembleRowWiseAdagrad, model.ebc.parameters(), {
            "lr": 0.1, "ensemble_mode": EnsembleModeDefinition(step_ema=1)})
        sharder = EmbeddingBagCollectionSharder(local_world_size=1)
        plan = ShardingPlan({"ebc": sp.construct_module_sharding_plan(
            model.ebc, {c.name: sp.row_wise() for c in configs}, sharder=sharder,
            local_size=1, world_size=1, device_type="cpu")})
        dmp = DistributedModelParallel(model, sharders=[sharder], plan=plan)
        dmp(_batch(configs, 0, 0, 3)).sum().backward()
        state = dmp.fused_optimizer.state_dict()["state"]
        for c in configs:
            table = state[f"ebc.embedding_bags.{c.name}.weight"]
            assert sorted(table) == ["momentum1", "sparse_ema", "step"], sorted(table)
            slow = table["sparse_ema"].local_shards()[0].tensor
            assert slow.shape == (c.num_embeddings, c.embedding_dim)
            assert slow.abs().sum() > 0  # averaged before step 1 (step_ema 1, coef 0)
    finally:
        dist.destroy_process_group()


def test_shard_takes_ensemble_mode_as_a_mapping(tmp_path):
    """``shard()`` of a collection annotated with ``ensemble_mode`` as a plain dict (one
    rank, in this process) trains as the unsharded collection with the same annotation (3
    steps: averages before each, a swap before step 2)."""
    import torch.distributed as dist
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.modules.fused_optim import EnsembleRowWiseAdagrad

    kwargs = {"lr": 0.2, "ensemble_mode": {"step_ema": 1, "step_swap": 2, "step_ema_coef": 0.5}}
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        configs = _configs(False)[:2]
        torch.manual_seed(0)
        ref = fbtriton_dist.EmbeddingBagCollection(tables=configs)
        to_shard = copy.deepcopy(ref)
        for m in (ref, to_shard):
            apply_optimizer_in_backward(EnsembleRowWiseAdagrad, m.parameters(), kwargs)
        sharded = fbtriton_dist.shard(to_shard, _plan("row_wise", 1).subset(
            [c.name for c in configs]))
        for step in range(3):
            batch = _global_batch(configs, 4, step, False)
            ref(_kjt(*batch, 0, 4)).values().sum().backward()
            sharded(_kjt(*batch, 0, 4)).values().sum().backward()
        full = sharded.gather_full_state_dict()
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(full[key], value, atol=1e-6, rtol=1e-6)
    finally:
        dist.destroy_process_group()


def test_graph_pipeline_refuses_it_on_every_device(tmp_path):
    """``TrainPipeline(cuda_graph=True)`` refuses a sharded collection with ensemble rowwise
    Adagrad (a replayed graph would skip its whole-table step), also on the CPU, where the
    step would run eagerly; ``cuda_graph=False`` trains it."""
    from dataclasses import dataclass

    import pytest
    import torch.distributed as dist
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.modules.fused_optim import EnsembleRowWiseAdagrad
    from fbtriton_dist.sharding import TrainPipeline

    @dataclass
    class Batch:
        sparse: object

        def to(self, device, non_blocking=False):
            return self

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        configs = _configs(False)[:2]
        ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs)
        apply_optimizer_in_backward(EnsembleRowWiseAdagrad, ebc.parameters(),
                                    {"lr": 0.2, "ensemble_mode": {"step_ema": 1}})
        sharded = fbtriton_dist.shard(ebc, _plan("row_wise", 1).subset(
            [c.name for c in configs]))
        loss = lambda m, b: m(b.sparse).values().sum()  # noqa: E731
        with pytest.raises(ValueError, match=r"TrainPipeline\(cuda_graph=True\).*expected fused "
                                             r"optimizers without a whole-table step, got "
                                             r"\['ensemble_rowwise_adagrad'\]"):
            TrainPipeline(sharded, None, "cpu", loss_fn=loss, own_group=False, cuda_graph=True)
        pipe = TrainPipeline(sharded, None, "cpu", loss_fn=loss, own_group=False)
        before = sharded.gather_full_state_dict()
        pipe.progress(iter([Batch(_kjt(*_global_batch(configs, 4, 0, False), 0, 4))]))
        after = sharded.gather_full_state_dict()
        assert all(not torch.equal(before[k], after[k]) for k in before)  # it trained
    finally:
        dist.destroy_process_group()
