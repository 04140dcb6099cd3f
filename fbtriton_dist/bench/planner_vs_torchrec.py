"""Our planner vs TorchRec's ``EmbeddingShardingPlanner`` on the same tables and topology.

Both plans (and ours with equal row blocks) are scored with *our* cost model
(fbtriton_dist.planner.cost) and printed side by side: the time each planner took, the
imbalance (max/mean over ranks) of the estimated per-rank step time, of memory and of
lookups, the slowest rank's time, and, with ``--simulate``, the same plans scored by the
simulation (``bench.simulate``: ids drawn from each table's distribution, the real bucketize,
the collectives' byte counts; the slowest simulated rank's time by the cost model's
coefficients, and the largest estimate-vs-simulation error over the simulated ranks and
terms). TorchRec plans on CPU with a CUDA topology; no GPU is needed. Usage::

    python -m fbtriton_dist.bench.planner_vs_torchrec [--tables configs/tables/criteo_terabyte.yaml]
        [--world-sizes 2 8 64] [--local-world-size 8] [--hbm-gb 80] [--batch-size 512] [--zipf A]
        [--simulate]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fbtriton_dist.planner import (
    IdDistribution,
    PlanCost,
    Shard,
    ShardingPlan,
    ShardingPlanner,
    TableSharding,
    TableSpec,
    load_tables,
)

DEFAULT_TABLES = os.path.join(
    os.path.dirname(__file__), "..", "..", "configs", "tables", "criteo_terabyte.yaml"
)
_TORCHREC_TYPES = {
    "row_wise": "row_wise",
    "table_wise": "table_wise",
    "column_wise": "column_wise",
    "table_column_wise": "column_wise",
    "table_row_wise": "table_row_wise",
    "grid_shard": "grid_shard",
    "data_parallel": "data_parallel",
}


@dataclass(frozen=True)
class Scored:
    """One plan's scores beyond the cost model's: its simulated step time (the slowest
    simulated rank, cost-model coefficients) and the largest |estimate error| there."""

    seconds: float
    """CPU seconds the planner took."""
    sim_step_s: float | None = None
    sim_error: float | None = None


@dataclass(frozen=True)
class Comparison:
    world_size: int
    ours: PlanCost
    torchrec: PlanCost
    equal_rows: PlanCost
    scores: dict[str, Scored] = field(default_factory=dict)
    """By planner name (``NAMES``)."""


NAMES = ("fbtriton_dist", "fbtriton (equal rows)", "torchrec")


def torchrec_plan(
    tables: Sequence[TableSpec], world_size: int, local_world_size: int, hbm_bytes: int, batch: int
) -> ShardingPlan:
    """Run TorchRec's planner on CPU (meta-device module, CUDA topology); return our plan type."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.modules.embedding_configs import DataType, PoolingType

    dtypes = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=list(t.features),
            pooling=PoolingType.SUM if t.pooling == "sum" else PoolingType.MEAN,
            data_type=dtypes[t.dtype],
        )
        for t in tables
    ]
    constraints = {
        t.name: ParameterConstraints(
            pooling_factors=list(t.pooling_factors or [1.0] * len(t.features))
        )
        for t in tables
    }
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    topology = Topology(
        world_size=world_size,
        local_world_size=local_world_size,
        compute_device="cuda",
        hbm_cap=hbm_bytes,
    )
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch, constraints=constraints, debug=False
    )
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()):
        plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    return from_torchrec(plan.plan[""], tables, world_size, local_world_size)


def from_torchrec(
    params: Mapping[str, object],
    tables: Sequence[TableSpec],
    world_size: int,
    local_world_size: int,
) -> ShardingPlan:
    """TorchRec's per-table ``ParameterSharding`` -> our :class:`ShardingPlan`."""
    out = []
    for t in tables:
        ps = params[t.name]
        kind = _TORCHREC_TYPES[ps.sharding_type]  # type: ignore[attr-defined]
        E, D = t.num_embeddings, t.embedding_dim
        if kind == "data_parallel":
            shards = [
                Shard(rank=r, row_start=0, row_end=E, col_start=0, col_end=D)
                for r in range(world_size)
            ]
        else:
            shards = [
                Shard(
                    rank=m.placement.rank(),
                    row_start=m.shard_offsets[0],
                    row_end=m.shard_offsets[0] + m.shard_sizes[0],
                    col_start=m.shard_offsets[1],
                    col_end=m.shard_offsets[1] + m.shard_sizes[1],
                )
                for m in ps.sharding_spec.shards  # type: ignore[attr-defined]
                if m.shard_sizes[0] > 0 and m.shard_sizes[1] > 0
            ]
            shards.sort(key=lambda s: (s.row_start, s.col_start))
        out.append(
            TableSharding(
                name=t.name, sharding=kind, num_embeddings=E, embedding_dim=D, shards=tuple(shards)
            )
        )
    return ShardingPlan(world_size=world_size, local_world_size=local_world_size, tables=tuple(out))


