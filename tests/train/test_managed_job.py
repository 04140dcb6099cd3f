"""The job on managed tables, end to end on the CPU: configs/jobs/managed.yaml
(shrunk so that every table fills and evicts within a few steps) trains on the drifting
source; the id managers' numbers in metrics.jsonl and the summary are those of the remap
replayed on the same batches by the reference; a resumed run remaps, trains and saves
exactly what the uninterrupted run does; on 2 gloo ranks too; the Criteo reader hands raw
ids to a managed table; the step loop and the planner respect managed tables."""

import os

import pytest
import torch
import yaml

from fbtriton_dist.ops.id_remap import STATS, IdTable, id_remap
from fbtriton_dist.planner import ConfigError
from fbtriton_dist.train import checkpoint as ckpt
from fbtriton_dist.train.config import load_job
from fbtriton_dist.train.data import DataPosition
from fbtriton_dist.train.job import _constraints, _dense_optimizer, build_model, main
from fbtriton_dist.train.metrics import format_summary
from fbtriton_dist.train.modes import graph_blockers, resolve_pipeline
from fbtriton_dist.train.sources import make_source
from tests.train.test_job import losses, records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "configs", "jobs", "managed.yaml")
MANAGED = ("t_user", "t_item", "t_query")
SMALL = {"t_user": 60, "t_item": 300, "t_query": 120}  # capacities: full after a few steps


