"""Storage tiers benchmark: a training step (forward + fused backward) of tables on a cached
tier against the same tables on ``device``, in one process.

    python -m fbtriton_dist.bench tbe --storage device,cached,file --cache-load-factor 0.1
    python -m fbtriton_dist.bench tbe --storage device,cached --prefetch --zipf 1.1 \\
        --tables 4 --rows 100000 --dim 64 --batch 1024 --bag 20
    python -m fbtriton_dist.bench tbe --storage device,host,cached --device cuda --fbgemm

Every tier's module starts from the device module's weights; first each tier trains
``--check-steps`` batches and its weights, optimizer state and step are compared with the
device module's, bit for bit (the cache evicts along the way): a tier that differs stops the
run (exit status 1) before anything is timed. Then every tier is timed ``--repeats`` times, the
tiers in an order rotated per repeat (A/B alternation: drift on a shared machine hits every
tier alike); a repeat times ``--steps`` steps one by one after ``--warmup`` untimed ones and
keeps their median. A tier's time is the median of its repeats' medians, with their spread;
``ratio`` is its time over ``device``'s (> 1: slower than device). Per cached tier: the hit rate
(distinct rows of a lookup found in the cache / distinct rows looked up), rows fetched
(misses) and written back per step, and with ``--prefetch`` (the next batch's misses read on
a worker thread during the step: ``TableBatchedEmbedding.prefetch``) the worker's time per
step, the part of it the lookups waited for (exposed) and the rows taken from it.

``--device cuda``: our modules on the GPU (the Triton kernels; a cached tier keeps its slots in
device memory and its rows in pinned host memory; ``host`` keeps every row in pinned host
memory, read over PCIe); a tier our module refuses on the device gets a row saying so and
the run goes on; each timed step is
bracketed by ``torch.cuda.synchronize()``. ``--fbgemm`` (CUDA only) adds FBGEMM's tiers,
``fbgemm_device``, ``fbgemm_managed`` (UVM) and ``fbgemm_managed_caching`` (its HBM cache,
``--cache-load-factor``, LRU/LFU as ``--policy``; its forward prefetches its own batch, no
``--prefetch`` for it), from our initial weights on the same batches
(``bench/storage_fbgemm.py``); before timing, ``fbgemm_device`` and our ``device`` train one
step from the same weights and must agree within 1e-5 relative (else exit status 1). Every
row's ``ratio`` is its time over our ``device``'s; the pairs ours ``device`` / ``cached`` /
``host`` against ``fbgemm_device`` / ``fbgemm_managed_caching`` / ``fbgemm_managed`` print
fbgemm ms / ours ms (> 1: ours faster).

``--graph``: each of our tiers also as a CUDA-graph step, rows ``<tier> (graph)``: the step
(lookup, fused backward) replayed by ``graphs.GraphedStep`` after one eager warm-up step; a
cached tier's slot map runs eagerly before each replay (``graphs.before_each_replay``), its
lookup and update on the slots are replayed. Checked bit for bit like the others (the check
steps replay it), paired with FBGEMM's eager modules. On the CPU the step runs eagerly.

``--slot-map``: where the ``cached`` tier's slot map lives (``FBTD_SLOT_MAP`` while the modules
are built): ``auto`` (the default: on the cache's device on CUDA, on the host on the CPU),
``host``, ``device`` (the CUDA path, also on the CPU), or ``both``: the cached tier twice,
rows ``cached (host map)`` and ``cached (device map)``, timed in the same rotation.
"""

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from fbtriton_dist import knobs, optim
from fbtriton_dist.bench import storage_fbgemm
from fbtriton_dist.bench.timing import SPREAD_FLAG, spread
from fbtriton_dist.graphs import GraphedStep
from fbtriton_dist.modules.tbe import TableBatchedEmbedding
from fbtriton_dist.storage import TIERS, Storage


@dataclasses.dataclass(kw_only=True, frozen=True)
class Setup:
    """One benchmark's tables and batches."""

    tables: int = 4
    """T: tables, one feature each."""
    rows: int = 100_000
    """E: rows per table."""
    dim: int = 64
    """D."""
    batch: int = 1024
    """B: bags per feature."""
    bag: int = 20
    """L: ids per bag."""
    zipf: float = 1.1
    """Ids' Zipf exponent (0: uniform); ranks are mapped to rows by a random permutation."""
    batches: int = 8
    """Distinct batches, cycled."""
    seed: int = 0


