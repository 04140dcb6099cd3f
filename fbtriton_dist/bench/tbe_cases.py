"""The TBE benchmark's cases: shapes S0..S6 (GPU) and C0, C1 (CPU) and their id batches,
BASELINES.md's bytes model, one generator of (phase, step) per provider (one module alive at a
time), and the correctness checks (ours vs FBGEMM on the same weights; each timed provider of
ours, on the backend it is timed on, vs the reference at full size), each with the list of
what differs beyond its tolerance."""

import dataclasses
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fbtriton_dist import optim
from fbtriton_dist.bench import tbe_optims
from fbtriton_dist.bench.tbe_optims import DEFAULT_PHASES, EPS, LR, PHASES, optimizer_of
from fbtriton_dist.graphs import GraphedStep
from fbtriton_dist.modules import TableBatchedEmbedding

__all__ = ["DEFAULT_PHASES", "EPS", "LR", "PHASES"]  # the phases: bench/tbe_optims.py
PROVIDERS = (
    "ours",
    "ours_graph",
    "ours_checked",
    "reference",
    "fbgemm",
    "torchrec",
    "torch_pt",
    "torch_pt_sparse",
    "torch_fused",
    "torch_fused_sparse",
)
DEFAULT_PROVIDERS = {
    "cuda": [p for p in PROVIDERS if p not in ("reference", "torchrec")],
    "cpu": [
        "ours",
        "reference",
        "ours_graph",
        "fbgemm",
        "torchrec",
        "torch_pt",
        "torch_pt_sparse",
        "torch_fused",
        "torch_fused_sparse",
    ],
}
# a name in --providers also selects its variants; "torch" selects all four torch providers
ALIASES = {
    "torch": ["torch_pt", "torch_pt_sparse", "torch_fused", "torch_fused_sparse"],
    "torch_pt": ["torch_pt", "torch_pt_sparse"],
    "torch_fused": ["torch_fused", "torch_fused_sparse"],
}
# whose forward a provider without a fwd phase shares (for the derived bwd)
FWD_OF = {"torch_pt_sparse": "torch_pt", "torch_fused_sparse": "torch_fused"}
KERNEL_TABLE_PROVIDERS = ("ours", "ours_graph", "ours_checked", "fbgemm")


@dataclass(kw_only=True, frozen=True)
class Shape:
    """One benchmark shape: fixed bag size L, int64 ids, table-major (``[T][B][L]``)."""

    name: str
    """S0..S6 (GPU), C0, C1 (CPU)."""
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
    pooling: str = "sum"
    """``"sum"`` (pooled, ``[B, sum(D)]``) or ``"none"`` (sequence lookups, one row per id:
    ``[N, max_D]``; ``--pooling none``)."""

    @property
    def tables(self) -> list[tuple[int, int]]:
        return [(E, D) for n, E, D in self.groups for _ in range(n)]

    @property
    def weight_bytes(self) -> int:
        return sum(E * D for E, D in self.tables) * _esize(self.dtype)

    def tiny(self) -> "Shape":
        """The same shape scaled to CPU size: E <= 1000, B <= 8, T <= 2 (every group kept)."""
        per = max(1, 2 // len(self.groups))
        groups = tuple((min(n, per), min(E, 1000), D) for n, E, D in self.groups)
        return dataclasses.replace(self, groups=groups, B=min(self.B, 8))

    def describe(self) -> str:
        tabs = " + ".join(f"{n}x(E{E:.0e} D{D})".replace("e+0", "e") for n, E, D in self.groups)
        ids = f"zipf({self.zipf})" if self.zipf else "uniform"
        pool = " pooling none" if self.pooling == "none" else ""
        return f"{tabs} B{self.B} L{self.L} {str(self.dtype).removeprefix('torch.')} {ids}{pool}"

    @property
    def mixed_D(self) -> bool:
        return len({D for _, D in self.tables}) > 1


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
        # CPU: the shapes of the fast-CPU-path issue (one process, its threads)
        Shape(name="C0", groups=((8, 100_000, 64),), B=512, L=20),
        Shape(name="C1", groups=((4, 200_000, 128),), B=1024, L=10, zipf=1.1),
    )
}
DEFAULT_SHAPES = {
    "cuda": [n for n in SHAPES if n.startswith("S")],
    "cpu": [n for n in SHAPES if n.startswith("C")],
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
    rows = (T * n, max(D for _, D in shape.tables)) if shape.pooling == "none" else (
        shape.B, total_D)
    grad = torch.randn(rows, generator=gen, device=device)
    return Batch(torch.cat(ids), offsets, grad, [n] * T, unique)


def model_bytes(shape: Shape, batch: Batch, phase: str, out_size: int) -> int:
    """BASELINES.md's useful bytes: fwd = every looked-up row read + pooled output written;
    fwd_bwd adds the output gradient read and each unique row read and written once (+ its
    fp32 optimizer states, read and written: ``tbe_optims.OptimPhase.row_state_bytes``, and
    EMA-in-place's amortised whole-table average). Ids and offsets are not counted. Without
    pooling the output (and its gradient) is one row per id."""
    w = _esize(shape.dtype)
    dims = [D for _, D in shape.tables]
    out = shape.B * sum(dims) * out_size
    if shape.pooling == "none":
        out = sum(n * D for n, D in zip(batch.lookups, dims, strict=True)) * out_size
    nbytes = sum(n * D * w for n, D in zip(batch.lookups, dims, strict=True)) + out
    if phase != "fwd":
        nbytes += out + sum(2 * u * D * w for u, D in zip(batch.unique, dims, strict=True))
        entry = tbe_optims.phase(phase)
        nbytes += sum(u * entry.row_state_bytes(D) for u, D in zip(batch.unique, dims,
                                                                   strict=True))
        nbytes += int(entry.ema_bytes(shape.tables, w))
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
        pooling=ctx.shape.pooling,
    )
    if "fwd" in ctx.phases:  # an inference lookup, as FBGEMM's forward (no backward plan)
        yield "fwd", torch.no_grad()(lambda: m(idx, off))
    for phase in _train_phases(ctx):
        why = tbe_optims.switch_optimizer(m, phase)
        yield phase, why or (lambda: m(idx, off).backward(grad))


