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
    one_gather = kind in ("row_wise", "table_row_wise", "table_wise") and same_dim
    assert sharded.output_dist_.one_slice_of_one_dim == one_gather, kind
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
        # the sharded tables' gradients are divided by R: the reference's loss too
        (sum(dense[n.replace("@", "_")](out_ref[n].values()).sum() for n in names)
         / world).backward()
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
            g /= world  # averaged, as DDP does
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
    # (sharding kind, optimizer, TorchRec's module and one D): rowwise Adagrad on column slices keeps
    # one accumulator per slice, so column / grid use per-element optimizers
    ("row_wise", "rowwise_adagrad", False),
    ("table_wise", "sgd", False),
    ("column_wise", "adagrad", False),
    ("table_row_wise", "rowwise_adagrad", False),
    ("grid_shard", "sgd", False),
    ("data_parallel", "rowwise_adagrad", False),
    ("mixed", "adagrad", False),
    ("mixed", "sgd", True),
    # one D everywhere and one column slice per table: the output dist's single gather
    ("row_wise", "rowwise_adagrad", True),
    ("table_row_wise", "sgd", True),
]


def _all_cases(rank, world):
    return {case: _sharded_vs_unsharded(rank, world, *case) for case in CASES}


def _on_world(rank, world):
    """What the world-size tests check, on one start-up of the ranks: every case sharded vs
    unsharded, a model with an EBC and an EC under one plan, the comm report's rows per id."""
    return _all_cases(rank, world), _ebc_and_ec(rank, world), _ec_traffic(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_ec_matches_unsharded_with_an_ebc_beside_it_and_counts_its_rows(world):
    """One start-up of the ranks per world size for three checks (each below)."""
    cases, both, traffic = zip(*run_ranks(_on_world, world), strict=True)
    _check_sharded_ec_matches_unsharded(cases)
    _check_a_model_with_an_ebc_and_an_ec_shards_both_with_one_plan(both)
    _check_ec_comm_report_counts_a_row_per_id(traffic)


def _check_sharded_ec_matches_unsharded(per_rank):
    for rank, reports in enumerate(per_rank):
        assert set(reports) == set(CASES)
        for case, report in reports.items():
            for key, err in report.items():
                assert err < 2e-5, f"rank {rank} {case} {key}: {err}"


# -- an EBC and an EC in one model, one plan --------------------------------------------------
class _TwoCollections(torch.nn.Module):
    """Pooled features through the EBC, sequences through the EC, on one KJT."""

    def __init__(self, ebc, ec, dims):
        super().__init__()
        self.ebc, self.ec = ebc, ec
        g = torch.Generator().manual_seed(4)
        self.pooled_proj = torch.nn.Parameter(torch.randn(sum(dims["pooled"]), generator=g))
        self.row_proj = torch.nn.ParameterDict({
            n.replace("@", "_"): torch.nn.Parameter(torch.randn(D, generator=g))
            for n, D in dims["rows"]
        })

    def forward(self, kjt):
        pooled = self.ebc(kjt).values()
        rows = self.ec(kjt)
        per_sample = pooled @ self.pooled_proj
        row_terms = sum((jt.values() @ self.row_proj[n.replace("@", "_")]).sum()
                        for n, jt in rows.items())
        return per_sample, rows, per_sample.sum() + row_terms


def _ebc_and_ec_models(rank, world, copies=1):
    """The unsharded EBC + EC model, its collections, ``copies`` sharded copies and the
    test's batch split."""
    import dataclasses

    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from tests.sharding.test_sharded_ebc import _configs as _bag_configs

    dev = device()
    bags = _bag_configs(False)
    seqs = _configs(False)
    for c in seqs:
        c.name = f"s_{c.name}"
    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=bags, device=dev)
    ec = fbtriton_dist.EmbeddingCollection(tables=seqs, device=dev)
    dims = {"pooled": [c.embedding_dim for c in bags for _ in c.feature_names],
            "rows": list(zip(ec._embedding_names,
                             [c.embedding_dim for c in seqs for _ in c.feature_names],
                             strict=True))}
    ref = _TwoCollections(ebc, ec, dims)
    cls, kwargs = _optimizer("adagrad")
    apply_optimizer_in_backward(cls, [*ebc.parameters(), *ec.parameters()], kwargs)
    bag_plan = _plan("mixed", world)
    seq_plan = _plan("row_wise", world)  # the same shapes, every sequence table row-wise
    plan = dataclasses.replace(bag_plan, tables=bag_plan.tables + tuple(
        dataclasses.replace(ts, name=f"s_{ts.name}") for ts in seq_plan.tables))
    models = []
    for _ in range(copies):
        model = copy.deepcopy(ref)
        apply_optimizer_in_backward(cls, [*model.ebc.parameters(), *model.ec.parameters()],
                                    kwargs)
        models.append(fbtriton_dist.shard(model, plan, device=dev))
    return ref, (ebc, ec), models, bags + seqs


