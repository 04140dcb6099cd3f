"""VBE at the TBE: one training step (lookup, expand, backward with the fused rowwise
Adagrad) of a candidates-per-user batch, with user features at their own batch size against
the same samples with every user's bag repeated for each candidate.

    python -m fbtriton_dist.bench vbe [--device cuda] [--candidates 8] [--out vbe.json]
    python -m fbtriton_dist.bench vbe --tiny --device cpu        # CI: tiny shapes

B samples = B / K users x K candidates; ``T`` user features (read once per user) and ``T``
item features (once per sample), L ids a bag, one table of E x D per feature, uniform ids.
Without VBE the user features carry as many ids as the item features (half the ids of the
batch); with VBE a K-th of that. Providers, each timed by ``timing.Timer``:

- ``ours_fixed``: our TBE on the expanded batch (``[B, sum(D)]``);
- ``ours_vbe``: our TBE with ``batch_size_per_feature_per_rank``, then the user rows expanded
  by the inverse indices (one gather, as the EmbeddingBagCollection does);
- ``fbgemm_fixed`` / ``fbgemm_vbe``: FBGEMM's TBE the same two ways (when importable; its VBE
  is expanded the same way).

Each row: ids per step, median / pipelined ms, and the ratio of the VBE step to the fixed one
of the same provider.
"""

import argparse
import json
import os
import sys

import torch

from fbtriton_dist import TableBatchedEmbedding, optim
from fbtriton_dist.bench.tbe_cases import import_fbgemm
from fbtriton_dist.bench.timing import Timer, TimerConfig

LR, EPS = 0.01, 1e-8


def make_batches(T: int, B: int, K: int, L: int, E: int, device: torch.device, seed: int = 0):
    """(fixed, vbe): each ``(indices, offsets, batch_sizes or None)``, features ``T`` users
    then ``T`` items; and the inverse indices ``[B]`` (sample -> user)."""
    g = torch.Generator().manual_seed(seed)
    users = B // K
    user_ids = torch.randint(0, E, (T, users, L), generator=g)
    item_ids = torch.randint(0, E, (T, B, L), generator=g)
    inverse = torch.arange(B) // K
    fixed_ids = torch.cat([user_ids[:, inverse].reshape(-1), item_ids.reshape(-1)])
    vbe_ids = torch.cat([user_ids.reshape(-1), item_ids.reshape(-1)])

    def offsets(bags: int) -> torch.Tensor:
        return torch.arange(bags + 1, dtype=torch.int64) * L

    sizes = [[users]] * T + [[B]] * T
    fixed = (fixed_ids.to(device), offsets(2 * T * B).to(device), None)
    vbe = (vbe_ids.to(device), offsets(T * users + T * B).to(device), sizes)
    return fixed, vbe, inverse.to(device)


def expand(out: torch.Tensor, T: int, B: int, K: int, D: int, inverse: torch.Tensor):
    """FBGEMM's 1-D VBE output (one rank) -> ``[B, 2T * D]``: user rows by ``inverse``."""
    users = B // K
    user = out[: T * users * D].view(T, users, D)[:, inverse]  # [T, B, D]
    item = out[T * users * D:].view(T, B, D)
    return torch.cat([user, item]).permute(1, 0, 2).reshape(B, 2 * T * D)


def _providers(T, E, D, device, fbgemm: bool):
    tables = [(E, D)] * (2 * T)
    opt = optim.RowWiseAdagrad(lr=LR, eps=EPS)
    ours = TableBatchedEmbedding(tables, optimizer=opt, device=device)
    yield "ours", lambda i, o, bs: ours(i, o, batch_size_per_feature_per_rank=bs)
    if fbgemm:
        fb = import_fbgemm()
        cuda = device.type == "cuda"
        where = ((fb["EmbeddingLocation"].DEVICE, fb["ComputeDevice"].CUDA) if cuda
                 else (fb["EmbeddingLocation"].HOST, fb["ComputeDevice"].CPU))
        theirs = fb["TBE"](
            embedding_specs=[(E, D, *where) for E, D in tables],
            optimizer=fb["OptimType"].EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS,
            output_dtype=fb["SparseType"].FP32, pooling_mode=fb["PoolingMode"].SUM,
        )
        yield "fbgemm", lambda i, o, bs: theirs(i, o, batch_size_per_feature_per_rank=bs)


