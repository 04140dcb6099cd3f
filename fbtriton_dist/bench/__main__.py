"""Benchmarks: ``python -m fbtriton_dist.bench {tbe,dist,vbe,planner,id_remap,simulate,managed,
cache_sim,link} [args]``.

Each subcommand is the module ``fbtriton_dist.bench.<name>`` with a ``main(argv)``; ``dist``
runs under torchrun (``torchrun --nproc-per-node 2 -m fbtriton_dist.bench dist ...``).
"""

import importlib
import sys

COMMANDS = {
    "tbe": "tbe", "dist": "dist", "vbe": "vbe", "planner": "planner_vs_torchrec",
    "id_remap": "id_remap", "simulate": "simulate", "managed": "managed_job",
    "cache_sim": "cache_sim", "link": "link",
}


USAGE = (
    "usage: python -m fbtriton_dist.bench {tbe,dist,vbe,planner,id_remap,simulate,managed,"
    "cache_sim,link} [args]  (each takes --help)\n"
    "  tbe      our TBE against FBGEMM's, TorchRec's and torch's, one process\n"
    "  dist     a sharded training step against TorchRec's DMP (under torchrun)\n"
    "  vbe      variable batch per feature against fixed batches\n"
    "  planner  our planner against TorchRec's EmbeddingShardingPlanner\n"
    "  id_remap managed tables' id remap against TorchRec's MCH module (CPU)\n"
    "  simulate a plan's per-rank lookups and traffic, simulated, next to the planner's estimate\n"
    "  managed  managed tables against `% E` hashing on drifting data: collisions, AUC (CPU)\n"
    "  cache_sim a row cache's hit rate on drawn ids (the real slot map) vs the planner's "
    "estimate\n"
    "  link     the storage tiers' row traffic and random row gathers: a cost: YAML for plan --cost"
)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(
            f"usage: python -m fbtriton_dist.bench {{{','.join(COMMANDS)}}} [args]; "
            f"got {argv[:1] or 'nothing'}"
        )
    module = importlib.import_module(f"fbtriton_dist.bench.{COMMANDS[argv[0]]}")
    module.main(argv[1:])


if __name__ == "__main__":
    main()
