"""The fused-optimizer phases of ``bench tbe``: one ``fwd_bwd_<name>`` phase per optimizer of
``optim.REGISTRY``, each with our config (the hyper-parameters every provider of the phase
uses), FBGEMM's ``EmbOptimType`` member and constructor keywords with the same values (or why
FBGEMM offers none), and its bytes per unique row.

    phase("fwd_bwd_adam").config            # optim.Adam(lr=0.01, eps=1e-8, ...)
    phase("fwd_bwd_adam").fbgemm_kwargs()   # {"learning_rate": 0.01, "eps": 1e-8,
                                            #  "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0}
    fbgemm_optimizer(phase("fwd_bwd_ftrl"), fb)   # raises NotOffered("FBGEMM has no ...")

``fwd_bwd_sgd`` and ``fwd_bwd_rowwise_adagrad`` are the phases ``bench tbe`` always had (its
default ``--phases``); the others are timed when named. A provider that lacks an optimizer
prints ``fbgemm: not offered (why)`` for its phase instead of failing the run: FBGEMM lacks
FTRL and rowwise RMSprop AR everywhere, and its CPU TBE (fbgemm-gpu-cpu) runs only EXACT_SGD,
EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD and EMAINPLACE_ROWWISE_ADAGRAD (it refuses the others when
built: "Optimizer ... is not supported in CPU mode"). FBGEMM gates ENSEMBLE_ROWWISE_ADAGRAD
behind its feature gate ``TBE_ENSEMBLE_ROWWISE_ADAGRAD`` (its lookup asserts it; on by
FBGEMM's environment variable ``FBGEMM_TBE_ENSEMBLE_ROWWISE_ADAGRAD=1``): not offered when off.

Bytes (``row_state_bytes``): per unique row of a step, its optimizer states read and written
once (fp32, one value per row or per element as the registry says: Adam's two moments are
``2 * 2 * 4 * D`` bytes). EMA-in-place rowwise Adagrad adds its moving average over whole
tables every ``step_ema`` steps, amortised per step (``ema_bytes``: each row's first half read,
its second half read and written); ensemble rowwise Adagrad its moving average (rows read,
fp32 slow copy read and written, zeroed with ``step_mode: none``) every ``step_ema`` steps and
its swap (slow copy read, rows written) every ``step_swap``; its slow copy is not a per-row
state of the backward, so ``row_state_bytes`` counts its ``momentum1`` only."""

import dataclasses
from dataclasses import dataclass
from typing import Any

from fbtriton_dist import optim

LR, EPS = 0.01, 1e-8
"""The learning rate and eps of every phase (and of every provider, ours and FBGEMM's)."""

CONFIGS: dict[str, optim.Optimizer] = {
    "sgd": optim.SGD(lr=LR),
    "rowwise_adagrad": optim.RowWiseAdagrad(lr=LR, eps=EPS),
    "adagrad": optim.Adagrad(lr=LR, eps=EPS),
    "adam": optim.Adam(lr=LR, eps=EPS),
    "partial_rowwise_adam": optim.PartialRowWiseAdam(lr=LR, eps=EPS),
    "lamb": optim.LAMB(lr=LR, eps=EPS),
    "partial_rowwise_lamb": optim.PartialRowWiseLAMB(lr=LR, eps=EPS),
    "lars_sgd": optim.LarsSGD(lr=LR),
    "ftrl": optim.FTRL(lr=LR),
    "emainplace_rowwise_adagrad": optim.EmaInplaceRowWiseAdagrad(lr=LR, eps=EPS),
    "rowwise_rmsprop_ar": optim.RowWiseRMSpropAR(lr=LR, eps=EPS),
}
"""Our config per registry name: the hyper-parameters of its phase (FBGEMM's defaults where
the config has them, ``LR`` and ``EPS``). A registry entry missing here gets its config's
defaults with ``lr=LR`` (``_config``), so a new optimizer has a phase at once."""

_FBGEMM_FIELDS = {"lr": "learning_rate", "eps": "eps", "weight_decay": "weight_decay",
                  "eta": "eta", "momentum": "momentum"}
"""Our config field -> FBGEMM's TBE constructor keyword of the same meaning (``betas`` is its
``beta1`` / ``beta2``; the EMA fields its ``EmainplaceModeDefinition``)."""
_EMA_FIELDS = ("step_ema", "step_start", "step_ema_coef", "step_swap", "step_mode")
"""EMA-in-place's ``EmainplaceModeDefinition`` fields; ensemble's ``EnsembleModeDefinition``."""
_COUNTER_DEFINITIONS = {"counter_based_regularization": "CounterBasedRegularizationDefinition",
                        "cowclip_regularization": "CowClipDefinition",
                        "global_weight_decay": "GlobalWeightDecayDefinition"}
