"""The reference backend: ``fbtriton_dist.reference``, the slow, obvious pure-PyTorch twin of
every kernel (the spec and the test oracle), on any device."""

from fbtriton_dist import optim
from fbtriton_dist.ops.backends.base import Backend, Capabilities
from fbtriton_dist.reference.tbe import UPDATES


class ReferenceBackend(Backend):
    def id_index(self, keys, last_seen):
        return None  # the spec's remap (reference/id_remap.py)


BACKEND = ReferenceBackend(
    "reference",
    Capabilities(
        devices=("cpu", "cuda"),
        optimizers=tuple(name for name in optim.NAMES if name in UPDATES),
        tiers=("device", "host", "cached", "file"),
    ),
    "fbtriton_dist.reference",
)
