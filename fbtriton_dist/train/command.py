"""The ``train`` command's arguments and the checks made before any worker starts: a new run
must not write into a folder holding another run (``other_run``), and
``python -m fbtriton_dist.train.precheck`` checks the job once before torchrun starts its
workers. Never imports torch."""

import argparse
import os
import sys
from collections.abc import Sequence

from fbtriton_dist.train.config import ConfigError, JobConfig, load_job


def other_run(cfg: JobConfig) -> str | None:
    """What of another run ``cfg.run_dir`` holds (its metrics, complete checkpoints), or
    None: a new run must not write there (``--resume`` / ``--overwrite`` aside)."""
    found = []
    metrics = os.path.join(cfg.run_dir, cfg.logging.metrics)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(cfg.logging.metrics)
    folder = cfg.checkpoint_dir
    steps = sorted(
        int(n[5:]) for n in (os.listdir(folder) if os.path.isdir(folder) else [])
        if n.startswith("step_") and n[5:].isdigit()
        and os.path.isfile(os.path.join(folder, n, "meta.json"))
    )
    if steps:
        found.append(f"checkpoints up to step {steps[-1]}")
    return ", ".join(found) or None


def run_dir_problem(cfg: JobConfig) -> str:
    """The error for a new run into a folder holding another run (``other_run``)."""
    return (
        f"run_dir {cfg.run_dir} holds another run ({other_run(cfg)}): pass --resume to continue "
        "it, --overwrite to start over there (deleting it), or choose another folder with "
        "logging.run_dir=..."
    )


def precheck(argv: Sequence[str] | None = None) -> int:
    """``python -m fbtriton_dist.train.precheck ARGS``: the job's arguments and file checked
    once, before torchrun starts its workers (``launch/multinode.sh``): a config error, or a
    new run into a folder holding another run, is printed once with exit status 2, as one
    process prints it. 0: go ahead. Never imports torch."""
    p = argparse.ArgumentParser(prog="python -m fbtriton_dist.train", allow_abbrev=False)
    add_arguments(p)
    args = finish_arguments(p, *p.parse_known_args(argv))
    try:
        cfg = load_job(args.config, args.overrides, args.steps)
    except (ConfigError, ValueError) as e:
        print(f"train: error: {e}", file=sys.stderr)
        return 2
    if not (args.resume or args.overwrite) and other_run(cfg):
        print(f"train: error: {run_dir_problem(cfg)}", file=sys.stderr)
        return 2
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``train`` command's arguments (``python -m fbtriton_dist.train``, ``fbtriton-dist
    train``)."""
    p.add_argument("--config", required=True, metavar="JOB.yaml", help="job file (configs/jobs/)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint"
    )
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument(
        "--overwrite", action="store_true",
        help="start over in a run folder that holds another run (its metrics, plan and "
        "checkpoints are deleted); without it (or --resume) such a folder is refused",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY.PATH=VALUE",
        help="override job keys, e.g. train.batch_size=512 optimizer.dense.lr=0.1",
    )


def finish_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: Sequence[str]
) -> argparse.Namespace:
    """Fold ``KEY.PATH=VALUE`` words that ``parse_known_args`` left over (overrides written
    after an option, e.g. ``--steps 5 train.batch_size=64``) into ``args.overrides``; refuse
    ``--resume`` with ``--overwrite`` (exit 2). The parser must be built with
    ``allow_abbrev=False``: an abbreviation such as ``--o`` is then an unknown word here, never
    ``--overwrite``."""
    bad = [e for e in extra if e.startswith("-") or "=" not in e]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.resume and args.overwrite:  # one would delete the run the other continues
        parser.error("--resume and --overwrite together: --resume continues the run in the "
                     "run folder, --overwrite deletes it; give one of them")
    args.overrides = [*args.overrides, *extra]
    return args
