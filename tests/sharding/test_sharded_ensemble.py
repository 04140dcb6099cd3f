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
    from fbgemm_gpu.tbe.config import EnsembleModeDefinition
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.modules.fused_optim import EnsembleRowWiseAdagrad

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
