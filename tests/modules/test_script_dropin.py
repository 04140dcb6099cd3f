"""Our collections under TorchScript as TorchRec users script theirs, next to TorchRec's:
an FX-traced model then ``torch.jit.script`` (TorchRec's DLRM ``SparseArch`` and ``DLRM``,
traced by ``torchrec.fx``), the ``EmbeddingCollection`` scripted directly, the constructors'
and accessors' signatures against TorchRec's stable interface, and TorchRec's message for a
duplicated KJT key."""

import copy
import inspect
import io
from typing import Dict, List, Optional  # noqa: UP035 (TorchRec's interface spells them so)

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.fx import symbolic_trace as torchrec_trace
from torchrec.models.dlrm import DLRM, SparseArch
from torchrec.schema.utils import is_signature_compatible

import fbtriton_dist
from tests.modules.test_portable_graphs import _kjt, _pair


def _bag_tables(weighted: bool = False) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=6,
                           feature_names=["f2", "f3"]),
    ]


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("trace", ["fx", "torchrec_fx"])
def test_fx_trace_then_script_runs_like_torchrec(kind, trace):
    theirs, ours = _pair(kind)
    tracer = torch.fx.symbolic_trace if trace == "fx" else torchrec_trace
    scripted = [torch.jit.script(tracer(m)) for m in (theirs, ours)]
    for B, seed in ((3, 0), (5, 1)):
        kjt = _kjt(B, seed)
        want = theirs(kjt)
        for model in scripted:
            torch.testing.assert_close(model(kjt), want, atol=1e-6, rtol=1e-6)


def _dlrm_pair(arch: str):
    torch.manual_seed(0)
    build = (lambda ebc: SparseArch(ebc)) if arch == "sparse" else (
        lambda ebc: DLRM(embedding_bag_collection=ebc, dense_in_features=5,
                         dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[6, 1]))
    theirs = build(torchrec.EmbeddingBagCollection(tables=_bag_tables()))
    ours = build(fbtriton_dist.EmbeddingBagCollection(tables=_bag_tables(), backend="reference"))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


@pytest.mark.parametrize("arch", ["sparse", "dlrm"])
def test_torchrec_dlrm_traced_then_scripted(arch):
    """TorchRec's DLRM model tests' flow: ``torchrec.fx.symbolic_trace`` then script, run."""
    theirs, ours = _dlrm_pair(arch)
    kjt = _kjt(4, 2)
    dense = torch.rand(4, 5)
    args = (kjt,) if arch == "sparse" else (dense, kjt)
    want = theirs(*args)
    scripted = torch.jit.script(torchrec_trace(ours))
    torch.testing.assert_close(scripted(*args), want, atol=1e-5, rtol=1e-5)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.jit.load(buffer)(*args), want, atol=1e-5, rtol=1e-5)


def test_embedding_collection_scripts_like_torchrec():
    theirs, ours = _pair("ec")
    scripted = torch.jit.script(ours.ec)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    buffer.seek(0)
    for model in (scripted, torch.jit.load(buffer)):
        kjt = _kjt(3, 4)
        got, want = model(kjt), theirs.ec(kjt)
        assert list(got) == list(want)
        for k in want:
            torch.testing.assert_close(got[k].values(), want[k].values(), msg=k)
            torch.testing.assert_close(got[k].lengths(), want[k].lengths(), msg=k)


def test_embedding_collection_scripted_with_indices():
    tables = [EmbeddingConfig(name="t", embedding_dim=3, num_embeddings=6,
                              feature_names=["f1", "f2", "f3"])]
    ours = fbtriton_dist.EmbeddingCollection(tables=tables, need_indices=True)
    kjt = _kjt(2, 5)
    got, want = torch.jit.script(ours)(kjt), ours(kjt)
    for k in want:
        torch.testing.assert_close(got[k].weights(), want[k].weights(), msg=k)
        torch.testing.assert_close(got[k].values(), want[k].values(), msg=k)


# TorchRec's stable interface of the two modules (its ``torchrec/schema``), restated
class _BagsInterface:
    def __init__(self, tables: List[EmbeddingBagConfig], is_weighted: bool = False,  # noqa: UP006
                 device: Optional[torch.device] = None) -> None: ...
    def forward(self, features: KeyedJaggedTensor) -> torchrec.KeyedTensor: ...
    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]: ...  # noqa: UP006
    def is_weighted(self) -> bool: ...


class _SequencesInterface:
    def __init__(self, tables: List[EmbeddingConfig],  # noqa: UP006
                 device: Optional[torch.device] = None, need_indices: bool = False) -> None: ...
    def forward(self, features: KeyedJaggedTensor) -> Dict[str, torchrec.JaggedTensor]: ...  # noqa: UP006
    def embedding_configs(self) -> List[EmbeddingConfig]: ...  # noqa: UP006
    def need_indices(self) -> bool: ...
    def embedding_dim(self) -> int: ...
    def embedding_names_by_table(self) -> List[List[str]]: ...  # noqa: UP006


@pytest.mark.parametrize(("interface", "cls"), [
    (_BagsInterface, fbtriton_dist.EmbeddingBagCollection),
    (_SequencesInterface, fbtriton_dist.EmbeddingCollection),
])
def test_signatures_are_compatible_with_torchrec_stable_interface(interface, cls):
    for name, method in inspect.getmembers(interface, inspect.isfunction):
        assert is_signature_compatible(inspect.signature(method),
                                       inspect.signature(getattr(cls, name))), name


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("how", ["eager", "fx", "script", "fx_script"])
def test_a_duplicated_key_gives_torchrec_message(kind, how):
    from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

    _, ours = _pair(kind)
    module = ours.ebc if kind == "ebc" else ours.ec
    model = {"eager": lambda m: m, "fx": torch.fx.symbolic_trace, "script": torch.jit.script,
             "fx_script": lambda m: torch.jit.script(torch.fx.symbolic_trace(m))}[how](module)
    kjt = KeyedJaggedTensor(keys=["f1", "f2", "f1", "f3"], values=torch.tensor([1, 2, 3, 4]),
                            lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(ValueError, match="keys must be unique") as theirs:
        validate_keyed_jagged_tensor(copy.copy(kjt))
    with pytest.raises(Exception, match="keys must be unique") as ours_error:
        model(kjt)
    assert str(theirs.value) in str(ours_error.value)
