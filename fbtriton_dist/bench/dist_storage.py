"""``bench dist --storage device,cached,file``: sharded tables on storage tiers against the same
plan on ``device``, in one launch (under torchrun; ``--tiny`` on the CPU with gloo).

    torchrun --standalone --nproc-per-node 2 -m fbtriton_dist.bench dist --tiny \\
        --storage device,cached,file --cache-load-factor 0.1 --models ebc --providers ours_plain

For every (plan, model, provider of ours) each tier's model is built once: the plan's tables
of at least ``--tier-min-rows`` rows on the tier (``TableSharding.storage``: every shard its
own cache of ``--cache-load-factor`` x its rows, ``--policy``; ``file``: under ``--path`` or a
temporary folder, one per rank), the smaller ones on ``device`` (a cache of a fraction of a
tiny table cannot hold a step's rows). Then:

1. the check, before anything is timed: every model trains ``--check-steps`` steps on the
   same batches, and each tier's losses, weights and fused optimizer state (every rank's
   local shards, and the dense parameters) must equal ``device``'s bit for bit; a difference
   stops the run (exit 1, nothing timed);
2. ``--repeats`` rounds, the tiers in an order rotated per round, each measured as ``bench
   dist`` measures a provider (``dist_measure.measure``: warm-up, timed steps, the step split
   on the last round), with the caches' counts over the round (summed over every rank).

Per tier: the median over rounds of ms per step (the slowest rank's median step) and
samples/s, ``ratio`` = the median over rounds of (the tier's ms per step / ``device``'s ms
per step in the same round): > 1 is slower than ``device``; the hit rate (distinct rows found
in the cache / distinct rows looked up), rows fetched and written back per step (all ranks),
and the step split (rank 0, last round); with a pipeline that reads rows ahead (``ours_lean``
and the other ``TrainPipeline`` providers), the prefetch's rows and its hidden / exposed ms per
step and rank, as the job's ``caches`` metrics count them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fbtriton_dist.planner import IdDistribution, ShardingPlan
from fbtriton_dist.storage import Storage

TIERS = ("device", "host", "cached", "file", "cached+hot", "file+hot")
"""``<tier>+hot``: that tier with the hot shards promoted to ``device`` within
``--hot-budget-mb`` per rank (the planner's ``shard_tiers.promote_hot_shards``: tiers per
shard, ``docs/storage.md``)."""
CACHE_KEYS = ("lookups", "misses", "evictions", "writebacks", "prefetched", "prefetch_used",
              "prefetch_us", "prefetch_wait_us")


def parse_tiers(text: str) -> list[str]:
    """``--storage``: comma-separated tiers, ``device`` first (added when missing: the ratios'
    base)."""
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise ValueError(f"--storage: expected tiers among {list(TIERS)}, comma separated, "
                         f"got {text!r}")
    return ["device", *dict.fromkeys(t for t in tiers if t != "device")]


def tier_plan(plan: ShardingPlan, tier: str, *, load_factor: float, policy: str,
              path: str | None, min_rows: int,
              hot_budget_bytes: float | Sequence[float] | None = None,
              stats: Mapping[str, Any] | None = None,
              optimizer: str = "rowwise_adagrad") -> tuple[ShardingPlan, list[str]]:
    """``plan`` with its tables of at least ``min_rows`` rows on ``tier`` (None storage for
    ``device``), and their names. ``<tier>+hot``: then the shards of those tables with the
    most lookups per extra device byte (``stats``: id distributions by table, None: uniform)
    back on ``device`` while their rank stays within 95 % of ``hot_budget_bytes`` (one for
    every rank, or one per rank; ``planner.shard_tiers.promote_hot_shards``)."""
    if tier.endswith("+hot"):
        from fbtriton_dist.planner import TableSpec
        from fbtriton_dist.planner.shard_tiers import promote_hot_shards

        if hot_budget_bytes is None:
            raise ValueError(f"--storage {tier}: expected --hot-budget-mb (device memory per "
                             "rank the hot shards may fill), got none")
        base, names = tier_plan(plan, tier.removesuffix("+hot"), load_factor=load_factor,
                                policy=policy, path=path, min_rows=min_rows)
        specs = [TableSpec(name=t.name, num_embeddings=t.num_embeddings,
                           embedding_dim=t.embedding_dim, features=(t.name,))
                 for t in base.tables]
        return promote_hot_shards(base, specs, stats, names, hot_budget_bytes,
                                  optimizer), names
    if tier == "device":
        return plan, []
    storage = (Storage(tier="host") if tier == "host" else
               Storage(tier=tier, cache_load_factor=load_factor, policy=policy,
                       path=path if tier == "file" else None))
    names = [t.name for t in plan.tables if t.num_embeddings >= min_rows]
    tables = tuple(dataclasses.replace(t, storage=storage) if t.name in names else t
                   for t in plan.tables)
    return dataclasses.replace(plan, tables=tables), names


def device_shards(plan: ShardingPlan, names: Sequence[str]) -> list[str]:
    """The shards of tables ``names`` that ``plan`` puts on ``device``
    (``table[i] (rank r: rows a..b, ...)``; a table wholly on device: every shard)."""
    out = []
    for t in plan.tables:
        if t.name in names:
            out += [f"{t.name}[{i}] ({s.describe()})" for i, s in enumerate(t.shards)
                    if (t.shard_storage(s) or Storage(tier="device")).tier == "device"]
    return out


def local_tensors(module: torch.nn.Module, sharded) -> dict[str, torch.Tensor]:
    """This rank's training state: the model's state dict (a ShardedTensor as its local
    shards) and the sharded collection's fused optimizer state."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, torch.Tensor] = {}
    items = list(module.state_dict().items())
    items += [(f"fused.{k}", v) for k, v in sharded.fused_optimizer_state_dict().items()]
    for k, v in items:
        if isinstance(v, ShardedTensor):
            for i, s in enumerate(v.local_shards()):
                out[f"{k}#{i}"] = s.tensor.detach().cpu().clone()
        elif torch.is_tensor(v):
            out[k] = v.detach().cpu().clone()
    return out


