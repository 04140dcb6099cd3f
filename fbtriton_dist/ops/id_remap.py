"""The id remap of managed tables (dynamic ids): validation, the backend choice, the batched
algorithm.

``reference/id_remap.py`` is the spec (semantics, tie-breaks, state). Here the same steps
are vectorised torch around an *index* (raw id -> slot of the resident ids) that the backend
supplies: the fast CPU path's ``SortedIndex`` (``ops/cpu_id_remap.py``: sorted keys,
``searchsorted``) or the Triton ``HashIndex`` (``kernels/id_remap.py``: an open-addressing
hash table, batched lookup with the hit counters and timestamps updated in the kernel,
batched erase and insert, the admission sketch). The index is derived state, rebuilt from
``keys`` / ``last_seen`` when the backend changes or the state was loaded (``IdTable.reindex``);
the slots it gives do not depend on its layout, so every backend remaps alike.

Example::

    table = IdTable(IdManagerConfig(capacity=4, eviction="lru"), "t_user")
    slots, fresh = id_remap(table, torch.tensor([10, 2**40, 10]), step=0)
    # slots [0, 1, 0]; fresh [0, 1]: rows to re-initialise before the lookup
"""

from dataclasses import dataclass, field

import torch

from fbtriton_dist.id_manager import POLICY_CODE, IdManagerConfig
from fbtriton_dist.ops import backends
from fbtriton_dist.reference import id_remap as spec

STATS = spec.STATS
LRU, LFU, TTL, NONE = spec.LRU, spec.LFU, spec.TTL, spec.NONE


@dataclass
class IdTable:
    """One managed table's state tensors (``reference/id_remap.py`` describes them) and its
    backend's index. The tensors are the module's buffers: written in place."""

    config: IdManagerConfig
    name: str
    keys: torch.Tensor = None  # type: ignore[assignment]
    counts: torch.Tensor = None  # type: ignore[assignment]
    last_seen: torch.Tensor = None  # type: ignore[assignment]
    sketch: torch.Tensor = None  # type: ignore[assignment]
    stats: torch.Tensor = None  # type: ignore[assignment]
    device: torch.device | str | None = None
    _index: object = field(default=None, repr=False)
    _index_of: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        C = self.config.capacity
        kw = {"dtype": torch.int64, "device": self.device}
        if self.keys is None:
            self.keys = torch.zeros(C, **kw)
            self.counts = torch.zeros(C, **kw)
            self.last_seen = torch.full((C,), -1, **kw)
            depth = self.config.admission.sketch_depth if self.config.sketch_width else 0
            self.sketch = torch.zeros((depth, self.config.sketch_width), **kw)
            self.stats = torch.zeros(len(STATS), **kw)

    def reindex(self) -> None:
        """Forget the index: the state tensors were replaced or loaded."""
        self._index, self._index_of = None, None

    def index(self, backend: str):
        if self._index_of != backend or self._index is None:
            # the backend's index (Triton: a hash table; CPU: sorted keys); None: the spec
            self._index = backends.get(backend).id_index(self.keys, self.last_seen)
            self._index_of = backend
        return self._index