def run(args) -> dict:
    device = torch.device(args.device)
    T, B, K = args.features, args.batch_size, args.candidates
    L, E, D = args.bag, args.rows, args.dim
    if args.tiny:
        T, B, K, L, E, D = 2, 16, 4, 3, 100, 8
    if B % K:
        raise SystemExit(f"--batch-size {B}: expected a multiple of --candidates {K}")
    fixed, vbe, inverse = make_batches(T, B, K, L, E, device)
    timer = Timer(device, TimerConfig(warmup=args.warmup, iters=args.iters,
                                      min_iters=min(args.iters, 3), pipelined=args.iters,
                                      profiled=args.profiled if device.type == "cuda" else 0))
    try:
        import_fbgemm()
        fbgemm = True
    except Exception as e:  # a peer: without it there is nothing to compare with
        fbgemm = False
        print(f"[vbe] fbgemm not importable ({type(e).__name__}: {e}): ours only", flush=True)
    rows = []
    for name, tbe in _providers(T, E, D, device, fbgemm):
        try:
            _measure(rows, name, tbe, timer, fixed, vbe, inverse, (T, B, K, D))
        except Exception as e:
            if name == "ours":  # our own provider never skips
                raise
            rows.append({"provider": name, "failed": f"{type(e).__name__}: {e}"[:300]})
            print(f"[vbe] {name} failed: {rows[-1]['failed']}", flush=True)
    shape = dict(T_user=T, T_item=T, B=B, K=K, L=L, E=E, D=D, device=str(device),
                 optimizer="rowwise_adagrad")
    return {"shape": shape, "rows": rows, "torch": torch.__version__}


def _measure(rows: list, name, tbe, timer, fixed, vbe, inverse, dims) -> None:
    """Append ``name``'s fixed and VBE rows to ``rows`` as they are measured."""
    T, B, K, D = dims

    def fixed_step(tbe=tbe):
        out = tbe(fixed[0], fixed[1], None)
        out.backward(torch.ones_like(out))

    def vbe_step(tbe=tbe):
        out = expand(tbe(*vbe), T, B, K, D, inverse)
        out.backward(torch.ones_like(out))

    # the two ways agree before they are timed (pooled values of the first step)
    with torch.no_grad():
        a = tbe(fixed[0], fixed[1], None)
        b = expand(tbe(*vbe), T, B, K, D, inverse)
    err = (a - b).abs().max().item()
    if err > 1e-4:
        raise SystemExit(f"[vbe] {name}: the VBE lookup differs from the fixed one by {err}")
    timed = {}
    for kind, step, ids in (("fixed", fixed_step, fixed[0].numel()),
                            ("vbe", vbe_step, vbe[0].numel())):
        m = timer.measure(step)
        timed[kind] = m
        rows.append({"provider": f"{name}_{kind}", "ids": ids,
                     "median_ms": m["median_ms"], "pipelined_ms": m.get("pipelined_ms"),
                     "busy_ms": m.get("busy_ms"), "kernels": m.get("kernels")})
        print(f"[vbe] {name}_{kind}: {ids} ids, median {m['median_ms']:.3f} ms, pipelined "
              f"{m.get('pipelined_ms') or float('nan'):.3f} ms", flush=True)
    rows[-1]["vbe_over_fixed"] = timed["vbe"]["median_ms"] / timed["fixed"]["median_ms"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fbtriton_dist.bench vbe", description=__doc__,
                                allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="T=2, B=16, K=4, L=3, E=100, D=8 (CI)")
    p.add_argument("--features", type=int, default=8, help="T user and T item features")
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--candidates", type=int, default=8, help="K candidates per user")
    p.add_argument("--bag", type=int, default=20, help="L ids per bag")
    p.add_argument("--rows", type=int, default=1_000_000, help="E rows per table")
    p.add_argument("--dim", type=int, default=128, help="D")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profiled", type=int, default=5, help="iterations under the profiler (CUDA)")
    p.add_argument("--out", help="write the JSON here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny)")
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.out + ".tmp", args.out)  # never a half-written file
    else:
        sys.stdout.write(text + "\n")
