"""TBE benchmark (issue 3): our Triton TableBatchedEmbedding vs FBGEMM's CUDA TBE and torch.

    python -m fbtriton_dist.bench tbe --out tbe.json            # S0..S6, every provider (GPU)
    python -m fbtriton_dist.bench tbe --tiny --device cpu       # CI: tiny shapes, CPU providers
    python -m fbtriton_dist.bench tbe --plot tbe.json --png tbe.png   # chart, no GPU needed

Providers: ``ours`` (Triton, bounds_check="warn"), ``ours_checked`` (bounds_check="error",
synchronous), ``reference`` (the same module on the PyTorch reference), ``torch_pt``
(F.embedding_bag per table + cat; dense grad + torch.optim), ``torch_fused`` (one concatenated
table per distinct D, shifted ids; dense grad + torch.optim), ``torch_pt_sparse`` /
``torch_fused_sparse`` (sparse=True grads + index_add_ for SGD, torch.optim.Adagrad on the sparse
grad), ``fbgemm`` (SplitTableBatchedEmbeddingBagsCodegen, when importable).
Phases: ``fwd`` (a training forward), ``fwd_bwd_sgd``, ``fwd_bwd_rowwise_adagrad`` (fused
providers update inside backward; torch ones run backward + step + zero_grad; torch's Adagrad is
per-element). ``bwd`` = fwd_bwd - fwd is printed as derived.

Per (shape, provider, phase): median ms (L2 flushed, CUDA events), pipelined ms, GPU-busy ms
(profiler), effective GB/s with the byte count beside it (BASELINES.md's model), % of the copy
bandwidth measured in this process, speedup against every other provider, peak memory, and for
``ours``/``fbgemm`` the per-kernel µs/iter. Method: ../shared/tools/fbgemm-sm90/BASELINES.md.
"""

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fbtriton_dist import optim
from fbtriton_dist.bench.timing import Timer, TimerConfig, copy_bandwidth
from fbtriton_dist.modules import TableBatchedEmbedding

