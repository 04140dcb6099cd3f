"""The ``host`` storage tier (modules/host_tier.py): host tables get their own TBE in the
collections on every device, and where the tier maps host memory (CUDA) a TBE of host tables
allocates its weights and states there. On the CPU the mapped path runs by replacing
``host_tier._maps_host_memory`` (capsules of DLPack's CPU device type)."""

import copy

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from fbtriton_dist import optim
from fbtriton_dist.modules import host_tier
from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.modules.ec import EmbeddingCollection
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.ops import cuda_managed
from fbtriton_dist.ops.host_mapped import is_host_mapped
from tests.conftest import TRITON_OK, requires_cuda
from tests.helpers import device_for, make_batch, upstream_grad

BAGS = [
    EmbeddingBagConfig(name="t0", num_embeddings=30, embedding_dim=4, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", num_embeddings=20, embedding_dim=3, feature_names=["f2"]),
    EmbeddingBagConfig(name="t2", num_embeddings=10, embedding_dim=2, feature_names=["f3"],
                       pooling=PoolingType.MEAN),
]
SEQS = [
    EmbeddingConfig(name="t0", num_embeddings=30, embedding_dim=4, feature_names=["f0", "f1"]),
    EmbeddingConfig(name="t1", num_embeddings=20, embedding_dim=4, feature_names=["f2"]),
]
HOST = {"t0": "host", "t2": "host"}


@pytest.fixture
def mapping(monkeypatch):
    """Host tables map host memory on the CPU too, as on CUDA."""
    monkeypatch.setattr(host_tier, "_maps_host_memory", lambda device: True)


def build(make, configs, storage, device="cpu"):
    torch.manual_seed(0)
    m = make(copy.deepcopy(configs), device=device, storage=storage)
    apply_optimizer_in_backward(torch.optim.Adam, m.parameters(), {"lr": 0.1})
    return m


def kjt(configs, step, device="cpu"):
    g = torch.Generator().manual_seed(step)
    keys = [f for c in configs for f in c.feature_names]
    rows = [c.num_embeddings for c in configs for _ in c.feature_names]
    lengths = torch.randint(0, 3, (len(keys) * 2,), generator=g)
    values = torch.cat([torch.randint(0, E, (int(n),), generator=g)
                        for E, n in zip(rows, lengths.view(len(keys), 2).sum(1), strict=True)])
    return KeyedJaggedTensor(keys=keys, values=values.to(device), lengths=lengths.to(device))


def train(models, configs, steps=3, device="cpu"):
    for step in range(steps):
        batch = kjt(configs, step, device)
        for m in models:
            out = m(batch)
            values = (torch.cat([jt.values() for jt in out.values()])
                      if isinstance(out, dict) else out.values())
            (values * torch.arange(values.numel(), device=device).view(values.shape)).sum().backward()


def assert_same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)  # TorchRec's keys, in the same order
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k
    fa, fb = a.fused_optimizer_state_dict(), b.fused_optimizer_state_dict()
    assert list(fa) == list(fb)
    for k in fa:
        assert torch.equal(fa[k].cpu(), fb[k].cpu()), k


@pytest.mark.parametrize("make,configs", [(EmbeddingBagCollection, BAGS),
                                          (EmbeddingCollection, SEQS)], ids=["ebc", "ec"])
def test_host_tables_get_their_own_tbe_and_train_as_device(make, configs):
    device = build(make, configs, None)
    host = build(make, configs, {"t0": "host"})
    groups = [[configs[t].name for t in members] for _, members in host.tbe_groups()]
    plain = [[configs[t].name for t in members] for _, members in device.tbe_groups()]
    assert ["t0"] in groups and ["t0"] not in plain
    for tbe, members in host.tbe_groups():
        assert host_tier.all_host(tbe.storage) == (members == [0])
    assert_same(device, host)
    train([device, host], configs)
    assert_same(device, host)


def test_mapped_collection_trains_as_device(mapping):
    device = build(EmbeddingBagCollection, BAGS, None)
    host = build(EmbeddingBagCollection, BAGS, HOST)
    train([device, host], BAGS)
    for tbe, _ in host.tbe_groups():
        mapped = [is_host_mapped(t) for t in (tbe.weights, tbe.momentum1, tbe.momentum2)]
        assert mapped == [host_tier.all_host(tbe.storage)] * 3 and tbe.momentum1.numel() > 0
    assert_same(device, host)
    params = [p for _, p in host.named_parameters()]
    host.to("cpu")  # the collection repacks each group: host groups into mapped memory again
    assert [p for _, p in host.named_parameters()] == params
    for tbe, _ in host.tbe_groups():
        assert is_host_mapped(tbe.weights) == host_tier.all_host(tbe.storage)
    assert is_host_mapped(host.embedding_bags["t0"].weight)
    assert not is_host_mapped(host.embedding_bags["t1"].weight)
    train([device, host], BAGS)
    assert_same(device, host)


