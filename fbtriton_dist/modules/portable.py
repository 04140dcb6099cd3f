"""The EmbeddingBagCollection's pooled lookup in plain torch ops, for graphs that leave us.

``ebc_op`` runs the module's own TBE through a handle valid in its process only. Two users need
a lookup that is a function of its inputs alone, for inference:

- ``torch.jit.script(ebc)``: the scripted forward calls ``pooled`` (TorchScript compiles it),
  so a saved script model holds its tables and runs wherever TorchRec's KJT does;
- ``torch.export`` of a model passed through ``ir.encapsulate_ir_modules``: the graph calls
  ``torch.ops.fbtriton_dist.ebc_portable_lookup`` (``pooled`` again), so the exported program
  runs in another process that imports fbtriton_dist, and ``ir.decapsulate_ir_modules`` puts
  our module back in the unflattened model.

Every id is gathered, scaled by its weight, and accumulated in fp32 per bag (MEAN divides by
the bag's length; an empty bag is zeros), as the TBE kernels do; ids outside a table raise.
"""

import torch
from torch import Tensor


def pooled(
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    feature_tables: list[int],
    means: list[bool],
    order: list[int],
    names: list[str],
) -> Tensor:
    """``[B, sum(D)]`` fp32: output feature ``i`` (``names[i]``, as ``feature@table``) pools KJT
    key ``order[i]`` (``values`` [N], ``lengths`` [K, B], ``weights`` [N] or None, key-major)
    in table ``params[feature_tables[i]]`` ([E, D]), by mean if ``means[i]`` else by sum."""
    K, B = lengths.size(0), lengths.size(1)
    per_key = lengths.sum(1)
    starts = torch.zeros(K + 1, dtype=torch.int64, device=lengths.device)
    if K > 0:
        starts[1:] = torch.cumsum(per_key, 0)
    if int(starts[K]) != values.numel():
        total = int(starts[K])
        raise ValueError(
            f"KeyedJaggedTensor: lengths add up to {total} ids, but values holds {values.numel()}"
        )
    bags = torch.arange(B, device=values.device)
    out: list[Tensor] = []
    for i in range(len(order)):
        k = order[i]
        table = params[feature_tables[i]]
        a, n = int(starts[k]), int(per_key[k])
        ids = values.narrow(0, a, n).long()
        if n > 0:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= table.size(0):
                name, E = names[i], table.size(0)
                raise ValueError(
                    f"KeyedJaggedTensor {name}: ids in [{lo}, {hi}], outside the table's "
                    f"[0, {E})"
                )
        rows = table.index_select(0, ids).float()
        if weights is not None:
            rows = rows * weights.narrow(0, a, n).float().unsqueeze(1)
        bag_of = torch.repeat_interleave(bags, lengths[k].long(), output_size=n)
        sums = torch.zeros(B, table.size(1), dtype=torch.float32, device=values.device)
        sums = sums.index_add(0, bag_of, rows)
        if means[i]:
            sums = sums / lengths[k].clamp(min=1).unsqueeze(1).float()
        out.append(sums)
    if len(out) == 0:
        return torch.zeros(B, 0, dtype=torch.float32, device=values.device)
    return torch.cat(out, dim=1)


def rows(ids: Tensor, table: Tensor, name: str) -> Tensor:
    """``[N, D]`` fp32: the rows of ``table`` ([E, D]) for ``ids`` [N] (an EmbeddingCollection's
    scripted lookup, output ``name``); ids outside the table raise."""
    if ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.size(0):
            E = table.size(0)
            raise ValueError(
                f"KeyedJaggedTensor {name}: ids in [{lo}, {hi}], outside the table's [0, {E})"
            )
    return table.index_select(0, ids.long()).float()


@torch.library.custom_op("fbtriton_dist::ebc_portable_lookup", mutates_args=())
def ebc_portable_lookup(
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    params: list[Tensor],
    feature_tables: list[int],
    means: list[bool],
    order: list[int],
    names: str,
) -> Tensor:
    """``pooled`` as one op (inference: no autograd), for exported programs; ``names``
    joined by newlines (an op takes no list of strings)."""
    return pooled(values, lengths, weights, params, feature_tables, means, order, names.split("\n"))


@ebc_portable_lookup.register_fake
def _(values, lengths, weights, params, feature_tables, means, order, names):
    width = sum(params[t].shape[1] for t in feature_tables)
    return values.new_empty((lengths.shape[1], width), dtype=torch.float32)