def _train_phases(ctx: Context) -> list[str]:
    """The timed ``fwd_bwd_*`` phases, in ``PHASES``' order."""
    return [p for p in PHASES if p != "fwd" and p in ctx.phases]


def _ours_graph_cases(ctx: Context) -> Iterator[tuple[str, object]]:
    """``ours``' whole step (forward, or forward + backward + fused update; the host work
    included) replayed from a CUDA graph by ``graphs.GraphedStep``: each call copies the batch's
    ids and offsets into the graph's inputs and replays. Warmed up and captured here, before
    the timer sees it. Without CUDA, GraphedStep runs the step eagerly (on the fast CPU
    path): the rows say so in ``note``."""
    idx, off, grad = ctx.batch.indices, ctx.batch.offsets, ctx.batch.grad
    m = TableBatchedEmbedding(
        ctx.shape.tables,
        optimizer=optim.SGD(lr=LR),
        weights_dtype=ctx.shape.dtype,
        bounds_check="warn",
        backend="auto",
        device=ctx.device,
        pooling=ctx.shape.pooling,
    )

    @torch.no_grad()
    def forward(indices, offsets):  # an inference lookup, as FBGEMM's forward
        return m(indices, offsets)

    def train_step(indices, offsets):
        m(indices, offsets).backward(grad)

    for phase in [p for p in PHASES if p in ctx.phases]:
        if phase in ("fwd_bwd_emainplace_rowwise_adagrad", "fwd_bwd_ensemble_rowwise_adagrad"):
            yield phase, ("skipped: its whole-table step is scheduled on the host by the step "
                          "count: a captured graph would bake in one step's choice")
            continue
        why = tbe_optims.switch_optimizer(m, phase) if phase != "fwd" else None
        if why:
            yield phase, why
            continue
        step = GraphedStep(forward if phase == "fwd" else train_step)
        for _ in range(step.warmup + 1):  # eager warm-up calls, then the capture
            step(idx, off)

        def run(step=step):
            return step(idx, off)

        run.note = (
            f"CUDA graph ({step.captures} capture, replayed)"
            if step.captures
            else "eager: GraphedStep's fallback without CUDA (the fast CPU path)"
        )
        yield phase, run
        del step, run


