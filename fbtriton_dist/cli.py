"""The ``fbtriton-dist`` command: one argparse subcommand per task (``plan``, ``train``,
``report``).

Exit status: 0 done, 1 the tables do not fit (the message says which table and by how much),
2 bad input (a YAML error names the file, the key path and the valid choices).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["build_parser", "main"]

GiB = 1024**3


def _bounded(low: float, high: float | None, *, strict: bool = False,
             strict_high: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low`` (> with ``strict``), <= ``high`` (< with
    ``strict_high``); anything else is a usage error (exit 2) naming the flag and the bound."""

    def number(text: str) -> float:
        value = float(text)
        lo = f"> {low:g}" if strict else f">= {low:g}"
        bound = lo if high is None else f"{lo} and {'<' if strict_high else '<='} {high:g}"
        ok = math.isfinite(value) and (value > low if strict else value >= low)
        if ok and high is not None:
            ok = value < high if strict_high else value <= high
        if not ok:
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text}")
        return value

    return number


PLAN_DEFAULTS = {"hbm_gb": 80.0, "reserved": 0.1, "batch_size": 512,
                 "optimizer": "rowwise_adagrad", "row_cuts": "balanced", "memory_tolerance": 0.01}
"""``plan``'s defaults for a table-set file (a job file brings its own)."""

JOB_KEYS = {"hbm_gb": "sharding.hbm_gb", "reserved": "sharding.reserved",
            "batch_size": "train.batch_size", "optimizer": "optimizer.embedding.type",
            "row_cuts": "sharding.row_cuts", "local_world_size": "sharding.local_world_size",
            "zipf": "data.synthetic.zipf", "host_budget_gb": "sharding.host_budget_gb",
            "disk_budget_gb": "sharding.disk_budget_gb",
            "replica_sync_dtype": "sharding.replica_sync_dtype"}
"""``plan``'s options given with a job file: the job key each one overrides."""


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from fbtriton_dist.planner.arguments import (
        add_group_arguments,
        add_simulate_arguments,
        positive_int,
    )
    from fbtriton_dist.planner.tables import OPTIMIZERS

    p = sub.add_parser(
        "plan",
        allow_abbrev=False,
        help="shard a table set over ranks and print per-rank memory, lookups, comm, imbalance",
        description=(
            "Plan how the tables of TABLES.yaml are sharded over --world-size ranks, print the "
            "plan and its estimated per-rank cost, and optionally write it as YAML (--out). "
            "With --check, evaluate an existing plan file instead of planning."
        ),
    )
    p.add_argument("tables", metavar="TABLES.yaml",
                   help="table set (see docs/planner.md), or a job file: then the plan the job "
                        "makes (its sharding, batch size, optimizer and id settings; the "
                        "options below override those keys)")
    p.add_argument("--world-size", type=positive_int, required=True, help="R, number of ranks")
    p.add_argument(
        "--local-world-size", type=positive_int, default=None, help="ranks per host (default 8)"
    )
    p.add_argument("--hbm-gb", type=_bounded(0, None, strict=True), default=None,
                   help="HBM per rank in GiB (default 80)")
    p.add_argument("--host-budget-gb", type=_bounded(0, None, strict=True), default=None,
                   help="host memory per rank in GiB for the backing stores of tables on the "
                        "host / cached storage tiers (default: not checked)")
    p.add_argument("--disk-budget-gb", type=_bounded(0, None, strict=True), default=None,
                   help="disk per rank in GiB for the files of tables on the file storage tier "
                        "(default: not checked)")
    p.add_argument("--auto-tiers", action="store_true",
                   help="choose the storage tier (device, cached, file) and cache size of every "
                        "table without storage: (tables with storage: auto always get one)")
    p.add_argument("--shard-tiers", action="store_true",
                   help="with tiers chosen (--auto-tiers, storage: auto): a tier per shard, the "
                        "hot shards of cached tables back on device where their rank has room "
                        "(with a job file: its sharding.shard_tiers)")
    p.add_argument("--file-dir", metavar="DIR", default=None,
                   help="directory of the files of tables the planner puts on the file tier "
                        "(default: none, such a table is an error)")
    p.add_argument(
        "--reserved",
        type=_bounded(0, 1, strict_high=True),
        default=None,
        help="share of HBM kept for the dense model and buffers, in [0, 1) (default 0.1)",
    )
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="B per rank (default 512)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                   help="fused optimizer of tables that name none (default rowwise_adagrad)")
    p.add_argument(
        "--zipf",
        type=_bounded(0, None),
        default=None,
        metavar="ALPHA",
        help="Zipf exponent of the ids of every table without its own id_distribution",
    )
    p.add_argument(
        "--row-cuts",
        choices=("balanced", "equal"),
        default=None,
        help="skew-aware row cuts (default) or TorchRec-style equal row blocks",
    )
    p.add_argument(
        "--memory-tolerance",
        type=_bounded(0, None),
        default=None,
        metavar="T",
        help="the memory pass may raise the step time by this share to even out memory "
             "(default 0.01; 0: only moves that keep the step time)",
    )
    p.add_argument("--cost", metavar="COST.yaml", default=None,
                   help="the cost model's bandwidths (bytes/s) from this file's cost: mapping, "
                        "e.g. what `python -m fbtriton_dist.bench link --out` measured (with a "
                        "job file: over its sharding.cost keys)")
    p.add_argument("--out", metavar="PLAN.yaml", help="write the plan here (atomically)")
    p.add_argument("--check", metavar="PLAN.yaml", help="evaluate this plan instead of planning")
    p.add_argument("--png", metavar="FILE.png",
                   help="draw per-rank memory, lookups and traffic as bars (needs matplotlib)")
    p.add_argument("--simulate", action="store_true",
                   help="draw ids from each table's distribution, run the real bucketize and "
                        "count every rank's lookups and traffic; print them next to the "
                        "estimate (needs torch; python -m fbtriton_dist.bench simulate)")
    add_simulate_arguments(p)
    add_group_arguments(p)
    p.set_defaults(func=_run_plan)


