"""Managed maps resharded on load (``sharding/managed/state.py``), on real gloo groups.

One spawned run of 3 ranks (a 2-rank subgroup for the 2-rank phases) saves two managed
collections with torch.distributed.checkpoint on 2 and on 3 ranks after ``K`` steps, loads
each onto the other world size (2 -> 3, 3 -> 2), and an unsharded module's checkpoint onto 3
(1 -> 3); the test process loads the 2-rank checkpoint into an unsharded module (2 -> 1).
Every resumed run trains ``M`` more steps on the same id stream.

* ``fit``: capacities no owner fills (checked: no eviction, no overflow), constant initial
  rows (so fresh rows do not depend on the owners' seeds), Adam (two per-element states and
  a step). The reference is one uninterrupted unsharded managed collection: every step's
  output and, at the end, each live id's row, optimizer state, ``counts`` and ``last_seen``
  must match. Tables: row-wise LRU over two features, row-wise LFU with admission, table-wise
  TTL (on the last rank, so it moves), data-parallel, and a plain table.
* ``ev``: small row-wise tables (LRU, LFU with admission, TTL) that evict before the save and
  after the load, random fresh rows, rowwise Adagrad; the stream is chosen so that loads drop
  ids where LFU's order differs from LRU's and TTL's ``(last_seen, row)`` from row order. The reference is written here from the documented rules,
  independently of the library: owners simulated on the spec (``reference/id_remap.py``) over
  a plain collection, the checkpoint re-inserted by the rule of ``managed_state.py``'s
  docstring (the owner of each id's hash keeps what fits, the policy's eviction order drops
  the rest, kept entries in saved-row order, sketches folded, seeds per new owner). At least
  one direction must drop ids, or the overflow rule would go untested.

Errors are checked too: the default planner on another world size, a changed eviction, other
row cuts of as many owners, another capacity, admission or table set, eviction 'none' that
cannot fit.
"""

import io

import pytest
import torch
import torch.distributed as dist

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import _row_cuts

K, M = 3, 3  # steps before the save, after the load
SPLITS = {1: [8], 2: [3, 5], 3: [3, 3, 2]}
B = 8
EV_SEEDS = {"lru": 1234, "lfu": 4321, "ttl": 555}
TOL = 2e-5


# -- the collections -------------------------------------------------------------------------
def _fit_configs(capacity_rw=60):
    from torchrec import EmbeddingBagConfig, PoolingType

    def c(name, E, D, features, init, **kw):
        return EmbeddingBagConfig(name=name, num_embeddings=E, embedding_dim=D,
                                  feature_names=features, weight_init_min=init,
                                  weight_init_max=init, **kw)

    return [c("rw", capacity_rw + 1, 4, ["f_rw", "f_rw2"], 0.1),
            c("adm", 61, 3, ["f_adm"], -0.05, pooling=PoolingType.MEAN),
            c("tw", 31, 2, ["f_tw"], 0.2),
            c("dp", 21, 2, ["f_dp"], 0.03),
            c("plain", 7, 3, ["f_plain"], 0.07)]


def _fit_managed(**change):
    from fbtriton_dist.id_manager import Admission, IdManagerConfig

    out = {"rw": IdManagerConfig(capacity=60, eviction="lru"),
           "adm": IdManagerConfig(capacity=60, eviction="lfu", admission=Admission(min_count=2)),
           "tw": IdManagerConfig(capacity=30, eviction="ttl", ttl_steps=2),
           "dp": IdManagerConfig(capacity=20, eviction="lru")}
    out.update(change)
    return {k: v for k, v in out.items() if v is not None}


def _ev_configs():
    from torchrec import EmbeddingBagConfig

    return [EmbeddingBagConfig(name="lru", num_embeddings=11, embedding_dim=4,
                               feature_names=["e_lru", "e_lru2"]),
            EmbeddingBagConfig(name="lfu", num_embeddings=13, embedding_dim=3,
                               feature_names=["e_lfu", "e_lfu2"]),
            EmbeddingBagConfig(name="ttl", num_embeddings=13, embedding_dim=2,
                               feature_names=["e_ttl"])]


