"""Managed tables in our EmbeddingBagCollection / EmbeddingCollection: raw ids remapped before
the lookup, fresh rows and fused optimizer state re-initialised, the maps in the state dict,
eval without updates, TorchRec's ManagedCollision* construction, per-table metrics."""

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from fbtriton_dist.id_manager import Admission, IdManagerConfig
from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.modules.ec import EmbeddingCollection
from fbtriton_dist.modules.managed import (
    ManagedCollisionCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from tests.conftest import TRITON_OK

BACKENDS = ["cpu", "reference", *(["triton"] if TRITON_OK else [])]


def bag_tables():
    return [
        EmbeddingBagConfig(name="t_user", num_embeddings=5, embedding_dim=4,
                           feature_names=["user", "friend"]),
        EmbeddingBagConfig(name="t_ad", num_embeddings=7, embedding_dim=3, feature_names=["ad"]),
    ]


MANAGED = {"t_user": IdManagerConfig(capacity=4, eviction="lru")}


def kjt(user, friend, ad):
    """One id per bag, B = len(user)."""
    values = torch.tensor([*user, *friend, *ad], dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "friend", "ad"], values=values, lengths=torch.ones(len(values), dtype=torch.int64))


def stream(steps=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        raw = (torch.randint(0, 9, (6,), generator=g) * 1_000_003 + 2**45).tolist()
        yield kjt(raw[:3], raw[3:], torch.randint(0, 7, (3,), generator=g).tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_ebc_looks_up_the_remapped_ids(backend):
    torch.manual_seed(1)
    ebc = EmbeddingBagCollection(bag_tables(), managed=MANAGED, backend=backend)
    torch.manual_seed(1)
    mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(bag_tables(), backend=backend),
        ManagedCollisionCollection(MANAGED, bag_tables()), return_remapped_features=True)
    plain = EmbeddingBagCollection(bag_tables(), backend=backend)
    for features in stream():
        out = ebc(features)
        out_mc, remapped = mc(features)
        assert out.keys() == ["user", "friend", "ad"]
        torch.testing.assert_close(out.values(), out_mc.values(), rtol=0, atol=0)
        v = remapped.values()
        n = remapped.length_per_key()
        assert ((v[: n[0] + n[1]] >= 0) & (v[: n[0] + n[1]] <= 4)).all()
        assert torch.equal(v[n[0] + n[1]:], features.values()[n[0] + n[1]:])  # unmanaged
        plain.load_state_dict(mc._embedding_bag_collection.state_dict())
        torch.testing.assert_close(plain(remapped).values(), out.values(), rtol=0, atol=0)
    assert ebc.id_managers.metrics()["t_user"]["total_evicted"] > 0


def test_ec_remaps_and_drop_in():
    tables = [EmbeddingConfig(name="t_user", num_embeddings=4, embedding_dim=4,
                              feature_names=["user"])]
    managed = {"t_user": {"capacity": 3, "eviction": "lfu"}}
    torch.manual_seed(2)
    ec = EmbeddingCollection(tables, managed=managed)
    torch.manual_seed(2)
    mc = ManagedCollisionEmbeddingCollection(EmbeddingCollection(tables),
                                             ManagedCollisionCollection(managed, tables))
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["user"], values=torch.tensor([2**60, -7, 2**60, 11, 12]), lengths=torch.tensor([3, 2]))
    out = ec(features)["user"]
    out_mc, remapped = mc(features)
    assert remapped is None
    torch.testing.assert_close(out.values(), out_mc["user"].values(), rtol=0, atol=0)
    weight = ec.embeddings["t_user"].weight
    # 2**60, -7, 11 take slots 0, 1, 2; 12 overflows to the default row 3
    torch.testing.assert_close(out.values(), weight[[0, 1, 0, 2, 3]].detach())
    assert ec.id_managers.metrics()["t_user"]["overflow"] == 1


def fused_ebc(seed=0, backend="cpu"):
    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=3, embedding_dim=4,
                                 feature_names=["user"])]
    ebc = EmbeddingBagCollection(tables, managed={"t_user": IdManagerConfig(capacity=2)},
                                 backend=backend)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.5})
    return ebc