def _job_file(path: str) -> bool:
    """Whether ``path`` is a job file (anything but ``defaults`` and ``tables`` at the top)."""
    from fbtriton_dist.planner._yaml import read_yaml

    data = read_yaml(path)
    return isinstance(data, dict) and bool(set(data) - {"defaults", "tables"})


def _run_plan(args: argparse.Namespace) -> int:
    if _job_file(args.tables):
        return _run_plan_job(args)
    from fbtriton_dist.planner import (
        CostModel,
        IdDistribution,
        ShardingPlan,
        ShardingPlanner,
        load_tables,
    )
    from fbtriton_dist.planner.cost_inputs import read_cost_file, with_cost
    from fbtriton_dist.planner.report import format_report

    for key, value in PLAN_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    table_set = load_tables(args.tables)
    specs = table_set.tables
    stats = dict(table_set.stats)
    if args.zipf is not None:
        zipf = IdDistribution(kind="zipf", alpha=args.zipf)
        stats = {t.name: stats.get(t.name, zipf) for t in specs}
    H = args.local_world_size or min(args.world_size, 8)
    if args.world_size % H:
        H = args.world_size if args.local_world_size is None else H
    planner = ShardingPlanner(
        world_size=args.world_size,
        local_world_size=H,
        hbm_bytes_per_rank=args.hbm_gb * GiB,
        reserved_fraction=args.reserved,
        cost_model=with_cost(CostModel.with_wire(args.wire_dtype, args.backward_wire_dtype,
                                                 batch_size=args.batch_size,
                                                 replica_sync_dtype=args.replica_sync_dtype
                                                 or "fp32"),
                             read_cost_file(args.cost) if args.cost else {}),
        optimizer=args.optimizer,
        row_cuts=args.row_cuts,
        memory_tolerance=args.memory_tolerance,
        progress=_progress,
        host_bytes_per_rank=(args.host_budget_gb * GiB if args.host_budget_gb is not None
                             else None),
        disk_bytes_per_rank=(args.disk_budget_gb * GiB if args.disk_budget_gb is not None
                             else None),
        auto_tiers=args.auto_tiers, file_dir=args.file_dir, shard_tiers=args.shard_tiers,
    )
    if args.check:
        if args.group_size is not None:
            raise ValueError("--group-size: --check evaluates the plan's own group_size")
        plan = ShardingPlan.load_yaml(args.check)
        if (plan.world_size, plan.local_world_size) != (args.world_size, H):
            raise ValueError(
                f"{args.check}: plan is for world_size={plan.world_size}, local_world_size="
                f"{plan.local_world_size}; the command line says {args.world_size}, {H}"
            )
    elif args.group_size is not None:
        plan = _plan_groups(args, planner, specs, table_set.constraints, stats)
    else:
        plan = planner.plan(specs, table_set.constraints, stats)
    if plan.group_size is not None:
        return _grouped_outputs(args, plan, planner, specs, stats)
    plan.validate(specs, budget_bytes=planner.budget_bytes, optimizer=args.optimizer,
                  host_budget_bytes=planner.host_bytes_per_rank)
    cost = planner.cost(plan, specs, stats)
    title = f"{args.check or args.tables}: {len(specs)} tables on {planner.describe()}"
    report = format_report(plan, specs, cost, stats, title=title)
    return _plan_outputs(args, plan, planner, specs, stats, cost, report)