LR, EPS = 0.01, 1e-8
PHASES = ("fwd", "fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad")
PROVIDERS = (
    "ours",
    "ours_checked",
    "reference",
    "fbgemm",
    "torch_pt",
    "torch_pt_sparse",
    "torch_fused",
    "torch_fused_sparse",
)
DEFAULT_PROVIDERS = {
    "cuda": [p for p in PROVIDERS if p != "reference"],
    "cpu": ["reference", "torch_pt", "torch_pt_sparse", "torch_fused", "torch_fused_sparse"],
}
# a name in --providers also selects its variants; "torch" selects all four torch providers
ALIASES = {
    "torch": ["torch_pt", "torch_pt_sparse", "torch_fused", "torch_fused_sparse"],
    "torch_pt": ["torch_pt", "torch_pt_sparse"],
    "torch_fused": ["torch_fused", "torch_fused_sparse"],
}
# whose forward a provider without a fwd phase shares (for the derived bwd)
FWD_OF = {"torch_pt_sparse": "torch_pt", "torch_fused_sparse": "torch_fused"}
KERNEL_TABLE_PROVIDERS = ("ours", "ours_checked", "fbgemm")


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One benchmark shape: fixed bag size L, int64 ids, table-major (``[T][B][L]``)."""

    name: str
    """S0..S6."""
    groups: tuple[tuple[int, int, int], ...]
    """(number of tables, E rows, D dim) per group of equal tables, in table order."""
    B: int
    """Batch size."""
    L: int
    """Ids per bag (fixed)."""
    dtype: torch.dtype = torch.float32
    """Weights dtype (the fused providers' output is fp32; torch's is the weights dtype)."""
    zipf: float | None = None
    """Zipf exponent s of the ids (p(rank k) ∝ k^-s, ranks scattered by a permutation), or
    None for uniform ids."""

    @property
    def tables(self) -> list[tuple[int, int]]:
        return [(E, D) for n, E, D in self.groups for _ in range(n)]

    @property
    def weight_bytes(self) -> int:
        return sum(E * D for E, D in self.tables) * _esize(self.dtype)

    def tiny(self) -> "Shape":
        """The same shape scaled to CPU size: E <= 1000, B <= 16, T <= 4 (every group kept)."""
        per = max(1, 4 // len(self.groups))
        groups = tuple((min(n, per), min(E, 1000), D) for n, E, D in self.groups)
        return dataclasses.replace(self, groups=groups, B=min(self.B, 16))

    def describe(self) -> str:
        tabs = " + ".join(f"{n}x(E{E:.0e} D{D})".replace("e+0", "e") for n, E, D in self.groups)
        ids = f"zipf({self.zipf})" if self.zipf else "uniform"
        return f"{tabs} B{self.B} L{self.L} {str(self.dtype).removeprefix('torch.')} {ids}"


SHAPES = {
    s.name: s
    for s in (
        Shape(name="S0", groups=((32, 100_000, 128),), B=512, L=20),
        Shape(name="S1", groups=((32, 1_000_000, 128),), B=2048, L=20),
        Shape(name="S2", groups=((32, 1_000_000, 128),), B=2048, L=20, dtype=torch.float16),
        Shape(name="S3", groups=((32, 1_000_000, 128),), B=2048, L=20, zipf=1.05),
        Shape(name="S4", groups=((8, 10_000_000, 256),), B=4096, L=40, dtype=torch.float16),
        Shape(name="S5", groups=((16, 1_000_000, 64), (16, 1_000_000, 256)), B=2048, L=20),
        Shape(name="S6", groups=((8, 1_000_000, 128),), B=65536, L=20, zipf=1.15),
    )
}


def _esize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


@dataclass
class Batch:
    """One batch of ids for a shape, and what the bytes model needs to know about it."""

    indices: torch.Tensor  # [N] int64, table-major
    offsets: torch.Tensor  # [T*B+1] int64
    grad: torch.Tensor  # [B, sum(D)] fp32, the upstream gradient
    lookups: list[int]  # N_t per table
    unique: list[int]  # U_t distinct rows per table


def make_batch(shape: Shape, device: torch.device, seed: int = 0) -> Batch:
    """Uniform or Zipf ids (inverse-CDF over ranks, ranks mapped to rows by a random
    permutation per table), fixed bag size L."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ids, unique = [], []
    n = shape.B * shape.L
    cdfs: dict[int, torch.Tensor] = {}
    for E, _ in shape.tables:
        if shape.zipf is None:
            t_ids = torch.randint(0, E, (n,), generator=gen, device=device)
        else:
            if E not in cdfs:
                k = torch.arange(1, E + 1, dtype=torch.float64, device=device)
                cdf = torch.cumsum(k.pow(-shape.zipf), 0)
                cdfs[E] = cdf / cdf[-1]
            u = torch.rand(n, generator=gen, dtype=torch.float64, device=device)
            rank = torch.searchsorted(cdfs[E], u).clamp_(max=E - 1)
            t_ids = torch.randperm(E, generator=gen, device=device)[rank]
        ids.append(t_ids)
        unique.append(int(torch.unique(t_ids).numel()))
    T = len(shape.tables)
    offsets = torch.arange(T * shape.B + 1, dtype=torch.int64, device=device) * shape.L
    total_D = sum(D for _, D in shape.tables)
    grad = torch.randn(shape.B, total_D, generator=gen, device=device)
    return Batch(torch.cat(ids), offsets, grad, [n] * T, unique)


def model_bytes(shape: Shape, batch: Batch, phase: str, out_size: int) -> int:
    """BASELINES.md's useful bytes: fwd = every looked-up row read + pooled output written;
    fwd_bwd adds the output gradient read and each unique row read and written once (+ its
    fp32 rowwise-Adagrad state). Ids and offsets are not counted."""
    w = _esize(shape.dtype)
    dims = [D for _, D in shape.tables]
    out = shape.B * sum(dims) * out_size
    nbytes = sum(n * D * w for n, D in zip(batch.lookups, dims, strict=True)) + out
    if phase != "fwd":
        nbytes += out + sum(2 * u * D * w for u, D in zip(batch.unique, dims, strict=True))
        if phase == "fwd_bwd_rowwise_adagrad":
            nbytes += sum(2 * u * 4 for u in batch.unique)
    return nbytes


@dataclass
class Context:
    shape: Shape
    batch: Batch
    device: torch.device
    phases: list[str]
    dense_limit_gb: float