def compare(
    tables: Sequence[TableSpec],
    world_size: int,
    *,
    local_world_size: int = 8,
    hbm_bytes: int = 80 * 1024**3,
    batch_size: int = 512,
    stats: Mapping[str, IdDistribution] | None = None,
    simulate: bool = False,
) -> Comparison:
    from fbtriton_dist.planner import CostModel

    H = min(local_world_size, world_size)
    model = CostModel(batch_size=batch_size)
    ours = ShardingPlanner(
        world_size=world_size, local_world_size=H, hbm_bytes_per_rank=hbm_bytes, cost_model=model
    )
    equal = ShardingPlanner(
        world_size=world_size,
        local_world_size=H,
        hbm_bytes_per_rank=hbm_bytes,
        cost_model=model,
        row_cuts="equal",
    )
    import torchrec.distributed.planner  # noqa: F401, PLC0415 (its import is not planning time)

    plans, seconds = {}, {}  # CPU seconds: this machine is shared, wall time is noisy
    for name, make in ((NAMES[2], lambda: torchrec_plan(tables, world_size, H, hbm_bytes,
                                                        batch_size)),
                       (NAMES[0], lambda: ours.plan(tables, stats=stats)),
                       (NAMES[1], lambda: equal.plan(tables, stats=stats))):
        start = time.process_time()
        plans[name] = make()
        seconds[name] = time.process_time() - start
    plans[NAMES[2]].validate(tables)
    plans[NAMES[0]].validate(tables, budget_bytes=ours.budget_bytes)
    costs = {name: ours.cost(plan, tables, stats) for name, plan in plans.items()}
    scores = {name: Scored(seconds[name]) for name in NAMES}
    if simulate:
        from fbtriton_dist.bench import simulate as sim  # noqa: PLC0415 (torch)

        for name, plan in plans.items():
            run = sim.simulate(plan, tables, stats, batch_size=batch_size, estimate=costs[name])
            scores[name] = Scored(seconds[name], run.step_time(model),
                                  max(sim.max_errors(run, costs[name]).values()))
    return Comparison(world_size=world_size, ours=costs[NAMES[0]], torchrec=costs[NAMES[2]],
                      equal_rows=costs[NAMES[1]], scores=scores)


def format_rows(results: Sequence[Comparison]) -> str:
    simulated = any(s.sim_step_s is not None for c in results for s in c.scores.values())
    lines = [
        f"{'R':>4}  {'planner':<21} {'CPU s':>7} {'time max/mean':>13} {'slowest ms':>10} "
        f"{'memory max/mean':>15} {'lookups max/mean':>16}"
        + (f" {'sim slowest ms':>14} {'sim max |err|':>13}" if simulated else "")
    ]
    for c in results:
        for name, cost in zip(NAMES, (c.ours, c.equal_rows, c.torchrec), strict=True):
            score = c.scores.get(name, Scored(float("nan")))
            line = (
                f"{c.world_size:>4}  {name:<21} {score.seconds:>7.1f} {cost.imbalance():>13.3f} "
                f"{cost.max() * 1e3:>10.3f} "
                f"{cost.imbalance('memory_bytes'):>15.3f} {cost.imbalance('lookups'):>16.3f}"
            )
            if simulated and score.sim_step_s is not None:
                line += f" {score.sim_step_s * 1e3:>14.3f} {100 * score.sim_error:>12.1f}%"
            lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", default=DEFAULT_TABLES)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8, 64])
    p.add_argument("--local-world-size", type=int, default=8)
    p.add_argument("--hbm-gb", type=float, default=80.0)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--zipf", type=float, default=None, help="Zipf exponent for every table")
    p.add_argument("--simulate", action="store_true",
                   help="score the plans by the simulation too (bench.simulate)")
    args = p.parse_args(argv)
    table_set = load_tables(args.tables)
    stats = dict(table_set.stats)
    if args.zipf is not None:
        stats = {t.name: IdDistribution(kind="zipf", alpha=args.zipf) for t in table_set.tables}
    results = [
        compare(
            table_set.tables,
            R,
            local_world_size=args.local_world_size,
            hbm_bytes=int(args.hbm_gb * 1024**3),
            batch_size=args.batch_size,
            stats=stats,
            simulate=args.simulate,
        )
        for R in args.world_sizes
    ]
    print(
        f"tables: {args.tables}; batch {args.batch_size}/rank; HBM {args.hbm_gb:g} GiB; "
        "scored with our cost model" + (" and by the simulation" if args.simulate else "")
    )
    print(format_rows(results))


if __name__ == "__main__":
    main()
