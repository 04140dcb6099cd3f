"""Managed tables (dynamic ids), sharded: each raw id is remapped by the rank that owns it.

A managed table of ``C`` slots (``C + 1`` rows, the last the default row) sharded by rows
(``row_wise``, ``table_row_wise``, ``table_wise``: shards of full columns) has one *owner*
per row shard. Owner ``i`` (rows ``[r0, r1)``) has ``c_i = r1 - r0`` slots (one less for the
shard that holds the default row ``C``) and its own ``IdManager`` of capacity ``c_i``: its
slot ``s`` is the table's row ``r0 + s``, its default slot ``c_i`` the table's default row
``C``. The owners also split the hashed id space in proportion to their slots:

    h(x) = ((x * 0x9E3779B97F4A7C15) ^ ((x * 0x9E3779B97F4A7C15) >> 31)) & (2**62 - 1)
    (int64 wrapping, arithmetic shift); owner i holds [floor(2**62 * sum(c_<i) / C),
    floor(2**62 * sum(c_<=i) / C))

so each id has one owner, the only one that ever gives it a slot. One step
(``managed_dist``, before the collection's own input dist):

1. each rank sends every id of a managed table to its owner (one count all-to-all and its
   host read, one int64 id all-to-all); a data-parallel table's ids go to every rank;
2. each owner remaps what it got as one batch, source rank after source rank, each
   source's ids in the unsharded module's table order (the table's features in config
   order, each feature's ids in KJT order), re-initialises its fresh rows (drawn as the
   unsharded module does, ``modules/managed.py`` ``fresh_rows``, from its own seed) and
   their fused optimizer state (zero), and sends each source its ids' rows back (a third
   all-to-all); a data-parallel table is remapped by every rank on the same global batch
   (rank after rank), so every replica keeps the same map, rows and state;
3. the KJT with the rows in place of the raw ids goes through the plain input dist, which
   sends each row to the shard that holds it, i.e. to the owner that assigned it.

A table-wise table has a single owner with all ``C`` slots: it remaps exactly as the
unsharded module would on the global batch taken rank after rank. Owner ``i`` of a row-wise
table draws its fresh rows from seed ``owner_seed(seed, i)`` (one owner: the table's seed).
Column-wise and grid shards of a managed table are refused.

State dict (``id_managers._managed_collision_modules.<table>.<buffer>``, the unsharded
names): ``keys``, ``counts``, ``last_seen`` are ShardedTensors of ``[C]`` (owner ``i``'s
slots at rows ``[r0, r0 + c_i)``: a slot's entry sits at its row, as unsharded); ``sketch``
one of ``[depth, sum of the owners' widths]``; ``step``, ``seed`` ``[owners]``; ``totals``
``[owners, len(STATS)]``; ``owners`` ``[owners, 2]`` (each owner's first row and slots) and
``config`` (the table's ``IdManagerConfig``, ``modules/managed.py`` ``CONFIG_FIELDS``) plain
tensors. Their local shards are the live buffers, so ``torch.distributed.checkpoint`` saves
and loads them in place. A data-parallel table's are the plain replicated tensors of the
unsharded module. A load checks ``config`` (an error names the table and the key). Loading
onto other owners (another world size or plan, an unsharded module's map, or into one)
re-inserts every id at the owner of its hash: ``sharding/managed/state.py``.
"""

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist.id_manager import IdManagerConfig
from fbtriton_dist.modules.managed import IdManager, config_tensor, fresh_rows, owner_seed
from fbtriton_dist.ops.id_remap import STATS
from fbtriton_dist.sharding.managed.hashing import HASH_BITS, hash_bounds, id_hash
from fbtriton_dist.sharding.managed.state import load_maps
from fbtriton_dist.sharding.modules.sharded_ebc import ShardedEmbeddingBagCollection
from fbtriton_dist.sharding.modules.sharded_ec import ShardedEmbeddingCollection
from fbtriton_dist.sparse import kjt_key_ranges, kjt_with_values

ROW_SHARDINGS = ("row_wise", "table_row_wise", "table_wise")


__all__ = ["HASH_BITS", "ROW_SHARDINGS", "ManagedShardedEmbeddingBagCollection",
           "ManagedShardedEmbeddingCollection", "ShardedIdManagers", "hash_bounds", "id_hash",
           "owner_seed"]


