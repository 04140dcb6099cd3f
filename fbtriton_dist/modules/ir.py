"""Exported programs that carry our EmbeddingBagCollection out of the process, and back in.

The counterpart of TorchRec's IR serializer (``torchrec.ir``: ``encapsulate_ir_modules`` /
``decapsulate_ir_modules``), for our module::

    model, fqns = encapsulate_ir_modules(model)
    ep = torch.export.export(model, (kjt,), strict=False, preserve_module_call_signature=fqns)
    torch.export.save(ep, path)
    ...                                    # another process
    ep = load(path)                        # runs as it is: ``portable.ebc_portable_lookup``
    model = decapsulate_ir_modules(torch.export.unflatten(ep))  # our modules again

``encapsulate_ir_modules`` gives each of our EBCs a non-persistent ``ir_metadata`` buffer (its
configs as JSON bytes) and makes its traced forward the portable op, a function of the graph's
inputs and weights alone (inference). ``decapsulate_ir_modules`` builds an EBC from each
``ir_metadata`` it finds, loads the unflattened module's weights into it and puts it in its
place, so training, the fused optimizer and ``shard()`` work on the result. A table's
``init_fn`` is code, not data: the rebuilt configs have none (their weights are loaded).
"""

import json

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from fbtriton_dist.modules.ebc import EmbeddingBagCollection

FORMAT = 1
"""``ir_metadata``'s layout version; another one is refused."""


def _config_dict(cfg) -> dict:
    return {
        "name": cfg.name,
        "num_embeddings": cfg.num_embeddings,
        "embedding_dim": cfg.embedding_dim,
        "feature_names": list(cfg.feature_names),
        "pooling": getattr(cfg.pooling, "name", str(cfg.pooling)),
        "data_type": getattr(cfg.data_type, "name", str(cfg.data_type)),
        "weight_init_min": cfg.weight_init_min,
        "weight_init_max": cfg.weight_init_max,
    }


def serialize(module: EmbeddingBagCollection) -> torch.Tensor:
    """The module's configs as uint8 JSON bytes."""
    meta = {
        "format": FORMAT,
        "module": "fbtriton_dist.EmbeddingBagCollection",
        "is_weighted": module.is_weighted(),
        "tables": [_config_dict(c) for c in module.embedding_bag_configs()],
    }
    return torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8).clone()


def deserialize(data: torch.Tensor, device: torch.device | str = "cpu") -> EmbeddingBagCollection:
    """An EmbeddingBagCollection (weights uninitialised: load them) from ``serialize``'s bytes."""
    try:
        meta = json.loads(bytes(data.cpu().tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"ir_metadata: not the JSON serialize() writes ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"ir_metadata: expected format {FORMAT}, got {got}")
    tables = []
    for t in meta["tables"]:
        tables.append(
            EmbeddingBagConfig(
                name=t["name"],
                num_embeddings=t["num_embeddings"],
                embedding_dim=t["embedding_dim"],
                feature_names=list(t["feature_names"]),
                pooling=PoolingType[t["pooling"]],
                data_type=DataType[t["data_type"]],
                weight_init_min=t["weight_init_min"],
                weight_init_max=t["weight_init_max"],
            )
        )
    with torch.random.fork_rng(devices=[]):  # the weights are loaded: leave the caller's RNG
        return EmbeddingBagCollection(tables, is_weighted=meta["is_weighted"], device=device)


def encapsulate_ir_modules(model: nn.Module) -> tuple[nn.Module, tuple[str, ...]]:
    """Prepare ``model`` (in place) for ``torch.export``: returns it and the fully qualified
    names of our EBCs in it, for ``preserve_module_call_signature``."""
    fqns = []
    for fqn, module in model.named_modules():
        if isinstance(module, EmbeddingBagCollection):
            module.register_buffer("ir_metadata", serialize(module), persistent=False)
            module.set_portable_export()
            fqns.append(fqn)
    return model, tuple(fqns)


def load(f) -> torch.export.ExportedProgram:
    """``torch.export.load`` with weights_only unpickling of the saved example inputs: TorchRec's
    KJT, KeyedTensor and JaggedTensor are allowed, nothing else that torch does not allow."""
    with torch.serialization.safe_globals([KeyedJaggedTensor, KeyedTensor, JaggedTensor]):
        return torch.export.load(f)


def decapsulate_ir_modules(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Replace (in place) each submodule of an unflattened exported program that carries an
    ``ir_metadata`` buffer by our EmbeddingBagCollection with its weights; returns ``model``."""
    found = [
        (fqn, m)
        for fqn, m in model.named_modules()
        if "ir_metadata" in dict(m.named_buffers(recurse=False))
    ]
    for fqn, old in found:
        params = dict(old.named_parameters())
        where = device if device is not None else next(iter(params.values())).device
        new = deserialize(old.get_buffer("ir_metadata"), where)
        state = {k: params[k] for k in new.state_dict() if k in params}
        missing = sorted(set(new.state_dict()) - set(state))
        if missing:
            raise ValueError(f"{fqn or 'model'}: the exported program has no weights {missing}")
        new.load_state_dict({k: v.detach() for k, v in state.items()})
        if not fqn:
            return new
        parent_name, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, name, new)
    return model
