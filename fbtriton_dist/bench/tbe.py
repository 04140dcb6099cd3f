"""TBE benchmark: our TableBatchedEmbedding vs FBGEMM's TBE, TorchRec and torch.

    python -m fbtriton_dist.bench tbe --out tbe.json            # S0..S6, every provider (GPU)
    python -m fbtriton_dist.bench tbe --device cpu              # C0, C1: the fast CPU path
    python -m fbtriton_dist.bench tbe --device cpu --zipf 0,1.1 # each with uniform, Zipf ids
    python -m fbtriton_dist.bench tbe --tiny --device cpu       # CI: tiny shapes, CPU providers
    python -m fbtriton_dist.bench tbe --plot tbe.json --png tbe.png   # chart, no GPU needed
    python -m fbtriton_dist.bench tbe --storage device,cached,file --cache-load-factor 0.1
                                                                 # tiers: bench/storage.py

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
per-element): the default ``--phases``. Named in ``--phases``, ``fwd_bwd_<optimizer>`` for every
other fused optimizer of ours (``fwd_bwd_adagrad``, ``_adam``, ``_partial_rowwise_adam``,
``_lamb``, ``_partial_rowwise_lamb``, ``_lars_sgd``, ``_ftrl``, ``_emainplace_rowwise_adagrad``,
``_rowwise_rmsprop_ar``; their hyper-parameters, FBGEMM's ``EmbOptimType`` and bytes:
``bench/tbe_optims.py``), timed for ours (and ours_graph, but the EMA one) and fbgemm, whose
row says ``fbgemm: not offered (why)`` where FBGEMM lacks it (its CPU TBE runs only SGD and
the Adagrads). ``bwd`` = fwd_bwd - fwd is printed as derived.

Threads (``--threads 1,2``; on CPU by default 1 up to the usable cores, 1 with ``--tiny``): every
provider is timed at each count in the same run, switched by ``torch.set_num_threads`` in this
process, which every provider follows: our native kernels size their pthread pool by
``torch.get_num_threads()`` at each call; torch's ops run on its OpenMP pool; FBGEMM's CPU TBE
(fbgemm-gpu-cpu wheels, built without OpenMP: their ``at::parallel_for`` runs inline) runs its
forward and its fused backward update on the calling thread, and the one parallel part of its
backward, the sort of the ids (``fbgemm::radix_sort_parallel``), binds at load time to the
FBGEMM copy inside libtorch_cpu, built with OpenMP: it runs on torch's OpenMP pool at torch's
count. On a CPU shared with other processes, libgomp's spinning barriers in that sort can make
FBGEMM's backward 10-20x slower at 2 threads than at 1 (``OMP_WAIT_POLICY=passive``, set before
torch is imported, avoids it); such repeats show in the spread. Each (provider, phase, count) is
timed ``--repeats`` times (3 on CPU; a repeat on CPU: 10 warm-up calls, then the median of 20
to 200 calls, 0.25 s), the providers and counts in an order rotated per repeat; a row is the
median repeat, with the spread (max - min) / median of the repeats' medians (``!`` over 20%;
the targets read it), the interquartile one (``iqr``) and ``cpu_util`` (process CPU time /
wall of the timed loop, spin-waits included). ``best``: per shape, phase and provider its time
at each count, its best count, each provider's time over ours' at each count and each at its
best (bold), and ``paired``: that ratio repeat by repeat (both timed back to back), median and
range. The load average is recorded before and after each shape.

Per (shape, provider, phase, count): median ms (L2 flushed, CUDA events), pipelined ms, GPU-busy ms
(profiler), effective GB/s with the byte count beside it (BASELINES.md's model), % of the copy
bandwidth measured in this process, speedup against every other provider, peak memory, and for
``ours``/``fbgemm`` the per-kernel µs/iter. Method: ../shared/tools/fbgemm-sm90/BASELINES.md.

Correctness comes before timing, per shape: ``--check`` (each timed provider of ours, with the
backend it is timed on, vs the reference on the timed batch at the shape's size, for each timed
phase: the forward, 3 fused steps of the phase's optimizer, weights and states;
``tbe_cases.check``) and, when ``fbgemm`` is a provider, ours vs FBGEMM on the same weights
(forward, one SGD step; then one step of each other timed optimizer on table 0, rows and
states; ``--no-compare`` leaves it out). A check that differs beyond its tolerance, or raises, stops
the run with exit status 1 before that shape is timed, naming the shape, the provider, what
differs and by how much.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import NoReturn

import torch

from fbtriton_dist.bench.tbe_cases import (
    ALIASES,
    DEFAULT_PHASES,
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
from fbtriton_dist.bench.timing import (
    SPREAD_FLAG,
    Timer,
    TimerConfig,
    copy_bandwidth,
    iqr_spread,
    paired_ratio,
    spread,
)

__all__ = ["SHAPES", "PHASES", "PROVIDERS", "Batch", "Shape", "make_batch", "model_bytes", "main"]


# ---------------------------------------------------------------- driver


def run_shape(ctx: Context, providers: list[str], timer: Timer, copy_gbs: float,
              counts: list[int] | None = None, repeats: int = 1) -> list[dict]:
    """One row per (provider, phase, thread count). Each provider's step is timed at every
    count, ``repeats`` times: each repeat builds every provider's module afresh (one alive at a
    time) and times each of its phases at every count, the providers and the counts in an order
    rotated by one per repeat, so drift over the run hits every provider and count alike. A
    row is the measurement of its median repeat, with every repeat's median (``repeats_ms``)
    and their ``spread``."""
    counts = counts or [torch.get_num_threads()]
    order: list[tuple[str, str]] = []  # (provider, phase) as first met
    info: dict[tuple[str, str], dict] = {}  # bytes, note, or skipped/error of the whole phase
    runs: dict[tuple[str, str, int], list[dict]] = {}
    errors: dict[tuple[str, str, int], str] = {}
    broken: set[str] = set()  # providers whose module could not be built
    for rep in range(repeats):
        k = rep % len(providers)
        for provider in providers[k:] + providers[:k]:
            if provider in broken:
                continue
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
                            key = (provider, phase)
                            order += [key] if key not in info else []
                            info[key] = {"skipped": f"skipped: not importable: {e}"} if (
                                missing) else {"error": msg}
                    broken.add(provider)
                    break
                done.add(phase)
                key = (provider, phase)
                if key not in info:
                    order.append(key)
                    info[key] = {}
                if isinstance(fn, str):
                    if rep == 0:
                        print(f"  {provider} {phase}: {fn}", flush=True)
                    info[key] = {"skipped": fn}
                    continue
                info[key]["bytes"] = model_bytes(ctx.shape, ctx.batch, phase,
                                                 output_size(provider, ctx.shape))
                if getattr(fn, "note", None):
                    info[key]["note"] = fn.note
                j = rep % len(counts)
                for threads in counts[j:] + counts[:j]:
                    if (provider, phase, threads) in errors:
                        continue
                    torch.set_num_threads(threads)
                    t0 = time.perf_counter()
                    try:
                        r = timer.measure(fn)
                    except Exception as e:
                        msg = f"{type(e).__name__}: {str(e)[:500]}"
                        print(f"  {provider} {phase} {threads} thr: ERROR {msg}", flush=True)
                        errors[(provider, phase, threads)] = msg
                        _free()
                        continue
                    r["wall_s"] = time.perf_counter() - t0
                    runs.setdefault((provider, phase, threads), []).append(r)
                    util = r.get("cpu_util")
                    print(
                        f"  {provider:<18} {phase:<36} {threads:>2} thr  rep {rep + 1}/{repeats}"
                        f"  busy {r['busy_ms']:9.3f} ms  median {r['median_ms']:9.3f} ms"
                        + (f"  cpu {util:.2f}" if util is not None else "")
                        + f"  ({r['wall_s']:.1f} s)"
                        + (f"  [{fn.note}]" if getattr(fn, "note", None) else ""),
                        flush=True,
                    )
            cases.close()
            # the last step closure still holds the module: drop it before building the next one
            fn = cases = None  # noqa: F841
            _free()
    rows = []
    for provider, phase in order:
        base = dict(shape=ctx.shape.name, provider=provider, phase=phase)
        meta = info[(provider, phase)]
        if "skipped" in meta or "error" in meta:
            rows.append(dict(base, **{k: meta[k] for k in ("skipped", "error") if k in meta}))
            continue
        for threads in counts:
            if (provider, phase, threads) in errors:
                rows.append(dict(base, threads=threads, error=errors[(provider, phase, threads)]))
            elif (provider, phase, threads) in runs:
                rows.append(_row(dict(base, threads=threads), meta, runs[(provider, phase,
                                                                             threads)], copy_gbs))
    _add_ratios(rows)
    return rows


def _row(base: dict, meta: dict, runs: list[dict], copy_gbs: float) -> dict:
    """The row of one (provider, phase, count): its median repeat's measurement, every repeat's
    median ms, their spread (flagged above ``SPREAD_FLAG``), GB/s and % of the copy bandwidth."""
    ranked = sorted(runs, key=lambda r: r["median_ms"])
    repeats_ms = [r["median_ms"] for r in runs]
    row = dict(base, bytes=meta["bytes"], **ranked[(len(ranked) - 1) // 2])
    row["wall_s"] = sum(r["wall_s"] for r in runs)
    row["repeats_ms"] = repeats_ms
    row["spread"] = spread(repeats_ms)
    row["iqr_spread"] = iqr_spread(repeats_ms)
    row["spread_flag"] = row["spread"] is not None and row["spread"] > SPREAD_FLAG
    if "note" in meta:
        row["note"] = meta["note"]
    for when in ("busy", "median"):
        gbs = meta["bytes"] / row[f"{when}_ms"] / 1e6
        row[f"gbs_{when}"] = gbs
        row[f"pct_copy_{when}"] = 100 * gbs / copy_gbs
    return row


def _add_ratios(rows: list[dict]) -> None:
    """ratios[other] = {busy, median}: other's time / this one's at the same thread count
    (> 1: this one is faster)."""
    ok = [r for r in rows if r.get("busy_ms")]
    for r in ok:
        r["ratios"] = {
            o["provider"]: {
                "busy": o["busy_ms"] / r["busy_ms"],
                "median": o["median_ms"] / r["median_ms"],
            }
            for o in ok
            if o["phase"] == r["phase"] and o["provider"] != r["provider"]
            and o.get("threads") == r.get("threads")
        }


def best_counts(rows: list[dict], base: str = "ours") -> list[dict]:
    """Per (shape, phase, provider) timed: its median ms (with spread) at each thread count,
    its best count (the lowest median) and time there, and, for each provider but ``base``,
    ``vs_base``: its time over ``base``'s, at each count both were timed at (``by_threads``)
    and each at its own best count (``best``); > 1: ``base`` is faster."""
    groups: dict[tuple[str, str, str], dict] = {}
    for r in rows:
        if not r.get("median_ms") or r.get("threads") is None:
            continue
        e = groups.setdefault((r["shape"], r["phase"], r["provider"]), dict(
            shape=r["shape"], phase=r["phase"], provider=r["provider"], by_threads={}))
        e["by_threads"][r["threads"]] = {
            k: r.get(k) for k in ("median_ms", "spread", "spread_flag", "iqr_spread", "cpu_util",
                                  "repeats_ms")}
    for e in groups.values():
        t, m = min(e["by_threads"].items(), key=lambda kv: kv[1]["median_ms"])
        e.update(best_threads=t, best_ms=m["median_ms"], best_spread=m["spread"])
    for (shape, phase, provider), e in groups.items():
        b = groups.get((shape, phase, base))
        if b is None or provider == base:
            continue
        e["vs_" + base] = {
            "best": e["best_ms"] / b["best_ms"],
            "by_threads": {t: m["median_ms"] / b["by_threads"][t]["median_ms"]
                           for t, m in e["by_threads"].items() if t in b["by_threads"]},
        }
        paired = paired_ratio(*({t: m.get("repeats_ms") or [] for t, m in g.items()}
                                for g in (e["by_threads"], b["by_threads"])))
        if paired:  # each at its best count within each repeat, then the median repeat
            e["vs_" + base]["paired"] = paired
    return sorted(groups.values(), key=lambda e: PHASES.index(e["phase"]))  # stable: providers


def derived_bwd(rows: list[dict]) -> list[dict]:
    """bwd_<opt> = fwd_bwd_<opt> - fwd of the same provider (or the provider whose forward it
    shares) at the same thread count, GPU-busy and median."""
    fwd = {(r["shape"], r["provider"], r.get("threads")): r
           for r in rows if r["phase"] == "fwd" and r.get("busy_ms")}
    out = []
    for r in rows:
        if not r["phase"].startswith("fwd_bwd_") or not r.get("busy_ms"):
            continue
        f = fwd.get((r["shape"], FWD_OF.get(r["provider"], r["provider"]), r.get("threads")))
        if f is None:
            continue
        out.append(
            dict(
                shape=r["shape"],
                provider=r["provider"],
                phase="bwd_" + r["phase"].removeprefix("fwd_bwd_"),
                threads=r.get("threads"),
                busy_ms=r["busy_ms"] - f["busy_ms"],
                median_ms=r["median_ms"] - f["median_ms"],
            )
        )
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _spread(r: dict) -> str:
    """``±12%`` (the repeats' spread), ``!`` after it above ``SPREAD_FLAG``; ``-`` for one."""
    if r.get("spread") is None:
        return "-"
    return f"±{100 * r['spread']:.0f}%" + ("!" if r["spread"] > SPREAD_FLAG else "")


def print_shape_table(rows: list[dict], derived: list[dict], source: str) -> None:
    busy = "GPU-busy" if source == "profiler" else "busy=wall"
    print(
        f"  {'phase':<36} {'provider':<18} {'thr':>3} {'median ms':>9} {'spread':>7} "
        f"{'pipe ms':>8} {busy + ' ms':>12} "
        f"{'bytes MB':>9} {'GB/s@busy':>9} {'%copy':>6} {'GB/s@med':>8} {'%copy':>6} "
        f"{'peak GB':>7}  speedup vs others at this count (busy/median)"
    )
    for phase in PHASES:
        for r in [r for r in rows if r["phase"] == phase]:
            head = f"  {phase:<36} {r['provider']:<18} {_fmt(r.get('threads'), '>3')}"
            if not r.get("busy_ms"):
                print(f"{head} {r.get('error') or r.get('skipped')}")
                continue
            ratios = " ".join(
                f"{k} {v['busy']:.2f}/{v['median']:.2f}" for k, v in r.get("ratios", {}).items()
            )
            print(
                f"{head} {r['median_ms']:9.3f} {_spread(r):>7} {_fmt(r['pipelined_ms'], '8.3f')} "
                f"{r['busy_ms']:12.3f} {r['bytes'] / 1e6:9.1f} {r['gbs_busy']:9.0f} "
                f"{r['pct_copy_busy']:6.1f} {r['gbs_median']:8.0f} {r['pct_copy_median']:6.1f} "
                f"{_fmt(r['peak_gb'], '7.2f')}  {ratios}"
            )
    for d in derived:
        print(
            f"  {d['phase'] + ' (derived)':<36} {d['provider']:<18} "
            f"{_fmt(d.get('threads'), '>3')} {d['median_ms']:9.3f} "
            f"{'':>7} {'':>8} {d['busy_ms']:12.3f}  = fwd_bwd - fwd"
        )


def print_vs_fbgemm(rows: list[dict]) -> None:
    """One line per phase and thread count: FBGEMM's end-to-end median over ours (eager) and
    ours_graph's, at the same count."""
    counts = list(dict.fromkeys(r.get("threads") for r in rows))
    for phase in PHASES:
        for threads in counts:
            got = {r["provider"]: r for r in rows if r["phase"] == phase
                   and r.get("median_ms") and r.get("threads") == threads}
            fb = got.get("fbgemm")
            ours = [p for p in ("ours", "ours_graph") if p in got]
            if fb is None or not ours:
                continue
            parts = [
                f"{p} {got[p]['median_ms']:.3f} ms = {fb['median_ms'] / got[p]['median_ms']:.2f}x"
                + (f" [{got[p]['note']}]" if "note" in got[p] else "")
                for p in ours
            ]
            at = f" at {threads} thr" if threads is not None and len(counts) > 1 else ""
            print(
                f"  e2e median ({'wall' if fb.get('busy_source') == 'wall' else 'L2 flushed'}, "
                f"host included) {phase}{at}: fbgemm {fb['median_ms']:.3f} ms; "
                + "; ".join(parts)
            )


def print_threads_table(best: list[dict], counts: list[int], base: str = "ours") -> None:
    """Markdown: each provider's median ms (± spread, ``!`` over the flag) at each thread count
    and its best count; then each other provider's time over ``base``'s at each count and,
    in bold, each at its best count."""
    if not best:
        return
    cols = [f"{t} thr ms" for t in counts]
    print("\n| shape | phase | provider | " + " | ".join(cols) + " | best |")
    print("|---|---|---|" + "---:|" * len(cols) + "---|")
    for e in best:
        cells = []
        for t in counts:
            m = e["by_threads"].get(t)
            iqr = m and m.get("iqr_spread")
            cells.append("-" if m is None else f"{m['median_ms']:.3f} {_spread(m)}"
                         + ("" if iqr is None else f" (iqr {100 * iqr:.0f}%)"))
        print(f"| {e['shape']} | {e['phase']} | {e['provider']} | " + " | ".join(cells)
              + f" | {e['best_ms']:.3f} @ {e['best_threads']} thr |")
    versus = [e for e in best if "vs_" + base in e]
    if not versus:
        return
    cols = [f"@{t} thr" for t in counts]
    print(f"\n| shape | phase | provider / {base} | " + " | ".join(cols)
          + " | best / best |")
    print("|---|---|---|" + "---:|" * len(cols) + "---:|")
    bests = {(e["shape"], e["phase"], e["provider"]): e for e in best}
    for e in versus:
        v = e["vs_" + base]
        cells = [_fmt(v["by_threads"].get(t), ".2f") + ("x" if t in v["by_threads"] else "")
                 for t in counts]
        b, p = bests[(e["shape"], e["phase"], base)], v.get("paired")
        print(f"| {e['shape']} | {e['phase']} | {e['provider']} / {base} | " + " | ".join(cells)
              + f" | **{v['best']:.2f}x** ({e['provider']} @ {e['best_threads']} / {base} @ "
              f"{b['best_threads']})" + (f"; per repeat {p['median']:.2f}x [{p['min']:.2f}-"
                                         f"{p['max']:.2f}]" if p else "") + " |")


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
    p.add_argument("--phases", default=None,
                   help=f"comma list of {list(PHASES)} (default {list(DEFAULT_PHASES)}; "
                   "fwd_bwd_<optimizer>: bench/tbe_optims.py)")
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
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (3 GPU, 10 CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (10 GPU, 200 CPU)")
    p.add_argument("--min-iters", type=int, default=None, help="(5 GPU, 20 CPU)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="per timed loop, after min-iters (1.5 GPU, 0.25 CPU)")
    p.add_argument("--pipelined", type=int, default=None)
    p.add_argument("--profiled", type=int, default=5)
    p.add_argument("--pooling", choices=["sum", "none"], default="sum",
                   help="none: sequence lookups, one output row per id (FBGEMM's NONE, torch's "
                   "F.embedding)")
    p.add_argument("--zipf", default=None,
                   help="comma list of Zipf exponents (0: uniform ids): each shape runs once per "
                   "exponent, named e.g. C0@zipf1.1 (default: each shape's own ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", default=None,
                   help="comma list of thread counts (torch's, which the native CPU kernels "
                   "use too): every provider is timed at each (default on CPU: 1..the usable "
                   "cores, 1 with --tiny; on CUDA: torch's)")
    p.add_argument("--repeats", type=int, default=None,
                   help="time each provider, phase and count this many times: the median "
                   "repeat is reported, with the spread (max-min)/median (default 3 CPU, 1 GPU)")
    p.add_argument("--out", default=None, help="write everything as JSON here")
    p.add_argument("--plot", default=None, metavar="JSON", help="only plot this JSON (no GPU)")
    p.add_argument("--png", default=None, help="where --plot writes (default JSON's name .png)")
    return p.parse_args(argv)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), the bound of ``--threads``."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def parse_threads(raw: str, usable: int) -> list[int]:
    """``--threads``: ``"2"`` or ``"1,2"`` -> [1, 2] (duplicates dropped, order kept); each
    count in 1..``usable``, else a SystemExit naming the bound."""
    try:
        counts = list(dict.fromkeys(int(x) for x in raw.split(",")))
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise SystemExit(f"--threads: expected a comma list of thread counts from 1 to the "
                         f"{usable} usable cores, got {raw!r}")
    over = [c for c in counts if c > usable]
    if over:
        raise SystemExit(f"--threads: {over[0]} is more than the {usable} usable cores "
                         f"(len(os.sched_getaffinity(0))); expected counts from 1 to {usable}, "
                         f"got {raw!r}")
    return counts


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
    phases = _select(args.phases, list(DEFAULT_PHASES), PHASES, "phases")
    cpu = device.type == "cpu"
    usable = usable_cores()
    if args.threads:
        counts = parse_threads(args.threads, usable)
    elif cpu and args.tiny:  # tiny ops: one thread avoids OpenMP spin-waits on a shared CPU
        counts = [1]
    elif cpu:
        counts = list(range(1, usable + 1))
    else:
        counts = [torch.get_num_threads()]
    repeats = args.repeats if args.repeats is not None else (3 if cpu else 1)
    if repeats < 1:
        raise SystemExit(f"--repeats: expected a count >= 1, got {repeats}")
    torch.set_num_threads(max(counts))  # the checks, the copy bandwidth
    cfg = TimerConfig(  # CPU: sub-ms calls on a shared machine want many iterations a repeat
        warmup=args.warmup if args.warmup is not None else (10 if cpu else 3),
        iters=args.iters if args.iters is not None else (200 if cpu else 10),
        min_iters=args.min_iters if args.min_iters is not None else (20 if cpu else 5),
        budget_s=args.budget_s if args.budget_s is not None else (0.25 if cpu else 1.5),
        pipelined=args.pipelined if args.pipelined is not None else (3 if cpu else 10),
        profiled=args.profiled,
    )
    report = {
        "device": torch.cuda.get_device_name(device) if not cpu else "cpu",
        "threads": counts,
        "usable_cores": usable,
        "repeats": repeats,
        "env": {k: os.environ.get(k) for k in (
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        "spread": f"(max - min) / median of the {repeats} repeats' median ms; flagged (!) "
        f"over {SPREAD_FLAG:.0%}",
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
        "best": [],
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
                res = check(shape, batch, device, providers, phases, args.dense_limit_gb)
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
        load = _loadavg()
        rows = run_shape(ctx, providers, timer, copy_gbs, counts, repeats)
        torch.set_num_threads(max(counts))
        report["shapes"][shape.name]["loadavg"] = {"before": load, "after": _loadavg()}
        derived = derived_bwd(rows)
        best = best_counts(rows)
        report["rows"] += rows
        report["derived"] += derived
        report["best"] += best
        print(f"\n-- {shape.name} {shape.describe()}")
        print_shape_table(rows, derived, "wall" if cpu else "profiler")
        print_vs_fbgemm(rows)
        print_kernels(rows)
        if len(counts) > 1 or repeats > 1:
            print_threads_table(best, counts)
        if load is not None:
            print(f"  load average (1 min) {load:.2f} before, {_loadavg():.2f} after; "
                  f"{usable} usable cores")
        del ctx, batch
        _free()
        report["elapsed_s"] = time.perf_counter() - t_run
        if args.out:  # after every shape, so a run cut short keeps what it measured
            _write(report, args.out)
    print(f"\ntotal {time.perf_counter() - t_run:.1f} s")
    return report


def _loadavg() -> float | None:
    """The machine's 1-minute load average (other processes on shared cores skew CPU times)."""
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not available
        return None


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
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--storage" or a.startswith("--storage=") for a in argv):
        from fbtriton_dist.bench import storage  # the tiers against device: bench/storage.py

        return storage.main(argv)
    args = parse_args(argv)
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
