"""EmbeddingBagCollection's lookup as one registered op, for graphs and meta tensors.

``torch.ops.fbtriton_dist.ebc_lookup(values [N], lengths [K, B], weights [N] | None,
params, states, spec, order) -> [B, sum(D)]``: a KJT's tensors in its own key order, the
module's per-table weights (``embedding_bags.<t>.weight``), each group's fused-optimizer state
(``TableGroups.op_states()``: step counter and momenta, the module's non-persistent buffers),
the static layout (``spec``: ``op_spec.spec_of``, a JSON string) and which KJT key each of its
features reads (``order``). The op is a function of these alone: it runs the eager lookup of
the collection rebuilt from the spec (``op_spec.skeleton``, weights-free, cached) bound to the
given tensors, host reads included; its fake (meta) implementation only gives the output's
shape, which depends on B alone. Its backward is the op ``ebc_lookup_backward`` (the TBE
backward of the same batch) and, for fused tables, ``ebc_fused_update``: the optimizer applied
in place to the rows and states it is given. So a graph holding the op (FX, ``torch.export``,
``torch.compile``) runs on a ``copy.deepcopy`` of its module, or in another process after
``torch.export.save`` / ``load``, each updating its own tensors.

``forward`` is the module's forward under ``torch.fx`` tracing, ``torch.compile``,
``torch.export`` and on meta tensors: ``_kjt_inputs`` reads the KJT's host metadata (keys,
stride) and is an FX leaf (``torch.fx.wrap``), as TorchRec's KJT helpers are.
"""

import contextlib
from typing import Optional

import torch
from torch import Tensor

from fbtriton_dist.modules import (
    op_spec,
    portable,  # noqa: F401 (registers ebc_portable_lookup)
)
from fbtriton_dist.modules.table_groups import live_collection
from fbtriton_dist.sparse import (
    KeyedJaggedTensor,
    keyed_tensor,
    kjt_parts,
    order_batch,
    unorder_weights_grad,
)


def spec(module) -> str:
    """``op_spec.spec_of(module)``, a constant of the graph under ``torch.compile``: the
    constant function takes the module's ``id`` (an int Dynamo holds as a constant; some torch
    versions refuse a module argument there)."""
    return _spec_of_id(id(module))


@torch.compiler.assume_constant_result
def _spec_of_id(key: int) -> str:
    module = live_collection(key)
    if module is None:
        raise RuntimeError(f"fbtriton_dist lookup op: no live collection has id {key}")
    return op_spec.spec_of(module)


def traced(features) -> bool:
    """Is the forward being traced (FX, Dynamo, export), or are the features meta/fake?"""
    if isinstance(features, torch.fx.Proxy) or torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        return True
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    values = features.values()
    return values.device.type == "meta" or torch._subclasses.fake_tensor.is_fake(values)


def compiling_around(module, features) -> bool:
    """Is Dynamo compiling (``torch.compile``) a lookup the registered ops cannot make: a
    collection whose lookup keeps Python state (``needs_eager_lookup``: cached tables, managed
    tables), a batch size per feature (VBE), or a fused optimizer the ops lack
    (``op_spec.OPS_LACK``)? The lookup then runs eagerly, through ``run_eagerly``: one graph
    break. (Strict ``torch.export`` then refuses the break naming the reason; non-strict export
    does not run Dynamo. Not ``is_compiling() and not is_exporting()``: torch 2.11 took that
    as false under ``torch.compile``.)"""
    return torch.compiler.is_dynamo_compiling() and (
        module.needs_eager_lookup() or features.variable_stride_per_key()
        or _lacks_ops_of_id(id(module)))


@torch.compiler.assume_constant_result
def _lacks_ops_of_id(key: int) -> bool:
    module = live_collection(key)
    return module is not None and op_spec.lacks_ops(module)


run_eagerly = torch.compiler.disable(
    lambda forward, features: forward(features),
    reason="fbtriton_dist: the lookup of cached / file tier tables or managed tables (their "
           "slot and id maps are Python state), of a batch size per feature (VBE), or with a "
           "fused optimizer the registered ops lack (counter, EMA, ensemble, global decay), "
           "runs eagerly between compiled graphs; fullgraph=True cannot hold it",
)
"""``run_eagerly(forward, features)``: ``forward(features)`` outside Dynamo's graphs."""


@torch.jit.unused
def _eager_kjt_inputs(
    features: KeyedJaggedTensor, feature_names: list[str], weighted: bool
) -> tuple[Tensor, Tensor, Optional[Tensor], list[int]]:
    parts = kjt_parts(features, feature_names, weighted)
    keys = list(parts.keys)
    order = [keys.index(f) for f in feature_names]
    lengths = parts.lengths.reshape(len(keys), parts.batch_size)
    return parts.values, lengths, parts.weights, order


@torch.fx.wrap
def _kjt_inputs(
    features: KeyedJaggedTensor, feature_names: list[str], weighted: bool
) -> tuple[Tensor, Tensor, Optional[Tensor], list[int]]:
    """(values, lengths [K, B], weights or None, order): host metadata only. TorchScript
    compiles it too (an FX graph holding it can be scripted): there, the checks are
    TorchScript's plain ones."""
    if torch.jit.is_scripting():
        keys = features.keys()
        for k in keys:
            if keys.count(k) > 1:
                raise ValueError("KeyedJaggedTensor keys must be unique")
        order = [keys.index(f) for f in feature_names]
        lengths = features.lengths().view(len(keys), features.stride())
        weights = features.weights_or_none() if weighted else None
        return features.values(), lengths, weights, order
    return _eager_kjt_inputs(features, feature_names, weighted)


