"""fbtriton_dist: sharded embedding bags on Triton TBE kernels, a drop-in for TorchRec.

The package imports lazily: ``import fbtriton_dist`` loads nothing, each subpackage
(``fbtriton_dist.planner``, ``.sharding``, ``.train``, ``.ops``, ...) and each top-level name
is imported on first use, so ``fbtriton_dist.planner`` and the ``fbtriton-dist plan`` command
never load torch or triton.
"""

import importlib

__version__ = "0.1.0"

SUBMODULES = (
    "bench", "cli", "graphs", "id_manager", "kernels", "knobs", "modules", "ops", "optim",
    "planner", "reference", "sharding", "sparse", "storage", "train",
)
"""What ``fbtriton_dist.<name>`` imports on first use."""

_NAMES = {
    "EmbeddingBagCollection": "fbtriton_dist.modules.ebc",
    "EmbeddingCollection": "fbtriton_dist.modules.ec",
    "TableBatchedEmbedding": "fbtriton_dist.modules.tbe",
    "IdManagerConfig": "fbtriton_dist.id_manager",
    "Admission": "fbtriton_dist.id_manager",
    "Storage": "fbtriton_dist.storage",
    "ManagedCollisionCollection": "fbtriton_dist.modules.managed",
    "ManagedCollisionEmbeddingBagCollection": "fbtriton_dist.modules.managed",
    "ManagedCollisionEmbeddingCollection": "fbtriton_dist.modules.managed",
    "ShardedEmbeddingBagCollection": "fbtriton_dist.sharding",
    "ShardedEmbeddingCollection": "fbtriton_dist.sharding",
    "shard": "fbtriton_dist.sharding",
}
"""Top-level names and the module each comes from."""

__all__ = [*_NAMES, *SUBMODULES]


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    if name in SUBMODULES:
        return importlib.import_module(f"fbtriton_dist.{name}")
    raise AttributeError(f"module 'fbtriton_dist' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
