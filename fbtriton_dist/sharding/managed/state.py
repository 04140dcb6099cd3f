"""Managed tables' maps loaded onto other owners than those that saved them: the ids
re-inserted by the owner of their hash (resharding a DCP checkpoint: 2 ranks -> 3, 3 -> 2,
an unsharded module's map into a sharded one and back).

A sharded managed table (``sharding/managed/sharded.py``) gives each id to the owner of its hash
range, and the ranges follow the owners' slots, so another world size or plan moves most ids
to another owner, and another slot. Loading a checkpoint onto other owners therefore takes
two steps:

1. ``dcp.load(state, checkpoint_id=..., planner=ManagedLoadPlanner())``. The per-slot state
   loads by row as any sharded tensor does: each rank gets the saved entries (raw id,
   ``counts``, ``last_seen``) of the rows it now holds, with those rows' weights and fused
   optimizer state. The per-owner state (``step``, ``seed``, ``totals``, ``sketch``, whose
   shapes follow the saved owners) cannot load into the new owners' tensors: the planner
   reads it into a ``SavedOwners`` (``modules/managed.py``) that it puts in their place in
   ``state``. (The default planner refuses: DCP's "Size mismatch ... for
   <...>._managed_collision_modules.<table>.step" names the table and the key; when the
   number of owners is the same but their rows are not, ``load_state_dict`` refuses, naming
   the table and ``owners``.)
2. ``module.load_state_dict(state["model"])`` (``load_maps``, a collective of the sharded
   module's group): every rank sends each live entry it now holds, with its row and
   optimizer state, to the owner of its hash under the new layout (one count and two data
   all-to-alls per table); each owner re-inserts what it got (``reinsert``).

What "exactly" means. A map's state is its set of live entries (raw id -> row values, fused
optimizer state, ``counts``, ``last_seen``), its clock, its seed, its admission sketch and its
totals; slots are where the entries sit, not state (nothing a lookup returns depends on them,
only the policy's tie-breaks between equal entries do).

* While the entries fit (an owner receives no more live ids than its slots; always so for a
  single owner: an unsharded module, a table-wise or data-parallel table), every live id keeps
  its row values, optimizer state, ``counts`` and ``last_seen`` bit for bit, and the resumed
  run remaps as an uninterrupted run of the new layout holding that state would: the same
  hits, misses, admissions and evictions. So when no owner is ever full, a run saved on R
  ranks and resumed on R' trains every id as one uninterrupted unsharded module does on the
  same stream (fresh rows aside: each owner draws them from its own seed, as in any sharded
  run; and with admission, up to sketch collisions, see below).
* An owner that receives ``n`` live ids for ``c < n`` slots keeps the ``c`` its policy would
  keep longest, as if it had evicted the others one by one: ``lru`` and ``ttl`` drop in
  ascending ``(last_seen, saved row)``, ``lfu`` in ascending ``(counts, last_seen, saved
  row)``; ``none`` refuses (a ValueError naming the table, the owner, ``n`` and ``c``, on
  every rank). A dropped id is gone, as an evicted one: seen again it is a new id with a fresh
  row. The drops count as evictions in ``totals`` (``total_evicted``).
* Slots: an owner of several owners puts its kept entries in slots ``0, 1, ...`` in ascending
  saved row, so among them the policy's tie-breaks keep the saved order; a single owner's
  slots are the table's rows, and each entry stays at its saved row.
* ``step``: the saved clock (every owner keeps the same). ``seed``: new owner ``j`` of ``R'``
  draws its fresh rows from ``owner_seed(table seed, j, R')``, as a run started on that
  layout. ``totals``: the saved owners' summed, held by the first new owner (``metrics()``
  sums the owners). ``sketch``: each new owner's is the saved sketches of the owners whose
  hash ranges meet its own, folded to its width (``fold_sketch``): an id's count is never
  below its true count, so an id is at worst admitted early, never late; it is exact where no
  two ids share every counter (the same caveat as any count-min sketch).

A map saved and loaded by the same owners loads in place as before (the default planner is
enough). The planner also refuses, naming the table and the key: a managed table the
checkpoint has no map for, a map of another capacity, and a checkpoint table that is managed
where this module's is not; ``load_state_dict`` refuses a map of another config (eviction,
``ttl_steps``, admission: ``config``).
"""

