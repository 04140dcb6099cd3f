"""TorchRec's train pipelines over a DistributedModelParallel that holds our collections, on 2
gloo ranks: ``TrainPipelineSparseDist``, ``TrainPipelineSemiSync`` and
``PrefetchTrainPipelineSparseDist`` each train the same model twice from the same weights on
the same batches, once over TorchRec's own EmbeddingBagCollection (EmbeddingCollection)
sharded by TorchRec's sharder and once over ours sharded by ours, with the same plan
(table-wise, row-wise, column-wise) and SGD fused into the backward on both (so the
gradient division of both is compared too). The 5 steps' losses must agree within 1e-5 (the
semi-sync pipeline's embeddings lag a step behind the update on both sides alike). A
pipeline that fails over TorchRec's own modules here (CPU, no CUDA streams) is skipped,
naming where TorchRec failed; our side then does not run. Under ``FBTD_DIST_BACKEND=nccl`` the
same runs on GPUs (one rank per GPU: 2 ranks, or 1 on a one-GPU machine), where every pipeline
must run."""

import copy

import pytest
import torch

from tests.sharding.harness import backend, device, run_ranks

B = 4  # samples per rank and step
STEPS = 5
DENSE = 3
PIPELINES = ("TrainPipelineSparseDist", "TrainPipelineSemiSync",
             "PrefetchTrainPipelineSparseDist")
LIMITS = {  # why a pipeline fails over TorchRec's own modules without CUDA (TorchRec 1.8)
    "TrainPipelineSemiSync": "its embedding lookup calls Batch.record_stream on the CPU's "
                             "current stream, which CPU tensors refuse",
    "PrefetchTrainPipelineSparseDist": "prefetch_embeddings returns at once without a data "
                                       "dist stream, so the forward finds no prefetched input",
}


def _tables(kind):
    from torchrec import EmbeddingBagConfig, EmbeddingConfig

    cls = EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    return [
        cls(name="tw", num_embeddings=7, embedding_dim=4, feature_names=["f_tw"]),
        cls(name="rw", num_embeddings=11, embedding_dim=4, feature_names=["f_rw1", "f_rw2"]),
        cls(name="cw", num_embeddings=6, embedding_dim=4, feature_names=["f_cw"]),
    ]


class _EBCModel(torch.nn.Module):
    """Pooled embeddings and dense features through a Linear, BCE loss (TorchRec's pipelines
    take ``(loss, output)``)."""

    def __init__(self, ebc, features):
        super().__init__()
        self.ebc = ebc
        self.top = torch.nn.Linear(4 * len(features) + DENSE, 1)

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.top(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, logits.detach()


class _ECModel(torch.nn.Module):
    """Each feature's rows (one per id) against its own weight vector, summed per batch."""

    def __init__(self, ec, features):
        super().__init__()
        self.ec, self.features = ec, list(features)
        self.w = torch.nn.Linear(4, len(self.features), bias=False)

    def forward(self, batch):
        rows = self.ec(batch.sparse_features)
        loss = batch.dense_features.sum() * 0.0
        for i, f in enumerate(self.features):
            loss = loss + (self.w(rows[f].values())[:, i]).sum() / B
        return loss, loss.detach()


def _batches(features, tables, rank):
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    rows = {f: c.num_embeddings for c in tables for f in c.feature_names}
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * rank + step)
        lengths = torch.randint(0, 3, (len(features) * B,), generator=g)
        values = torch.cat([torch.randint(0, rows[f], (int(n),), generator=g)
                            for f, n in zip(features, lengths.view(len(features), B).sum(1),
                                            strict=True)])
        kjt = KeyedJaggedTensor(keys=list(features), values=values, lengths=lengths)
        out.append(Batch(dense_features=torch.randn(B, DENSE, generator=g), sparse_features=kjt,
                         labels=torch.randint(0, 2, (B,), generator=g).float()))
    return out


