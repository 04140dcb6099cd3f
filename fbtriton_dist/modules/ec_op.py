"""EmbeddingCollection's lookup as one registered op, for graphs and meta tensors.

``torch.ops.fbtriton_dist.ec_lookup(values [N], ids_per_key, params, states, spec, order) ->
[rows of each feature]``: a KJT's ids in its own key order with the number of ids of each key
(host ints: the KJT's ``length_per_key()``, symbolic under compile / export, cached on a KJT
moved to meta), the module's per-table weights (``embeddings.<t>.weight``), each group's
fused-optimizer state, the static layout (``spec``) and which KJT key each of its features
reads (``order``, in the module's feature order), as ``ebc_op``'s: a function of its inputs
alone (``op_spec``). Its fake implementation gives feature i the shape
``[ids_per_key[order[i]], D_i]``. Its backward is ``ec_lookup_backward`` (the TBE backward of
the same ids) and, for fused tables, ``ec_fused_update`` (the optimizer applied in place to
the given rows and states).

``forward`` is the module's forward under ``torch.fx`` tracing, ``torch.compile``,
``torch.export`` and on meta tensors: ``_kjt_inputs`` reads the KJT's host metadata and cuts
its lengths by key; it is an FX leaf (``torch.fx.wrap``), as TorchRec's KJT helpers are.
"""

import contextlib

import torch
from torch import Tensor

from fbtriton_dist.modules import op_spec
from fbtriton_dist.modules.ebc_op import spec
from fbtriton_dist.sparse import KeyedJaggedTensor, check_sequence_keys


@torch.jit.unused
def _eager_keys(features: KeyedJaggedTensor, feature_names: list[str]) -> list[str]:
    return check_sequence_keys(features, feature_names)


@torch.jit.unused
def _eager_ids_per_key(features: KeyedJaggedTensor) -> list[int]:
    return [int(n) if not isinstance(n, torch.SymInt) else n for n in features.length_per_key()]


@torch.fx.wrap
def _kjt_inputs(
    features: KeyedJaggedTensor, feature_names: list[str]
) -> tuple[Tensor, list[int], list[int], list[Tensor], list[Tensor]]:
    """(values, ids per key (host), order, each feature's lengths, each feature's ids).
    TorchScript compiles it too (an FX graph holding it can be scripted)."""
    if torch.jit.is_scripting():
        keys = features.keys()
        for k in keys:
            if keys.count(k) > 1:
                raise ValueError("KeyedJaggedTensor keys must be unique")
        ids_per_key = features.length_per_key()
    else:
        keys = _eager_keys(features, feature_names)
        ids_per_key = _eager_ids_per_key(features)
    values = features.values()
    order = [keys.index(f) for f in feature_names]
    all_lengths = features.lengths()
    per_key: list[Tensor] = []
    at = 0
    for stride in features.stride_per_key():
        per_key.append(all_lengths[at : at + stride])
        at += stride
    lengths = [per_key[k] for k in order]
    return values, ids_per_key, order, lengths, _ids(values, ids_per_key, order)


def _ids(values: Tensor, ids_per_key: list[int], order: list[int]) -> list[Tensor]:
    starts = [0]
    for n in ids_per_key:
        starts.append(starts[-1] + n)
    return [values[starts[k] : starts[k + 1]] for k in order]


def forward(module, features):
    """``module(features)`` through the registered op: ``{feature: JaggedTensor}``."""
    names = list(module.op_layout().feature_order)
    inputs = _kjt_inputs(features, names)
    values, ids_per_key, order, lengths, ids = (inputs[0], inputs[1], inputs[2], inputs[3],
                                                inputs[4])
    params = module.group_params(range(len(module.table_configs())))
    layout = spec(module)  # first: it syncs the fused optimizers, whose states come next
    rows = torch.ops.fbtriton_dist.ec_lookup(values, ids_per_key, params, module.op_states(),
                                             layout, order)
    n = len(names)
    return module.jagged_outputs([rows[i] for i in range(n)], [ids[i] for i in range(n)],
                           [lengths[i] for i in range(n)])


