"""``train.pipeline`` resolved before the model is built (``train/modes.py``): ``auto`` picks
the CUDA graph on CUDA with a process group and a batch of fixed shape, overlap (sharded) or
plain otherwise; an explicit ``graph`` that cannot run says why. Device types are strings
here: nothing needs a GPU."""

import math

import pytest

from fbtriton_dist.planner import ConfigError
from fbtriton_dist.train import modes
from fbtriton_dist.train.config import job_from_dict
from fbtriton_dist.train.metrics import StageTimer
from fbtriton_dist.train.modes import graph_blockers, max_ids_bound, resolve_pipeline

TABLES = [
    {"name": "t0", "num_embeddings": 100, "embedding_dim": 8, "features": ["f0", "f1"],
     "pooling_factors": [2, 3]},
    {"name": "t1", "num_embeddings": 50, "embedding_dim": 8, "features": ["f2"]},
]


def cfg(pipeline="auto", dense="adagrad", **sections):
    data = {"tables": TABLES, "model": {"dense_arch": [8], "over_arch": [4, 1]},
            "train": {"steps": 10, "batch_size": 32, "pipeline": pipeline},
            "optimizer": {"dense": {"type": dense}}}
    for key, value in sections.items():
        section, _, field = key.partition("__")
        data.setdefault(section, {})[field] = value
    return job_from_dict(data)


@pytest.mark.parametrize("device, grouped, want", [
    ("cpu", True, "overlap"),     # as before: sharded on the CPU overlaps the input dist
    ("cpu", False, "plain"),      # one process: nothing to overlap
    ("cuda", True, "graph"),      # the whole step one CUDA graph
    ("cuda", False, "plain"),     # one process without torchrun: unsharded tables
], ids=["cpu-sharded", "cpu-one", "cuda-sharded", "cuda-one"])
def test_auto_picks_the_graph_on_cuda_and_keeps_the_cpu_choices(device, grouped, want,
                                                                monkeypatch):
    assert resolve_pipeline(cfg(), device, grouped) == want
    monkeypatch.setattr(modes, "AUTO_PICKS_GRAPH", False)  # the switch: overlap, not graph
    off = "overlap" if (device, grouped) == ("cuda", True) else want
    assert resolve_pipeline(cfg(), device, grouped) == off


@pytest.mark.parametrize("changes, reason", [
    ({"sharding__comm": {"dedup": True}}, "dedup"),
    ({"data__synthetic": {"candidates_per_user": 2}}, "candidates_per_user"),
    ({"optimizer__embedding": {"type": "rowwise_adagrad_with_counter"}}, "with counter"),
], ids=["dedup", "vbe", "counter"])
def test_auto_falls_back_to_overlap_on_cuda_when_the_step_cannot_be_captured(changes, reason):
    c = cfg(**changes)
    assert resolve_pipeline(c, "cuda", True) == "overlap"
    assert any(reason in why for why in graph_blockers(c, "cuda", True))


@pytest.mark.parametrize("tier, prefetch, blocked", [
    ("cached", "auto", False), ("cached", True, True), ("file", "auto", True),
    ("file", False, False)])
def test_cached_tables_run_in_the_graph_unless_their_rows_are_read_ahead(tier, prefetch,
                                                                         blocked):
    """A CUDA graph step maps cached tables' rows before each replay, so they run in it;
    reading their rows ahead (``train.prefetch_rows``: ``auto`` reads ``file`` tables) is an
    eager pipeline's, so it keeps ``auto`` on overlap and refuses an explicit ``graph``."""
    storage = {"tier": tier, "cache_load_factor": 0.5}
    if tier == "file":
        storage["path"] = "/tmp/fbtd-mode-test"
    tables = [{**TABLES[0], "storage": storage}, TABLES[1]]
    c = job_from_dict({"tables": tables, "model": {"dense_arch": [8], "over_arch": [4, 1]},
                       "train": {"steps": 10, "batch_size": 32, "prefetch_rows": prefetch}})
    assert resolve_pipeline(c, "cuda", True) == ("overlap" if blocked else "graph")
    reason = "tables ['t0'] read their rows ahead (train.prefetch_rows)"
    assert any(reason in why for why in graph_blockers(c, "cuda", True)) == blocked
    if blocked:
        explicit = job_from_dict({"tables": tables, "model": {"dense_arch": [8], "over_arch": [
            4, 1]}, "train": {"steps": 10, "pipeline": "graph", "prefetch_rows": prefetch}})
        with pytest.raises(ConfigError, match=r"tables \['t0'\] read their rows ahead"):
            resolve_pipeline(explicit, "cuda", True)


def test_nonfinite_skip_keeps_auto_plain():
    assert resolve_pipeline(cfg(train__nonfinite="skip"), "cuda", True) == "plain"


