"""What a learning rate means sharded: the embedding gradients divided by the world size.

On 2 and 3 gloo ranks with uneven local batches, every rank trains a sharded copy of an
unsharded module for one fused step; the unsharded module trains on the whole global batch
with the loss as the mean over it. Each rank's loss is the sum over its own samples times
R / global batch (the mean over its samples when the batches are even: DDP's convention), so
with the gradients divided by R (``CommOptions.gradient_division``, the default) every
table's weights and optimizer state must equal the reference's, per table and so per sharding
type (row-wise, table-wise, column-wise, table-row-wise, grid, data-parallel; one plan holds
them all). With ``gradient_division=False`` the gradients of the ranks are summed: the
reference then needs its loss times R. SGD for every type; rowwise Adagrad (its accumulator is
the gradient's square: R^2 apart) for every type but the column-split ones, which keep an
accumulator per column slice (TorchRec's and FBGEMM's convention), and per-element Adagrad for
those. The EmbeddingBagCollection, the EmbeddingCollection (sequence rows) and VBE batches.
TorchRec's own DMP against ours under DMP: tests/sharding/test_dmp.py."""

import copy

import pytest
import torch

from tests.sharding.harness import device, run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _global_batch, _kjt, _optimizer, _plan

KINDS = {"rw": "row_wise", "tw": "table_wise", "cw": "column_wise", "twrw": "table_row_wise",
         "grid": "grid_shard", "dp": "data_parallel"}
"""The mixed plan: table name -> its sharding type."""
OPTIMIZERS = {"sgd": "sgd", "rowwise_adagrad": "rowwise_adagrad", "adagrad": "adagrad"}
SLICED = ("cw", "grid")  # column slices: a row-wise accumulator per slice


def _compare(ref, sharded, configs, opt_name, report, tables_key):
    """Per table: the gathered weights and this rank's optimizer state against the
    reference's (``report[<table>(<type>).weights / .state]``)."""
    full = sharded.gather_full_state_dict()
    ref_states = {}
    for tbe in ref._tbes:
        ref_states.update(zip(tbe.table_names, tbe.split_optimizer_states(), strict=True))
    local_states = [s for tbe in sharded.tbes for s in tbe.split_optimizer_states()]
    state_err: dict[str, float] = {}
    for (lt, _), states in zip(sharded.local_views(), local_states, strict=True):
        name = configs[lt.table].name
        for mine, whole in zip(states, ref_states[name], strict=True):
            piece = whole[lt.row_start : lt.row_end]
            if whole.dim() == 2:
                piece = piece[:, lt.col_start : lt.col_end]
            err = (mine - piece).abs().max().item() if mine.numel() else 0.0
            state_err[name] = max(state_err.get(name, 0.0), err)
    for c in configs:
        if opt_name == "rowwise_adagrad" and c.name in SLICED:
            continue
        key = f"{tables_key}.{c.name}.weight"
        tag = f"{c.name}({KINDS[c.name]})"
        w_ref = ref.state_dict()[key]
        report[f"{tag}.weights"] = (full[key].float() - w_ref.float()).abs().max().item()
        report[f"{tag}.state"] = state_err.get(c.name, 0.0)


