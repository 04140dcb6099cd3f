"""EmbeddingBagCollection's lookup as one registered op, for graphs and meta tensors.

``torch.ops.fbtriton_dist.ebc_lookup(values [N], lengths [K, B], weights [N] | None,
params, handle, order) -> [B, sum(D)]``: a KJT's tensors in its own key order, the module's
per-table weights (``embedding_bags.<t>.weight``, so that a graph sees what it reads), the
module (``handle``, from ``register``) and which KJT key each of its features reads
(``order``). The op runs the eager lookup (``EmbeddingBagCollection._lookup``), host reads
included, inside it; its fake (meta) implementation only gives the output's shape, which
depends on B alone. Its backward is the op ``ebc_lookup_backward``: the TBE backward of the
same batch (``TableBatchedEmbedding.lookup_backward``), fused optimizer updates included.

``forward`` is the module's forward under ``torch.fx`` tracing, ``torch.compile``,
``torch.export`` and on meta tensors: ``_kjt_inputs`` reads the KJT's host metadata (keys,
stride) and is an FX leaf (``torch.fx.wrap``), as TorchRec's KJT helpers are.

The handle is an int: a graph holding the op runs in the process of the module it was made
from (an exported program is not portable to another process).
"""

import itertools
import weakref

import torch
from torch import Tensor

from fbtriton_dist.modules import portable  # noqa: F401 (registers ebc_portable_lookup)
from fbtriton_dist.sparse import keyed_tensor, kjt_parts, order_batch, unorder_weights_grad

_MODULES: dict[int, weakref.ref] = {}
_NEXT = itertools.count()


def register(module) -> int:
    """A handle for ``module`` (an EmbeddingBagCollection or EmbeddingCollection: a
    ``TableGroups``), valid while it lives."""
    handle = next(_NEXT)
    _MODULES[handle] = weakref.ref(module, lambda _, h=handle: _MODULES.pop(h, None))
    return handle


def _module(handle: int, params: list[Tensor] | None = None, same_storage: bool = True):
    ref = _MODULES.get(handle)
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(
            f"fbtriton_dist: no embedding collection with handle {handle} in this process; a "
            "graph holding its lookup op runs only beside the module it was made from"
        )
    if params is not None:
        ours = module._group_params(range(len(module._table_configs)))
        if len(params) != len(ours) or any(
            (same_storage and p.data_ptr() != q.data_ptr()) or p.shape != q.shape
            for p, q in zip(params, ours, strict=False)
        ):
            raise RuntimeError(
                "fbtriton_dist: the weights given to a lookup op are not those of the module "
                f"the graph was made from (handle {handle}); trace or compile the copy itself"
            )
    return module


def traced(features) -> bool:
    """Is the forward being traced (FX, Dynamo, export), or are the features meta/fake?"""
    if isinstance(features, torch.fx.Proxy) or torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        return True
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    values = features.values()
    return values.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(values)


@torch.fx.wrap
def _kjt_inputs(features, feature_names: tuple[str, ...], weighted: bool):
    """(values, lengths [K, B], weights or None, order): host metadata only."""
    parts = kjt_parts(features, feature_names, weighted)
    keys = list(parts.keys)
    order = [keys.index(f) for f in feature_names]
    lengths = parts.lengths.reshape(len(keys), parts.batch_size)
    return parts.values, lengths, parts.weights, order


def forward(module, features):
    """``module(features)`` through the registered op: a KeyedTensor in config order."""
    portable_export = module._portable_export  # ir.encapsulate_ir_modules: for elsewhere
    names = module._config_features if portable_export else module._feature_order
    inputs = _kjt_inputs(features, tuple(names), module._is_weighted)
    values, lengths, weights, order = inputs[0], inputs[1], inputs[2], inputs[3]
    params = [module.embedding_bags[c.name].weight for c in module._embedding_bag_configs]
    if portable_export:
        out = torch.ops.fbtriton_dist.ebc_portable_lookup(
            values, lengths, weights, params, module._config_feature_tables,
            module._config_means, order, "\n".join(module._config_names),
        )
        return keyed_tensor(module._embedding_names, module._lengths_per_embedding, out)
    out = torch.ops.fbtriton_dist.ebc_lookup(
        values, lengths, weights, params, module._op_handle, order
    )
    return keyed_tensor(module._embedding_names, module._lengths_per_embedding, out)


