"""A sharded training step, ours against TorchRec's DistributedModelParallel, in one launch.

    torchrun --standalone --nproc-per-node 2 -m fbtriton_dist.bench dist --out dist.json
    torchrun --standalone --nproc-per-node 2 -m fbtriton_dist.bench dist --tiny   # CPU, gloo
    torchrun --standalone --nproc-per-node 2 -m fbtriton_dist.bench dist --tiny --vbe 8
    torchrun --standalone --nproc-per-node 2 -m fbtriton_dist.bench dist --tiny --models dcnv2
    python -m fbtriton_dist.bench dist --plot dist.json --png dist.png            # no torchrun

The default setup: the 26 Criteo tables scaled to ~20 GB fp32 (D=128), B=8192 samples
per rank, L=20 ids per bag, Zipf(1.1) ids, rowwise Adagrad (lr 0.01, eps 1e-8); plans
``row_wise`` and ``table_wise``; models ``ebc`` (embeddings alone), ``dlrm`` and ``ec`` (the
tables as an EmbeddingCollection, a row per id; ``--models ec``) and ``dcnv2`` (MLPerf's
DLRM-dcnv2, ``dist_dcnv2``: TorchRec's ``DLRM_DCN`` against our ``DCNv2Model``, the same initial
weights; with it among the models the defaults are MLPerf's: the tables
``configs/tables/mlperf_dcnv2.yaml``, each feature's bags of its multi-hot size); providers
``torchrec``, ``ours_plain``, ``ours_lean``, ``ours_lean_bf16``, ``ours_dedup``,
``ours_fixed``, ``ours_graph`` (see ``dist_setup`` and ``dist_providers``). Every provider
trains on the same pre-generated batches (each rank its own), one provider's model at a time;
warm-up steps are not counted (``dist_measure`` says what is measured and how). Rank 0 prints a
table with the ratios against TorchRec and writes ``--out`` (JSON) after every provider, so a
crash keeps the rows measured so far. A provider that fails or cannot run here is recorded with
the reason and the run goes on; at the end the run exits non-zero if any provider failed (only
a peer that is not importable here, TorchRec or FBGEMM, may be skipped; ours never are).

``--vbe K``: every sample is one of K candidates of a user, and the first half of the tables
are user features (half of the ids at equal L): each provider trains on VBE batches (one bag
per user for those features, ``stride_per_key_per_rank`` + ``inverse_indices``) and on the same
samples as fixed batches; the rows say which (``batch``), with the ids and bytes sent and the
time per step of both (the fixed-shape providers take fixed batches only).

``--storage device,cached,file``: the tables on storage tiers against the same plan on
``device`` (our providers only; ``dist_storage`` says what is checked and measured).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from .dist_report import PROVIDERS, best_table, best_threads, format_table, line, plot, vbe_table

DEFAULT_TABLES = os.path.join(
    os.path.dirname(__file__), "..", "..", "configs", "tables", "criteo_terabyte.yaml"
)
MLPERF_TABLES = os.path.join(os.path.dirname(DEFAULT_TABLES), "mlperf_dcnv2.yaml")
PLANS = ("row_wise", "table_wise")
MODELS = ("ebc", "dlrm", "ec", "dcnv2")
FULL = {
    "total_gb": 20.0,
    "dim": 128,
    "batch_size": 8192,
    "bag_size": 20,
    "batches": 8,
    "warmup": 5,
    "steps": 20,
    "profile_steps": 5,
    "split_steps": 5,
    "dense_arch": None,
    "over_arch": "1024,1024,512,256,1",
    "low_rank": 512,
}
TINY = {
    "total_gb": 0.004,
    "dim": 16,
    "batch_size": 64,
    "bag_size": 4,
    "batches": 3,
    "warmup": 1,
    "steps": 3,
    "profile_steps": 2,  # CUDA; on the CPU 0 unless --profile-steps is given
    "split_steps": 2,
    "dense_arch": None,
    "over_arch": "32,1",
    "low_rank": 8,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m fbtriton_dist.bench dist",
        description="Sharded training step: ours vs TorchRec DMP (run under torchrun).",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="small tables, B=64, a few steps, on the CPU with gloo (CI)",
    )
    p.add_argument("--tables", help="table-set YAML, rows scaled (default criteo_terabyte.yaml; "
                   "with --models dcnv2 mlperf_dcnv2.yaml)")
    p.add_argument("--total-gb", type=float, help="weights in fp32 GB (default 20; tiny 0.004)")
    p.add_argument(
        "--scale",
        type=float,
        help="row scale factor of every table (overrides "
        "--total-gb; a table keeps at least min(E, 1000) rows)",
    )
    p.add_argument("--dim", type=int, help="D of every table (default 128; tiny 16)")
    p.add_argument("--batch-size", type=int, help="B per rank (default 8192; tiny 64)")
    p.add_argument("--bag-size", type=_bag_size,
                   help="L ids per bag, or 'tables': each feature's pooling factor in the table "
                   "set (MLPerf's multi-hot sizes; the default with --models dcnv2; else 20, "
                   "tiny 4)")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the ids (0: uniform)")
    p.add_argument(
        "--hot-rows",
        choices=["scattered", "first"],
        default="scattered",
        help="where the hot ids are: spread over the table, or its first rows",
    )
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument(
        "--dense-arch",
        help="DLRM dense arch, comma separated, ending in D (default 512,256,D; tiny 32,D)",
    )
    p.add_argument("--over-arch", help="DLRM over arch (default 1024,1024,512,256,1; tiny 32,1)")
    p.add_argument("--cross-layers", type=int, default=3, help="dcnv2: cross layers (default 3)")
    p.add_argument("--low-rank", type=int, help="dcnv2: cross rank (default 512; tiny 8)")
    p.add_argument("--lr", type=float, default=0.01, help="rowwise Adagrad learning rate")
    p.add_argument("--eps", type=float, default=1e-8, help="rowwise Adagrad eps")
    p.add_argument("--dense-lr", type=float, default=0.01, help="dense SGD learning rate")
    p.add_argument("--batches", type=int, help="distinct batches per rank, cycled (default 8)")
    p.add_argument(
        "--warmup", type=int, help="warm-up steps, not counted (default 5, at least --batches)"
    )
    p.add_argument("--steps", type=int, help="timed steps (default 20)")
    p.add_argument("--profile-steps", type=int, help="profiled steps (default 5; CPU: the "
                   "operators' self time)")
    p.add_argument("--split-steps", type=int, help="steps with stage timers (default 5)")
    p.add_argument("--plans", nargs="+", choices=PLANS, default=list(PLANS))
    p.add_argument("--models", nargs="+", choices=MODELS, default=["ebc", "dlrm"],
                   help="ebc, dlrm (default both), ec (an EmbeddingCollection: a row per id), "
                   "dcnv2 (MLPerf's DLRM-dcnv2)")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS,
                   help="default: all; with --storage ours_plain")
    p.add_argument(
        "--comm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra CommOptions field for the ours_lean* providers (repeatable)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help="default: cpu with --tiny, else auto (CUDA when available)",
    )
    p.add_argument(
        "--one-rank",
        action="store_true",
        help="allow a world of one process (a proxy for the compute when one GPU is all there "
        "is: no collective crosses a link, so it says nothing about the network)",
    )
    p.add_argument(
        "--vbe",
        type=int,
        default=1,
        metavar="K",
        help="K > 1: K candidates per user, user features (half the tables) once per user; "
        "measure VBE batches against the same samples as fixed batches",
    )
    p.add_argument("--job", help="a training job YAML (configs/jobs/quickstart.yaml): its "
                   "tables, batch, DLRM and lr (flags given win; dist_cpu)")
    p.add_argument("--threads", help="threads per rank, comma separated: each provider at each "
                   "count (default: usable cores // local ranks, the job's rule)")
    p.add_argument("--storage", metavar="TIERS",
                   help="sharded tables on storage tiers against device, e.g. "
                   "device,cached,file (bench/dist_storage.py; our providers only, default "
                   "ours_plain): checked bit for bit first, then timed in rotated rounds")
    p.add_argument("--cache-load-factor", type=float, default=0.1,
                   help="--storage: each shard's cache slots / its rows (default 0.1)")
    p.add_argument("--policy", choices=["lru", "lfu"], default="lru", help="--storage: eviction")
    p.add_argument("--tier-min-rows", type=int, default=10_000,
                   help="--storage: tables with fewer rows stay on device (default 10000)")
    p.add_argument("--check-steps", type=int, default=3,
                   help="--storage: steps of the bit-for-bit check (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="--storage: rounds (default 3)")
    p.add_argument("--path", help="--storage: the file tier's folder (default: a temporary one)")
    p.add_argument("--hot-budget-mb", type=_budgets,
                   help="--storage cached+hot / file+hot: device memory per rank (MiB) the hot "
                        "shards may fill (95 %%), promoted by the planner's rule; one number, "
                        "or one per rank, comma separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results here (JSON, rank 0)")
    p.add_argument("--plot", metavar="JSON", help="draw a results file (no torchrun, no GPU)")
    p.add_argument("--png", default="dist.png", help="where --plot writes its chart")
    args = p.parse_args(argv)
    # the long options on the command line (a job's values do not override them)
    given = {a[2:].split("=")[0].replace("-", "_")
             for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
    args.job_tables = None
    if args.job:
        from .dist_cpu import apply_job

        args.job_tables = apply_job(args, given)
    mlperf = "dcnv2" in args.models
    if args.tables is None:
        args.tables = MLPERF_TABLES if mlperf else DEFAULT_TABLES
    if args.bag_size is None and mlperf:
        args.bag_size = "tables"
    preset = TINY if args.tiny else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = "cpu" if args.tiny else "auto"
    if args.tiny and args.device == "cpu" and "profile_steps" not in given:
        args.profile_steps = 0  # CI: the CPU profile (dist_cpu) only when asked for
    args.dense_arch = (
        _ints(args.dense_arch)
        if args.dense_arch
        else ([32, args.dim] if args.tiny else [512, 256, args.dim])
    )
    args.over_arch = _ints(args.over_arch)
    if args.cross_layers < 0 or args.low_rank < 1:
        p.error(f"--cross-layers, --low-rank: expected >= 0 and >= 1, got {args.cross_layers}, "
                f"{args.low_rank}")
    if args.vbe < 1:
        p.error(f"--vbe: expected K >= 1 candidates per user, got {args.vbe}")
    if args.dense_arch[-1] != args.dim:
        p.error(f"--dense-arch must end in D={args.dim}, got {args.dense_arch}")
    args.comm_extra = dict(_comm_item(p, item) for item in args.comm)
    _storage_args(p, args)
    return args


def _storage_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--storage``'s tiers, and the providers: ours only (default ``ours_plain``)."""
    if args.storage is None:
        args.providers = args.providers or list(PROVIDERS)
        return
    from .dist_storage import parse_tiers

    try:
        args.storage = parse_tiers(args.storage)
    except ValueError as e:
        p.error(str(e))
    args.providers = args.providers or ["ours_plain"]
    if "torchrec" in args.providers or args.vbe > 1:
        p.error("--storage: expected our providers on fixed batches, got "
                f"--providers {' '.join(args.providers)} --vbe {args.vbe}")
    hot = [t for t in args.storage if t.endswith("+hot")]
    if hot and args.hot_budget_mb is None:
        p.error(f"--storage {','.join(hot)}: expected --hot-budget-mb (device memory per "
                "rank the hot shards may fill), got none")
    if not 0 < args.cache_load_factor <= 1 or min(args.repeats, args.check_steps) < 1:
        p.error("--storage: expected --cache-load-factor in (0, 1], --repeats and "
                f"--check-steps >= 1, got {args.cache_load_factor}, {args.repeats}, "
                f"{args.check_steps}")


