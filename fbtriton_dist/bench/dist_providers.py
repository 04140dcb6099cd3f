"""The providers of ``bench dist``: one sharded training step each, on the same model.

* ``torchrec``: TorchRec's DistributedModelParallel, FBGEMM's fused TBE
  (EXACT_ROWWISE_ADAGRAD), the plan's placement given shard for shard; dense parameters under
  its DDP; a plain loop.
* ``ours_plain``: ``fbtriton_dist.shard(model, plan)`` with default options; a plain loop.
* ``ours_lean``: ``shard(..., comm=CommOptions())`` +
  ``fbtriton_dist.sharding.pipeline.TrainPipeline``;
  ``ours_lean_bf16``: the same with ``wire_dtype=torch.bfloat16``; ``ours_dedup``: with
  ``dedup=True``; ``ours_fixed``: with ``fixed_shapes=True`` (no host sync in the step);
  ``ours_graph``: fixed shapes and ``TrainPipeline(cuda_graph=True, overlap_input=False)``,
  the whole step one CUDA graph replay (on the CPU the same steps run eagerly);
  ``ours_graph_overlap``: that with ``overlap_input=True``, the pipeline's default (the
  replay also runs the next batch's input dist on a side stream); ``ours_graph_bf16``:
  ``ours_graph`` with
  ``wire_dtype=torch.bfloat16`` (TorchRec's wire stays fp32: not a like-for-like ratio).

A peer that is not importable here (TorchRec, FBGEMM) raises :class:`Skip` with the reason; our
own providers never skip: an error in our code (an import error included) is the provider's
error, and fails the run (``bench dist`` exits non-zero). The dense optimizer is
SGD for everyone (model ``dcnv2`` too: ``dist_dcnv2`` says how its TorchRec and our models
start from the same weights); ours all-reduces (averages) dense gradients in an optimizer
pre-step hook, so a pipeline that calls ``optimizer.step()`` itself does it too (averaging twice
is harmless).
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fbtriton_dist.planner import ShardingPlan
from fbtriton_dist.train.data import Batch
from fbtriton_dist.train.loop import allreduce_mean

from .dist_report import PROVIDERS
from .dist_setup import ModelSpec, Table, build_model, embedding_fqn, torchrec_module_plan


class Skip(Exception):
    """A peer cannot run here (its package is not importable); the message says why. Never
    raised for our own providers."""


@dataclass(kw_only=True)
class Context:
    """Everything a provider is built from (the same for every provider of one measurement)."""

    tables: Sequence[Table]
    configs: list
    """The tables' configs: ``EmbeddingBagConfig``, or ``EmbeddingConfig`` for model ``ec``."""
    plan: ShardingPlan
    spec: ModelSpec
    batches: Sequence[Batch]
    grad: torch.Tensor | None
    device: torch.device
    group: Any
    seed: int
    lr: float
    eps: float
    dense_lr: float
    comm_extra: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Runner:
    """A built provider: ``step()`` trains on the next batch and returns the (detached) loss."""

    name: str
    model: nn.Module
    """What the loop calls: the TrainModel (ours) or the DistributedModelParallel."""
    step: Callable[[], torch.Tensor]
    sharded: nn.Module | None
    """Our sharded collection (has ``comm_report``), None for TorchRec."""
    loop: str
    """``plain``, ``pipeline`` or ``pipeline_worker`` (CPU: the next batch's input dist on a
    worker thread, overlapping the step)."""
    dense_numel: int
    notes: list[str] = field(default_factory=list)


def fresh(batch: Batch) -> Batch:
    """``batch`` with a new KeyedJaggedTensor over the same device tensors: no lengths per key
    or offsets cached from an earlier step, as a data loader hands them over (a VBE batch keeps
    its strides and inverse indices)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = batch.sparse
    vbe = {}
    if kjt.variable_stride_per_key():
        vbe = {"stride_per_key_per_rank": kjt.stride_per_key_per_rank(),
               "inverse_indices": kjt.inverse_indices()}
    sparse = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), **vbe)
    return Batch(dense=batch.dense, sparse=sparse, labels=batch.labels)


def batch_stream(batches: Sequence[Batch]):
    """The batches in order, cycled forever: step k trains on ``fresh(batches[k % n])``."""
    return (fresh(batches[k % len(batches)]) for k in itertools.count())


def loss_of(out) -> torch.Tensor:
    """The loss in a model / pipeline output: TorchRec's ``(loss, ...)`` or a tensor."""
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out.detach()


def _dense_optimizer(params: list[nn.Parameter], ctx: Context, allreduce: bool):
    """SGD over ``params`` (a dummy one when there are none: a pipeline wants an optimizer)."""
    if not params:
        return torch.optim.SGD([nn.Parameter(torch.zeros(1, device=ctx.device))], lr=0.0)
    opt = torch.optim.SGD(params, lr=ctx.dense_lr)
    if allreduce:
        opt.register_step_pre_hook(lambda *_: allreduce_mean(params, ctx.group))
    return opt


