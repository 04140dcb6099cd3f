"""Job YAML: every section, the error messages (file, key path, valid choices), overrides."""

import pathlib

import pytest

from fbtriton_dist.planner import ConfigError
from fbtriton_dist.train.config import JobConfig, apply_overrides, job_from_dict, load_job

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLES = [{"name": "t0", "num_embeddings": 100, "embedding_dim": 8, "features": ["f0", "f1"]}]


def job(**sections):
    base = {"tables": TABLES, "model": {"dense_arch": [8], "over_arch": [4, 1]}}
    base["train"] = {"steps": 10}
    return {**base, **sections}


def error(data, where="jobs/x.yaml") -> str:
    with pytest.raises(ConfigError) as e:
        job_from_dict(data, where)
    return str(e.value)


@pytest.mark.parametrize("name", ["quickstart", "dlrm_criteo"])
def test_shipped_jobs_load(name):
    cfg = load_job(ROOT / "configs" / "jobs" / f"{name}.yaml")
    assert isinstance(cfg, JobConfig)
    assert cfg.name == name
    assert cfg.run_dir == f"runs/{name}"


def test_defaults_and_paths(tmp_path):
    cfg = job_from_dict(job(), str(tmp_path / "j.yaml"), str(tmp_path))
    assert cfg.data.source == "synthetic" and cfg.data.num_dense == 13
    assert cfg.optimizer.embedding.type == "rowwise_adagrad"
    assert (cfg.sharding.comm.wire_dtype, cfg.sharding.comm.dedup) == ("fp32", False)
    cfg = job_from_dict(job(sharding={"comm": {"wire_dtype": "bf16", "dedup": True}}))
    assert (cfg.sharding.comm.wire_dtype, cfg.sharding.comm.dedup) == ("bf16", True)
    cfg = job_from_dict(job(sharding={"comm": {"wire_dtype": "fp8",
                                               "backward_wire_dtype": "int8"}}))
    assert (cfg.sharding.comm.wire_dtype, cfg.sharding.comm.backward_wire_dtype) == ("fp8", "int8")
    cfg = job_from_dict(job(), str(tmp_path / "j.yaml"), str(tmp_path))
    assert cfg.checkpoint_dir == "runs/j/checkpoints"
    assert cfg.path("a/b.tsv") == str(tmp_path / "a" / "b.tsv")
    assert [t.features for t in cfg.tables.tables] == [("f0", "f1")]


def test_table_set_file_relative_to_job(tmp_path):
    (tmp_path / "tables").mkdir()
    (tmp_path / "jobs").mkdir()
    (tmp_path / "tables" / "t.yaml").write_text(
        "tables:\n  - {name: a, num_embeddings: 10, embedding_dim: 8, features: [fa],"
        " id_distribution: {kind: zipf, alpha: 1.2}}\n"
    )
    (tmp_path / "jobs" / "j.yaml").write_text(
        "tables: ../tables/t.yaml\nmodel: {dense_arch: [8]}\ntrain: {steps: 3}\n"
    )
    cfg = load_job(tmp_path / "jobs" / "j.yaml")
    assert cfg.tables.tables[0].name == "a"
    assert cfg.tables.stats["a"].alpha == 1.2


def test_unknown_top_level_key():
    msg = error(job(trian={"steps": 3}))
    assert msg.startswith("jobs/x.yaml: trian: unknown key, expected one of [")
    assert "train" in msg and "optimizer" in msg


def test_unknown_nested_key():
    msg = error(job(optimizer={"embedding": {"type": "sgd", "learning_rate": 0.1}}))
    assert msg.startswith("jobs/x.yaml: optimizer.embedding.learning_rate: unknown key")
    assert ("[type, lr, eps, weight_decay, weight_decay_mode, betas, eta, momentum, beta, l1, "
            "l2, step_ema, step_start, step_ema_coef, step_swap, step_mode, ar_alpha, ema_beta, min_shrinkage, "
            "state_dtype, counter, cowclip, global_weight_decay]") in msg


def test_bad_choice_lists_choices():
    msg = error(job(optimizer={"embedding": {"type": "ada"}}))
    assert msg == (
        "jobs/x.yaml: optimizer.embedding.type: expected one of "
        "[sgd, adagrad, rowwise_adagrad, adam, partial_rowwise_adam, lamb, "
        "partial_rowwise_lamb, lars_sgd, ftrl, emainplace_rowwise_adagrad, "
        "rowwise_rmsprop_ar, rowwise_adagrad_with_counter, ensemble_rowwise_adagrad, rowwise_adagrad_global_decay], "
        "got 'ada'"
    )
    msg = error(job(data={"source": "criteo_tsv"}))
    assert ("data.source: expected one of [synthetic, random_rec, criteo, multihot], got "
            "'criteo_tsv'") in msg