def _pipelined_ebc_and_ec(rank, world):
    """The EBC + EC model trained by TrainPipeline (the next batch's input dists run ahead)
    and by a plain loop from the same start: the same losses and weights."""
    from fbtriton_dist.sharding import TrainPipeline
    from tests.sharding.test_lean import _Batch

    _, _, (plain, piped), configs = _ebc_and_ec_models(rank, world, copies=2)
    sizes = BATCH[:world]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    batches = [_Batch(torch.zeros(hi - lo, 1), _kjt(*_feature_batch(configs, sum(sizes), s),
                                                     lo, hi), torch.zeros(hi - lo))
               for s in range(4)]
    plain_losses = []
    for b in batches:
        loss = plain(b.sparse.to(device()))[2]
        loss.backward()
        plain_losses.append(loss.detach())
    pipe = TrainPipeline(piped, None, device(), loss_fn=lambda m, b: m(b.sparse)[2])
    it, piped_losses = iter(batches), []
    while True:
        try:
            piped_losses.append(pipe.progress(it))
        except StopIteration:
            break
    report = {"losses": max(abs(float(a - b)) for a, b in
                            zip(plain_losses, piped_losses, strict=True)),
              "count": float(len(piped_losses) != len(batches))}
    for name in ("ebc", "ec"):
        a = getattr(plain, name).gather_full_state_dict()
        b = getattr(piped, name).gather_full_state_dict()
        report[f"weights.{name}"] = max((a[k] - b[k]).abs().max().item() for k in a)
    return report


def test_train_pipeline_runs_an_ebc_and_an_ec_ahead_like_the_plain_loop():
    for rank, report in enumerate(run_ranks(_pipelined_ebc_and_ec, 2)):
        for key, err in report.items():
            assert err == 0.0, f"rank {rank} {key}: {err}"


def _ebc_and_ec(rank, world):
    ref, (ebc, ec), (model,), configs = _ebc_and_ec_models(rank, world)
    kinds = (type(model.ebc).__name__, type(model.ec).__name__)
    assert kinds == ("ShardedEmbeddingBagCollection", "ShardedEmbeddingCollection"), kinds
    dev = device()
    sizes = BATCH[:world]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    report = {}
    for step in range(3):
        batch = _feature_batch(configs, sum(sizes), step)
        want_pooled, want_rows, want_loss = ref(_kjt(*batch, 0, sum(sizes)).to(dev))
        (want_loss / world).backward()  # the sharded gradients are divided by R
        got_pooled, got_rows, got_loss = model(_kjt(*batch, lo, hi).to(dev))
        got_loss.backward()
        report[f"step{step}.pooled"] = (got_pooled - want_pooled[lo:hi]).abs().max().item()
        report[f"step{step}.rows"] = max(
            ((jt.values() - _rows_of(want_rows[n], lo, hi)[0]).abs().max().item()
             if jt.values().numel() else 0.0) for n, jt in got_rows.items())
        grads = [p.grad.clone() for p in (model.pooled_proj, *model.row_proj.values())]
        for g in grads:
            dist.all_reduce(g)
            g /= world
        wants = [ref.pooled_proj.grad, *(p.grad for p in ref.row_proj.values())]
        report[f"step{step}.dense_grad"] = max(
            (a - b).abs().max().item() for a, b in zip(grads, wants, strict=True))
        for m in (ref, model):
            m.zero_grad()
    for sharded, unsharded in ((model.ebc, ebc), (model.ec, ec)):
        full = sharded.gather_full_state_dict()
        report[f"weights.{type(sharded).__name__}"] = max(
            (full[k].float() - v.float()).abs().max().item()
            for k, v in unsharded.state_dict().items())
    return report


def _check_a_model_with_an_ebc_and_an_ec_shards_both_with_one_plan(per_rank):
    for rank, report in enumerate(per_rank):
        for key, err in report.items():
            assert err < 2e-5, f"rank {rank} {key}: {err}"


def test_a_plan_table_that_no_collection_holds_is_refused():
    import dataclasses

    import fbtriton_dist

    ec = fbtriton_dist.EmbeddingCollection(tables=_configs(False), device="meta")
    plan = _plan("table_wise", 1)
    extra = dataclasses.replace(plan.tables[0], name="nowhere")
    model = torch.nn.Sequential(ec)
    with pytest.raises(ValueError, match=r"plan: table\(s\) \['nowhere'\] are in no embedding"):
        fbtriton_dist.shard(model, dataclasses.replace(plan, tables=(*plan.tables, extra)),
                            optimizer=fbtriton_dist.optim.SGD())


# -- checkpoints, bad input, traffic -----------------------------------------------------------
GLOBAL_B = 10
SPLITS = {2: [5, 5], 3: [3, 5, 2]}


def _ec_model(world, kind="mixed"):
    import fbtriton_dist

    torch.manual_seed(0)
    ec = fbtriton_dist.EmbeddingCollection(tables=_configs(False), device=device())
    return fbtriton_dist.shard(ec, _plan(kind, world), device=device(),
                               optimizer=fbtriton_dist.optim.Adagrad(lr=0.2))


