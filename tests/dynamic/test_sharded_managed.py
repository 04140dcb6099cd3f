"""Sharded managed tables on real gloo process groups (2 and 3 ranks, uneven row cuts).

The reference is built independently of ``sharding/managed/sharded.py``: an unsharded plain
EmbeddingBagCollection on the global batch, whose raw ids are remapped by R simulated
managers (the spec, ``reference/id_remap.py``), one per row shard, each id routed to the
owner of its hash range (the hash and the ranges re-derived here from the documented formula),
each owner seeing its ids source rank after source rank; fresh rows drawn as documented and
their optimizer state zeroed. A wrong bucket, a wrong order, a wrong slot -> row offset or a
missed reset changes the outputs or the trained weights."""

import pytest
import torch
import torch.distributed as dist

from tests.sharding.harness import run_ranks
from tests.sharding.test_sharded_ebc import _row_cuts, _state_error

BATCH = [3, 5, 2]  # local batch sizes of ranks 0, 1, 2
STEPS = 6


def _configs():
    from torchrec import EmbeddingBagConfig, PoolingType

    c = EmbeddingBagConfig
    return [
        c(name="rw", num_embeddings=11, embedding_dim=4, feature_names=["f_rw", "f_rw2"]),
        c(name="tw", num_embeddings=7, embedding_dim=3, feature_names=["f_tw"],
          pooling=PoolingType.MEAN),
        c(name="dp", num_embeddings=6, embedding_dim=2, feature_names=["f_dp"]),
        c(name="plain", num_embeddings=5, embedding_dim=3, feature_names=["f_plain"]),
    ]


def _managed():
    from fbtriton_dist.id_manager import Admission, IdManagerConfig

    return {
        "rw": IdManagerConfig(capacity=10, eviction="lru"),
        "tw": IdManagerConfig(capacity=6, eviction="lfu", admission=Admission(min_count=2)),
        "dp": IdManagerConfig(capacity=5, eviction="ttl", ttl_steps=2),
    }


def _plan(R):
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding

    def rows(E, D):
        cuts = _row_cuts(E, R)
        return tuple(Shard(rank=r, row_start=cuts[r], row_end=cuts[r + 1], col_start=0,
                           col_end=D) for r in range(R))

    full = {"tw": (Shard(rank=0, row_start=0, row_end=7, col_start=0, col_end=3),),
            "dp": tuple(Shard(rank=r, row_start=0, row_end=6, col_start=0, col_end=2)
                        for r in range(R))}
    kinds = {"rw": "row_wise", "tw": "table_wise", "dp": "data_parallel", "plain": "row_wise"}
    tables = tuple(
        TableSharding(name=c.name, sharding=kinds[c.name], num_embeddings=c.num_embeddings,
                      embedding_dim=c.embedding_dim,
                      shards=full.get(c.name) or rows(c.num_embeddings, c.embedding_dim))
        for c in _configs())
    return ShardingPlan(world_size=R, local_world_size=R, tables=tables)


def _global_batch(step, B):
    """Drifting raw ids (a window of 14 ids moving by 3 per step; large, some negative)."""
    g = torch.Generator().manual_seed(100 + step)
    out = {}
    for c in _configs():
        for f in c.feature_names:
            lengths = torch.randint(0, 4, (B,), generator=g)
            n = int(lengths.sum())
            if c.name == "plain":
                values = torch.randint(0, 5, (n,), generator=g)
            else:
                k = torch.randint(3 * step, 3 * step + 14, (n,), generator=g)
                values = torch.where(k % 5 == 0, -k * 7919 - 1, k * 1_000_003 + 2**41)
            out[f] = (lengths, values)
    return out


def _kjt(batch, lo, hi, reverse=False):
    from torchrec import KeyedJaggedTensor

    keys = list(batch)[::-1] if reverse else list(batch)
    ls, vs = [], []
    for f in keys:
        lengths, values = batch[f]
        a, b = int(lengths[:lo].sum()), int(lengths[:hi].sum())
        ls.append(lengths[lo:hi])
        vs.append(values[a:b])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(vs), lengths=torch.cat(ls))


# -- the reference: R simulated managers per table, written from the docs ----------------------
def _hash(x):
    h = x * (0x9E3779B97F4A7C15 - 2**64)
    return (h ^ (h >> 31)) & (2**62 - 1)