def check_ids(table: IdTable, ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        what = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else repr(ids)
        raise ValueError(f"table '{table.name}' ids: expected a 1-D int64 tensor, got {what}")
    if ids.device != table.keys.device:
        raise ValueError(
            f"table '{table.name}' ids: expected them on {table.keys.device}, got {ids.device}"
        )


def id_remap(
    table: IdTable, ids: torch.Tensor, *, step: int, update: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw ids ``[N]`` int64 -> ``(slots [N], fresh [M])``: each id's row in ``[0,
    capacity]`` (``capacity``: the default row), and the slots given a new id (re-initialise
    their rows and optimizer states before the lookup). ``update=False``: lookup only (eval).
    ``table.stats`` holds the step's numbers (``STATS``) afterwards."""
    check_ids(table, ids)
    resolved = backends.resolve(backend, ids.device)
    cfg = table.config
    kwargs = {"step": int(step), "policy": POLICY_CODE[cfg.eviction],
              "ttl_steps": cfg.ttl_steps or 0, "min_count": cfg.admission.min_count,
              "update": update}
    index = table.index(resolved)
    if index is None:  # the backend runs the spec itself (the reference)
        out = spec.id_remap(ids, table.keys, table.counts, table.last_seen, table.sketch,
                            table.stats, table=table.name, **kwargs)
        table.reindex()
        return out
    return _remap(table, index, ids, **kwargs)


def _remap(table: IdTable, index, ids: torch.Tensor, *, step: int, policy: int, ttl_steps: int,
           min_count: int, update: bool) -> tuple[torch.Tensor, torch.Tensor]:
    keys, counts, last_seen = table.keys, table.counts, table.last_seen
    C, dev = keys.numel(), ids.device
    out = dict.fromkeys(STATS, 0)
    out["lookups"] = ids.numel()
    empty = ids.new_empty(0)
    if update and policy == TTL:
        gone = ((last_seen >= 0) & (last_seen < step - ttl_steps)).nonzero().squeeze(1)
        if gone.numel():
            index.replace(keys[gone], gone, empty, empty)
            last_seen[gone], counts[gone] = -1, 0
            out["expired"] = gone.numel()
    # every id looked up as it comes (a hit counts each occurrence); only the misses are made
    # distinct, in first-occurrence order
    slot_of = index.lookup(ids, counts, last_seen, step, touch=update)
    miss_at = (slot_of < 0).nonzero().squeeze(1)
    out["hits"] = ids.numel() - miss_at.numel()
    fresh = empty
    if update and miss_at.numel():
        uniq, inverse, n = torch.unique(ids[miss_at], return_inverse=True, return_counts=True)
        U = uniq.numel()
        first = torch.full((U,), ids.numel(), dtype=torch.int64, device=dev)
        first.scatter_reduce_(0, inverse, miss_at, "amin")
        order = first.argsort()  # first-occurrence order (positions are distinct)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(U, device=dev)
        uniq, n, inverse = uniq[order], n[order], rank[inverse]
        slot_u = torch.full((U,), -1, dtype=torch.int64, device=dev)
        admitted = torch.arange(U, device=dev)
        misses = U
        if min_count > 1:
            est = index.sketch_add(table.sketch, uniq, n)
            admitted = admitted[est >= min_count]
        A = admitted.numel()
        out["rejected"] = misses - A
        free = (last_seen < 0).nonzero().squeeze(1)
        F = free.numel()
        if policy == NONE and A > F:
            raise spec.table_full_error(table.name, C, A, F)
        targets, victims = free[:A], empty
        if A > F and policy in (LRU, LFU):
            cand = ((last_seen >= 0) & (last_seen < step)).nonzero().squeeze(1)
            need = min(A - F, cand.numel())
            if need:
                victims = pick_victims(cand, last_seen, counts if policy == LFU else None, need)
            targets = torch.cat([free, victims])
        got = admitted[: targets.numel()]
        index.replace(keys[victims], victims, uniq[got], targets)
        keys[targets], counts[targets], last_seen[targets] = uniq[got], n[got], step
        slot_u[got] = targets
        fresh = targets
        out["admitted"], out["overflow"] = targets.numel(), A - targets.numel()
        out["evicted"] = victims.numel()
        slot_of[miss_at] = slot_u[inverse]
    slots = torch.where(slot_of >= 0, slot_of, C)
    out["default_reads"] = int((slots == C).sum())
    table.stats.copy_(torch.tensor([out[k] for k in STATS], dtype=torch.int64))
    return slots, fresh


def _smallest(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` smallest of distinct ``keys``, in no order (a selection, not a
    sort: ``O(n)``)."""
    if k >= keys.numel():
        return torch.arange(keys.numel(), device=keys.device)
    return (keys <= keys.kthvalue(k).values).nonzero().squeeze(1)


def pick_victims(cand: torch.Tensor, last_seen: torch.Tensor, counts: torch.Tensor | None,
             need: int) -> torch.Tensor:
    """The ``need`` first of the candidate slots ``cand`` (ascending) in ascending ``(counts,
    last_seen, slot)`` order (lru: ``counts`` None), in that order: selected in ``O(C)``,
    then only they are sorted."""
    lru_key = last_seen[cand] * (int(last_seen.numel()) + 1) + cand  # distinct: (step, slot)
    if counts is None:
        pick = _smallest(lru_key, need)
        return cand[pick[lru_key[pick].argsort()]]
    c = counts[cand]
    if need < cand.numel():  # every candidate below the need-th count, then the ties' oldest
        bound = c.kthvalue(need).values
        below = (c < bound).nonzero().squeeze(1)
        tied = (c == bound).nonzero().squeeze(1)
        pick = torch.cat([below, tied[_smallest(lru_key[tied], need - below.numel())]])
    else:
        pick = torch.arange(cand.numel(), device=cand.device)
    order = lru_key[pick].argsort()
    order = order[c[pick][order].argsort(stable=True)]
    return cand[pick[order]]
