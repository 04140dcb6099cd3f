"""Fused optimizers of TableBatchedEmbedding: one registry entry each, applied inside backward.

Adding a fused optimizer touches these files, and no other (each backend lists the
optimizers its code implements in its capabilities, ``ops/backends/``, read from that code; a
backend without it refuses it when a module is built, naming what it supports):

1. ``fbtriton_dist/optim.py`` (this file): its config dataclass (in ``optim_configs.py``, or
   a file of its own as ``optim_counter.py``; added to ``Optimizer``) and
   one ``OptimizerSpec`` in ``REGISTRY``: the name (YAML, planner), the FBGEMM name, the
   states, the hyper-parameters the kernels read, the torch / TorchRec classes that map to
   it, the kernel code (``KERNEL_CODES``, the one code table). The planner (choices, state
   bytes), the job config (choices, keys), the modules (state tensors and their per-table
   views), the sharded module's state dict and the torch-class mapping all read it.
2. ``fbtriton_dist/reference/tbe.py``: its twin ``_<name>_update``, listed in ``UPDATES`` (the
   reference backend; the spec every other backend is tested against).
3. Triton: ``fbtriton_dist/kernels/tbe_optim.py``: its kernel code as a constexpr global, its
   name in ``OPTIMIZERS``, a ``@triton.jit`` ``_<name>_update`` helper and its branch in
   ``optimizer_update`` (the row-update kernel of ``kernels/tbe_backward.py`` calls that, by
   the constexpr code).
4. The CPU backend: ``fbtriton_dist/ops/cpu.py``, its vectorised step ``_<name>_step`` in
   ``_STEPS`` (and whether it reads the rows, ``_NEEDS_ROWS``): that is enough, the backward
   runs it where the native C kernels lack the optimizer. Optionally, for speed, the native
   kernels: ``ops/csrc/tbe_cpu_backward.c``, its ``OPT_<NAME>`` (= its kernel code) and its
   ``case`` in the row update (and its states' prefetch); ``ops/cpu_native.py`` reads the
   ``OPT_*`` names from that file and uses the C update for those.
5. ``tests/modules/test_tbe_module.py``: an instance in ``OPTIMIZERS`` and rows in ``CASES``
   (Triton vs the reference over three steps). ``tests/test_optim.py`` checks every registry
   entry without being edited (torch-class round trip, kernel code, planner and job choices,
   state bytes against the module's state tensors, a reference step for each entry);
   ``tests/ops/test_native_tables.py`` the C codes; ``tests/ops/test_backends.py`` runs it on
   every backend that lists it against the reference.

Package files per backend that implements it: reference 3 (1, 2; 1 is this file and the
config's), Triton 4 (1-3), the CPU backend 4 (1, 2, ``ops/cpu.py``; 5 with its native C update,
``tbe_cpu_backward.c``).

Limits of that count: states among ``STATE_BUFFERS`` (``momentum1``, ``momentum2``, each per
row or per element; FBGEMM's per-row ``prev_iter`` and ``row_counter``) and hyper-parameters
among ``HYPER_FIELDS``'s. A new hyper-parameter the kernels read is a slot of ``HYPER_FIELDS``
and ``hyper_parameters`` (native CPU: ``NATIVE_HYPER_FIELDS``, ``tbe_cpu_backward.c``'s
``HYPER_*``), and, for the job's YAML, a key of ``train/optim_config.py``'s
``EmbeddingOptimizerConfig`` (and ``train/job.py``'s ``_embedding_optimizer``). A new state
buffer, or state kept per module (``max_counter``), is more: ``docs/optimizers_counter.md``. An
optimizer neither torch nor TorchRec has gets an annotation class in ``modules/fused_optim.py``.

Semantics follow FBGEMM's TBE optimizers (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD,
ADAM, PARTIAL_ROWWISE_ADAM, LAMB, PARTIAL_ROWWISE_LAMB, LARS_SGD, EMAINPLACE_ROWWISE_ADAGRAD,
ENSEMBLE_ROWWISE_ADAGRAD; FTRL is not FBGEMM's): the gradients of duplicate ids in a batch are
summed first, then each unique row gets one update; rows not in the batch are untouched (their
moments too: "lazy" Adam; EMAINPLACE's and ENSEMBLE's whole-table steps aside). The formulas:
``docs/modules.md``, "Fused optimizers" (the counter's and ensemble's: ``docs/optimizers_*.md``).

This module never imports torch at import time (the planner and the job config read it); the
torch classes are named by dotted path and imported only when a mapping needs them.
"""

