"""TorchRec's sharder ``fused_params`` (FBGEMM's TBE keyword arguments) as our fused optimizer,
torch-free (``sharding/dmp.py``'s sharders read it; ``docs/torchrec_dropin.md``).

TorchRec users pick a fused optimizer through a sharder's ``fused_params``, which TorchRec
passes to FBGEMM's TBE: ``{"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate":
0.05, "eps": 1e-8, ...}``. ``from_fused_params`` maps them onto ``optim.REGISTRY``:

- ``optimizer``: FBGEMM's ``EmbOptimType`` member, its name or value in any case, or, for an
  optimizer FBGEMM lacks (``ftrl``, ``rowwise_rmsprop_ar``), our registry name;
  EXACT_ROWWISE_ADAGRAD with ``weight_decay_mode`` COUNTER / COWCLIP is
  ``rowwise_adagrad_with_counter``, with DECOUPLE_GLOBAL ``rowwise_adagrad_global_decay``
  (its ``global_weight_decay``: FBGEMM's ``GlobalWeightDecayDefinition``);
- FBGEMM's names of the hyper-parameters (``FBGEMM_KEYS``): ``learning_rate`` is ``lr``,
  ``beta1`` / ``beta2`` are ``betas``, ``ensemble_mode`` / ``emainplace_mode`` (FBGEMM's
  definitions, or mappings of their fields) spread into the ``step_*`` fields; the others
  keep their names; where not given, FBGEMM's TBE defaults (``FBGEMM_DEFAULTS``; rowwise
  Adagrad's ``weight_decay_mode`` NONE, as FBGEMM's, not our config's L2);
- a field of our config (``optim.FTRL``'s ``l1``, ...) by its own name;
- ``optimizer_state_dtypes``: handed back as given (the states' storage, not the update).

A key of another FBGEMM option (``cache_load_factor``, ``stochastic_rounding``, ...) or one
the chosen optimizer does not read (``momentum`` of rowwise Adagrad), unless it is at FBGEMM's
default, raises ValueError naming it: nothing is ignored silently.
"""

from collections.abc import Mapping
from typing import Any

from fbtriton_dist import optim, optim_ensemble, optim_gwd

FBGEMM_DEFAULTS: Mapping[str, Any] = {
    "learning_rate": 0.01, "eps": 1e-8, "weight_decay": 0.0, "weight_decay_mode": "none",
    "beta1": 0.9, "beta2": 0.999, "eta": 0.001, "momentum": 0.9,
}
"""FBGEMM's TBE (``SplitTableBatchedEmbeddingBagsCodegen``, fbgemm-gpu 1.8.0) defaults of its
optimizer keywords that several optimizers share."""

FBGEMM_KEYS = (*FBGEMM_DEFAULTS, "ensemble_mode", "emainplace_mode",
               "counter_based_regularization", "cowclip_regularization", "global_weight_decay")
"""FBGEMM's TBE optimizer keywords that map onto our configs' fields."""

_FIELD = {"learning_rate": "lr"}
"""FBGEMM's keyword -> our field, where the names differ (``beta1`` / ``beta2``: ``betas``)."""

_SCHEDULES = {"ensemble_mode": (optim.EnsembleRowWiseAdagrad, optim_ensemble.MODE_FIELDS),
              "emainplace_mode": (optim.EmaInplaceRowWiseAdagrad,
                                  ("step_ema", "step_start", "step_ema_coef"))}
"""FBGEMM's schedule arguments: the config that reads each and the fields it spreads into."""


def _is_default(key: str, value: Any) -> bool:
    """``value`` is FBGEMM's default of ``key`` (None for the definitions; NONE, in any of
    its forms, for ``weight_decay_mode``)."""
    if key == "weight_decay_mode":
        return str(getattr(value, "name", value)).lower() in ("none", "0")
    return value is None or value == FBGEMM_DEFAULTS.get(key)


