"""Sharded EmbeddingCollection vs unsharded, on real gloo process groups of 2 and 3 ranks.

Every rank builds the same unsharded EmbeddingCollection (the reference: ours, tested against
TorchRec's in tests/modules/test_ec.py; one case shards TorchRec's own module) and shards a
copy with a hand-made plan (uneven row cuts, every sharding type alone and all mixed). Each
step rank r feeds its slice of a global batch (unequal local batch sizes, KJT keys in another
order on odd ranks) to the sharded module; the reference runs the whole batch in one process.
Each feature's rows, a dense layer's gradients and, after 3 fused steps, the weights and
optimizer states must agree. Then: a model mixing an EBC and an EC, DCP save on 2 ranks and
load on 3, bad ids, the comm report, the planner's estimate of the rows on the wire."""

import copy

import pytest
import torch
import torch.distributed as dist

from tests.sharding.harness import device, run_ranks
from tests.sharding.test_sharded_ebc import BATCH, _global_batch, _kjt, _optimizer, _plan
from tests.sharding.test_sharded_ebc import _state_error as _state_error_of


def _configs(same_dim: bool = False):
    """The tables of test_sharded_ebc's plans (same names and shapes), as sequence tables; a
    feature name two tables share ('f_rw': its rows from 'rw' and from 'dp'). ``same_dim``:
    every D = 4 (TorchRec's EmbeddingCollection wants one D), the plans' dims otherwise."""
    from torchrec import EmbeddingConfig

    tables = [("rw", 13, 4, ["f_rw"]), ("tw", 7, 3, ["f_tw1", "f_tw2"]), ("cw", 9, 6, ["f_cw"]),
              ("twrw", 11, 5, ["f_twrw"]), ("grid", 10, 4, ["f_grid"]), ("dp", 5, 2, ["f_rw"])]
    return [EmbeddingConfig(name=n, num_embeddings=E, embedding_dim=4 if same_dim else D,
                            feature_names=list(f)) for n, E, D, f in tables]


def _plan_for(kind, world, same_dim):
    """``test_sharded_ebc._plan`` with the dims of ``_configs(same_dim)``."""
    import dataclasses

    plan = _plan(kind, world)
    if not same_dim:
        return plan

    def wide(ts):  # every shard's columns scaled to D = 4 (column slices: 0:2, 2:4)
        D = ts.embedding_dim
        shards = tuple(dataclasses.replace(s, col_start=s.col_start * 4 // D,
                                           col_end=s.col_end * 4 // D) for s in ts.shards)
        return dataclasses.replace(ts, embedding_dim=4, shards=shards)

    return dataclasses.replace(plan, tables=tuple(wide(ts) for ts in plan.tables))


def _feature_batch(configs, B_global, step):
    """The global batch of every KJT key (each name once: a shared name is one key)."""
    feats, lengths, values, _ = _global_batch(configs, B_global, step, False)
    seen, keep = set(), []
    for f, _ in feats:
        if f in seen:
            continue
        seen.add(f)
        keep.append((f, min(E2 for f2, E2 in feats if f2 == f)))
    for f, E in keep:  # a shared name's ids must fit every table that reads it
        values[f] = values[f] % E
    return keep, lengths, values, None


def _rows_of(jt, lo, hi):
    lengths = jt.lengths()
    a, b = int(lengths[:lo].sum()), int(lengths[:hi].sum())
    return jt.values()[a:b], lengths[lo:hi]


def _sharded_vs_unsharded(rank, world, kind, opt_name, torchrec_module=False):
    import torchrec
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist

    same_dim = torchrec_module
    configs = _configs(same_dim)
    dev = device()
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingCollection(tables=configs, device=dev)
    cls, kwargs = _optimizer(opt_name)
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    names = ref._embedding_names
    dims = [c.embedding_dim for c in configs for _ in c.feature_names]
    # made before shard(): a rank's shards may draw from the global RNG, another's not
    dense = torch.nn.ModuleDict({n.replace("@", "_"): torch.nn.Linear(D, 1, device=dev)
                                 for n, D in zip(names, dims, strict=True)})
    dense_s = copy.deepcopy(dense)
    if torchrec_module:  # TorchRec's own module, its weights copied from the reference
        to_shard = torchrec.EmbeddingCollection(tables=configs, device=torch.device("cpu"))
        to_shard.load_state_dict({k: v.cpu() for k, v in ref.state_dict().items()})
    else:
        to_shard = copy.deepcopy(ref)
    apply_optimizer_in_backward(cls, to_shard.parameters(), kwargs)
    sharded = fbtriton_dist.shard(to_shard, _plan_for(kind, world, same_dim), device=dev)
    assert type(sharded).__name__ == "ShardedEmbeddingCollection"
    report = {}
    draw = torch.rand(1)  # shard() leaves the global RNG as it found it, on every rank
    every = [torch.empty(1) for _ in range(world)]
    dist.all_gather(every, draw)
    report["rng_after_shard"] = max((e - draw).abs().item() for e in every)
    sizes = BATCH[:world]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for step in range(3):
        batch = _feature_batch(configs, sum(sizes), step)
        out_ref = ref(_kjt(*batch, 0, sum(sizes)).to(dev))
        sum(dense[n.replace("@", "_")](out_ref[n].values()).sum() for n in names).backward()
        local = _kjt(*batch, lo, hi, reverse_keys=rank % 2 == 1).to(dev)
        out = sharded(local)
        assert list(out) == names
        sum(dense_s[n.replace("@", "_")](out[n].values()).sum() for n in names).backward()
        err, lengths_ok = 0.0, True
        for n in names:
            want, want_lengths = _rows_of(out_ref[n], lo, hi)
            got = out[n].values()
            lengths_ok &= torch.equal(out[n].lengths().cpu(), want_lengths.cpu())
            assert got.shape == want.shape, (n, got.shape, want.shape)
            err = max(err, (got - want).abs().max().item() if got.numel() else 0.0)
        report[f"step{step}.out"] = err
        report[f"step{step}.lengths"] = 0.0 if lengths_ok else 1.0
        grads = [p.grad.clone() for p in dense_s.parameters()]
        for g in grads:
            dist.all_reduce(g)
        report[f"step{step}.dense_grad"] = max(
            (a - p.grad).abs().max().item() for a, p in zip(grads, dense.parameters(), strict=True)
        )
        dense.zero_grad()
        dense_s.zero_grad()
    full = sharded.gather_full_state_dict()
    assert list(full) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        report[f"weights.{k}"] = (full[k].float() - v.float()).abs().max().item()
    report["state"] = _state_error_of(ref, sharded, configs)
    return report


CASES = [
    # (sharding kind, optimizer, TorchRec's module): rowwise Adagrad on column slices keeps
    # one accumulator per slice, so column / grid use per-element optimizers
    ("row_wise", "rowwise_adagrad", False),
    ("table_wise", "sgd", False),
    ("column_wise", "adagrad", False),
    ("table_row_wise", "rowwise_adagrad", False),
    ("grid_shard", "sgd", False),
    ("data_parallel", "rowwise_adagrad", False),
    ("mixed", "adagrad", False),
    ("mixed", "sgd", True),
]


def _all_cases(rank, world):
    return {case: _sharded_vs_unsharded(rank, world, *case) for case in CASES}


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_ec_matches_unsharded(world):
    for rank, reports in enumerate(run_ranks(_all_cases, world)):
        assert set(reports) == set(CASES)
        for case, report in reports.items():
            for key, err in report.items():
                assert err < 2e-5, f"rank {rank} {case} {key}: {err}"