class _Table:
    """What the plan fixes about one managed table (the same on every rank)."""

    def __init__(self, t: int, cfg, config: IdManagerConfig, ts) -> None:
        self.t, self.name, self.config = t, cfg.name, config
        self.features = list(cfg.feature_names or [cfg.name])
        self.C = config.capacity
        self.replicated = ts.sharding == "data_parallel"
        if self.replicated:
            self.owners = []
            return
        if ts.sharding not in ROW_SHARDINGS or any(
            s.col_start != 0 or s.col_end != cfg.embedding_dim for s in ts.shards
        ):
            raise NotImplementedError(
                f"table '{cfg.name}': a managed table sharded {ts.sharding} (shards of columns) "
                f"is not supported; shard it {', '.join(ROW_SHARDINGS)} or data_parallel"
            )
        shards = sorted(ts.shards, key=lambda s: s.row_start)
        if len({s.rank for s in shards}) != len(shards):
            raise ValueError(f"table '{cfg.name}': a managed table needs one row shard per rank, "
                             f"got {[(s.rank, s.row_start, s.row_end) for s in shards]}")
        # (rank, first row, slots): the shard holding the default row has one slot less
        self.owners = [(s.rank, s.row_start, s.row_end - s.row_start - (s.row_end > self.C))
                       for s in shards]
        for rank, r0, c in self.owners:
            if c < 1:
                raise ValueError(
                    f"table '{cfg.name}': the row shard [{r0}, {r0 + c + 1}) on rank {rank} "
                    "holds only the default row; a managed table's row shards need >= 1 slot"
                )
        self.bounds = hash_bounds([c for _, _, c in self.owners])

    def owner_index(self, rank: int) -> int | None:
        return next((i for i, (r, _, _) in enumerate(self.owners) if r == rank), None)


def _local_config(config: IdManagerConfig, capacity: int) -> IdManagerConfig:
    return IdManagerConfig(capacity=capacity, eviction=config.eviction,
                           ttl_steps=config.ttl_steps, admission=config.admission)