"""Our counter and global-decay optimizers' definitions -> FBGEMM's classes
(``fbgemm_gpu.tbe.config``)."""
_WEIGHT_DECAY_MODES = {"none": "NONE", "l2": "L2", "decoupled": "DECOUPLE"}


class NotOffered(Exception):
    """FBGEMM (this build, on this device) has no TBE with this optimizer."""


@dataclass(frozen=True)
class OptimPhase:
    """One ``fwd_bwd_<name>`` phase."""

    phase: str
    """``fwd_bwd_<name>``."""
    name: str
    """The registry name (``optim.REGISTRY``)."""
    config: optim.Optimizer
    """Ours, with the hyper-parameters of the phase."""
    fbgemm: str | None
    """FBGEMM's ``EmbOptimType`` member, None where FBGEMM has none."""

    def fbgemm_kwargs(self) -> dict[str, Any]:
        """FBGEMM's TBE constructor keywords with our config's values (the optimizer itself
        aside): ``learning_rate``, ``eps``, ``beta1``/``beta2``, ``weight_decay``, ``eta``,
        ``momentum``; ``weight_decay_mode`` as a ``WeightDecayMode`` member name where a
        rowwise Adagrad's decay applies; ``emainplace_mode`` / ``ensemble_mode`` as a dict of
        ``EmainplaceModeDefinition``'s / ``EnsembleModeDefinition``'s fields (``step_mode`` a
        ``StepMode`` member name in lower case). A field with no FBGEMM keyword raises."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self.config):
            value = getattr(self.config, f.name)
            if f.name in _FBGEMM_FIELDS:
                out[_FBGEMM_FIELDS[f.name]] = value
            elif f.name == "betas":
                out["beta1"], out["beta2"] = value
            elif f.name in _EMA_FIELDS:
                ensemble = isinstance(self.config, optim.EnsembleRowWiseAdagrad)
                out.setdefault("ensemble_mode" if ensemble else "emainplace_mode", {})[
                    f.name] = value
            elif f.name == "weight_decay_mode":
                if isinstance(self.config, optim.RowWiseAdagradWithCounter):
                    out["weight_decay_mode"] = value.upper()  # COUNTER or COWCLIP
                elif isinstance(self.config, optim.RowWiseAdagradGlobalDecay):
                    out["weight_decay_mode"] = "DECOUPLE_GLOBAL"
                elif self.config.applied_weight_decay > 0:
                    out["weight_decay_mode"] = _WEIGHT_DECAY_MODES[value]
            elif f.name in _COUNTER_DEFINITIONS:
                if value is not None:
                    out[f.name] = dataclasses.asdict(value)
            else:
                raise ValueError(f"{self.phase}: expected fields of {sorted(_FBGEMM_FIELDS)}, "
                                 f"betas, {list(_EMA_FIELDS)} or weight_decay_mode, got "
                                 f"{type(self.config).__name__}.{f.name}")
        return out

    def row_state_bytes(self, D: int) -> int:
        """Optimizer-state bytes read and written for one unique row of dim D (fp32 states;
        ensemble: its ``momentum1``, the slow copy is the whole-table step's)."""
        if isinstance(self.config, optim.EnsembleRowWiseAdagrad):
            return 2 * 4
        return 2 * optim.spec(self.name).state_bytes(1, D)

    def ema_bytes(self, tables: list[tuple[int, int]], weight_size: int) -> float:
        """Bytes per step of the whole-table steps (else 0): EMA-in-place's every row's D/2 +
        D/2 read and D/2 written, once every ``step_ema`` steps; ensemble's as the module
        docstring says."""
        if isinstance(self.config, optim.EnsembleRowWiseAdagrad):
            elems, c = sum(E * D for E, D in tables), self.config
            ema = elems * (weight_size + 2 * 4 + (4 if c.step_mode == "none" else 0))
            return ema / int(c.step_ema) + elems * (4 + weight_size) / int(c.step_swap)
        if not isinstance(self.config, optim.EmaInplaceRowWiseAdagrad):
            return 0.0
        per_run = sum(E * D * weight_size * 3 / 2 for E, D in tables)
        return per_run / int(self.config.step_ema)


def _config(name: str) -> optim.Optimizer:
    if name in CONFIGS:
        return CONFIGS[name]
    config = optim.spec(name).config
    has_lr = any(f.name == "lr" for f in dataclasses.fields(config))
    return config(lr=LR) if has_lr else config()


OPTIM_PHASES: dict[str, OptimPhase] = {
    f"fwd_bwd_{name}": OptimPhase(f"fwd_bwd_{name}", name, _config(name),
                                  optim.spec(name).fbgemm)
    for name in optim.REGISTRY
}
"""Every fused optimizer's phase, in the registry's order."""

DEFAULT_PHASES = ("fwd", "fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad")
"""``bench tbe``'s phases when ``--phases`` is not given (what it always timed)."""
PHASES = (*DEFAULT_PHASES, *(p for p in OPTIM_PHASES if p not in DEFAULT_PHASES))
"""Every phase: the defaults first, then the other optimizers in the registry's order."""


def phase(name: str) -> OptimPhase:
    """The phase ``fwd_bwd_<optimizer>``; a ValueError naming the choices otherwise."""
    if name not in OPTIM_PHASES:
        raise ValueError(f"expected a phase of {list(OPTIM_PHASES)}, got {name!r}")
    return OPTIM_PHASES[name]


def optimizer_of(phase_name: str) -> optim.Optimizer:
    """Our optimizer for a phase: the phase's, SGD for ``fwd`` (a module needs one)."""
    return CONFIGS["sgd"] if phase_name == "fwd" else phase(phase_name).config


def switch_optimizer(module, phase_name: str) -> str | None:
    """Give a ``TableBatchedEmbedding`` the phase's optimizer (new states at zero); None, or
    why the phase is skipped: the states do not fit in device memory (the module is left
    with SGD, no states)."""
    import torch  # noqa: PLC0415

    try:
        module.set_optimizer(optimizer_of(phase_name))
    except torch.OutOfMemoryError as e:
        module.set_optimizer(CONFIGS["sgd"])
        torch.cuda.empty_cache()
        return f"skipped: the {phase_name} states do not fit: {str(e).splitlines()[0]}"
    return None


def torch_not_offered(phases: list[str]):
    """(phase, why) for each training phase the torch and TorchRec providers do not time: they
    time SGD and (per-element) Adagrad only."""
    for name in phases:
        if name not in ("fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad"):
            yield name, "skipped: the torch providers time fwd_bwd_sgd and _rowwise_adagrad only"


def fbgemm_optimizer(entry: OptimPhase, fb: dict) -> dict[str, Any]:
    """The keywords of FBGEMM's TBE for ``entry``: ``optimizer`` (its ``EmbOptimType``
    member) and ``fbgemm_kwargs()`` with FBGEMM's types (``WeightDecayMode``,
    ``EmainplaceModeDefinition``). ``fb``: ``tbe_cases.import_fbgemm()``. Raises
    ``NotOffered`` where FBGEMM has no such optimizer or this fbgemm_gpu lacks it."""
    if entry.fbgemm is None:
        raise NotOffered(f"FBGEMM has no {entry.name} (our {type(entry.config).__name__})")
    kind = getattr(fb["OptimType"], entry.fbgemm, None)
    if kind is None:
        raise NotOffered(f"this fbgemm_gpu's EmbOptimType has no {entry.fbgemm}")
    kwargs = entry.fbgemm_kwargs()
    if "weight_decay_mode" in kwargs:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: PLC0415
            WeightDecayMode,
        )

        kwargs["weight_decay_mode"] = getattr(WeightDecayMode, kwargs["weight_decay_mode"])
    for key, cls_name in _COUNTER_DEFINITIONS.items():
        if key in kwargs:
            kwargs[key] = _fbgemm_definition(cls_name, kwargs[key])
    if "ensemble_mode" in kwargs:
        kwargs["ensemble_mode"] = _ensemble_mode(entry, kwargs["ensemble_mode"])
    if "emainplace_mode" in kwargs:
        mode = _emainplace_mode_class()
        if mode is None:
            raise NotOffered(f"this fbgemm_gpu has no EmainplaceModeDefinition ({entry.fbgemm}'s "
                             "schedule)")
        kwargs["emainplace_mode"] = mode(**kwargs["emainplace_mode"])
    return dict(optimizer=kind, **kwargs)


