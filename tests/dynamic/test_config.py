"""Managed tables' config: Python and YAML forms, and every bad input named by table and key."""

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from fbtriton_dist.id_manager import Admission, IdManagerConfig, IdManagerError, managed_configs
from fbtriton_dist.modules.ebc import EmbeddingBagCollection
from fbtriton_dist.ops.id_remap import IdTable, id_remap
from fbtriton_dist.planner import ConfigError
from fbtriton_dist.planner.tables import table_set_from_dict


def test_config_defaults_and_rows():
    cfg = IdManagerConfig(capacity=1000)
    assert (cfg.eviction, cfg.admission.min_count, cfg.num_embeddings, cfg.default_row) == (
        "lru", 1, 1001, 1000)
    assert cfg.sketch_width == 0  # no admission: no sketch
    assert IdManagerConfig(capacity=1000, admission={"min_count": 2}).sketch_width == 4096
    assert IdManagerConfig(capacity=3, admission=Admission(min_count=2)).sketch_width == 1024


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"capacity": 0}, r"capacity: expected an integer >= 1, got 0"),
        ({"capacity": -5}, r"capacity: expected an integer >= 1, got -5"),
        ({"capacity": 2.5}, r"capacity: expected an integer >= 1, got 2.5"),
        ({"capacity": 4, "eviction": "fifo"}, r"eviction: expected one of \[lru, lfu, ttl, none\]"),
        ({"capacity": 4, "eviction": "ttl"}, r"ttl_steps: missing"),
        ({"capacity": 4, "eviction": "ttl", "ttl_steps": -1}, r"ttl_steps: expected an integer >= 1, got -1"),
        ({"capacity": 4, "eviction": "ttl", "ttl_steps": 0}, r"ttl_steps: expected an integer >= 1, got 0"),
        ({"capacity": 4, "eviction": "lru", "ttl_steps": 3}, r"ttl_steps: only for eviction 'ttl'"),
        ({"capacity": 4, "admission": {"min_count": 0}}, r"admission.min_count: expected an integer >= 1, got 0"),
        ({"capacity": 4, "admission": {"min_count": -2}}, r"admission.min_count: expected an integer >= 1"),
        ({"capacity": 4, "admission": {"sketch_width": 100}}, r"admission.sketch_width: expected 0 or a power of two, got 100"),
        ({"capacity": 4, "admission": {"min_k": 2}}, r"admission.min_k: unknown key"),
        ({"capacity": 4, "admission": 3}, r"admission: expected an Admission or a mapping, got 3"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(IdManagerError, match=match):
        IdManagerConfig(**kwargs)


def test_module_errors_name_the_table():
    tables = [("t_user", 11), ("t_item", 5)]
    with pytest.raises(ValueError, match=r"table 't_user' id_manager.capacity: expected an integer >= 1, got 0"):
        managed_configs({"t_user": {"capacity": 0}}, tables)
    with pytest.raises(ValueError, match=r"table 't_user' id_manager.ttl_steps: missing"):
        managed_configs({"t_user": {"capacity": 10, "eviction": "ttl"}}, tables)
    with pytest.raises(ValueError, match=r"table 't_user' id_manager.capacity: missing required key"):
        managed_configs({"t_user": {"eviction": "lru"}}, tables)
    with pytest.raises(ValueError, match=r"table 't_item' num_embeddings: expected capacity \+ 1 = 11 \(10 slots and the default row\), got 5"):
        managed_configs({"t_item": IdManagerConfig(capacity=10)}, tables)
    with pytest.raises(ValueError, match=r"managed: unknown table 't_ad', expected one of \['t_item', 't_user'\]"):
        managed_configs({"t_ad": IdManagerConfig(capacity=10)}, tables)
    ebc_tables = [EmbeddingBagConfig(name="t_user", num_embeddings=10, embedding_dim=4,
                                     feature_names=["f"])]
    with pytest.raises(ValueError, match=r"table 't_user' num_embeddings: expected capacity \+ 1 = 11"):
        EmbeddingBagCollection(ebc_tables, managed={"t_user": IdManagerConfig(capacity=10)})


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bad_ids_and_a_full_table(backend):
    table = IdTable(IdManagerConfig(capacity=2, eviction="none"), "t_user")
    with pytest.raises(ValueError, match=r"table 't_user' ids: expected a 1-D int64 tensor, got torch.int32"):
        id_remap(table, torch.tensor([1, 2], dtype=torch.int32), step=0, backend=backend)
    with pytest.raises(ValueError, match=r"table 't_user' ids: expected a 1-D int64 tensor, got torch.float32"):
        id_remap(table, torch.tensor([1.0]), step=0, backend=backend)
    id_remap(table, torch.tensor([5, 6, 5]), step=0, backend=backend)  # fills it
    id_remap(table, torch.tensor([6, 5]), step=1, backend=backend)  # hits: fine
    with pytest.raises(ValueError, match=r"table 't_user' is full with eviction 'none': 1 new ids admitted this step, 0 of its capacity 2 slots free"):
        id_remap(table, torch.tensor([5, 7]), step=2, backend=backend)


def test_kjt_of_int32_ids_is_refused():
    tables = [EmbeddingBagConfig(name="t_user", num_embeddings=5, embedding_dim=4,
                                 feature_names=["f"])]
    ebc = EmbeddingBagCollection(tables, managed={"t_user": IdManagerConfig(capacity=4)})
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([1, 2], dtype=torch.int32), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"table 't_user' ids: expected int64 raw ids"):
        ebc(kjt)


def _tables(manager, rows=1001):
    return {"tables": [{"name": "t_user", "num_embeddings": rows, "embedding_dim": 8,
                        "features": ["user"], "id_manager": manager},
                       {"name": "t_ad", "num_embeddings": 50, "embedding_dim": 8,
                        "features": ["ad"]}]}


def test_yaml_form():
    ts = table_set_from_dict(_tables({"capacity": 1000, "eviction": "ttl", "ttl_steps": 500,
                                      "admission": {"min_count": 2}}))
    assert ts.id_managers == {"t_user": IdManagerConfig(
        capacity=1000, eviction="ttl", ttl_steps=500, admission=Admission(min_count=2))}
    assert table_set_from_dict(_tables(None)).id_managers == {}


@pytest.mark.parametrize(
    "manager, rows, match",
    [
        ({"capacity": 0}, 1, r"tables\[0\].id_manager.capacity: \(table 't_user'\) expected an integer >= 1, got 0"),
        ({"capacity": 1000, "eviction": "ttl"}, 1001, r"tables\[0\].id_manager.ttl_steps: \(table 't_user'\) missing"),
        ({"capacity": 1000, "eviction": "ttl", "ttl_steps": -3}, 1001, r"tables\[0\].id_manager.ttl_steps: \(table 't_user'\) expected an integer >= 1, got -3"),
        ({"capacity": 1000, "evict": "lru"}, 1001, r"tables\[0\].id_manager.evict: \(table 't_user'\) unknown key"),
        ({"capacity": 1000}, 1000, r"tables\[0\].num_embeddings: table 't_user' is managed: expected capacity \+ 1 = 1001"),
        ([1000], 1001, r"tables\[0\].id_manager: \(table 't_user'\) expected a mapping"),
    ],
)
def test_yaml_errors(manager, rows, match):
    with pytest.raises(ConfigError, match=match):
        table_set_from_dict(_tables(manager, rows), "tables.yaml")
