"""Command-line options that ``fbtriton-dist plan`` (``cli.py``) and ``python -m
fbtriton_dist.bench simulate`` share: argparse only, torch-free, so that both import them from
here (downward) and ``bench`` never imports the command line."""

from __future__ import annotations

import argparse

__all__ = ["add_group_arguments", "add_simulate_arguments", "group_size_arg", "positive_int",
           "replica_sync_arg"]


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_simulate_arguments(p: argparse.ArgumentParser) -> None:
    """The simulation's options (``plan --simulate`` and ``bench simulate``)."""
    p.add_argument("--sim-ranks", type=int, nargs="+", default=None, metavar="RANK",
                   help="ranks to simulate (default: all up to 16 ranks, else 8 spread ranks "
                        "and the slowest by the estimate)")
    p.add_argument("--sim-sources", type=positive_int, default=None, metavar="N",
                   help="ranks whose batches are drawn (default: all up to 64 ranks, else 32 "
                        "spread ranks and the simulated ones)")
    p.add_argument("--sim-seed", type=int, default=0, help="seed of the drawn ids (default 0)")
    p.add_argument("--sim-backend", choices=("reference", "cpu"), default="reference",
                   help="what runs the bucketize (default: the reference)")
    p.add_argument("--wire-dtype", choices=("fp32", "bf16", "fp16", "fp8", "int8"),
                   default="fp32", help="output dist wire format the cost model (and the "
                   "simulation) count: values, plus fp8's / int8's row scales (default fp32)")
    p.add_argument("--backward-wire-dtype", choices=("fp32", "bf16", "fp16", "fp8", "int8"),
                   default=None, help="the gradients' wire format (default: --wire-dtype)")
    p.add_argument("--sim-ids", choices=("planner", "job"), default="planner",
                   help="Zipf ids as the estimate assumes (planner, default) or as a training "
                        "job's synthetic data draws them (job: train.data.power_law_rows)")


def group_size_arg(text: str) -> int | str:
    """An argparse ``type``: ``auto`` or an integer >= 1 (whether it divides R is checked
    with R)."""
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or an integer >= 1, got {text}") from None


def replica_sync_arg(text: str) -> str | int:
    """An argparse ``type``: ``step`` or an integer N >= 1 (every N steps)."""
    if text == "step":
        return text
    try:
        return positive_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"expected 'step' or an integer >= 1, got {text}") from None


def add_group_arguments(p: argparse.ArgumentParser) -> None:
    """Replica groups (2D parallel, ``planner/groups.py``): ``plan --group-size``."""
    p.add_argument("--group-size", type=group_size_arg, default=None, metavar="S|auto",
                   help="plan the tables for groups of S consecutive ranks, each group holding "
                        "all tables and syncing its shards' replicas (S must divide R); auto: "
                        "try powers of two from 8 up to R and R, keep the fastest that fits "
                        "(default: flat, one group of R)")
    p.add_argument("--replica-sync", type=replica_sync_arg, default="step", metavar="step|N",
                   help="with --group-size: the replicas exchange row gradients every step "
                        "(step, default) or average weights and optimizer state every N steps")
    p.add_argument("--replica-sync-dtype", choices=("fp32", "bf16", "fp16", "fp8", "int8"),
                   default=None, help="with --replica-sync N: the format the weights are "
                   "averaged in (values plus fp8's / int8's row scales; the optimizer state: "
                   "fp32; default fp32, a job file's sharding.replica_sync_dtype)")
