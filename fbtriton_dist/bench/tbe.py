"""TBE benchmark: our TableBatchedEmbedding vs FBGEMM's TBE, TorchRec and torch.

    python -m fbtriton_dist.bench tbe --out tbe.json            # S0..S6, every provider (GPU)
    python -m fbtriton_dist.bench tbe --device cpu              # C0, C1: the fast CPU path
    python -m fbtriton_dist.bench tbe --device cpu --zipf 0,1.1 # each with uniform, Zipf ids
    python -m fbtriton_dist.bench tbe --tiny --device cpu       # CI: tiny shapes, CPU providers
    python -m fbtriton_dist.bench tbe --plot tbe.json --png tbe.png   # chart, no GPU needed

Providers: ``ours`` (backend "auto": Triton on CUDA, the fast CPU path on CPU;
bounds_check="warn"), ``ours_graph`` (the same module's whole
step replayed from a CUDA graph by ``fbtriton_dist.graphs.GraphedStep``: the batch copied in
and one replay per call, timed like every provider, host included; on CPU it falls back to
eager, labelled in the rows' ``note``), ``ours_checked`` (bounds_check="error",
synchronous), ``reference`` (the same module on the PyTorch reference), ``torchrec``
(TorchRec's unsharded EmbeddingBagCollection on a KeyedJaggedTensor, dense grads + torch.optim;
CPU), ``torch_pt``
(F.embedding_bag per table + cat; dense grad + torch.optim), ``torch_fused`` (one concatenated
table per distinct D, shifted ids; dense grad + torch.optim), ``torch_pt_sparse`` /
``torch_fused_sparse`` (sparse=True grads + index_add_ for SGD, torch.optim.Adagrad on the sparse
grad), ``fbgemm`` (SplitTableBatchedEmbeddingBagsCodegen, when importable: its CUDA TBE, or
on ``--device cpu`` its CPU TBE).
Phases: ``fwd`` (a training forward), ``fwd_bwd_sgd``, ``fwd_bwd_rowwise_adagrad`` (fused
providers update inside backward; torch ones run backward + step + zero_grad; torch's Adagrad is
per-element). ``bwd`` = fwd_bwd - fwd is printed as derived.

Per (shape, provider, phase): median ms (L2 flushed, CUDA events), pipelined ms, GPU-busy ms
(profiler), effective GB/s with the byte count beside it (BASELINES.md's model), % of the copy
bandwidth measured in this process, speedup against every other provider, peak memory, and for
``ours``/``fbgemm`` the per-kernel µs/iter. Method: ../shared/tools/fbgemm-sm90/BASELINES.md.

Correctness comes before timing, per shape: ``--check`` (each timed provider of ours, with the
backend it is timed on, vs the reference on the timed batch at the shape's size, for each timed
phase: the forward, 3 fused SGD or rowwise-Adagrad steps; ``tbe_cases.check``) and, when
``fbgemm`` is a provider, ours vs FBGEMM on the same weights (forward, one SGD step;
``--no-compare`` leaves it out). A check that differs beyond its tolerance, or raises, stops
the run with exit status 1 before that shape is timed, naming the shape, the provider, what
differs and by how much.
"""

import argparse
import dataclasses
import json
import sys
import time
from typing import NoReturn

import torch

from fbtriton_dist.bench.tbe_cases import (
    ALIASES,
    DEFAULT_PROVIDERS,
    DEFAULT_SHAPES,
    FWD_OF,
    KERNEL_TABLE_PROVIDERS,
    OURS_MODULES,
    PHASES,
    PROVIDERS,
    SHAPES,
    Batch,
    Context,
    Shape,
    _free,
    check,
    compare_with_fbgemm,
    import_fbgemm,
    make_batch,
    model_bytes,
    output_size,
    provider_cases,
)
from fbtriton_dist.bench.timing import Timer, TimerConfig, copy_bandwidth

__all__ = ["SHAPES", "PHASES", "PROVIDERS", "Batch", "Shape", "make_batch", "model_bytes", "main"]


# ---------------------------------------------------------------- driver