def user_kjt(ids):
    return KeyedJaggedTensor.from_lengths_sync(keys=["user"], values=torch.tensor(ids),
                                               lengths=torch.ones(len(ids), dtype=torch.int64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_evicted_rows_and_optimizer_state_are_reset(backend):
    ebc = fused_ebc(backend=backend)
    weight = ebc.embedding_bags["t_user"].weight
    ebc(user_kjt([100, 200])).values().sum().backward()  # slots 0, 1 trained
    (state,) = ebc._tbes[0].split_optimizer_states()[0]
    assert (state[:2] > 0).all()
    trained = weight[:2].detach().clone()
    ebc(user_kjt([200])).values().sum().backward()  # 200 is more recent than 100
    out = ebc(user_kjt([300]))  # evicts slot 0 (id 100): reset before the lookup reads it
    assert state[0] == 0 and state[1] > 0
    fresh = weight[0].detach().clone()
    assert not torch.equal(fresh, trained[0])
    assert (fresh.abs() <= 1 / 3**0.5).all()  # the table's init: uniform in +-1/sqrt(E)
    torch.testing.assert_close(out.values()[0], fresh)
    # the draw is a function of the manager's seed and step: another module built alike
    # draws the same row
    other = fused_ebc(backend=backend)
    other(user_kjt([100, 200])).values().sum().backward()
    other(user_kjt([200])).values().sum().backward()
    other(user_kjt([300]))
    torch.testing.assert_close(other.embedding_bags["t_user"].weight[0], weight[0])
    assert ebc.id_managers.metrics()["t_user"]["evicted"] == 1


def test_state_dict_round_trip_continues_the_same_remap():
    torch.manual_seed(0)
    managed = {"t_user": IdManagerConfig(capacity=4, eviction="lfu",
                                         admission=Admission(min_count=2))}
    a = EmbeddingBagCollection(bag_tables(), managed=managed)
    batches = list(stream(steps=12, seed=5))
    for features in batches[:6]:
        a(features)
    state = a.state_dict()
    for name in ("keys", "counts", "last_seen", "sketch", "step", "seed", "totals"):
        assert f"id_managers._managed_collision_modules.t_user.{name}" in state
    torch.manual_seed(99)  # other weights, another seed: all replaced by the load
    b = EmbeddingBagCollection(bag_tables(), managed=managed)
    b.load_state_dict({k: v.clone() for k, v in state.items()})
    for features in batches[6:]:
        torch.testing.assert_close(a(features).values(), b(features).values(), rtol=0, atol=0)
    ma, mb = (m.id_managers._managed_collision_modules["t_user"] for m in (a, b))
    assert torch.equal(ma.keys[ma.last_seen >= 0], mb.keys[mb.last_seen >= 0])
    assert ma.metrics() == mb.metrics()


def test_eval_does_not_update_and_misses_read_the_default_row():
    ebc = EmbeddingBagCollection(bag_tables(), managed=MANAGED)
    ebc(kjt([1, 2, 3], [4, 5, 6], [0, 1, 2]))  # 1, 2, 3, 4 get slots; 5, 6 overflow
    manager = ebc.id_managers._managed_collision_modules["t_user"]
    before = {k: v.clone() for k, v in manager.state_dict().items()}
    ebc.eval()
    _, remapped = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(bag_tables()), ebc.id_managers, True).eval()(
        kjt([1, 9, 3], [4, 5, 2], [0, 1, 2]))
    assert remapped.values()[:6].tolist() == [0, 4, 2, 3, 4, 1]
    ebc(kjt([1, 9, 3], [4, 5, 2], [0, 1, 2]))
    after = manager.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_metrics_per_table():
    ebc = EmbeddingBagCollection(bag_tables(), managed=MANAGED)
    ebc(kjt([1, 2, 1], [3, 1, 2], [0, 1, 2]))
    m = ebc.id_managers.metrics()["t_user"]
    assert (m["lookups"], m["hits"], m["admitted"], m["occupancy"], m["step"]) == (6, 0, 3, 0.75, 1)
    ebc(kjt([1, 2, 7], [8, 1, 2], [0, 1, 2]))
    m = ebc.id_managers.metrics()["t_user"]
    # 1, 2 hit (4 ids); 7 takes the last slot, 8 evicts 3 (the only slot not used this step)
    assert (m["hits"], m["hit_rate"], m["admitted"], m["evicted"], m["occupancy"]) == (
        4, 4 / 6, 2, 1, 1.0)
    assert (m["total_lookups"], m["total_admitted"], m["step"]) == (12, 5, 2)


def test_drop_in_refuses_mismatched_tables():
    with pytest.raises(ValueError, match=r"managed_collision_collection: unknown table 't_user', expected one of \['t_ad'\]"):
        ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(bag_tables()[1:]),
            ManagedCollisionCollection(MANAGED, bag_tables()))
    with pytest.raises(ValueError, match=r"built without managed"):
        ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(bag_tables(), managed=MANAGED),
            ManagedCollisionCollection(MANAGED, bag_tables()))


