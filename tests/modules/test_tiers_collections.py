"""Storage tiers of the unsharded collections (``storage={table: Storage}``): EBC and EC train
exactly as on ``device`` with fused optimizers while their caches evict; state dicts hold the
whole tables under TorchRec's keys and round trip across tiers; bad inputs."""

import copy

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from fbtriton_dist.id_manager import IdManagerConfig
from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.modules.ec import EmbeddingCollection
from fbtriton_dist.storage import Storage
from tests.conftest import requires_cuda

BAGS = [
    EmbeddingBagConfig(name="t0", num_embeddings=60, embedding_dim=4, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", num_embeddings=40, embedding_dim=3, feature_names=["f2"],
                       pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", num_embeddings=10, embedding_dim=2, feature_names=["f3"]),
]
SEQS = [
    EmbeddingConfig(name="t0", num_embeddings=60, embedding_dim=4, feature_names=["f0", "f1"]),
    EmbeddingConfig(name="t1", num_embeddings=40, embedding_dim=3, feature_names=["f2"]),
]
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.2}),
    "adam": (torch.optim.Adam, {"lr": 0.2}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.2}),
}
STEPS = 4
B = 3


def storage_for(tier, tmp_path):
    path = {"path": str(tmp_path / "rows")} if tier == "file" else {}
    return {"t0": Storage(tier=tier, cache_slots=14, **path),
            "t1": {"tier": tier, "cache_load_factor": 0.3, "policy": "lfu", **path}}


def ebc(storage, opt="adam", backend="cpu", weighted=False, configs=BAGS, device="cpu"):
    torch.manual_seed(0)
    m = EmbeddingBagCollection(copy.deepcopy(configs), is_weighted=weighted, backend=backend,
                               storage=storage, device=device)
    if opt is not None:
        apply_optimizer_in_backward(OPTIMIZERS[opt][0], m.parameters(), OPTIMIZERS[opt][1])
    return m


def ec(storage, opt="adagrad", backend="cpu", device="cpu"):
    torch.manual_seed(0)
    m = EmbeddingCollection(copy.deepcopy(SEQS), backend=backend, storage=storage, device=device)
    apply_optimizer_in_backward(OPTIMIZERS[opt][0], m.parameters(), OPTIMIZERS[opt][1])
    return m


def kjt(configs, step, weighted=False, max_L=2):
    g = torch.Generator().manual_seed(100 + step)
    keys, lengths, values = [], [], []
    for cfg in configs:
        for f in cfg.feature_names:
            L = torch.randint(0, max_L + 1, (B,), generator=g)
            keys.append(f)
            lengths.append(L)
            values.append(torch.randint(0, cfg.num_embeddings, (int(L.sum()),), generator=g))
    values = torch.cat(values)
    w = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.cat(lengths), weights=w)


def loss(out, step):
    g = torch.Generator().manual_seed(step)
    if isinstance(out, dict):  # EmbeddingCollection
        return sum((jt.values() * torch.randn(jt.values().shape, generator=g)).sum()
                   for jt in out.values())
    v = out.values()
    return (v * torch.randn(v.shape, generator=g)).sum()


def train(models, configs, weighted=False, steps=STEPS):
    for step in range(steps):
        batch = kjt(configs, step, weighted)
        for m in models:
            loss(m(batch), step).backward()


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    fa, fb = a.fused_optimizer_state_dict(), b.fused_optimizer_state_dict()
    assert fa.keys() == fb.keys()
    for k in fa:
        assert torch.equal(fa[k], fb[k]), k


def evictions(m):
    return sum(s["evictions"] for tbe, _ in m.tbe_groups() for s in tbe.cache_stats().values())


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("tier", ["cached", "file"])
def test_ebc_tiers_train_as_device(opt, tier, tmp_path):
    device, tiered = ebc(None, opt), ebc(storage_for(tier, tmp_path), opt)
    assert_same(device, tiered)  # a seeded build draws the same rows into the backing store
    train([device, tiered], BAGS)
    assert_same(device, tiered)
    assert evictions(tiered) >= STEPS


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_ebc_weighted(backend, tmp_path):
    device = ebc(None, "adagrad", backend, weighted=True)
    tiered = ebc(storage_for("cached", tmp_path), "adagrad", backend, weighted=True)
    train([device, tiered], BAGS, weighted=True)
    assert_same(device, tiered)


