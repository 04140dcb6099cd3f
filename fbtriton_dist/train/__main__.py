"""``python -m fbtriton_dist.train --config configs/jobs/NAME.yaml [--resume] [--steps N] ...``"""

import sys

from fbtriton_dist.train.job import main

if __name__ == "__main__":
    sys.exit(main())
