"""TBE check and benchmark: Triton kernels vs the PyTorch reference at full size, then timings
against torch.nn.functional.embedding_bag (and FBGEMM's CUDA TBE where importable).

    python -m fbtriton_dist.bench.tbe --T 32 --E 1000000 --D 128 --B 2048 --L 20 --out r.json

Prints, per phase, median ms (triton.testing.do_bench), effective GB/s with its byte count,
the fraction of the device-to-device copy bandwidth measured in the same run, and the ratio
against each peer. Needs a CUDA GPU.
"""

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from fbtriton_dist import TableBatchedEmbedding, optim


def _batch(T, E, B, L, gen, device):
    lengths = torch.randint(0, 2 * L + 1, (T * B,), generator=gen)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    indices = torch.randint(0, E, (int(offsets[-1]),), generator=gen)
    return indices.to(device), offsets.to(device)


def check(args, device) -> dict:
    """Forward, then 3 fused rowwise-Adagrad steps: Triton vs reference on the same GPU."""
    gen = torch.Generator().manual_seed(0)
    tables = [(args.E, args.D)] * args.T
    opt = optim.RowWiseAdagrad(lr=0.05)
    tri = TableBatchedEmbedding(tables, optimizer=opt, backend="triton", device=device)
    ref = TableBatchedEmbedding(tables, optimizer=opt, backend="reference", device=device)
    ref.load_state_dict(tri.state_dict())
    result = {}
    for step in range(3):
        indices, offsets = _batch(args.T, args.E, args.B, args.L, gen, device)
        grad = torch.randn(args.B, args.T * args.D, device=device, generator=None)
        out_t, out_r = tri(indices, offsets), ref(indices, offsets)
        result[f"step{step}_forward_max_abs_err"] = (out_t - out_r).abs().max().item()
        out_t.backward(grad)
        out_r.backward(grad)
    result["weights_max_abs_err"] = (tri.weights - ref.weights).abs().max().item()
    result["momentum_max_rel_err"] = (
        ((tri.momentum1 - ref.momentum1).abs() / ref.momentum1.abs().clamp(min=1e-12)).max().item()
    )
    result["rows_touched"] = int((ref.momentum1 > 0).sum())
    ok = result["weights_max_abs_err"] < 1e-5 and result["momentum_max_rel_err"] < 1e-4
    ok = ok and all(result[f"step{s}_forward_max_abs_err"] < 1e-4 for s in range(3))
    result["ok"] = bool(ok)
    del tri, ref
    torch.cuda.empty_cache()
    return result


def copy_bandwidth(device) -> float:
    """Device-to-device copy GB/s (bytes read + written) on a 4 GiB buffer."""
    x = torch.empty(1 << 30, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() * 4 / ms / 1e6


def bench(args, device, copy_gbs) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    T, E, D, B, L = args.T, args.E, args.D, args.B, args.L
    tables = [(E, D)] * T
    indices, offsets = _batch(T, E, B, L, gen, device)
    N = indices.numel()
    dtype = torch.float16 if args.fp16 else torch.float32
    esize = torch.finfo(dtype).bits // 8
    # bytes: rows read (N x D) + ids + output written; backward also writes the rows back
    fwd_bytes = N * D * esize + N * 8 + B * T * D * 4
    grad = torch.randn(B, T * D, device=device)
    rows = []

    def record(provider, phase, ms, nbytes):
        rows.append(
            dict(
                provider=provider,
                phase=phase,
                ms=ms,
                bytes=nbytes,
                gbs=nbytes / ms / 1e6,
                frac_copy_bw=nbytes / ms / 1e6 / copy_gbs,
            )
        )

    ours = {
        name: TableBatchedEmbedding(tables, optimizer=o, weights_dtype=dtype, device=device)
        for name, o in (("sgd", optim.SGD(lr=0.01)), ("adagrad", optim.RowWiseAdagrad()))
    }
    fwd_module = ours["sgd"]
    record("ours", "fwd", triton.testing.do_bench(lambda: fwd_module(indices, offsets)), fwd_bytes)
    for name, m in ours.items():
        for _ in range(3):  # first calls compile the kernels and grow the allocator's pool
            m(indices, offsets).backward(grad)
        ms = triton.testing.do_bench(lambda m=m: m(indices, offsets).backward(grad))
        record("ours", f"fwd+bwd_{name}", ms, 3 * fwd_bytes)  # fwd read + bwd read + write
    ours.clear()
    torch.cuda.empty_cache()

    # peer: one torch EmbeddingBag per table (its own kernels), dense gradients
    weights = [torch.randn(E, D, device=device, dtype=dtype, requires_grad=True) for _ in range(T)]
    off_cpu = offsets.cpu()
    segs = [(int(off_cpu[t * B]), int(off_cpu[(t + 1) * B])) for t in range(T)]
    per_t = [(indices[s:e], offsets[t * B : (t + 1) * B] - s) for t, (s, e) in enumerate(segs)]

    def torch_fwd():
        return torch.cat(
            [
                F.embedding_bag(i, w, o, mode="sum")
                for w, (i, o) in zip(weights, per_t, strict=True)
            ],
            dim=1,
        )

    def torch_fwd_bwd():
        torch_fwd().backward(grad.to(dtype))
        for w in weights:
            w.grad = None

    record("torch.embedding_bag", "fwd", triton.testing.do_bench(torch_fwd), fwd_bytes)
    record(
        "torch.embedding_bag",
        "fwd+bwd(dense grad)",
        triton.testing.do_bench(torch_fwd_bwd),
        3 * fwd_bytes,
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--T", type=int, default=32)
    p.add_argument("--E", type=int, default=1_000_000)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--B", type=int, default=2048)
    p.add_argument("--L", type=int, default=20)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fbtriton_dist.bench.tbe needs a CUDA GPU")
    device = torch.device("cuda")
    report = {"shape": vars(args), "device": torch.cuda.get_device_name()}
    if not args.skip_check:
        report["check"] = check(args, device)
        print("check Triton vs reference:", json.dumps(report["check"]))
    report["copy_gbs"] = copy_bandwidth(device)
    print(f"device-to-device copy: {report['copy_gbs']:.0f} GB/s")
    report["bench"] = bench(args, device, report["copy_gbs"])
    base = {
        r["phase"].split("(")[0].split("_")[0]: r["ms"]
        for r in report["bench"]
        if r["provider"] == "torch.embedding_bag"
    }
    for r in report["bench"]:
        peer = base.get(r["phase"].split("(")[0].split("_")[0])
        ratio = f"{peer / r['ms']:.2f}x vs torch" if peer and r["provider"] == "ours" else ""
        print(
            f"{r['provider']:>20} {r['phase']:<22} {r['ms']:8.3f} ms  {r['gbs']:7.0f} GB/s "
            f"({r['bytes'] / 1e9:.2f} GB)  {100 * r['frac_copy_bw']:5.1f}% of copy BW  {ratio}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