def _plan_groups(args, planner, specs, constraints, stats):
    """``plan --group-size S|auto``: a grouped plan (``planner/groups.py``); auto prints
    every candidate's estimate first."""
    from fbtriton_dist.planner import groups

    if args.group_size != "auto":
        return groups.plan_grouped(planner, specs, constraints, stats,
                                   group_size=args.group_size, replica_sync=args.replica_sync)
    proposal = groups.propose_group_size(planner, specs, constraints, stats,
                                         replica_sync=args.replica_sync)
    print(groups.format_candidates(proposal))
    return proposal.plan


def _grouped_outputs(args, plan, planner, specs, stats) -> int:
    """The report of a grouped plan: one group's plan, then the groups, sync and step."""
    from fbtriton_dist.planner import groups
    from fbtriton_dist.planner.report import format_report

    plan.validate(specs, budget_bytes=planner.budget_bytes, optimizer=planner.optimizer,
                  host_budget_bytes=planner.host_bytes_per_rank)
    cost = groups.evaluate_grouped(plan, specs, stats, planner.cost_model, planner.optimizer)
    sub = groups.group_planner(planner, plan.group_world, plan.replica_sync)
    title = (f"{args.check or args.tables}: {len(specs)} tables on {plan.world_size} ranks, "
             f"{plan.num_groups} group(s) of {sub.describe()}")
    report = format_report(plan.group_plan(), specs, cost.group, stats, title=title)
    return _plan_outputs(args, plan, planner, specs, stats, cost,
                         f"{report}\n{groups.format_grouped(cost)}")


def _run_plan_job(args: argparse.Namespace) -> int:
    """``plan JOB.yaml``: the plan the job makes on ``--world-size`` ranks (the job's own
    planning function, ``train/planning.py``), options overriding the job's keys."""
    from fbtriton_dist.train.config import load_job  # torch-free
    from fbtriton_dist.train.planning import plan_job

    if args.auto_tiers or args.file_dir is not None:
        raise ValueError("--auto-tiers / --file-dir: a job's tables say their storage; give "
                         "them storage: auto (the planner chooses) or a file tier with its "
                         "path (the job's sharding.file_dir)")
    if args.memory_tolerance is not None:
        raise ValueError("--memory-tolerance: a job plans with the planner's default "
                         "(the job file has no such key); drop it to see the job's plan")
    overrides = [f"{JOB_KEYS[k]}={getattr(args, k)}" for k in JOB_KEYS
                 if getattr(args, k) is not None]
    if args.cost:  # the file's bandwidths over the job's sharding.cost keys
        from fbtriton_dist.planner.cost_inputs import read_cost_file

        overrides += [f"sharding.cost.{k}={v!r}" for k, v in read_cost_file(args.cost).items()]
    if args.shard_tiers:  # a tier per shard: the job's key
        overrides.append("sharding.shard_tiers=true")
    if args.group_size is not None:  # the job's replica groups (train/planning.py)
        overrides += [f"sharding.group_size={args.group_size}",
                      f"sharding.replica_sync={args.replica_sync}"]
    cfg = load_job(args.tables, overrides)
    if args.zipf is not None and cfg.data.source != "synthetic":
        raise ValueError(f"--zipf: the job's ids come from data.source={cfg.data.source}, "
                         f"not synthetic Zipf; give its tables an id_distribution instead")
    p = plan_job(cfg, args.world_size, min(args.world_size, 8), plan_path=args.check,
                 progress=_progress)
    return _plan_outputs(args, p.plan, p.planner, p.specs, p.stats, p.cost, p.report)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _plan_outputs(args, plan, planner, specs, stats, cost, report: str) -> int:
    """Print the report; write ``--out``, draw ``--png``, run ``--simulate``."""
    from fbtriton_dist.planner.cost_inputs import cost_line, given_line

    print(report)
    if given_line(planner.cost_model):  # plan --cost, a job's sharding.cost
        print(given_line(planner.cost_model))
    flat = cost.as_plan_cost() if hasattr(cost, "as_plan_cost") else cost  # grouped: S ranks
    if args.out:
        header = (
            f"fbtriton_dist sharding plan for {args.tables}\n{planner.describe()}\n"
            f"estimated step {flat.max() * 1e3:.3f} ms, imbalance (max/mean) {flat.imbalance():.3f}"
            f"\n{cost_line(planner.cost_model)}"
        )
        plan.save_yaml(args.out, header=header)
        print(f"wrote {args.out}")
    if args.png:
        title = report.splitlines()[0] if report else args.tables
        _plan_png(args.png, flat, title, planner.budget_bytes)
    if args.simulate:
        # torch and sharding/: loaded only when asked, the plan command stays torch-free
        simulate = importlib.import_module("fbtriton_dist.bench.simulate")
        print(simulate.run(plan, specs, stats, cost, planner.cost_model, args))
        if cost.tiers:  # the caches' hit rates on drawn ids, the runtime's slot map
            cache_sim = importlib.import_module("fbtriton_dist.bench.cache_sim")
            print(cache_sim.plan_comparison(plan, specs, stats, planner.cost_model.batch_size,
                                            seed=args.sim_seed))
    return 0


