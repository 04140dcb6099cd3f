"""Our collections in TorchRec's IR serializer (``torchrec.ir``), where the installed torchrec
has it (the 1.8.0 wheel does not ship ``torchrec.ir``; then nothing is registered and
``modules/ir.py`` is the way to carry a model out and back).

``torchrec.ir.serializer.JsonSerializer`` finds a module's serializer by its class name, and
ours are named as TorchRec's. ``register`` therefore puts one serializer under the name that
serves both: TorchRec's module goes to TorchRec's serializer, ours is described by its
configs (``"fbtriton_dist": 1`` marks the metadata) and rebuilt as ours by
``decapsulate_ir_modules``. Encapsulated, our EBC takes TorchRec's meta forward where the
installed torchrec has one (the same IR as TorchRec's EBC); our EC keeps its own traced
forward, whose lookup op is a function of its inputs (``op_spec``), so the exported program
runs wherever fbtriton_dist is imported.
"""

import importlib.util


def available() -> bool:
    """Is ``torchrec.ir`` importable here?"""
    try:
        return importlib.util.find_spec("torchrec.ir") is not None
    except ModuleNotFoundError:
        return False


def _config_dict(cfg) -> dict:
    return {"name": cfg.name, "num_embeddings": cfg.num_embeddings,
            "embedding_dim": cfg.embedding_dim, "feature_names": list(cfg.feature_names),
            "pooling": getattr(getattr(cfg, "pooling", None), "name", None),
            "data_type": cfg.data_type.name, "weight_init_min": cfg.weight_init_min,
            "weight_init_max": cfg.weight_init_max}


def register(cls) -> bool:
    """Register ``cls`` (our EmbeddingBagCollection or EmbeddingCollection) with
    ``torchrec.ir``'s JsonSerializer; False where torchrec has no ``torchrec.ir``."""
    if not available():
        return False
    import torch
    from torchrec.ir import serializer as trs
    from torchrec.modules.embedding_configs import (
        DataType,
        EmbeddingBagConfig,
        EmbeddingConfig,
        PoolingType,
    )

    pooled = cls.__name__ == "EmbeddingBagCollection"
    theirs = trs.JsonSerializer.module_to_serializer_cls.get(cls.__name__)
    meta_forward = getattr(trs, "ebc_meta_forward", None) if pooled else None

    class Serializer(trs.JsonSerializer):
        _module_cls = (theirs._module_cls, cls) if theirs is not None else cls

        @classmethod
        def serialize_to_dict(cls_, module) -> dict:
            if not isinstance(module, cls):
                return theirs.serialize_to_dict(module)
            configs = module.embedding_bag_configs() if pooled else module.embedding_configs()
            out = {"fbtriton_dist": 1, "tables": [_config_dict(c) for c in configs],
                   "device": str(module.device)}
            out.update({"is_weighted": module.is_weighted()} if pooled
                       else {"need_indices": module.need_indices()})
            return out

        @classmethod
        def deserialize_from_dict(cls_, metadata_dict, device=None, unflatten_ep=None):
            if not metadata_dict.get("fbtriton_dist"):
                return theirs.deserialize_from_dict(metadata_dict, device, unflatten_ep)
            if device is None and metadata_dict.get("device"):
                device = torch.device(metadata_dict["device"])
            tables = []
            for t in metadata_dict["tables"]:
                t = dict(t, data_type=DataType[t["data_type"]])
                pooling = t.pop("pooling")
                tables.append(EmbeddingBagConfig(**t, pooling=PoolingType[pooling]) if pooled
                              else EmbeddingConfig(**t))
            if pooled:
                return cls(tables, is_weighted=metadata_dict["is_weighted"], device=device)
            return cls(tables, device=device, need_indices=metadata_dict["need_indices"])

        @classmethod
        def swap_meta_forward(cls_, module) -> None:
            if not isinstance(module, cls):
                theirs.swap_meta_forward(module)
            elif meta_forward is not None:
                module.forward = meta_forward.__get__(module, cls)

    trs.JsonSerializer.module_to_serializer_cls[cls.__name__] = Serializer
    return True