def _plain_step(model: nn.Module, opt, stream) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        loss = model(next(stream))[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()  # the embedding rows are updated here (fused optimizer)
        opt.step()
        return loss.detach()

    return step


# -- ours -------------------------------------------------------------------------------------
LEAN_OPTIONS: dict[str, dict[str, Any]] = {
    "ours_lean": {},
    "ours_lean_bf16": {"wire_dtype": torch.bfloat16},
    "ours_dedup": {"dedup": True},
    "ours_fixed": {"fixed_shapes": True},
    "ours_graph": {"fixed_shapes": True},
    "ours_graph_overlap": {"fixed_shapes": True},
    "ours_graph_bf16": {"fixed_shapes": True, "wire_dtype": torch.bfloat16},
}
PIPELINE_OPTIONS: dict[str, dict[str, Any]] = {
    "ours_graph": {"cuda_graph": True, "overlap_input": False},
    "ours_graph_overlap": {"cuda_graph": True, "overlap_input": True},
    "ours_graph_bf16": {"cuda_graph": True, "overlap_input": False},
}


def build_ours(name: str, ctx: Context) -> Runner:
    import fbtriton_dist
    from fbtriton_dist import optim
    from fbtriton_dist.modules.ebc import EmbeddingBagCollection

    kwargs: dict[str, Any] = {"optimizer": optim.RowWiseAdagrad(lr=ctx.lr, eps=ctx.eps)}
    pipeline_cls = None
    if name != "ours_plain":  # our own code: an import error here fails the provider, never skips
        from fbtriton_dist.sharding import CommOptions, TrainPipeline

        kwargs["comm"] = CommOptions(**{**LEAN_OPTIONS[name], **ctx.comm_extra})
        pipeline_cls = TrainPipeline
    torch.manual_seed(ctx.seed)
    if ctx.spec.kind == "ec":
        from fbtriton_dist.modules.ec import EmbeddingCollection

        collection = EmbeddingCollection(tables=ctx.configs, device=torch.device("meta"))
    else:
        collection = EmbeddingBagCollection(tables=ctx.configs, device=torch.device("meta"))
    model = build_model(ctx.spec, collection, ctx.device, ctx.grad, ours=True, seed=ctx.seed)
    model = fbtriton_dist.shard(model, ctx.plan, ctx.group, ctx.device, **kwargs)
    model = model.to(ctx.device)  # buffers the model made on the CPU (DLRM's triu_indices)
    fqn = embedding_fqn(ctx.spec.kind, ours=True)
    sharded = model.get_submodule(fqn)
    if ctx.spec.kind == "dcnv2":  # TorchRec's initial rows too
        from .dist_dcnv2 import fill_ours

        fill_ours(sharded, ctx.tables, ctx.seed)
    params = [
        p for n, p in model.named_parameters() if p.requires_grad and not n.startswith(fqn + ".")
    ]
    opt = _dense_optimizer(params, ctx, allreduce=True)
    stream = batch_stream(ctx.batches)
    if pipeline_cls is None:
        step, loop = _plain_step(model, opt, stream), "plain"
    else:
        pipe = pipeline_cls(model, opt, ctx.device, **PIPELINE_OPTIONS.get(name, {}))

        def step() -> torch.Tensor:
            return loss_of(pipe.progress(stream))

        # CPU: the next batch's input dist on the pipeline's worker thread, during the step
        loop = "pipeline" if pipe.worker is None else "pipeline_worker"
    return Runner(
        name=name,
        model=model,
        step=step,
        sharded=sharded,
        loop=loop,
        dense_numel=sum(p.numel() for p in params),
    )


# -- TorchRec ---------------------------------------------------------------------------------
def build_torchrec(ctx: Context) -> Runner:
    try:
        import torchrec
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.types import ShardingEnv
        from torchrec.distributed.types import ShardingPlan as TorchRecPlan
        from torchrec.optim.optimizers import in_backward_optimizer_filter
    except ImportError as e:
        raise Skip(f"TorchRec / FBGEMM not importable: {e}") from e
    torch.manual_seed(ctx.seed)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": ctx.lr,
             "eps": ctx.eps}
    if ctx.spec.kind == "ec":
        ebc = torchrec.EmbeddingCollection(tables=ctx.configs, device=torch.device("meta"))
        sharder = EmbeddingCollectionSharder(fused_params=fused)
    else:
        ebc = torchrec.EmbeddingBagCollection(tables=ctx.configs, device=torch.device("meta"))
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
    model = build_model(ctx.spec, ebc, ctx.device, ctx.grad, seed=ctx.seed)
    module_plan = torchrec_module_plan(ebc, ctx.plan, sharder, ctx.device.type)
    fqn = embedding_fqn(ctx.spec.kind)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(ctx.group),
        device=ctx.device,
        plan=TorchRecPlan({fqn: module_plan}),
        sharders=[sharder],
    )
    if ctx.spec.kind == "dcnv2":  # ours start from the same rows
        from .dist_dcnv2 import fill_torchrec

        fill_torchrec(dmp, fqn, ctx.tables, ctx.seed)
    params = [
        p
        for n, p in in_backward_optimizer_filter(dmp.named_parameters())
        if p.requires_grad and "embedding_bags" not in n and "embeddings." not in n
    ]
    opt = _dense_optimizer(params, ctx, allreduce=False)  # DMP's DDP averages them
    return Runner(
        name="torchrec",
        model=dmp,
        step=_plain_step(dmp, opt, batch_stream(ctx.batches)),
        sharded=None,
        loop="plain",
        dense_numel=sum(p.numel() for p in params),
    )


def build(name: str, ctx: Context) -> Runner:
    if name == "torchrec":
        return build_torchrec(ctx)
    if name in ("ours_plain", *LEAN_OPTIONS):
        return build_ours(name, ctx)
    raise ValueError(f"provider: expected one of {list(PROVIDERS)}, got {name!r}")


def release(device: torch.device) -> None:
    """Free what the last provider left (call after dropping every reference to it)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