import dataclasses
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fbtriton_dist.optim_configs import (  # noqa: F401  (re-exported: optim.SGD, ...)
    FTRL,
    LAMB,
    SGD,
    WEIGHT_DECAY_MODES,
    Adagrad,
    Adam,
    EmaInplaceRowWiseAdagrad,
    LarsSGD,
    PartialRowWiseAdam,
    PartialRowWiseLAMB,
    RowWiseAdagrad,
    RowWiseRMSpropAR,
)
from fbtriton_dist.optim_counter import RowWiseAdagradWithCounter, counter_mode
from fbtriton_dist.optim_ensemble import EnsembleRowWiseAdagrad, ensemble_kwargs
from fbtriton_dist.optim_gwd import GWD_TORCH, RowWiseAdagradGlobalDecay, is_global_mode

Optimizer = SGD | Adagrad | RowWiseAdagrad | Adam | PartialRowWiseAdam | LAMB | PartialRowWiseLAMB | LarsSGD | FTRL | EmaInplaceRowWiseAdagrad | RowWiseRMSpropAR | RowWiseAdagradWithCounter | EnsembleRowWiseAdagrad | RowWiseAdagradGlobalDecay  # noqa: E501


# -- the registry ---------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """One state tensor of an optimizer: fp32, or fp16 / bf16 where a module's
    ``optimizer_state_dtypes`` says so (``STATE_DTYPE_BYTES``)."""

    name: str
    """The TableBatchedEmbedding buffer (and its state-dict key) holding it: state i is
    ``momentum{i+1}``; the collections key it ``embedding_bags.<table>.weight.<i>``."""
    per_row: bool
    """One value per row (``[E]``, a collection's state dict shows ``[E, 1]``), else one per
    element (``[E, D]``)."""
    fp32_only: bool = False
    """Always fp32 (step numbers, counts): ``optimizer_state_dtypes`` may not name it."""
    torchrec_key: str = ""
    """Its key in TorchRec's ``KeyedOptimizer`` state where not ``name`` (FBGEMM's)."""


@dataclass(frozen=True)
class TorchClass:
    """A torch / TorchRec optimizer class that an ``apply_optimizer_in_backward`` annotation
    may name, and how its keyword arguments map to our config."""

    path: str
    """Dotted path, imported only when a mapping needs the class, e.g. ``torch.optim.SGD``."""
    kwargs: Mapping[str, Any]
    """Keyword -> the class's default, for keywords that are fields of our config (same
    name, same meaning)."""
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Keywords with no fused equivalent unless left at this value (the class's default)."""
    modes: Mapping[str, str] = field(default_factory=dict)
    """Keywords that name a choice (a field of our config with the same name; the config
    checks and normalises the value) -> our default, e.g. rowwise Adagrad's
    ``weight_decay_mode`` (FBGEMM's fused-parameter name; TorchRec passes it to FBGEMM)."""

    def resolve(self) -> type | None:
        """The class, or None where its package is not installed."""
        module, _, name = self.path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except ImportError:
            return None