class ShardedIdManagers(nn.Module):
    """This rank's id managers of a sharded collection's managed tables: one per table it
    owns rows of (all of a data-parallel table), named as unsharded
    (``_managed_collision_modules.<table>``)."""

    def __init__(self, collection, source, device, backend: str) -> None:
        super().__init__()
        self.rank = collection.rank
        self.group = collection.group
        self.world = collection.layout.world_size
        self.local_world = collection.layout.local_world_size
        self.device_type = collection.device.type
        configs = collection.table_configs()
        sources = source.managers()
        seeds = torch.tensor([int(sources[c.name].seed) for c in configs if c.name in sources],
                             dtype=torch.int64, device=collection.device)
        dist.broadcast(seeds, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                       group=self.group)  # one seed per table on every rank
        self.tables: list[_Table] = []
        managers = {}
        for t, cfg in enumerate(configs):
            if cfg.name not in sources:
                continue
            src = sources[cfg.name]
            info = _Table(t, cfg, src.config, collection.plan.table(cfg.name))
            seed = int(seeds[len(self.tables)])
            self.tables.append(info)
            if info.replicated:
                m = IdManager(cfg.name, src.config, device=device, backend=backend)
            else:
                i = info.owner_index(self.rank)
                if i is None:
                    continue
                m = IdManager(cfg.name, _local_config(src.config, info.owners[i][2]),
                              device=device, backend=backend)
                seed = owner_seed(seed, i, len(info.owners))
                if int(src.step) and len(info.owners) > 1:
                    raise NotImplementedError(
                        f"table '{cfg.name}': sharding a managed table whose map is in use "
                        f"(step {int(src.step)}) row-wise needs its ids re-inserted by owner; "
                        "shard it before training, or save it with torch.distributed.checkpoint "
                        "and load that into the sharded module with planner="
                        "ManagedLoadPlanner() (sharding/managed/state.py)"
                    )
            if int(src.step) and (info.replicated or len(info.owners) == 1):
                m.load_state_dict(src.state_dict())  # one owner / replicas: the same map
            m.seed.fill_(seed)
            managers[cfg.name] = m
        self._managed_collision_modules = nn.ModuleDict(managers)

    def managers(self) -> dict[str, IdManager]:
        return dict(self._managed_collision_modules.items())

    # -- one step -----------------------------------------------------------------------------
    def remap(self, features, update: bool):
        """``features`` (this rank's KJT) with every managed table's raw ids replaced by
        rows, and per local table ``(fresh slots, step)``; collective (3 all-to-alls)."""
        R, me, M = self.world, self.rank, len(self.tables)
        ranges = kjt_key_ranges(features)
        values = features.values()
        dev = values.device
        spans, batches = [], []
        for info in self.tables:
            s = [ranges[f] for f in info.features if f in ranges]
            if s and values.dtype != torch.int64:
                raise ValueError(
                    f"table '{info.name}' ids: expected int64 raw ids (KeyedJaggedTensor values) "
                    f"for a managed table, got {values.dtype}"
                )
            spans.append(s)
            parts = [values[a:b] for a, b in s]
            batches.append(torch.cat(parts) if parts else values.new_zeros(0, dtype=torch.int64))
        # who gets what: (destination, table) major, each table's ids in batch order
        ids, dest, table, pos = [], [], [], []
        for m, (info, x) in enumerate(zip(self.tables, batches, strict=True)):
            n = x.numel()
            if info.replicated:  # every rank remaps the global batch
                d = torch.arange(R, device=dev).repeat_interleave(n)
                x_all, p = x.repeat(R), torch.arange(n, device=dev).repeat(R)
            else:
                i = torch.searchsorted(torch.tensor(info.bounds, dtype=torch.int64, device=dev),
                                       id_hash(x), right=True)
                ranks = torch.tensor([r for r, _, _ in info.owners], dtype=torch.int64,
                                     device=dev)
                d, x_all, p = ranks[i], x, torch.arange(n, device=dev)
            ids.append(x_all)
            dest.append(d)
            table.append(torch.full_like(d, m))
            pos.append(p)
        ids, dest, table, pos = (torch.cat(v) if v else values.new_zeros(0, dtype=torch.int64)
                                 for v in (ids, dest, table, pos))
        key = dest * M + table
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=R * M).view(R, M)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        sent_h, recv_h = torch.stack([counts, recv_counts]).tolist()  # the host read
        recv = ids.new_empty(sum(map(sum, recv_h)))
        dist.all_to_all_single(recv, ids[order].contiguous(), [sum(c) for c in recv_h],
                               [sum(c) for c in sent_h], group=self.group)
        # remap, table by table, what every source sent (source rank after source rank)
        starts = torch.tensor([0, *recv_counts.reshape(-1).cumsum(0).tolist()])
        managers, fresh, own, back = self.managers(), {}, {}, {}
        for m, info in enumerate(self.tables):
            if info.name not in managers:
                continue
            chunks = [(int(starts[r * M + m]), int(starts[r * M + m + 1])) for r in range(R)]
            x = torch.cat([recv[a:b] for a, b in chunks])
            slots, new, step = managers[info.name].remap(x, update)
            fresh[info.name] = (new, step)
            if info.replicated:
                at = sum(b - a for a, b in chunks[:me])
                own[m] = slots[at : at + chunks[me][1] - chunks[me][0]]
                continue
            _, r0, c = info.owners[info.owner_index(me)]
            rows = torch.where(slots == c, info.C, slots + r0)
            at = 0
            for r, (a, b) in enumerate(chunks):
                back[(r, m)] = rows[at : at + b - a]
                at += b - a
        rows_back = self._send_back(back, sent_h, recv_h, ids)
        # rows_back follows the send order, data-parallel tables' entries left out
        sorted_table, sorted_pos = table[order], pos[order]
        flags = torch.tensor([t.replicated for t in self.tables] or [False], device=dev)
        keep = ~flags[sorted_table]
        sorted_table, sorted_pos = sorted_table[keep], sorted_pos[keep]
        out = values.clone() if any(spans) else values
        for m, (info, s) in enumerate(zip(self.tables, spans, strict=True)):
            if not s:
                continue
            if info.replicated:
                rows = own[m]
            else:
                sel = sorted_table == m
                rows = torch.empty_like(batches[m])
                rows[sorted_pos[sel]] = rows_back[sel]
            at = 0
            for a, b in s:
                out[a:b] = rows[at : at + b - a]
                at += b - a
        return (kjt_with_values(features, out) if any(spans) else features), fresh

    def _send_back(self, back, sent_h, recv_h, ids) -> torch.Tensor:
        """Each owner's rows to the sources of its ids: one all-to-all, in the order the ids
        were sent (data-parallel tables' entries left out)."""
        R = self.world
        rw = [m for m, t in enumerate(self.tables) if not t.replicated]
        if not rw:
            return ids.new_zeros(0)
        empty = ids.new_zeros(0)
        pieces = [back.get((r, m), empty) for r in range(R) for m in rw]
        out = ids.new_empty(sum(sent_h[q][m] for q in range(R) for m in rw))
        dist.all_to_all_single(out, torch.cat(pieces), [sum(sent_h[q][m] for m in rw)
                                                        for q in range(R)],
                               [sum(recv_h[r][m] for m in rw) for r in range(R)],
                               group=self.group)
        return out

    # -- state ------------------------------------------------------------------------------
    def sharded_state(self, prefix: str) -> dict:
        """The state-dict entries of every managed table (the module docstring's form)."""
        out, managers = {}, self.managers()
        for info in self.tables:
            p = f"{prefix}_managed_collision_modules.{info.name}."
            m = managers.get(info.name)
            if info.replicated:
                out.update({p + k: v for k, v in m.state_dict().items()})
                continue
            for k, (size, offsets, local) in self.pieces(info, m).items():
                out[p + k] = _sharded_tensor(self.group, self.local_world, self.device_type, size,
                                             offsets, local)
            out[p + "owners"] = torch.tensor([[r0, c] for _, r0, c in info.owners],
                                             dtype=torch.int64)
            out[p + "config"] = config_tensor(info.config)
        return out

    def pieces(self, info: _Table, m: IdManager | None) -> dict:
        """buffer -> (global size, [(rank, offsets, sizes)] of every owner, local tensor)."""
        n_owners = len(info.owners)
        widths = [_local_config(info.config, c).sketch_width for _, _, c in info.owners]
        depth = info.config.admission.sketch_depth if widths[0] else 0
        wstart = [sum(widths[:i]) for i in range(n_owners)]
        out = {}
        for k in ("keys", "counts", "last_seen"):
            out[k] = ((info.C,), [(r, (r0,), (c,)) for r, r0, c in info.owners],
                      getattr(m, k) if m is not None else None)
        out["sketch"] = ((depth, sum(widths)),
                         [(r, (0, wstart[i]), (depth, widths[i]))
                          for i, (r, _, _) in enumerate(info.owners)],
                         m.sketch if m is not None else None)
        for k in ("step", "seed"):
            out[k] = ((n_owners,), [(r, (i,), (1,)) for i, (r, _, _) in enumerate(info.owners)],
                      getattr(m, k).view(1) if m is not None else None)
        out["totals"] = ((n_owners, len(STATS)),
                         [(r, (i, 0), (1, len(STATS))) for i, (r, _, _) in enumerate(info.owners)],
                         m.totals.view(1, -1) if m is not None else None)
        return out

    def metrics(self) -> dict[str, dict[str, float]]:
        """Per managed table, over all its owners (a collective: one all-reduce): the
        last step's ``STATS`` and totals summed, ``hit_rate``, ``occupancy`` (occupied
        slots / capacity), ``step``. A data-parallel table's numbers are its replica's."""
        S, managers = len(STATS), self.managers()
        rows = torch.zeros(len(self.tables), 2 * S + 2, dtype=torch.int64)
        for j, info in enumerate(self.tables):
            m = managers.get(info.name)
            if m is None or (info.replicated and self.rank != 0):
                continue
            rows[j, :S], rows[j, S : 2 * S] = m.last.cpu(), m.totals.cpu()
            rows[j, 2 * S] = int((m.last_seen >= 0).sum())
            rows[j, 2 * S + 1] = int(m.step)
        dev = next((m.last.device for m in managers.values()), torch.device("cpu"))
        rows = rows.to(dev)
        dist.all_reduce(rows, group=self.group)
        out = {}
        for j, info in enumerate(self.tables):
            v = rows[j].tolist()
            d: dict[str, float] = dict(zip(STATS, v[:S], strict=True))
            d["hit_rate"] = v[1] / v[0] if v[0] else 0.0
            d["occupancy"] = v[2 * S] / info.C
            owners = 1 if info.replicated else len(info.owners)
            d["step"] = v[2 * S + 1] // owners
            d.update({f"total_{k}": x for k, x in zip(STATS, v[S : 2 * S], strict=True)})
            out[info.name] = d
        return out