@torch.library.custom_op("fbtriton_dist::ebc_lookup", mutates_args=())
def ebc_lookup(
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    handle: int,
    order: list[int],
) -> Tensor:
    module = _module(handle, params)
    batch = order_batch(values, lengths, weights, order)
    with torch.no_grad():
        return module._lookup(batch)


@ebc_lookup.register_fake
def _(values, lengths, weights, params, handle, order):
    module = _module(handle)
    return params[0].new_empty(
        (lengths.shape[1], sum(module._lengths_per_embedding)), dtype=torch.float32
    )


@torch.library.custom_op("fbtriton_dist::ebc_lookup_backward", mutates_args=())
def ebc_lookup_backward(
    grad: Tensor,
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    handle: int,
    order: list[int],
    psw_grad: bool,
) -> list[Tensor]:
    """[the weights' gradient ([1] if not asked for), one per table: its weight's gradient
    ``[E, D]`` (a 1-D placeholder for a table with a fused optimizer: ``ebc_fused_update``
    updates it)]. Placeholders hold one element: returns may not share storage."""
    module = _module(handle, params)
    batch = order_batch(values, lengths, weights, order)
    g_psw, g_tables = module._lookup_backward(batch, grad.contiguous(), psw_grad, update=False)
    out = [
        unorder_weights_grad(g_psw, lengths, order)
        if g_psw is not None
        else values.new_zeros(1, dtype=torch.float32)
    ]
    # (the tables' gradients are views of one flat gradient: returns may not alias)
    for g, p in zip(g_tables, params, strict=True):
        out.append(g.clone() if g is not None else p.new_zeros(1))
    return out


def _fused_tables(module) -> set[int]:
    return {
        t
        for members in module._groups.values()
        if module._fused_optimizer(members) is not None
        for t in members
    }


@ebc_lookup_backward.register_fake
def _(grad, values, lengths, weights, params, handle, order, psw_grad):
    fused = _fused_tables(_module(handle))
    out = [torch.empty_like(weights) if psw_grad else values.new_empty(1, dtype=torch.float32)]
    out += [p.new_empty(1) if t in fused else torch.empty_like(p) for t, p in enumerate(params)]
    return out


@torch.library.custom_op("fbtriton_dist::ebc_fused_update", mutates_args=("params",))
def ebc_fused_update(
    grad: Tensor,
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    handle: int,
    order: list[int],
    after: Tensor,
) -> None:
    """The fused optimizers' in-place update of their tables' rows (and states, step).
    ``after``: an output of ``ebc_lookup_backward``, which reads the rows before the update
    (a data dependency, so that no compiler runs this first).

    Functionalized (torch.compile, export) the op may be given copies of ``params``, which
    are then copied back into them: the module's rows are updated, then copied into those."""
    module = _module(handle, params, same_storage=False)
    batch = order_batch(values, lengths, weights, order)
    module._lookup_backward(batch, grad.contiguous(), False, update=True)
    ours = [module.embedding_bags[c.name].weight for c in module._embedding_bag_configs]
    with torch.no_grad():
        for p, q in zip(params, ours, strict=True):
            if p.data_ptr() != q.data_ptr():
                p.copy_(q)


@ebc_fused_update.register_fake
def _(grad, values, lengths, weights, params, handle, order, after):
    return None


def _setup_context(ctx, inputs, output):
    values, lengths, weights, params, handle, order = inputs
    ctx.handle, ctx.order, ctx.num_params = handle, order, len(params)
    ctx.weighted = weights is not None
    ctx.save_for_backward(values, lengths, weights, *params)


def _backward(ctx, grad):
    values, lengths, weights, *params = ctx.saved_tensors
    psw_grad = ctx.weighted and ctx.needs_input_grad[2]
    out = torch.ops.fbtriton_dist.ebc_lookup_backward(
        grad, values, lengths, weights, params, ctx.handle, ctx.order, psw_grad
    )
    if _fused_tables(_module(ctx.handle)):  # after the gradients, which read the old rows
        torch.ops.fbtriton_dist.ebc_fused_update(
            grad, values, lengths, weights, params, ctx.handle, ctx.order, out[0]
        )
    g_psw = out[0] if psw_grad else None
    g_params = [g if g.dim() == 2 else None for g in out[1:]]
    return None, None, g_psw, g_params, None, None


ebc_lookup.register_autograd(_backward, setup_context=_setup_context)