def test_variable_batch_per_feature():
    tables = [EmbeddingBagConfig(name="t0", num_embeddings=5, embedding_dim=4, feature_names=["f0"]),
              EmbeddingBagConfig(name="t1", num_embeddings=10, embedding_dim=3, feature_names=["f1"])]
    ebc = EmbeddingBagCollection(tables, managed={"t0": IdManagerConfig(capacity=4)})
    # f0: one bag (two raw ids) that both samples read; f1: a bag per sample
    features = KeyedJaggedTensor(
        keys=["f0", "f1"], values=torch.tensor([10**15, 77, 3, 4]), lengths=torch.tensor([2, 1, 1]),
        stride_per_key_per_rank=[[1], [2]], inverse_indices=(["f0", "f1"], torch.tensor([[0, 0], [0, 1]])))
    out = ebc(features).values()
    w0, w1 = ebc.embedding_bags["t0"].weight, ebc.embedding_bags["t1"].weight
    torch.testing.assert_close(out[:, :4], (w0[0] + w0[1]).expand(2, 4).detach())
    torch.testing.assert_close(out[:, 4:], w1[[3, 4]].detach())


def test_built_on_meta_then_materialised():
    ebc = EmbeddingBagCollection(bag_tables(), managed=MANAGED, device="meta")
    ebc.to_empty(device="cpu")
    ebc.reset_parameters()  # garbage maps emptied, as the weights are drawn
    manager = ebc.id_managers._managed_collision_modules["t_user"]
    assert (manager.last_seen == -1).all() and int(manager.step) == 0
    ebc(kjt([1, 2, 3], [4, 5, 6], [0, 1, 2]))
    assert ebc.id_managers.metrics()["t_user"]["admitted"] == 4


def test_torchrec_mch_modules_are_read():
    from torchrec.modules.mc_modules import (
        LFU_EvictionPolicy,
        LRU_EvictionPolicy,
        MCHManagedCollisionModule,
    )

    def mch(policy):
        return MCHManagedCollisionModule(zch_size=5, device=torch.device("cpu"),
                                         eviction_policy=policy, eviction_interval=1)

    mcc = ManagedCollisionCollection({"t_user": mch(LFU_EvictionPolicy())}, bag_tables())
    assert mcc.managers()["t_user"].config == IdManagerConfig(capacity=4, eviction="lfu")
    mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(bag_tables()),
        ManagedCollisionCollection({"t_user": mch(LRU_EvictionPolicy())}, bag_tables()),
        return_remapped_features=True)
    _, remapped = mc(kjt([2**62, 5, 2**62], [7, 8, 9], [0, 1, 2]))
    assert remapped.values()[:6].tolist() == [0, 1, 0, 2, 3, 4]  # 9: the default row
    with pytest.raises(ValueError, match=r"table 't_user' num_embeddings: expected capacity \+ 1 = 9"):
        ManagedCollisionCollection(
            {"t_user": MCHManagedCollisionModule(zch_size=9, device=torch.device("cpu"),
                                                 eviction_policy=LRU_EvictionPolicy(),
                                                 eviction_interval=1)}, bag_tables())


def test_shard_refuses_torchrec_style_managed_wrappers():
    from fbtriton_dist.planner import ShardingPlan
    from fbtriton_dist.sharding import shard

    wrapper = torch.nn.Sequential(ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(bag_tables()), ManagedCollisionCollection(MANAGED, bag_tables())))
    with pytest.raises(NotImplementedError, match=r"0: sharding TorchRec-style ManagedCollision"):
        shard(wrapper, ShardingPlan.__new__(ShardingPlan))