def import_fbgemm():
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
    """BASELINES.md's construction: the optimizer's ``EmbOptimType`` (``optimizer`` a registry
    name: EXACT_SGD, EXACT_ROWWISE_ADAGRAD, ADAM, ...) with the hyper-parameters of its phase
    (``tbe_optims``: lr 0.01, eps 1e-8, FBGEMM's defaults else), fp32 output, SUM pooling (NONE
    for the shape's ``pooling="none"``), all else default; weights uniform(-0.1, 0.1). On CPU:
    FBGEMM's CPU TBE. Raises ``tbe_optims.NotOffered`` where FBGEMM (this build, this device)
    lacks the optimizer."""
    fb = import_fbgemm()
    if device.type == "cuda":
        where = (fb["EmbeddingLocation"].DEVICE, fb["ComputeDevice"].CUDA)
    else:
        where = (fb["EmbeddingLocation"].HOST, fb["ComputeDevice"].CPU)
    entry = tbe_optims.phase(f"fwd_bwd_{optimizer}")
    kwargs = tbe_optims.fbgemm_optimizer(entry, fb)
    precision = {torch.float32: "FP32", torch.float16: "FP16"}[shape.dtype]
    try:
        emb = fb["TBE"](
            embedding_specs=[(E, D, *where) for E, D in shape.tables],
            weights_precision=getattr(fb["SparseType"], precision),
            output_dtype=fb["SparseType"].FP32,
            pooling_mode=(fb["PoolingMode"].NONE if shape.pooling == "none"
                          else fb["PoolingMode"].SUM),
            **kwargs,
        )
    except (AssertionError, TypeError) as e:
        if tbe_optims.refused(e):
            raise tbe_optims.NotOffered(
                f"FBGEMM's {'CUDA' if device.type == 'cuda' else 'CPU'} TBE: {e}") from e
        raise
    emb.init_embedding_weights_uniform(-0.1, 0.1)
    return emb


def _fbgemm_cases(ctx: Context) -> Iterator[tuple[str, object]]:
    idx, off, grad = ctx.batch.indices, ctx.batch.offsets, ctx.batch.grad
    if ctx.shape.pooling == "none" and ctx.shape.mixed_D:
        for phase in ctx.phases:
            yield phase, "skipped: FBGEMM's NONE pooling takes tables of one D only"
        return
    if "fwd" in ctx.phases or "fwd_bwd_sgd" in ctx.phases:
        emb = fbgemm_tbe(ctx.shape, "sgd", ctx.device)
        if "fwd" in ctx.phases:
            yield "fwd", lambda: emb(idx, off)
        if "fwd_bwd_sgd" in ctx.phases:
            yield "fwd_bwd_sgd", lambda: emb(idx, off).backward(grad)
        del emb
        _free()
    for phase in _train_phases(ctx):
        if phase == "fwd_bwd_sgd":
            continue
        held = []  # emptied after the phase: the step's module freed before the next is built
        try:
            held.append(fbgemm_tbe(ctx.shape, tbe_optims.phase(phase).name, ctx.device))
        except tbe_optims.NotOffered as e:
            yield phase, f"fbgemm: not offered ({e})"
            continue
        except torch.OutOfMemoryError as e:
            _free()
            yield phase, f"skipped: does not fit: {str(e).splitlines()[0]}"
            continue
        yield phase, lambda held=held: held[0](idx, off).backward(grad)
        held.clear()
        _free()


def _torchrec_cases(ctx: Context) -> Iterator[tuple[str, object]]:
    """TorchRec's unsharded ``EmbeddingBagCollection`` (one ``nn.EmbeddingBag`` per table) on
    the same ids as a KeyedJaggedTensor: its forward; backward with dense gradients and
    ``torch.optim.SGD`` / ``torch.optim.Adagrad`` (per-element: TorchRec's unsharded module has
    no fused or row-wise optimizer)."""
    shape, batch = ctx.shape, ctx.batch
    if shape.pooling == "none":
        for phase in ctx.phases:
            yield phase, ("skipped: pooling none: TorchRec's EmbeddingCollection is one "
                          "nn.Embedding per table, the torch_pt provider here")
        return
    import torchrec  # noqa: PLC0415 (a peer, imported only when benchmarked)

    tables = [
        torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=D, num_embeddings=E,
                                    feature_names=[f"f{t}"])
        for t, (E, D) in enumerate(shape.tables)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=ctx.device)
    if shape.dtype != torch.float32:
        ebc = ebc.to(shape.dtype)
    kjt = torchrec.KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(len(tables))], values=batch.indices,
        offsets=batch.offsets,
    )
    grad = batch.grad.to(shape.dtype)

    def forward() -> torch.Tensor:
        return ebc(kjt).values()

    if "fwd" in ctx.phases:
        yield "fwd", torch.no_grad()(forward)
    yield from tbe_optims.torch_not_offered(_train_phases(ctx))
    for phase in ("fwd_bwd_sgd", "fwd_bwd_rowwise_adagrad"):
        if phase not in ctx.phases:
            continue
        params = list(ebc.parameters())
        opt = (torch.optim.SGD(params, lr=LR) if phase == "fwd_bwd_sgd"
               else torch.optim.Adagrad(params, lr=LR, eps=EPS))

        def step(opt=opt) -> None:
            forward().backward(grad)
            opt.step()
            opt.zero_grad(set_to_none=True)

        step.note = "dense grads + torch.optim" + ("" if "sgd" in phase else ".Adagrad")
        yield phase, step
        del opt, step


