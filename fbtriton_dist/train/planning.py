"""How a training job plans its tables: the one function the job and ``fbtriton-dist plan
JOB.yaml`` both call, so that the command's preview is the plan the job makes.

The job's settings that reach the planner: ``sharding.hbm_gb``, ``reserved``, ``row_cuts``,
``local_world_size``, ``plan``, ``group_size`` (an int, or ``auto``: the planner proposes it),
``replica_sync``, the bandwidths of ``cost``, the tiers' ``host_budget_gb``, ``disk_budget_gb``,
``file_dir`` and ``shard_tiers``; ``train.batch_size``; the embedding optimizer; the id
statistics (each table's ``id_distribution``, else ``data.synthetic.zipf`` for synthetic data;
managed tables uniform) and the constraints (managed tables limited to
:data:`MANAGED_SHARDINGS`). Never imports torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from fbtriton_dist.planner import (
    ConfigError,
    CostModel,
    FieldError,
    GroupedCost,
    IdDistribution,
    PlanCost,
    ShardingPlan,
    ShardingPlanner,
    TableConstraints,
    TableSpec,
    evaluate_grouped,
    plan_grouped,
    propose_group_size,
)
from fbtriton_dist.planner.cost_inputs import with_cost
from fbtriton_dist.planner.groups import format_candidates, format_grouped, group_size_candidates
from fbtriton_dist.planner.plan import check_group_size
from fbtriton_dist.planner.report import format_report
from fbtriton_dist.storage import Storage

from .config import JobConfig

__all__ = ["MANAGED_SHARDINGS", "JobPlan", "group_size", "job_constraints", "make_plan",
           "plan_job", "plan_storage"]

GiB = 1024**3

MANAGED_SHARDINGS = ("row_wise", "table_row_wise", "table_wise", "data_parallel")
"""How a managed table (``id_manager:``) may be sharded (``sharding/managed/sharded.py``)."""


@dataclass(frozen=True)
class JobPlan:
    """A job's plan with what made it: the planner (its budget, ``describe()``), the tables and
    id statistics it was costed with, the cost and the printed report. With replica groups
    (``group_size`` below the world) ``plan`` is the grouped plan (world R, ``group_size`` and
    ``replica_sync`` in it, what ``shard()`` takes) and ``cost`` its :class:`GroupedCost`."""

    plan: ShardingPlan
    planner: ShardingPlanner
    specs: Sequence[TableSpec]
    stats: Mapping[str, IdDistribution]
    cost: PlanCost | GroupedCost
    report: str

    @property
    def group_size(self) -> int:
        """S, the ranks of one replica group (the world when flat): ``sharding.group_size``,
        or what ``auto`` chose; the one source of S for the job."""
        return self.plan.group_world


def job_constraints(cfg: JobConfig) -> dict[str, TableConstraints]:
    """The table set's constraints, each managed table's shardings limited to
    :data:`MANAGED_SHARDINGS` (one that allows only others is an error naming it)."""
    out = dict(cfg.tables.constraints)
    for name in cfg.tables.id_managers:
        c = out.get(name, TableConstraints())
        allowed = [s for s in (c.sharding or MANAGED_SHARDINGS) if s in MANAGED_SHARDINGS]
        if not allowed:
            raise ConfigError("<job>", f"tables.{name}.sharding", (
                f"table '{name}' is managed (id_manager): expected some of "
                f"[{', '.join(MANAGED_SHARDINGS)}], got {list(c.sharding or ())}"))
        out[name] = dataclasses.replace(c, sharding=tuple(allowed))
    return out


def group_size(cfg: JobConfig, world_size: int) -> int:
    """The ranks one plan is for: ``sharding.group_size`` (replica groups), else the world;
    a size that does not divide ``world_size`` is an error naming both. ``auto`` is planned:
    :func:`plan_job`'s ``JobPlan.group_size`` is the job's S."""
    if cfg.sharding.group_size == "auto":
        raise ValueError("sharding.group_size: expected an integer for group_size(), got auto "
                         "(plan_job(...).group_size is the size auto plans)")
    S = cfg.sharding.group_size or world_size
    if world_size % S:
        raise ConfigError("<job>", "sharding.group_size", (
            f"expected a divisor of the world size {world_size} (groups of consecutive ranks), "
            f"got {S}"))
    return S


def plan_job(
    cfg: JobConfig,
    world_size: int,
    local_world_size: int,
    *,
    plan_path: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> JobPlan:
    """The job's plan for ``world_size`` ranks, ``local_world_size`` per host unless
    ``sharding.local_world_size`` says otherwise: planned, or read from ``plan_path`` (else
    ``sharding.plan``) and checked. With ``sharding.group_size`` S below the world the plan is
    grouped: one group's plan for S ranks (hosts of at most S ranks), replicated over R/S
    groups; ``auto``: the planner proposes S (``planner.groups.propose_group_size``, the
    candidates' table printed above the report; a world with one candidate plans it alone).
    A plan file is for S ranks, or a grouped plan for the world."""
    s = cfg.sharding
    R = world_size
    S = None if s.group_size == "auto" else group_size(cfg, R)
    H = min(s.local_world_size or local_world_size, R)
    if R % H:
        H = R
    if S is not None and S < R and S % H and H % S:
        H = S  # (before groups: a group's hosts of min(H, S) ranks) keeps the old plans
    specs = cfg.tables.tables
    stats = dict(cfg.tables.stats)
    if cfg.data.source == "synthetic" and cfg.data.synthetic.zipf > 0:
        zipf = IdDistribution(kind="zipf", alpha=cfg.data.synthetic.zipf)
        stats = {t.name: stats.get(t.name, zipf) for t in specs}
    for name in cfg.tables.id_managers:  # slots are handed out by arrival, not by hotness
        stats[name] = IdDistribution(kind="uniform")
    optimizer = cfg.optimizer.embedding.optimizer_name  # the planner knows the registry's names
    planner = ShardingPlanner(
        world_size=R,
        local_world_size=H,
        hbm_bytes_per_rank=s.hbm_gb * GiB,
        reserved_fraction=s.reserved,
        cost_model=with_cost(CostModel.with_wire(s.comm.wire_dtype, s.comm.backward_wire_dtype,
                                                 batch_size=cfg.train.batch_size,
                                                 replica_sync_dtype=s.replica_sync_dtype),
                             s.cost),
        optimizer=optimizer,
        row_cuts=s.row_cuts,
        progress=progress,
        host_bytes_per_rank=s.host_budget_gb * GiB if s.host_budget_gb is not None else None,
        disk_bytes_per_rank=s.disk_budget_gb * GiB if s.disk_budget_gb is not None else None,
        file_dir=cfg.path(s.file_dir) if s.file_dir is not None else None,
        shard_tiers=s.shard_tiers,
    )
    path = plan_path or (cfg.path(s.plan) if s.plan is not None else None)
    lines = []
    if path is not None:
        plan = _load_plan(path, cfg, R, H, S)
    elif S is None:  # auto
        sizes = group_size_candidates(R, H)
        if len(sizes) == 1:  # nothing to choose (small worlds): one plan, no search
            plan = _grouped(cfg, planner, specs, stats, sizes[0])
            lines.append(f"sharding.group_size auto: {sizes[0]} (the only candidate on "
                         f"{R} rank(s), {H} per host)")
        else:
            proposal = propose_group_size(planner, specs, job_constraints(cfg), stats,
                                          replica_sync=s.replica_sync)
            plan = proposal.plan
            if proposal.group_size == R:  # one group: the flat plan, as without group_size
                plan = dataclasses.replace(plan, group_size=None, replica_sync="step")
            lines += [format_candidates(proposal),
                      f"sharding.group_size auto: {proposal.group_size} "
                      f"({R // proposal.group_size} group(s) of {proposal.group_size} ranks)"]
    else:
        plan = _grouped(cfg, planner, specs, stats, S)
    plan = with_storage(plan, specs)
    plan.validate(specs, budget_bytes=planner.budget_bytes, optimizer=optimizer,
                  host_budget_bytes=planner.host_bytes_per_rank)
    if plan.group_world == R:
        cost = planner.cost(plan, specs, stats)
        title = f"job {cfg.name}: {len(specs)} tables on {planner.describe()}"
        lines.append(format_report(plan, specs, cost, stats, title=title))
    else:  # the group's plan, then the groups, sync and step (``plan --group-size``'s report)
        cost = evaluate_grouped(plan, specs, stats, planner.cost_model, optimizer)
        title = (f"job {cfg.name}: {len(specs)} tables on {R} ranks, {plan.num_groups} "
                 f"group(s) of {plan.group_world} ranks ({planner.describe()})")
        lines += [format_report(plan.group_plan(), specs, cost.group, stats, title=title),
                  format_grouped(cost)]
    return JobPlan(plan, planner, specs, stats, cost, "\n".join(lines))


def _grouped(cfg: JobConfig, planner: ShardingPlanner, specs, stats,
             S: int) -> ShardingPlan:
    """The plan for groups of S ranks: flat (no group size in it) when S is the world."""
    if S == planner.world_size:
        return planner.plan(specs, job_constraints(cfg), stats)
    return plan_grouped(planner, specs, job_constraints(cfg), stats, group_size=S,
                        replica_sync=cfg.sharding.replica_sync)


def _load_plan(path: str, cfg: JobConfig, R: int, H: int, S: int | None) -> ShardingPlan:
    """``sharding.plan`` (or ``plan_path``) checked against the job: a grouped plan for R
    ranks (its group size the job's, or any with ``auto``), else a plan for S ranks (R with
    ``auto``), made grouped when S is below R."""
    plan = ShardingPlan.load_yaml(path)
    if plan.group_size is not None and plan.group_world < plan.world_size:
        if plan.world_size != R or S not in (None, plan.group_size):
            raise ValueError(
                f"{path}: a grouped plan for world_size={plan.world_size}, group_size="
                f"{plan.group_size}; this job has {R} rank(s) and sharding.group_size="
                f"{cfg.sharding.group_size}; plan again or drop sharding.plan")
        return plan
    want = R if S is None else S
    if plan.world_size != want:
        raise ValueError(
            f"{path}: plan is for world_size={plan.world_size}, this job plans for "
            f"{want} rank(s) (the world, or sharding.group_size); plan again or "
            "drop sharding.plan"
        )
    if want == R:
        return plan
    try:
        check_group_size(R, H, want)
    except FieldError as e:
        raise ConfigError("<job>", "sharding.group_size", str(e)) from e
    return dataclasses.replace(plan, world_size=R, local_world_size=H, group_size=want,
                               replica_sync=cfg.sharding.replica_sync)


def with_storage(plan: ShardingPlan, specs) -> ShardingPlan:
    """``plan`` with each table's ``storage`` from the table set where the plan names none (a
    plan file written before tiers, or by hand); one that names another is an error."""
    by_name = {t.name: t for t in specs}
    tables = []
    for t in plan.tables:
        spec = by_name.get(t.name)
        want = spec.storage if spec is not None else None
        if t.storage is not None and want is not None and t.storage != want:
            raise ValueError(f"table '{t.name}': the plan's storage {t.storage} differs from "
                             f"the table set's {want}")
        tables.append(t if t.storage is not None or want is None
                      else dataclasses.replace(t, storage=want))
    return dataclasses.replace(plan, tables=tuple(tables))


def plan_storage(plan: ShardingPlan) -> dict[str, Storage]:
    """The storage of every table ``plan`` names one for (the table set's, or the tier the
    planner chose for ``storage: auto``; a table whose shards all name the same storage:
    theirs): what a job in one process builds its tables on. A table whose shards name
    different storage is refused (one process builds each table whole, on one tier)."""
    out = {}
    for t in plan.tables:
        kinds = list(dict.fromkeys(t.shard_storage(s) for s in t.shards))
        if len(kinds) > 1:
            raise ValueError(
                f"table '{t.name}': its shards name different storage tiers "
                f"{[s.tier if s is not None else None for s in kinds]}; a job in one process "
                "builds each table whole on one tier: give the plan's table one storage")
        if kinds[0] is not None:
            out[t.name] = kinds[0]
    return out


def make_plan(cfg: JobConfig, world_size: int, local_world_size: int) -> tuple[ShardingPlan, str]:
    """The plan (planned, or read from ``sharding.plan`` and checked) and its printed report."""
    p = plan_job(cfg, world_size, local_world_size)
    return p.plan, p.report