def _ev_managed():
    from fbtriton_dist.id_manager import Admission, IdManagerConfig

    return {"lru": IdManagerConfig(capacity=10, eviction="lru"),
            "lfu": IdManagerConfig(capacity=12, eviction="lfu", admission=Admission(min_count=2)),
            "ttl": IdManagerConfig(capacity=12, eviction="ttl", ttl_steps=4)}


def _ev_weights():
    g = torch.Generator().manual_seed(7)
    return {c.name: torch.rand(c.num_embeddings, c.embedding_dim, generator=g) - 0.5
            for c in _ev_configs()}


def _plan(configs, kinds, R):
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding

    def shards(c):
        E, D, kind = c.num_embeddings, c.embedding_dim, kinds[c.name]
        if kind == "table_wise":
            return (Shard(rank=R - 1, row_start=0, row_end=E, col_start=0, col_end=D),)
        if kind == "data_parallel":
            return tuple(Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D)
                         for r in range(R))
        cuts = _row_cuts(E, R)
        return tuple(Shard(rank=r, row_start=cuts[r], row_end=cuts[r + 1], col_start=0,
                           col_end=D) for r in range(R))

    return ShardingPlan(world_size=R, local_world_size=R, tables=tuple(
        TableSharding(name=c.name, sharding=kinds[c.name], num_embeddings=c.num_embeddings,
                      embedding_dim=c.embedding_dim, shards=shards(c)) for c in configs))


FIT_KINDS = {"rw": "row_wise", "adm": "row_wise", "tw": "table_wise", "dp": "data_parallel",
             "plain": "row_wise"}
EV_KINDS = {"lru": "row_wise", "lfu": "row_wise", "ttl": "row_wise"}


def _unsharded(which, managed=None, seeds=True):
    """A fresh unsharded managed collection (the ``ev`` one with its weights and, with
    ``seeds``, its seeds; else the seeds are drawn, to be replaced by a load)."""
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from fbtriton_dist.modules.ebc import EmbeddingBagCollection

    if which == "fit":
        ebc = EmbeddingBagCollection(_fit_configs(), managed=managed or _fit_managed())
        apply_optimizer_in_backward(torch.optim.Adam, ebc.parameters(), {"lr": 0.05})
        return ebc
    ebc = EmbeddingBagCollection(_ev_configs(), managed=managed or _ev_managed())
    with torch.no_grad():
        for name, w in _ev_weights().items():
            ebc.embedding_bags[name].weight.copy_(w)
    for name, m in ebc.id_managers.managers().items():
        if seeds:
            m.seed.fill_(EV_SEEDS[name])
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.3, "eps": 1e-8})
    return ebc


def _sharded(which, R, group, managed=None, plan=None, seeds=True):
    import fbtriton_dist

    configs, kinds = (_fit_configs(), FIT_KINDS) if which == "fit" else (_ev_configs(), EV_KINDS)
    return fbtriton_dist.shard(_unsharded(which, managed, seeds),
                               plan or _plan(configs, kinds, R), process_group=group)


# -- the id stream ---------------------------------------------------------------------------
def _batch(which, step):
    """The global batch: per feature (lengths [B], raw ids); ids drift (fit: a window of 8
    moving by 2 per step; ev: 20 moving by 3), large and some negative."""
    g = torch.Generator().manual_seed(1001 * (which == "ev") + step)
    window, shift = (8, 2) if which == "fit" else (20, 3)
    out = {}
    for t, c in enumerate(_fit_configs() if which == "fit" else _ev_configs()):
        for f in c.feature_names:
            lengths = torch.randint(0, 4, (B,), generator=g)
            n = int(lengths.sum())
            if c.name == "plain":
                values = torch.randint(0, 7, (n,), generator=g)
            else:
                k = torch.randint(shift * step, shift * step + window, (n,), generator=g)
                values = torch.where(k % 5 == 0, -k * 7919 - 1 - t, k * 1_000_003 + 2**41 + t)
            out[f] = (lengths, values)
    return out


def _kjt(batch, lo, hi):
    from torchrec import KeyedJaggedTensor

    ls, vs = [], []
    for lengths, values in batch.values():
        a, b = int(lengths[:lo].sum()), int(lengths[:hi].sum())
        ls.append(lengths[lo:hi])
        vs.append(values[a:b])
    return KeyedJaggedTensor(keys=list(batch), values=torch.cat(vs), lengths=torch.cat(ls))