import dataclasses
import re

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fbtriton_dist import optim
from fbtriton_dist.modules.managed import (
    PER_OWNER,
    SavedOwners,
    check_config,
    fold_sketch,
    load_saved_owners,
    owner_seed,
    saved_owners_of,
)
from fbtriton_dist.ops.id_remap import STATS
from fbtriton_dist.sharding.managed.hashing import hash_ranges, owners_of

__all__ = ["ManagedLoadPlanner", "load_maps", "reinsert"]

_MAP = "_managed_collision_modules."
_KEY = re.compile(r"^(?P<p>.*" + re.escape(_MAP) + r"(?P<t>[^.]+)\.)(?P<k>[a-z_]+)$")
_MAP_KEYS = ("keys", "counts", "last_seen", *PER_OWNER, "owners", "config")
_SLOT_KEYS = ("keys", "counts", "last_seen")


class ManagedLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (same arguments) that loads managed tables' maps saved by other
    owners: their per-owner entries are read into a ``SavedOwners`` put in place of the
    module's in the state dict, for ``load_state_dict`` to re-insert (the module docstring).
    Everything else, managed maps of the same owners included, loads as with the default
    planner."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        if self.flatten_state_dict:  # every key's path, those flattening dropped included
            _, self._paths = flatten_state_dict(self.original_state_dict)
        else:
            self._paths = {k: (k,) for k in self.original_state_dict}
        self._staged: dict[str, dict[tuple, torch.Tensor]] = {}
        self._skipped: set[str] = set()
        tables = {}
        for fqn in self._paths:
            m = _KEY.match(fqn)
            if m and m["k"] in _MAP_KEYS:
                tables[m["p"]] = m["t"]
        for prefix, table in tables.items():
            self._plan_table(prefix, table)
        self._refuse_unmanaged(tables)

    # -- what to read -----------------------------------------------------------------------
    def _value(self, fqn: str):
        value = self.original_state_dict
        for part in self._paths[fqn]:
            value = value[part]
        return value

    def _plan_table(self, p: str, table: str) -> None:
        md = self.metadata.state_dict_metadata
        if p + "keys" not in md:
            if self.allow_partial_load:
                return
            theirs = sorted({m["t"] for k in md if (m := _KEY.match(k))})
            raise ValueError(
                f"table '{table}': the checkpoint holds no id map for this managed table (no "
                f"key '{p}keys'; its managed tables: {theirs})")
        saved = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in md[p + "keys"].chunks)
        capacity = int(md[p + "keys"].size[0])
        owners, mine = self._target_owners(p)
        if sum(c for _, c in owners) != capacity:
            raise ValueError(
                f"table '{table}' id_manager.capacity: the checkpoint's map has {capacity} "
                f"slots, this module's {sum(c for _, c in owners)} (key '{p}keys')")
        for k in ("owners", "config"):  # recorded since: an older checkpoint lacks them
            if p + k in self._paths and p + k not in md:
                self._skipped.add(p + k)
        reshaped = any(p + k in md and p + k in self._paths
                       and tuple(md[p + k].size) != _size(self._value(p + k))
                       for k in PER_OWNER)
        if saved == owners and not reshaped:
            return
        staged = SavedOwners(table=table, owners=saved, step=self._whole(p + "step", table),
                             seed=self._whole(p + "seed", table),
                             totals=self._whole(p + "totals", table))
        self._stage_sketch(p, table, staged, owners, mine)
        for k in ("owners", *PER_OWNER):
            if p + k in self._paths:
                self._put(p + k, staged)

    def _target_owners(self, p: str) -> tuple[list[tuple[int, int]], int | None]:
        """This module's owners ``[(first row, slots)]`` of the table and this rank's index
        among them (None: it owns none)."""
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        keys = self._value(p + "keys")
        if p + "owners" not in self._paths:  # one owner of every slot: unsharded, replicas
            return [(0, int(keys.shape[0]))], 0
        owners = [tuple(o) for o in self._value(p + "owners").tolist()]
        if not isinstance(keys, ShardedTensor):
            return owners, 0
        local = [int(s.metadata.shard_offsets[0]) for s in keys.local_shards()]
        return owners, next((i for i, (r0, _) in enumerate(owners) if r0 in local), None)

    def _whole(self, fqn: str, table: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise ValueError(f"table '{table}': the checkpoint's map lacks '{fqn}'")
        tensor = torch.zeros(tuple(md.size), dtype=md.properties.dtype)
        self._staged[fqn] = {(0,) * len(md.size): tensor}
        return tensor

    def _stage_sketch(self, p, table, staged: SavedOwners, owners, mine) -> None:
        """The saved owners' sketches this rank's owner folds: those whose hash ranges meet
        its own (all, for a single owner)."""
        md = self.metadata.state_dict_metadata.get(p + "sketch")
        if md is None:
            raise ValueError(f"table '{table}': the checkpoint's map lacks '{p}sketch'")
        if mine is None or md.size.numel() == 0:
            return
        chunks = sorted(md.chunks, key=lambda c: int(c.offsets[1]))
        if len(chunks) != len(staged.owners):
            raise ValueError(f"table '{table}': the checkpoint's '{p}sketch' has {len(chunks)} "
                             f"blocks for {len(staged.owners)} owners")
        lo, hi = hash_ranges([c for _, c in owners])[mine]
        blocks = self._staged.setdefault(p + "sketch", {})
        for i, (a, b) in enumerate(hash_ranges([c for _, c in staged.owners])):
            if a < hi and lo < b:
                tensor = torch.zeros(tuple(chunks[i].sizes), dtype=md.properties.dtype)
                blocks[tuple(int(x) for x in chunks[i].offsets)] = tensor
                staged.sketch[i] = tensor

    def _put(self, fqn: str, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        self._skipped.add(fqn)
        set_element(self.original_state_dict, self._paths[fqn], value)
        if fqn in self.state_dict:
            self.state_dict[fqn] = value

    def _refuse_unmanaged(self, tables: dict[str, str]) -> None:
        for fqn in self.metadata.state_dict_metadata:
            m = _KEY.match(fqn)
            if not m or m["k"] != "keys" or m["p"] in tables or "id_managers." + _MAP not in fqn:
                continue
            base = fqn[: fqn.index("id_managers." + _MAP)]
            if any(f"{base}{kind}.{m['t']}.weight" in self._paths
                   for kind in ("embedding_bags", "embeddings")):
                raise ValueError(
                    f"table '{m['t']}' is managed in the checkpoint (key '{fqn}') but not in "
                    f"this module: build it with managed={{'{m['t']}': ...}}")

    # -- the plan ---------------------------------------------------------------------------
    def create_local_plan(self):
        if not self._skipped:
            return super().create_local_plan()
        plain = {k: v for k, v in self.state_dict.items() if k not in self._skipped}
        plan = create_default_local_load_plan(plain, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, chunks in self._staged.items():
            local = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape)
                     for o, t in chunks.items()]
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], local)
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index):
        if index.fqn in self._staged:
            return self._staged[index.fqn][tuple(int(x) for x in index.offset)]
        return super().lookup_tensor(index)


