"""The ``fbtriton-dist`` command: one argparse subcommand per task (``plan``, ``train``,
``report``).

Exit status: 0 done, 1 the tables do not fit (the message says which table and by how much),
2 bad input (a YAML error names the file, the key path and the valid choices).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["build_parser", "main"]

GiB = 1024**3


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _add_plan(sub: argparse._SubParsersAction) -> None:
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
                   help="table set (see docs/planner.md), or a job file (its tables)")
    p.add_argument("--world-size", type=_positive_int, required=True, help="R, number of ranks")
    p.add_argument(
        "--local-world-size", type=_positive_int, default=None, help="ranks per host (default 8)"
    )
    p.add_argument("--hbm-gb", type=float, default=80.0, help="HBM per rank in GiB (default 80)")
    p.add_argument(
        "--reserved",
        type=float,
        default=0.1,
        help="share of HBM kept for the dense model and buffers (default 0.1)",
    )
    p.add_argument("--batch-size", type=_positive_int, default=512, help="B per rank (default 512)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="rowwise_adagrad")
    p.add_argument(
        "--zipf",
        type=float,
        default=None,
        metavar="ALPHA",
        help="Zipf exponent of the ids of every table without its own id_distribution",
    )
    p.add_argument(
        "--row-cuts",
        choices=("balanced", "equal"),
        default="balanced",
        help="skew-aware row cuts (default) or TorchRec-style equal row blocks",
    )
    p.add_argument(
        "--memory-tolerance",
        type=float,
        default=0.01,
        metavar="T",
        help="the memory pass may raise the step time by this share to even out memory "
             "(default 0.01; 0: only moves that keep the step time)",
    )
    p.add_argument("--out", metavar="PLAN.yaml", help="write the plan here (atomically)")
    p.add_argument("--check", metavar="PLAN.yaml", help="evaluate this plan instead of planning")
    p.add_argument("--png", metavar="FILE.png",
                   help="draw per-rank memory, lookups and traffic as bars (needs matplotlib)")
    p.add_argument("--simulate", action="store_true",
                   help="draw ids from each table's distribution, run the real bucketize and "
                        "count every rank's lookups and traffic; print them next to the "
                        "estimate (needs torch; python -m fbtriton_dist.bench simulate)")
    add_simulate_arguments(p)
    p.set_defaults(func=_run_plan)


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """The simulation's options (``plan --simulate`` and ``bench simulate``)."""
    p.add_argument("--sim-ranks", type=int, nargs="+", default=None, metavar="RANK",
                   help="ranks to simulate (default: all up to 16 ranks, else 8 spread ranks "
                        "and the slowest by the estimate)")
    p.add_argument("--sim-sources", type=_positive_int, default=None, metavar="N",
                   help="ranks whose batches are drawn (default: all up to 64 ranks, else 32 "
                        "spread ranks and the simulated ones)")
    p.add_argument("--sim-seed", type=int, default=0, help="seed of the drawn ids (default 0)")
    p.add_argument("--sim-backend", choices=("reference", "cpu"), default="reference",
                   help="what runs the bucketize (default: the reference)")
    p.add_argument("--sim-ids", choices=("planner", "job"), default="planner",
                   help="Zipf ids as the estimate assumes (planner, default) or as a training "
                        "job's synthetic data draws them (job: train.data.power_law_rows)")


def _table_set(path: str):
    """The table set of a table-set file or of a job file (its ``tables``, overrides of the
    job's own file applied), so that the plan a job wrote can be ``--check``ed."""
    from fbtriton_dist.planner import load_tables
    from fbtriton_dist.planner._yaml import read_yaml

    data = read_yaml(path)
    if isinstance(data, dict) and set(data) - {"defaults", "tables"}:
        from fbtriton_dist.train.config import load_job  # torch-free

        return load_job(path).tables
    return load_tables(path)


def _run_plan(args: argparse.Namespace) -> int:
    from fbtriton_dist.planner import (
        CostModel,
        IdDistribution,
        ShardingPlan,
        ShardingPlanner,
    )
    from fbtriton_dist.planner.report import format_report

    table_set = _table_set(args.tables)
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
        cost_model=CostModel(batch_size=args.batch_size),
        optimizer=args.optimizer,
        row_cuts=args.row_cuts,
        memory_tolerance=args.memory_tolerance,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if args.check:
        plan = ShardingPlan.load_yaml(args.check)
        if (plan.world_size, plan.local_world_size) != (args.world_size, H):
            raise ValueError(
                f"{args.check}: plan is for world_size={plan.world_size}, local_world_size="
                f"{plan.local_world_size}; the command line says {args.world_size}, {H}"
            )
    else:
        plan = planner.plan(specs, table_set.constraints, stats)
    plan.validate(specs, budget_bytes=planner.budget_bytes, optimizer=args.optimizer)
    cost = planner.cost(plan, specs, stats)
    title = f"{args.check or args.tables}: {len(specs)} tables on {planner.describe()}"
    print(format_report(plan, specs, cost, stats, title=title))
    if args.out:
        header = (
            f"fbtriton_dist sharding plan for {args.tables}\n{planner.describe()}\n"
            f"estimated step {cost.max() * 1e3:.3f} ms, imbalance (max/mean) {cost.imbalance():.3f}"
        )
        plan.save_yaml(args.out, header=header)
        print(f"wrote {args.out}")
    if args.png:
        _plan_png(args.png, cost, title, planner.budget_bytes)
    if args.simulate:
        # torch and sharding/: loaded only when asked, the plan command stays torch-free
        simulate = importlib.import_module("fbtriton_dist.bench.simulate")
        print(simulate.run(plan, specs, stats, cost, planner.cost_model, args))
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
    from fbtriton_dist.train.config import add_arguments  # torch-free

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
        from fbtriton_dist.train.config import finish_arguments

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