def make_batches(setup: Setup) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``setup.batches`` (indices ``[T*B*L]``, offsets ``[T*B+1]``) of Zipf ids."""
    gen = torch.Generator().manual_seed(setup.seed)
    E, n = setup.rows, setup.batch * setup.bag
    perms = [torch.randperm(E, generator=gen) for _ in range(setup.tables)]
    cdf = None
    if setup.zipf:
        cdf = torch.cumsum(torch.arange(1, E + 1, dtype=torch.float64).pow(-setup.zipf), 0)
        cdf /= cdf[-1].clone()
    offsets = torch.arange(setup.tables * setup.batch + 1, dtype=torch.int64) * setup.bag
    out = []
    for _ in range(setup.batches):
        ids = []
        for perm in perms:
            if cdf is None:
                ids.append(torch.randint(0, E, (n,), generator=gen))
            else:
                u = torch.rand(n, generator=gen, dtype=torch.float64)
                ids.append(perm[torch.searchsorted(cdf, u).clamp_(max=E - 1)])
        out.append((torch.cat(ids), offsets))
    return out


LR, EPS = 0.05, 1e-8
"""Rowwise Adagrad's rate and eps, ours and FBGEMM's."""


def build(setup: Setup, tier: str, load_factor: float, policy: str, folder: str,
          lr: float = LR, device: str = "cpu") -> TableBatchedEmbedding:
    """The tables on ``tier`` (rowwise Adagrad; the CPU kernels, or the Triton kernels on
    CUDA), the same init each time. Raises ValueError where the module refuses the tier on
    ``device``."""
    storage = None
    if tier != "device":
        path = os.path.join(folder, tier) if tier == "file" else None
        storage = [Storage(tier=tier, cache_load_factor=load_factor, policy=policy,
                           path=path) if tier in ("cached", "file") else Storage(tier=tier)
                   ] * setup.tables
    return TableBatchedEmbedding([(setup.rows, setup.dim)] * setup.tables,
                                 optimizer=optim.RowWiseAdagrad(lr=lr, eps=EPS),
                                 seed=setup.seed + 1, storage=storage, bounds_check="ignore",
                                 device=device)


class GraphedTier:
    """Our module whose training step is replayed from a CUDA graph (``GraphedStep``, one
    eager warm-up step): a ``--graph`` row. ``upcoming`` batches are prefetched after the
    replay."""

    def __init__(self, module: TableBatchedEmbedding) -> None:
        self.module = module
        self.step = GraphedStep(self._step, warmup=1)

    def _step(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        self.module(indices, offsets).sum().backward()


def tbe_of(m) -> TableBatchedEmbedding | None:
    """Our module behind a timed entry (None: FBGEMM's)."""
    m = m.module if isinstance(m, GraphedTier) else m
    return m if isinstance(m, TableBatchedEmbedding) else None


def train_step(module, batch, upcoming=None) -> None:
    """One training step; ``upcoming``: the next batch, prefetched before the backward (after
    the replay of a ``GraphedTier``)."""
    if isinstance(module, GraphedTier):
        module.step(*batch)
        if upcoming is not None:
            module.module.prefetch(*upcoming)
        return
    out = module(*batch)
    if upcoming is not None:
        module.prefetch(*upcoming)
    out.sum().backward()


def check(setup: Setup, modules: dict[str, TableBatchedEmbedding], batches, steps: int,
          prefetch: bool) -> dict[str, list[str]]:
    """Train every module ``steps`` batches (prefetching the next one where asked); per tier,
    what differs from ``device`` (weights, optimizer state, step), bit for bit."""
    for i in range(steps):
        for m in modules.values():
            train_step(m, batches[i % len(batches)],
                       batches[(i + 1) % len(batches)] if prefetch else None)
    want = modules["device"].state_dict()
    out = {}
    for tier, m in modules.items():
        m = tbe_of(m)
        got = m.state_dict()
        out[tier] = [f"{k}: {_diff(want[k], got[k])}" for k in want
                     if isinstance(want[k], torch.Tensor) and not torch.equal(want[k], got[k])]
        if m.step != modules["device"].step:
            out[tier].append(f"step {m.step}, device {modules['device'].step}")
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)}, device {tuple(a.shape)}"
    d = (a.double() - b.double()).abs()
    return f"{int((d > 0).sum())} elements differ, max |diff| {float(d.max()):.3g}"


