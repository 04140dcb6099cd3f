"""``optimizer_state_dtypes`` on 2 gloo ranks, row-wise: Adam with bf16 moments sharded
matches the unsharded collection after 2 steps; a checkpoint (torch.distributed.checkpoint)
keeps the states bf16 under TorchRec's keys and loads back exactly; a checkpoint of another
state dtype is converted to the model's (round to nearest); the DMP sharder takes
``fused_params={"optimizer_state_dtypes": ...}`` and refuses other keys."""

import copy

import pytest
import torch

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt, _plan

BF16 = {"momentum1": "bf16", "momentum2": "bf16"}
ADAM = (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95)})


def _tables():
    """Two of ``test_sharded_ebc``'s tables (one with two features)."""
    return _configs(False)[:2]


def _collection(state_dtypes, seed=0):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    torch.manual_seed(seed)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=_tables(),
                                               optimizer_state_dtypes=state_dtypes)
    apply_optimizer_in_backward(ADAM[0], ebc.parameters(), ADAM[1])
    return ebc


def _states(sharded) -> dict[str, torch.Tensor]:
    """This rank's local state shards, by key and offsets."""
    out = {}
    for key, value in sharded.fused_optimizer_state_dict().items():
        if key == "step":
            continue
        for s in value.local_shards():
            out[f"{key}@{list(s.metadata.shard_offsets)}"] = s.tensor.clone()
    return out


def _run(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    report = {}
    configs = _tables()
    plan = _plan("row_wise", world).subset([c.name for c in configs])
    ref = _collection(BF16)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(ADAM[0], to_shard.parameters(), ADAM[1])
    sharded = fbtriton_dist.shard(to_shard, plan)  # the collection's own state dtypes
    sizes = BATCH[:world]
    lo, B = sum(sizes[:rank]), sum(sizes)
    for step in range(2):
        batch = _global_batch(configs, B, step, False)
        out_ref = ref(_kjt(*batch, 0, B)).values()
        grad = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(7 + step))
        out_ref.backward(grad / world)  # the sharded gradients are divided by the world size
        sharded(_kjt(*batch, lo, lo + sizes[rank])).values().backward(grad[lo:lo + sizes[rank]])
    full = sharded.gather_full_state_dict()
    report["weights"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    ref_state = ref.fused_optimizer_state_dict()
    state = sharded.fused_optimizer_state_dict()
    err, dtypes = 0.0, set()
    for key, value in state.items():
        if key == "step":
            continue
        dtypes.add(value.metadata().tensor_properties.dtype)
        for s in value.local_shards():
            r0, c0 = s.metadata.shard_offsets
            r1, c1 = r0 + s.tensor.shape[0], c0 + s.tensor.shape[1]
            dtypes.add(s.tensor.dtype)
            err = max(err, ((s.tensor.float() - ref_state[key][r0:r1, c0:c1].float()).abs()
                            / ref_state[key][r0:r1, c0:c1].float().abs().clamp_min(1e-6))
                      .max().item())
    report["state_rel"], report["state_dtypes"] = err, sorted(map(str, dtypes))

    # save bf16 states; load into a fresh bf16 model (exact) and an fp32 one (exact: widening)
    saved = _states(sharded)
    dcp.save({"fused": state}, checkpoint_id=f"{path}/bf16")
    for dtypes_, name in ((BF16, "bf16"), (None, "fp32")):
        other = fbtriton_dist.shard(_collection(dtypes_, seed=1), plan)
        sd = {"fused": other.fused_optimizer_state_dict()}
        dcp.load(sd, checkpoint_id=f"{path}/bf16")
        other.load_fused_optimizer_state_dict(sd["fused"])
        got = _states(other)
        report[f"bf16_into_{name}"] = all(
            got[k].dtype == (torch.bfloat16 if dtypes_ else torch.float32)
            and torch.equal(got[k], v.to(got[k].dtype)) for k, v in saved.items())
        report[f"bf16_into_{name}_step"] = other.tbes[0].step
    # fp32 states that bf16 cannot hold exactly, loaded into a bf16 model: rounded to nearest
    for t in other.tbes:
        for name in ("momentum1", "momentum2"):
            getattr(t, name).mul_(1 + 2**-12)
    fp32 = _states(other)
    dcp.save({"fused": other.fused_optimizer_state_dict()}, checkpoint_id=f"{path}/fp32")
    low = fbtriton_dist.shard(_collection(BF16, seed=2), plan)
    sd = {"fused": low.fused_optimizer_state_dict()}
    dcp.load(sd, checkpoint_id=f"{path}/fp32")
    got = _states(low)
    report["fp32_into_bf16_rounded"] = all(torch.equal(got[k], v.to(torch.bfloat16))
                                           for k, v in fp32.items())
    report["fp32_not_bf16_exact"] = any(not torch.equal(v.to(torch.bfloat16).float(), v)
                                        for v in fp32.values())
    return report


def test_sharded_bf16_states_match_unsharded_and_checkpoint(tmp_path):
    for report in run_ranks(_run, 2, str(tmp_path), timeout=240):
        assert report["weights"] < 1e-6, report
        # the ranks' row gradients are summed in another order: a moment may round to the
        # other side of a bf16 step (relative 2**-8)
        assert report["state_rel"] <= 2**-7, report
        assert report["state_dtypes"] == ["torch.bfloat16"], report
        assert report["bf16_into_bf16"] and report["bf16_into_fp32"], report
        assert report["bf16_into_bf16_step"] == report["bf16_into_fp32_step"] == 2, report
        assert report["fp32_into_bf16_rounded"] and report["fp32_not_bf16_exact"], report


def test_dmp_sharder_fused_params():
    from fbgemm_gpu.split_embedding_configs import SparseType

    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer_state_dtypes": {"momentum1": SparseType.BF16}})
    assert sharder.fused_params == {"optimizer_state_dtypes": {"momentum1": SparseType.BF16}}
    assert EmbeddingBagCollectionSharder().fused_params is None
    with pytest.raises(ValueError, match=r"fused_params: \['learning_rate'\] configure a fused "
                                         r"optimizer; expected fused_params\['optimizer'\]"):
        EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
    with pytest.raises(ValueError, match=r"optimizer_state_dtypes\['momentum1'\]: expected one"):
        EmbeddingBagCollectionSharder(fused_params={"optimizer_state_dtypes": {"momentum1": 8}})