def _fbgemm_definition(cls_name: str, fields: dict[str, Any]):
    """FBGEMM's counter / CowClip definition with our definition's ``fields`` (enum members by
    name; the tail-id threshold as FBGEMM's ``TailIdThreshold``)."""
    from fbgemm_gpu.tbe import config  # noqa: PLC0415

    enums = {"counter_weight_decay_mode": config.CounterWeightDecayMode,
             "learning_rate_mode": config.LearningRateMode, "grad_sum_decay": config.GradSumDecay}
    out = {}
    for key, value in fields.items():
        if key in enums:
            out[key] = enums[key][{"decoupled": "DECOUPLE"}.get(value, value.upper())]
        elif key == "tail_id_threshold":
            out[key] = config.TailIdThreshold(value, fields["tail_id_threshold_is_ratio"])
        elif key != "tail_id_threshold_is_ratio":
            out[key] = value
    return getattr(config, cls_name)(**out)


def _ensemble_mode(entry: OptimPhase, fields: dict[str, Any]):
    """FBGEMM's ``EnsembleModeDefinition`` with our fields; ``NotOffered`` where this
    fbgemm_gpu lacks it or its feature gate is off (its lookup would assert)."""
    from fbgemm_gpu import config as gates  # noqa: PLC0415
    from fbgemm_gpu.tbe import config  # noqa: PLC0415

    gate = getattr(getattr(gates, "FeatureGateName", None), "TBE_ENSEMBLE_ROWWISE_ADAGRAD", None)
    if not hasattr(config, "EnsembleModeDefinition") or gate is None:
        raise NotOffered(f"this fbgemm_gpu has no EnsembleModeDefinition / feature gate for "
                         f"{entry.fbgemm}")
    if not gate.is_enabled():
        raise NotOffered("FBGEMM's feature gate TBE_ENSEMBLE_ROWWISE_ADAGRAD is off (its "
                         "environment variable FBGEMM_TBE_ENSEMBLE_ROWWISE_ADAGRAD=1 turns it on)")
    step_mode = config.StepMode[fields.pop("step_mode").upper()]
    return config.EnsembleModeDefinition(step_mode=step_mode, **fields)


