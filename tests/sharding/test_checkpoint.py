"""Sharded state dicts: TorchRec keys, torch.distributed.checkpoint save on 2 ranks and load
(resharded) on 3, optimizer state included; a full TorchRec state dict loads into shards."""

import torch

from tests.sharding.harness import device, run_ranks
from tests.sharding.test_sharded_ebc import _configs, _global_batch, _kjt, _plan

GLOBAL_B = 10
SPLITS = {2: [5, 5], 3: [3, 5, 2]}


def _model(world):
    import fbtriton_dist

    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=_configs(False), device=device())
    return fbtriton_dist.shard(
        ebc, _plan("mixed", world), optimizer=fbtriton_dist.optim.RowWiseAdagrad(lr=0.2)
    )


def _step(sharded, rank, world, step):
    sizes = SPLITS[world]
    lo = sum(sizes[:rank])
    batch = _global_batch(_configs(False), GLOBAL_B, step, False)
    out = sharded(_kjt(*batch, lo, lo + sizes[rank]).to(device())).values()
    g = torch.Generator().manual_seed(50 + step)
    grad = torch.randn(GLOBAL_B, out.shape[1], generator=g)[lo : lo + sizes[rank]]
    # times R: the sharded gradients are divided by R, so any world size takes the same step
    out.backward(grad.to(out.device) * world)


def _save(rank, world, path):
    import torch.distributed.checkpoint as dcp

    sharded = _model(world)
    for step in range(2):
        _step(sharded, rank, world, step)
    sd = sharded.state_dict()
    assert list(sd) == [f"embedding_bags.{c.name}.weight" for c in _configs(False)]
    dcp.save({"model": sd, "fused": sharded.fused_optimizer_state_dict()}, checkpoint_id=path)
    _step(sharded, rank, world, 2)
    full = {k: v.cpu() for k, v in sharded.gather_full_state_dict().items()}
    if rank == 0:
        torch.save(full, f"{path}/expected.pt")


def _load(rank, world, path):
    import torch.distributed.checkpoint as dcp

    sharded = _model(world)  # another world size, so another layout of the same plan kind
    state = {"model": sharded.state_dict(), "fused": sharded.fused_optimizer_state_dict()}
    dcp.load(state, checkpoint_id=path)
    sharded.load_state_dict(state["model"])
    sharded.load_fused_optimizer_state_dict(state["fused"])
    _step(sharded, rank, world, 2)  # same third step: matches only if the state came back
    expected = torch.load(f"{path}/expected.pt", weights_only=True)
    full = sharded.gather_full_state_dict()
    return max((full[k].cpu() - v).abs().max().item() for k, v in expected.items())


def _load_torchrec(rank, world):
    import torchrec

    torch.manual_seed(5)
    theirs = torchrec.EmbeddingBagCollection(tables=_configs(False))
    sharded = _model(world)
    sharded.load_state_dict(theirs.state_dict(), strict=True)
    full = sharded.gather_full_state_dict()
    return max((full[k].cpu() - v).abs().max().item() for k, v in theirs.state_dict().items())


def test_save_on_2_ranks_load_resharded_on_3(tmp_path):
    run_ranks(_save, 2, str(tmp_path))
    errors = run_ranks(_load, 3, str(tmp_path))
    assert max(errors) < 1e-6, errors


def test_full_torchrec_state_dict_loads_into_shards():
    assert max(run_ranks(_load_torchrec, 2)) == 0.0