def _entry(value: Any, fused: Mapping[str, Any]) -> optim.OptimizerSpec:
    """The registry entry that ``fused_params["optimizer"]`` names."""
    raw = getattr(value, "name", value)
    names = {str(raw).lower(), str(getattr(value, "value", raw)).lower()}
    fbgemm = {e.fbgemm: e for e in reversed(optim.REGISTRY.values()) if e.fbgemm}
    by_value = {"exact_row_wise_adagrad": "EXACT_ROWWISE_ADAGRAD",
                "partial_row_wise_adam": "PARTIAL_ROWWISE_ADAM",
                "partial_row_wise_lamb": "PARTIAL_ROWWISE_LAMB",
                "ema_in_place_row_wise_adagrad": "EMAINPLACE_ROWWISE_ADAGRAD",
                "ensemble_row_wise_adagrad": "ENSEMBLE_ROWWISE_ADAGRAD"}
    for name in names:
        key = by_value.get(name, name.upper())
        if key in fbgemm:
            entry = fbgemm[key]
            if entry.name == "rowwise_adagrad" and optim.counter_mode(
                    fused.get("weight_decay_mode")):  # FBGEMM's COUNTER / COWCLIP
                return optim.REGISTRY["rowwise_adagrad_with_counter"]
            if entry.name == "rowwise_adagrad" and optim_gwd.is_global_mode(
                    fused.get("weight_decay_mode")):  # FBGEMM's DECOUPLE_GLOBAL
                return optim.REGISTRY["rowwise_adagrad_global_decay"]
            return entry
        if name in optim.REGISTRY and optim.REGISTRY[name].fbgemm is None:
            return optim.REGISTRY[name]
    choices = [*dict.fromkeys(e.fbgemm for e in optim.REGISTRY.values() if e.fbgemm),
               *(n for n, e in optim.REGISTRY.items() if e.fbgemm is None)]
    raise ValueError(f"fused_params['optimizer']: expected one of [{', '.join(choices)}] "
                     f"(FBGEMM's EmbOptimType, or ours where FBGEMM has none), got {value!r}")


def from_fused_params(fused_params: Mapping[str, Any]) -> tuple[optim.Optimizer | None,
                                                               Any]:
    """``(our fused optimizer or None, optimizer_state_dtypes or None)`` of a sharder's
    ``fused_params``; None where it names no ``optimizer`` (then it may hold only
    ``optimizer_state_dtypes``). Raises ValueError naming a key that does not map."""
    fused = dict(fused_params)
    dtypes = fused.pop("optimizer_state_dtypes", None)
    if "optimizer" not in fused:
        if fused:
            raise ValueError(f"fused_params: {sorted(fused)} configure a fused optimizer; "
                             "expected fused_params['optimizer'] with them (or the optimizer "
                             "from apply_optimizer_in_backward, without them)")
        return None, dtypes
    entry = _entry(fused.pop("optimizer"), fused)
    fields = set(entry.config.__dataclass_fields__)
    values: dict[str, Any] = {}
    if entry.fbgemm is not None:  # FBGEMM's defaults, not our configs'
        for key, default in FBGEMM_DEFAULTS.items():
            if _FIELD.get(key, key) in fields:
                values[_FIELD.get(key, key)] = default
        if "betas" in fields:
            values["betas"] = (FBGEMM_DEFAULTS["beta1"], FBGEMM_DEFAULTS["beta2"])
    unread = []
    for key, value in fused.items():
        if key in _SCHEDULES:
            config, spread = _SCHEDULES[key]
            if entry.config is not config:
                if value is not None:
                    unread.append(key)
                continue
            mode = dict(value) if isinstance(value, Mapping) else {
                k: getattr(value, k) for k in spread if hasattr(value, k)}
            if extra := sorted(set(mode) - set(spread)):
                raise ValueError(f"fused_params[{key!r}].{extra[0]}: expected a field among "
                                 f"[{', '.join(spread)}]")
            values.update(mode)
        elif key in ("beta1", "beta2") and "betas" in fields:
            betas = list(values["betas"])
            betas[key == "beta2"] = value
            values["betas"] = tuple(betas)
        elif _FIELD.get(key, key) in fields:
            values[_FIELD.get(key, key)] = value
        elif key in FBGEMM_KEYS:
            if not _is_default(key, value):
                unread.append(key)
        else:
            raise ValueError(
                f"fused_params[{key!r}]: expected a key among [optimizer, "
                f"optimizer_state_dtypes, {', '.join(FBGEMM_KEYS)}] or a field of "
                f"{entry.config.__name__} [{', '.join(sorted(fields))}]; other FBGEMM TBE "
                "options have no equivalent here")
    if unread:
        raise ValueError(f"fused_params: {entry.name} does not read {sorted(unread)}; expected "
                         "them left out (or at FBGEMM's defaults)")
    return entry.config(**values), dtypes
