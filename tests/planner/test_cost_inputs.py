"""The cost model's bandwidths from the user (``planner/cost_inputs.py``): ``plan --cost
FILE.yaml``, the step estimate following them both ways, and bad input refused."""

import pytest

from fbtriton_dist.cli import main
from fbtriton_dist.planner import ConfigError, CostModel, FieldError, ShardingPlanner, TableSpec
from fbtriton_dist.planner.cost_inputs import (
    COST_KEYS,
    cost_values,
    read_cost_file,
    with_cost,
)
from fbtriton_dist.storage import Storage

TABLES = ("tables:\n"
          "  - {name: c, num_embeddings: 20000, embedding_dim: 16, features: [c],\n"
          "     storage: {tier: cached, cache_load_factor: 0.1}}\n"
          "  - {name: f, num_embeddings: 20000, embedding_dim: 16, features: [f],\n"
          "     storage: {tier: file, cache_load_factor: 0.1, path: /rows}}\n")


def _step(**bandwidths) -> float:
    """The estimated step of a cached and a file table on one rank."""
    specs = [TableSpec(name=n, num_embeddings=20_000, embedding_dim=16, features=(n,),
                       storage=Storage(tier=tier, cache_load_factor=0.1, path=path))
             for n, tier, path in (("c", "cached", None), ("f", "file", "/rows"))]
    planner = ShardingPlanner(world_size=1, hbm_bytes_per_rank=10**9,
                              cost_model=with_cost(CostModel(batch_size=256), bandwidths))
    return planner.cost(planner.plan(specs), specs).max()


@pytest.mark.parametrize("key", ["host_tier_bandwidth", "disk_bandwidth"])
def test_step_estimate_follows_the_tier_bandwidths(key):
    default = getattr(CostModel(), key)
    base = _step()
    assert _step(**{key: default / 10}) > base  # a slower link: a longer step
    assert _step(**{key: default * 10}) < base  # a faster one: shorter
    assert _step(**{key: default}) == base


def test_plan_cost_file_sets_the_model_and_the_plan_header(tmp_path, capsys):
    tables = tmp_path / "tables.yaml"
    tables.write_text(TABLES)
    cost = tmp_path / "cost.yaml"
    cost.write_text("# measured\ncost:\n  disk_bandwidth: 2.5e+08\n  host_tier_bandwidth: 8e9\n")
    assert read_cost_file(str(cost)) == {"disk_bandwidth": 2.5e8, "host_tier_bandwidth": 8e9}
    outs = {}
    for name, extra in (("default", []), ("given", ["--cost", str(cost)])):
        out = tmp_path / f"{name}.yaml"
        assert main(["plan", str(tables), "--world-size", "1", "--out", str(out), *extra]) == 0
        printed = capsys.readouterr().out
        assert ("cost model, given (bytes/s): host_tier_bandwidth 8e+09 (default 2.5e+10), "
                "disk_bandwidth 2.5e+08 (default 2e+09)" in printed) == (name == "given")
        outs[name] = out.read_text()
    assert "disk_bandwidth 2.5e+08" in outs["given"] and "host_tier_bandwidth 8e+09" in \
        outs["given"]
    assert "disk_bandwidth 2e+09" in outs["default"]  # the defaults, unchanged
    step = [line for line in outs["given"].splitlines() if "estimated step" in line]
    default_step = [line for line in outs["default"].splitlines() if "estimated step" in line]
    assert step != default_step


def test_bad_cost_input(tmp_path, capsys):
    with pytest.raises(FieldError, match=r"cost\.pcie_bandwidth: unknown key, expected one of "
                                         r"\[hbm_bandwidth, .*disk_bandwidth\]"):
        cost_values({"pcie_bandwidth": 1e9})
    for bad in (-1, 0, float("inf")):
        with pytest.raises(FieldError, match=f"cost.disk_bandwidth: expected a finite number of "
                                             f"bytes/s > 0, got {bad}"):
            cost_values({"disk_bandwidth": bad})
    with pytest.raises(FieldError, match="expected a number of bytes/s > 0, got 'fast'"):
        cost_values({"hbm_bandwidth": "fast"})
    assert cost_values({"hbm_bandwidth": "25e9"}) == {"hbm_bandwidth": 25e9}  # YAML 1.1's str
    assert set(COST_KEYS) <= {f for f in CostModel.__dataclass_fields__}
    files = {"malformed": ("cost: {disk_bandwidth: [1\n", "not valid YAML: line"),
             "no_cost_key": ("disk_bandwidth: 1.0e+9\n", "expected a mapping with the one key "
                                                        "'cost'"),
             "negative": ("cost: {disk_bandwidth: -5.0}\n", "cost.disk_bandwidth: expected a "
                                                           "finite number of bytes/s > 0")}
    for name, (text, message) in files.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message) as e:
            read_cost_file(str(path))
        assert str(path) in str(e.value)
    tables = tmp_path / "tables.yaml"
    tables.write_text(TABLES)
    assert main(["plan", str(tables), "--world-size", "1", "--cost",
                 str(tmp_path / "negative.yaml")]) == 2
    assert "cost.disk_bandwidth: expected a finite number" in capsys.readouterr().err
