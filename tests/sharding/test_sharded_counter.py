"""Rowwise Adagrad with counter on 2 gloo ranks, row-wise: TorchRec's ``RowWiseAdagrad``
annotation with FBGEMM's COUNTER arguments, sharded, matches the unsharded collection after 3
steps (rows touched at different steps), weights and the three per-row states (``momentum1``,
``prev_iter``, ``row_counter``), each sharded with its rows. Both sides of ``max_counter``:
a case that never refreshes it (counter SGD), and one whose tail-id threshold is a ratio of
it, refreshed every step, where the shards' own largest counters differ (the first two steps
touch only rank 0's rows): each shard's ``max_counter`` is its table's over both ranks (the
sharded collection's all-reduce), the unsharded one's, and so are the rows it scales."""

import copy

import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt, _plan


def _annotation(max_matters: bool):
    from torchrec.optim import RowWiseAdagrad

    from tests.fbgemm_config import (
        CounterBasedRegularizationDefinition,
        CounterWeightDecayMode,
        LearningRateMode,
        TailIdThreshold,
        WeightDecayMode,
    )

    if max_matters:  # rows above half the largest counter get a rate scaled by max_counter
        definition = CounterBasedRegularizationDefinition(
            counter_weight_decay_mode=CounterWeightDecayMode.L2, counter_halflife=-1,
            adjustment_ub=1.0, learning_rate_mode=LearningRateMode.TAIL_ID_LR_DECREASE,
            tail_id_threshold=TailIdThreshold(0.25, True), max_counter_update_freq=1)
    else:
        definition = CounterBasedRegularizationDefinition(
            counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE, counter_halflife=2,
            adjustment_ub=2.0, learning_rate_mode=LearningRateMode.COUNTER_SGD,
            tail_id_threshold=TailIdThreshold(1.2, False))
    return RowWiseAdagrad, {"lr": 0.2, "eps": 1e-6, "weight_decay": 0.3,
                            "weight_decay_mode": WeightDecayMode.COUNTER,
                            "counter_based_regularization": definition}


def _run(rank, world, max_matters):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    configs = _configs(False)[:2]
    plan = _plan("row_wise", world).subset([c.name for c in configs])
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs)
    cls, kwargs = _annotation(max_matters)
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, plan)
    sizes = BATCH[:world]
    lo, B = sum(sizes[:rank]), sum(sizes)
    (tbe,) = sharded.tbes
    own = []  # this shard's largest counter before each step
    for step in range(4 if max_matters else 3):
        own.append(float(tbe.row_counter.max()))
        batch = _global_batch(configs, B, step, False)
        if max_matters and step < 2:  # ids 0, 1 only, rank 0's rows: its counters run ahead
            batch = (batch[0], batch[1], {f: v % 2 for f, v in batch[2].items()}, batch[3])
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
    (ref_tbe, _), = ref.tbe_groups()
    report["max_counter"] = (float(tbe.max_counter), float(ref_tbe.max_counter))
    report["own"] = own
    return report


def test_sharded_counter_matches_unsharded():
    for report in run_ranks(_run, 2, False, timeout=240):
        assert report["kind"] == "RowWiseAdagradWithCounter", report
        assert report["weights"] < 1e-5, report
        assert report["keys"] == ["0", "0", "1", "1", "2", "2"], report  # 2 tables x 3 states
        assert report["state_err"] < 1e-4 and report["state_max"] >= 3, report  # prev_iter 3


def test_sharded_max_counter_is_the_tables_over_every_shard():
    reports = run_ranks(_run, 2, True, timeout=240)
    # before the last step: rank 0's largest counter 3, rank 1's less (its own would be less)
    assert reports[0]["own"] == [0, 1, 2, 3] and reports[1]["own"][3] < 3, [r["own"] for r in reports]
    for report in reports:
        assert report["weights"] < 1e-5, report
        assert report["state_err"] < 1e-4, report
        assert report["max_counter"] == (4.0, 4.0), report  # 1 + 3 on both shards