def _size(value) -> tuple[int, ...]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return tuple(value.metadata().size if isinstance(value, ShardedTensor) else value.shape)


# -- load_state_dict ------------------------------------------------------------------------
def load_maps(collection, state_dict: dict, prefix: str) -> None:
    """The managed collection's ``_load_from_state_dict`` of its maps (``prefix``: its
    ``id_managers.``): each table's config checked; a map of the same owners: each
    ShardedTensor entry -> this rank's piece (the live buffer after an in-place DCP load);
    a ``SavedOwners`` (other owners): re-inserted (``reinsert``, a collective) or, for one
    owner, taken in place; entries of tables this rank owns nothing of: dropped. The child
    ``IdManager``s then load what is left (a data-parallel table's replica: by itself)."""
    ids = collection.id_managers
    managers = ids.managers()
    for info in ids.tables:
        if info.replicated:
            continue
        p = f"{prefix}{_MAP}{info.name}."
        m = managers.get(info.name)
        key = p + "config"
        if key in state_dict:
            check_config(info.name, info.config, state_dict.pop(key), key)
        saved = saved_owners_of(state_dict, p)
        if saved is None:
            _check_owners(info, state_dict.pop(p + "owners", None), p)
            _local_pieces(ids, info, m, state_dict, p)
            continue
        if len(info.owners) > 1:
            reinsert(collection, info, m, saved)
        elif m is not None:  # one owner of every slot: the entries stay at their rows
            with torch.no_grad():
                for k, v in load_saved_owners(saved, m.config).items():
                    getattr(m, k).copy_(v)
        state_dict.pop(p + "owners", None)
        for k in (*_SLOT_KEYS, *PER_OWNER):
            state_dict.pop(p + k, None)
            if m is not None:
                state_dict[p + k] = getattr(m, k)  # loaded: the child copies it onto itself