def forward(module, features):
    """``module(features)`` through the registered op: a KeyedTensor in config order."""
    portable_export = module.portable_export_enabled()  # ir.encapsulate_ir_modules: elsewhere
    op = module.op_layout()
    names = op.config_features if portable_export else op.feature_order
    inputs = _kjt_inputs(features, list(names), op.weighted)
    values, lengths, weights, order = inputs[0], inputs[1], inputs[2], inputs[3]
    params = [module.embedding_bags[c.name].weight for c in module.embedding_bag_configs()]
    if portable_export:
        out = torch.ops.fbtriton_dist.ebc_portable_lookup(
            values, lengths, weights, params, op.config_feature_tables,
            op.config_means, order, "\n".join(op.config_names),
        )
        return keyed_tensor(op.embedding_names, op.lengths_per_embedding, out)
    layout = spec(module)  # first: it syncs the fused optimizers, whose states come next
    out = torch.ops.fbtriton_dist.ebc_lookup(
        values, lengths, weights, params, module.op_states(), layout, order
    )
    return keyed_tensor(op.embedding_names, op.lengths_per_embedding, out)


@contextlib.contextmanager
def _bound(values, lengths, weights, params, states, spec, order):
    """(the skeleton bound to ``params`` and ``states``, its ``bound``, packed copies, the
    batch in the module's feature order), released after the call."""
    module = op_spec.skeleton(spec, str(params[0].device))
    bound, packed = op_spec.bind(module, params, states)
    try:
        yield module, bound, packed, order_batch(values, lengths, weights, order)
    finally:
        op_spec.release(module)


@torch.library.custom_op("fbtriton_dist::ebc_lookup", mutates_args=())
def ebc_lookup(
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    states: list[Tensor],
    spec: str,
    order: list[int],
) -> Tensor:
    with _bound(values, lengths, weights, params, states, spec, order) as (module, bound, _, batch):
        with torch.no_grad():
            return module.lookup(batch, bound)


@ebc_lookup.register_fake
def _(values, lengths, weights, params, states, spec, order):
    width = sum(op_spec.feature_dims(spec))
    return params[0].new_empty((lengths.shape[1], width), dtype=torch.float32)


@torch.library.custom_op("fbtriton_dist::ebc_lookup_backward", mutates_args=())
def ebc_lookup_backward(
    grad: Tensor,
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    states: list[Tensor],
    spec: str,
    order: list[int],
    psw_grad: bool,
) -> list[Tensor]:
    """[the weights' gradient ([1] if not asked for), one per table: its weight's gradient
    ``[E, D]`` (a 1-D placeholder for a table with a fused optimizer: ``ebc_fused_update``
    updates it)]. Placeholders hold one element: returns may not share storage."""
    with _bound(values, lengths, weights, params, states, spec, order) as (module, bound, _, batch):
        g_psw, g_tables = module.lookup_backward(batch, grad.contiguous(), psw_grad, update=False,
                                                 bound=bound)
        out = [
            unorder_weights_grad(g_psw, lengths, order)
            if g_psw is not None
            else values.new_zeros(1, dtype=torch.float32)
        ]
        # (the tables' gradients are views of one flat gradient: returns may not alias)
        for g, p in zip(g_tables, params, strict=True):
            out.append(g.clone() if g is not None else p.new_zeros(1))
        return out


@ebc_lookup_backward.register_fake
def _(grad, values, lengths, weights, params, states, spec, order, psw_grad):
    fused = op_spec.fused_tables(spec)
    out = [torch.empty_like(weights) if psw_grad else values.new_empty(1, dtype=torch.float32)]
    out += [p.new_empty(1) if t in fused else torch.empty_like(p) for t, p in enumerate(params)]
    return out


@torch.library.custom_op("fbtriton_dist::ebc_fused_update", mutates_args=("params", "states"))
def ebc_fused_update(
    grad: Tensor,
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    states: list[Tensor],
    spec: str,
    order: list[int],
    after: Tensor,
) -> None:
    """The fused optimizers' in-place update of the rows of ``params`` and of ``states``
    (momenta, step). ``after``: an output of ``ebc_lookup_backward``, which reads the rows
    before the update (a data dependency, so that no compiler runs this first)."""
    inputs = (values, lengths, weights, params, states, spec, order)
    with _bound(*inputs) as (module, bound, packed, batch):
        module.lookup_backward(batch, grad.contiguous(), False, update=True, bound=bound)
        op_spec.copy_back(packed)


@ebc_fused_update.register_fake
def _(grad, values, lengths, weights, params, states, spec, order, after):
    return None


def _setup_context(ctx, inputs, output):
    values, lengths, weights, params, states, spec, order = inputs
    ctx.spec, ctx.order, ctx.num_params = spec, order, len(params)
    ctx.weighted = weights is not None
    ctx.save_for_backward(values, lengths, weights, *params, *states)


def _backward(ctx, grad):
    values, lengths, weights, *tensors = ctx.saved_tensors
    params, states = tensors[: ctx.num_params], tensors[ctx.num_params :]
    psw_grad = ctx.weighted and ctx.needs_input_grad[2]
    out = torch.ops.fbtriton_dist.ebc_lookup_backward(
        grad, values, lengths, weights, params, states, ctx.spec, ctx.order, psw_grad
    )
    if op_spec.fused_tables(ctx.spec):  # after the gradients, which read the old rows
        torch.ops.fbtriton_dist.ebc_fused_update(
            grad, values, lengths, weights, params, states, ctx.spec, ctx.order, out[0]
        )
    g_psw = out[0] if psw_grad else None
    g_params = [g if g.dim() == 2 else None for g in out[1:]]
    return None, None, g_psw, g_params, [None] * len(states), None, None


ebc_lookup.register_autograd(_backward, setup_context=_setup_context)
