"""A plan's traffic, simulated: ids drawn from every table's distribution, cut by the real
bucketize, counted per rank and collective, side by side with the planner's estimate.

For every source rank s (its batch: B samples, each feature's bags of its pooling factor L,
``floor(L)`` or ``ceil(L)`` ids so the mean is L; ids drawn exactly from the table's
:class:`~fbtriton_dist.planner.IdDistribution` by its inverse CDF, ``inverse_cdf_array`` of
uniform numbers, so a row r is drawn with the share ``cdf(r+1) - cdf(r)`` the cost model
assumes), ``ops.bucketize`` (reference backend by default) cuts the bags by the shard-features
of the plan's layout (``sharding.dist.layout.ShardLayout``); the ids each destination q gets are
its lookups, and ``sharding.dist.input_dist.message`` gives the bytes of the message s -> q as the
input dist lays it out (int32 lengths, ids in the destination's id dtype, pieces padded to 8
bytes) plus the header all-to-all's fixed row. The output dist's bytes per collective are
``sharding.dist.output_dist.OutputDist.traffic`` (the element counts its all-to-alls are called
with; reduce-scatter and all-gather inside the host, forward and backward, the data-parallel
gradient all-gather); a sequence table's rows per id come from the same id counts.

Large R: past 16 ranks the destinations are a sample (8 ranks spread over 0..R-1 plus the
rank with the largest estimated time, ``sample_ranks``), past 64 the sources too
(``--sim-sources``, 32 spread ranks plus the destinations): every source's batch is drawn from
the same distributions, so what a destination gets from the ranks of a class (its host, other
hosts) is the sampled sources' mean times the class size. Not simulated: dedup, VBE, weighted
features (``CommOptions`` defaults: fp32 pooled values, no dedup). Usage::

    python -m fbtriton_dist.bench simulate TABLES.yaml --world-size R [--local-world-size H]
        [--zipf A] [--batch-size B] [--plan PLAN.yaml] [--sim-ranks 0 5 ...]
        [--sim-sources N] [--sim-seed S] [--sim-backend reference|cpu] [--sim-ids planner|job]

``fbtriton-dist plan TABLES.yaml --world-size R --simulate`` prints the same after the plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from fbtriton_dist.ops import bucketize as bucketize_ops
from fbtriton_dist.planner import (
    CostModel,
    IdDistribution,
    PlanCost,
    ShardingPlan,
    ShardingPlanner,
    TableSpec,
    evaluate,
    inverse_cdf_array,
    load_tables,
)
from fbtriton_dist.planner.arguments import add_simulate_arguments
from fbtriton_dist.planner.cost import CostAccumulator
from fbtriton_dist.planner.groups import (
    GroupedCost,
    data_parallel_world_bytes,
    evaluate_grouped,
    replica_syncs,
    sync_inter_share,
)
from fbtriton_dist.sharding.comm.wire import WireFormat
from fbtriton_dist.sharding.dist.input_dist import InputDist, message
from fbtriton_dist.sharding.dist.layout import ShardLayout
from fbtriton_dist.sharding.dist.output_dist import OutputDist
from fbtriton_dist.train.data import power_law_rows

FP32 = WireFormat("fp32")

__all__ = ["RankTraffic", "Simulation", "compare", "compare_collectives", "format_comparison",
           "max_collective_errors", "sample_ranks", "simulate", "simulate_grouped"]

UNIFORM = IdDistribution()
ALL_SOURCES_UP_TO = 64
"""At most this many ranks: every rank's batch is drawn (else ``DEFAULT_SOURCES``)."""
DEFAULT_SOURCES = 32
ALL_RANKS_UP_TO = 16
"""At most this many ranks: every rank is simulated (else ``sample_ranks``)."""
ID_LAWS = ("planner", "job")
"""``--sim-ids``: Zipf ids by the planner's discrete Zipf (``stats.inverse_cdf_array``, what
the estimate assumes) or as a training job's synthetic data draws them
(``train.data.power_law_rows``: the same law, exact on the first 1,024 rows and within a row
or so beyond; a check that the job's data is what the plan was made for)."""
TERMS = ("lookups", "input_dist_bytes", "output_dist_bytes", "inter_host_bytes")
"""What is compared, per rank (``RankCost`` field names)."""
_DTYPE = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16"}