def _sharded_tensor(group, local_world: int, kind: str, size, metas, local):
    """A ShardedTensor of global ``size`` whose shard on each owner is given by ``metas``
    (``(rank, offsets, sizes)``, from the plan: no collective); ``local``: this rank's."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
        TensorProperties,
    )

    shards = []
    for r, off, sz in metas:
        where = f"rank:{r}/cuda:{r % local_world}" if kind == "cuda" else f"rank:{r}/cpu"
        shards.append(ShardMetadata(list(off), list(sz), where))
    mine = [Shard(local, m) for (r, _, _), m in zip(metas, shards, strict=True)
            if local is not None and r == dist.get_rank(group)]
    meta = ShardedTensorMetadata(shards, torch.Size(size), TensorProperties(dtype=torch.int64))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        mine, meta, process_group=group)


class _Managed:
    """What the managed sharded collections add: ``id_managers`` (``ShardedIdManagers``),
    the managed dist before the input dist, the fresh rows reset, the maps in the state
    dict."""

    def _init_managed(self, managed, backend: str) -> None:
        self.id_managers = ShardedIdManagers(self, managed, self.device, backend)

    def input_dist_is_pure(self) -> bool:
        """No: the managed dist updates the id maps and resets fresh rows."""
        return False

    def input_dist(self, features):
        """The managed dist (raw ids -> rows by their owners, fresh rows reset; the module
        docstring), then the plain input dist of the rows."""
        remapped, fresh = self.id_managers.remap(features, update=self.training)
        self._reset_fresh(fresh)
        return super().input_dist(remapped)

    @torch.no_grad()
    def _reset_fresh(self, fresh: Mapping) -> None:
        shards = {lt.table: (view, states) for lt, view, states in self.local_shards()}
        managers = self.id_managers.managers()
        index = {c.name: t for t, c in enumerate(self.table_configs())}
        for name, (slots, step) in fresh.items():
            if slots.numel() == 0:
                continue
            t = index[name]
            cfg = self.table_configs()[t]
            view, states = shards[t]
            rows = fresh_rows(cfg, slots.numel(), view.shape[1], int(managers[name].seed), step)
            at = slots.to(view.device)
            view[at] = rows.to(view.device, view.dtype)
            for state in states:
                state[at] = 0

    def metrics(self) -> dict[str, dict[str, float]]:
        """``ShardedIdManagers.metrics`` (a collective)."""
        return self.id_managers.metrics()

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        out = super().state_dict(destination=destination, prefix=prefix)
        out.update(self.id_managers.sharded_state(f"{prefix}id_managers."))
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """The weights, then the maps (``managed.state.load_maps``: this rank's pieces, the
        config checked, ids re-inserted by owner when saved by other owners: a collective)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        load_maps(self, state_dict, f"{prefix}id_managers.")


class ManagedShardedEmbeddingBagCollection(_Managed, ShardedEmbeddingBagCollection):
    """A ShardedEmbeddingBagCollection whose managed tables (``managed``: the unsharded
    collection's ``id_managers``) take raw ids: ``sharding/managed/sharded.py`` says how."""

    def __init__(self, configs, plan, *, managed, **kwargs) -> None:
        super().__init__(configs, plan, **kwargs)
        self._init_managed(managed, kwargs.get("backend", "auto"))


class ManagedShardedEmbeddingCollection(_Managed, ShardedEmbeddingCollection):
    """The same for a ShardedEmbeddingCollection."""

    def __init__(self, configs, plan, *, managed, **kwargs) -> None:
        super().__init__(configs, plan, **kwargs)
        self._init_managed(managed, kwargs.get("backend", "auto"))