def run_shape(ctx: Context, providers: list[str], timer: Timer, copy_gbs: float) -> list[dict]:
    rows = []
    for provider in providers:
        base = dict(shape=ctx.shape.name, provider=provider)
        done: set[str] = set()
        cases = provider_cases(provider, ctx)
        while True:
            try:
                phase, fn = next(cases)
            except StopIteration:
                break
            except Exception as e:  # building the module failed: the remaining phases fail
                missing = isinstance(e, ImportError)  # a peer that is not installed
                msg = f"{type(e).__name__}: {e}"
                print(f"  {provider}: {'skipped' if missing else 'ERROR'} {msg}", flush=True)
                for phase in ctx.phases:
                    if phase not in done and not (phase == "fwd" and provider in FWD_OF):
                        what = {"skipped": f"skipped: not importable: {e}"} if missing else {
                            "error": msg}
                        rows.append(dict(base, phase=phase, **what))
                break
            done.add(phase)
            if isinstance(fn, str):
                print(f"  {provider} {phase}: {fn}", flush=True)
                rows.append(dict(base, phase=phase, skipped=fn))
                continue
            nbytes = model_bytes(ctx.shape, ctx.batch, phase, output_size(provider, ctx.shape))
            t0 = time.perf_counter()
            try:
                r = timer.measure(fn)
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"  {provider} {phase}: ERROR {msg}", flush=True)
                rows.append(dict(base, phase=phase, error=msg))
                _free()
                continue
            row = dict(base, phase=phase, bytes=nbytes, **r)
            if getattr(fn, "note", None):
                row["note"] = fn.note
            for when in ("busy", "median"):
                gbs = nbytes / row[f"{when}_ms"] / 1e6
                row[f"gbs_{when}"] = gbs
                row[f"pct_copy_{when}"] = 100 * gbs / copy_gbs
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(
                f"  {provider:<18} {phase:<24} busy {row['busy_ms']:9.3f} ms  "
                f"median {row['median_ms']:9.3f} ms  ({row['wall_s']:.1f} s)"
                + (f"  [{row['note']}]" if "note" in row else ""),
                flush=True,
            )
        cases.close()
        # the last step closure still holds the module: drop it before building the next one
        fn = cases = None  # noqa: F841
        _free()
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[dict]) -> None:
    """ratios[other] = {busy, median}: other's time / this one's (> 1: this one is faster)."""
    ok = [r for r in rows if r.get("busy_ms")]
    for r in ok:
        r["ratios"] = {
            o["provider"]: {
                "busy": o["busy_ms"] / r["busy_ms"],
                "median": o["median_ms"] / r["median_ms"],
            }
            for o in ok
            if o["phase"] == r["phase"] and o["provider"] != r["provider"]
        }


def derived_bwd(rows: list[dict]) -> list[dict]:
    """bwd_<opt> = fwd_bwd_<opt> - fwd of the same provider (or the provider whose forward it
    shares), GPU-busy and median."""
    fwd = {(r["shape"], r["provider"]): r for r in rows if r["phase"] == "fwd" and r.get("busy_ms")}
    out = []
    for r in rows:
        if not r["phase"].startswith("fwd_bwd_") or not r.get("busy_ms"):
            continue
        f = fwd.get((r["shape"], FWD_OF.get(r["provider"], r["provider"])))
        if f is None:
            continue
        out.append(
            dict(
                shape=r["shape"],
                provider=r["provider"],
                phase="bwd_" + r["phase"].removeprefix("fwd_bwd_"),
                busy_ms=r["busy_ms"] - f["busy_ms"],
                median_ms=r["median_ms"] - f["median_ms"],
            )
        )
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_shape_table(rows: list[dict], derived: list[dict], source: str) -> None:
    busy = "GPU-busy" if source == "profiler" else "busy=wall"
    print(
        f"  {'phase':<30} {'provider':<18} {'median ms':>9} {'pipe ms':>8} {busy + ' ms':>12} "
        f"{'bytes MB':>9} {'GB/s@busy':>9} {'%copy':>6} {'GB/s@med':>8} {'%copy':>6} "
        f"{'peak GB':>7}  speedup vs others (busy/median)"
    )
    for phase in PHASES:
        for r in [r for r in rows if r["phase"] == phase]:
            head = f"  {phase:<30} {r['provider']:<18}"
            if not r.get("busy_ms"):
                print(f"{head} {r.get('error') or r.get('skipped')}")
                continue
            ratios = " ".join(
                f"{k} {v['busy']:.2f}/{v['median']:.2f}" for k, v in r.get("ratios", {}).items()
            )
            print(
                f"{head} {r['median_ms']:9.3f} {_fmt(r['pipelined_ms'], '8.3f')} "
                f"{r['busy_ms']:12.3f} {r['bytes'] / 1e6:9.1f} {r['gbs_busy']:9.0f} "
                f"{r['pct_copy_busy']:6.1f} {r['gbs_median']:8.0f} {r['pct_copy_median']:6.1f} "
                f"{_fmt(r['peak_gb'], '7.2f')}  {ratios}"
            )
    for d in derived:
        print(
            f"  {d['phase'] + ' (derived)':<30} {d['provider']:<18} {d['median_ms']:9.3f} "
            f"{'':>8} {d['busy_ms']:12.3f}  = fwd_bwd - fwd"
        )


