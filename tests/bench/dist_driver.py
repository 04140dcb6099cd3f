"""Run by tests/bench/test_bench_dist.py under torchrun (one copy per rank).

python -m tests.bench.dist_driver NAME -- BENCH DIST ARGS...
    ``bench dist`` with our own ``fbtriton_dist.sharding.NAME`` (``CommOptions`` or
    ``TrainPipeline``) made unimportable first, as a broken fast path would be: the providers
    that need it must fail the run, not skip.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import fbtriton_dist.sharding as sharding
    from fbtriton_dist.bench import dist

    name, sep, bench_args = argv[0], argv[1], argv[2:]
    if name not in ("CommOptions", "TrainPipeline") or sep != "--":
        raise SystemExit(f"usage: {__doc__.splitlines()[2].strip()}")
    for module in (sharding, sys.modules[getattr(sharding, name).__module__]):
        delattr(module, name)  # `from fbtriton_dist.sharding[.x] import NAME` now raises
    dist.main(bench_args)


if __name__ == "__main__":
    main(sys.argv[1:])
