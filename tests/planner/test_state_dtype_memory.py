"""A table's optimizer-state dtype in the memory model (``TableSpec.state_dtype``): bf16 / fp16
states count half the bytes of fp32 ones, in the plan's budget check too; the table-set key
and the job's ``optimizer.embedding.state_dtype`` parse, bad values name the key."""

import dataclasses

import pytest

from fbtriton_dist.planner import ConfigError, ShardingPlanner, TableSpec
from fbtriton_dist.planner.memory import block_bytes, shard_equation, state_bytes
from fbtriton_dist.planner.tables import table_set_from_dict
from fbtriton_dist.train.config import job_from_dict

SPEC = TableSpec(name="t", num_embeddings=1000, embedding_dim=16, features=("f",))


@pytest.mark.parametrize(("optimizer", "per_value"), [("adam", 2 * 16), ("rowwise_adagrad", 1)])
def test_low_precision_states_halve_the_state_bytes(optimizer, per_value):
    fp32 = state_bytes(optimizer, 1000, 16)
    assert fp32 == 4 * 1000 * per_value
    for dtype in ("bf16", "fp16"):
        assert state_bytes(optimizer, 1000, 16, dtype) == fp32 // 2
        low = dataclasses.replace(SPEC, state_dtype=dtype)
        assert (block_bytes(low, 1000, 16, optimizer)
                == block_bytes(SPEC, 1000, 16, optimizer) - fp32 // 2)
    assert block_bytes(SPEC, 1000, 16, optimizer) == 1000 * 16 * 4 + fp32


def test_the_budget_check_counts_the_state_dtype():
    low = dataclasses.replace(SPEC, state_dtype="bf16")
    plan = ShardingPlanner(world_size=1, optimizer="adam").plan([low])
    # weights 64000 B + Adam's two [E, D] moments: 128000 B in fp32, 64000 B in bf16
    plan.validate([low], budget_bytes=128_000, optimizer="adam")
    with pytest.raises(ValueError, match=r"rank 0 needs 187.5 KiB, budget 125.0 KiB"):
        plan.validate([SPEC], budget_bytes=128_000, optimizer="adam")
    sh = plan.tables[0].shards[0]
    assert "(adam, bf16)" in shard_equation(low, sh, "adam")


def test_table_set_key():
    entry = {"name": "a", "num_embeddings": 10, "embedding_dim": 4, "features": ["f"]}
    ts = table_set_from_dict({"tables": [{**entry, "state_dtype": "bf16"}]})
    assert ts.tables[0].state_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"tables\[0\]\.state_dtype: expected one of "
                                          r"\[fp32, fp16, bf16\], got 'int8'"):
        table_set_from_dict({"tables": [{**entry, "state_dtype": "int8"}]}, "t.yaml")


def _job(state_dtype=None, table_state_dtype=None):
    table = {"name": "t0", "num_embeddings": 100, "embedding_dim": 8, "features": ["f0"]}
    if table_state_dtype is not None:
        table["state_dtype"] = table_state_dtype
    embedding = {"type": "adam"}
    if state_dtype is not None:
        embedding["state_dtype"] = state_dtype
    return {"tables": [table], "model": {"dense_arch": [8], "over_arch": [4, 1]},
            "train": {"steps": 10}, "optimizer": {"embedding": embedding}}


def test_job_key():
    from fbtriton_dist.train.job import _state_dtypes

    cfg = job_from_dict(_job("bf16"))
    assert cfg.optimizer.embedding.state_dtype == "bf16"
    assert [t.state_dtype for t in cfg.tables.tables] == ["bf16"]  # the planner counts it
    assert _state_dtypes(cfg) == {"momentum1": "bf16", "momentum2": "bf16"}
    assert job_from_dict(_job()).tables.tables[0].state_dtype == "fp32"
    with pytest.raises(ConfigError, match=r"jobs/x.yaml: optimizer.embedding.state_dtype: "
                                          r"expected one of \[fp32, fp16, bf16\], got 'int8'"):
        job_from_dict(_job("int8"), "jobs/x.yaml")
    with pytest.raises(ConfigError, match=r"optimizer.embedding.state_dtype: expected the "
                                          r"tables' state_dtype \{'t0': 'fp16'\}"):
        job_from_dict(_job("bf16", table_state_dtype="fp16"), "jobs/x.yaml")