@pytest.mark.parametrize(
    "section, key, expected",
    [
        ({"train": {"steps": "ten"}}, "train.steps", "expected an integer, got 'ten'"),
        ({"train": {"steps": 5, "batch_size": 0}}, "train.batch_size", "expected an integer >= 1"),
        ({"logging": {"progress_bar": "yes"}}, "logging.progress_bar", "expected true or false"),
        ({"model": {"dense_arch": "8"}}, "model.dense_arch", "expected a non-empty list"),
        ({"model": {"dense_arch": [8, 0]}}, "model.dense_arch[1]", "expected an integer >= 1"),
        ({"optimizer": {"dense": {"lr": -1}}}, "optimizer.dense.lr", "expected a number >= 0"),
        ({"data": {"synthetic": {"zipf": "x"}}}, "data.synthetic.zipf", "expected a number"),
        ({"data": {"synthetic": {"candidates_per_user": 0}}}, "data.synthetic.candidates_per_user",
         "expected an integer >= 1"),
        ({"data": {"synthetic": {"user_features": "a"}}}, "data.synthetic.user_features",
         "expected a list of feature names"),
        ({"sharding": {"reserved": 1.5}}, "sharding.reserved", "expected a number < 1"),
        ({"sharding": {"comm": {"wire_dtype": "int4"}}}, "sharding.comm.wire_dtype",
         "expected one of [fp32, bf16, fp16, fp8, int8], got 'int4'"),
        ({"sharding": {"comm": {"backward_wire_dtype": "e5m2"}}},
         "sharding.comm.backward_wire_dtype", "expected one of [fp32, bf16, fp16, fp8, int8]"),
        ({"sharding": {"comm": {"dedup": "yes"}}}, "sharding.comm.dedup", "expected true or false"),
        ({"sharding": {"comm": {"fixed_shapes": True, "dedup": True}}},
         "sharding.comm.fixed_shapes", "does not combine with dedup"),
        ({"sharding": {"comm": {"max_ids": 100}}}, "sharding.comm.max_ids",
         "set fixed_shapes: true"),
        ({"sharding": {"comm": {"fixed_shapes": True, "max_ids": 0}}}, "sharding.comm.max_ids",
         ">= 1"),
        ({"tables": 3}, "tables", "expected a table-set file path or a list of tables"),
        ({"train": {"steps": 5}, "seed": -1}, "seed", "expected an integer >= 0"),
        ({"train": {"steps": 5, "prefetch_rows": "file"}}, "train.prefetch_rows",
         "expected auto, true or false, got 'file'"),
    ],
)
def test_wrong_types_name_the_key(section, key, expected):
    msg = error(job(**section))
    assert msg.startswith(f"jobs/x.yaml: {key}: "), msg
    assert expected in msg


def test_table_errors_keep_the_key_path():
    bad = [{**TABLES[0], "pooling": "max"}]
    msg = error(job(tables=bad))
    assert msg.startswith("jobs/x.yaml: tables[0].pooling: expected one of [sum, mean, none]")


def test_cross_section_checks():
    msg = error(job(model={"dense_arch": [16], "over_arch": [4, 1]}))
    assert "model.dense_arch: DLRM needs every table's embedding_dim == dense_arch[-1] = 16" in msg
    msg = error(job(model={"dense_arch": [8], "over_arch": [4, 2]}))
    assert "model.over_arch: expected at least two layer sizes ending in 1" in msg
    msg = error(job(train={"epochs": 1}))
    assert "train.steps: required with data.source: synthetic" in msg
    msg = error(job(data={"source": "criteo"}))
    assert "data.criteo: required with source: criteo" in msg
    msg = error(job(data={"synthetic": {"zipf_per_feature": {"nope": 1.1}}}))
    assert "data.synthetic.zipf_per_feature.nope: not a feature of the tables" in msg
    msg = error(job(data={"synthetic": {"candidates_per_user": 4, "user_features": ["nope"]}}))
    assert "data.synthetic.user_features: 'nope' is not a feature of the tables" in msg
    msg = error(job(data={"source": "criteo", "criteo": {"train": ["a.tsv"]}}))
    assert "data.criteo.features: the tables have 2 features, Criteo has 26" in msg


def test_yaml_file_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: {steps: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not valid YAML: line"):
        load_job(path)
    path.write_text("- 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: expected a mapping, got list"):
        load_job(path)
    # no Python objects from YAML tags: safe_load only
    path.write_text("name: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(path)


def test_overrides(tmp_path):
    path = tmp_path / "j.yaml"
    import yaml

    path.write_text(yaml.safe_dump(job()))
    cfg = load_job(path, ["train.batch_size=64", "optimizer.dense.type=adam"], steps=7)
    assert (cfg.train.batch_size, cfg.train.steps, cfg.optimizer.dense.type) == (64, 7, "adam")
    with pytest.raises(ConfigError, match=r"j.yaml: train.batchsize: unknown key"):
        load_job(path, ["train.batchsize=64"])
    with pytest.raises(ConfigError, match=r"command line: train.steps: expected an override"):
        apply_overrides({}, ["train.steps"], "j.yaml")
    with pytest.raises(ConfigError, match=r"command line: seed: is not a mapping"):
        apply_overrides({"seed": 1}, ["seed.x=2"], "j.yaml")


@pytest.mark.parametrize("value,tiers", [(None, {"file"}), ("auto", {"file"}),
                                         (True, {"cached", "file"}), (False, set())])
def test_prefetch_rows_names_the_tiers_read_ahead(value, tiers):
    from fbtriton_dist.train.modes import prefetch_tiers

    train = {"steps": 5} if value is None else {"steps": 5, "prefetch_rows": value}
    assert prefetch_tiers(job_from_dict(job(train=train))) == tiers