def _check_owners(info, saved, p: str) -> None:
    if saved is None:  # a plain state dict without it (an unsharded module's map)
        return
    mine = [[r0, c] for _, r0, c in info.owners]
    if saved.tolist() != mine:
        raise ValueError(
            f"table '{info.name}' owners: the checkpoint's map was saved by owners (first row, "
            f"slots) {saved.tolist()}, this module's are {mine} (key '{p}owners'); load it "
            "with planner=fbtriton_dist.sharding.managed.state.ManagedLoadPlanner(), which "
            "re-inserts its ids by owner")


def _local_pieces(ids, info, m, state_dict: dict, p: str) -> None:
    """Each ShardedTensor entry of a map of this module's owners -> this rank's local piece;
    a table-wise table also takes an unsharded module's plain map as it is."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for k, (size, metas, _) in ids.pieces(info, m).items():
        value = state_dict.get(p + k)
        if value is None:
            continue
        if m is None:
            del state_dict[p + k]
            continue
        mine = next(off for r, off, _ in metas if r == ids.rank)
        if isinstance(value, ShardedTensor):
            piece = next((s.tensor for s in value.local_shards()
                          if list(s.metadata.shard_offsets) == list(mine)), None)
            if piece is None or tuple(value.size()) != size:
                raise ValueError(
                    f"table '{info.name}' {k}: its shards do not match this rank's id manager "
                    f"(key '{p + k}'); load the checkpoint with torch.distributed.checkpoint "
                    "and planner=ManagedLoadPlanner() (sharding/managed/state.py)")
            state_dict[p + k] = piece.reshape(getattr(m, k).shape)
        elif len(info.owners) == 1:  # table-wise: an unsharded module's map as it is
            state_dict[p + k] = value.reshape(getattr(m, k).shape)
        else:
            raise ValueError(
                f"table '{info.name}' {k}: expected a ShardedTensor of this plan's owners, got "
                f"a {tuple(value.shape)} tensor (key '{p + k}'); a map of other owners is "
                "re-inserted by owner through torch.distributed.checkpoint and "
                "planner=ManagedLoadPlanner() (sharding/managed/state.py)")


# -- the re-insert --------------------------------------------------------------------------
@torch.no_grad()
def reinsert(collection, info, m, saved: SavedOwners) -> None:
    """Move every live entry of table ``info`` this rank holds after the row-wise DCP load
    (raw id, ``counts``, ``last_seen``, saved row, the row's weights and fused optimizer
    state) to the owner of its hash among ``info.owners``, and re-insert what this rank's
    owner gets (the module docstring's rules). A collective of ``collection.group``: every
    rank calls it for the same tables in the same order."""
    group, R = collection.group, collection.layout.world_size
    caps = [c for _, _, c in info.owners]
    j = info.owner_index(collection.rank)
    D = collection.table_configs()[info.t].embedding_dim
    widths = [1 if s.per_row else D for s in optim.spec_of(collection.optimizer).states]
    W = D + sum(widths)
    dev = collection.device
    view = states = None
    ints = torch.zeros(0, 4, dtype=torch.int64, device=dev)
    vals = torch.zeros(0, W, dtype=torch.float64, device=dev)
    dest = torch.zeros(0, dtype=torch.int64, device=dev)
    if m is not None:
        view, states = next((v, s) for lt, v, s in collection.local_shards()
                            if lt.table == info.t)
        live = torch.nonzero(m.last_seen >= 0).squeeze(1)
        ints = torch.stack([m.keys[live], m.counts[live], m.last_seen[live],
                            live + info.owners[j][1]], 1)
        # float64 holds fp32 / fp16 / bf16 values exactly
        vals = torch.cat([view[live].double(), *[s[live].reshape(live.numel(), w).double()
                                                 for s, w in zip(states, widths, strict=True)]],
                         1)
        ranks = torch.tensor([r for r, _, _ in info.owners], dtype=torch.int64, device=dev)
        dest = ranks[owners_of(ints[:, 0], caps)]
    order = torch.argsort(dest, stable=True)
    ints, vals = ints[order].contiguous(), vals[order].contiguous()
    send = torch.bincount(dest, minlength=R)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    sent_h, recv_h = send.tolist(), recv.tolist()
    got = ints.new_empty(sum(recv_h), 4)
    dist.all_to_all_single(got, ints, recv_h, sent_h, group=group)
    got_vals = vals.new_empty(sum(recv_h), W)
    dist.all_to_all_single(got_vals, vals, recv_h, sent_h, group=group)
    fill = torch.zeros(len(caps), 2, dtype=torch.int64, device=dev)
    if j is not None:
        fill[j, 0], fill[j, 1] = got.shape[0], caps[j]
    dist.all_reduce(fill, group=group)  # every rank learns of an overflow: all raise alike
    over = [(i, n, c) for i, (n, c) in enumerate(fill.tolist()) if n > c]
    if over and info.config.eviction == "none":
        i, n, c = over[0]
        raise ValueError(
            f"table '{info.name}' is full with eviction 'none': re-inserting the checkpoint's "
            f"map by owner, owner {i} (rank {info.owners[i][0]}) gets {n} live ids for its {c} "
            "slots; raise capacity, load onto owners with more slots, or choose an eviction")
    if m is None:
        return
    by_row = torch.argsort(got[:, 3])
    got, got_vals = got[by_row], got_vals[by_row]
    keep = _kept(got, caps[j], info.config.eviction)
    got, got_vals = got[keep], got_vals[keep]
    k = got.shape[0]
    m.keys.zero_()
    m.counts.zero_()
    m.last_seen.fill_(-1)
    m.keys[:k], m.counts[:k], m.last_seen[:k] = got[:, 0], got[:, 1], got[:, 2]
    view[:k] = got_vals[:, :D].to(view.dtype)
    at = D
    for s, w in zip(states, widths, strict=True):
        s[:k] = got_vals[:, at : at + w].reshape(k, *s.shape[1:]).to(s.dtype)
        at += w
    totals = saved.total() if j == 0 else torch.zeros(len(STATS), dtype=torch.int64)
    totals[STATS.index("evicted")] += int(keep.numel()) - k
    m.totals.copy_(totals)
    m.step.fill_(saved.last_step())
    m.seed.fill_(owner_seed(saved.table_seed(), j, len(caps)))
    m.sketch.copy_(fold_sketch(list(saved.sketch.values()), m.sketch.shape[0],
                               m.sketch.shape[1]))
    m.last.zero_()
    m.reindex()


def _kept(entries: torch.Tensor, capacity: int, eviction: str) -> torch.Tensor:
    """``[n]`` bool: the entries ``[n, 4]`` (id, counts, last_seen, saved row; ascending saved
    row) an owner of ``capacity`` slots keeps: all when they fit, else all but the first
    ``n - capacity`` in the policy's eviction order (lfu: ascending ``(counts, last_seen,
    row)``; lru, ttl: ascending ``(last_seen, row)``)."""
    n = entries.shape[0]
    keep = torch.ones(n, dtype=torch.bool, device=entries.device)
    if n <= capacity:
        return keep
    order = torch.argsort(entries[:, 2], stable=True)  # rows ascending already
    if eviction == "lfu":
        order = order[torch.argsort(entries[order, 1], stable=True)]
    keep[order[: n - capacity]] = False
    return keep