def test_explicit_modes():
    assert resolve_pipeline(cfg("overlap"), "cpu", True) == "overlap"
    assert resolve_pipeline(cfg("overlap"), "cpu", False) == "plain"
    assert resolve_pipeline(cfg("plain"), "cuda", True) == "plain"
    assert resolve_pipeline(cfg("graph"), "cuda", True) == "graph"


def test_explicit_graph_that_cannot_run_names_every_reason():
    with pytest.raises(ConfigError) as e:
        resolve_pipeline(cfg("graph", sharding__comm={"dedup": True}), "cpu", False)
    text = str(e.value)
    assert "train.pipeline" in text and "CUDA" in text and "torchrun" in text
    assert "dedup" in text


@pytest.mark.parametrize("dense", ["sgd", "adagrad", "adam", "adamw"])
def test_every_dense_optimizer_of_the_job_can_be_captured(dense):
    assert not graph_blockers(cfg(dense=dense), "cuda", True)


def test_id_bound_of_each_source():
    B = 32
    assert max_ids_bound(cfg(sharding__comm={"fixed_shapes": True, "max_ids": 7})) == 7
    mean = B * (2 + 3 + 1)  # Poisson bag lengths around the pooling factors
    bound = max_ids_bound(cfg())
    assert mean + 8 * math.sqrt(mean) < bound < 1.5 * mean + 32
    rr = cfg(data__source="random_rec", data__random_rec={"ids_per_feature": 4})
    assert max_ids_bound(rr) == B * 3 * 4  # at most ids_per_feature per bag


def test_stage_timer_cancel_forgets_a_started_stage():
    t = StageTimer("cpu", warmup_steps=0)
    t.start("step")
    t.cancel("step")
    t.stop("step")  # nothing open: nothing counted
    t.step_done()
    assert t.take() == {}


def test_the_nonfinite_flag_is_kept_in_place_with_the_step_counted_on_the_device():
    """What a CUDA graph replays: the first bad step lands in the same tensor (a replay
    writes to the captured addresses), numbered by a device counter, not a captured int."""
    from types import SimpleNamespace

    import torch

    from fbtriton_dist.train.loop import NO_BAD_STEP, Trainer

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    t = SimpleNamespace(dense_params=[p], _step_t=torch.tensor(4),
                        _first_bad=torch.tensor(NO_BAD_STEP))
    flag = t._first_bad
    Trainer._note_finite(t, torch.tensor(0.5))  # step 5: finite
    assert t._first_bad is flag and int(flag) == NO_BAD_STEP
    Trainer._note_finite(t, torch.tensor(float("nan")))  # step 6: the first bad one
    Trainer._note_finite(t, torch.tensor(float("inf")))  # step 7: also bad, not the first
    assert t._first_bad is flag and int(flag) == 6 and int(t._step_t) == 7


def test_the_graph_gets_a_capturable_dense_optimizer():
    import torch

    from fbtriton_dist.train.dense_optim import CapturableAdagrad
    from fbtriton_dist.train.job import _dense_optimizer

    params = [torch.nn.Parameter(torch.ones(2))]
    for kind in ("adam", "adamw"):
        c = cfg(dense=kind).optimizer.dense
        assert _dense_optimizer(c, params, capturable=True).param_groups[0]["capturable"]
        assert not _dense_optimizer(c, params).param_groups[0]["capturable"]
    c = cfg(dense="adagrad").optimizer.dense
    assert isinstance(_dense_optimizer(c, params, capturable=True), CapturableAdagrad)
    assert type(_dense_optimizer(c, params)) is torch.optim.Adagrad


def test_a_job_asking_for_the_graph_on_the_cpu_stops_with_the_reasons(tmp_path, capsys):
    from fbtriton_dist.train.job import main
    from tests.train.test_job import write_job

    path = write_job(tmp_path, "g", train__pipeline="graph", train__steps=2)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.pipeline: graph captures the whole step" in err
    assert "the device is cpu" in err and "torchrun" in err
    assert not (tmp_path / "g" / "metrics.jsonl").exists()


@pytest.mark.parametrize("opt", ["emainplace_rowwise_adagrad", "ensemble_rowwise_adagrad"])
def test_whole_table_step_optimizers_keep_the_step_out_of_a_cuda_graph(opt):
    """EMA in place's and ensemble's whole-table steps are chosen on the host by the step
    count (a replayed graph would skip them): ``auto`` runs overlap on CUDA, an explicit
    ``graph`` is refused naming the optimizer; rowwise Adagrad still gets the graph."""
    c = cfg(optimizer__embedding={"type": opt})
    assert resolve_pipeline(c, "cuda", True) == "overlap"
    with pytest.raises(ConfigError, match=f"train.pipeline: graph .*{opt} runs a whole-table "
                                          "step"):
        resolve_pipeline(cfg("graph", optimizer__embedding={"type": opt}), "cuda", True)
    plain = cfg(optimizer__embedding={"type": "rowwise_adagrad"})
    assert resolve_pipeline(plain, "cuda", True) == "graph"