def differences(want: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor],
                limit: int = 5) -> list[str]:
    """Where ``got`` is not ``want`` bit for bit (keys, shapes, dtypes, values): at most
    ``limit`` lines."""
    out = []
    if set(want) != set(got):
        out.append(f"keys differ: missing {sorted(set(want) - set(got))[:3]}, "
                   f"extra {sorted(set(got) - set(want))[:3]}")
    for k in sorted(set(want) & set(got)):
        a, b = want[k], got[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{k}: {tuple(b.shape)} {b.dtype}, device {tuple(a.shape)} {a.dtype}")
        elif not torch.equal(a, b):
            n = int((a != b).sum())
            diff = float((a.double() - b.double()).abs().max())
            out.append(f"{k}: {n} of {a.numel()} values differ (max |diff| {diff:.3g})")
    return out[:limit]


def summarise(rounds: Sequence[Mapping[str, Mapping[str, Any]]],
              tiers: Sequence[str], ranks: int = 1) -> list[dict[str, Any]]:
    """A row per tier from ``rounds`` (per round, per tier: ``ms_per_step``, ``samples_per_s``,
    cache counts summed over ``ranks`` ranks, ``steps``): medians over rounds; ``ratio`` =
    median over rounds of tier ms / device ms of the same round (> 1: slower than device);
    with a prefetch (a pipeline), its rows per step and hidden / exposed ms per step and
    rank."""
    rows = []
    for tier in tiers:
        ms = [r[tier]["ms_per_step"] for r in rounds]
        row: dict[str, Any] = {
            "tier": tier,
            "ms_per_step": statistics.median(ms),
            "ms_per_step_rounds": ms,
            "samples_per_s": statistics.median(r[tier]["samples_per_s"] for r in rounds),
            "ratio": statistics.median(r[tier]["ms_per_step"] / r["device"]["ms_per_step"]
                                       for r in rounds),
        }
        counts = {k: sum(r[tier]["cache"].get(k, 0) for r in rounds) for k in CACHE_KEYS}
        steps = sum(r[tier]["steps"] for r in rounds)
        if counts["lookups"]:
            row["hit_rate"] = 1 - counts["misses"] / counts["lookups"]
            row["fetched_per_step"] = counts["misses"] / steps
            row["written_back_per_step"] = counts["writebacks"] / steps
        if counts["prefetched"]:  # a pipeline read rows ahead: per step and rank, as the job
            per = 1e-3 / (steps * ranks)
            row["prefetched_per_step"] = counts["prefetched"] / steps
            row["prefetch_used_per_step"] = counts["prefetch_used"] / steps
            row["prefetch_hidden_ms"] = max(counts["prefetch_us"] - counts["prefetch_wait_us"],
                                            0) * per
            row["prefetch_exposed_ms"] = counts["prefetch_wait_us"] * per
        row["stages_ms"] = rounds[-1][tier].get("stages_ms", {})
        rows.append(row)
    return rows


STAGES = ("forward", "input_dist", "lookup", "output_dist", "dense", "backward")


def format_rows(head: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """The table of one (plan, model, provider): per tier its median ms and samples/s, ``x
    device`` = tier ms / device ms (> 1: slower), the caches' numbers, the step split."""

    def num(v, d=2):
        return "-" if v is None else f"{v:,.{d}f}"

    lines = [f"{head} (x device = tier ms / device ms, > 1: slower than device; pf: "
             "prefetch ms per step and rank)",
             f"{'tier':>10} {'ms/step':>9} {'samples/s':>10} {'x device':>9} {'hit':>6} "
             f"{'fetch/st':>9} {'wrback/st':>9} {'pf hid':>6} {'pf exp':>6} "
             + " ".join(f"{s[:8]:>8}" for s in STAGES)]
    for r in rows:
        st = r.get("stages_ms", {})
        hit = f"{r['hit_rate']:.3f}" if "hit_rate" in r else "-"
        lines.append(
            f"{r['tier']:>10} {r['ms_per_step']:>9.2f} {r['samples_per_s']:>10,.0f} "
            f"{r['ratio']:>8.2f}x {hit:>6} {num(r.get('fetched_per_step'), 0):>9} "
            f"{num(r.get('written_back_per_step'), 0):>9} "
            f"{num(r.get('prefetch_hidden_ms')):>6} {num(r.get('prefetch_exposed_ms')):>6} "
            + " ".join(f"{num(st.get(s)):>8}" for s in STAGES))
    return "\n".join(lines)


def _cache_counts(sharded) -> dict[str, int]:
    stats = sharded.cache_stats() if callable(getattr(sharded, "cache_stats", None)) else {}
    return {k: sum(int(v[k]) for v in stats.values()) for k in CACHE_KEYS}


def _gather(obj, group) -> list:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _check(runners: Mapping[str, Any], steps: int, group) -> dict[str, list[str]]:
    """Train every tier ``steps`` steps; per tier, every rank's differences from device."""
    state = {}
    for tier, runner in runners.items():
        losses = torch.stack([runner.step() for _ in range(steps)]).cpu()
        state[tier] = {"losses": losses, **local_tensors(runner.model, runner.sharded)}
    out = {}
    for tier in runners:
        if tier != "device":
            mine = differences(state["device"], state[tier])
            out[tier] = [line for rank, lines in enumerate(_gather(mine, group))
                         for line in (f"rank {rank}: {x}" for x in lines)]
    return out


def _measure_round(runners, order, args, env, samples_per_step: int, split: int) -> dict:
    from .dist_measure import measure

    out = {}
    for tier in order:
        runner = runners[tier]
        before = _cache_counts(runner.sharded)
        local = measure(runner, warmup=args.warmup, steps=args.steps, profile_steps=0,
                        split=split, device=env.device, group=env.process_group)
        after = _cache_counts(runner.sharded)
        local["cache"] = {k: after[k] - before[k] for k in CACHE_KEYS}
        ranks = _gather({k: local[k] for k in ("elapsed_s", "ms_per_step_median", "cache")}
                        | {"stages_ms": local.get("stages_ms", {})}, env.process_group)
        elapsed = max(r["elapsed_s"] for r in ranks)
        out[tier] = {
            "ms_per_step": max(r["ms_per_step_median"] for r in ranks),
            "samples_per_s": samples_per_step * args.steps / elapsed,
            "cache": {k: sum(r["cache"][k] for r in ranks) for k in CACHE_KEYS},
            "steps": args.warmup + args.steps + split,
            "stages_ms": ranks[0]["stages_ms"],
        }
    return out


def run_storage(args, env, ctx_for, results: dict[str, Any]) -> dict[str, Any]:
    """Every (plan, model, provider) with each tier of ``args.storage``; rank 0 prints the
    tables and fills ``results["storage"]``. ``ctx_for(plan_name, model)``: the ``Context``
    of ``bench dist``. Failed checks go to ``results["failed"]``; then nothing is timed."""
    from .dist_providers import build, release

    tiers = args.storage
    mb = getattr(args, "hot_budget_mb", None)  # one per rank, or one for all
    hot_budget = (None if mb is None else [x * 2**20 for x in mb] if len(mb) > 1
                  else mb[0] * 2**20)
    base = args.path or tempfile.mkdtemp(prefix="fbtd-bench-dist-")
    folder = os.path.join(base, f"rank{env.rank}")
    samples_per_step = args.batch_size * env.world_size
    results["storage"] = []
    try:
        for plan_name in args.plans:
            for model in args.models:
                ctx = ctx_for(plan_name, model)
                for provider in args.providers:
                    runners, tiered, promoted = {}, [], {}
                    # where the hot rows are: the first rows (Zipf over the row numbers) or
                    # scattered over the table (every row block alike)
                    hot = (IdDistribution(kind="zipf", alpha=args.zipf)
                           if args.hot_rows == "first" and args.zipf > 0
                           else IdDistribution(kind="uniform"))
                    for tier in tiers:
                        plan, tiered = tier_plan(
                            ctx.plan, tier, load_factor=args.cache_load_factor,
                            policy=args.policy, path=os.path.join(folder, tier),
                            min_rows=args.tier_min_rows, hot_budget_bytes=hot_budget,
                            stats={t.name: hot for t in ctx.plan.tables})
                        if tier.endswith("+hot"):
                            promoted[tier] = device_shards(plan, tiered)
                        runners[tier] = build(provider, dataclasses.replace(ctx, plan=plan))
                    head = f"{plan_name}/{model}/{provider}"
                    bad = _check(runners, args.check_steps, env.process_group)
                    entry: dict[str, Any] = {"plan": plan_name, "model": model,
                                             "provider": provider, "tiered_tables": tiered,
                                             "check_steps": args.check_steps}
                    if promoted:
                        entry["promoted"] = promoted
                    if any(bad.values()):
                        for tier, lines in bad.items():
                            if lines:
                                results["failed"].append(
                                    f"{head}/{tier}: not bit for bit as device after "
                                    f"{args.check_steps} steps: " + "; ".join(lines))
                        entry["check"] = bad
                        results["storage"].append(entry)
                        return results
                    entry["check"] = "bit for bit as device"
                    rounds = []
                    t0 = time.perf_counter()
                    for k in range(args.repeats):
                        order = tiers[k % len(tiers):] + tiers[: k % len(tiers)]
                        split = args.split_steps if k == args.repeats - 1 else 0
                        rounds.append(_measure_round(runners, order, args, env,
                                                     samples_per_step, split))
                    entry.update(rounds=rounds, rows=summarise(rounds, tiers, env.world_size),
                                 seconds=round(time.perf_counter() - t0, 1))
                    results["storage"].append(entry)
                    if env.rank == 0:
                        print(format_rows(f"{head}: tiered {len(tiered)} tables "
                                          f"(>= {args.tier_min_rows} rows), "
                                          f"{args.repeats} rounds", entry["rows"]), flush=True)
                        for tier, shards in promoted.items():
                            print(f"{tier}: on device {', '.join(shards) or 'none'}",
                                  flush=True)
                    runners = {}
                    release(env.device)
    finally:
        if args.path is None:
            shutil.rmtree(base, ignore_errors=True)
    return results