@contextlib.contextmanager
def _bound(values, ids_per_key, params, states, spec, order):
    module = op_spec.skeleton(spec, str(params[0].device))
    bound, packed = op_spec.bind(module, params, states)
    try:
        yield module, bound, packed, _ids(values, ids_per_key, order)
    finally:
        op_spec.release(module)


@torch.library.custom_op("fbtriton_dist::ec_lookup", mutates_args=())
def ec_lookup(values: Tensor, ids_per_key: list[int], params: list[Tensor], states: list[Tensor],
              spec: str, order: list[int]) -> list[Tensor]:
    with _bound(values, ids_per_key, params, states, spec, order) as (module, bound, _, ids):
        with torch.no_grad():
            rows = module.lookup(ids, autograd=False, bound=bound)
        return [r.clone() for r in rows]  # outputs of a custom op may not share storage


@ec_lookup.register_fake
def _(values, ids_per_key, params, states, spec, order):
    dims = op_spec.feature_dims(spec)
    return [params[0].new_empty((ids_per_key[k], D), dtype=torch.float32)
            for k, D in zip(order, dims, strict=True)]


@torch.library.custom_op("fbtriton_dist::ec_lookup_backward", mutates_args=())
def ec_lookup_backward(grads: list[Tensor], values: Tensor, ids_per_key: list[int],
                       params: list[Tensor], states: list[Tensor], spec: str,
                       order: list[int]) -> list[Tensor]:
    """One per table: its weight's gradient ``[E, D]``, or a one-element placeholder for a
    table with a fused optimizer (``ec_fused_update`` updates it)."""
    with _bound(values, ids_per_key, params, states, spec, order) as (module, bound, _, ids):
        g_tables = module.lookup_backward(ids, list(grads), update=False, bound=bound)
        return [g.clone() if g is not None else p.new_zeros(1)
                for g, p in zip(g_tables, params, strict=True)]


@ec_lookup_backward.register_fake
def _(grads, values, ids_per_key, params, states, spec, order):
    fused = op_spec.fused_tables(spec)
    return [p.new_empty(1) if t in fused else torch.empty_like(p) for t, p in enumerate(params)]


@torch.library.custom_op("fbtriton_dist::ec_fused_update", mutates_args=("params", "states"))
def ec_fused_update(grads: list[Tensor], values: Tensor, ids_per_key: list[int],
                    params: list[Tensor], states: list[Tensor], spec: str, order: list[int],
                    after: Tensor) -> None:
    """The fused optimizers' in-place update of the rows of ``params`` and of ``states``;
    ``after``: an output of ``ec_lookup_backward`` (it reads the rows before the update)."""
    with _bound(values, ids_per_key, params, states, spec, order) as (module, bound, packed, ids):
        module.lookup_backward(ids, list(grads), update=True, bound=bound)
        op_spec.copy_back(packed)


@ec_fused_update.register_fake
def _(grads, values, ids_per_key, params, states, spec, order, after):
    return None


def _setup_context(ctx, inputs, output):
    values, ids_per_key, params, states, spec, order = inputs
    ctx.args = (ids_per_key, spec, order, len(params))
    ctx.shapes = [(r.shape, r.dtype, r.device) for r in output]
    ctx.save_for_backward(values, *params, *states)


def _backward(ctx, grads):
    values, *tensors = ctx.saved_tensors
    ids_per_key, spec, order, num_params = ctx.args
    params, states = tensors[:num_params], tensors[num_params:]
    grads = [g if g is not None else torch.zeros(s, dtype=dt, device=dev)
             for g, (s, dt, dev) in zip(grads, ctx.shapes, strict=True)]
    out = torch.ops.fbtriton_dist.ec_lookup_backward(grads, values, ids_per_key, params, states,
                                                     spec, order)
    if op_spec.fused_tables(spec):  # after the gradients, which read the old rows
        torch.ops.fbtriton_dist.ec_fused_update(grads, values, ids_per_key, params, states,
                                                spec, order, out[0])
    return (None, None, [g if g.dim() == 2 else None for g in out], [None] * len(states), None,
            None)


ec_lookup.register_autograd(_backward, setup_context=_setup_context)