def test_tbe_constructor_and_apply_allocate_mapped(mapping):
    tbe = TableBatchedEmbedding([(8, 4), (5, 2)], optimizer=optim.Adam(lr=0.1),
                                storage=["host", "host"], backend="cpu")
    weights = tbe.weights
    for t in (tbe.weights, tbe.momentum1, tbe.momentum2):
        assert is_host_mapped(t) and t.numel() > 0
    with torch.no_grad():
        tbe.weights.data = tbe.weights.detach().clone()  # as if moved: device memory
        tbe.momentum1 = torch.ones_like(tbe.momentum1)
    assert not is_host_mapped(tbe.weights) and not is_host_mapped(tbe.momentum1)
    values = tbe.weights.detach().clone()
    tbe.to("cpu")  # _apply: back into mapped memory, the same Parameter, the same values
    assert tbe.weights is weights and torch.equal(tbe.weights, values)
    assert is_host_mapped(tbe.weights) and is_host_mapped(tbe.momentum1)
    assert torch.equal(tbe.momentum1, torch.ones_like(tbe.momentum1))
    with pytest.raises(ValueError, match=r"weights: tables \['a'\] are on storage tier 'host', "
                                         r"expected weights in host memory mapped to cpu"):
        TableBatchedEmbedding([(8, 4)], storage=["host"], table_names=["a"],
                              weights=torch.zeros(32))


def test_triton_kernels_train_mapped_rows_as_device(mapping):
    """The Triton kernels (on the GPU, else interpreted) on rows in mapped host memory."""
    if not TRITON_OK:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    dev, tables, ftm = device_for("triton"), [(16, 4), (6, 3)], [0, 0, 1]
    device, host = (TableBatchedEmbedding(tables, feature_table_map=ftm, backend="triton",
                                          optimizer=optim.Adam(lr=0.1), storage=storage,
                                          device=dev) for storage in (None, ["host", "host"]))
    host.load_state_dict(device.state_dict())
    assert all(is_host_mapped(t) for t in (host.weights, host.momentum1, host.momentum2))
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        batch = make_batch(tables, ftm, 3, 2, weighted=True, hot=True, generator=g, device=dev)
        for m in (device, host):
            out = m(*batch)
            (out * upstream_grad(out, step)).sum().backward()
    a, b = device.state_dict(), host.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k], k
    assert torch.equal(device.momentum2, host.momentum2) and host.step == 3
    assert is_host_mapped(host.weights) and is_host_mapped(host.momentum1)


def test_mixed_tbe_refused_where_host_is_mapped(monkeypatch):
    tables, names, storage = [(8, 4), (5, 2), (3, 2)], ["a", "b", "c"], ["host", "device", "host"]
    TableBatchedEmbedding(tables, table_names=names, storage=storage)  # the CPU: host == device
    monkeypatch.setattr(host_tier, "_maps_host_memory", lambda device: True)
    with pytest.raises(ValueError, match=r"tables \['a', 'c'\] \(storage tier 'host'\) and "
                                         r"\['b'\] \(other tiers\) share one TableBatched"
                                         r"Embedding on cpu.*put the 'host' tables in a separate"):
        TableBatchedEmbedding(tables, table_names=names, storage=storage)


def test_maps_host_memory_rule():
    assert host_tier.maps_host_memory("cuda:0") and host_tier.maps_host_memory("cuda")
    assert not host_tier.maps_host_memory("cpu") and not host_tier.maps_host_memory("meta")


@requires_cuda
def test_host_tier_on_cuda_is_zero_copy_and_trains_as_device():
    from fbtriton_dist.ops.host_mapped import host_of

    big = [EmbeddingBagConfig(name="big", num_embeddings=1 << 18, embedding_dim=16,
                              feature_names=["f"])]
    before = torch.cuda.memory_allocated()
    kept = EmbeddingBagCollection(big, device="cuda", storage={"big": "host"})
    assert torch.cuda.memory_allocated() - before < (1 << 18) * 16 * 4 // 8  # rows not on HBM
    assert kept.embedding_bags["big"].weight.is_cuda
    device = build(EmbeddingBagCollection, BAGS, None, "cuda")
    host = build(EmbeddingBagCollection, BAGS, HOST, "cuda")
    train([device, host], BAGS, device="cuda")
    torch.cuda.synchronize()
    for tbe, _ in host.tbe_groups():
        if not host_tier.all_host(tbe.storage):
            assert not is_host_mapped(tbe.weights)
            continue
        for t in (tbe.weights, tbe.momentum1, tbe.momentum2):
            pinned = host_of(t)  # the host tensor the CUDA tensor is (managed or pinned)
            assert t.is_cuda and pinned is not None
            assert pinned.is_pinned() or cuda_managed.is_managed(pinned)
            assert pinned.data_ptr() == t.data_ptr()
            assert torch.equal(pinned, t.cpu())  # the kernels' updates landed in host memory
    assert_same(device, host)
    params = [p for _, p in host.named_parameters()]
    host.cpu()  # ordinary CPU tensors
    assert not any(is_host_mapped(p) for p in params)
    host.cuda()  # mapped again, the same Parameters
    assert [p for _, p in host.named_parameters()] == params
    assert is_host_mapped(params[0]) and params[0].is_cuda
    device.cpu()
    device.cuda()
    train([device, host], BAGS, device="cuda")
    assert_same(device, host)