@dataclass(frozen=True)
class OptimizerSpec:
    """Everything the package knows about one fused optimizer."""

    name: str
    """The YAML and planner name (``optimizer.embedding.type``, a table's ``optimizer``)."""
    fbgemm: str | None
    """FBGEMM's ``EmbOptimType`` member with the same update; None where FBGEMM has none
    (only the tests that compare against FBGEMM read it)."""
    config: type
    """Our config dataclass (an ``Optimizer``)."""
    states: tuple[State, ...]
    """The state tensors, in order (buffers of ``STATE_BUFFERS``)."""
    hyper: tuple[str, ...]
    """Config fields the kernels read from the device hyper-parameter tensor
    (``hyper_parameters``); other fields (e.g. a mode) are compile-time choices."""
    torch: tuple[TorchClass, ...]
    """The torch / TorchRec classes that map to it; the first is its equivalent (ours, in
    ``modules/fused_optim.py``, where neither has one)."""
    kernel_code: int
    """The integer the kernels use for it (0 is no optimizer)."""

    def state_bytes(self, rows: int, cols: int,
                    state_dtypes: Mapping[str, Any] | None = None) -> int:
        """Bytes of its states for a rows x cols block: fp32 as FBGEMM keeps them, or the
        dtype ``state_dtypes`` (``optimizer_state_dtypes``) names for a state."""
        dtypes = state_dtype_names(state_dtypes)
        return sum(STATE_DTYPE_BYTES["fp32" if s.fp32_only else dtypes.get(s.name, "fp32")] * rows
                   * (1 if s.per_row else cols) for s in self.states)

    @property
    def keywords(self) -> Mapping[str, Any]:
        """The keywords that configure it (the job's keys), with their defaults: its torch
        class's (``self.torch[0].kwargs``)."""
        return self.torch[0].kwargs

    @property
    def modes(self) -> Mapping[str, str]:
        """The keywords that name a choice (the job's keys too), with our defaults: its torch
        class's (``self.torch[0].modes``)."""
        return self.torch[0].modes

    def from_kwargs(self, kwargs: Mapping[str, Any], where: str, cls_name: str = "") -> Optimizer:
        """Our config from the keyword arguments of its torch class (``self.torch[0]``; its
        defaults where not given). Raises if a keyword has no fused equivalent."""
        tc = self.torch[0]
        name = cls_name or tc.path
        for key, allowed in tc.fixed.items():
            value = kwargs.get(key, allowed)
            if value != allowed:
                raise ValueError(
                    f"{where}: {name}({key}={value!r}) has no fused equivalent "
                    f"(supported: {key}={allowed})"
                )
        values = {}
        for key, default in tc.kwargs.items():
            value = kwargs.get(key, default)
            values[key] = tuple(value) if isinstance(default, tuple) else value
        for key, default in tc.modes.items():
            values[key] = kwargs.get(key, default)
        return self.config(**values)