def _world() -> int:
    """2 ranks on gloo; under NCCL one per GPU, at most 2."""
    if backend() != "nccl":
        return 2
    return max(1, min(2, torch.cuda.device_count()))


def _plan(module, sharder, fqn, world):
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan

    per_table = {"tw": sp.table_wise(rank=world - 1), "rw": sp.row_wise(),
                 "cw": sp.column_wise(ranks=list(range(world)))}
    plan = sp.construct_module_sharding_plan(module, per_table, sharder=sharder,
                                             local_size=world, world_size=world,
                                             device_type=device().type)
    return ShardingPlan({fqn: plan})


def _copy_into(dmp, full):
    """Every tensor of ``full`` (unsharded, TorchRec's keys) into DMP's state: this rank's
    pieces of a ShardedTensor, the whole of anything else."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            whole = full[key.removeprefix("module.")]
            if isinstance(value, ShardedTensor):
                for piece in value.local_shards():
                    (r, c), (n, m) = piece.metadata.shard_offsets, piece.metadata.shard_sizes
                    piece.tensor.copy_(whole[r : r + n, c : c + m])
            else:
                value.copy_(whole)


def _losses(rank, world, kind, side, pipeline_name, reference_state):
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import train_pipelines as tp
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding import dmp as ours

    tables = copy.deepcopy(_tables(kind))
    features = [f for c in tables for f in c.feature_names]
    ebc = kind == "ebc"
    fqn = "ebc" if ebc else "ec"
    model_cls = _EBCModel if ebc else _ECModel
    if side == "torchrec":
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        module = (torchrec.EmbeddingBagCollection if ebc else torchrec.EmbeddingCollection)(
            tables=tables)
        sharder = EmbeddingBagCollectionSharder() if ebc else EmbeddingCollectionSharder()
    else:
        module = (fbtriton_dist.EmbeddingBagCollection if ebc
                  else fbtriton_dist.EmbeddingCollection)(tables=tables)
        sharder = (ours.EmbeddingBagCollectionSharder(local_world_size=world) if ebc
                   else ours.EmbeddingCollectionSharder(local_world_size=world))
    model = model_cls(module, features)
    model.load_state_dict(reference_state)
    apply_optimizer_in_backward(torch.optim.SGD, getattr(model, fqn).parameters(), {"lr": 0.5})
    dmp = DistributedModelParallel(model, sharders=[sharder],
                                   plan=_plan(getattr(model, fqn), sharder, fqn, world),
                                   device=device())
    _copy_into(dmp, reference_state)
    dense = [p for n, p in dmp.named_parameters() if fqn + "." not in n]
    opt = torch.optim.SGD(dense, lr=0.5)
    pipeline = getattr(tp, pipeline_name)(dmp, opt, device())
    it, losses = iter(_batches(features, tables, rank)), []
    for _ in range(STEPS):
        out = pipeline.progress(it)
        losses.append(float(out.sum()) if ebc else float(out))
    return losses


def _both_sides(rank, world, kind, pipeline_name):
    torch.manual_seed(0)
    import torchrec

    tables = _tables(kind)
    features = [f for c in tables for f in c.feature_names]
    module = (torchrec.EmbeddingBagCollection if kind == "ebc" else torchrec.EmbeddingCollection)(
        tables=tables)
    reference = (_EBCModel if kind == "ebc" else _ECModel)(module, features)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    try:
        want = _losses(rank, world, kind, "torchrec", pipeline_name, state)
    except (RuntimeError, AssertionError) as e:  # TorchRec's modules in its own pipeline
        import traceback

        frames = [f for f in traceback.extract_tb(e.__traceback__) if "torchrec" in f.filename]
        where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}"
        return {"torchrec_fails": f"{type(e).__name__}: {str(e)[:120]} (at {where})"}
    return {"torchrec": want,
            "ours": _losses(rank, world, kind, "ours", pipeline_name, state)}


@pytest.mark.parametrize("pipeline_name", PIPELINES)
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_torchrec_pipeline_over_ours_matches_it_over_torchrec(kind, pipeline_name):
    results = run_ranks(_both_sides, _world(), kind, pipeline_name)
    failed = [r["torchrec_fails"] for r in results if "torchrec_fails" in r]
    if failed and pipeline_name in LIMITS and backend() != "nccl":
        pytest.skip(f"TorchRec 1.8's {pipeline_name} cannot run TorchRec's own modules on "
                    f"CPU/gloo (it needs CUDA streams: {LIMITS[pipeline_name]}): {failed[0]}")
    if failed and kind == "ec" and "embedding_forward_split" in failed[0]:
        pytest.skip("TorchRec's EmbeddingCollection needs FBGEMM's sequence (pooling NONE) "
                    f"CUDA kernels, which this FBGEMM build lacks: {failed[0]}")
    assert not failed, failed  # TrainPipelineSparseDist runs TorchRec's modules on CPU; all on GPU
    for rank, losses in enumerate(results):
        want, got = losses["torchrec"], losses["ours"]
        assert len(got) == len(want) == STEPS
        assert len({round(x, 6) for x in want}) == STEPS, want  # no constant or repeated loss
        for step, (a, b) in enumerate(zip(want, got, strict=True)):
            assert abs(a - b) <= 1e-5, f"rank {rank} {pipeline_name} step {step}: {a} vs {b}"


def _cached_vs_device(rank, world):
    """TorchRec's ``TrainPipelineSparseDist`` over DMP holding our collection, its tables on
    ``device`` and then on ``cached`` (half-size caches that evict): the losses, full weights
    and the caches' counts."""
    import dataclasses

    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.train_pipeline import train_pipelines as tp
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding import dmp as ours
    from fbtriton_dist.storage import Storage

    tables = [dataclasses.replace(c, num_embeddings=40) for c in _tables("ebc")]
    features = [f for c in tables for f in c.feature_names]
    out, initial = [], None
    for storage in (None, Storage(tier="cached", cache_load_factor=0.5)):
        torch.manual_seed(0)
        module = fbtriton_dist.EmbeddingBagCollection(
            tables=copy.deepcopy(tables), device=device(),
            storage={c.name: storage for c in tables} if storage else None)
        # (on CUDA a cached table draws its rows on the host's generator, device on the GPU's)
        initial = initial or {k: v.cpu().clone() for k, v in module.state_dict().items()}
        module.load_state_dict(initial)
        sharder = ours.EmbeddingBagCollectionSharder(local_world_size=world)
        torch.manual_seed(1)  # the dense layer alike (the draws above use other generators)
        model = _EBCModel(module, features)
        apply_optimizer_in_backward(torch.optim.Adam, model.ebc.parameters(), {"lr": 0.5})
        dmp = DistributedModelParallel(model, sharders=[sharder],
                                       plan=_plan(model.ebc, sharder, "ebc", world),
                                       device=device())
        opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "ebc." not in n], lr=0.5)
        pipeline = tp.TrainPipelineSparseDist(dmp, opt, device())
        it = iter(_batches(features, tables, rank))
        losses = [float(pipeline.progress(it).sum()) for _ in range(STEPS)]
        sharded = dmp.module.ebc.sharded
        evictions = sum(s["evictions"] for s in sharded.cache_stats().values())
        out.append((losses, sharded.gather_full_state_dict(), evictions))
    (want, full_d, _), (got, full_c, evicted) = out
    return want, got, all(torch.equal(full_d[k], full_c[k]) for k in full_d), evicted


def test_torchrec_pipeline_trains_cached_tables_as_device_bit_for_bit():
    """TorchRec's pipeline runs the next batch's input dist during the step: cached shards
    (rows evicted and written back) train as on ``device``, bit for bit."""
    results = run_ranks(_cached_vs_device, _world())
    for rank, (want, got, same, _) in enumerate(results):
        assert got == want and same, (rank, want, got)
        assert len({round(x, 6) for x in want}) == STEPS, want
    assert sum(r[3] for r in results) > 0
