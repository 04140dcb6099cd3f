"""FBGEMM's TBE config classes (``WeightDecayMode``, ``CounterBasedRegularizationDefinition``,
``EnsembleModeDefinition`` ...) wherever the installed FBGEMM keeps them: in
``fbgemm_gpu.tbe.config`` from fbgemm-gpu 1.8 (the CPU wheel), in the training module in older
builds (the 1.6 CUDA build of the GPU runs). ``from tests.fbgemm_config import WeightDecayMode``."""

import importlib

_MODULES = ("fbgemm_gpu.tbe.config", "fbgemm_gpu.split_table_batched_embeddings_ops_training")


def __getattr__(name: str):
    for module in _MODULES:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise AttributeError(f"FBGEMM has no {name} in {' or '.join(_MODULES)}")