@dataclass
class RankTraffic:
    """What one rank gets in one simulated step (bytes received, forward and backward)."""

    rank: int
    lookups: float = 0.0
    """Ids looked up (every source's ids for this rank's shard-features)."""
    lookup_bytes: float = 0.0
    """Bytes of the rows gathered: ids x columns x weight bytes."""
    collectives: dict[str, float] = field(default_factory=dict)
    """Bytes received per collective (``input_dist.header``, ``input_dist.data``,
    ``output_dist.*``, ``data_parallel.grad_all_gather``, ``sequence_dist.*``)."""
    inter_host_bytes: float = 0.0
    """The part of all of them that came from other hosts."""

    def add(self, name: str, value: float) -> None:
        self.collectives[name] = self.collectives.get(name, 0.0) + float(value)

    @property
    def input_dist_bytes(self) -> float:
        return sum(v for k, v in self.collectives.items() if k.startswith("input_dist."))

    @property
    def output_dist_bytes(self) -> float:
        return sum(v for k, v in self.collectives.items() if not k.startswith("input_dist."))

    def time_s(self, coefficients: np.ndarray) -> float:
        """The cost model's time of these terms (``CostAccumulator.coefficients``)."""
        row = dict.fromkeys(CostAccumulator.TERMS, 0.0)
        row.update(lookup_bytes=self.lookup_bytes, input_dist_bytes=self.input_dist_bytes,
                   output_dist_bytes=self.output_dist_bytes,
                   inter_host_bytes=self.inter_host_bytes)
        return float(coefficients @ np.array([row[t] for t in CostAccumulator.TERMS]))


@dataclass(frozen=True)
class Simulation:
    """Simulated ranks of one plan, and how they were simulated."""

    ranks: tuple[RankTraffic, ...]
    sources: tuple[int, ...]
    world_size: int
    local_world_size: int
    batch_size: int
    seed: int
    backend: str
    ids: str
    """How Zipf ids were drawn: ``planner`` (the estimate's discrete Zipf) or ``job``."""
    seconds: float
    """Wall seconds the simulation took."""
    cpu_seconds: float
    """CPU seconds of this process (the machine may be shared)."""

    def step_time(self, model: CostModel) -> float:
        """The slowest simulated rank's time by the cost model's coefficients (of a sample at
        large R: the max-estimate rank is in it)."""
        coef = CostAccumulator(self.world_size, self.local_world_size, model).coefficients
        return max(r.time_s(coef) for r in self.ranks)


def sample_ranks(world_size: int, estimate: PlanCost | None = None, n: int = 8) -> list[int]:
    """Every rank up to ``ALL_RANKS_UP_TO`` ranks, else ``n`` ranks spread evenly over
    0..R-1 plus the rank with the largest estimated time (deterministic)."""
    if world_size <= ALL_RANKS_UP_TO:
        return list(range(world_size))
    ranks = set(np.linspace(0, world_size - 1, n).round().astype(int).tolist())
    if estimate is not None:
        ranks.add(max(range(world_size), key=lambda r: estimate.ranks[r].time_s))
    return sorted(ranks)


def _sources(world_size: int, ranks: Sequence[int], n: int | None) -> list[int]:
    if n is None:
        n = world_size if world_size <= ALL_SOURCES_UP_TO else DEFAULT_SOURCES
    if n >= world_size:
        return list(range(world_size))
    spread = np.linspace(0, world_size - 1, max(n, 1)).round().astype(int).tolist()
    return sorted(set(spread) | set(ranks))


def _configs(tables: Sequence[TableSpec]) -> list[SimpleNamespace]:
    """EmbeddingBagConfig-like objects (read by attribute, as ``ShardLayout`` does); a
    sequence table has no ``pooling``, as an ``EmbeddingConfig``."""
    out = []
    for t in tables:
        c = SimpleNamespace(name=t.name, num_embeddings=t.num_embeddings,
                            embedding_dim=t.embedding_dim, feature_names=list(t.features),
                            data_type=_DTYPE[t.dtype])
        if t.pooling != "none":
            c.pooling = t.pooling.upper()
        out.append(c)
    return out


