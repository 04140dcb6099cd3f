"""Per-sample weights that require grad, through a ``shard()``-ed EmbeddingBagCollection (no
DMP): every rank's weights get the gradient the unsharded module gives the same samples'
weights (the gradient of the global batch's loss), for every sharding type, on 2 and 3 gloo
ranks, over two steps of the fused optimizer; keys in another order on odd ranks."""

import copy

import pytest
import torch

from tests.sharding.harness import device, run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt, _plan

KINDS = ["row_wise", "table_wise", "column_wise", "table_row_wise", "grid_shard",
         "data_parallel", "mixed"]


def _weights_grad(rank, world, kind):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    configs = _configs(True)
    dev = device()
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, is_weighted=True, device=dev)
    apply_optimizer_in_backward(torch.optim.SGD, ref.parameters(), {"lr": 0.3})
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(torch.optim.SGD, to_shard.parameters(), {"lr": 0.3})
    sharded = fbtriton_dist.shard(to_shard, _plan(kind, world))
    sizes = BATCH[:world]
    lo, hi, B_global = sum(sizes[:rank]), sum(sizes[: rank + 1]), sum(sizes)
    errs = []
    for step in range(2):
        feats, lengths, values, weights = _global_batch(configs, B_global, step, True)
        w_ref = {f: w.clone().requires_grad_() for f, w in weights.items()}
        w_ours = {f: w.clone().requires_grad_() for f, w in weights.items()}
        out_ref = ref(_kjt(feats, lengths, values, w_ref, 0, B_global).to(dev)).values()
        proj = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(step))
        ((out_ref * proj.to(dev)).sum() / world).backward()  # each rank's loss / world
        local = _kjt(feats, lengths, values, w_ours, lo, hi, reverse_keys=rank % 2 == 1)
        out = sharded(local.to(dev)).values()
        (out * proj[lo:hi].to(dev)).sum().backward()
        for f, _ in feats:
            a, b = int(lengths[f][:lo].sum()), int(lengths[f][:hi].sum())
            want = w_ref[f].grad[a:b] * world  # the global loss's gradient
            got = w_ours[f].grad
            if got is None:
                errs.append(float("inf") if b > a else 0.0)
                continue
            errs.append((got[a:b] - want).abs().max().item() if b > a else 0.0)
            others = torch.cat([got[:a], got[b:]])  # other ranks' samples: not ours
            errs.append(others.abs().max().item() if others.numel() else 0.0)
        errs.append((out - out_ref[lo:hi]).abs().max().item())
    return max(errs)


def _all_kinds(rank, world):
    return {kind: _weights_grad(rank, world, kind) for kind in KINDS}


@pytest.mark.parametrize("world", [2, 3])
def test_per_sample_weight_gradients_match_unsharded(world):
    for rank, errs in enumerate(run_ranks(_all_kinds, world)):
        for kind, err in errs.items():
            assert err < 1e-5, (rank, kind, err)


def _no_grad_unchanged(rank, world):
    """Weights without grad (or under no_grad) travel in the data all-to-all as before."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    configs = _configs(True)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs, is_weighted=True, device=device())
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.3})
    sharded = fbtriton_dist.shard(ebc, _plan("mixed", world))
    feats, lengths, values, weights = _global_batch(configs, sum(BATCH[:world]), 0, True)
    lo = sum(BATCH[:rank])
    w = {f: v.clone().requires_grad_() for f, v in weights.items()}
    kjt = _kjt(feats, lengths, values, w, lo, lo + BATCH[rank]).to(device())
    with torch.no_grad():
        a = sharded(kjt).values()
    b = sharded(_kjt(feats, lengths, values, weights, lo, lo + BATCH[rank]).to(device()))
    c = sharded(kjt).values()
    traffic = sharded.comm_report()
    return (a - b.values()).abs().max().item(), (a - c).abs().max().item(), sorted(traffic)


def test_weights_without_grad_keep_the_data_all_to_all():
    for err_b, err_c, _ in run_ranks(_no_grad_unchanged, 2):
        assert err_b == 0.0 and err_c < 1e-6


def _vbe_weights_grad(rank, world):
    """A VBE batch (a batch size per feature, ``test_sharded_vbe``'s): each rank's weights get
    the unsharded module's gradient of its own samples' loss (its weights reach no other
    rank's samples)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from tests.sharding.test_sharded_vbe import SAMPLES, _bags, _local_kjt

    configs = _configs(True)
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, is_weighted=True, device=device())
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(torch.optim.SGD, to_shard.parameters(), {"lr": 0.3})
    sharded = fbtriton_dist.shard(to_shard, _plan("mixed", world))
    bags = _bags(configs, world, 0, True)
    runs = []
    # a rank without samples (3 ranks): only the sharded module (the unsharded one's VBE
    # path takes no empty batch); its weights, read by no sample, get zeros
    for module in (ref, sharded):
        if module is ref and not SAMPLES[rank]:
            runs.append((None, None))
            continue
        mine = {f: (lengths, ids, w.clone().requires_grad_())
                for f, (lengths, ids, w) in bags[rank].items()}
        out = module(_local_kjt(configs, [*bags[:rank], mine], rank,
                                reverse=rank % 2 == 1).to(device())).values()
        proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
        (out * proj.to(out.device)).sum().backward()
        runs.append((out.detach(), {f: w.grad for f, (_, _, w) in mine.items()}))
    (out_ref, g_ref), (out, g) = runs
    if not SAMPLES[rank]:
        return max((w.abs().max().item() for w in g.values() if w is not None and w.numel()),
                   default=0.0)
    errs = [(out - out_ref).abs().max().item() if out.numel() else 0.0]
    for f, want in g_ref.items():
        if want is None:  # no bag of this feature here
            errs.append(0.0 if g[f] is None or not g[f].any() else float("inf"))
        elif want.numel():
            errs.append(float("inf") if g[f] is None else (g[f] - want).abs().max().item())
    return max(errs)


@pytest.mark.parametrize("world", [2, 3])
def test_per_sample_weight_gradients_of_a_vbe_batch(world):
    for rank, err in enumerate(run_ranks(_vbe_weights_grad, world)):
        assert err < 1e-5, (rank, err)