def _free() -> None:
    """Give a freed module's memory back before the next one is built (CUDA only: on CPU a
    full gc.collect costs more than the tiny shapes' measurements)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- providers
# Each yields (phase, step callable) or (phase, "skipped: why"), building one module at a time.


def _ours_cases(ctx: Context, backend: str, bounds_check: str) -> Iterator[tuple[str, object]]:
    idx, off, grad = ctx.batch.indices, ctx.batch.offsets, ctx.batch.grad
    m = TableBatchedEmbedding(
        ctx.shape.tables,
        optimizer=optim.SGD(lr=LR),
        weights_dtype=ctx.shape.dtype,
        bounds_check=bounds_check,
        backend=backend,
        device=ctx.device,
    )
    if "fwd" in ctx.phases:
        yield "fwd", lambda: m(idx, off)
    if "fwd_bwd_sgd" in ctx.phases:
        yield "fwd_bwd_sgd", lambda: m(idx, off).backward(grad)
    if "fwd_bwd_rowwise_adagrad" in ctx.phases:
        m.set_optimizer(optim.RowWiseAdagrad(lr=LR, eps=EPS))
        yield "fwd_bwd_rowwise_adagrad", lambda: m(idx, off).backward(grad)


def _import_fbgemm():
    import fbgemm_gpu  # noqa: F401  (loads the operator libraries)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return dict(
        TBE=SplitTableBatchedEmbeddingBagsCodegen,
        OptimType=EmbOptimType,
        SparseType=SparseType,
        EmbeddingLocation=EmbeddingLocation,
        PoolingMode=PoolingMode,
        ComputeDevice=ComputeDevice,
    )


def fbgemm_tbe(shape: Shape, optimizer: str, device: torch.device):
    """BASELINES.md's construction: EXACT_SGD / EXACT_ROWWISE_ADAGRAD, lr 0.01, eps 1e-8, fp32
    output, SUM pooling, all else default; weights uniform(-0.1, 0.1). On CPU: FBGEMM's CPU TBE."""
    fb = _import_fbgemm()
    if device.type == "cuda":
        where = (fb["EmbeddingLocation"].DEVICE, fb["ComputeDevice"].CUDA)
    else:
        where = (fb["EmbeddingLocation"].HOST, fb["ComputeDevice"].CPU)
    kind = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD"}[optimizer]
    precision = {torch.float32: "FP32", torch.float16: "FP16"}[shape.dtype]
    emb = fb["TBE"](
        embedding_specs=[(E, D, *where) for E, D in shape.tables],
        optimizer=getattr(fb["OptimType"], kind),
        learning_rate=LR,
        eps=EPS,
        weights_precision=getattr(fb["SparseType"], precision),
        output_dtype=fb["SparseType"].FP32,
        pooling_mode=fb["PoolingMode"].SUM,
    )
    emb.init_embedding_weights_uniform(-0.1, 0.1)
    return emb


def _fbgemm_cases(ctx: Context) -> Iterator[tuple[str, object]]:
    idx, off, grad = ctx.batch.indices, ctx.batch.offsets, ctx.batch.grad
    if "fwd" in ctx.phases or "fwd_bwd_sgd" in ctx.phases:
        emb = fbgemm_tbe(ctx.shape, "sgd", ctx.device)
        if "fwd" in ctx.phases:
            yield "fwd", lambda: emb(idx, off)
        if "fwd_bwd_sgd" in ctx.phases:
            yield "fwd_bwd_sgd", lambda: emb(idx, off).backward(grad)
        del emb
        _free()
    if "fwd_bwd_rowwise_adagrad" in ctx.phases:
        emb2 = fbgemm_tbe(ctx.shape, "rowwise_adagrad", ctx.device)
        yield "fwd_bwd_rowwise_adagrad", lambda: emb2(idx, off).backward(grad)