def _ebc_case(rank, world, opt_name, division, vbe=False):
    """One fused step of the EBC, sharded vs unsharded (``vbe``: VBE batches)."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding import CommOptions
    from tests.sharding import test_sharded_vbe as vbe_batches
    from tests.sharding.test_sharded_ebc import _configs

    configs = _configs(False)
    dev = device()
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, device=dev)
    cls, kwargs = _optimizer(opt_name)
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, _plan("mixed", world),
                                  comm=CommOptions(gradient_division=division))
    if vbe:
        sizes = vbe_batches.SAMPLES[:world]
        bags = vbe_batches._bags(configs, world, 0, False)
        global_kjt = vbe_batches._global_kjt(configs, bags, world)
        local_kjt = vbe_batches._local_kjt(configs, bags, rank, reverse=rank == 1)
    else:
        sizes = BATCH[:world]
        batch = _global_batch(configs, sum(sizes), 0, False)
        lo = sum(sizes[:rank])
        global_kjt = _kjt(*batch, 0, sum(sizes))
        local_kjt = _kjt(*batch, lo, lo + sizes[rank], reverse_keys=rank % 2 == 1)
    B_global, lo = sum(sizes), sum(sizes[:rank])
    total_D = sum(c.embedding_dim * len(c.feature_names) for c in configs)
    coef = torch.randn(B_global, total_D, generator=torch.Generator().manual_seed(7)).to(dev)
    # the reference: the mean over the global batch of each sample's <output, coef>
    scale_ref = 1.0 if division else float(world)  # off: the ranks' sum is R times it
    ((ref(global_kjt.to(dev)).values() * coef).sum() / B_global * scale_ref).backward()
    out = sharded(local_kjt.to(dev)).values()
    ((out * coef[lo : lo + sizes[rank]]).sum() * world / B_global).backward()
    report: dict[str, float] = {}
    _compare(ref, sharded, configs, opt_name, report, "embedding_bags")
    return report


def _ec_case(rank, world, opt_name, division):
    """One fused step of the EmbeddingCollection, sharded vs unsharded."""
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding import CommOptions
    from tests.sharding.test_sharded_ec import _configs, _feature_batch, _plan_for

    configs = _configs(False)
    dev = device()
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingCollection(tables=configs, device=dev)
    cls, kwargs = _optimizer(opt_name)
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, _plan_for("mixed", world, False),
                                  comm=CommOptions(gradient_division=division))
    sizes = BATCH[:world]
    B_global, lo = sum(sizes), sum(sizes[:rank])
    batch = _feature_batch(configs, B_global, 0)
    names = ref._embedding_names
    dims = [c.embedding_dim for c in configs for _ in c.feature_names]
    g = torch.Generator().manual_seed(7)
    coef = {n: torch.randn(D, generator=g).to(dev) for n, D in zip(names, dims, strict=True)}

    def total(rows):  # each id's row against its feature's coefficients
        return sum((rows[n].values() @ coef[n]).sum() for n in names)

    scale_ref = 1.0 if division else float(world)
    (total(ref(_kjt(*batch, 0, B_global).to(dev))) / B_global * scale_ref).backward()
    local = _kjt(*batch, lo, lo + sizes[rank], reverse_keys=rank % 2 == 1).to(dev)
    (total(sharded(local)) * world / B_global).backward()
    report: dict[str, float] = {}
    _compare(ref, sharded, configs, opt_name, report, "embeddings")
    return report


CASES = [
    # (collection, optimizer, gradient_division)
    *(("ebc", opt, True) for opt in OPTIMIZERS),
    ("ebc", "sgd", False),
    ("ebc", "rowwise_adagrad", False),
    *(("ec", opt, True) for opt in OPTIMIZERS),
    ("ec", "sgd", False),
    ("vbe", "sgd", True),
    ("vbe", "rowwise_adagrad", True),
    ("vbe", "sgd", False),
]


def _all_cases(rank, world):
    out = {}
    for kind, opt_name, division in CASES:
        if kind == "ec":
            out[kind, opt_name, division] = _ec_case(rank, world, opt_name, division)
        else:
            out[kind, opt_name, division] = _ebc_case(rank, world, opt_name, division,
                                                      vbe=kind == "vbe")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_one_step_equals_unsharded_on_the_global_batch_mean(world):
    for rank, reports in enumerate(run_ranks(_all_cases, world)):
        assert set(reports) == set(CASES)
        for case, report in reports.items():
            tables = {k.split(".")[0] for k in report}
            expect = {f"{t}({k})" for t, k in KINDS.items()
                      if not (case[1] == "rowwise_adagrad" and t in SLICED)}
            assert tables == expect, (case, sorted(tables))
            for key, err in report.items():
                assert err < 1e-5, f"rank {rank} {case} {key}: {err}"


def test_gradient_division_option_is_checked():
    from fbtriton_dist.sharding import CommOptions

    assert CommOptions().gradient_division is None
    with pytest.raises(ValueError, match="gradient_division: expected True, False or None"):
        CommOptions(gradient_division=1)
