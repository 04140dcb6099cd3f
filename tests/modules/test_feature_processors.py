"""TorchRec's feature processors around our EmbeddingBagCollection (unsharded):
``FeatureProcessedEmbeddingBagCollection`` with one ``PositionWeightedModule`` per feature or a
``PositionWeightedModuleCollection``, eager and FX-traced, against the same module around
TorchRec's EBC with the same weights: outputs and every gradient (tables and position
weights), for a KJT with and without per-id weights of its own."""

import copy

import pytest
import torch
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.fx import symbolic_trace as torchrec_trace
from torchrec.modules.feature_processor_ import (
    PositionWeightedModule,
    PositionWeightedModuleCollection,
)
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

import fbtriton_dist

FEATURES = ["f1", "f2", "f3"]
MAX_LENGTH = 4


def _tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1"]),
        EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=6,
                           feature_names=["f2", "f3"]),
    ]  # SUM: TorchRec's EBC refuses weighted MEAN


def _fp_ebc(ebc, processors: str):
    if processors == "collection":
        fps = PositionWeightedModuleCollection({f: MAX_LENGTH for f in FEATURES})
    else:
        fps = {f: PositionWeightedModule(max_feature_length=MAX_LENGTH) for f in FEATURES}
    return FeatureProcessedEmbeddingBagCollection(ebc, fps)


def _pair(processors: str):
    torch.manual_seed(0)
    theirs = _fp_ebc(torchrec.EmbeddingBagCollection(tables=_tables(), is_weighted=True),
                     processors)
    with torch.no_grad():  # position weights other than the initial ones
        for name, p in theirs.named_parameters():
            if "position_weight" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    ours = _fp_ebc(fbtriton_dist.EmbeddingBagCollection(tables=_tables(), is_weighted=True,
                                                        backend="reference"), processors)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def _kjt(B: int, seed: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, MAX_LENGTH + 1, (len(FEATURES) * B,), generator=g)
    lengths[1] = 0
    N = int(lengths.sum())
    return KeyedJaggedTensor(keys=FEATURES, values=torch.randint(0, 6, (N,), generator=g),
                             lengths=lengths,
                             weights=torch.rand(N, generator=g) if weighted else None)


HOWS = {
    "eager": lambda m: m,
    "torchrec_fx": torchrec_trace,
    "torchrec_fx_script": lambda m: torch.jit.script(torchrec_trace(m)),
}


@pytest.mark.parametrize("how", list(HOWS))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("processors", ["dict", "collection"])
def test_feature_processed_ebc_matches_torchrec(processors, weighted, how):
    theirs, ours = _pair(processors)
    model = HOWS[how](ours)
    for step, B in enumerate((3, 5)):
        kjt = _kjt(B, step, weighted)
        want, got = theirs(kjt), model(kjt)
        assert got.keys() == want.keys()
        torch.testing.assert_close(got.values(), want.values(), atol=1e-5, rtol=1e-5)
        scale = torch.rand(want.values().shape, generator=torch.Generator().manual_seed(step))
        (want.values() * scale).sum().backward()
        (got.values() * scale).sum().backward()
        grads = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-5,
                                       msg=name)
        for m in (theirs, ours):
            m.zero_grad()


def test_split_gives_our_ebc_back():
    """TorchRec's sharder of a feature-processed EBC splits it; the EBC half is ours."""
    _, ours = _pair("dict")
    _, ebc = ours.split()
    assert isinstance(ebc, fbtriton_dist.EmbeddingBagCollection)
    assert copy.deepcopy(ours)(_kjt(2, 0, False)).values().shape == (2, 4 + 3 + 3)