def _torch_lookup(ctx: Context, fused: bool, sparse: bool):
    """(parameters, forward) for torch's embedding_bag: per table, or one concatenated table
    per distinct D (ids shifted by the table's first row) with the [T, B, D] -> [B, T*D] copy."""
    shape, batch, dev = ctx.shape, ctx.batch, ctx.device
    B, tables = shape.B, shape.tables
    bounds = batch.offsets[::B].tolist()  # first id of each table, and N: [T + 1]
    starts = batch.offsets[:-1]  # [T*B] start of each bag

    def new_param(rows: int, D: int) -> torch.nn.Parameter:
        w = torch.empty(rows, D, dtype=shape.dtype, device=dev).uniform_(-0.1, 0.1)
        return torch.nn.Parameter(w)

    if not fused:
        params = [new_param(E, D) for E, D in tables]
        inputs = [
            (batch.indices[bounds[t] : bounds[t + 1]], starts[t * B : (t + 1) * B] - bounds[t])
            for t in range(len(tables))
        ]

        def forward() -> torch.Tensor:
            return torch.cat(
                [
                    F.embedding_bag(i, w, o, mode="sum", sparse=sparse)
                    for w, (i, o) in zip(params, inputs, strict=True)
                ],
                dim=1,
            )

        return params, forward

    by_dim: dict[int, list[int]] = {}
    for t, (_, D) in enumerate(tables):
        by_dim.setdefault(D, []).append(t)
    params, inputs = [], []
    for D, ts in by_dim.items():
        row0 = [0, *torch.tensor([tables[t][0] for t in ts]).cumsum(0).tolist()]
        params.append(new_param(row0[-1], D))
        ids = torch.cat(
            [batch.indices[bounds[t] : bounds[t + 1]] + row0[k] for k, t in enumerate(ts)]
        )
        lengths = torch.cat([batch.offsets.diff()[t * B : (t + 1) * B] for t in ts])
        offs = torch.cumsum(lengths, 0) - lengths
        inputs.append((ids, offs, len(ts), D))

    def forward_fused() -> torch.Tensor:
        outs = [
            F.embedding_bag(i, w, o, mode="sum", sparse=sparse)
            .view(n, B, D)
            .permute(1, 0, 2)
            .reshape(B, n * D)
            for w, (i, o, n, D) in zip(params, inputs, strict=True)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    return params, forward_fused


def _torch_cases(ctx: Context, fused: bool, sparse: bool) -> Iterator[tuple[str, object]]:
    shape = ctx.shape
    w_bytes, state_bytes = shape.weight_bytes, sum(E * D for E, D in shape.tables) * 4
    limit = ctx.dense_limit_gb * 1e9
    need = {  # weights + dense grad / dense optimizer state, what each mode allocates up front
        "fwd_bwd_sgd": w_bytes if sparse else 2 * w_bytes,
        "fwd_bwd_rowwise_adagrad": w_bytes + state_bytes + (0 if sparse else w_bytes),
    }
    params, forward = _torch_lookup(ctx, fused, sparse)
    grad = ctx.batch.grad.to(shape.dtype)
    if "fwd" in ctx.phases and not sparse:  # a sparse=True forward is the same kernel
        yield "fwd", forward
    for phase in ("fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad"):
        if phase not in ctx.phases:
            continue
        if need[phase] > limit:
            parts = ["weights", *(["dense grad"] if not sparse else [])]
            parts += ["fp32 Adagrad state"] if "adagrad" in phase else []
            yield (
                phase,
                (
                    f"skipped: needs {need[phase] / 1e9:.1f} GB ({' + '.join(parts)}) "
                    f"> --dense-limit-gb {ctx.dense_limit_gb:g}"
                ),
            )
            continue
        if phase == "fwd_bwd_sgd" and sparse:

            def step() -> None:
                forward().backward(grad)
                with torch.no_grad():
                    for p in params:
                        g = p.grad  # uncoalesced COO: duplicates are summed by index_add_
                        p.index_add_(0, g._indices()[0], g._values(), alpha=-LR)
                        p.grad = None

            yield phase, step
            continue
        if phase == "fwd_bwd_sgd":
            opt = torch.optim.SGD(params, lr=LR)
        else:  # torch has no row-wise Adagrad: per-element, sparse-aware when grads are sparse
            opt = torch.optim.Adagrad(params, lr=LR, eps=EPS, foreach=False if sparse else None)

        def step_opt(opt=opt) -> None:
            forward().backward(grad)
            opt.step()
            opt.zero_grad(set_to_none=True)

        yield phase, step_opt
        del opt, step_opt


def provider_cases(name: str, ctx: Context) -> Iterator[tuple[str, object]]:
    if name == "ours":
        return _ours_cases(ctx, "triton", "warn")
    if name == "ours_checked":
        return _ours_cases(ctx, "triton", "error")
    if name == "reference":
        return _ours_cases(ctx, "reference", "warn")
    if name == "fbgemm":
        return _fbgemm_cases(ctx)
    fused = name.startswith("torch_fused")
    return _torch_cases(ctx, fused=fused, sparse=name.endswith("_sparse"))


def output_size(provider: str, shape: Shape) -> int:
    return _esize(shape.dtype) if provider.startswith("torch") else 4


# ---------------------------------------------------------------- correctness


def compare_with_fbgemm(ctx: Context, backend: str) -> dict:
    """Same weights in FBGEMM's TBE and ours: forward outputs, then table 0's rows after one
    EXACT_SGD step (touched rows vs each other and vs the exact w - lr * sum(grad rows), plus
    4096 random untouched rows that must not move)."""
    shape, batch, dev = ctx.shape, ctx.batch, ctx.device
    idx, off, grad = batch.indices, batch.offsets, batch.grad
    fb = fbgemm_tbe(shape, "sgd", dev)
    ours = TableBatchedEmbedding(
        shape.tables,
        optimizer=optim.SGD(lr=LR),
        weights_dtype=shape.dtype,
        bounds_check="warn",
        backend=backend,
        device=dev,
        init_weights=False,
    )
    with torch.no_grad():
        for a, b in zip(ours.split_embedding_weights(), fb.split_embedding_weights(), strict=True):
            a.copy_(b.reshape(a.shape))
    out_f, out_o = fb(idx, off), ours(idx, off)
    fwd_err = ((out_o.float() - out_f.float()).abs().max() / out_f.abs().max()).item()

    E0, D0 = shape.tables[0]
    ids0 = idx[: batch.lookups[0]]
    touched, inverse = torch.unique(ids0, return_inverse=True)
    bag = torch.repeat_interleave(
        torch.arange(shape.B, device=dev), off[1 : shape.B + 1] - off[: shape.B]
    )
    exact = torch.zeros(touched.numel(), D0, dtype=torch.float64, device=dev)
    exact.index_add_(0, inverse, grad[bag, :D0].double()).mul_(-LR)
    sample = torch.randint(0, E0, (4096,), device=dev)
    untouched = sample[~torch.isin(sample, touched)]
    w_f, w_o = fb.split_embedding_weights()[0].view(E0, D0), ours.split_embedding_weights()[0]
    before = w_f[touched].double(), w_f[untouched].double()
    out_f.backward(grad)
    out_o.backward(grad)
    d_f, d_o = w_f[touched].double() - before[0], w_o[touched].double() - before[0]
    scale = exact.abs().max().clamp(min=1e-30)
    result = {
        "fwd_rel_err": fwd_err,
        "sgd_rel_err_ours_vs_fbgemm": ((d_o - d_f).abs().max() / scale).item(),
        "sgd_rel_err_ours_vs_exact": ((d_o - exact).abs().max() / scale).item(),
        "sgd_rel_err_fbgemm_vs_exact": ((d_f - exact).abs().max() / scale).item(),
        "untouched_max_abs_change_ours": (w_o[untouched].double() - before[1]).abs().max().item()
        if untouched.numel()
        else 0.0,
        "rows_compared": int(touched.numel()),
        "ours_backend": backend,
    }
    fp16 = shape.dtype == torch.float16  # both round fp16 updates stochastically
    tol_fwd, tol_sgd = 1e-5, (1e-2 if fp16 else 1e-4)
    result["ok"] = bool(
        result["fwd_rel_err"] <= tol_fwd
        and result["sgd_rel_err_ours_vs_fbgemm"] <= tol_sgd
        and result["sgd_rel_err_ours_vs_exact"] <= tol_sgd
        and result["untouched_max_abs_change_ours"] == 0.0
    )
    result["tolerance"] = {"fwd": tol_fwd, "sgd": tol_sgd}
    del fb, ours, out_f, out_o, w_f, w_o, before, d_f, d_o, exact
    _free()
    return result


def _random_length_batch(T, E, B, L, gen, device):
    lengths = torch.randint(0, 2 * L + 1, (T * B,), generator=gen)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    indices = torch.randint(0, E, (int(offsets[-1]),), generator=gen)
    return indices.to(device), offsets.to(device)


def check(shape: Shape, device: torch.device) -> dict:
    """Forward, then 3 fused rowwise-Adagrad steps: Triton vs reference on the same device,
    at the shape's full size (fp32 weights, bag sizes 0..2L so empty bags are covered)."""
    gen = torch.Generator().manual_seed(0)
    tables = shape.tables
    E_min = min(E for E, _ in tables)
    opt = optim.RowWiseAdagrad(lr=0.05)
    tri = TableBatchedEmbedding(tables, optimizer=opt, backend="triton", device=device)
    ref = TableBatchedEmbedding(tables, optimizer=opt, backend="reference", device=device)
    ref.load_state_dict(tri.state_dict())
    result = {}
    for step in range(3):
        indices, offsets = _random_length_batch(len(tables), E_min, shape.B, shape.L, gen, device)
        grad = torch.randn(shape.B, sum(D for _, D in tables), device=device)
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
    _free()
    return result


# ---------------------------------------------------------------- driver


def run_shape(ctx: Context, providers: list[str], timer: Timer, copy_gbs: float) -> list[dict]:
    rows = []
    for provider in providers:
        base = dict(shape=ctx.shape.name, provider=provider)
        done: set[str] = set()
        cases = provider_cases(provider, ctx)
        if provider == "fbgemm" and ctx.device.type != "cuda":
            msg = "skipped: FBGEMM's CUDA TBE needs --device cuda"
            cases = (item for item in [(p, msg) for p in ctx.phases])
        while True:
            try:
                phase, fn = next(cases)
            except StopIteration:
                break
            except Exception as e:  # building the module failed: the remaining phases fail
                msg = f"{type(e).__name__}: {e}"
                print(f"  {provider}: ERROR {msg}", flush=True)
                for phase in ctx.phases:
                    if phase not in done and not (phase == "fwd" and provider in FWD_OF):
                        rows.append(dict(base, phase=phase, error=msg))
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
            for when in ("busy", "median"):
                gbs = nbytes / row[f"{when}_ms"] / 1e6
                row[f"gbs_{when}"] = gbs
                row[f"pct_copy_{when}"] = 100 * gbs / copy_gbs
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(
                f"  {provider:<18} {phase:<24} busy {row['busy_ms']:9.3f} ms  "
                f"median {row['median_ms']:9.3f} ms  ({row['wall_s']:.1f} s)",
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
        prog="python -m fbtriton_dist.bench tbe", description=__doc__.split("\n")[0]
    )
    p.add_argument("--shapes", default=None, help=f"comma list of {list(SHAPES)} (default all)")
    p.add_argument("--providers", default=None, help=f"comma list of {list(PROVIDERS)} or torch")
    p.add_argument("--phases", default=None, help=f"comma list of {list(PHASES)}")
    p.add_argument("--tiny", action="store_true", help="E<=1000, B<=16, T<=4 (CPU, CI)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--check", action="store_true", help="first, Triton vs reference per shape")
    p.add_argument("--no-compare", action="store_true", help="skip ours-vs-fbgemm correctness")
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write everything as JSON here")
    p.add_argument("--plot", default=None, metavar="JSON", help="only plot this JSON (no GPU)")
    p.add_argument("--png", default=None, help="where --plot writes (default JSON's name .png)")
    return p.parse_args(argv)


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
    shapes = [SHAPES[n] for n in _select(args.shapes, list(SHAPES), SHAPES, "shapes")]
    if args.tiny:
        shapes = [s.tiny() for s in shapes]
    providers = _select(args.providers, DEFAULT_PROVIDERS[device.type], PROVIDERS, "providers")
    phases = _select(args.phases, list(PHASES), PHASES, "phases")
    cpu = device.type == "cpu"
    if cpu and args.tiny:  # tiny ops: one thread avoids OpenMP spin-waits on a shared CPU
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
        fp32_bytes = sum(E * D for E, D in shape.tables) * 4
        if args.check and 2 * fp32_bytes > args.dense_limit_gb * 1e9:
            report["check"][shape.name] = {
                "skipped": f"two fp32 modules need {2 * fp32_bytes / 1e9:.1f} GB "
                f"> --dense-limit-gb {args.dense_limit_gb:g}"
            }
            print(f"  check Triton vs reference: {report['check'][shape.name]['skipped']}")
        elif args.check:
            try:
                report["check"][shape.name] = check(shape, device)
            except Exception as e:
                report["check"][shape.name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  check Triton vs reference: {json.dumps(report['check'][shape.name])}")
        try:
            batch = make_batch(shape, device, args.seed)
        except Exception as e:
            report["shapes"][shape.name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"  batch: ERROR {e}")
            continue
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
        if "fbgemm" in providers and ours_like and not args.no_compare:
            backend = "triton" if ours_like == "ours" else "reference"
            try:
                res = compare_with_fbgemm(ctx, backend)
            except Exception as e:
                res = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                _free()
            report["correctness"][shape.name] = res
            print(f"  correctness {ours_like} vs fbgemm: {json.dumps(res)}", flush=True)
        rows = run_shape(ctx, providers, timer, copy_gbs)
        derived = derived_bwd(rows)
        report["rows"] += rows
        report["derived"] += derived
        print(f"\n-- {shape.name} {shape.describe()}")
        print_shape_table(rows, derived, "wall" if cpu else "profiler")
        print_kernels(rows)
        del ctx, batch
        _free()
        report["elapsed_s"] = time.perf_counter() - t_run
        if args.out:  # after every shape, so a run cut short keeps what it measured
            _write(report, args.out)
    print(f"\ntotal {time.perf_counter() - t_run:.1f} s")
    return report


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