class _Owner:
    """One simulated manager: the spec's state tensors, its first row, seed."""

    def __init__(self, cfg, capacity, r0, seed):
        from fbtriton_dist.id_manager import IdManagerConfig

        self.cfg = IdManagerConfig(capacity=capacity, eviction=cfg.eviction,
                                   ttl_steps=cfg.ttl_steps, admission=cfg.admission)
        self.r0, self.seed, C = r0, seed, capacity
        self.keys, self.counts = torch.zeros(C, dtype=torch.int64), torch.zeros(C, dtype=torch.int64)
        self.last_seen = torch.full((C,), -1, dtype=torch.int64)
        depth = self.cfg.admission.sketch_depth if self.cfg.sketch_width else 0
        self.sketch = torch.zeros(depth, self.cfg.sketch_width, dtype=torch.int64)

    def remap(self, ids, step, update):
        from fbtriton_dist.id_manager import POLICY_CODE
        from fbtriton_dist.reference import id_remap as spec

        stats = torch.zeros(len(spec.STATS), dtype=torch.int64)
        return spec.id_remap(ids, self.keys, self.counts, self.last_seen, self.sketch, stats,
                             step=step, policy=POLICY_CODE[self.cfg.eviction],
                             ttl_steps=self.cfg.ttl_steps or 0,
                             min_count=self.cfg.admission.min_count, update=update)