def _grad(which, step, width):
    return torch.randn(B, width, generator=torch.Generator().manual_seed(77 + step + 50 * (
        which == "ev")))


def _train(module, which, steps, lo, hi):
    """Train ``steps`` on samples ``[lo, hi)``: each step's output. A sharded module divides
    its gradients by its world size R, so its rank's gradient is R times its slice: every
    world size then takes the unsharded module's step on the whole batch."""
    outs = []
    R = module.layout.world_size if hasattr(module, "layout") else 1
    for step in steps:
        out = module(_kjt(_batch(which, step), lo, hi)).values()
        out.backward(_grad(which, step, out.shape[1])[lo:hi] * R)
        outs.append(out.detach().clone())
    return outs


def _state(which, module):
    return {which: module.state_dict(), f"{which}_fused": module.fused_optimizer_state_dict()}


def _per_id_sharded(sharded, group):
    """{(table, raw id): (row, [optimizer state rows], counts, last_seen)} of every live id,
    gathered from the group's owners."""
    mine = {}
    shards = {lt.table: (v, s) for lt, v, s in sharded.local_shards()}
    managers = sharded.id_managers.managers()
    for t, cfg in enumerate(sharded.table_configs()):
        m = managers.get(cfg.name)
        if m is None:
            continue
        view, states = shards[t]
        for s in torch.nonzero(m.last_seen >= 0).squeeze(1).tolist():
            mine[(cfg.name, int(m.keys[s]))] = (view[s].detach().clone(),
                                                 [st[s].reshape(-1).clone() for st in states],
                                                 int(m.counts[s]), int(m.last_seen[s]))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {k: v for d in everyone for k, v in d.items()}


def _per_id_unsharded(ebc):
    fused = ebc.fused_optimizer_state_dict()
    out = {}
    for name, m in ebc.id_managers.managers().items():
        weight = ebc.embedding_bags[name].weight
        states = [v for k, v in fused.items() if k.startswith(f"embedding_bags.{name}.weight.")]
        for s in torch.nonzero(m.last_seen >= 0).squeeze(1).tolist():
            out[(name, int(m.keys[s]))] = (weight[s].detach().clone(),
                                           [st[s].reshape(-1).clone() for st in states],
                                           int(m.counts[s]), int(m.last_seen[s]))
    return out


def _totals(metrics):
    return {n: (d["total_lookups"], d["total_evicted"], d["total_overflow"], d["step"])
            for n, d in metrics.items()}


# -- the spawned ranks -------------------------------------------------------------------------
def _save(rank, R, group, path):
    out = {}
    state = {}
    for which in ("fit", "ev"):
        sharded = _sharded(which, R, group)
        lo = sum(SPLITS[R][:rank])
        out[which] = _train(sharded, which, range(K), lo, lo + SPLITS[R][rank])
        state.update(_state(which, sharded))
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, process_group=group)
    return out


def _load(rank, R, group, path):
    import torch.distributed.checkpoint as dcp

    from fbtriton_dist.sharding.managed.state import ManagedLoadPlanner

    torch.manual_seed(100 + rank)  # other seeds and maps: all replaced by the load
    out = {}
    modules = {w: _sharded(w, R, group, seeds=False) for w in ("fit", "ev")}
    state = {k: v for w, m in modules.items() for k, v in _state(w, m).items()}
    dcp.load(state, checkpoint_id=path, planner=ManagedLoadPlanner(), process_group=group)
    lo = sum(SPLITS[R][:rank])
    for which, sharded in modules.items():
        sharded.load_state_dict(state[which])
        sharded.load_fused_optimizer_state_dict(state[f"{which}_fused"])
        out[which] = _train(sharded, which, range(K, K + M), lo, lo + SPLITS[R][rank])
        out[f"{which}.ids"] = _per_id_sharded(sharded, group)
        out[f"{which}.totals"] = _totals(sharded.metrics())
    return out