def _torch_rows(ctx: Context, fused: bool, sparse: bool):
    """(parameters, forward) for torch's ``F.embedding`` without pooling, ``[N, max_D]``: per
    table (rows of a narrower table padded to max_D), or one concatenated table (one D) with
    the ids shifted by each table's first row; ``sparse`` grads are per-id rows (the SGD step
    then is one ``index_add_``)."""
    shape, batch, dev = ctx.shape, ctx.batch, ctx.device
    B, tables = shape.B, shape.tables
    bounds = batch.offsets[::B].tolist()
    max_D = max(D for _, D in tables)

    def new_param(rows: int, D: int) -> torch.nn.Parameter:
        w = torch.empty(rows, D, dtype=shape.dtype, device=dev).uniform_(-0.1, 0.1)
        return torch.nn.Parameter(w)

    ids = [batch.indices[bounds[t] : bounds[t + 1]] for t in range(len(tables))]
    if not fused:
        params = [new_param(E, D) for E, D in tables]

        def forward() -> torch.Tensor:
            rows = [F.pad(F.embedding(i, w, sparse=sparse), (0, max_D - w.shape[1]))
                    for w, i in zip(params, ids, strict=True)]
            return torch.cat(rows)

        return params, forward
    first = [0, *torch.tensor([E for E, _ in tables]).cumsum(0).tolist()]
    params = [new_param(first[-1], max_D)]
    shifted = torch.cat([i + first[t] for t, i in enumerate(ids)])
    return params, lambda: F.embedding(shifted, params[0], sparse=sparse)


def _torch_lookup(ctx: Context, fused: bool, sparse: bool):
    """(parameters, forward) for torch's embedding_bag: per table, or one concatenated table
    per distinct D (ids shifted by the table's first row) with the [T, B, D] -> [B, T*D] copy.
    Without pooling, ``_torch_rows``."""
    if ctx.shape.pooling == "none":
        return _torch_rows(ctx, fused, sparse)
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
    if shape.pooling == "none" and fused and shape.mixed_D:
        for phase in ctx.phases:
            yield phase, "skipped: one concatenated table needs one D (torch_pt pads instead)"
        return
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
    yield from tbe_optims.torch_not_offered(_train_phases(ctx))
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
        return _ours_cases(ctx, "auto", "warn")
    if name == "ours_graph":
        return _ours_graph_cases(ctx)
    if name == "ours_checked":
        return _ours_cases(ctx, "auto", "error")
    if name == "reference":
        return _ours_cases(ctx, "reference", "warn")
    if name == "fbgemm":
        return _fbgemm_cases(ctx)
    if name == "torchrec":
        return _torchrec_cases(ctx)
    fused = name.startswith("torch_fused")
    return _torch_cases(ctx, fused=fused, sparse=name.endswith("_sparse"))


def output_size(provider: str, shape: Shape) -> int:
    return _esize(shape.dtype) if provider.startswith("torch") else 4


# ---------------------------------------------------------------- correctness