@dataclass
class _Collection:
    """One sharded collection of the plan (the pooled tables, or the sequence tables): its
    layout, and per feature (layout order) its table's spec and distribution."""

    layout: ShardLayout
    specs: list[TableSpec]
    dists: list[IdDistribution]
    L: list[float]
    sequence: bool

    @classmethod
    def of(cls, plan: ShardingPlan, tables: Sequence[TableSpec],
           stats: Mapping[str, IdDistribution], sequence: bool) -> _Collection | None:
        mine = [t for t in tables if (t.pooling == "none") == sequence]
        if not mine:
            return None
        sub = plan.subset(t.name for t in mine)
        layout = ShardLayout(_configs(mine), sub, plan.world_size)
        specs, dists, L = [], [], []
        for t in mine:
            for i in range(len(t.features)):
                specs.append(t)
                dists.append(stats.get(t.name, UNIFORM))
                L.append(float(t.pooling_factors[i]) if t.pooling_factors else 1.0)
        return cls(layout, specs, dists, L, sequence)


def _draw(coll: _Collection, features: Sequence[int], B: int, rng: np.random.Generator,
          ids: str = "planner"):
    """One rank's bags of ``features`` (layout feature indices): (values, offsets [K*B+1]),
    feature-major as a KJT's. ``ids="job"`` draws a Zipf table's ids as a training job's
    synthetic data does (``train.data.power_law_rows``) instead of by the planner's
    ``inverse_cdf_array``."""
    values, lengths = [], []
    for f in features:
        L = coll.L[f]
        base, frac = math.floor(L), L - math.floor(L)
        n = np.full(B, base, dtype=np.int64) + (rng.random(B) < frac)
        u = rng.random(int(n.sum()))
        dist, E = coll.dists[f], coll.specs[f].num_embeddings
        if ids == "job" and dist.kind == "zipf":
            values.append(power_law_rows(torch.from_numpy(u), E, dist.alpha).numpy())
        else:
            values.append(inverse_cdf_array(dist, E, u))
        lengths.append(n)
    offsets = np.zeros(len(features) * B + 1, dtype=np.int64)
    if features:
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
    vals = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(vals.astype(np.int64)), torch.from_numpy(offsets)


def _bucketized_counts(values: torch.Tensor, offsets: torch.Tensor,
                       ranges: Sequence[tuple[int, int, int]], B: int, backend: str) -> np.ndarray:
    """Ids of the batch in each ``(key, row_start, row_end)`` range: one ``ops.bucketize``
    over the distinct ranges (the replicas of a data-parallel table and the column slices of
    a table share theirs), the lengths it returns summed per range."""
    distinct = list(dict.fromkeys(ranges))
    if not distinct:
        return np.zeros(0, dtype=np.int64)
    key, lo, hi = (torch.tensor(col, dtype=torch.int64) for col in zip(*distinct, strict=True))
    lengths, _, _ = bucketize_ops.bucketize(values, offsets, None, key, lo, hi, B,
                                            backend=backend)
    per_range = lengths.view(len(distinct), B).sum(1).numpy()
    where = {r: i for i, r in enumerate(distinct)}
    return per_range[[where[r] for r in ranges]]