def _plan_png(path: str, cost, title: str, budget_bytes: float) -> None:
    from fbtriton_dist.planner.picture import PictureSkipped, draw_plan

    try:
        draw_plan(cost, path, title=title, budget_bytes=budget_bytes)
    except PictureSkipped as e:
        print(f"--png {path} skipped: {e}", file=sys.stderr)
        return
    print(f"wrote {path}")


def _add_train(sub: argparse._SubParsersAction) -> None:
    from fbtriton_dist.train.command import add_arguments  # torch-free

    p = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a DLRM job from a YAML file (torchrun for several ranks)",
        description=(
            "Train the job described by JOB.yaml (configs/jobs/, docs/training.md): in this "
            "process, or under torchrun on every rank. Same as python -m fbtriton_dist.train."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from fbtriton_dist.train.job import run

    return run(args)


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        allow_abbrev=False,
        help="print a run's summary and draw its loss/AUC curves and stage times as a PNG",
        description=(
            "Read RUN_DIR/metrics.jsonl of a training job, print its summary and draw the "
            "loss and AUC curves and the per-stage time split (RUN_DIR/report.png, as the "
            "job does at its end). Needs matplotlib for the picture."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (logging.run_dir)")
    p.add_argument("--metrics", default="metrics.jsonl",
                   help="the metrics file in RUN_DIR (logging.metrics; default metrics.jsonl)")
    p.add_argument("--png", metavar="FILE.png", help="draw here (default RUN_DIR/report.png)")
    p.set_defaults(func=_run_report)


def _run_report(args: argparse.Namespace) -> int:
    from fbtriton_dist.train.picture import PictureSkipped, draw_run, read_run

    run = read_run(args.run_dir, args.metrics)
    if run["summary"] is not None:
        from fbtriton_dist.train.metrics import format_summary

        summary = {k: v for k, v in run["summary"].items() if k not in ("kind", "step", "time")}
        print(format_summary(summary))
    else:
        last = run["train"][-1]["step"] if run["train"] else 0
        print(f"{run['path']}: no summary yet (the run has not finished; last train record at "
              f"step {last})")
    try:
        path, _ = draw_run(args.run_dir, args.metrics, args.png)
    except PictureSkipped as e:
        print(f"picture skipped: {e}", file=sys.stderr)
        return 0
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fbtriton-dist", description="fbtriton_dist: sharded embedding bags on Triton",
        allow_abbrev=False,  # `train --o` must not become --overwrite (it deletes a run)
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_plan(sub)
    _add_train(sub)
    _add_report(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from fbtriton_dist.planner import ConfigError, PlanError, PlanValidationError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "train":  # KEY.PATH=VALUE overrides may follow options
        from fbtriton_dist.train.command import finish_arguments

        args = finish_arguments(parser, args, extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except BrokenPipeError:  # `fbtriton-dist plan ... | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except PlanError as e:
        print(f"fbtriton-dist {args.command}: does not fit: {e}", file=sys.stderr)
        return 1
    except PlanValidationError as e:
        print(f"fbtriton-dist {args.command}: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError) as e:
        print(f"fbtriton-dist {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