@pytest.mark.parametrize("opt, kwargs", [(torch.optim.Adam, {"lr": 0.1}),
                                         (torch.optim.Adagrad, {"lr": 0.1})],
                         ids=["adam", "adagrad"])
def test_per_element_optimizer_state_is_reset(opt, kwargs):
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=3, embedding_dim=4,
                                 feature_names=["user"])]
    ebc = EmbeddingBagCollection(tables, managed={"t_user": IdManagerConfig(capacity=2)})
    apply_optimizer_in_backward(opt, ebc.parameters(), kwargs)
    ebc(user_kjt([100, 200])).values().sum().backward()
    ebc(user_kjt([200])).values().sum().backward()
    states = ebc._tbes[0].split_optimizer_states()[0]
    assert states and all((s[0] != 0).any() for s in states)
    ebc(user_kjt([300]))  # evicts 100's slot 0
    assert all((s[0] == 0).all() and (s[1] != 0).any() for s in states)


def test_ttl_expiry_resets_the_reused_row():
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=2, embedding_dim=4,
                                 feature_names=["user"])]
    ebc = EmbeddingBagCollection(
        tables, managed={"t_user": IdManagerConfig(capacity=1, eviction="ttl", ttl_steps=2)})
    weight = ebc.embedding_bags["t_user"].weight
    ebc(user_kjt([7]))
    with torch.no_grad():
        weight[0] = 5.0  # stands for training
    for _ in (1, 2):  # 7 (seen at 0) was seen in the last 2 steps: 8 reads the default row
        ebc(user_kjt([8]))
        assert (weight[0] == 5.0).all() and ebc.id_managers.metrics()["t_user"]["overflow"] == 1
        assert ebc.id_managers.metrics()["t_user"]["expired"] == 0
    ebc(user_kjt([8]))  # 7 expires at step 3: 8 takes slot 0, re-initialised
    assert (weight[0].abs() <= 1 / 2**0.5).all()
    assert ebc.id_managers.metrics()["t_user"]["expired"] == 1


def test_deepcopy_remaps_alike():
    import copy

    ebc = EmbeddingBagCollection(bag_tables(), managed=MANAGED)
    batches = list(stream(steps=6, seed=3))
    for features in batches[:3]:
        ebc(features)
    twin = copy.deepcopy(ebc)
    for features in batches[3:]:
        torch.testing.assert_close(ebc(features).values(), twin(features).values(), rtol=0, atol=0)
    assert ebc.id_managers.metrics() == twin.id_managers.metrics()


def test_torch_compile_remaps_between_graphs():
    """``torch.compile`` of a collection with managed tables: the remap and lookup run eagerly
    (one graph break) and train as the eager module, bit for bit, evicting; ``fullgraph=True``
    and ``torch.fx`` refuse it, saying why."""
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=5, embedding_dim=4,
                                 feature_names=["user", "friend"]),
              EmbeddingBagConfig(name="t_ad", num_embeddings=7, embedding_dim=3,
                                 feature_names=["ad"])]

    def build():
        torch.manual_seed(4)
        ebc = EmbeddingBagCollection(tables, managed=MANAGED)
        apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.5})
        return ebc

    eager, compiled_ebc = build(), build()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda f: (compiled_ebc(f).values() * 2).sum(), backend=backend)
    for features in stream(steps=6, seed=5):
        (eager(features).values() * 2).sum().backward()
        compiled(features).backward()
    assert graphs
    for (k, a), (_, b) in zip(eager.state_dict().items(), compiled_ebc.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), k
    assert compiled_ebc.id_managers.metrics() == eager.id_managers.metrics()
    assert eager.id_managers.metrics()["t_user"]["total_evicted"] > 0
    torch._dynamo.reset()
    with pytest.raises(Exception, match="managed tables.*fullgraph=True"):
        torch.compile(compiled_ebc, backend="eager", fullgraph=True)(next(stream(1)))
    with pytest.raises(NotImplementedError, match="id maps are Python state"):
        torch.fx.symbolic_trace(compiled_ebc)
