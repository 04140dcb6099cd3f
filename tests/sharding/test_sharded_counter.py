"""Rowwise Adagrad with counter on 2 gloo ranks, row-wise: TorchRec's ``RowWiseAdagrad``
annotation with FBGEMM's COUNTER arguments, sharded, matches the unsharded collection after 3
steps (rows touched at different steps), weights and the three per-row states (``momentum1``,
``prev_iter``, ``row_counter``), each sharded with its rows. ``max_counter`` is per module
(per rank sharded, as FBGEMM's per-rank TBE), so the case never refreshes it."""

import copy

import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt, _plan


def _annotation():
    from fbgemm_gpu.tbe.config import (
        CounterBasedRegularizationDefinition,
        CounterWeightDecayMode,
        LearningRateMode,
        TailIdThreshold,
        WeightDecayMode,
    )
    from torchrec.optim import RowWiseAdagrad

    definition = CounterBasedRegularizationDefinition(
        counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE, counter_halflife=2,
        adjustment_ub=2.0, learning_rate_mode=LearningRateMode.COUNTER_SGD,
        tail_id_threshold=TailIdThreshold(1.2, False))
    return RowWiseAdagrad, {"lr": 0.2, "eps": 1e-6, "weight_decay": 0.3,
                            "weight_decay_mode": WeightDecayMode.COUNTER,
                            "counter_based_regularization": definition}


def _run(rank, world):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    configs = _configs(False)[:2]
    plan = _plan("row_wise", world).subset([c.name for c in configs])
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs)
    cls, kwargs = _annotation()
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, plan)
    sizes = BATCH[:world]
    lo, B = sum(sizes[:rank]), sum(sizes)
    for step in range(3):
        batch = _global_batch(configs, B, step, False)
        out_ref = ref(_kjt(*batch, 0, B)).values()
        grad = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7 + step))
        out_ref.backward(grad / world)  # the sharded gradients are divided by the world size
        sharded(_kjt(*batch, lo, lo + sizes[rank])).values().backward(grad[lo:lo + sizes[rank]])
    full = sharded.gather_full_state_dict()
    report = {"weights": max((full[k] - v).abs().max().item()
                             for k, v in ref.state_dict().items())}
    ref_state, state = ref.fused_optimizer_state_dict(), sharded.fused_optimizer_state_dict()
    report["keys"] = sorted(k.rsplit(".", 1)[1] for k in state if k != "step")
    err, moved = 0.0, 0.0
    for key, value in state.items():
        if key == "step":
            continue
        for s in value.local_shards():
            r0, c0 = s.metadata.shard_offsets
            r1, c1 = r0 + s.tensor.shape[0], c0 + s.tensor.shape[1]
            err = max(err, (s.tensor - ref_state[key][r0:r1, c0:c1]).abs().max().item())
            moved = max(moved, s.tensor.abs().max().item())
    report["state_err"], report["state_max"] = err, moved
    report["kind"] = type(sharded.optimizer).__name__
    return report


def test_sharded_counter_matches_unsharded():
    for report in run_ranks(_run, 2, timeout=240):
        assert report["kind"] == "RowWiseAdagradWithCounter", report
        assert report["weights"] < 1e-5, report
        assert report["keys"] == ["0", "0", "1", "1", "2", "2"], report  # 2 tables x 3 states
        assert report["state_err"] < 1e-4 and report["state_max"] >= 3, report  # prev_iter 3