def test_ebc_vbe(tmp_path):
    """A batch size per feature (the KJT's strides and inverse indices)."""
    strides = {"f0": 4, "f1": 2, "f2": 4, "f3": 2}
    device = ebc(None, "adam", weighted=True)
    tiered = ebc(storage_for("cached", tmp_path), "adam", weighted=True)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        lengths, values = [], []
        for cfg in BAGS:
            for f in cfg.feature_names:
                n = torch.randint(0, 3, (strides[f],), generator=g)
                lengths.append(n)
                values.append(torch.randint(0, cfg.num_embeddings, (int(n.sum()),), generator=g))
        values = torch.cat(values)
        inverse = torch.stack([torch.arange(4) // (4 // strides[f]) for f in strides])
        batch = KeyedJaggedTensor(
            keys=list(strides), values=values, lengths=torch.cat(lengths),
            weights=torch.rand(values.numel(), generator=g) + 0.5,
            stride_per_key_per_rank=[[n] for n in strides.values()],
            inverse_indices=(list(strides), inverse),
        )
        for m in (device, tiered):
            loss(m(batch), step).backward()
    assert_same(device, tiered)
    assert evictions(tiered) > 0


@pytest.mark.parametrize("tier", ["cached", "file"])
def test_ec_tiers_train_as_device(tier, tmp_path):
    device, tiered = ec(None), ec(storage_for(tier, tmp_path))
    train([device, tiered], SEQS)
    assert_same(device, tiered)
    assert evictions(tiered) >= STEPS


@pytest.mark.parametrize("make,configs", [(ebc, BAGS), (ec, SEQS)], ids=["ebc", "ec"])
def test_state_dict_round_trips_across_tiers(make, configs, tmp_path):
    device = make(None)
    cached = make(storage_for("cached", tmp_path))
    train([device, cached], configs)
    sd = cached.state_dict()
    assert sd["embeddings.t0.weight" if make is ec else "embedding_bags.t0.weight"].shape == (
        60, 4)  # the whole table, not its slots
    filed = make(storage_for("file", tmp_path / "f"))
    filed.load_state_dict(sd)
    back = make(None)
    back.load_state_dict(filed.state_dict())
    # the fused optimizer state, through fused_optimizer_state_dict, as a checkpoint loads it
    for m in (filed, back):
        state = m.fused_optimizer_state_dict()
        for k, v in cached.fused_optimizer_state_dict().items():
            if k != "step":
                state[k].copy_(v)
        m.load_fused_optimizer_state_dict({"step": cached.fused_optimizer_state_dict()["step"]})
    for m in (filed, back):
        assert_same(device, m)
    train([device, filed, back], configs)  # and they go on training alike
    assert_same(device, filed)
    assert_same(device, back)


def test_state_dict_of_another_shape(tmp_path):
    tiered = ebc(storage_for("cached", tmp_path))
    sd = tiered.state_dict()
    sd["embedding_bags.t0.weight"] = torch.zeros(61, 4)
    with pytest.raises(ValueError, match=r"table 't0' \(embedding_bags.t0.weight\): the "
                                         r"checkpoint's shape is \[61, 4\], this module's \[60, 4\]"):
        tiered.load_state_dict(sd)


def test_cached_parameter_holds_the_slots(tmp_path):
    tiered = ebc(storage_for("cached", tmp_path))
    assert tiered.embedding_bags["t0"].weight.shape == (14, 4)
    assert tiered.embedding_bags["t2"].weight.shape == (10, 2)  # on device: the whole table
    assert tiered.table_storage()["t1"].tier == "cached"
    assert tiered.table_storage()["t2"].tier == "device"


def test_to_moves_the_cache_not_the_backing_store(tmp_path):
    device, tiered = ebc(None), ebc(storage_for("cached", tmp_path))
    train([device, tiered], BAGS, steps=2)
    tbe = tiered.tbe_groups()[0][0]
    backing = tbe.split_embedding_weights()[0]
    tiered.to(torch.device("cpu"))
    assert tbe.split_embedding_weights()[0] is backing
    train([device, tiered], BAGS, steps=2)
    assert_same(device, tiered)


class _Head(torch.nn.Module):
    """A collection and a dense layer over its output: something for Dynamo to compile."""

    def __init__(self, collection, device="cpu") -> None:
        super().__init__()
        self.collection = collection
        torch.manual_seed(1)
        self.linear = torch.nn.Linear(4, 1, device=device)

    def forward(self, features):
        out = self.collection(features)
        if isinstance(out, dict):  # EmbeddingCollection
            return {k: self.linear(jt.values()[:, :4].relu()) for k, jt in out.items()
                    if jt.values().shape[1] == 4}
        return self.linear(out.values()[:, :4].relu())


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("make", [ebc, ec])
def test_torch_compile_looks_up_cached_tables_between_graphs(make, where, tmp_path):
    """``torch.compile`` of a model holding cached tables: their lookup runs eagerly (one graph
    break), the dense layers compile, and training equals the eager ``device`` model bit for
    bit; ``fullgraph=True``, ``torch.export`` and ``torch.fx`` refuse it, saying why. On a GPU:
    the Triton kernels and the slot map on the device."""
    configs = BAGS if make is ebc else SEQS
    backend = "triton" if where == "cuda" else "cpu"
    device, tiered = (_Head(make(s, backend=backend, device=where), where)
                      for s in (None, storage_for("cached", tmp_path)))
    tiered.collection.load_state_dict(device.collection.state_dict())  # CUDA: other draws
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(tiered, backend=backend)
    for step in range(STEPS):
        batch = kjt(configs, step).to(torch.device(where))
        for model in (device, compiled):
            out = model(batch)
            sum(o.sum() for o in out.values()).backward() if isinstance(out, dict) \
                else out.sum().backward()
    assert graphs  # the dense part compiled
    assert_same(device.collection, tiered.collection)
    torch.testing.assert_close(tiered.linear.weight.grad, device.linear.weight.grad,
                               rtol=1e-6, atol=1e-6)
    assert evictions(tiered.collection) >= STEPS
    torch._dynamo.reset()
    # (Dynamo stops at the graph break naming our reason; a torch that traced into the call
    # instead would meet our own refusal, which names fullgraph=True too)
    with pytest.raises(Exception, match="cached.*fullgraph=True"):
        torch.compile(tiered, backend="eager", fullgraph=True)(kjt(configs, 0).to(where))
    with pytest.raises(NotImplementedError, match=r"cached storage tiers \(cached, file\) "
                                                  "under torch.fx, torch.export"):
        torch.export.export(tiered, (kjt(configs, 0).to(where),), strict=False)
    with pytest.raises(NotImplementedError, match="slot map is Python state"):
        torch.fx.symbolic_trace(tiered)


@pytest.mark.parametrize("make", [ebc, ec])
def test_jit_script_is_refused_and_the_whole_tables_script(make, tmp_path):
    """A cached table's parameter holds its cache's slots: ``torch.jit.script`` refuses the
    collection, naming the tables (a script would read slots for rows); the recipe it gives
    (a collection without ``storage=`` loading the whole tables) scripts and looks up as the
    cached one does."""
    configs = BAGS if make is ebc else SEQS
    tiered = make(storage_for("cached", tmp_path))
    train([tiered], configs)
    with pytest.raises(NotImplementedError, match=r"torch.jit.script of a collection with "
                                                  r"cached tables \['t0', 't1'\]"):
        torch.jit.script(tiered)
    plain = make(None)
    plain.load_state_dict(tiered.state_dict())
    scripted = torch.jit.script(plain.eval())
    tiered.eval()
    batch = kjt(configs, 9)
    with torch.no_grad():
        a, b = scripted(batch), tiered(batch)
    if make is ebc:
        torch.testing.assert_close(a.values(), b.values(), rtol=1e-6, atol=1e-6)
    else:
        for k in b:
            assert torch.equal(a[k].values(), b[k].values()), k


def test_bad_storage_arguments():
    with pytest.raises(ValueError, match=r"storage: unknown tables \['nope', 'tx'\], expected "
                                         r"some of \['t0', 't1', 't2'\]"):
        ebc({"tx": "cached", "nope": None, "t0": "cached"})
    with pytest.raises(ValueError, match=r"table 't1' storage.policy: expected one of"):
        ebc({"t1": {"tier": "cached", "policy": "mru"}})
    with pytest.raises(ValueError, match=r"tables \['t0'\]: managed tables \(managed=\) on a "
                                         "storage tier other than 'device'"):
        EmbeddingBagCollection(copy.deepcopy(BAGS), storage={"t0": "cached"},
                               managed={"t0": IdManagerConfig(capacity=59)})
    with pytest.raises(ValueError, match=r"table 't0': storage tier 'cached' on the meta device"):
        EmbeddingBagCollection(copy.deepcopy(BAGS), device="meta", storage={"t0": "cached"})


def test_plain_optimizer_training_is_refused_eval_works(tmp_path):
    tiered = ebc(storage_for("cached", tmp_path), opt=None)
    device = ebc(None, opt=None)
    batch = kjt(BAGS, 0)
    with pytest.raises(ValueError, match="training needs a fused optimizer"):
        tiered(batch)
    with torch.no_grad():
        assert torch.equal(tiered(batch).values(), device(batch).values())


def test_without_storage_nothing_changes():
    plain, same = ebc(None), ebc({"t0": "device", "t1": None})
    assert all(not tbe.tiered for tbe, _ in plain.tbe_groups())
    assert all(not tbe.tiered for tbe, _ in same.tbe_groups())
    assert not plain._state_dict_hooks and not plain._load_state_dict_pre_hooks  # noqa: SLF001
    assert_same(plain, same)


def test_docs_snippet_runs(tmp_path, monkeypatch):
    """``docs/storage.md``'s snippet runs as written."""
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "storage.md"
    (block,) = re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, str(page), "exec"), {"__name__": "snippet"})