def _simulate_collection(coll: _Collection, ranks: Sequence[int], sources: Sequence[int],
                         B: int, seed: int, backend: str, out: dict[int, RankTraffic],
                         ids: str = "planner", wire: tuple[str, str] = ("fp32", "fp32")) -> None:
    """Add what every rank of ``ranks`` gets from ``coll`` in one step to ``out`` (pooled
    values and rows in the ``wire`` formats, forward and backward)."""
    fwd, bwd = (WireFormat(w) for w in wire)
    lay, R = coll.layout, coll.layout.world_size
    H = lay.local_world_size
    # the input dist's own numbers: each destination's id dtype, the header's width
    sender = InputDist(lay, 0, "cpu", [max(1, len(lay.local[0]))], backend="reference")
    n_sf = [len(q) for q in lay.local]
    # shard-features to bucketize against: the simulated ranks' (a sequence source also
    # needs every holder's, for the rows that come back to it)
    targets = [(q, sf) for q in ranks for sf in lay.local[q]]
    extra = [(h, sf) for h in range(R) for sf in lay.local[h] if not sf.data_parallel]
    ranks_set = set(ranks)
    # per destination and source: ids received and row bytes looked up, per shard-feature
    got: dict[int, dict[int, np.ndarray]] = {q: {} for q in ranks}
    own_dp_ids: dict[int, float] = {}  # sequence: values of a source's own rows of replicas
    back_rows: dict[int, tuple[float, float]] = {}  # sequence: values of the rows a simulated
    # source gets back (all, from other hosts)
    for s in sources:
        cut = targets + (extra if coll.sequence and s in ranks_set else [])
        features = sorted({sf.feature for _, sf in cut})
        key = {f: i for i, f in enumerate(features)}
        rng = np.random.default_rng([seed, s, int(coll.sequence)])
        values, offsets = _draw(coll, features, B, rng, ids)
        counts = _bucketized_counts(values, offsets, [(key[sf.feature], sf.row_start,
                                                        sf.row_end) for _, sf in cut], B, backend)
        at = 0
        for q in ranks:
            got[q][s] = counts[at:at + n_sf[q]]
            at += n_sf[q]
        if coll.sequence and s in ranks_set:
            back = [(h // H != s // H, fwd.nbytes(int(c) * sf.dim, int(c))) for (h, sf), c in
                    zip(cut[len(targets):], counts[len(targets):], strict=True) if h != s]
            back_rows[s] = (float(sum(n for _, n in back)), float(sum(n for f, n in back if f)))
        if coll.sequence:
            per_feature = np.diff(offsets.numpy()[::B])
            own_dp_ids[s] = float(sum(
                int(per_feature[key[sf.feature]]) * sf.dim
                for sf in lay.local[ranks[0]] if sf.data_parallel))
    hdr = 8.0 * sender.H  # the header all-to-all: a fixed [R, H] int64 block
    for q in ranks:
        t = out.setdefault(q, RankTraffic(q))
        sfs = lay.local[q]
        terms = {s: _from_source(coll, sfs, got[q][s], B, sender.id_dtype[q], hdr, bwd)
                 for s in sources}
        same, other = _scaled(q, H, R, terms)
        own = terms[q]
        t.lookups += own["ids"] + same["ids"] + other["ids"]
        t.lookup_bytes += own["row_bytes"] + same["row_bytes"] + other["row_bytes"]
        names = [k for k in own if "." in k]
        for k in names:
            t.add(k, same[k] + other[k])
        t.inter_host_bytes += sum(other[k] for k in names)
        if coll.sequence:  # forward: the rows of q's ids from every other holder
            t.add("sequence_dist.forward", back_rows[q][0])
            t.inter_host_bytes += back_rows[q][1]
            # backward of the replicas' own rows: an all-gather of every rank's gradient
            # rows, each padded to the most any rank has (fp32)
            dp = (R - 1) * max(own_dp_ids.values(), default=0.0) * 4
            t.add("data_parallel.grad_all_gather", dp)
            t.inter_host_bytes += dp * (R - H) / max(R - 1, 1)
            continue
        od = OutputDist(lay, q, torch.device("cpu"), (fwd, bwd))
        sizes = [B] * R
        traffic = od.traffic(sizes)
        for k, (_, received) in traffic.items():
            t.add(k, received)
        got_far = od.inter_host(sizes)[1]  # forward; backward: the same messages back
        sent_far = od.inter_host(sizes, backward=True)[0]
        dp = traffic["data_parallel.grad_all_gather"][1]
        t.inter_host_bytes += got_far + sent_far + dp * (R - H) / max(R - 1, 1)


def _from_source(coll: _Collection, sfs, counts: np.ndarray, B: int, id_dtype,
                 hdr: float, bwd: WireFormat = FP32) -> dict[str, float]:
    """What a destination holding ``sfs`` gets from one source whose batch put ``counts`` ids
    in them: ids, row bytes looked up, and bytes per collective (the input dist's message
    layout; a sequence table's gradient rows back, fp32)."""
    dims = np.array([sf.dim for sf in sfs], dtype=np.float64)
    row_bytes = np.array([coll.specs[sf.feature].dtype_bytes for sf in sfs]) * dims
    msg = message(len(sfs) * B, int(counts.sum()), 0, id_dtype, False, False)
    x = {"ids": float(counts.sum()), "row_bytes": float(counts @ row_bytes),
         "input_dist.header": hdr, "input_dist.data": float(msg.nbytes)}
    if coll.sequence:  # backward: the gradients of the rows of its ids here (not replicas)
        keep = np.array([not sf.data_parallel for sf in sfs], dtype=bool)
        x["sequence_dist.backward"] = float(bwd.nbytes(float(counts[keep] @ dims[keep]),
                                                       float(counts[keep].sum())))
    return x


def _scaled(q: int, H: int, R: int, terms: Mapping[int, dict[str, float]]) -> tuple[dict, dict]:
    """What ``q`` gets from the other ranks of its host and from the other hosts, given the
    ``terms`` of each sampled source: the sum over a class's sampled sources times (class
    size / sampled; the sources' batches are drawn from the same distributions), the plain
    sum when every rank is a source; a class without a sampled source takes the mean of all."""
    host = q // H
    everyone = [s for s in terms if s != q]
    classes = {"same": [s for s in everyone if s // H == host],
               "other": [s for s in everyone if s // H != host]}
    sizes = {"same": H - 1, "other": R - H}
    out = []
    for c in ("same", "other"):
        picked = classes[c] or everyone
        scale = sizes[c] / len(picked) if picked else 0.0
        out.append({k: scale * sum(terms[s][k] for s in picked) for k in terms[q]})
    return out[0], out[1]


def simulate(
    plan: ShardingPlan,
    tables: Sequence[TableSpec],
    stats: Mapping[str, IdDistribution] | None = None,
    *,
    batch_size: int = 512,
    ranks: Sequence[int] | None = None,
    sources: int | None = None,
    seed: int = 0,
    backend: str = "reference",
    estimate: PlanCost | None = None,
    ids: str = "planner",
    wire: tuple[str, str] = ("fp32", "fp32"),
) -> Simulation:
    """One step of ``plan`` simulated for ``ranks`` (default ``sample_ranks``), from the
    batches of every rank or a sample of ``sources`` ranks (see the module docstring);
    ``ids``: ``planner`` (the distribution the estimate assumes) or ``job`` (Zipf tables drawn
    as a training job's synthetic data, ``train.data.power_law_rows``); ``wire``: the output
    dist's (forward, backward) wire formats (``planner.cost.WIRE_FORMATS`` names)."""
    if ids not in ID_LAWS:
        raise ValueError(f"ids: expected one of {list(ID_LAWS)}, got {ids!r}")
    start, cpu = time.perf_counter(), time.process_time()
    R = plan.world_size
    ranks = sorted(set(ranks)) if ranks is not None else sample_ranks(R, estimate)
    bad = [r for r in ranks if not 0 <= r < R]
    if bad:
        raise ValueError(f"ranks: expected 0 <= rank < {R}, got {bad}")
    src = _sources(R, ranks, sources)
    out: dict[int, RankTraffic] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small ops: one thread is faster (2 cores: 2-5x)
    try:
        for sequence in (False, True):
            coll = _Collection.of(plan, tables, stats or {}, sequence)
            if coll is not None:
                _simulate_collection(coll, ranks, src, batch_size, seed, backend, out, ids,
                                     wire)
    finally:
        torch.set_num_threads(threads)
    return Simulation(ranks=tuple(out[r] for r in ranks), sources=tuple(src), world_size=R,
                      local_world_size=plan.local_world_size, batch_size=batch_size, seed=seed,
                      backend=backend, ids=ids, seconds=time.perf_counter() - start,
                      cpu_seconds=time.process_time() - cpu)


SYNC_GROUPS = 2
"""Groups whose ids are drawn for the ``step`` replica sync (every group's batch comes from
the same distributions: a replica receives (G-1) x their mean distinct rows)."""


def _group_ids(spec: TableSpec, dist: IdDistribution, n_samples: int, rng: np.random.Generator,
               ids: str) -> np.ndarray:
    """The distinct ids one group's ``n_samples`` samples look up in table ``spec`` (each
    feature's bags of floor(L) or ceil(L) ids, as ``_draw``), sorted."""
    out = []
    for i in range(len(spec.features)):
        L = float(spec.pooling_factors[i]) if spec.pooling_factors else 1.0
        base, frac = math.floor(L), L - math.floor(L)
        n = int(base * n_samples + (rng.random(n_samples) < frac).sum())
        u = rng.random(n)
        if ids == "job" and dist.kind == "zipf":
            out.append(power_law_rows(torch.from_numpy(u), spec.num_embeddings,
                                      dist.alpha).numpy())
        else:
            out.append(inverse_cdf_array(dist, spec.num_embeddings, u))
    return np.unique(np.concatenate(out)) if out else np.zeros(0, dtype=np.int64)


def simulate_grouped(
    plan: ShardingPlan,
    tables: Sequence[TableSpec],
    stats: Mapping[str, IdDistribution] | None = None,
    *,
    batch_size: int = 512,
    ranks: Sequence[int] | None = None,
    sources: int | None = None,
    seed: int = 0,
    backend: str = "reference",
    estimate: GroupedCost | None = None,
    ids: str = "planner",
    wire: tuple[str, str] = ("fp32", "fp32"),
    optimizer: str = "rowwise_adagrad",
    sync_groups: int = SYNC_GROUPS,
    replica_sync_dtype: str = "fp32",
) -> Simulation:
    """One step of a grouped plan (``planner/groups.py``) for local ``ranks`` of one group:
    :func:`simulate` of the group's plan on S ranks (its input and output dists), then each
    rank's replica sync: for the ``step`` sync's sparse all-gather, the distinct ids that
    ``sync_groups`` drawn groups' batches put in each of its shards, times G-1 other replicas,
    times the row's bytes; the dense all-reduce and the every-N average (which do not depend
    on the ids) by their ring sizes (the average's weights in ``replica_sync_dtype``);
    data-parallel tables' gradient all-gather over the whole world scaled from the group's.
    A flat plan: :func:`simulate`."""
    S, R, G = plan.group_world, plan.world_size, plan.num_groups
    flat = estimate.as_plan_cost() if estimate is not None else None
    sim = simulate(plan.group_plan(), tables, stats, batch_size=batch_size, ranks=ranks,
                   sources=sources, seed=seed, backend=backend, estimate=flat, ids=ids,
                   wire=wire)
    if G == 1:
        return sim
    start, cpu = time.perf_counter(), time.process_time()
    H = plan.local_world_size
    by_name = {t.name: (i, t) for i, t in enumerate(tables)}
    simulated = {r.rank for r in sim.ranks}
    model = CostModel(batch_size=batch_size, replica_sync_dtype=replica_sync_dtype)
    syncs = [x for x in replica_syncs(plan, tables, stats, model, optimizer)
             if x.rank in simulated]
    drawn: dict[str, list[np.ndarray]] = {}
    for name in sorted({x.table for x in syncs if x.collective.endswith("sparse_all_gather")}):
        i, spec = by_name[name]
        dist = (stats or {}).get(name, UNIFORM)
        drawn[name] = [_group_ids(spec, dist, S * batch_size,
                                  np.random.default_rng([seed, 7919, g, i]), ids)
                       for g in range(sync_groups)]
    far = sync_inter_share(S, G, H)
    dp_extra = data_parallel_world_bytes(plan, tables, batch_size)
    same_host = max(H - S, 0)
    for t in sim.ranks:
        for x in (x for x in syncs if x.rank == t.rank):
            if x.collective.endswith("sparse_all_gather"):
                unique = np.mean([np.searchsorted(u, x.row_end) - np.searchsorted(u, x.row_start)
                                  for u in drawn[x.table]])
                nbytes = (G - 1) * float(unique) * x.row_bytes
            else:
                nbytes = x.bytes
            t.add(x.collective, nbytes)
            t.inter_host_bytes += far * nbytes
        dp = t.collectives.get("data_parallel.grad_all_gather", 0.0)
        if dp_extra:  # the other groups' R-S ranks' rows, as many as each group rank's
            extra = dp * (R - S) / (S - 1) if S > 1 else dp_extra
            t.add("data_parallel.grad_all_gather", extra)
            t.inter_host_bytes += extra * (R - S - same_host) / (R - S)
    return dataclasses.replace(sim, seconds=sim.seconds + time.perf_counter() - start,
                               cpu_seconds=sim.cpu_seconds + time.process_time() - cpu)


def error(estimate: float, simulated: float) -> float:
    """(estimate - simulated) / simulated; 0 when both are 0, inf when only the estimate is
    not."""
    if simulated == 0:
        return 0.0 if estimate == 0 else math.inf
    return (estimate - simulated) / simulated


def compare(sim: Simulation, cost: PlanCost) -> list[tuple[int, dict[str, tuple[float, float,
                                                                                 float]]]]:
    """Per simulated rank, ``{term: (estimate, simulated, error)}`` for ``TERMS``."""
    rows = []
    for r in sim.ranks:
        est = cost.ranks[r.rank]
        rows.append((r.rank, {k: (float(getattr(est, k)), float(getattr(r, k)),
                                  error(float(getattr(est, k)), float(getattr(r, k))))
                              for k in TERMS}))
    return rows


def max_errors(sim: Simulation, cost: PlanCost) -> dict[str, float]:
    """The largest |error| of each term over the simulated ranks."""
    rows = compare(sim, cost)
    return {k: max(abs(terms[k][2]) for _, terms in rows) for k in TERMS}


def compare_collectives(sim: Simulation, cost: PlanCost) -> list[tuple[int, dict[str, tuple[
        float, float, float]]]]:
    """Per simulated rank, ``{collective: (estimate, simulated, error)}`` for every
    collective either side has (``cost`` from ``evaluate(..., collectives=True)``)."""
    names = sorted(set(cost.collectives) | {k for r in sim.ranks for k in r.collectives})
    rows = []
    for r in sim.ranks:
        pairs = {}
        for n in names:
            est = float(cost.collectives[n][r.rank]) if n in cost.collectives else 0.0
            got = r.collectives.get(n, 0.0)
            pairs[n] = (est, got, error(est, got))
        rows.append((r.rank, pairs))
    return rows


def max_collective_errors(sim: Simulation, cost: PlanCost) -> dict[str, float]:
    """The largest |error| of each collective's bytes over the simulated ranks."""
    rows = compare_collectives(sim, cost)
    return {n: max(abs(pairs[n][2]) for _, pairs in rows) for n in (rows[0][1] if rows else {})}


_HEAD = {"lookups": "lookups", "input_dist_bytes": "in-dist MB",
         "output_dist_bytes": "out-dist MB", "inter_host_bytes": "inter-host MB"}


def _pct(e: float) -> str:
    return "inf" if math.isinf(e) else f"{100 * e:+.1f}%"


def format_comparison(sim: Simulation, cost: PlanCost, model: CostModel | None = None) -> str:
    """The estimate and the simulation per rank side by side, with the error (estimate vs
    simulated, % of simulated), then the simulated bytes of each collective."""
    rows = compare(sim, cost)
    n_src = len(sim.sources)
    how = ("every rank's batch" if n_src == sim.world_size
           else f"{n_src} of {sim.world_size} ranks' batches, scaled to all")
    lines = [
        f"simulated {len(sim.ranks)} of {sim.world_size} ranks from {how}; B={sim.batch_size}, "
        f"seed {sim.seed}, ids {sim.ids}, bucketize backend {sim.backend}, {sim.seconds:.1f} s "
        f"({sim.cpu_seconds:.1f} s CPU)",
        "rank " + "".join(f"{_HEAD[k] + ' est':>18}{'sim':>14}{'err':>8}" for k in TERMS)]
    for rank, terms in rows:
        cells = []
        for k in TERMS:
            est, got, e = terms[k]
            scale = 1.0 if k == "lookups" else 1e-6
            fmt = "{:,.0f}" if k == "lookups" else "{:,.2f}"
            cells.append(f"{fmt.format(est * scale):>18}{fmt.format(got * scale):>14}{_pct(e):>8}")
        lines.append(f"{rank:<5}" + "".join(cells))
    worst = max_errors(sim, cost)
    lines.append("max |error|: " + ", ".join(f"{_HEAD[k].replace(' MB', '')} {_pct(v)[1:]}"
                                             for k, v in worst.items()))
    if model is not None:
        est_step = max(cost.ranks[r.rank].time_s for r in sim.ranks)
        lines.append(f"step time of the simulated ranks (cost model's coefficients): estimate "
                     f"{est_step * 1e3:.3f} ms, simulated {sim.step_time(model) * 1e3:.3f} ms")
    if not cost.collectives:  # no per-collective estimate: the simulation's bytes alone
        names = sorted({k for r in sim.ranks for k in r.collectives})
        lines.append("simulated MB received per collective")
        lines.append("rank " + "".join(f"{n:>{max(len(n), 9) + 2}}" for n in names))
        for r in sim.ranks:
            lines.append(f"{r.rank:<5}" + "".join(
                f"{r.collectives.get(n, 0.0) * 1e-6:>{max(len(n), 9) + 2},.3f}" for n in names))
        return "\n".join(lines)
    rows = compare_collectives(sim, cost)
    names = list(rows[0][1]) if rows else []
    width = {n: max(len(n), 15) + 2 for n in names}
    lines.append("MB received per collective, estimate / simulated")
    lines.append("rank " + "".join(f"{n:>{width[n]}}" for n in names))
    for rank, pairs in rows:
        lines.append(f"{rank:<5}" + "".join(
            f"{f'{pairs[n][0] * 1e-6:,.3f} / {pairs[n][1] * 1e-6:,.3f}':>{width[n]}}"
            for n in names))
    worst = max_collective_errors(sim, cost)
    lines.append("max |error| per collective: " + ", ".join(
        f"{n} {_pct(v)[1:]}" for n, v in worst.items()))
    return "\n".join(lines)


def run(plan: ShardingPlan, tables: Sequence[TableSpec], stats, cost: PlanCost,
        model: CostModel, args: argparse.Namespace) -> str:
    """Simulate ``plan`` with the options of ``planner.arguments.add_simulate_arguments`` and
    format the comparison (a grouped plan: one group's ranks, its replica sync included;
    ``cost`` may then be its ``GroupedCost``)."""
    if plan.group_world != plan.world_size:
        grouped = cost if isinstance(cost, GroupedCost) else evaluate_grouped(
            plan, tables, stats, model, getattr(args, "optimizer", None) or "rowwise_adagrad")
        sim = simulate_grouped(plan, tables, stats, batch_size=model.batch_size,
                               ranks=args.sim_ranks, sources=args.sim_sources,
                               seed=args.sim_seed, backend=args.sim_backend, estimate=grouped,
                               ids=getattr(args, "sim_ids", "planner"), wire=model.wire(),
                               optimizer=getattr(args, "optimizer", None) or "rowwise_adagrad",
                               replica_sync_dtype=model.replica_sync_dtype)
        head = (f"grouped plan: {plan.num_groups} groups of {plan.group_world} of "
                f"{plan.world_size} ranks, replica sync {plan.replica_sync}; local ranks of "
                f"one group simulated, the sync's distinct rows from {SYNC_GROUPS} drawn "
                f"groups")
        return head + "\n" + format_comparison(sim, grouped.as_plan_cost(), model)
    sim = simulate(plan, tables, stats, batch_size=model.batch_size, ranks=args.sim_ranks,
                   sources=args.sim_sources, seed=args.sim_seed, backend=args.sim_backend,
                   estimate=cost, ids=getattr(args, "sim_ids", "planner"), wire=model.wire())
    if not cost.collectives:  # the same estimate, its comm split per collective
        cost = evaluate(plan, tables, stats, model, collectives=True)
    return format_comparison(sim, cost, model)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("tables", metavar="TABLES.yaml")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--local-world-size", type=int, default=None, help="default min(R, 8)")
    p.add_argument("--hbm-gb", type=float, default=80.0)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--zipf", type=float, default=None, metavar="ALPHA",
                   help="Zipf exponent of every table without its own id_distribution")
    p.add_argument("--plan", metavar="PLAN.yaml", help="simulate this plan instead of planning")
    add_simulate_arguments(p)
    args = p.parse_args(argv)
    table_set = load_tables(args.tables)
    stats = dict(table_set.stats)
    if args.zipf is not None:
        zipf = IdDistribution(kind="zipf", alpha=args.zipf)
        stats = {t.name: stats.get(t.name, zipf) for t in table_set.tables}
    R = args.world_size
    H = args.local_world_size or min(R, 8)
    model = CostModel.with_wire(args.wire_dtype, args.backward_wire_dtype,
                                batch_size=args.batch_size)
    planner = ShardingPlanner(world_size=R, local_world_size=H,
                              hbm_bytes_per_rank=args.hbm_gb * 1024**3, cost_model=model)
    start = time.process_time()
    if args.plan:
        plan = ShardingPlan.load_yaml(args.plan)
        plan.validate(table_set.tables)
        if (plan.world_size, plan.local_world_size) != (R, H):
            raise SystemExit(f"{args.plan}: plan is for world_size={plan.world_size}, "
                             f"local_world_size={plan.local_world_size}; got {R}, {H}")
    else:
        plan = planner.plan(table_set.tables, table_set.constraints, stats)
    planned = time.process_time() - start
    if plan.group_world != plan.world_size:  # a grouped plan (--plan): its own cost
        cost = evaluate_grouped(plan, table_set.tables, stats, model, planner.optimizer)
    else:
        cost = evaluate(plan, table_set.tables, stats, model, planner.optimizer,
                        collectives=True)
    print(f"{args.plan or args.tables}: {len(table_set.tables)} tables on {planner.describe()}; "
          f"{'loaded' if args.plan else 'planned'} in {planned:.1f} s CPU")
    print(run(plan, table_set.tables, stats, cost, model, args))


if __name__ == "__main__":
    main()