def managed_job(tmp_path, name="managed", tables=None, **sections):
    """configs/jobs/managed.yaml with smaller tables and a short run in ``tmp_path/name``."""
    with open(JOB, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    for t in data["tables"]:
        if t["name"] in SMALL:
            t["id_manager"]["capacity"] = SMALL[t["name"]]
            t["num_embeddings"] = SMALL[t["name"]] + 1
        if t["name"] == "t_query":
            t["id_manager"]["ttl_steps"] = 6
    if tables is not None:
        data["tables"] = tables(data["tables"])
    data["data"]["synthetic"]["drift"].update(window=600, new_ids_per_step=25)
    data["train"] = {"steps": 16, "batch_size": 64, "eval_every": 8, "eval_batches": 2}
    data["checkpoint"] = {"every": 8, "keep": 2}
    data["logging"] = {"log_every": 4, "progress_bar": False, "run_dir": str(tmp_path / name)}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def replayed_stats(cfg, steps):
    """Per managed table and step, the reference remap's ``STATS`` on the job's batches (a
    table's ids: its features in config order, each in KJT order)."""
    source = make_source(cfg.tables, cfg.data, batch_size=cfg.train.batch_size, seed=cfg.seed,
                         rank=0, world_size=1)
    tables = {t.name: t for t in cfg.tables.tables}
    maps = {n: IdTable(c, n) for n, c in cfg.tables.id_managers.items()}
    out = {n: [] for n in maps}
    for k, (batch, _) in zip(range(steps), source.train_batches(DataPosition()), strict=False):
        per_key = batch.sparse.to_dict()
        for name, table in maps.items():
            ids = torch.cat([per_key[f].values() for f in tables[name].features])
            id_remap(table, ids, step=k, backend="reference")
            out[name].append(dict(zip(STATS, table.stats.tolist(), strict=True)))
    return out


def test_managed_job_writes_the_id_managers_numbers(tmp_path, capsys):
    path = managed_job(tmp_path)
    assert main(["--config", str(path)]) == 0
    cfg = load_job(path)
    want = replayed_stats(cfg, 16)
    train = records(tmp_path / "managed", "train")
    assert [r["step"] for r in train] == [4, 8, 12, 16]
    for r in train:
        assert set(r["id_managers"]) == set(MANAGED)  # t_category is not managed
        for name, got in r["id_managers"].items():
            window = want[name][r["step"] - 4 : r["step"]]
            total = {k: sum(s[k] for s in window) for k in STATS}
            assert got["steps"] == 4
            for k in ("lookups", "admitted", "evicted", "expired", "rejected", "overflow"):
                assert got[f"{k}_per_step"] == pytest.approx(total[k] / 4, abs=1e-3), (name, k)
            assert got["hit_rate"] == pytest.approx(total["hits"] / total["lookups"], abs=1e-6)
            assert got["default_rate"] == pytest.approx(
                total["default_reads"] / total["lookups"], abs=1e-6)
            assert 0 < got["occupancy"] <= 1
    last = train[-1]["id_managers"]
    assert last["t_user"]["occupancy"] == last["t_item"]["occupancy"] == 1.0  # full ...
    assert last["t_user"]["evicted_per_step"] > 0 and last["t_item"]["evicted_per_step"] > 0
    assert last["t_query"]["expired_per_step"] > 0  # ... and evicting / expiring by policy
    assert last["t_user"]["rejected_per_step"] > 0  # min_count 2
    (summary,) = records(tmp_path / "managed", "summary")
    for name in MANAGED:
        got = summary["id_managers"][name]
        assert got["steps"] == 16
        assert got["total_admitted"] == sum(s["admitted"] for s in want[name])
        assert got["total_evicted"] == sum(s["evicted"] for s in want[name])
    assert [r["step"] for r in records(tmp_path / "managed", "eval")] == [8, 16]
    out = capsys.readouterr().out
    assert "id_managers.t_user: occupancy 1, hit_rate" in out


def test_managed_job_resume_remaps_like_the_uninterrupted_run(tmp_path):
    log = {"log_every": 1}
    full = managed_job(tmp_path, "full", logging=log)
    half = managed_job(tmp_path, "half", logging=log)
    assert main(["--config", str(full)]) == 0
    assert main(["--config", str(half), "--steps", "8"]) == 0
    assert main(["--config", str(half), "--resume"]) == 0
    want, got = losses(tmp_path / "full"), losses(tmp_path / "half")
    assert sorted(got) == list(range(1, 17))
    for step in range(9, 17):
        assert got[step] == want[step], step
    ids = {r["step"]: r["id_managers"] for r in records(tmp_path / "half", "train")}
    full_ids = {r["step"]: r["id_managers"] for r in records(tmp_path / "full", "train")}
    for step in range(9, 17):
        assert ids[step] == full_ids[step], step
    # the resumed steps did evict: their remap depended on the restored maps
    assert sum(ids[s]["t_user"]["evicted_per_step"] for s in range(9, 17)) > 0
    assert sum(ids[s]["t_item"]["evicted_per_step"] for s in range(9, 17)) > 0
    # the final checkpoints hold the same weights, maps and optimizer states
    cfg = load_job(full)
    states = []
    for run in ("full", "half"):
        model = build_model(cfg, torch.device("cpu"))
        dense = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
        opt = _dense_optimizer(cfg.optimizer.dense, dense)
        ckpt.load_checkpoint(str(tmp_path / run / "checkpoints" / "step_00000016"), model, opt)
        states.append((model.state_dict(), ckpt.fused_optimizer_state_dict(model)))
    (a, fa), (b, fb) = states
    assert any(".id_managers._managed_collision_modules.t_user.keys" in k for k in a)
    assert a.keys() == b.keys() and fa.keys() == fb.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for k in fa:
        assert torch.equal(fa[k], fb[k]) if torch.is_tensor(fa[k]) else fa[k] == fb[k], k


def test_managed_job_on_two_ranks_resumes_exactly(tmp_path):
    from tests.train.test_multirank import ok, torchrun

    full = managed_job(tmp_path, "full", logging={"log_every": 1},
                       train={"steps": 8, "eval_every": 4})
    half = managed_job(tmp_path, "half", logging={"log_every": 1},
                       train={"steps": 8, "eval_every": 4}, checkpoint={"every": 4})
    args = ["fbtriton_dist.train", "--config"]
    out = ok(torchrun(2, *args, str(full)))
    assert "id_managers.t_item: occupancy" in out
    ok(torchrun(2, *args, str(half), "--steps", "4"))
    ok(torchrun(2, *args, str(half), "--resume"))
    want, got = losses(tmp_path / "full"), losses(tmp_path / "half")
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == want[step], step
    ids = {r["step"]: r["id_managers"] for r in records(tmp_path / "half", "train")}
    full_ids = {r["step"]: r["id_managers"] for r in records(tmp_path / "full", "train")}
    assert all(ids[s] == full_ids[s] for s in range(5, 9))
    assert sum(ids[s]["t_item"]["evicted_per_step"] for s in range(5, 9)) > 0
    plan = yaml.safe_load((tmp_path / "full" / "plan.yaml").read_text())
    kinds = {t["name"]: t["sharding"] for t in plan["tables"]}
    assert all(kinds[n] in ("row_wise", "table_row_wise", "table_wise", "data_parallel")
               for n in MANAGED)


def test_criteo_hands_raw_ids_to_a_managed_table(tmp_path):
    import random

    from fbtriton_dist.train.data import parse_criteo_line
    from tests.train.test_data import criteo_line

    rng = random.Random(2)
    lines = [criteo_line(rng, missing=0.0) for _ in range(40)]
    (tmp_path / "train.tsv").write_text("".join(lines))
    tables = [{"name": f"t{j}", "num_embeddings": 20 + j, "embedding_dim": 4,
               "features": [f"c{j}"]} for j in range(26)]
    tables[0].update(num_embeddings=31, id_manager={"capacity": 30, "eviction": "lru"})
    data = {
        "seed": 1, "tables": tables, "model": {"dense_arch": [8, 4], "over_arch": [4, 1]},
        "data": {"source": "criteo", "criteo": {"train": ["train.tsv"]}},
        "train": {"epochs": 1, "batch_size": 8, "eval_batches": 0},
        "logging": {"log_every": 1, "progress_bar": False, "run_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "criteo.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_job(path)
    source = make_source(cfg.tables, cfg.data, batch_size=8, seed=0, rank=0, world_size=1,
                         resolve=cfg.path)
    batch, _ = next(source.train_batches(DataPosition()))
    per_key = batch.sparse.to_dict()
    raw = [int(line.split("\t")[14], 16) for line in lines[:8]]
    assert per_key["c0"].values().tolist() == raw  # no % E: ids far above the 31 rows
    assert max(raw) > 31
    assert per_key["c1"].values().tolist() == [int(line.split("\t")[15], 16) % 21
                                               for line in lines[:8]]
    assert main(["--config", str(path)]) == 0
    train = records(tmp_path / "run", "train")
    assert len(train) == 5 and set(train[-1]["id_managers"]) == {"t0"}
    assert train[-1]["id_managers"]["t0"]["occupancy"] == 1.0  # 40 distinct ids, 30 slots
    # 64-bit hex ids wrap to negative int64; wider ones are refused by column
    cols = lines[0].rstrip("\n").split("\t")
    cols[14], cols[15] = "ffffffffffffffff", "1" + "0" * 16
    sizes = [None, None] + [10] * 24
    with pytest.raises(ValueError, match="column C2: '10000000000000000' is not a 64-bit"):
        parse_criteo_line("\t".join(cols), sizes)
    cols[15] = "8000000000000000"
    _, _, cats = parse_criteo_line("\t".join(cols), sizes)
    assert cats[:2] == [-1, -(2**63)]


def test_the_step_loop_and_the_plan_respect_managed_tables(tmp_path):
    cfg = load_job(managed_job(tmp_path), ["train.pipeline=auto"])
    assert resolve_pipeline(cfg, "cuda", grouped=True) == "plain"
    assert any("managed tables" in w for w in graph_blockers(cfg, "cuda", True))
    with pytest.raises(ConfigError, match="train.pipeline: overlap cannot run here: managed"):
        resolve_pipeline(load_job(managed_job(tmp_path), ["train.pipeline=overlap"]), "cpu",
                         grouped=True)
    cons = _constraints(cfg)
    assert set(cons) == set(MANAGED)
    assert all("column_wise" not in cons[n].sharding for n in MANAGED)

    def column_wise(tables):
        tables[0]["sharding"] = ["column_wise", "table_wise"]
        tables[1]["sharding"] = ["grid_shard"]
        return tables

    cfg = load_job(managed_job(tmp_path, "cw", tables=column_wise))
    with pytest.raises(ConfigError, match=r"tables.t_item.sharding: table 't_item' is managed"):
        _constraints(cfg)
    text = format_summary({"steps": 3, "id_managers": {"t": {"occupancy": 0.5, "steps": 3}}})
    assert text.splitlines()[1:] == ["  steps: 3", "  id_managers.t: occupancy 0.5, steps 3"]


def test_job_config_errors_name_the_drift_key(tmp_path):
    path = managed_job(tmp_path)
    for override, message in [
        ("data.synthetic.drift.new_ids_per_step=-3",
         "data.synthetic.drift.new_ids_per_step: expected an integer >= 0, got -3"),
        ("data.synthetic.drift.window=0",
         "data.synthetic.drift.window: expected an integer >= 1, got 0"),
        ("data.synthetic.drift.features=[user, nope]",
         "data.synthetic.drift.features[1]: 'nope' is not a feature of the tables"),
        ("data.synthetic.drift.speed=3", "data.synthetic.drift.speed: unknown key"),
        ("data.synthetic.drift.dense_weight=-1",
         "data.synthetic.drift.dense_weight: expected a number >= 0.0, got -1"),
        ("data.synthetic.candidates_per_user=4",
         "data.synthetic.drift: does not combine with candidates_per_user > 1"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_job(path, [override])
    data = yaml.safe_load(path.read_text())
    del data["data"]["synthetic"]["drift"]["new_ids_per_step"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"data.synthetic.drift: missing required key\(s\) "
                                          r"\[new_ids_per_step\]"):
        load_job(path)
    assert load_job(path, ["data.synthetic.drift=null"]).data.synthetic.drift is None


def test_managed_job_saved_on_two_ranks_resumes_on_three(tmp_path):
    """The job's resume loads the maps saved by 2 owners into 3 (sharding/managed/state.py):
    the first resumed step finds the ids the checkpoint held (its hit rate is the
    uninterrupted run's side of the way from an empty map's)."""
    from tests.train.test_multirank import ok, torchrun

    kw = {"logging": {"log_every": 1}, "train": {"steps": 8, "eval_every": 4}}
    full = managed_job(tmp_path, "full", **kw)
    half = managed_job(tmp_path, "half", checkpoint={"every": 4}, **kw)
    args = ["fbtriton_dist.train", "--config"]
    ok(torchrun(2, *args, str(full)))
    ok(torchrun(2, *args, str(half), "--steps", "4"))
    ok(torchrun(3, *args, str(half), "--resume"))
    assert sorted(losses(tmp_path / "half")) == list(range(1, 9))
    ids = {r["step"]: r["id_managers"] for r in records(tmp_path / "half", "train")}
    full_ids = {r["step"]: r["id_managers"] for r in records(tmp_path / "full", "train")}
    for name in MANAGED:
        empty, want, got = (full_ids[1][name]["hit_rate"], full_ids[5][name]["hit_rate"],
                            ids[5][name]["hit_rate"])
        assert want > empty and got > (empty + want) / 2, (name, empty, want, got)
