"""Our collections in TorchRec's IR serializer (``torchrec.ir``). The installed torchrec 1.8.0
wheel has no ``torchrec.ir``: TorchRec's own flow (encapsulate, export with dynamic KJT
shapes, save/load, unflatten, decapsulate) is tested where it is importable and skipped here
naming the missing module; ``modules/ir.py`` (``test_ebc_script_ir.py``) serves the wheel
without it. Our registration's dispatch (TorchRec's module to TorchRec's serializer, ours to
ours, rebuilt from its configs) is tested everywhere on a stand-in registry."""

import copy
import sys
import types

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig

import fbtriton_dist
from fbtriton_dist.modules import torchrec_ir
from tests.modules.test_portable_graphs import _kjt, _pair

NO_IR = pytest.mark.skipif(not torchrec_ir.available(),
                           reason="torchrec.ir: module not in the installed torchrec wheel")


def test_without_torchrec_ir_nothing_is_registered():
    try:
        import torchrec.ir  # noqa: F401
    except ImportError:
        assert not torchrec_ir.available()
        assert torchrec_ir.register(fbtriton_dist.EmbeddingBagCollection) is False
    else:
        assert torchrec_ir.available()


class _TheirSerializer:
    """Stands in for the serializer TorchRec registers under the same class name."""

    _module_cls = torchrec.EmbeddingBagCollection

    @classmethod
    def serialize_to_dict(cls, module):
        return {"theirs": True}

    @classmethod
    def deserialize_from_dict(cls, metadata_dict, device=None, unflatten_ep=None):
        return "their module"

    @classmethod
    def swap_meta_forward(cls, module):
        module.swapped = True


@pytest.fixture
def stand_in_ir(monkeypatch):
    """A ``torchrec.ir.serializer`` with TorchRec's registry shape (a ``JsonSerializer`` whose
    ``module_to_serializer_cls`` maps class names to serializers)."""
    package, serializer = types.ModuleType("torchrec.ir"), types.ModuleType(
        "torchrec.ir.serializer")

    class JsonSerializer:
        module_to_serializer_cls = {"EmbeddingBagCollection": _TheirSerializer}

    serializer.JsonSerializer = JsonSerializer
    package.serializer = serializer
    monkeypatch.setitem(sys.modules, "torchrec.ir", package)
    monkeypatch.setitem(sys.modules, "torchrec.ir.serializer", serializer)
    monkeypatch.setattr(torchrec_ir, "available", lambda: True)
    return JsonSerializer


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_registration_dispatches_theirs_and_rebuilds_ours(stand_in_ir, kind):
    cls = fbtriton_dist.EmbeddingBagCollection if kind == "ebc" else fbtriton_dist.EmbeddingCollection
    assert torchrec_ir.register(cls)
    entry = stand_in_ir.module_to_serializer_cls[cls.__name__]
    theirs, ours = _pair(kind)
    module = ours.ebc if kind == "ebc" else ours.ec
    if kind == "ebc":  # the name is shared with TorchRec's: its module still goes to its own
        their_module = theirs.ebc
        assert isinstance(their_module, entry._module_cls)
        assert entry.serialize_to_dict(their_module) == {"theirs": True}
        assert entry.deserialize_from_dict({"theirs": True}) == "their module"
    assert isinstance(module, entry._module_cls)
    metadata = entry.serialize_to_dict(module)
    rebuilt = entry.deserialize_from_dict(copy.deepcopy(metadata))
    assert type(rebuilt) is cls and entry.serialize_to_dict(rebuilt) == metadata
    rebuilt.load_state_dict(module.state_dict())
    kjt = _kjt(3, 0)
    got, want = rebuilt(kjt), module(kjt)
    if kind == "ebc":
        torch.testing.assert_close(got.values(), want.values())
    else:
        for k in want:
            torch.testing.assert_close(got[k].values(), want[k].values())


def _tables(kind):
    if kind == "ebc":
        return [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                   feature_names=["f1", "f2", "f3"])]
    return [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10,
                            feature_names=["f1", "f2", "f3"])]


@NO_IR
@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_torchrec_ir_flow_with_dynamic_kjt(kind, tmp_path):  # pragma: no cover (no torchrec.ir)
    from torchrec.ir.serializer import JsonSerializer
    from torchrec.ir.utils import decapsulate_ir_modules, encapsulate_ir_modules, mark_dynamic_kjt

    _, ours = _pair(kind)
    kjt = _kjt(3, 0)
    want = ours(kjt)
    model, fqns = encapsulate_ir_modules(copy.deepcopy(ours), JsonSerializer)
    ep = torch.export.export(model, (kjt,), dynamic_shapes=mark_dynamic_kjt(kjt), strict=False,
                             preserve_module_call_signature=tuple(fqns))
    torch.export.save(ep, tmp_path / "m.pt2")
    back = decapsulate_ir_modules(torch.export.unflatten(torch.export.load(tmp_path / "m.pt2")),
                                  JsonSerializer)
    back.load_state_dict(ours.state_dict())
    inner = back.ebc if kind == "ebc" else back.ec
    assert type(inner).__module__.startswith("fbtriton_dist")
    torch.testing.assert_close(back(kjt), want)