def compare_with_fbgemm(ctx: Context, backend: str) -> dict:
    """Same weights in FBGEMM's TBE and ours: forward outputs, then table 0's rows after one
    EXACT_SGD step (touched rows vs each other and vs the exact w - lr * sum(grad rows), plus
    4096 random untouched rows that must not move); then each other timed ``fwd_bwd_*`` phase
    on table 0 alone (``tbe_optims.compare_with_fbgemm``: rows and states after one step;
    ``"fbgemm: not offered (why)"`` where FBGEMM lacks the optimizer)."""
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
    result["failures"] = failures(
        result,
        {
            "fwd_rel_err": (tol_fwd, "forward output (max err / max |FBGEMM's|)"),
            "sgd_rel_err_ours_vs_fbgemm": (tol_sgd, "table 0's rows after one SGD step vs FBGEMM"),
            "sgd_rel_err_ours_vs_exact": (tol_sgd, "table 0's rows after one SGD step vs exact"),
            "untouched_max_abs_change_ours": (0.0, "rows no id looked up moved"),
        },
    )
    del fb, ours, out_f, out_o, w_f, w_o, before, d_f, d_o, exact
    _free()

    def build_ours(one: Shape, optimizer: optim.Optimizer) -> TableBatchedEmbedding:
        return TableBatchedEmbedding(one.tables, optimizer=optimizer, weights_dtype=one.dtype,
                                     bounds_check="warn", backend=backend, device=dev,
                                     init_weights=False)

    values, limits = tbe_optims.compare_with_fbgemm(shape, batch, dev, ctx.phases, backend,
                                                    fbgemm_tbe, build_ours)
    _free()
    result.update(values)
    result["failures"] += failures(result, limits)
    result["ok"] = not result["failures"]
    result["tolerance"] = {"fwd": tol_fwd, "sgd": tol_sgd,
                           "optimizers": {k: v[0] for k, v in limits.items()}}
    return result


def failures(result: dict, limits: dict[str, tuple[float, str]]) -> list[str]:
    """One line per ``result[key]`` above its limit (NaN is), for ``limits[key] = (limit, what)``:
    ``"weights after 3 steps: weights_max_abs_err 0.119 > 1e-05"``."""
    out = []
    for key, (limit, what) in limits.items():
        value = result[key]
        if not value <= limit:
            out.append(f"{what}: {key} {value:.3g} > {limit:g}")
    return out


def _random_length_batch(T, E, B, L, gen, device):
    lengths = torch.randint(0, 2 * L + 1, (T * B,), generator=gen)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    indices = torch.randint(0, E, (int(offsets[-1]),), generator=gen)
    return indices.to(device), offsets.to(device)


OURS_MODULES = {"ours": ("auto", "warn"), "ours_graph": ("auto", "warn"),
                "ours_checked": ("auto", "error")}
"""The timed providers that run our module: its ``(backend, bounds_check)`` as timed
(``ours_graph`` steps ``ours``' module through ``GraphedStep``: eager on the CPU)."""


