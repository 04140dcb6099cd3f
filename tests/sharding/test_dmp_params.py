"""``named_parameters()`` of a DMP model with our sharder, side by side with TorchRec's own
DMP (TorchRec's EmbeddingBagCollection and sharder) on 2 gloo ranks, one plan for both (a
table of each sharding type), even local batches: the same parameter names, the same local weight shapes, the
embedding weights left out of DMP's DDP and marked as updated in backward; and 3 training
steps of a dense optimizer over the non-embedding parameters plus the fused embedding
optimizer, both rates halved by a torch scheduler after each step, leave every parameter
(local shards included) the same on both.

TorchRec's data-parallel table on CPU is not fused (its dense kernel): the dense optimizer
(SGD, as the fused one) updates it there, the fused one here, so one learning rate for both.
Ours also builds its dense optimizer over all of ``dmp.parameters()``: the embedding weights
never get a ``.grad``, so it does not update them a second time."""

import copy

import torch

from tests.sharding import test_dmp_ec
from tests.sharding.harness import run_ranks
from tests.sharding.test_dmp import BATCH, _batch, _configs, _Model, _torchrec_plan

LR = 0.1


def _load_full(dmp, full: dict) -> None:
    """Every rank's part of the full ``{key: tensor}`` into the DMP model's state (its
    ShardedTensor pieces are views of the live weights)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            if not isinstance(value, ShardedTensor):
                value.copy_(full[key])
                continue
            for piece in value.local_shards():
                (r, c), (nr, nc) = piece.metadata.shard_offsets, piece.metadata.shard_sizes
                piece.tensor.copy_(full[key][r : r + nr, c : c + nc])


def _dmp(rank, world, which):
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as TRSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import EmbeddingBagCollectionSharder

    configs = _configs()
    torch.manual_seed(0)
    ref = _Model(torchrec.EmbeddingBagCollection(tables=copy.deepcopy(configs)))
    if which == "ours":
        model = _Model(fbtriton_dist.EmbeddingBagCollection(tables=copy.deepcopy(configs)))
        model.load_state_dict(ref.state_dict())
        sharder = EmbeddingBagCollectionSharder(local_world_size=world)
    else:
        model, sharder = ref, TRSharder()
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": LR})
    dmp = DistributedModelParallel(model, sharders=[sharder],
                                   plan=_torchrec_plan(model.ebc, sharder, world),
                                   device=torch.device("cpu"))
    _load_full(dmp, full)  # TorchRec's sharded tables start from their init_fn
    params = dict(dmp.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    dense_names = sorted(n for n, _ in in_backward_optimizer_filter(dmp.named_parameters()))
    fused_names = sorted(n for n, _ in in_backward_optimizer_filter(dmp.named_parameters(),
                                                                     include=True))
    ddp = dmp._dmp_wrapped_module
    ignored = sorted(getattr(ddp, "parameters_to_ignore", ()))
    dense_opt = torch.optim.SGD(
        dmp.parameters() if which == "ours"
        else [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())], LR)
    schedules = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                 for opt in (dmp.fused_optimizer, dense_opt)]  # lr halves every step
    B = sum(BATCH) // world  # even local batches: TorchRec's row-wise output dist on gloo
    lo, hi = rank * B, (rank + 1) * B  # takes no uneven ones
    outs = []
    for step in range(3):
        out = dmp(_batch(configs, step, lo, hi))
        out.sum().backward()
        dmp.fused_optimizer.step()
        dense_opt.step()
        dense_opt.zero_grad()
        outs.append(out.detach())
        # a fused rate reaches the kernels at the next step(), one step after a dense one:
        # the dense schedule starts a step later, so TorchRec's data-parallel table (dense
        # on CPU) gets the rates the fused tables get
        for i, sched in enumerate(schedules):
            if i == 0 or step >= 1:
                sched.step()
    grads = {n: p.grad is not None for n, p in params.items()}
    moved = {n: (p.detach() - before[n]).abs().max().item() if p.numel() else 0.0
             for n, p in params.items()}
    return {
        "shapes": {n: tuple(p.shape) for n, p in params.items()},
        "values": {n: p.detach().clone() for n, p in params.items()},
        "dense": dense_names, "moved": moved, "fused": fused_names, "ignored": ignored, "grads": grads,
        "state_keys": sorted(dmp.state_dict()), "outs": torch.cat(outs),
        "fused_keys": sorted(dmp.fused_optimizer.state_dict()["state"]),
    }


def _both(rank, world):
    """Both runs on this rank, compared here (tensors do not travel back well)."""
    ours, theirs = (_dmp(rank, world, which) for which in ("ours", "torchrec"))
    errs = {name: (ours["values"][name] - v).abs().max().item() if v.numel() else 0.0
            for name, v in theirs.pop("values").items() if name in ours["values"]}
    errs["outs"] = (ours.pop("outs") - theirs.pop("outs")).abs().max().item()
    ours.pop("values")
    return ours, theirs, errs


def test_dmp_named_parameters_and_training_match_torchrecs():
    tables = [c.name for c in _configs()]
    weights = {f"ebc.embedding_bags.{t}.weight" for t in tables}
    for rank, (ours, theirs, errs) in enumerate(run_ranks(_both, 2)):
        assert ours["shapes"] == theirs["shapes"], rank  # names and local shapes
        assert weights <= set(ours["shapes"]), rank
        assert set(ours["ignored"]) == weights == set(theirs["ignored"]), rank
        assert ours["state_keys"] == theirs["state_keys"], rank
        assert ours["dense"] == ["top.bias", "top.weight"], rank
        assert set(ours["fused"]) == weights, rank  # every table of ours is fused
        assert set(theirs["dense"]) - set(ours["dense"]) == {"ebc.embedding_bags.dp.weight"}
        assert not any(ours["grads"][n] for n in weights), rank  # never a .grad
        assert all(ours["moved"][n] > 0 for n in weights if ours["shapes"][n] != (0,)), rank
        for name, err in errs.items():  # outputs, then every parameter after 3 steps
            assert err < 1e-5, (rank, name, err)
        assert {k.split(".weight")[0] for k in ours["fused_keys"]} == {
            f"ebc.embedding_bags.{t}" for t in tables}, rank


def _ec_params(rank, world):
    """An EmbeddingCollection under DMP, ours and TorchRec's own: {name: local shape} and the
    names DDP ignores."""
    import torchrec
    from torchrec.distributed.embedding import EmbeddingCollectionSharder as TRSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding.dmp import EmbeddingCollectionSharder

    configs = test_dmp_ec._configs()
    runs = {}
    for which in ("ours", "torchrec"):
        cls = fbtriton_dist.EmbeddingCollection if which == "ours" else torchrec.EmbeddingCollection
        model = test_dmp_ec._Model(cls(tables=copy.deepcopy(configs)))
        model.top = torch.nn.Linear(2, 1)  # a dense parameter, so DMP wraps DDP
        apply_optimizer_in_backward(torch.optim.SGD, model.ec.parameters(), {"lr": LR})
        sharder = (EmbeddingCollectionSharder(local_world_size=world) if which == "ours"
                   else TRSharder())
        dmp = DistributedModelParallel(model, sharders=[sharder],
                                       plan=test_dmp_ec._plan(model.ec, sharder, world),
                                       device=torch.device("cpu"))
        runs[which] = ({n: tuple(p.shape) for n, p in dmp.named_parameters()},
                       sorted(getattr(dmp._dmp_wrapped_module, "parameters_to_ignore", ())))
    return runs


def test_dmp_embedding_collection_parameters_match_torchrecs():
    names = {f"ec.embeddings.{c.name}.weight" for c in test_dmp_ec._configs()}
    for rank, runs in enumerate(run_ranks(_ec_params, 2)):
        (ours, ours_ignored), (theirs, theirs_ignored) = runs["ours"], runs["torchrec"]
        assert ours == theirs, rank
        assert names <= set(ours), rank
        assert set(ours_ignored) == names == set(theirs_ignored), rank