def print_vs_fbgemm(rows: list[dict]) -> None:
    """One line per phase: FBGEMM's end-to-end median over ours (eager) and ours_graph's."""
    for phase in PHASES:
        got = {r["provider"]: r for r in rows if r["phase"] == phase and r.get("median_ms")}
        fb = got.get("fbgemm")
        ours = [p for p in ("ours", "ours_graph") if p in got]
        if fb is None or not ours:
            continue
        parts = [
            f"{p} {got[p]['median_ms']:.3f} ms = {fb['median_ms'] / got[p]['median_ms']:.2f}x"
            + (f" [{got[p]['note']}]" if "note" in got[p] else "")
            for p in ours
        ]
        print(
            f"  e2e median ({'wall' if fb.get('busy_source') == 'wall' else 'L2 flushed'}, host "
            f"included) {phase}: fbgemm {fb['median_ms']:.3f} ms; "
            + "; ".join(parts)
        )


def print_kernels(rows: list[dict], top: int = 12) -> None:
    for r in rows:
        if r["provider"] not in KERNEL_TABLE_PROVIDERS or not r.get("kernels"):
            continue
        total = sum(r["kernels"].values())
        print(
            f"  kernels {r['provider']} {r['phase']}: GPU-busy {1e3 * r['busy_ms']:.1f} µs/iter, "
            f"sum of device activities {total:.1f} µs/iter"
        )
        items = list(r["kernels"].items())
        for name, us in items[:top]:
            print(f"    {us:9.1f} µs  {name[:110]}")
        if len(items) > top:
            rest = sum(us for _, us in items[top:])
            print(f"    {rest:9.1f} µs  ({len(items) - top} more)")


def _versions(providers: list[str]) -> dict:
    out = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:  # pragma: no cover - triton is a dependency
        out["triton"] = f"unavailable: {e}"
    if "fbgemm" in providers:
        try:
            import fbgemm_gpu

            out["fbgemm_gpu"] = getattr(fbgemm_gpu, "__version__", "?")
        except Exception as e:
            out["fbgemm_gpu"] = f"not importable: {type(e).__name__}: {e}"
    return out


def _select(names: str | None, default: list[str], valid, what: str) -> list[str]:
    if names is None:
        return list(default)
    out = []
    for n in names.split(","):
        n = n.strip()
        expanded = ALIASES.get(n, [n]) if what == "providers" else [n]
        for x in expanded:
            if x not in valid:
                raise SystemExit(f"--{what}: expected names from {list(valid)}, got {n!r}")
            if x not in out:
                out.append(x)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="python -m fbtriton_dist.bench tbe", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--shapes", default=None,
        help=f"comma list of {list(SHAPES)} (default: S* on CUDA, C* on CPU; every one --tiny)",
    )
    p.add_argument("--providers", default=None, help=f"comma list of {list(PROVIDERS)} or torch")
    p.add_argument("--phases", default=None, help=f"comma list of {list(PHASES)}")
    p.add_argument("--tiny", action="store_true", help="E<=1000, B<=8, T<=2 (CPU, CI)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--check",
        action="store_true",
        help="first, per shape, each timed provider of ours (its backend: Triton on CUDA, the "
        "native kernels on the CPU) vs the reference on each timed phase; a mismatch stops the "
        "run (exit 1) untimed",
    )
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="skip ours-vs-fbgemm correctness (run when fbgemm is a provider; a mismatch stops "
        "the run, exit 1, before the shape is timed)",
    )
    p.add_argument(
        "--dense-limit-gb",
        type=float,
        default=60.0,
        help="skip torch modes whose weights + dense grad/state exceed this",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=None, help="timed iterations (10 GPU, 5 CPU)")
    p.add_argument("--min-iters", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=1.5, help="per timed loop, after min-iters")
    p.add_argument("--pipelined", type=int, default=None)
    p.add_argument("--profiled", type=int, default=5)
    p.add_argument("--pooling", choices=["sum", "none"], default="sum",
                   help="none: sequence lookups, one output row per id (FBGEMM's NONE, torch's "
                   "F.embedding)")
    p.add_argument("--zipf", default=None,
                   help="comma list of Zipf exponents (0: uniform ids): each shape runs once per "
                   "exponent, named e.g. C0@zipf1.1 (default: each shape's own ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 with --tiny on CPU)")
    p.add_argument("--out", default=None, help="write everything as JSON here")
    p.add_argument("--plot", default=None, metavar="JSON", help="only plot this JSON (no GPU)")
    p.add_argument("--png", default=None, help="where --plot writes (default JSON's name .png)")
    return p.parse_args(argv)