def check(shape: Shape, batch: Batch, device: torch.device, providers: list[str],
          phases: list[str], dense_limit_gb: float | None = None) -> dict:
    """What the run times, against the reference: for each timed provider of ours (one check
    per distinct module: ``OURS_MODULES``) and each timed phase, the module as timed (its
    backend: Triton on CUDA, the native kernels on the CPU; the shape's weights dtype; the
    phase's optimizer, ``LR``, ``EPS``) vs the same module on the reference backend, same
    weights. ``fwd``: the timed batch's inference forward. ``fwd_bwd_<optimizer>``: 3 fused
    steps (the timed batch and its gradient, then two batches of bag sizes 0..2L so empty bags
    are covered): each step's forward, then the weights and every optimizer state. A phase
    whose two modules (weights + states) need more than ``dense_limit_gb`` is skipped, said in
    ``<providers>.<phase>.skipped``."""
    configs: dict[tuple[str, str], list[str]] = {}
    for p in providers:
        if p in OURS_MODULES:
            configs.setdefault(OURS_MODULES[p], []).append(p)
    half = shape.dtype != torch.float32
    # half rows: each side rounds its updates (stochastically, by default) to one ulp, so the
    # weights, and the forwards after a step, differ by about that much
    tol_w, tol_after = (2e-3, 4e-3) if half else (1e-5, 1e-4)
    result: dict = {"checked": [], "rows_touched": 0}
    limits: dict[str, tuple[float, str]] = {}
    for (backend, bounds), names in configs.items():
        label = "/".join(names)
        for phase in [ph for ph in PHASES if ph in phases]:
            need = 2 * (shape.weight_bytes + sum(optim.spec_of(optimizer_of(phase)).state_bytes(
                E, D) for E, D in shape.tables))
            if dense_limit_gb is not None and need > dense_limit_gb * 1e9:
                result[f"{label}.{phase}.skipped"] = (
                    f"two modules with their states need {need / 1e9:.1f} GB > "
                    f"--dense-limit-gb {dense_limit_gb:g}")
                continue
            got = _check_phase(shape, batch, device, backend, bounds, phase)
            result["checked"].append({"providers": names, "backend": backend,
                                      "bounds_check": bounds, "phase": phase})
            result["rows_touched"] = max(result["rows_touched"], got.pop("rows_touched", 0))
            what = f"{label} (backend {backend!r}) {phase}"
            for key, value in got.items():
                result[f"{label}.{phase}.{key}"] = value
                if key.startswith("step"):
                    tol = 1e-4 if key.startswith("step0") else tol_after
                    limits[f"{label}.{phase}.{key}"] = (tol, f"{what}: forward of {key[:5]}")
            if phase != "fwd":
                limits[f"{label}.{phase}.weights_max_abs_err"] = (
                    tol_w, f"{what}: weights after 3 fused steps")
            if phase == "fwd_bwd_rowwise_adagrad":
                limits[f"{label}.{phase}.momentum_max_rel_err"] = (
                    1e-4, f"{what}: rowwise-Adagrad state (momentum1) after 3 steps")
            for key in [k for k in got if k.endswith("_state_rel_err")]:
                limits[f"{label}.{phase}.{key}"] = (
                    4e-3 if half else 1e-4, f"{what}: {key[:9]} (max err / max |ref|) after 3 "
                    "steps")
    result["failures"] = failures(result, limits)
    result["ok"] = not result["failures"]
    return result


def _check_phase(shape: Shape, batch: Batch, device: torch.device, backend: str, bounds: str,
                 phase: str) -> dict:
    """One module of ours (``backend``, ``bounds``) vs the reference on one phase:
    ``check``'s numbers (forward errors relative to the largest output, weights, state)."""
    kw = dict(optimizer=optimizer_of(phase), weights_dtype=shape.dtype, device=device,
              pooling=shape.pooling)
    ours = TableBatchedEmbedding(shape.tables, backend=backend, bounds_check=bounds, **kw)
    ref = TableBatchedEmbedding(shape.tables, backend="reference", **kw)
    ref.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(0)
    E_min = min(E for E, _ in shape.tables)
    out: dict = {}
    steps = 1 if phase == "fwd" else 3
    for step in range(steps):
        if step == 0:
            idx, off, grad = batch.indices, batch.offsets, batch.grad
        else:
            idx, off = _random_length_batch(len(shape.tables), E_min, shape.B, shape.L, gen,
                                            device)
            grad = None
        with torch.set_grad_enabled(phase != "fwd"):
            out_o, out_r = ours(idx, off), ref(idx, off)
        scale = out_r.float().abs().max().clamp(min=1e-30)
        out[f"step{step}_forward_max_rel_err"] = (
            (out_o.float() - out_r.float()).abs().max() / scale).item()
        if phase != "fwd":
            grad = torch.randn(out_r.shape, generator=gen).to(device) if grad is None else grad
            grad = tbe_optims.exact_sum_grad(grad)  # both sides sum the same row gradients
            out_o.backward(grad)
            out_r.backward(grad)
    if phase != "fwd":
        out["weights_max_abs_err"] = (ours.weights.float() - ref.weights.float()).abs().max().item()
    if phase == "fwd_bwd_rowwise_adagrad":
        m_o, m_r = ours.momentum1, ref.momentum1
        out["momentum_max_rel_err"] = (
            ((m_o - m_r).abs() / m_r.abs().clamp(min=1e-12)).max().item())
        out["rows_touched"] = int((m_r > 0).sum())
    elif phase != "fwd":  # momentum1_state_rel_err, momentum2_...: max err / max |reference's|
        for state in optim.spec_of(optimizer_of(phase)).states:
            s_o, s_r = getattr(ours, state.name).float(), getattr(ref, state.name).float()
            out[f"{state.name}_state_rel_err"] = (
                (s_o - s_r).abs().max() / s_r.abs().max().clamp(min=1e-30)).item()
    del ours, ref
    _free()
    return out
