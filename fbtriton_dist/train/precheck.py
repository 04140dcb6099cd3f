"""``python -m fbtriton_dist.train.precheck ARGS``: check a job's arguments and file before
torchrun starts workers (``command.precheck``; no torch import)."""

import sys

from fbtriton_dist.train.command import precheck

if __name__ == "__main__":
    sys.exit(precheck())