def _error(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the message is the result (DCP raises a
        # CheckpointException, a BaseException, with each rank's traceback)
        return f"{type(e).__name__}: {e}"
    return None


def _load_errors(rank, R, group, path, none_path):
    """What loading goes wrong with: the default planner onto other owners; another
    eviction; another row cut of as many owners (2 ranks); eviction 'none' that cannot fit."""
    import torch.distributed.checkpoint as dcp

    from fbtriton_dist.id_manager import IdManagerConfig
    from fbtriton_dist.sharding.managed.state import ManagedLoadPlanner

    out = {}
    if R == 3:
        sharded = _sharded("fit", R, group)
        out["default planner"] = _error(lambda: dcp.load(
            _state("fit", sharded), checkpoint_id=path, process_group=group))
        sharded = _sharded("fit", R, group, _fit_managed(rw=IdManagerConfig(capacity=60,
                                                                           eviction="lfu")))
        state = _state("fit", sharded)
        dcp.load(state, checkpoint_id=path, planner=ManagedLoadPlanner(), process_group=group)
        out["eviction"] = _error(lambda: sharded.load_state_dict(state["fit"]))
        sharded = _sharded("ev", R, group, {"lru": IdManagerConfig(capacity=10, eviction="none")})
        state = {"ev": sharded.state_dict()}
        dcp.load(state, checkpoint_id=none_path, planner=ManagedLoadPlanner(),
                 process_group=group)
        out["none"] = _error(lambda: sharded.load_state_dict(state["ev"]))
    else:
        from dataclasses import replace

        plan = _plan(_fit_configs(), FIT_KINDS, 2)
        a, b = plan.table("rw").shards
        moved = (replace(a, row_end=a.row_end + 3), replace(b, row_start=b.row_start + 3))
        plan = replace(plan, tables=tuple(t if t.name != "rw" else replace(t, shards=moved)
                                          for t in plan.tables))
        sharded = _sharded("fit", R, group, plan=plan)
        state = _state("fit", sharded)
        dcp.load(state, checkpoint_id=path, process_group=group)
        out["other cuts"] = _error(lambda: sharded.load_state_dict(state["fit"]))
    return out


def _ranks(rank, world, path):
    sub = dist.new_group([0, 1])
    out = {}
    if rank < 2:
        out["save2"] = _save(rank, 2, sub, f"{path}/r2")
    dist.barrier()
    out["save3"] = _save(rank, 3, None, f"{path}/r3")
    out["2to3"] = _load(rank, 3, None, f"{path}/r2")
    out["1to3"] = _load(rank, 3, None, f"{path}/r1")
    if rank < 2:
        out["3to2"] = _load(rank, 2, sub, f"{path}/r3")
        out["errors2"] = _load_errors(rank, 2, sub, f"{path}/r2", None)
    dist.barrier()
    out["errors3"] = _load_errors(rank, 3, None, f"{path}/r2", f"{path}/none")
    buffer = io.BytesIO()  # tensors through the result queue would outlive their process
    torch.save(out, buffer)
    return buffer.getvalue()


# -- the ev reference: owners simulated on the spec, re-inserted by the documented rule -------
def _hash(x):
    h = x * (0x9E3779B97F4A7C15 - 2**64)
    return (h ^ (h >> 31)) & (2**62 - 1)


def _layout(C, R):
    """(first row, slots) of the R owners of a row-wise managed table of C slots."""
    if R == 1:
        return [(0, C)]
    cuts = _row_cuts(C + 1, R)
    return [(cuts[i], cuts[i + 1] - cuts[i] - (i == R - 1)) for i in range(R)]


def _ranges(caps):
    starts = [sum(caps[:i]) for i in range(len(caps) + 1)]
    return [((a << 62) // starts[-1], (b << 62) // starts[-1]) for a, b in zip(starts, starts[1:], strict=False)]


class _Owner:
    """One simulated owner: the spec's state, its first row, its seed, its evictions."""

    def __init__(self, cfg, r0, capacity, seed):
        from fbtriton_dist.id_manager import IdManagerConfig

        self.cfg = IdManagerConfig(capacity=capacity, eviction=cfg.eviction,
                                   ttl_steps=cfg.ttl_steps, admission=cfg.admission)
        self.r0, self.seed = r0, seed
        self.keys = torch.zeros(capacity, dtype=torch.int64)
        self.counts = torch.zeros(capacity, dtype=torch.int64)
        self.last_seen = torch.full((capacity,), -1, dtype=torch.int64)
        depth = self.cfg.admission.sketch_depth if self.cfg.sketch_width else 0
        self.sketch = torch.zeros(depth, self.cfg.sketch_width, dtype=torch.int64)
        self.evicted = self.lookups = 0

    def remap(self, ids, step):
        from fbtriton_dist.id_manager import POLICY_CODE
        from fbtriton_dist.reference import id_remap as spec

        stats = torch.zeros(len(spec.STATS), dtype=torch.int64)
        out = spec.id_remap(ids, self.keys, self.counts, self.last_seen, self.sketch, stats,
                            step=step, policy=POLICY_CODE[self.cfg.eviction],
                            ttl_steps=self.cfg.ttl_steps or 0,
                            min_count=self.cfg.admission.min_count)
        self.evicted += int(stats[spec.STATS.index("evicted")])
        self.lookups += ids.numel()
        return out


class _Sim:
    """The ev collection as the docs say R owners per table run it, on a plain collection."""

    def __init__(self, R):
        from torchrec.optim import RowWiseAdagrad
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

        from fbtriton_dist.modules.ebc import EmbeddingBagCollection
        from fbtriton_dist.sharding.managed.sharded import owner_seed

        self.ref = EmbeddingBagCollection(_ev_configs())
        with torch.no_grad():
            for name, w in _ev_weights().items():
                self.ref.embedding_bags[name].weight.copy_(w)
        apply_optimizer_in_backward(RowWiseAdagrad, self.ref.parameters(), {"lr": 0.3, "eps": 1e-8})
        self.owners = {n: [_Owner(cfg, r0, c, owner_seed(EV_SEEDS[n], i, R))
                           for i, (r0, c) in enumerate(_layout(cfg.capacity, R))]
                       for n, cfg in _ev_managed().items()}
        self.dropped = 0

    def _states(self, name):
        fused = self.ref.fused_optimizer_state_dict()
        return [v for k, v in fused.items() if k.startswith(f"embedding_bags.{name}.weight.")]

    def step(self, step, R):
        """One training step on the global batch, split into R sources (one: the unsharded
        module's order, feature after feature): every output row."""
        from fbtriton_dist.modules.managed import fresh_rows

        batch, configs = _batch("ev", step), {c.name: c for c in _ev_configs()}
        remapped = dict(batch)
        for name, owners in self.owners.items():
            cfg = configs[name]
            pieces = []  # (feature, a, b): each source's ids, in the table's order
            for r in range(R):
                lo, hi = sum(SPLITS[R][:r]), sum(SPLITS[R][: r + 1])
                for f in cfg.feature_names:
                    lengths = batch[f][0]
                    pieces.append((f, int(lengths[:lo].sum()), int(lengths[:hi].sum())))
            ids = torch.cat([batch[f][1][a:b] for f, a, b in pieces])
            bounds = torch.tensor([lo for lo, _ in _ranges([o.cfg.capacity for o in owners])[1:]],
                                  dtype=torch.int64)
            who = torch.searchsorted(bounds, _hash(ids), right=True)
            rows = torch.empty_like(ids)
            weight = self.ref.embedding_bags[name].weight
            for i, o in enumerate(owners):
                slots, fresh = o.remap(ids[who == i], step)
                rows[who == i] = torch.where(slots == o.cfg.capacity, cfg.num_embeddings - 1,
                                             slots + o.r0)
                if fresh.numel():
                    with torch.no_grad():
                        weight[fresh + o.r0] = fresh_rows(cfg, fresh.numel(), weight.shape[1],
                                                          o.seed, step)
                        for s in self._states(name):
                            s[fresh + o.r0] = 0
            vals, at = {f: batch[f][1].clone() for f in cfg.feature_names}, 0
            for f, a, b in pieces:
                vals[f][a:b] = rows[at : at + b - a]
                at += b - a
            remapped.update({f: (batch[f][0], vals[f]) for f in cfg.feature_names})
        out = self.ref(_kjt(remapped, 0, B)).values()
        out.backward(_grad("ev", step, out.shape[1]))
        return out.detach().clone()

    @torch.no_grad()
    def reshard(self, R):
        """The checkpoint onto R owners, by the rule of sharding/managed/state.py's docstring."""
        from fbtriton_dist.sharding.managed.sharded import owner_seed

        for name, old in self.owners.items():
            cfg = _ev_managed()[name]
            entries = [(o.r0 + s, int(o.keys[s]), int(o.counts[s]), int(o.last_seen[s]))
                       for o in old for s in range(o.cfg.capacity) if o.last_seen[s] >= 0]
            layout = _layout(cfg.capacity, R)
            new = [_Owner(cfg, r0, c, owner_seed(EV_SEEDS[name], i, R))
                   for i, (r0, c) in enumerate(layout)]
            ranges, old_ranges = _ranges([c for _, c in layout]), _ranges(
                [o.cfg.capacity for o in old])
            weight, states = self.ref.embedding_bags[name].weight, self._states(name)
            w0, s0 = weight.clone(), [s.clone() for s in states]
            for o, (lo, hi) in zip(new, ranges, strict=True):
                mine = sorted(e for e in entries if lo <= _hash(torch.tensor(e[1])) < hi)
                order = (lambda e: (e[2], e[3], e[0])) if cfg.eviction == "lfu" else (
                    lambda e: (e[3], e[0]))
                drop = set(sorted(mine, key=order)[: max(0, len(mine) - o.cfg.capacity)])
                self.dropped += len(drop)
                kept = [e for e in mine if e not in drop]
                for slot, (row, key, count, last) in enumerate(kept):
                    slot = row if R == 1 else slot  # one owner: entries stay at their rows
                    o.keys[slot], o.counts[slot], o.last_seen[slot] = key, count, last
                    weight[o.r0 + slot] = w0[row]
                    for s, v in zip(states, s0, strict=True):
                        s[o.r0 + slot] = v[row]
                width = o.sketch.shape[1]
                for oo, (a, b) in zip(old, old_ranges, strict=True):
                    if a < hi and lo < b and width:
                        w = oo.sketch.shape[1]
                        o.sketch += (oo.sketch.reshape(-1, w // width, width).sum(1)
                                     if w >= width else oo.sketch.repeat(1, width // w))
            new[0].evicted = sum(o.evicted for o in old) + self.dropped
            new[0].lookups = sum(o.lookups for o in old)
            self.dropped = 0
            self.owners[name] = new

    def per_id(self):
        out = {}
        for name, owners in self.owners.items():
            weight, states = self.ref.embedding_bags[name].weight, self._states(name)
            for o in owners:
                for s in torch.nonzero(o.last_seen >= 0).squeeze(1).tolist():
                    row = o.r0 + s
                    out[(name, int(o.keys[s]))] = (weight[row].detach().clone(),
                                                   [st[row].reshape(-1).clone() for st in states],
                                                   int(o.counts[s]), int(o.last_seen[s]))
        return out

    def totals(self):
        return {n: (sum(o.lookups for o in os_), sum(o.evicted for o in os_))
                for n, os_ in self.owners.items()}


def _ev_reference(R_save, R_load):
    """(outputs of the M resumed steps, per-id state, totals, ids dropped by the load)."""
    sim = _Sim(R_save)
    for step in range(K):
        sim.step(step, R_save)
    before = sum(sum(o.evicted for o in os_) for os_ in sim.owners.values())
    sim.reshard(R_load)
    dropped = sum(sum(o.evicted for o in os_) for os_ in sim.owners.values()) - before
    outs = [sim.step(step, R_load) for step in range(K, K + M)]
    return outs, sim.per_id(), sim.totals(), dropped


# -- checks ----------------------------------------------------------------------------------
def _same_ids(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: live ids differ: {sorted(set(got) ^ set(want))}"
    for key, (row, states, counts, last) in want.items():
        g_row, g_states, g_counts, g_last = got[key]
        assert (g_counts, g_last) == (counts, last), f"{what} {key}: counts/last_seen"
        assert (g_row - row).abs().max() < TOL, f"{what} {key}: row {g_row} != {row}"
        for a, b in zip(g_states, states, strict=True):
            assert (a - b).abs().max() < TOL, f"{what} {key}: optimizer state {a} != {b}"


def _same_outputs(per_rank, want, R, what):
    """``per_rank[r]``: rank r's outputs (one per step) against the global ``want``."""
    for r, outs in enumerate(per_rank):
        lo, hi = sum(SPLITS[R][:r]), sum(SPLITS[R][: r + 1])
        for i, (a, b) in enumerate(zip(outs, want, strict=True)):
            err = (a - b[lo:hi]).abs().max().item() if a.numel() else 0.0
            assert err < TOL, f"{what} rank {r} step {i}: output off by {err}"


def _none_checkpoint(path):
    """An unsharded 'lru' map with eviction 'none', full, two of whose ids belong to the
    3-owner layout's first owner (1 slot): re-inserting it onto 3 ranks cannot fit."""
    import torch.distributed.checkpoint as dcp

    from fbtriton_dist.id_manager import IdManagerConfig

    (lo, hi), ids, x = _ranges([c for _, c in _layout(10, 3)])[0], [], 0
    while len(ids) < 10:
        x += 1
        first = lo <= _hash(torch.tensor(x)) < hi
        if first == (len(ids) < 2):
            ids.append(x)
    ebc = _unsharded("ev", {"lru": IdManagerConfig(capacity=10, eviction="none")})
    from torchrec import KeyedJaggedTensor

    features = [f for c in _ev_configs() for f in c.feature_names]
    ebc(KeyedJaggedTensor(keys=features, values=torch.tensor(ids),
                          lengths=torch.tensor([10] + [0] * (len(features) - 1))))
    dcp.save({"ev": ebc.state_dict()}, checkpoint_id=path, no_dist=True)


def test_managed_maps_reshard_on_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fbtriton_dist.sharding.managed.state import ManagedLoadPlanner

    path = str(tmp_path)
    # the fit reference: one unsharded run, uninterrupted; its step-K state is the 1-rank save
    fit = _unsharded("fit")
    ev1 = _unsharded("ev")
    fit_out = _train(fit, "fit", range(K), 0, B)
    ev1_out = _train(ev1, "ev", range(K), 0, B)
    dcp.save({**_state("fit", fit), **_state("ev", ev1)}, checkpoint_id=f"{path}/r1", no_dist=True)
    fit_out += _train(fit, "fit", range(K, K + M), 0, B)
    fit_ids, fit_totals = _per_id_unsharded(fit), _totals(fit.id_managers.metrics())
    assert all(t[1] == t[2] == 0 for t in fit_totals.values()), fit_totals  # nothing was full
    _none_checkpoint(f"{path}/none")

    results = [torch.load(io.BytesIO(r), weights_only=True)
               for r in run_ranks(_ranks, 3, path, timeout=240, pg_timeout=60)]

    # 2 -> 1: the 2-rank checkpoint into unsharded modules, here
    resumed = {w: _unsharded(w, seeds=False) for w in ("fit", "ev")}
    state = {k: v for w, m in resumed.items() for k, v in _state(w, m).items()}
    dcp.load(state, checkpoint_id=f"{path}/r2", planner=ManagedLoadPlanner(), no_dist=True)
    local = {}
    for w, m in resumed.items():
        m.load_state_dict(state[w])
        m.load_fused_optimizer_state_dict(state[f"{w}_fused"])
        local[w] = _train(m, w, range(K, K + M), 0, B)
        local[f"{w}.ids"] = _per_id_unsharded(m)
        local[f"{w}.totals"] = _totals(m.id_managers.metrics())

    # the saves: fit as the unsharded run, ev as its simulated owners
    for R, key in ((2, "save2"), (3, "save3")):
        _same_outputs([r[key]["fit"] for r in results[:R]], fit_out[:K], R, f"{key} fit")
        sim = _Sim(R)
        _same_outputs([r[key]["ev"] for r in results[:R]], [sim.step(s, R) for s in range(K)], R,
                      f"{key} ev")
    sim = _Sim(1)
    _same_outputs([ev1_out], [sim.step(s, 1) for s in range(K)], 1, "unsharded ev")

    # the loads
    drops = 0
    loads = {"2to3": (2, 3, [r["2to3"] for r in results]),
             "1to3": (1, 3, [r["1to3"] for r in results]),
             "3to2": (3, 2, [r["3to2"] for r in results[:2]]),
             "2to1": (2, 1, [local])}
    for name, (R_save, R_load, outs) in loads.items():
        _same_outputs([o["fit"] for o in outs], fit_out[K:], R_load, f"{name} fit")
        _same_ids(outs[0]["fit.ids"], fit_ids, f"{name} fit")
        assert outs[0]["fit.totals"] == fit_totals, f"{name} fit totals"
        ev_out, ev_ids, ev_totals, dropped = _ev_reference(R_save, R_load)
        drops += dropped
        _same_outputs([o["ev"] for o in outs], ev_out, R_load, f"{name} ev")
        _same_ids(outs[0]["ev.ids"], ev_ids, f"{name} ev")
        got = {n: t[:2] for n, t in outs[0]["ev.totals"].items()}
        assert got == ev_totals, f"{name} ev totals (lookups, evicted): {got} != {ev_totals}"
    assert drops > 0, "no load had to drop ids: the overflow rule went untested"

    # errors
    errors = {**results[0]["errors3"], **results[0]["errors2"]}
    assert "Size mismatch" in errors["default planner"], errors["default planner"]
    assert "_managed_collision_modules.rw." in errors["default planner"]
    assert errors["eviction"] == (
        "ValueError: table 'rw' id_manager.eviction: the checkpoint's is 'lru', this module's "
        "'lfu' (state-dict key 'id_managers._managed_collision_modules.rw.config')")
    assert errors["other cuts"].startswith(
        "ValueError: table 'rw' owners: the checkpoint's map was saved by owners (first row, "
        "slots) [[0, 20], [20, 40]], this module's are [[0, 23], [23, 37]]"), errors["other cuts"]
    assert errors["none"].startswith(
        "ValueError: table 'lru' is full with eviction 'none': re-inserting the checkpoint's "
        "map by owner, owner 0 (rank 0) gets 2 live ids for its 1 slots"), errors["none"]
    assert all(r["errors3"]["none"] == errors["none"] for r in results)  # every rank raised


@pytest.mark.parametrize("change, message", [
    ({"rw_capacity": 61}, r"table 'rw' id_manager\.capacity: the checkpoint's map has 60 slots, "
                          r"this module's 61 \(key 'fit\.id_managers\._managed_collision_modules"
                          r"\.rw\.keys'\)"),
    ({"rw": None}, r"table 'rw' is managed in the checkpoint \(key 'fit\.id_managers\."
                   r"_managed_collision_modules\.rw\.keys'\) but not in this module"),
    ({"plain": "managed"}, r"table 'plain': the checkpoint holds no id map for this managed "
                           r"table \(no key 'fit\.id_managers\._managed_collision_modules\.plain"
                           r"\.keys'; its managed tables: \['adm', 'dp', 'rw', 'tw'\]\)"),
    ({"adm": "min_count"}, r"table 'adm' id_manager\.admission\.min_count: the checkpoint's is "
                           r"2, this module's 3 \(state-dict key 'id_managers\."
                           r"_managed_collision_modules\.adm\.config'\)"),
], ids=["capacity", "unmanaged", "no map", "admission"])
def test_loading_another_table_config_names_the_table_and_key(tmp_path, change, message):
    import torch.distributed.checkpoint as dcp

    from fbtriton_dist.id_manager import Admission, IdManagerConfig
    from fbtriton_dist.modules.ebc import EmbeddingBagCollection
    from fbtriton_dist.sharding.managed.state import ManagedLoadPlanner

    saved = _unsharded("fit")
    _train(saved, "fit", range(2), 0, B)
    dcp.save(_state("fit", saved), checkpoint_id=str(tmp_path), no_dist=True)
    configs = _fit_configs(change.get("rw_capacity", 60))
    managed = _fit_managed(rw=IdManagerConfig(capacity=change["rw_capacity"])) if (
        "rw_capacity" in change) else _fit_managed(**{k: v for k, v in change.items()
                                                      if v is None})
    if change.get("plain") == "managed":
        managed["plain"] = IdManagerConfig(capacity=6)
    if change.get("adm") == "min_count":
        managed["adm"] = IdManagerConfig(capacity=60, eviction="lfu",
                                         admission=Admission(min_count=3))
    module = EmbeddingBagCollection(configs, managed=managed)
    state = _state("fit", module)
    # DCP wraps the planner's errors (CheckpointException, with the ValueError's text)
    with pytest.raises(BaseException, match=message):
        dcp.load(state, checkpoint_id=str(tmp_path), planner=ManagedLoadPlanner(), no_dist=True)
        module.load_state_dict(state["fit"])
