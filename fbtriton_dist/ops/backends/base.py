"""A backend's record of what it supports (``Capabilities``) and the base class of the backend
objects (``Backend``): one method per op that ``ops/`` dispatches, each by default the twin
function of the backend's implementation module (``kernels``, ``ops.cpu``, ``reference``),
overridden where a backend differs.

Imports neither torch nor triton at import time (``ops/backends/__init__.py`` says why).
"""

import importlib
from dataclasses import dataclass
from types import ModuleType

from fbtriton_dist import optim
from fbtriton_dist.pooling import PoolingMode

WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
"""The weight and output dtypes (torch names) of TableBatchedEmbedding."""


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What one backend supports; ``ops/`` reads these instead of comparing backend names."""

    devices: tuple[str, ...]
    """Device types whose tensors it runs on (``Backend.check_device`` may add conditions)."""
    dtypes: tuple[str, ...] = WEIGHT_DTYPES
    """Weight and output dtypes, by torch name (``"float32"``)."""
    poolings: tuple[PoolingMode, ...] = tuple(PoolingMode)
    """Pooling modes of the lookup."""
    optimizers: tuple[str, ...] = optim.NAMES
    """Fused optimizers (``optim.REGISTRY`` names) its backward applies."""
    capturable: bool = False
    """A lookup and its fused backward can be recorded in a CUDA graph (no host reads)."""
    bounds_check_in_kernel: bool = False
    """The forward drops and counts out-of-range ids itself (``err``), on every path its
    ``tbe_forward`` takes; else the batch is checked on the host before the lookup
    (``ops.tbe_checks.check_inputs``). A backward that gets no keys from the forward (``linearize``)
    is given the batch without the dropped ids (``ops.tbe``)."""
    weights_check_in_kernel: bool = False
    """With ``bounds_check_in_kernel``: given ``check_weights=True`` (``bounds_check="error"``)
    the forward also counts non-finite per-sample weights in ``err[2]``, in its own pass; else
    ``ops.tbe`` counts them before the lookup."""
    native_input_check: bool = False
    """That host check starts with one native pass over the batch (``cpu_native.check``)."""
    plan_ahead: bool = False
    """It has ``tbe_linearize`` and ``tbe_backward_plan``: a training batch's backward plan
    can be made beside the forward (``ops/tbe_ahead.py``)."""
    tiers: tuple[str, ...] = ("device",)
    """Storage tiers (``fbtriton_dist.storage.TIERS``) of the tables it looks up: those its
    tests train exactly as ``device`` (``modules/tiers.py`` runs the cache around the lookup)."""

    def problems(self, *, device: str | None = None, pooling=None, optimizer: str | None = None,
                 dtypes=(), tiers=()) -> list[str]:
        """What of the given is unsupported, one ``"<what> X (supported: [...])"`` each."""
        out = []
        if device not in (None, "meta") and device not in self.devices:  # meta: shapes only
            out.append(f"device {device!r} (supported: {list(self.devices)})")
        if pooling is not None:
            mode = PoolingMode.of(pooling)
            if mode not in self.poolings:
                out.append(f"pooling {mode.label!r} (supported: "
                           f"{[p.label for p in self.poolings]})")
        if optimizer is not None and optimizer not in self.optimizers:
            out.append(f"optimizer {optimizer!r} (supported: {list(self.optimizers)})")
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            if name not in self.dtypes:
                out.append(f"dtype {name} (supported: {list(self.dtypes)})")
        for tier in dict.fromkeys(tiers):
            if tier not in self.tiers:
                out.append(f"storage tier {tier!r} (supported: {list(self.tiers)})")
        return out


class Backend:
    """One backend: its name, capabilities and one method per op. The defaults call ``twin``:
    the function of the same name in ``module()`` (same signature as ``reference``'s twin),
    or the reference's where the module has none (the spec runs on any device)."""

    def __init__(self, name: str, capabilities: Capabilities, module: str) -> None:
        self.name = name
        self.capabilities = capabilities
        self._module_name = module

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def module(self) -> ModuleType:
        """The module holding this backend's twin of every op (imported at the first ask, then
        kept: every lookup asks)."""
        found = self.__dict__.get("_module")
        if found is None:
            found = self._module = importlib.import_module(self._module_name)
        return found

    def twin(self, op: str):
        """This backend's function for ``op``: its module's, else the reference's."""
        fn = getattr(self.module(), op, None)
        if fn is None:
            fn = getattr(importlib.import_module("fbtriton_dist.reference"), op)
        return fn

    def check_device(self, device) -> None:
        """Refuse (``RuntimeError``) tensors of ``device`` that it cannot run on."""
        kind = getattr(device, "type", None) or str(device).split(":")[0]
        if kind != "meta" and kind not in self.capabilities.devices:  # meta: shapes only
            raise RuntimeError(
                f"backend={self.name!r} runs on {list(self.capabilities.devices)} tensors, "
                f"got {kind!r}"
            )

    # -- the TBE lookup (ops/tbe.py)
    def tbe_forward(self, *args, **kwargs):
        return self.twin("tbe_forward")(*args, **kwargs)

    def tbe_backward(self, *args, rows=None, **kwargs):
        """``rows`` [T]: each feature's table rows, for backends that check ids there."""
        return self.twin("tbe_backward")(*args, **kwargs)

    def tbe_per_sample_weights_grad(self, *args, **kwargs):
        return self.twin("tbe_per_sample_weights_grad")(*args, **kwargs)

    def tbe_linearize(self, *args, **kwargs):
        raise NotImplementedError(f"backend={self.name!r} makes no backward plan ahead")

    def tbe_backward_plan(self, *args, **kwargs):
        raise NotImplementedError(f"backend={self.name!r} makes no backward plan ahead")

    # -- the input dist's ops (ops/bucketize.py)
    def bucketize(self, *args, **kwargs):
        return self.twin("bucketize")(*args, **kwargs)

    def bucketize_grid(self, sf_key: list[int], device):
        """A launch grid for these shard-features, built once per key order; None: none."""
        return None

    def bucketize_into(self, values, offsets, weights, sf_key, lo, hi, B, *outs, grid=None,
                       check=None, capacity=None):
        """``ops.bucketize.bucketize_into`` with its buffers (``outs``) laid out. The twin
        wants no values after the last bag: they are cut off (a host read)."""
        if check is not None:
            raise ValueError(
                f"bucketize_into: the in-kernel check is not backend={self.name!r}'s: expected "
                "check=None"
            )
        used = min(int(offsets[-1]), values.numel())
        values = values[:used]
        weights = weights[:used] if weights is not None else None
        return self.twin("bucketize_into")(
            values, offsets.clamp(max=used), weights, sf_key, lo, hi, B, *outs
        )

    def segment_plan(self, counts, group_first, group_base):
        return self.twin("segment_plan")(counts, group_first, group_base)

    def segment_copy(self, *args):
        return self.twin("segment_copy")(*args)

    # -- managed tables (ops/id_remap.py)
    def id_index(self, keys, last_seen):
        """The index of a managed table's ids, or None: the spec's remap runs instead."""
        from fbtriton_dist.ops.cpu_id_remap import SortedIndex  # noqa: PLC0415

        return SortedIndex(keys, last_seen)
