"""Run by tests/train/test_multirank.py under torchrun (one copy per rank).

python -m tests.train.rank_driver kill RANK STEP -- JOB ARGS...
    the job's own entry point, except that rank RANK SIGKILLs itself when it is about to
    run step STEP + 1 (a hard crash of one process in the middle of a run)
python -m tests.train.rank_driver predict JOB.yaml CHECKPOINT OUT.json [KEY=VALUE ...]
    build the job's model for this world size and plan, load CHECKPOINT, and predict one
    fixed batch on every rank (the same samples whatever the world size); rank 0 writes
    the logits, the eval loss and the AUC to OUT.json
"""

from __future__ import annotations

import json
import os
import signal
import sys


def kill(rank: int, step: int, job_args: list[str]) -> int:
    from fbtriton_dist.train import job, loop

    real_steps = loop.Trainer._steps

    def steps(self):  # the plain loop's and the pipeline's steps alike
        inner = real_steps(self)
        while True:
            if self.env.rank == rank and self.step == step:
                os.kill(os.getpid(), signal.SIGKILL)
            try:
                item = next(inner)
            except StopIteration:
                return
            yield item

    loop.Trainer._steps = steps
    return job.main(job_args)


def predict(config: str, checkpoint: str, out: str, overrides: list[str]) -> int:
    import torch

    from fbtriton_dist.train.checkpoint import load_checkpoint
    from fbtriton_dist.train.config import load_job
    from fbtriton_dist.train.data import make_source
    from fbtriton_dist.train.job import build, distributed, make_plan
    from fbtriton_dist.train.loop import evaluate

    cfg = load_job(config, overrides, None)
    torch.use_deterministic_algorithms(cfg.deterministic)
    with distributed(cfg.device) as env:
        plan, _ = make_plan(cfg, env.world_size, env.local_world_size)
        built = build(cfg, env, plan)
        load_checkpoint(checkpoint, built.model, built.optimizer, process_group=env.process_group)
        # the eval stream of a one-rank world: the same samples for every world size
        source = make_source(
            cfg.tables, cfg.data, batch_size=96, seed=cfg.seed, rank=0, world_size=1
        )
        (batch,) = source.eval_batches(1)
        metrics = evaluate(built.model, [batch], env)
        built.model.eval()
        with torch.no_grad():
            b = batch.to(env.device)
            logits = built.model(b.dense, b.sparse).squeeze(-1).cpu()
        if env.rank == 0:
            with open(out, "w", encoding="utf-8") as f:
                json.dump({"logits": logits.tolist(), **metrics, "plan": plan.to_dict()}, f)
        del built  # the sharded model holds the process group: free it before the group goes
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "kill":
        sep = argv.index("--")
        return kill(int(argv[1]), int(argv[2]), argv[sep + 1 :])
    if argv[0] == "predict":
        return predict(argv[1], argv[2], argv[3], argv[4:])
    raise SystemExit(f"rank_driver: unknown mode {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
