"""Rowwise Adagrad with global weight decay on 2 gloo ranks, row-wise: TorchRec's
``RowWiseAdagrad`` annotation with FBGEMM's DECOUPLE_GLOBAL arguments, sharded, matches the
unsharded collection after 5 steps, weights and both per-row states (``momentum1``,
``prev_iter``, each sharded with its rows). The catch-up reads the step of each rank's TBE
(FBGEMM's per-TBE ``iter``): step 2 sends no id to rank 1, whose TBEs must count it all the
same for its rows' later catch-up to match."""

import copy

import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt, _plan


def _annotation():
    from torchrec.optim import RowWiseAdagrad

    from tests.fbgemm_config import GlobalWeightDecayDefinition, WeightDecayMode

    return RowWiseAdagrad, {"lr": 0.2, "eps": 1e-6, "weight_decay": 0.5,
                            "weight_decay_mode": WeightDecayMode.DECOUPLE_GLOBAL,
                            "global_weight_decay": GlobalWeightDecayDefinition(
                                start_iter=2, lower_bound=0.5)}


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
    for step in range(5):
        feats, lengths, values, weights = _global_batch(configs, B, step, False)
        if step == 1:  # ids of rank 0's row blocks only
            values = {f: v % 3 for f, v in values.items()}
        batch = (feats, lengths, values, weights)
        out_ref = ref(_kjt(*batch, 0, B)).values()
        grad = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7 + step))
        out_ref.backward(grad / world)  # the sharded gradients are divided by the world size
        sharded(_kjt(*batch, lo, lo + sizes[rank])).values().backward(grad[lo:lo + sizes[rank]])
    full = sharded.gather_full_state_dict()
    report = {"weights": max((full[k] - v).abs().max().item()
                             for k, v in ref.state_dict().items())}
    ref_state, state = ref.fused_optimizer_state_dict(), sharded.fused_optimizer_state_dict()
    report["keys"] = sorted(k.rsplit(".", 1)[1] for k in state if k != "step")
    err, last = 0.0, 0.0
    for key, value in state.items():
        if key == "step":
            continue
        for s in value.local_shards():
            r0, c0 = s.metadata.shard_offsets
            r1, c1 = r0 + s.tensor.shape[0], c0 + s.tensor.shape[1]
            err = max(err, (s.tensor - ref_state[key][r0:r1, c0:c1]).abs().max().item())
            if key.endswith(".1"):
                last = max(last, s.tensor.max().item())
    report["state_err"], report["prev_iter_max"] = err, last
    report["kind"] = type(sharded.optimizer).__name__
    return report


def test_sharded_global_decay_matches_unsharded():
    reports = run_ranks(_run, 2, timeout=240)
    for report in reports:
        assert report["kind"] == "RowWiseAdagradGlobalDecay", report
        assert report["weights"] < 1e-5, report
        assert report["keys"] == ["0", "0", "1", "1"], report  # 2 tables x 2 states
        assert report["state_err"] < 1e-5, report
    assert reports[1]["prev_iter_max"] == 5, reports  # rank 1's rows: caught up at step 5
