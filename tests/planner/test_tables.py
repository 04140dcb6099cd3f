"""Table-set YAML: the shipped examples load, every error names file, key path and choices."""

import pathlib
from types import SimpleNamespace

import pytest

from fbtriton_dist.planner import (
    ConfigError,
    IdDistribution,
    TableConstraints,
    TableSpec,
    load_tables,
    to_table_specs,
)

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tables"


def test_shipped_table_sets_load():
    criteo = load_tables(CONFIGS / "criteo_terabyte.yaml")
    assert len(criteo.tables) == 26
    t20 = criteo.tables[20]
    assert (t20.num_embeddings, t20.embedding_dim, t20.dtype, t20.ids_per_sample) == (
        25641295,
        128,
        "fp32",
        100.0,
    )
    big = load_tables(CONFIGS / "ten_billion_rows.yaml")
    assert sum(t.num_embeddings for t in big.tables) == 10_000_000_000
    ad = big.tables[0]
    assert ad.features == ("ad_id", "clicked_ad_ids") and ad.pooling_factors == (1, 20)
    assert big.stats["ad_id"] == IdDistribution(kind="zipf", alpha=1.05)


def write(tmp_path, text):
    path = tmp_path / "tables.yaml"
    path.write_text(text)
    return path


def test_defaults_constraints_and_stats(tmp_path):
    path = write(
        tmp_path,
        """
defaults: {embedding_dim: 16, dtype: bf16}
tables:
  - {name: a, num_embeddings: 10, features: fa, sharding: row_wise, ranks: [0, 1],
     id_distribution: {kind: histogram, histogram: [5, 1]}}
  - {name: b, num_embeddings: 20, features: [fb, fc], pooling_factors: {fc: 4},
     optimizer: adam, min_shards: 1, max_shards: 2}
""",
    )
    ts = load_tables(path)
    assert ts.tables[0] == TableSpec(
        name="a", num_embeddings=10, embedding_dim=16, features=("fa",), dtype="bf16"
    )
    assert ts.tables[1].pooling_factors == (1.0, 4) and ts.tables[1].optimizer == "adam"
    assert ts.constraints == {
        "a": TableConstraints(sharding=("row_wise",), ranks=(0, 1)),
        "b": TableConstraints(min_shards=1, max_shards=2),
    }
    assert ts.stats["a"].cdf(10, 5) == pytest.approx(5 / 6)


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f], sharding: rowwise}",
            "tables[0].sharding[0]: expected one of [row_wise, table_wise, column_wise, "
            "table_row_wise, grid_shard, data_parallel], got 'rowwise'",
        ),
        (
            "- {name: a, num_embeddings: 0, embedding_dim: 4, features: [f]}",
            "tables[0].num_embeddings: expected an integer >= 1, got 0",
        ),
        (
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f], dtype: fp8}",
            "tables[0].dtype: expected one of [fp32, fp16, bf16], got 'fp8'",
        ),
        (
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f], pooling_factor: 2}",
            "tables[0].pooling_factor: unknown key, expected one of [name, num_embeddings",
        ),
        (
            "- {name: a, embedding_dim: 4, features: [f]}",
            "tables[0]: missing required key(s) [num_embeddings]",
        ),
        (
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f],\n"
            "   pooling_factors: {g: 2}}",
            "tables[0].pooling_factors.g: not a feature of this table, expected one of [f]",
        ),
        (
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f], min_shards: 3,"
            " max_shards: 2}",
            "tables[0].max_shards: expected >= min_shards=3, got 2",
        ),
        (
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f],\n"
            "   id_distribution: {kind: zipf, alpha: -1}}",
            "tables[0].id_distribution.alpha: expected a number > 0.0, got -1",
        ),
        (
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [f]}\n"
            "- {name: a, num_embeddings: 10, embedding_dim: 4, features: [g]}",
            "tables: table name(s) ['a'] appear more than once",
        ),
    ],
)
def test_table_yaml_errors(tmp_path, body, message):
    path = write(tmp_path, "tables:\n" + body + "\n")
    with pytest.raises(ConfigError) as e:
        load_tables(path)
    assert str(e.value).startswith(f"{path}: ")
    assert message in str(e.value)


def test_missing_file_and_bad_syntax(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_tables(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML: line 1"):
        load_tables(write(tmp_path, "tables: [{name: a"))


def test_embedding_bag_config_duck_typing():
    enum = lambda name: SimpleNamespace(name=name)  # noqa: E731
    cfg = SimpleNamespace(
        name="t",
        num_embeddings=100,
        embedding_dim=16,
        feature_names=["f1", "f2"],
        pooling=enum("MEAN"),
        data_type=enum("FP16"),
    )
    (spec,) = to_table_specs([cfg], pooling_factors={"f2": 3.0})
    assert spec == TableSpec(
        name="t",
        num_embeddings=100,
        embedding_dim=16,
        features=("f1", "f2"),
        pooling="mean",
        dtype="fp16",
        pooling_factors=(1.0, 3.0),
    )
    with pytest.raises(
        ValueError, match=r"tables\[0\]: expected a TableSpec or an EmbeddingBagConfig"
    ):
        to_table_specs([object()])


def test_real_torchrec_config():
    torchrec = pytest.importorskip("torchrec")
    cfg = torchrec.EmbeddingBagConfig(
        name="t", num_embeddings=10, embedding_dim=8, feature_names=["f"]
    )
    (spec,) = to_table_specs([cfg])
    assert (spec.dtype, spec.pooling, spec.features) == ("fp32", "sum", ("f",))
