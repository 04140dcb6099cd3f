"""``optimizer.schedule``: the factor per step (written out by hand here), its checks, the
rate reaching the fused kernels (unsharded and sharded collections) and the job's loop."""

import pytest
import torch
import torchrec

from fbtriton_dist import EmbeddingBagCollection, shard
from fbtriton_dist.planner import ConfigError, FieldError, ShardingPlanner
from fbtriton_dist.train.config import load_job
from fbtriton_dist.train.lr_schedule import LrSchedule
from fbtriton_dist.train.modes import graph_blockers
from tests.train.test_job import records, write_job


def test_factor_per_step_warmup_decay_and_end():
    s = LrSchedule(warmup_steps=4, decay_start=6, decay_steps=4, decay_power=2.0,
                   end_factor=0.1)
    # warm-up k/4; flat; decay r = 1, .75, .5, .25 -> .1 + .9 r^2; then the end factor
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 0.60625, 0.325, 0.15625, 0.1, 0.1]
    assert [s.factor(k) for k in range(1, 13)] == pytest.approx(want, rel=1e-12)
    assert LrSchedule().constant and LrSchedule().factor(7) == 1.0
    linear = LrSchedule(decay_steps=2, decay_power=1.0)  # decays from the first step
    assert [linear.factor(k) for k in (1, 2, 3)] == [1.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="k >= 1"):
        s.factor(0)


@pytest.mark.parametrize("kwargs, key", [
    ({"warmup_steps": 5, "decay_start": 4, "decay_steps": 2}, "decay_start"),
    ({"end_factor": 1.5}, "end_factor"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"decay_power": 0.0}, "decay_power"),
])
def test_bad_schedules_name_the_key(kwargs, key):
    with pytest.raises(FieldError, match=key):
        LrSchedule(**kwargs)


def test_job_key_is_read_checked_and_keeps_graph_off(tmp_path):
    sched = {"warmup_steps": 3, "decay_start": 3, "decay_steps": 2}
    cfg = load_job(write_job(tmp_path, optimizer={"schedule": sched}))
    assert cfg.optimizer.schedule == LrSchedule(**sched)
    assert any("optimizer.schedule" in w for w in graph_blockers(cfg, "cuda", True))
    assert not any("schedule" in w for w in graph_blockers(load_job(write_job(tmp_path)),
                                                           "cuda", True))
    with pytest.raises(ConfigError, match="optimizer.schedule.decay_start"):
        load_job(write_job(tmp_path, optimizer={"schedule": {"warmup_steps": 3,
                                                             "decay_start": 1,
                                                             "decay_steps": 2}}))


def _ebc(seed=0):
    torch.manual_seed(seed)
    cfgs = [torchrec.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=20,
                                        feature_names=["f"])]
    return EmbeddingBagCollection(tables=cfgs)


def _kjt():
    return torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([1, 3, 3, 19]), lengths=torch.tensor([2, 2]))


def _weight(ebc):
    w = ebc.state_dict()["embedding_bags.t.weight"]  # a ShardedTensor when sharded
    return (w.local_tensor() if hasattr(w, "local_tensor") else w).clone()


def _step(ebc):
    ebc(_kjt())["f"].pow(2).sum().backward()
    return _weight(ebc)


def test_set_learning_rate_reaches_the_unsharded_kernels():
    from torchrec.optim import apply_optimizer_in_backward

    a, b = _ebc(), _ebc()
    apply_optimizer_in_backward(torch.optim.SGD, a.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.SGD, b.parameters(), {"lr": 0.025})
    before = _step(a)  # one step at 0.1, so the next forward reads the annotation again
    b.load_state_dict(a.state_dict())
    a.set_learning_rate(0.025)
    assert torch.equal(_step(a), _step(b)) and not torch.equal(_step(a), before)
    a.set_learning_rate(0.0)
    frozen = _weight(a)
    assert torch.equal(_step(a), frozen)
    with pytest.raises(ValueError, match="no table of this collection has a fused"):
        _ebc().set_learning_rate(0.1)


def test_set_learning_rate_reaches_the_sharded_kernels(tmp_path):
    import torch.distributed as dist

    from fbtriton_dist import optim

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ebc = _ebc()
        plan = ShardingPlanner(world_size=1).plan(ebc.embedding_bag_configs())
        sharded = shard(ebc, plan, dist.group.WORLD, "cpu", optimizer=optim.SGD(lr=0.1))
        w0 = _weight(sharded)
        sharded.set_learning_rate(0.0)
        assert torch.equal(_step(sharded), w0)
        sharded.set_learning_rate(0.1)
        assert not torch.equal(_step(sharded), w0) and sharded.optimizer.lr == 0.1
    finally:
        dist.destroy_process_group()


def test_the_job_schedules_both_rates(tmp_path):
    """Decay to 0 after the first step: the weights after 3 steps are those after 1 (the
    rates reached the fused and the dense optimizers), and the metrics log each step's rates."""
    from fbtriton_dist.train.job import main

    sched = {"decay_start": 0, "decay_steps": 1, "end_factor": 0.0}
    runs = {}
    for steps in (1, 3):
        path = write_job(tmp_path, name=f"s{steps}", optimizer={
            "embedding": {"type": "rowwise_adagrad", "lr": 0.1},
            "dense": {"type": "adagrad", "lr": 0.1}, "schedule": sched},
            train={"steps": steps, "batch_size": 16, "eval_batches": 0},
            checkpoint={"every": 0}, logging={"log_every": 1, "progress_bar": False})
        assert main(["--config", str(path)]) == 0
        runs[steps] = tmp_path / f"s{steps}"
    lrs = [r["lr"] for r in records(runs[3], "train")]
    assert lrs == [{"embedding": 0.1, "dense": 0.1}, {"embedding": 0.0, "dense": 0.0},
                   {"embedding": 0.0, "dense": 0.0}]

    def weights(run, steps):
        from fbtriton_dist.train import checkpoint as ckpt
        from fbtriton_dist.train.job import _dense_optimizer, build_model

        cfg = load_job(tmp_path / f"s{steps}.yaml")
        model = build_model(cfg, torch.device("cpu"))
        opt = _dense_optimizer(cfg.optimizer.dense, [
            p for n, p in model.named_parameters() if "embedding_bags" not in n])
        (path,) = sorted((run / "checkpoints").iterdir())
        ckpt.load_checkpoint(str(path), model, opt)
        return model.state_dict()

    one, three = weights(runs[1], 1), weights(runs[3], 3)
    assert one.keys() == three.keys()
    for k in one:
        assert torch.equal(one[k], three[k]), k
