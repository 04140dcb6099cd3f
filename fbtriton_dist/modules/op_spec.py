"""What a traced lookup op (``ebc_op``, ``ec_op``) knows besides its tensors: the static layout.

A collection's registered lookup ops are functions of their inputs alone: the KJT's tensors,
the per-table weights, the state of each group with a fused optimizer
(``TableGroups.op_states()``: step counter and momenta, registered as the module's
non-persistent buffers) and ``spec``, one JSON
string made at trace time (``spec_of``): the table configs, the module's options and each
group's fused optimizer, seed and rounding. So a graph holding the op runs on whatever tensors
it is given: a ``copy.deepcopy`` of a traced or compiled model updates its own weights and
state, and an exported program runs after ``torch.export.save`` / ``load`` in another process.

Inside the op, ``skeleton(spec, device)`` is the collection rebuilt from the spec on the meta
device (no weights) with its TBEs' small layout buffers on ``device``, cached per process;
``bind`` points its TBEs at the given tensors for one call. Weights that are views of one
buffer per group (a live module's) are read and updated in place; otherwise (a loaded
program's separate tensors) a group's weights are packed into one buffer for the call and a
fused update is copied back into them.
"""

import dataclasses
import functools
import json
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from fbtriton_dist import optim
from fbtriton_dist.modules.table_groups import OP_STATES

MODULES: dict[str, type] = {}
"""Class name -> the collection class (``ebc.py`` and ``ec.py`` add theirs when imported)."""

FORMAT = 1
"""The spec's layout version; a program traced with another one is refused."""


def _config(cfg) -> dict:
    return {
        "name": cfg.name,
        "num_embeddings": int(cfg.num_embeddings),
        "embedding_dim": int(cfg.embedding_dim),
        "feature_names": list(cfg.feature_names),
        "pooling": getattr(getattr(cfg, "pooling", None), "name", str(getattr(cfg, "pooling", ""))),
        "data_type": getattr(cfg.data_type, "name", str(cfg.data_type)),
    }


def _optimizer(opt: optim.Optimizer | None) -> list | None:
    return None if opt is None else [type(opt).__name__, dataclasses.asdict(opt)]


def _from_json(value: list | None) -> optim.Optimizer | None:
    if value is None:
        return None
    name, fields = value
    if "betas" in fields:
        fields["betas"] = tuple(fields["betas"])
    return getattr(optim, name)(**fields)


def spec_of(module) -> str:
    """The static layout of ``module`` (an EmbeddingBagCollection or EmbeddingCollection) as
    the lookup ops take it. Syncs the fused optimizers with the parameters' annotations first
    (their states must exist before a graph reads them)."""
    groups = []
    tbe_groups = module.tbe_groups()
    for tbe, members in tbe_groups:
        fused = module.sync_optimizer(tbe, members)
        groups.append({"optimizer": _optimizer(fused), "seed": tbe.seed,
                       "stochastic_rounding": tbe.stochastic_rounding})
    tbe = tbe_groups[0][0]
    return json.dumps({
        "format": FORMAT,
        "module": type(module).__name__,
        "tables": [_config(c) for c in module.table_configs()],
        # TorchRec's accessors: the EBC's is_weighted(), the EC's need_indices()
        "is_weighted": bool(module.is_weighted()) if hasattr(module, "is_weighted") else False,
        "need_indices": (bool(module.need_indices()) if hasattr(module, "need_indices")
                         else False),
        "backend": tbe.backend,
        "bounds_check": tbe.bounds_check,
        "groups": groups,
    }, sort_keys=True)


@functools.lru_cache(maxsize=64)
def parse(spec: str) -> dict:
    s = json.loads(spec)
    if s.get("format") != FORMAT:
        raise RuntimeError(
            f"fbtriton_dist lookup op: expected a spec of format {FORMAT}, got "
            f"{s.get('format')!r} (traced with another fbtriton_dist version)"
        )
    return s


@functools.lru_cache(maxsize=64)
def skeleton(spec: str, device: str):
    """The collection of ``spec`` on the meta device, its TBEs' layout on ``device``."""
    s = parse(spec)
    cls = MODULES.get(s["module"])
    if cls is None:
        raise RuntimeError(
            f"fbtriton_dist lookup op: expected one of the collections {sorted(MODULES)}, got "
            f"{s['module']!r}; import fbtriton_dist.modules.ebc and fbtriton_dist.modules.ec "
            "(they register the ops and the collections) before running or loading a program"
        )
    configs = [SimpleNamespace(**t, init_fn=None) for t in s["tables"]]
    options = {"device": "meta", "backend": s["backend"], "bounds_check": s["bounds_check"]}
    if s["module"] == "EmbeddingBagCollection":
        module = cls(configs, is_weighted=s["is_weighted"], **options)
    else:
        module = cls(configs, need_indices=s["need_indices"], **options)
    for (tbe, _), group in zip(module.tbe_groups(), s["groups"], strict=True):
        tbe.set_layout_buffers(torch.device(device))
        tbe.seed, tbe.stochastic_rounding = group["seed"], group["stochastic_rounding"]
        tbe.optimizer = _from_json(group["optimizer"])
    return module