def _torchrec_placeholder(name: str) -> TorchClass:
    """TorchRec's class for an Adam-like FBGEMM optimizer: a placeholder taking FBGEMM's
    keywords (``**kwargs``); ``betas`` as ours, FBGEMM's ``beta1`` / ``beta2`` only at their
    defaults (refused otherwise, not ignored)."""
    return TorchClass(
        f"torchrec.optim.{name}",
        kwargs={"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
        fixed={"beta1": 0.9, "beta2": 0.999},
    )


REGISTRY: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            name="sgd",
            fbgemm="EXACT_SGD",
            config=SGD,
            states=(),
            hyper=("lr",),
            torch=(
                TorchClass(
                    "torch.optim.SGD",
                    kwargs={"lr": 1e-3},
                    fixed={"momentum": 0, "weight_decay": 0, "dampening": 0, "nesterov": False},
                ),
            ),
            kernel_code=1,
        ),
        OptimizerSpec(
            name="adagrad",
            fbgemm="EXACT_ADAGRAD",
            config=Adagrad,
            states=(State("momentum1", per_row=False),),
            hyper=("lr", "eps"),
            torch=(
                TorchClass(
                    "torch.optim.Adagrad",
                    kwargs={"lr": 1e-2, "eps": 1e-10},
                    fixed={"lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0},
                ),
            ),
            kernel_code=4,
        ),
        OptimizerSpec(
            name="rowwise_adagrad",
            fbgemm="EXACT_ROWWISE_ADAGRAD",
            config=RowWiseAdagrad,
            states=(State("momentum1", per_row=True),),
            hyper=("lr", "eps", "weight_decay"),
            torch=(
                TorchClass(  # TorchRec's own decay is L2: our weight_decay_mode="l2" (the default)
                    "torchrec.optim.RowWiseAdagrad",
                    kwargs={"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
                    fixed={"lr_decay": 0, "initial_accumulator_value": 0},
                    modes={"weight_decay_mode": "l2"},
                ),
            ),
            kernel_code=2,
        ),
        OptimizerSpec(
            name="adam",
            fbgemm="ADAM",
            config=Adam,
            states=(State("momentum1", per_row=False), State("momentum2", per_row=False)),
            hyper=("lr", "eps", "betas", "weight_decay"),
            torch=(
                TorchClass(  # torch's weight_decay is L2, ours decoupled: not mapped
                    "torch.optim.Adam",
                    kwargs={"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8},
                    fixed={"weight_decay": 0, "amsgrad": False},
                ),
            ),
            kernel_code=3,
        ),
        OptimizerSpec(
            name="partial_rowwise_adam",
            fbgemm="PARTIAL_ROWWISE_ADAM",
            config=PartialRowWiseAdam,
            states=(State("momentum1", per_row=False), State("momentum2", per_row=True)),
            hyper=("lr", "eps", "betas", "weight_decay"),
            torch=(_torchrec_placeholder("PartialRowWiseAdam"),),
            kernel_code=5,
        ),
        OptimizerSpec(
            name="lamb",
            fbgemm="LAMB",
            config=LAMB,
            states=(State("momentum1", per_row=False), State("momentum2", per_row=False)),
            hyper=("lr", "eps", "betas", "weight_decay"),
            torch=(_torchrec_placeholder("LAMB"),),
            kernel_code=6,
        ),
        OptimizerSpec(
            name="partial_rowwise_lamb",
            fbgemm="PARTIAL_ROWWISE_LAMB",
            config=PartialRowWiseLAMB,
            states=(State("momentum1", per_row=False), State("momentum2", per_row=True)),
            hyper=("lr", "eps", "betas", "weight_decay"),
            torch=(_torchrec_placeholder("PartialRowWiseLAMB"),),
            kernel_code=7,
        ),
        OptimizerSpec(
            name="lars_sgd",
            fbgemm="LARS_SGD",
            config=LarsSGD,
            states=(State("momentum1", per_row=False),),
            hyper=("lr", "eta", "momentum", "weight_decay"),
            torch=(
                TorchClass(  # a placeholder taking FBGEMM's keywords (**kwargs)
                    "torchrec.optim.LarsSGD",
                    kwargs={"lr": 0.01, "eta": 0.001, "momentum": 0.9, "weight_decay": 0.0},
                ),
            ),
            kernel_code=8,
        ),
        OptimizerSpec(
            name="ftrl",
            fbgemm=None,  # FBGEMM has no FTRL
            config=FTRL,
            states=(State("momentum1", per_row=False), State("momentum2", per_row=False)),
            hyper=("lr", "beta", "l1", "l2"),
            torch=(  # neither torch nor TorchRec has one: our placeholder
                TorchClass(
                    "fbtriton_dist.modules.fused_optim.FTRL",
                    kwargs={"lr": 0.05, "beta": 1.0, "l1": 0.0, "l2": 0.0},
                ),
            ),
            kernel_code=9,
        ),
        OptimizerSpec(
            name="emainplace_rowwise_adagrad",
            fbgemm="EMAINPLACE_ROWWISE_ADAGRAD",
            config=EmaInplaceRowWiseAdagrad,
            states=(State("momentum1", per_row=True),),
            hyper=("lr", "eps", "weight_decay"),  # the EMA's fields: the module's, not kernels'
            torch=(  # neither torch nor TorchRec has one: our placeholder
                TorchClass(
                    "fbtriton_dist.modules.fused_optim.EmaInplaceRowWiseAdagrad",
                    kwargs={"lr": 0.01, "eps": 1e-8, "weight_decay": 0.0, "step_ema": 10.0,
                            "step_start": 0.0, "step_ema_coef": 0.6},
                    modes={"weight_decay_mode": "l2"},
                ),
            ),
            kernel_code=10,
        ),
        OptimizerSpec(
            name="rowwise_rmsprop_ar",
            fbgemm=None,  # FBGEMM's sources have it, fbgemm-gpu 1.8.0's EmbOptimType not yet
            config=RowWiseRMSpropAR,
            states=(State("momentum1", per_row=True), State("momentum2", per_row=True)),
            hyper=("lr", "eps", "ar_alpha", "ema_beta", "min_shrinkage"),
            torch=(  # neither torch nor TorchRec has one: our placeholder
                TorchClass(
                    "fbtriton_dist.modules.fused_optim.RowWiseRMSpropAR",
                    kwargs={"lr": 0.01, "eps": 1e-8, "ar_alpha": 0.0, "ema_beta": 0.99,
                            "min_shrinkage": 0.1},
                ),
            ),
            kernel_code=11,
        ),
        OptimizerSpec(  # FBGEMM's rowwise Adagrad, weight_decay_mode COUNTER / COWCLIP
            name="rowwise_adagrad_with_counter", fbgemm="EXACT_ROWWISE_ADAGRAD",
            config=RowWiseAdagradWithCounter,
            states=(State("momentum1", per_row=True), *(State(n, per_row=True, fp32_only=True)
                                                        for n in ("prev_iter", "row_counter"))),
            hyper=("lr", "eps", "weight_decay"),  # the rest: read by the reference / CPU step
            torch=(TorchClass(  # ours; TorchRec's RowWiseAdagrad with these modes: from_torch
                "fbtriton_dist.modules.fused_optim.RowWiseAdagradWithCounter",
                kwargs={"lr": 0.01, "eps": 1e-10, "weight_decay": 0.0},
                modes={"weight_decay_mode": "counter", "counter_based_regularization": None,
                       "cowclip_regularization": None}),),
            kernel_code=12,
        ),
        OptimizerSpec(  # rowwise Adagrad's row update + the module's whole-table step
            name="ensemble_rowwise_adagrad", fbgemm="ENSEMBLE_ROWWISE_ADAGRAD",
            config=EnsembleRowWiseAdagrad,  # optim_ensemble.py; momentum1 fp32 as FBGEMM's
            states=(State("momentum1", per_row=True, fp32_only=True),
                    State("momentum2", per_row=False, torchrec_key="sparse_ema")),
            hyper=("lr", "eps", "weight_decay"),  # the schedule: the module's, not kernels'
            torch=(TorchClass("fbtriton_dist.modules.fused_optim.EnsembleRowWiseAdagrad",
                              kwargs={"lr": 0.01, "eps": 1e-8, "weight_decay": 0.0,
                                      "step_ema": 10000.0, "step_swap": 10000.0,
                                      "step_start": 0.0, "step_ema_coef": 0.6},
                              modes={"weight_decay_mode": "none", "step_mode": "use_iter"}),),
            kernel_code=13,
        ),
        OptimizerSpec(  # rowwise Adagrad, DECOUPLE_GLOBAL (optim_gwd.py); ours, from_torch maps
            "rowwise_adagrad_global_decay", "EXACT_ROWWISE_ADAGRAD", RowWiseAdagradGlobalDecay,
            (State("momentum1", per_row=True), State("prev_iter", per_row=True, fp32_only=True)),
            ("lr", "eps", "weight_decay"), (TorchClass(**GWD_TORCH),), kernel_code=14),
    )
}
"""Every fused optimizer, by name."""

NAMES: tuple[str, ...] = tuple(REGISTRY)
"""The optimizers' names, in registry order (the job's and the planner's choices)."""

STATE_BUFFERS = ("momentum1", "momentum2", "prev_iter", "row_counter")
"""TableBatchedEmbedding's state buffers (empty where the optimizer lacks the state); the last
two are FBGEMM's per-row ``prev_iter`` and ``row_counter`` (rowwise_adagrad_with_counter)."""

_BY_CONFIG = {spec.config: spec for spec in REGISTRY.values()}


def spec(name: str) -> OptimizerSpec:
    """The registry entry called ``name``."""
    if name not in REGISTRY:
        raise ValueError(f"optimizer: expected one of [{', '.join(NAMES)}], got {name!r}")
    return REGISTRY[name]


def spec_of(optimizer: Optimizer) -> OptimizerSpec:
    """The registry entry of a config instance."""
    found = next((_BY_CONFIG[c] for c in type(optimizer).__mro__ if c in _BY_CONFIG), None)
    if found is None:
        configs = " / ".join(f"fbtriton_dist.optim.{s.config.__name__}" for s in REGISTRY.values())
        raise ValueError(f"optimizer: expected None or {configs}, got {optimizer!r}")
    return found


def from_torch(cls: type, kwargs: Mapping[str, Any], where: str) -> Optimizer:
    """Our fused optimizer for a ``(optimizer class, kwargs)`` annotation left by
    ``torchrec.optim.apply_optimizer_in_backward`` (or torch's). Raises if it has no exact
    fused equivalent."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    for entry in REGISTRY.values():
        for tc in entry.torch:
            # compare names first: resolving a path imports its package
            if tc.path.rpartition(".")[2] == cls.__name__ and tc.resolve() is cls:
                if entry.name == "rowwise_adagrad" and counter_mode(
                        kwargs.get("weight_decay_mode")):  # FBGEMM's COUNTER / COWCLIP
                    entry = REGISTRY["rowwise_adagrad_with_counter"]
                elif entry.name == "rowwise_adagrad" and is_global_mode(
                        kwargs.get("weight_decay_mode")):  # FBGEMM's DECOUPLE_GLOBAL
                    entry = REGISTRY["rowwise_adagrad_global_decay"]
                if entry.config is EnsembleRowWiseAdagrad:  # FBGEMM's ensemble_mode= spread
                    kwargs = ensemble_kwargs(kwargs)
                return entry.from_kwargs(kwargs, where, name)
    paths = [tc.path for entry in REGISTRY.values() for tc in entry.torch]
    raise ValueError(
        f"{where}: optimizer {name} has no fused equivalent; use "
        f"{', '.join(paths[:-1])} or {paths[-1]}"
    )


def in_backward_annotation(param: Any) -> tuple[type, dict[str, Any]] | None:
    """``(optimizer class, kwargs)`` that ``apply_optimizer_in_backward`` (TorchRec's, or
    torch's) left on ``param`` (its first), or None. The one place that reads those private
    attributes. Read at every call: an annotation may come after a module's first forward."""
    classes = getattr(param, "_optimizer_classes", None)
    return (classes[0], param._optimizer_kwargs[0]) if classes else None


def set_in_backward_lr(param: Any, lr: float) -> None:
    """Change the learning rate of ``param``'s ``apply_optimizer_in_backward`` annotation (its
    first; the one place that writes it), and of its in-backward optimizer's param groups."""
    if not getattr(param, "_optimizer_classes", None):
        raise ValueError("set_in_backward_lr: the parameter has no apply_optimizer_in_backward "
                         "annotation")
    param._optimizer_kwargs[0]["lr"] = lr
    for opt in getattr(param, "_in_backward_optimizers", ())[:1]:
        for group in opt.param_groups:
            group["lr"] = lr


def torch_equivalent(optimizer: Optimizer) -> tuple[type, dict[str, Any]]:
    """``(class, kwargs)`` for ``apply_optimizer_in_backward`` that ``from_torch`` maps back
    to ``optimizer`` (for a TorchRec-shaped model that reads the annotation). Raises where a
    field has no equivalent in the class (e.g. decoupled weight decay)."""
    entry = spec_of(optimizer)
    tc = entry.torch[0]
    for f in dataclasses.fields(optimizer):
        if f.name not in {**tc.kwargs, **tc.modes} and getattr(optimizer, f.name) != f.default:
            raise ValueError(
                f"optimizer: {optimizer!r} has no {tc.path} equivalent "
                f"({f.name}={getattr(optimizer, f.name)!r} is not one of its arguments)"
            )
    cls = tc.resolve()
    if cls is None:
        raise ValueError(f"optimizer: {tc.path} is not installed")
    return cls, {key: getattr(optimizer, key) for key in (*tc.kwargs, *tc.modes)}


HYPER_FIELDS = (
    "lr", "eps", "beta1", "beta2", "weight_decay", "log_beta1", "log_beta2", "eta", "momentum",
    "beta", "l1", "l2", "ar_alpha", "ema_beta", "min_shrinkage",
)
"""What the fused backward reads from a small fp32 device tensor (not from launch arguments,
so that a CUDA-graph-captured step sees a changed learning rate): the fields in this order."""


NATIVE_HYPER_FIELDS = (*HYPER_FIELDS[:5], "decoupled", "step")
"""What the native CPU backward reads from its ``double`` hyper-parameter array
(``ops/csrc/tbe_cpu.h``'s ``HYPER_*`` slots, checked against this by a test): the fields in
this order; ``decoupled`` is 1.0 for ``weight_decay_mode="decoupled"``, ``step`` the step t."""

STATE_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
"""The dtypes a state may be stored in (``optimizer_state_dtypes``, FBGEMM's option name) and
their bytes per value. The update is computed in fp32 from the stored value and uses the
unrounded result; only the stored state is rounded, to nearest (as FBGEMM's stores)."""

_STATE_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
                        "bfloat16": "bf16"}


def state_dtype_names(state_dtypes: Mapping[str, Any] | None) -> dict[str, str]:
    """``optimizer_state_dtypes`` as ``{state buffer: "fp32" | "fp16" | "bf16"}``; a value may
    be that name, a torch dtype (``torch.float16``) or FBGEMM's ``SparseType`` (FP16, BF16,
    FP32). Raises on a key that is no state buffer or an unsupported dtype."""
    names = {}
    for key, value in (state_dtypes or {}).items():
        if key not in STATE_BUFFERS:
            raise ValueError(f"optimizer_state_dtypes: expected keys among "
                             f"[{', '.join(STATE_BUFFERS)}], got {key!r}")
        raw = getattr(value, "value", value)  # FBGEMM's SparseType: its value, e.g. "fp16"
        name = str(raw).lower().removeprefix("torch.")
        name = _STATE_DTYPE_ALIASES.get(name, name)
        allowed = ("fp32",) if key in ("prev_iter", "row_counter") else STATE_DTYPE_BYTES
        if name not in allowed:  # step numbers and counts stay fp32
            raise ValueError(f"optimizer_state_dtypes[{key!r}]: expected one of "
                             f"[{', '.join(allowed)}], got {value!r}")
        names[key] = name
    return names


NO_OPTIMIZER_CODE = 0
"""The kernels' code for no optimizer (the summed row gradients are returned)."""

KERNEL_CODES: dict[str, int] = {entry.name: entry.kernel_code for entry in REGISTRY.values()}
"""Every optimizer's kernel code, by name: the one table the Triton and native CPU kernels'
codes come from (``NO_OPTIMIZER_CODE`` aside)."""


def native_hyper_parameters(optimizer: Optimizer | None, step: int) -> list[float]:
    """``optimizer``'s values of ``NATIVE_HYPER_FIELDS`` at step ``step`` (zeros and the step
    without an optimizer)."""
    if optimizer is None:
        return [0.0] * (len(NATIVE_HYPER_FIELDS) - 1) + [float(step)]
    decoupled = getattr(optimizer, "weight_decay_mode", "l2") in ("decoupled", "decoupled_global")
    return [*hyper_parameters(optimizer)[:5], float(decoupled), float(step)]


def hyper_parameters(optimizer: Optimizer | None) -> list[float]:
    """``optimizer``'s values of ``HYPER_FIELDS`` (0 where its entry's ``hyper`` has none).
    ``log_beta`` is the natural log of the beta (-inf for 0): Adam's bias corrections
    ``1 - beta^t`` are computed from it on the device, with the step count t read from
    device memory."""
    if optimizer is None:
        return [0.0] * len(HYPER_FIELDS)
    values = {name: getattr(optimizer, name) for name in spec_of(optimizer).hyper}
    if "weight_decay" in values:  # rowwise Adagrad's "none" mode: no decay at all
        values["weight_decay"] = getattr(optimizer, "applied_weight_decay", values["weight_decay"])
    b1, b2 = values.get("betas", (0.0, 0.0))
    return [
        float(values["lr"]),
        float(values.get("eps", 0.0)),
        float(b1),
        float(b2),
        float(values.get("weight_decay", 0.0)),
        *(math.log(b) if b > 0 else -math.inf for b in (b1, b2)),
        float(values.get("eta", 0.0)),
        float(values.get("momentum", 0.0)),
        *(float(values.get(name, 0.0)) for name in ("beta", "l1", "l2")),
        *(float(values.get(name, 0.0)) for name in ("ar_alpha", "ema_beta", "min_shrinkage")),
    ]