def _emainplace_mode_class():
    """FBGEMM's ``EmainplaceModeDefinition``: in ``fbgemm_gpu.tbe.config`` (fbgemm-gpu 1.8), in
    the training module in older builds; None where neither has it."""
    import importlib  # noqa: PLC0415

    for module in ("fbgemm_gpu.tbe.config",
                   "fbgemm_gpu.split_table_batched_embeddings_ops_training"):
        try:
            found = getattr(importlib.import_module(module), "EmainplaceModeDefinition", None)
        except ImportError:
            continue
        if found is not None:
            return found
    return None


def refused(error: BaseException) -> bool:
    """Whether FBGEMM's constructor refused an optimizer it lacks on this device (its CPU TBE
    asserts "Optimizer ... is not supported in CPU mode"; an older build may not know a
    keyword), as opposed to failing for another reason."""
    text = str(error)
    return (isinstance(error, AssertionError) and "not supported" in text) or (
        isinstance(error, TypeError) and "unexpected keyword" in text)


def exact_sum_grad(grad):
    """``grad`` rounded to multiples of 2^-10: a row's gradient, a sum of such values below
    2^14 in magnitude, is then exact in fp32 in any order, so two implementations that sum in
    different orders (sorted runs, chunks, atomics) update from the same gradient. Per-element
    Adagrad's and Adam's ``g / (sqrt(v) + eps)`` turns a rounding difference of a gradient
    near 0 (|g| ~ 1e-7, eps 1e-8) into a step difference of ``lr``: with these gradients
    |g| is 0 or at least 2^-10, where the update is well conditioned."""
    return (grad * 1024).round() / 1024


def weights_err_limit(before, after, tol: float = 1e-4) -> float:
    """The limit of ``weights_err`` (max error / max update) for fp32 weights that moved from
    ``before`` to ``after`` (FBGEMM's): ``tol`` of the largest update plus the fp32 spacing at
    the largest ``|weight|`` over that update. Both sides store ``w - step`` rounded to fp32,
    so steps that differ by d leave weights up to d + one spacing apart; where the update is
    far below the weights (LARS-SGD: ``lr * eta = 1e-5`` of the row's norm) one spacing alone
    is more than ``tol`` of it, where it is large (Adam: ``lr``) the spacing adds nothing."""
    import torch  # noqa: PLC0415

    top = torch.maximum(before.abs().max(), after.abs().max()).float()
    spacing = (torch.nextafter(top, torch.tensor(float("inf"))) - top).item()
    update = (after.double() - before.double()).abs().max().clamp(min=1e-30).item()
    return tol + spacing / update