@functools.lru_cache(maxsize=64)
def groups(spec: str) -> list[list[int]]:
    """The config indices of each group's tables, as the module groups them (by dtype and
    pooling, or by dtype without pooling), from the spec alone: fake implementations run
    under a fake tensor mode, where no module can be built."""
    s = parse(spec)
    pooled = s["module"] == "EmbeddingBagCollection"
    found: dict[tuple, list[int]] = {}
    for t, cfg in enumerate(s["tables"]):
        found.setdefault((cfg["data_type"], cfg["pooling"] if pooled else ""), []).append(t)
    return list(found.values())


def fused_tables(spec: str) -> set[int]:
    """Config indices of the tables whose group has a fused optimizer."""
    s = parse(spec)
    return {t for members, group in zip(groups(spec), s["groups"], strict=True)
            if group["optimizer"] is not None for t in members}


def feature_dims(spec: str) -> list[int]:
    """D of each feature in the module's feature order (group after group)."""
    tables = parse(spec)["tables"]
    return [tables[t]["embedding_dim"] for members in groups(spec) for t in members
            for _ in tables[t]["feature_names"]]


def _flat(params: list[Tensor]) -> Tensor | None:
    """The one buffer ``params`` are back-to-back views of, or None."""
    p0 = params[0]
    at = p0.data_ptr()
    for p in params:
        if not p.is_contiguous() or p.dtype != p0.dtype or p.device != p0.device \
                or p.data_ptr() != at:
            return None
        at += p.numel() * p.element_size()
    total = sum(p.numel() for p in params)
    return p0.detach().as_strided((total,), (1,), p0.storage_offset())


OPS_LACK = {optim.RowWiseAdagradWithCounter: "carry its prev_iter / row_counter",
            optim.EmaInplaceRowWiseAdagrad: "run its whole-table step before the lookup",
            optim.EnsembleRowWiseAdagrad: "run its whole-table step before the lookup",
            optim.RowWiseAdagradGlobalDecay: "carry its prev_iter"}
"""Fused optimizers the registered lookup ops cannot train, with what they would miss."""


def lacks_ops(module) -> bool:
    """Does a group of ``module`` (a collection) train with an optimizer of ``OPS_LACK``?"""
    return any(type(module.sync_optimizer(tbe, members)) in OPS_LACK
               for tbe, members in module.tbe_groups())


def bind(module, params: list[Tensor], states: list[Tensor]):
    """Point ``module``'s (a skeleton's) TBEs at ``params`` (one per table, config order) and
    ``states`` (``OP_STATES`` of each group with a fused optimizer). Returns (``bound`` for
    ``lookup``, the packed copies ``[(tbe, params of its group)]`` a fused update must be
    copied back from)."""
    bound, packed, n, g = [], [], len(OP_STATES), 0
    for tbe, members in module.tbe_groups():
        ps = [params[t] for t in members]
        flat = _flat(ps)
        if flat is None:
            flat = torch.cat([p.detach().reshape(-1) for p in ps])
            packed.append((tbe, ps))
        tbe.weights = nn.Parameter(flat, requires_grad=False)
        if type(tbe.optimizer) in OPS_LACK:
            raise ValueError(f"{optim.spec_of(tbe.optimizer).name}: expected an eager collection "
                             "(the registered lookup ops of FX / torch.export do not "
                             f"{OPS_LACK[type(tbe.optimizer)]}; torch.compile looks it up "
                             "eagerly between its graphs), got a traced one")
        if tbe.optimizer is not None:
            for name, state in zip(OP_STATES, states[g * n : (g + 1) * n], strict=True):
                setattr(tbe, name, state)
            g += 1
        bound.append((ps, tbe.optimizer))
    return bound, packed


def release(module) -> None:
    """Let go of the tensors ``bind`` gave a cached skeleton (they may be a whole model's)."""
    for tbe, _ in module.tbe_groups():
        tbe.weights = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
        if tbe.optimizer is not None:
            for name in OP_STATES:
                setattr(tbe, name, torch.empty(0, device="meta"))


def copy_back(packed) -> None:
    """A fused update of packed weights, written into the tensors they were packed from."""
    with torch.no_grad():
        for tbe, ps in packed:
            for p, view in zip(ps, tbe.split_embedding_weights(), strict=True):
                p.copy_(view)