def time_tiers(modules: dict[str, TableBatchedEmbedding], batches, *, steps: int, warmup: int,
               repeats: int, prefetch: bool, start: int = 0,
               device: torch.device | None = None) -> dict[str, list[float]]:
    """Per tier, each repeat's median step in ms; the tiers in an order rotated per repeat.
    Each step is timed between two ``sync(device)``s (CUDA: ``torch.cuda.synchronize``).
    FBGEMM's modules never get ``prefetch`` (their forward fetches their own misses)."""
    tiers = list(modules)
    runs: dict[str, list[float]] = {t: [] for t in tiers}
    i = start
    for rep in range(repeats):
        k = rep % len(tiers)
        for tier in tiers[k:] + tiers[:k]:
            m = modules[tier]
            ahead = prefetch and tbe_of(m) is not None
            times = []
            for s in range(warmup + steps):
                nxt = batches[(i + 1) % len(batches)] if ahead else None
                sync(device)
                t0 = time.perf_counter()
                train_step(m, batches[i % len(batches)], nxt)
                sync(device)
                if s >= warmup:
                    times.append(1e3 * (time.perf_counter() - t0))
                i += 1
            runs[tier].append(statistics.median(times))
    return runs


def sync(device: torch.device | None) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU (or None)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def summarise(runs: dict[str, list[float]], stats: dict[str, dict], steps: dict[str, int]
              ) -> list[dict]:
    """A row per tier: median ms, spread, ``ratio`` = its ms / device's ms, and the cached
    tiers' numbers per step (``stats``: the summed ``cache_stats()`` over ``steps[tier]``
    steps)."""
    base = statistics.median(runs["device"])
    rows = []
    for tier, ms in runs.items():
        med = statistics.median(ms)
        row = {"tier": tier, "median_ms": med, "repeats_ms": ms, "spread": spread(ms),
               "ratio": med / base}
        s, n = stats.get(tier), steps.get(tier, 0)
        if s and n:
            row.update(
                hit_rate=1 - s["misses"] / s["lookups"] if s["lookups"] else None,
                fetched_per_step=s["misses"] / n,
                written_back_per_step=s["writebacks"] / n,
                evicted_per_step=s["evictions"] / n,
            )
            if s.get("prefetched"):
                row.update(
                    prefetched_per_step=s["prefetched"] / n,
                    prefetch_used_per_step=s["prefetch_used"] / n,
                    prefetch_ms_per_step=s["prefetch_us"] / 1e3 / n,
                    prefetch_exposed_ms_per_step=s["prefetch_wait_us"] / 1e3 / n,
                )
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    """The table: each tier's median ms and its ratio over device (> 1: slower); a tier the
    module refused on this device, why."""
    print(f"  {'tier':<22} {'median ms':>9} {'spread':>7} {'tier/device':>11} {'hit rate':>8} "
          f"{'fetched/step':>12} {'written/step':>12}  prefetch per step")
    for r in rows:
        if "refused" in r:
            print(f"  {r['tier']:<22} refused: {r['refused']}")
            continue
        sp = "-" if r["spread"] is None else (
            f"±{100 * r['spread']:.0f}%" + ("!" if r["spread"] > SPREAD_FLAG else ""))
        hit = "-" if r.get("hit_rate") is None else f"{100 * r['hit_rate']:.1f}%"
        fetched = "-" if "fetched_per_step" not in r else f"{r['fetched_per_step']:.0f}"
        written = "-" if "written_back_per_step" not in r else f"{r['written_back_per_step']:.0f}"
        pre = "-"
        if "prefetch_ms_per_step" in r:
            hidden = r["prefetch_ms_per_step"] - r["prefetch_exposed_ms_per_step"]
            pre = (f"{r['prefetched_per_step']:.0f} rows read ahead, "
                   f"{r['prefetch_used_per_step']:.0f} used; worker "
                   f"{r['prefetch_ms_per_step']:.3f} ms, waited for "
                   f"{r['prefetch_exposed_ms_per_step']:.3f} ms (hidden {hidden:.3f} ms)")
        print(f"  {r['tier']:<22} {r['median_ms']:9.3f} {sp:>7} {r['ratio']:10.2f}x {hit:>8} "
              f"{fetched:>12} {written:>12}  {pre}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fbtriton_dist.bench tbe --storage",
                                allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--storage", required=True,
                   help=f"comma list of tiers {list(TIERS)}; device is always timed too")
    p.add_argument("--cache-load-factor", type=float, default=0.1,
                   help="cache slots / rows of the cached tiers")
    p.add_argument("--policy", choices=["lru", "lfu"], default="lru")
    p.add_argument("--prefetch", action="store_true",
                   help="prefetch the next batch's misses on a worker thread during each step")
    for field in dataclasses.fields(Setup):  # --tables, --rows, --dim, --batch, --bag, ...
        p.add_argument("--" + field.name.replace("_", "-"), type=type(field.default),
                       default=field.default, help=f"Setup.{field.name} (default %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-steps", type=int, default=4,
                   help="steps trained and compared with device before timing")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where our modules live (cuda: the Triton kernels, HBM slots)")
    p.add_argument("--fbgemm", action="store_true",
                   help="add FBGEMM's fbgemm_device, fbgemm_managed (UVM) and "
                   "fbgemm_managed_caching (--device cuda only)")
    p.add_argument("--graph", action="store_true",
                   help="also time each of our tiers as a CUDA-graph step (rows '<tier> (graph)')")
    p.add_argument("--slot-map", choices=["auto", "host", "device", "both"], default="auto",
                   help="where the cached tier's slot map lives (both: time the two)")
    p.add_argument("--path", default=None,
                   help="directory of the file tier's files (default: a temporary one)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    tiers = [t.strip() for t in args.storage.split(",") if t.strip()]
    bad = [t for t in tiers if t not in TIERS]
    if bad or not tiers:
        raise SystemExit(f"--storage: expected a comma list of {list(TIERS)}, got "
                         f"{args.storage!r}")
    args.tiers = ["device", *dict.fromkeys(t for t in tiers if t != "device")]
    for name in ("steps", "repeats", "threads", "tables", "rows", "dim", "batch", "bag",
                 "batches"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected an integer >= 1, got {getattr(args, name)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is "
                         "False); expected --device cpu")
    if args.fbgemm and args.device != "cuda":
        raise SystemExit(storage_fbgemm.unavailable(torch.device(args.device)))
    if not 0 < args.cache_load_factor <= 1:
        raise SystemExit(f"--cache-load-factor: expected a number in (0, 1], got "
                         f"{args.cache_load_factor}")
    return args


def run(args: argparse.Namespace) -> dict:
    setup = Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    folder = args.path or tempfile.mkdtemp(prefix="fbtd-bench-storage-")
    try:
        return _run(args, setup, folder)
    finally:
        torch.set_num_threads(threads)
        if args.path is None:
            shutil.rmtree(folder, ignore_errors=True)


def _run(args, setup: Setup, folder: str) -> dict:
    device = torch.device(args.device)
    print(f"tiers {args.tiers} on {args.device}: T={setup.tables} tables of E={setup.rows:,} x "
          f"D={setup.dim}, B={setup.batch} bags of L={setup.bag} ids, Zipf({setup.zipf}), cache "
          f"{args.cache_load_factor:g} of the rows ({args.policy}), rowwise Adagrad, fused "
          f"fwd+bwd, {args.threads} thread(s), prefetch {'on' if args.prefetch else 'off'}, "
          f"slot map {args.slot_map}"
          f"{', and FBGEMM' if args.fbgemm else ''}", flush=True)
    batches = [tuple(t.to(device) for t in b) for b in make_batches(setup)]
    modules, refused = _build_ours(args, setup, folder)
    initial = [w.detach().clone() for w in modules["device"].split_embedding_weights()] if (
        args.fbgemm) else None  # FBGEMM's modules start from these
    report = {"args": dict(vars(args)), "setup": dataclasses.asdict(setup),
              "torch": torch.__version__, "loadavg_before": _loadavg(), "refused": refused}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    failures = check(setup, modules, batches, args.check_steps, args.prefetch)
    report["check"] = failures
    bad = {t: f for t, f in failures.items() if f}
    if bad:
        msg = "bench tbe --storage: tiers differ from device, nothing timed:" + "".join(
            f"\n  {t}: " + "; ".join(f) for t, f in bad.items())
        _stop(report, args, msg)
    print(f"  check: {', '.join(t for t in modules if t != 'device') or 'nothing'} equal device "
          f"bit for bit after {args.check_steps} steps", flush=True)
    timed: dict = dict(modules)
    if args.fbgemm:
        timed.update(_build_fbgemm(args, setup, folder, batches, initial, report))
    del initial
    ours = {t: tbe_of(m) for t, m in timed.items() if tbe_of(m) is not None}
    before = {t: dict(_sum_stats(m)) for t, m in ours.items()}
    for m in timed.values():
        storage_fbgemm.reset_stats(m)
    runs = time_tiers(timed, batches, steps=args.steps, warmup=args.warmup,
                      repeats=args.repeats, prefetch=args.prefetch, start=args.check_steps,
                      device=device)
    stats = {t: {k: v - before[t].get(k, 0) for k, v in _sum_stats(m).items()}
             for t, m in ours.items() if m.tiered}
    n = args.repeats * (args.warmup + args.steps)
    rows = summarise(runs, stats, {t: n for t in stats})
    for r in rows:
        if r["tier"] in timed and r["tier"] not in ours:
            r["hit_rate"] = storage_fbgemm.hit_rate(timed[r["tier"]])
    rows += [{"tier": t, "refused": why} for t, why in refused.items()]
    pairs = storage_fbgemm.pair_ratios(rows)
    report.update(rows=rows, pairs=pairs, loadavg_after=_loadavg())
    print_rows(rows)
    storage_fbgemm.print_pairs(pairs)
    print(f"  load average (1 min) {report['loadavg_before']} before, "
          f"{report['loadavg_after']} after")
    if args.out:
        _write(report, args.out)
        print(f"wrote {args.out}")
    return report


def _build_ours(args, setup: Setup, folder: str) -> tuple[dict, dict[str, str]]:
    """Our module per tier (and with ``--graph`` a second one per tier in a ``GraphedTier``),
    each from the device module's state; the tiers the module refuses on ``args.device``
    (tier -> why) instead of a module."""
    device = build(setup, "device", args.cache_load_factor, args.policy, folder,
                   device=args.device)
    modules, refused = {"device": device}, {}
    if args.graph:
        os.makedirs(os.path.join(folder, "graph"), exist_ok=True)
        graphed = build(setup, "device", args.cache_load_factor, args.policy, folder,
                        device=args.device)
        graphed.load_state_dict(device.state_dict())
        modules["device (graph)"] = GraphedTier(graphed)
    for tier in args.tiers[1:]:
        maps = ["host", "device"] if args.slot_map == "both" and tier == "cached" else [
            args.slot_map]
        for where in maps:
            name = tier if len(maps) == 1 else f"{tier} ({where} map)"
            for graph in (False, True) if args.graph else (False,):
                try:
                    with knobs.set_for_now("FBTD_SLOT_MAP", where):
                        m = build(setup, tier, args.cache_load_factor, args.policy,
                                  os.path.join(folder, "graph") if graph else folder,
                                  device=args.device)
                except ValueError as e:
                    refused[name] = str(e)
                    print(f"  {name}: refused on {args.device}: {e}", flush=True)
                    break
                m.load_state_dict(device.state_dict())
                if graph:
                    modules[f"{name} (graph)"] = GraphedTier(m)
                else:
                    modules[name] = m
    return modules, refused


def _build_fbgemm(args, setup: Setup, folder: str, batches, initial, report) -> dict:
    """FBGEMM's tiers from our initial weights, each trained the check steps' batches (as
    ours were: warm caches alike), after ``fbgemm_device`` matched our ``device`` module over
    one step (else the run stops, exit 1). None where fbgemm_gpu does not import (said so in
    the report and printed)."""
    device = torch.device(args.device)
    why = storage_fbgemm.unavailable(device)
    if why:
        print(f"  fbgemm: skipped: {why}", flush=True)
        report["fbgemm"] = {"skipped": why}
        return {}
    tables = [(setup.rows, setup.dim)] * setup.tables
    kw = dict(lr=LR, eps=EPS, load_factor=args.cache_load_factor, policy=args.policy,
              device=device)
    ours = build(setup, "device", args.cache_load_factor, args.policy, folder,
                 device=args.device)
    with torch.no_grad():  # a new module draws new weights: the timed modules' initial ones
        for w, w0 in zip(ours.split_embedding_weights(), initial, strict=True):
            w.copy_(w0)
    res = storage_fbgemm.compare(ours, storage_fbgemm.build("fbgemm_device", tables, initial,
                                                            **kw), batches[0])
    report["fbgemm"] = {"compare": res}
    if res["failures"]:
        _stop(report, args, "bench tbe --storage: fbgemm_device vs our device after one step "
              "differ, nothing timed: " + "; ".join(res["failures"]))
    print(f"  fbgemm_device vs our device after one step: weights {res['weights_rel_err']:.2g}, "
          f"state {res['state_rel_err']:.2g} (max |diff| / max, tolerance "
          f"{storage_fbgemm.REL_TOL:g})", flush=True)
    del ours
    out = {}
    for name in storage_fbgemm.PROVIDERS:
        out[name] = storage_fbgemm.build(name, tables, initial, **kw)
        for i in range(args.check_steps):
            train_step(out[name], batches[i % len(batches)])
    return out


def _stop(report: dict, args, msg: str):
    print(msg, file=sys.stderr, flush=True)
    if args.out:
        _write(report, args.out)
    raise SystemExit(1)


def _sum_stats(module: TableBatchedEmbedding) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in module.cache_stats().values():
        for k, v in s.items():
            out[k] = out.get(k, 0) + v
    return out


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not available
        return None


def _write(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
