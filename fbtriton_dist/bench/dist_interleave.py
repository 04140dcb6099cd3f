"""``bench dist``'s providers timed interleaved, for a machine other jobs share.

    torchrun --standalone --nproc-per-node 2 -m fbtriton_dist.bench.dist_interleave \\
        --device cpu --job configs/jobs/quickstart.yaml --models dlrm \\
        --providers torchrec ours_plain ours_lean_serial ours_lean --rounds 30 --chunk 10

``bench dist`` times one provider after another, each for a few seconds: on cores that other
processes load unevenly, the load of those seconds moves a provider's number more than the
providers differ. Here every provider is built first (all alive at once, one model each),
then timed in ``--rounds`` rounds of ``--chunk`` steps, the providers in an order rotated
every round, so that each sees the same load; with ``--threads 1,2`` each provider at each
thread count per rank is an arm of its own (``provider@Nt``, the count set before its
chunk). A row: the median over the rounds of the slowest rank's ms per step, the quartiles,
samples/s from it, and each rank's process CPU ms per step (mean over the rounds).
``ours_lean_serial`` is ``ours_lean`` with the pipeline's ``overlap_input=False`` (on the
CPU: the next batch's input dist before the step, on the calling thread, as before the
pipeline's worker thread). One plan, one model (the first of ``--plans`` / ``--models``);
the other flags are ``bench dist``'s.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence

SERIAL = {"ours_lean_serial": ("ours_lean", {"overlap_input": False})}
"""Providers of this module only: (``bench dist`` provider, pipeline options)."""


def order(providers: Sequence[str], round_: int) -> list[str]:
    """The providers of round ``round_``: the list rotated by the round number."""
    k = round_ % len(providers)
    return [*providers[k:], *providers[:k]]


def summarize(per_round: dict[str, list[float]], samples_per_step: int) -> dict[str, dict]:
    """Per provider: median and quartiles of its per-round ms per step, samples/s."""
    out = {}
    for name, ms in per_round.items():
        q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
        out[name] = {"ms_median": statistics.median(ms), "ms_q1": q[0], "ms_q3": q[2],
                     "rounds": len(ms),
                     "samples_per_s": 1e3 * samples_per_step / statistics.median(ms)}
    return out


def main(argv: Sequence[str] | None = None) -> None:
    import torch.distributed as dist

    from fbtriton_dist.train.job import distributed

    from . import dist as bench
    from . import dist_providers as prov
    from .dist_cpu import set_threads, thread_counts
    from .dist_setup import (
        ModelSpec,
        fixed_grad,
        make_batches,
        make_plan,
        scaled_tables,
        torchrec_configs,
    )

    argv = list(sys.argv[1:] if argv is None else argv)
    rounds, chunk = 30, 10
    for flag in ("--rounds", "--chunk"):
        if flag in argv:
            i = argv.index(flag)
            value = int(argv[i + 1])
            if value < 1:
                raise SystemExit(f"{flag}: expected >= 1, got {value}")
            rounds, chunk = (value, chunk) if flag == "--rounds" else (rounds, value)
            del argv[i : i + 2]
    names = []
    if "--providers" in argv:  # ours_lean_serial is not a bench dist provider
        i = argv.index("--providers") + 1
        while i < len(argv) and not argv[i].startswith("--"):
            names.append(argv.pop(i))
        argv.remove("--providers")
    args = bench.parse_args(argv)
    names = names or ["torchrec", "ours_lean_serial", "ours_lean"]
    bench.quiet()
    with distributed(args.device) as env:
        R, rank, device = env.world_size, env.rank, env.device
        H = env.local_world_size if R % env.local_world_size == 0 else R
        counts = thread_counts(args.threads, H) if device.type == "cpu" else [None]
        threads = set_threads(counts[0], H) if device.type == "cpu" else {}
        tables = args.job_tables or scaled_tables(args.tables, args.dim, args.total_gb,
                                                  args.scale)
        bags = ([t.bag_size for t in tables] if args.bag_size == "tables"
                else [args.bag_size] * len(tables))
        batches = make_batches(tables, n=args.batches, B=args.batch_size, L=bags,
                               alpha=args.zipf, num_dense=args.num_dense, seed=args.seed,
                               rank=rank, device=device)
        spec = ModelSpec(kind=args.models[0], num_dense=args.num_dense,
                         dense_arch=tuple(args.dense_arch), over_arch=tuple(args.over_arch),
                         cross_layers=args.cross_layers, low_rank=args.low_rank)
        ctx = prov.Context(tables=tables, configs=torchrec_configs(tables),
                           plan=make_plan(args.plans[0], tables, R, H), spec=spec,
                           batches=batches,
                           grad=fixed_grad(tables, args.batch_size, args.seed, rank, device),
                           device=device, group=env.process_group, seed=args.seed, lr=args.lr,
                           eps=args.eps, dense_lr=args.dense_lr, comm_extra=args.comm_extra)
        runners = {}
        for name in names:
            base, options = SERIAL.get(name, (name, None))
            saved = prov.PIPELINE_OPTIONS.get(base)
            if options is not None:
                prov.PIPELINE_OPTIONS[base] = options
            try:
                runners[name] = prov.build(base, ctx)
            finally:
                if options is not None:
                    prov.PIPELINE_OPTIONS.pop(base)
                    if saved is not None:
                        prov.PIPELINE_OPTIONS[base] = saved
            for _ in range(max(args.warmup, args.batches)):
                runners[name].step()
        # an arm: a provider at a thread count per rank (``name@Nt`` with several counts)
        arms = {(f"{n}@{c}t" if len(counts) > 1 else n): (n, c) for c in counts for n in names}
        ms: dict[str, list[float]] = {a: [] for a in arms}
        cpu: dict[str, float] = dict.fromkeys(arms, 0.0)
        for r in range(rounds):
            for arm in order(list(arms), r):
                name, count = arms[arm]
                if count is not None:
                    set_threads(count, H)
                dist.barrier(group=env.process_group)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(chunk):
                    runners[name].step()
                step_ms = 1e3 * (time.perf_counter() - t0) / chunk
                cpu[arm] += 1e3 * (time.process_time() - c0) / chunk / rounds
                ms[arm].append(step_ms)
        every: list = [None] * R
        dist.all_gather_object(every, (ms, cpu), group=env.process_group)
        if rank == 0:
            slowest = {a: [max(rk[0][a][i] for rk in every) for i in range(rounds)]
                       for a in arms}
            rows = summarize(slowest, args.batch_size * R)
            for a, (n, count) in arms.items():
                rows[a]["cpu_ms_per_step_per_rank"] = [round(rk[1][a], 3) for rk in every]
                rows[a]["loop"] = runners[n].loop
                rows[a]["threads_per_rank"] = count
            print(f"{args.plans[0]} {spec.kind}, {R} ranks, {rounds} rounds x {chunk} steps, "
                  f"{counts} thread(s) per rank (usable cores {threads.get('usable_cores')})")
            print(f"{'provider':>21} {'ms/step':>8} {'q1':>7} {'q3':>7} {'samples/s':>10} "
                  f"{'CPU ms/step per rank':>22}")
            for n, row in rows.items():
                print(f"{n:>21} {row['ms_median']:8.2f} {row['ms_q1']:7.2f} {row['ms_q3']:7.2f} "
                      f"{row['samples_per_s']:10,.0f} {str(row['cpu_ms_per_step_per_rank']):>22}")
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    json.dump({"command": " ".join(sys.argv), "plan": args.plans[0],
                               "model": spec.kind, "rounds": rounds, "chunk": chunk,
                               "threads": threads, "rows": rows, "ms_per_round": slowest}, f,
                              indent=1)
        runners.clear()
        prov.release(device)


if __name__ == "__main__":
    main()