def _ec_step(sharded, rank, world, step):
    sizes = SPLITS[world]
    lo = sum(sizes[:rank])
    out = sharded(_kjt(*_feature_batch(_configs(False), GLOBAL_B, step), lo,
                       lo + sizes[rank]).to(device()))
    g = torch.Generator().manual_seed(50 + step)
    loss = sum((jt.values() * torch.randn(jt.values().shape[1], generator=g)).sum()
               for jt in out.values())
    (loss * world).backward()  # the gradients are divided by R: the same step on any R


def _ec_save(rank, world, path):
    import torch.distributed.checkpoint as dcp

    sharded = _ec_model(world)
    for step in range(2):
        _ec_step(sharded, rank, world, step)
    sd = sharded.state_dict()
    assert list(sd) == [f"embeddings.{c.name}.weight" for c in _configs(False)]
    dcp.save({"model": sd, "fused": sharded.fused_optimizer_state_dict()}, checkpoint_id=path)
    _ec_step(sharded, rank, world, 2)
    full = {k: v.cpu() for k, v in sharded.gather_full_state_dict().items()}
    if rank == 0:
        torch.save(full, f"{path}/expected.pt")


def _ec_load(rank, world, path):
    import torch.distributed.checkpoint as dcp

    sharded = _ec_model(world)
    state = {"model": sharded.state_dict(), "fused": sharded.fused_optimizer_state_dict()}
    dcp.load(state, checkpoint_id=path)
    sharded.load_state_dict(state["model"])
    sharded.load_fused_optimizer_state_dict(state["fused"])
    _ec_step(sharded, rank, world, 2)  # the same third step: equal only if the state came back
    expected = torch.load(f"{path}/expected.pt", weights_only=True)
    full = sharded.gather_full_state_dict()
    return max((full[k].cpu() - v).abs().max().item() for k, v in expected.items())


def test_ec_dcp_save_on_2_ranks_load_resharded_on_3(tmp_path):
    run_ranks(_ec_save, 2, str(tmp_path))
    errors = run_ranks(_ec_load, 3, str(tmp_path))
    assert max(errors) < 1e-6, errors


def _ec_loads_torchrec_state(rank, world):
    import torchrec

    import fbtriton_dist

    torch.manual_seed(5)
    theirs = torchrec.EmbeddingCollection(tables=_configs(True))
    ours = fbtriton_dist.shard(fbtriton_dist.EmbeddingCollection(tables=_configs(True)),
                               _plan_for("mixed", world, True),
                               optimizer=fbtriton_dist.optim.SGD())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    full = ours.gather_full_state_dict()
    return max((full[k] - v).abs().max().item() for k, v in theirs.state_dict().items())


def test_a_full_torchrec_ec_state_dict_loads_into_shards():
    assert max(run_ranks(_ec_loads_torchrec_state, 2)) == 0.0


def _ec_bad_id(rank, world):
    from torchrec import KeyedJaggedTensor

    sharded = _ec_model(world)
    names = list(dict.fromkeys(f for c in _configs(False) for f in c.feature_names))
    values = torch.zeros(len(names), dtype=torch.int64)
    if rank == 1:
        values[names.index("f_cw")] = 9  # table 'cw' has 9 rows
    kjt = KeyedJaggedTensor(keys=names, values=values,
                            lengths=torch.ones(len(names), dtype=torch.int64))
    sharded(kjt.to(device()))


def test_a_bad_id_on_one_rank_stops_every_rank():
    with pytest.raises(RuntimeError) as info:
        run_ranks(_ec_bad_id, 3, timeout=120)
    text = str(info.value)
    assert "id 9 of feature 'f_cw' (sample 0) is out of range for table 'cw' with 9 rows" in text
    assert text.count("rank(s) [1] found bad input") == 2


def _ec_traffic(rank, world):
    sharded = _ec_model(world, "row_wise")
    sizes = SPLITS[world]
    lo = sum(sizes[:rank])
    batch = _feature_batch(_configs(False), GLOBAL_B, 0)
    _ec_step(sharded, rank, world, 0)
    feats, lengths, values, _ = batch
    # rows of my ids that live on another rank: each comes back as D fp32 values
    expected = 0
    for c in _configs(False):
        for f in c.feature_names:
            a, b = int(lengths[f][:lo].sum()), int(lengths[f][: lo + sizes[rank]].sum())
            ids = values[f][a:b]
            for s in sharded.plan.table(c.name).shards:
                if s.rank != rank:
                    hit = (ids >= s.row_start) & (ids < s.row_end)
                    expected += 4 * c.embedding_dim * int(hit.sum())
    return sharded.comm_report(), expected


def _check_ec_comm_report_counts_a_row_per_id(results):
    reports = [r for r, _ in results]
    for rank, (report, expected) in enumerate(results):
        assert report["output_dist.forward"]["received"] == expected, rank
        assert report["output_dist.backward"]["sent"] == expected, rank
    for key in ("output_dist.forward", "output_dist.backward", "input_dist.data"):
        assert sum(r[key]["sent"] for r in reports) == sum(r[key]["received"] for r in reports)