def _budgets(text: str) -> list[float]:
    """``--hot-budget-mb``: MiB > 0, one number or one per rank, comma separated."""
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or not all(0 < x < float("inf") for x in out):
        raise argparse.ArgumentTypeError(f"expected MiB > 0, one or one per rank comma "
                                         f"separated, got {text!r}")
    return out


def _bag_size(text: str) -> int | str:
    if text == "tables":
        return text
    try:
        L = int(text)
    except ValueError:
        L = -1
    if L < 0:
        raise argparse.ArgumentTypeError(f"expected ids per bag >= 0 or 'tables', got {text!r}")
    return L


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _comm_item(p: argparse.ArgumentParser, item: str) -> tuple[str, Any]:
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key:
        p.error(f"--comm: expected KEY=VALUE, got {item!r}")
    if value in ("bfloat16", "float16", "float32"):
        import torch

        return key, getattr(torch, value)
    return key, yaml.safe_load(value)


# -- the run ----------------------------------------------------------------------------------
def quiet() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    for name in ("torchrec", "torch.fx._symbolic_trace", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _versions(device) -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for mod in ("torchrec", "fbgemm_gpu", "triton"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a version is informational
            out[mod] = f"not importable ({type(e).__name__})"
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - informational
            out["nccl"] = f"? ({type(e).__name__})"
    return out


def run(args: argparse.Namespace, env) -> dict[str, Any]:
    """Measure every (plan, model, provider) on this rank; rank 0 returns (and writes) all."""

    from .dist_cpu import set_threads, thread_counts
    from .dist_providers import LEAN_OPTIONS, Context
    from .dist_setup import (
        ModelSpec,
        fixed_copies,
        fixed_grad,
        fixed_row_grad,
        make_batches,
        make_plan,
        scaled_tables,
        torchrec_bytes,
        torchrec_configs,
        torchrec_sequence_configs,
    )

    R, rank, device = env.world_size, env.rank, env.device
    H = env.local_world_size if R % env.local_world_size == 0 else R
    tables = args.job_tables or scaled_tables(args.tables, args.dim, args.total_gb, args.scale)
    configs = torchrec_configs(tables)
    bags = [t.bag_size for t in tables] if args.bag_size == "tables" else [args.bag_size] * len(
        tables)
    t0 = time.perf_counter()
    batches = make_batches(
        tables,
        n=args.batches,
        B=args.batch_size,
        L=bags,
        alpha=args.zipf,
        num_dense=args.num_dense,
        seed=args.seed,
        rank=rank,
        device=device,
        scatter=args.hot_rows == "scattered",
        candidates_per_user=args.vbe,
    )
    by_batch = {"fixed": batches} if args.vbe == 1 else {"vbe": batches,
                                                          "fixed": fixed_copies(batches)}
    grad = fixed_grad(tables, args.batch_size, args.seed, rank, device)
    weights_gb = sum(t.num_embeddings * t.embedding_dim for t in tables) * 4 / 1e9
    results: dict[str, Any] = {
        "setup": {
            "command": " ".join(sys.argv),
            "world_size": R,
            "local_world_size": H,
            "device": str(device),
            "backend": "nccl" if device.type == "cuda" else "gloo",
            "tables": len(tables),
            "rows": [t.num_embeddings for t in tables],
            "dim": args.dim,
            "weights_gb": weights_gb,
            "scale": args.scale,
            "batch_size_per_rank": args.batch_size,
            "bag_size": args.bag_size,
            "bag_sizes": bags,
            "ids_per_sample": sum(bags),
            "zipf": args.zipf,
            "hot_rows": args.hot_rows,
            "candidates_per_user": args.vbe,
            "user_tables": len(tables) // 2 if args.vbe > 1 else 0,
            "optimizer": {"type": "rowwise_adagrad", "lr": args.lr, "eps": args.eps},
            "dense": {
                "num_dense": args.num_dense,
                "dense_arch": args.dense_arch,
                "over_arch": args.over_arch,
                "cross_layers": args.cross_layers,
                "low_rank": args.low_rank,
                "optimizer": f"sgd lr {args.dense_lr}",
            },
            "warmup": args.warmup,
            "steps": args.steps,
            "profile_steps": args.profile_steps,
            "split_steps": args.split_steps,
            "distinct_batches": args.batches,
            "comm_extra": {k: str(v) for k, v in args.comm_extra.items()},
            "data_s": round(time.perf_counter() - t0, 3),
            "versions": _versions(device),
        },
        "rows": [],
        "failed": [],
    }
    _say(
        env,
        f"bench dist: {len(tables)} tables, {weights_gb:.3g} GB fp32, D={args.dim}, "
        f"B={args.batch_size}/rank, L={args.bag_size} ({sum(bags)} ids a sample), "
        f"zipf {args.zipf}, {R} ranks on "
        f"{device.type}; {args.warmup} warm-up + {args.steps} timed steps",
    )
    counts = thread_counts(args.threads, H) if device.type == "cpu" else [None]
    results["setup"]["threads_per_rank"] = counts

    def context(plan_name: str, kind: str, batch_kind: str = "fixed") -> Context:
        spec = ModelSpec(
            kind=kind,
            num_dense=args.num_dense,
            dense_arch=tuple(args.dense_arch),
            over_arch=tuple(args.over_arch),
            cross_layers=args.cross_layers,
            low_rank=args.low_rank,
        )
        row_grad = fixed_row_grad(tables, args.batch_size, max(1, sum(bags) // len(bags)),
                                  args.seed, rank, device)
        return Context(
            tables=tables,
            configs=torchrec_sequence_configs(tables) if kind == "ec" else configs,
            plan=make_plan(plan_name, tables, R, H),
            spec=spec,
            batches=by_batch[batch_kind],
            grad={"ebc": grad, "ec": row_grad}.get(kind),
            device=device,
            group=env.process_group,
            seed=args.seed,
            lr=args.lr,
            eps=args.eps,
            dense_lr=args.dense_lr,
            comm_extra=args.comm_extra,
        )

    if args.storage:  # tiers against device (bench/dist_storage.py)
        from .dist_storage import run_storage

        results["setup"]["storage"] = {
            "tiers": args.storage, "cache_load_factor": args.cache_load_factor,
            "policy": args.policy, "tier_min_rows": args.tier_min_rows,
            "check_steps": args.check_steps, "repeats": args.repeats,
            "hot_budget_mb": args.hot_budget_mb, "load_1min": os.getloadavg()[0]}
        run_storage(args, env, context, results)
        if rank == 0:
            results["setup"]["total_s"] = round(time.perf_counter() - t0, 1)
            results["setup"]["load_1min_end"] = os.getloadavg()[0]
            _write(args.out, results)
        return results
    for plan_name in args.plans:
        for kind, batch_kind in ((k, b) for k in args.models for b in by_batch):
            if kind == "ec" and batch_kind == "vbe":
                continue  # a sequence collection's batches have one stride
            ctx = context(plan_name, kind, batch_kind)
            plan = ctx.plan
            estimate = torchrec_bytes(ctx.batches[0], plan, tables, rank, sequence=kind == "ec")
            for threads in counts:
                thread_info = set_threads(threads, H) if device.type == "cpu" else {}
                group_rows = []  # ratios at one thread count
                for provider in args.providers:
                    if batch_kind == "vbe" and LEAN_OPTIONS.get(provider, {}).get("fixed_shapes"):
                        continue  # fixed message sizes take fixed batches only
                    if kind == "ec" and LEAN_OPTIONS.get(provider, {}).get("fixed_shapes"):
                        continue  # the sequence output dist has no fixed-shape mode
                    row = _run_one(provider, ctx, args, env, estimate)
                    row["batch"] = batch_kind
                    row.update(thread_info)
                    group_rows.append(row)
                    if failure(row):
                        results["failed"].append(failure(row))
                    if rank == 0:
                        results["rows"].append(row)
                        _ratios(group_rows)
                        _say(env, line(row))
                        _write(args.out, results)
    if rank == 0:
        results["setup"]["total_s"] = round(time.perf_counter() - t0, 1)
        results["best_threads"] = best_threads(results["rows"])
        print(format_table(results["rows"]), flush=True)
        if len(counts) > 1:
            print(best_table(results["best_threads"]), flush=True)
        if args.vbe > 1:
            print(vbe_table(results["rows"]), flush=True)
        print(f"total {results['setup']['total_s']:.0f} s", flush=True)
        _write(args.out, results)
        if args.out:
            print(f"results written to {args.out}", flush=True)
    return results


def failure(row: dict[str, Any]) -> str | None:
    """Why ``row`` fails the run, or None: an error of any provider, or a skip of one of ours
    (only a peer that is not importable may be skipped)."""
    if row["status"] == "ok" or (row["status"] == "skipped" and row["provider"] == "torchrec"):
        return None
    return f"{row['plan']}/{row['model']}/{row['provider']}: {row['status']}: {row.get('note')}"


def _say(env, text: str) -> None:
    if env.rank == 0:
        print(text, flush=True)


def _write(path: str | None, results: dict) -> None:
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


def _run_one(provider: str, ctx, args, env, estimate: dict[str, float]) -> dict[str, Any]:
    """Build, measure and free one provider on this rank; every rank's numbers merged."""
    import torch
    import torch.distributed as dist

    from .dist_measure import measure
    from .dist_providers import Skip, build, release

    device = env.device
    local: dict[str, Any] = {"status": "ok", "note": ""}
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        mem0 = torch.cuda.memory_allocated(device)
    runner = None
    try:
        runner = build(provider, ctx)
        if device.type == "cuda":
            local["model_mem_gb"] = (torch.cuda.memory_allocated(device) - mem0) / 1e9
        local["loop"] = runner.loop
        local.update(
            measure(
                runner,
                # one pass over the distinct batches at least: a new batch shape can compile
                warmup=max(args.warmup, args.batches),
                steps=args.steps,
                profile_steps=args.profile_steps,
                split=args.split_steps,
                device=device,
                group=env.process_group,
            )
        )
        local["bytes"] = _bytes(local, provider, estimate, runner.dense_numel, env.world_size)
    except Skip as e:
        local.update(status="skipped", note=str(e))
    except Exception as e:  # noqa: BLE001 - recorded; the other providers still run
        local.update(
            status="error",
            note=f"{type(e).__name__}: {e}"[:800],
            traceback=traceback.format_exc()[-3000:],
        )
    finally:
        runner = None
        release(device)
    local["seconds"] = round(time.perf_counter() - t0, 2)
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, local, group=env.process_group)
    return merge(
        provider,
        ctx.plan.tables[0].sharding,
        ctx.spec.kind,
        gathered,
        samples_per_step=args.batch_size * env.world_size,
        steps=args.steps,
    )


def _bytes(
    local: dict, provider: str, estimate: dict[str, float], dense_numel: int, R: int
) -> dict[str, float]:
    """Bytes this rank sends per step, per collective: our comm_report, or (TorchRec) the
    estimate; plus the dense gradients' ring all-reduce (2 (R-1)/R of them)."""
    report = local.pop("comm_report", None)
    if provider == "torchrec" or report is None:
        out = dict(estimate)
        local["bytes_source"] = "estimate"
    else:
        out = {
            k: float(v["sent"])
            for k, v in report.items()
            if "sent" in v and not k.endswith(("total", "inter_host"))
        }
        out = {k: v for k, v in out.items() if v}
        local["bytes_source"] = "comm_report"
        local["comm_report"] = report
        local["ids_sent"] = float(report["input_dist.data"].get("ids_sent", 0.0))
    if dense_numel:
        out["dense.all_reduce"] = 2.0 * (R - 1) / R * dense_numel * 4
    return out


def merge(
    provider: str, plan: str, model: str, ranks: list[dict], *, samples_per_step: int, steps: int
) -> dict[str, Any]:
    """One row from every rank's numbers: the slowest rank's time, summed bytes, max memory."""
    row: dict[str, Any] = {"plan": plan, "model": model, "provider": provider}
    bad = [r for r in ranks if r["status"] != "ok"]
    if bad:
        row["status"] = "error" if any(r["status"] == "error" for r in bad) else "skipped"
        row["note"] = bad[0]["note"]
        if "traceback" in bad[0]:
            row["traceback"] = bad[0]["traceback"]
        return row
    r0 = ranks[0]
    elapsed = max(r["elapsed_s"] for r in ranks)
    row.update(status="ok", loop=r0.get("loop"), seconds=max(r["seconds"] for r in ranks))
    row["samples_per_s"] = samples_per_step * steps / elapsed if elapsed > 0 else None
    row["samples_per_s_per_rank"] = row["samples_per_s"] and row["samples_per_s"] / len(ranks)
    row["ms_per_step"] = max(r["ms_per_step_median"] for r in ranks)
    row["ms_per_step_per_rank"] = [r["ms_per_step_median"] for r in ranks]
    row["cpu_ms_per_step_per_rank"] = [r.get("cpu_ms_per_step") for r in ranks]
    row["stages_ms"] = r0.get("stages_ms", {})
    row["stages_ms_per_rank"] = [r.get("stages_ms", {}) for r in ranks]
    if all("gpu" in r for r in ranks):
        gpu = {k: max(r["gpu"].get(k, 0.0) for r in ranks) for k in r0["gpu"] if k != "top"}
        if gpu.get("busy_ms"):
            gpu["wall_over_busy"] = row["ms_per_step"] / gpu["busy_ms"]
            gpu["busy_fraction"] = gpu["busy_ms"] / row["ms_per_step"]
        row["gpu"] = gpu
        row["gpu_per_rank"] = [r["gpu"] for r in ranks]
    if all("cpu_profile" in r for r in ranks):
        row["cpu_profile_per_rank"] = [r["cpu_profile"] for r in ranks]
    errors = [r["gpu_error"] for r in ranks if "gpu_error" in r]
    if errors:
        row["gpu_error"] = errors[0]
    keys = list(dict.fromkeys(k for r in ranks for k in r["bytes"]))
    row["bytes_sent"] = {k: sum(r["bytes"].get(k, 0.0) for r in ranks) for k in keys}
    row["bytes_sent_per_step"] = sum(row["bytes_sent"].values())
    row["bytes_source"] = r0.get("bytes_source")
    if all("ids_sent" in r for r in ranks):
        row["ids_sent_per_step"] = sum(r["ids_sent"] for r in ranks)
    if "comm_report" in r0:
        row["comm_report_rank0"] = r0["comm_report"]
    if all("peak_mem_gb" in r for r in ranks):
        row["peak_mem_gb"] = max(r["peak_mem_gb"] for r in ranks)
        row["model_mem_gb"] = max(r.get("model_mem_gb", 0.0) for r in ranks)
    row["losses"] = r0["losses"]
    row["losses_per_rank"] = [r["losses"] for r in ranks]
    row["warmup_losses_per_rank"] = [r.get("warmup_losses", []) for r in ranks]
    row["step_ms_rank0"] = r0["step_ms"]
    return row


def _ratios(rows: list[dict]) -> None:
    """``vs_torchrec`` and ``vs_plain``: samples/s over TorchRec's / ours_plain's (same group)."""
    by = {r["provider"]: r.get("samples_per_s") for r in rows if r.get("status") == "ok"}
    for r in rows:
        if r.get("status") != "ok":
            continue
        for key, base in (("vs_torchrec", "torchrec"), ("vs_plain", "ours_plain")):
            if by.get(base):
                r[key] = r["samples_per_s"] / by[base]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return
    if args.one_rank and "MASTER_ADDR" not in os.environ:
        raise SystemExit("bench dist --one-rank: run it under torchrun, e.g. torchrun "
                         "--standalone --nproc-per-node 1 -m fbtriton_dist.bench dist --one-rank")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2 and not args.one_rank:
        raise SystemExit(
            "bench dist compares sharded steps: run it under torchrun with 2 or more processes, "
            "e.g. torchrun --standalone --nproc-per-node 2 -m fbtriton_dist.bench dist --tiny"
        )
    quiet()
    from fbtriton_dist.train.job import distributed

    with distributed(args.device, group_of_one=args.one_rank) as env:
        results = run(args, env)
        rank = env.rank
    if results["failed"]:  # every rank exits non-zero; rank 0 says why
        lines = "".join(f"\n  {f}" for f in results["failed"])
        raise SystemExit(f"bench dist: {len(results['failed'])} failed:{lines}" if rank == 0 else 1)


if __name__ == "__main__":
    main()
