"""Sweep the TBE kernels' launch configs on one GPU (the data behind forward_config and
backward_config): GPU-busy µs per kernel for each (BLOCK_L, num_warps) of the forward and
(RUNS, num_warps) of the row-update kernel.

    python -m fbtriton_dist.bench.tbe_sweep --shapes S1,S2,S4,S5 --out sweep.json
"""

import argparse
import importlib
import json
import os
import time

import torch

from fbtriton_dist import TableBatchedEmbedding, optim

# rows of `bench dist`'s 26 tables (the Criteo set scaled to 20 GB fp32 at D=128)
BENCH_ROWS = (8297418, 8122, 3596, 1543, 4215, 3, 1481, 1000, 63, 8016265, 614445, 83910, 10,
              1000, 2483, 155, 4, 976, 14, 8317257, 5334329, 8251770, 121895, 2698, 108, 36)
SHAPES = {  # name: (tables [(E, D)], B, L, weights dtype, zipf exponent or 0)
    "S0": ([(100_000, 128)] * 32, 512, 20, torch.float32, 0.0),
    "S1": ([(1_000_000, 128)] * 32, 2048, 20, torch.float32, 0.0),
    "S2": ([(1_000_000, 128)] * 32, 2048, 20, torch.float16, 0.0),
    "S3": ([(1_000_000, 128)] * 32, 2048, 20, torch.float32, 1.05),
    "S4": ([(10_000_000, 256)] * 8, 4096, 40, torch.float16, 0.0),
    "S5": ([(1_000_000, 64)] * 16 + [(1_000_000, 256)] * 16, 2048, 20, torch.float32, 0.0),
    "S6": ([(1_000_000, 128)] * 8, 65536, 20, torch.float32, 1.15),
    # one rank of `bench dist`'s row-wise step (2 ranks): half of each of its 26 tables, both
    # ranks' bags with the half of their 20 ids that land there
    "RW": ([(max(1, E // 2), 128) for E in BENCH_ROWS], 16384, 10, torch.float32, 1.1),
}


def make_batch(tables, B, L, zipf, gen, device):
    """Fixed bag size L, table-major; Zipf ranks mapped to rows by a permutation per table."""
    ids = []
    for E, _ in tables:
        if zipf:
            p = torch.arange(1, E + 1, dtype=torch.float64).pow(-zipf)
            cdf = torch.cumsum(p / p.sum(), 0)
            ranks = torch.searchsorted(cdf, torch.rand(B * L, generator=gen, dtype=torch.float64))
            ids.append(torch.randperm(E, generator=gen)[ranks.clamp(max=E - 1)])
        else:
            ids.append(torch.randint(0, E, (B * L,), generator=gen))
    indices = torch.cat(ids).to(device)
    offsets = torch.arange(0, len(tables) * B * L + 1, L, device=device)
    return indices, offsets


def compiled_regs() -> dict[str, list[int]]:
    """[registers, spilled bytes] of each TBE kernel compiled so far (its last variant)."""
    out = {}
    kernels = (("tbe_forward", ["_FORWARD"]),
               ("tbe_backward", ["_RUN_COUNT", "_RUNS", "_CHUNKS"]), ("tbe_rows", ["_ROWS"]))
    for mod, names in kernels:
        module = importlib.import_module(f"fbtriton_dist.kernels.{mod}")
        for name in names:
            for compiled in module.LAUNCHERS[name].cache.values():
                out[name] = [getattr(compiled, "n_regs", -1), getattr(compiled, "n_spills", -1)]
    return out


def kernel_us(fn, iters=5) -> dict[str, float]:
    """µs per iteration of each CUDA kernel (profiler), plus 'busy' = their sum."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if t > 0:
            out[evt.key[:60]] = t / iters
    out["busy"] = sum(out.values())
    return out


def host_profile(fn, iters=20) -> list[tuple[str, float, int]]:
    """(op, self CPU µs per iteration, calls per iteration) of the top host-side costs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = [
        (e.key[:70], e.self_cpu_time_total / iters, e.count // iters)
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])[:25]


def bucketize_sweep(configs: list[str], device, B: int = 8192, L: int = 20, rows=BENCH_ROWS,
                    time=kernel_us) -> list[dict]:
    """µs of the bucketize kernels per ``FBTD_BUCKETIZE`` config on `bench dist`'s batch (the
    26 tables of RW at full size, B=8192, L=20, Zipf 1.1), cut for one rank (one shard per
    feature) and for two row-wise ranks (two); ``same``: output equal to the first config's.
    Each config is timed twice: ``bucketize`` (lengths and ids out) and
    ``bucketize_into+check`` (what the fixed-shape input dist runs: every destination's ids
    and int32 lengths at their place in one send buffer, the batch checked, the flag written
    into every message; ``same``: its lengths equal and no flag raised)."""
    kb = importlib.import_module("fbtriton_dist.kernels.bucketize")
    E = rows
    idx, off = make_batch([(e, 1) for e in E], B, L, 1.1, torch.Generator().manual_seed(0),
                          device)
    results = []
    for R in (1, 2):
        cuts = [(r, f, min(e, r * -(-e // R)), min(e, (r + 1) * -(-e // R)))
                for r in range(R) for f, e in enumerate(E)]  # destination-major
        columns = list(zip(*cuts, strict=True))[1:]
        sf_feature, lo, hi = (torch.tensor(c, device=device) for c in columns)
        table = kb.by_feature(sf_feature.tolist()).to(device)

        def run(sf_feature=sf_feature, lo=lo, hi=hi, table=table):
            return kb.bucketize(idx, off, None, sf_feature, lo, hi, B, capacity=idx.numel(),
                                table=table)

        # the fixed-shape send path: every destination's ids and int32 lengths at their own
        # place in one buffer, the ids and bags checked, the flag written into each message
        S, n = len(cuts), idx.numel()
        dest = torch.tensor([c[0] for c in cuts], device=device)
        send = torch.empty(R * (n + S // R * B + 1), dtype=torch.int64, device=device)
        slot = torch.arange(S, device=device)
        first_s = torch.searchsorted(dest, dest)  # each destination's first shard-feature
        where = dict(sf_first=first_s * B, sf_id_start=dest * n, sf_w_start=dest * n,
                     sf_len_start=slot * B)
        meta_at = R * n + S * B + torch.arange(R, device=device)
        cover = torch.ones(table.shape[0], dtype=torch.int64, device=device)

        ids_out = send[: R * n]
        len_out = send[R * n: R * n + S * B].view(torch.int32)[: S * B]

        def run_into(sf_feature=sf_feature, lo=lo, hi=hi, table=table, send=send, where=where,
                     meta_at=meta_at, cover=cover, ids_out=ids_out, len_out=len_out, cap=n):
            lengths = kb.bucketize_into(
                idx, off, None, sf_feature, lo, hi, B, ids_out, None, len_out, **where,
                table=table, check=(cover, send, meta_at), capacity=cap)
            return lengths, send

        first = None
        for cfg in configs:
            os.environ["FBTD_BUCKETIZE"] = cfg
            out = run()
            first = first if first is not None else out
            same = all(torch.equal(a, b) for a, b in zip(out[:2], first[:2], strict=True))
            r = {"phase": "bucketize", "shards": R, "config": cfg, "same": same,
                 **time(run, iters=10)}
            print(json.dumps(r), flush=True)
            results.append(r)
            lengths, buf = run_into()
            ok = torch.equal(lengths, out[0]) and int(buf[meta_at].sum()) == 0
            r = {"phase": "bucketize_into+check", "shards": R, "config": cfg, "same": ok,
                 **time(run_into, iters=10)}
            print(json.dumps(r), flush=True)
            results.append(r)
        os.environ.pop("FBTD_BUCKETIZE")
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="S1,S2,S4,S5")
    p.add_argument("--fwd", default="8,4;16,4;32,4;16,2;32,8;64,4")
    # FBTD_TBE_BWD values: runs,num_warps[,ids[,chunk[,maxnreg]]] (fields not given: default)
    p.add_argument("--bwd", default="1,1;1,1,1,256,0;2,1,1,256,0;1,1,2;1,1,1,128;1,2")
    p.add_argument("--optimizer", default="rowwise_adagrad",
                   choices=["rowwise_adagrad", "adagrad", "adam", "sgd"])
    p.add_argument("--bounds", default="warn", choices=["warn", "ignore"],
                   help="bounds_check of the module (the sharded path uses ignore)")
    p.add_argument("--bucketize", metavar="CFGS",
                   help="only sweep the input dist's bucketize: bags,block,warps;... "
                   "(FBTD_BUCKETIZE values), e.g. 32,32,4;8,16,1")
    p.add_argument("--out", default=None)
    p.add_argument("--inference", action="store_true",
                   help="time the fwd phase under no_grad (bench tbe's fwd; no backward plan)")
    p.add_argument("--host", action="store_true", help="also profile host time per step")
    p.add_argument("--launch", action="store_true", help="pipelined ms, fast launch off / on")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    results = []
    if args.bucketize:
        results = bucketize_sweep(args.bucketize.split(";"), device)
    for name in args.shapes.split(",") if not args.bucketize else []:
        tables, B, L, dtype, zipf = SHAPES[name]
        gen = torch.Generator().manual_seed(0)
        indices, offsets = make_batch(tables, B, L, zipf, gen, device)
        tbe = TableBatchedEmbedding(
            tables,
            optimizer={
                "rowwise_adagrad": lambda: optim.RowWiseAdagrad(lr=0.01, eps=1e-8),
                "adagrad": lambda: optim.Adagrad(lr=0.01, eps=1e-8),
                "adam": lambda: optim.Adam(lr=0.01),
                "sgd": lambda: optim.SGD(lr=0.01),
            }[args.optimizer](),
            weights_dtype=dtype,
            bounds_check=args.bounds,
            device=device,
            init_weights=False,
        )
        with torch.no_grad():
            tbe.weights.uniform_(-0.1, 0.1)
        grad = torch.randn(B, sum(D for _, D in tables), device=device)

        def fwd(tbe=tbe, indices=indices, offsets=offsets, inference=args.inference):
            with torch.set_grad_enabled(not inference):
                return tbe(indices, offsets)

        def step(tbe=tbe, indices=indices, offsets=offsets, grad=grad):
            tbe(indices, offsets).backward(grad)

        if args.launch:
            fwd_mod = importlib.import_module("fbtriton_dist.kernels.tbe_forward")
            bwd_mod = importlib.import_module("fbtriton_dist.kernels.tbe_backward")
            rows_mod = importlib.import_module("fbtriton_dist.kernels.tbe_rows")
            launchers = [fwd_mod.LAUNCHERS["_FORWARD"], bwd_mod.LAUNCHERS["_RUNS"],
                         bwd_mod.LAUNCHERS["_CHUNKS"], rows_mod.LAUNCHERS["_ROWS"]]
            for fast in (False, True, False, True):
                for launcher in launchers:
                    launcher.enabled = fast
                for fn in (fwd, step):
                    for _ in range(3):
                        fn()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(50):
                        fn()
                    torch.cuda.synchronize()
                    ms = (time.perf_counter() - t0) / 50 * 1e3
                    r = {
                        "shape": name,
                        "phase": fn.__name__,
                        "fast_launch": fast,
                        "pipelined_ms": ms,
                    }
                    print(json.dumps(r), flush=True)
                    results.append(r)
        if args.host:
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            for fn in (fwd, step):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                t0.record()
                for _ in range(20):
                    fn()
                t1.record()
                torch.cuda.synchronize()
                rows = host_profile(fn)
                r = {"shape": name, "phase": fn.__name__, "pipelined_ms": t0.elapsed_time(t1) / 20}
                r["host_self_cpu_us"] = {k: [round(us, 1), n] for k, us, n in rows}
                r["host_total_us"] = round(sum(us for _, us, _ in rows), 1)
                print(json.dumps(r), flush=True)
                results.append(r)
        for cfg in args.fwd.split(";"):
            os.environ["FBTD_TBE_FWD"] = cfg
            r = {"shape": name, "phase": "fwd", "config": cfg, **kernel_us(fwd),
                 "regs": compiled_regs()}
            print(json.dumps(r), flush=True)
            results.append(r)
        os.environ.pop("FBTD_TBE_FWD")
        for cfg in args.bwd.split(";"):
            os.environ["FBTD_TBE_BWD"] = cfg
            r = {"shape": name, "phase": f"fwd_bwd_{args.optimizer}", "config": cfg,
                 **kernel_us(step),
                 "regs": compiled_regs()}
            print(json.dumps(r), flush=True)
            results.append(r)
        os.environ.pop("FBTD_TBE_BWD")
        del tbe, fwd, step
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