def _owners(name, cfg, R, seed):
    """The simulated owners of a table: (first hash of each, [_Owner])."""
    from fbtriton_dist.sharding.managed.sharded import owner_seed  # the documented per-owner seed

    C = cfg.capacity
    if name == "rw":
        cuts = _row_cuts(C + 1, R)
        caps = [cuts[i + 1] - cuts[i] - (1 if i == R - 1 else 0) for i in range(R)]
        starts = [0]
        for c in caps[:-1]:
            starts.append(starts[-1] + c)
        bounds = [(s << 62) // C for s in starts[1:]]
        return bounds, [_Owner(cfg, caps[i], cuts[i], owner_seed(seed, i, R)) for i in range(R)]
    return [], [_Owner(cfg, C, 0, seed)]  # table-wise and data-parallel: one map


def _reference_remap(ref, owners, batch, sizes, step, update):
    """The global batch's managed ids -> rows (in place in a copy of ``batch``), the fresh
    rows re-initialised in ``ref`` (weights, fused optimizer state)."""
    from fbtriton_dist.modules.managed import fresh_rows

    configs = {c.name: c for c in _configs()}
    out = dict(batch)
    for name, (bounds, mans) in owners.items():
        cfg = configs[name]
        # each feature's ids by source rank, then the table order inside each rank
        pieces = []  # (feature, start, end) in the order the owners see them
        for r in range(len(sizes)):
            lo, hi = sum(sizes[:r]), sum(sizes[: r + 1])
            for f in cfg.feature_names:
                lengths = batch[f][0]
                pieces.append((f, int(lengths[:lo].sum()), int(lengths[:hi].sum())))
        ids = torch.cat([batch[f][1][a:b] for f, a, b in pieces])
        owner = torch.searchsorted(torch.tensor(bounds, dtype=torch.int64), _hash(ids), right=True)
        rows = torch.empty_like(ids)
        weight = ref.embedding_bags[name].weight
        fused = ref.fused_optimizer_state_dict()  # views of the live state
        states = [v for k, v in fused.items() if k.startswith(f"embedding_bags.{name}.weight.")]
        for i, m in enumerate(mans):
            sel = owner == i
            slots, fresh = m.remap(ids[sel], step, update)
            rows[sel] = torch.where(slots == m.cfg.capacity, cfg.num_embeddings - 1, slots + m.r0)
            if fresh.numel():
                new = fresh_rows(configs[name], fresh.numel(), weight.shape[1], m.seed, step)
                with torch.no_grad():
                    weight[fresh + m.r0] = new
                    for s in states:
                        s[fresh + m.r0] = 0
        at = 0
        vals = {f: batch[f][1].clone() for f in cfg.feature_names}
        for f, a, b in pieces:
            vals[f][a:b] = rows[at : at + b - a]
            at += b - a
        for f in cfg.feature_names:
            out[f] = (batch[f][0], vals[f])
    return out


def _case(rank, world, opt_name):
    import copy

    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.modules.ebc import EmbeddingBagCollection

    cls, kwargs = {"rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.3, "eps": 1e-8}),
                   "sgd": (torch.optim.SGD, {"lr": 0.3})}[opt_name]
    torch.manual_seed(rank)  # different RNGs: the sharded seeds must still agree
    src = EmbeddingBagCollection(_configs(), managed=_managed())
    weights = {c.name: src.embedding_bags[c.name].weight.detach().clone() for c in _configs()}
    dist.broadcast_object_list(obj := [weights, {n: int(m.seed) for n, m in
                                                 src.id_managers.managers().items()}], src=0)
    weights, seeds = obj
    ref = EmbeddingBagCollection(_configs())
    with torch.no_grad():
        for c in _configs():
            ref.embedding_bags[c.name].weight.copy_(weights[c.name])
            src.embedding_bags[c.name].weight.copy_(weights[c.name])
    apply_optimizer_in_backward(cls, ref.parameters(), kwargs)
    apply_optimizer_in_backward(cls, src.parameters(), kwargs)
    sharded = fbtriton_dist.shard(src, _plan(world))
    owners = {n: _owners(n, cfg, world, seeds[n]) for n, cfg in _managed().items()}
    total_D = sum(c.embedding_dim * len(c.feature_names) for c in _configs())
    torch.manual_seed(0)
    dense = torch.nn.Linear(total_D, 1)
    dense_s = copy.deepcopy(dense)
    sizes = BATCH[:world]
    lo = sum(sizes[:rank])
    report = {}
    for step in range(STEPS):
        batch = _global_batch(step, sum(sizes))
        remapped = _reference_remap(ref, owners, batch, sizes, step, update=True)
        out_ref = ref(_kjt(remapped, 0, sum(sizes))).values()
        (dense(out_ref).sum() / world).backward()  # the sharded gradients are divided by R
        out = sharded(_kjt(batch, lo, lo + sizes[rank], reverse=rank % 2 == 1)).values()
        dense_s(out).sum().backward()
        report[f"step{step}.out"] = (out - out_ref[lo : lo + sizes[rank]]).abs().max().item()
        dense.zero_grad()
        dense_s.zero_grad()
    # eval: lookups only, nothing changes
    sharded.eval()
    ref.eval()
    batch = _global_batch(STEPS, sum(sizes))
    remapped = _reference_remap(ref, owners, batch, sizes, STEPS, update=False)
    with torch.no_grad():
        out_ref = ref(_kjt(remapped, 0, sum(sizes))).values()
        out = sharded(_kjt(batch, lo, lo + sizes[rank])).values()
    report["eval.out"] = (out - out_ref[lo : lo + sizes[rank]]).abs().max().item()
    full = sharded.gather_full_state_dict()
    report["weights"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    report["state"] = _state_error(ref, sharded, _configs())
    # the maps: each owner's slots at its rows, as the simulated owner's
    sd = sharded.state_dict()
    for name, (_, mans) in owners.items():
        for k in ("keys", "counts", "last_seen"):
            v = sd[f"id_managers._managed_collision_modules.{name}.{k}"]
            if name == "dp":
                pieces = [(0, v)]
            else:
                pieces = [(s.metadata.shard_offsets[0], s.tensor) for s in v.local_shards()]
            for r0, local in pieces:
                m = next(m for m in mans if m.r0 == r0)
                mine = getattr(m, k)
                if k == "keys":  # empty slots' keys mean nothing
                    mine, local = mine[m.last_seen >= 0], local[m.last_seen >= 0]
                report[f"map.{name}.{k}"] = float((mine != local).sum())
    metrics = sharded.metrics()
    report["metrics.step"] = float(any(metrics[n]["step"] != STEPS for n in _managed()))
    report["metrics.evicted"] = float(metrics["rw"]["total_evicted"] == 0)  # there were some
    return report


def _cases(rank, world):
    return {o: _case(rank, world, o) for o in ("rowwise_adagrad", "sgd")}


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_managed_matches_simulated_owners(world):
    for rank, reports in enumerate(run_ranks(_cases, world, timeout=120, pg_timeout=60)):
        for case, report in reports.items():
            for key, err in report.items():
                assert err < 2e-5, f"rank {rank} {case} {key}: {err}"