def _exponents(raw: str) -> list[float]:
    try:
        values = [float(x) for x in raw.split(",")]
    except ValueError:
        values = [-1.0]
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"--zipf: expected a comma list of exponents >= 0, got {raw!r}")
    return values


def _with_ids(shape: Shape, zipf: float) -> Shape:
    """``shape`` with Zipf(``zipf``) ids (0: uniform), named for them."""
    name = f"{shape.name}@{f'zipf{zipf:g}' if zipf else 'uniform'}"
    return dataclasses.replace(shape, name=name, zipf=zipf or None)


def run(args: argparse.Namespace) -> dict:
    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> dict:
    dev_name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(dev_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny)")
    default_shapes = DEFAULT_SHAPES[device.type] if not args.tiny else list(SHAPES)
    shapes = [SHAPES[n] for n in _select(args.shapes, default_shapes, SHAPES, "shapes")]
    if args.tiny:
        shapes = [s.tiny() for s in shapes]
    shapes = [dataclasses.replace(s, pooling=args.pooling) for s in shapes]
    if args.zipf:
        shapes = [_with_ids(s, z) for s in shapes for z in _exponents(args.zipf)]
    providers = _select(args.providers, DEFAULT_PROVIDERS[device.type], PROVIDERS, "providers")
    phases = _select(args.phases, list(PHASES), PHASES, "phases")
    cpu = device.type == "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    elif cpu and args.tiny:  # tiny ops: one thread avoids OpenMP spin-waits on a shared CPU
        torch.set_num_threads(1)
    cfg = TimerConfig(
        warmup=args.warmup,
        iters=args.iters if args.iters is not None else (5 if cpu else 10),
        min_iters=args.min_iters if args.min_iters is not None else (2 if cpu else 5),
        budget_s=args.budget_s,
        pipelined=args.pipelined if args.pipelined is not None else (3 if cpu else 10),
        profiled=args.profiled,
    )
    report = {
        "device": torch.cuda.get_device_name(device) if not cpu else "cpu",
        "threads": torch.get_num_threads(),
        **_versions(providers),
        "args": vars(args),
        "timer": dataclasses.asdict(cfg),
        "providers": providers,
        "phases": phases,
        "method": (
            "median: L2 flushed (256 MB rewrite) + sync before each CUDA-event-timed iteration; "
            "pipelined: back-to-back / N; busy: union of device activity (torch profiler) / N"
            if not cpu
            else "CPU: all times are wall time (no L2 flush, no profiler GPU-busy: busy = median)"
        ),
        "shapes": {},
        "rows": [],
        "derived": [],
        "correctness": {},
        "check": {},
    }
    if cpu:  # what provider ours runs on the CPU
        from fbtriton_dist.ops import cpu_native  # noqa: PLC0415

        report["cpu_path"] = cpu_native.describe()
        print(f"CPU path: {report['cpu_path']}", flush=True)
    t_run = time.perf_counter()
    report.update(copy_bandwidth(device))
    copy_gbs = report["copy_gbs"]
    print(
        f"device {report['device']}, torch {report['torch']}, triton {report.get('triton')}"
        f"{', fbgemm_gpu ' + report['fbgemm_gpu'] if 'fbgemm_gpu' in report else ''}; "
        f"copy {copy_gbs:.0f} GB/s ({report['copy_bytes'] / 1e9:.1f} GB, read + write)\n"
        f"timing: {report['method']}; ours = bounds_check='warn', ours_checked = 'error'",
        flush=True,
    )
    timer = Timer(device, cfg)
    for shape in shapes:
        print(f"\n== {shape.name}: {shape.describe()}", flush=True)
        try:
            batch = make_batch(shape, device, args.seed)
        except Exception as e:
            report["shapes"][shape.name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  batch: ERROR {e}")
            continue
        fp32_bytes = sum(E * D for E, D in shape.tables) * 4
        if args.check and 2 * fp32_bytes > args.dense_limit_gb * 1e9:
            report["check"][shape.name] = {
                "skipped": f"two fp32 modules need {2 * fp32_bytes / 1e9:.1f} GB "
                f"> --dense-limit-gb {args.dense_limit_gb:g}"
            }
            print(f"  check vs reference: {report['check'][shape.name]['skipped']}")
        elif args.check:
            checked = [p for p in providers if p in OURS_MODULES]
            try:
                res = check(shape, batch, device, providers, phases)
            except Exception as e:
                msg = f"{type(e).__name__}: {str(e)[:500]}"
                res = {"error": msg, "ok": False, "failures": [f"the check raised {msg}"]}
                _free()
            report["check"][shape.name] = res
            print(f"  check {','.join(checked) or 'nothing (no provider of ours timed)'} vs "
                  f"reference: {json.dumps(res)}", flush=True)
            if not res["ok"]:
                what = f"provider {','.join(checked)} (backend='auto') vs the reference backend"
                _refuse(report, args, shape, what, res["failures"])
        ctx = Context(shape, batch, device, phases, args.dense_limit_gb)
        report["shapes"][shape.name] = {
            "describe": shape.describe(),
            "tables": shape.tables if len(set(shape.tables)) > 1 else [shape.tables[0]],
            "T": len(shape.tables),
            "B": shape.B,
            "L": shape.L,
            "dtype": str(shape.dtype),
            "zipf": shape.zipf,
            "N": sum(batch.lookups),
            "U": sum(batch.unique),
            "weight_bytes": shape.weight_bytes,
        }
        print(
            f"  N={sum(batch.lookups):,} lookups, U={sum(batch.unique):,} unique rows, "
            f"weights {shape.weight_bytes / 1e9:.2f} GB",
            flush=True,
        )
        ours_like = next((p for p in ("ours", "reference") if p in providers), None)
        if args.pooling == "none" and "fbgemm" in providers and not args.no_compare:
            report["correctness"][shape.name] = {
                "skipped": "pooling none: ours vs FBGEMM's NONE pooling is a CI test "
                "(tests/modules/test_tbe_vs_fbgemm.py)"}
        elif "fbgemm" in providers and ours_like and not args.no_compare:
            backend = "auto" if ours_like == "ours" else "reference"
            try:
                import_fbgemm()
            except ImportError as e:  # a peer that is not installed: no comparison, say why
                res = {"skipped": f"fbgemm_gpu is not importable: {e}"}
            else:
                try:
                    res = compare_with_fbgemm(ctx, backend)
                except Exception as e:
                    msg = f"{type(e).__name__}: {str(e)[:500]}"
                    res = {"error": msg, "ok": False, "failures": [f"the comparison raised {msg}"]}
                    _free()
            report["correctness"][shape.name] = res
            print(f"  correctness {ours_like} vs fbgemm: {json.dumps(res)}", flush=True)
            if "skipped" not in res and not res["ok"]:
                what = f"provider {ours_like} (backend={backend!r}) vs fbgemm"
                _refuse(report, args, shape, what, res["failures"])
        rows = run_shape(ctx, providers, timer, copy_gbs)
        derived = derived_bwd(rows)
        report["rows"] += rows
        report["derived"] += derived
        print(f"\n-- {shape.name} {shape.describe()}")
        print_shape_table(rows, derived, "wall" if cpu else "profiler")
        print_vs_fbgemm(rows)
        print_kernels(rows)
        del ctx, batch
        _free()
        report["elapsed_s"] = time.perf_counter() - t_run
        if args.out:  # after every shape, so a run cut short keeps what it measured
            _write(report, args.out)
    print(f"\ntotal {time.perf_counter() - t_run:.1f} s")
    return report


class CheckFailed(SystemExit):
    """A correctness check failed: the run stops (exit status 1) before timing that shape."""


def _refuse(report: dict, args, shape: Shape, what: str, failures: list[str]) -> NoReturn:
    """Stop the run: a path that computes the wrong thing is not timed. The report so far (with
    the failed check) is written to ``--out`` first."""
    msg = (
        f"bench tbe: {shape.name} ({shape.describe()}): {what}: check failed, so this shape "
        "and the ones after it are not timed:"
        + "".join(f"\n  {f}" for f in failures)
    )
    report["failed"] = msg
    if args.out:
        _write(report, args.out)
    print(msg, file=sys.stderr, flush=True)
    raise CheckFailed(1)


def _write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.plot:
        from fbtriton_dist.bench.plot import plot

        png = args.png or (args.plot.removesuffix(".json") + ".png")
        plot(args.plot, png)
        return None
    report = run(args)
    if args.out:
        _write(report, args.out)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