def compare_with_fbgemm(shape, batch, device, phases: list[str], backend: str, build_fbgemm,
                        build_ours) -> tuple[dict, dict[str, tuple[float, str]]]:
    """Ours vs FBGEMM after one step of each timed ``fwd_bwd_*`` phase but SGD's (which
    ``tbe_cases.compare_with_fbgemm`` checks on the whole shape), on table 0 alone (its ids
    of the timed batch, its columns of the gradient; one table keeps the two modules and
    their states small): the same weights in both, one forward + fused backward, then the
    rows the batch touched and, per state, the state at those rows.

    ``build_fbgemm(shape, name, device)``: FBGEMM's TBE for the registry name (raises
    ``NotOffered``); ``build_ours(shape, optimizer)``: ours with uninitialised weights. Where
    FBGEMM's step raises (a RuntimeError), ``<phase>`` says so and the phase is not compared.
    Returns (values, limits) for ``tbe_cases.failures``: ``<phase>.weights_err`` (fp32: max
    error over the largest update FBGEMM made, within ``weights_err_limit``; half: max abs
    error, both round),
    ``<phase>.<state>_rel_err`` (max error / max |FBGEMM's|), or ``<phase>`` = "fbgemm: not
    offered (why)"."""
    import torch  # noqa: PLC0415 (this module's table is read without torch by its tests)

    E0, D0 = shape.tables[0]
    one = dataclasses.replace(shape, groups=((1, E0, D0),))
    n0 = batch.lookups[0]
    idx, off = batch.indices[:n0], batch.offsets[: shape.B + 1]
    grad = exact_sum_grad(batch.grad[:, :D0].contiguous())
    touched = torch.unique(idx)
    half = shape.dtype != torch.float32
    values: dict = {}
    limits: dict[str, tuple[float, str]] = {}
    for name in [p for p in PHASES if p in phases and p not in ("fwd", "fwd_bwd_sgd")]:
        entry = phase(name)
        try:
            fb = build_fbgemm(one, entry.name, device)
        except NotOffered as e:
            values[name] = f"fbgemm: not offered ({e})"
            continue
        ours = build_ours(one, entry.config)
        with torch.no_grad():
            ours.split_embedding_weights()[0].copy_(fb.split_embedding_weights()[0].view(E0, D0))
        w_f, w_o = fb.split_embedding_weights()[0].view(E0, D0), ours.split_embedding_weights()[0]
        before = w_f[touched].double()
        try:  # the peer failing at run time is reported, not held against ours
            fb(idx, off).backward(grad)
        except RuntimeError as e:
            values[name] = f"fbgemm raised {type(e).__name__}: {str(e)[:300]}"
            del fb, ours, w_f, w_o
            continue
        ours(idx, off).backward(grad)
        after_f, after_o = w_f[touched].double(), w_o[touched].double()
        err = (after_o - after_f).abs().max()
        what = f"{name}: table 0's touched rows after one step vs FBGEMM"
        if half:
            limits[f"{name}.weights_err"] = (2e-3, what + " (max abs err)")
        else:
            err = err / (after_f - before).abs().max().clamp(min=1e-30)
            limits[f"{name}.weights_err"] = (weights_err_limit(before, after_f), what + (
                " (max err / max update; 1e-4 + one fp32 spacing of the weights)"))
        values[f"{name}.weights_err"] = err.item()
        states_f, states_o = fb.split_optimizer_states()[0], ours.split_optimizer_states()[0]
        for state, s_f, s_o in zip(optim.spec(entry.name).states, states_f, states_o,
                                   strict=True):
            if s_f.numel() != s_o.numel():
                values[f"{name}.{state.name}_rel_err"] = float("nan")  # fails, with the sizes
                limits[f"{name}.{state.name}_rel_err"] = (0.0, f"{name}: {state.name} has "
                                                          f"{s_o.numel()} values, FBGEMM's "
                                                          f"{s_f.numel()}")
                continue
            a, b = s_o[touched].double(), s_f.reshape(s_o.shape)[touched].double()
            values[f"{name}.{state.name}_rel_err"] = (
                (a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
            limits[f"{name}.{state.name}_rel_err"] = (
                1e-2 if half else 1e-4, f"{name}: {state.name} at the touched rows vs FBGEMM "
                "(max err / max |FBGEMM's|)")
        del fb, ours, w_f, w_o, states_f, states_o
        if torch.cuda.is_available():  # the next phase's two modules start from free memory
            torch.cuda.empty_cache()
    return values, limits
