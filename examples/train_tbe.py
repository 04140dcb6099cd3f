"""Train a TableBatchedEmbedding on synthetic Zipf ids: a tiny click model (pooled embeddings ->
linear -> logistic loss) with a fused rowwise-Adagrad update of the embedding rows.

    python examples/train_tbe.py --steps 50 --batch-size 512

Labels come from a hidden "true" embedding per row, so the loss can really go down. Runs on the
GPU with the Triton kernels when there is one, else on the CPU's fast path (torch ops).
"""

import argparse
import time

import torch

from fbtriton_dist import TableBatchedEmbedding, optim


class ZipfIds:
    """Ids of several tables, each Zipf: P(id = k) proportional to 1 / (k + 1)^alpha (row 0
    hottest). The cumulative distributions are built once; a batch is then one ``torch.rand``
    and one ``searchsorted`` over all its ids (table t's cdf is shifted by t, so one sorted
    array serves every table)."""

    def __init__(self, rows: list[int], alpha: float) -> None:
        cdfs = []
        for t, E in enumerate(rows):
            weights = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** alpha
            cdf = weights.cumsum(0)
            cdfs.append(cdf / cdf[-1] + t)
        self.cdf = torch.cat(cdfs)
        self.rows = torch.tensor(rows)
        self.start = self.rows.cumsum(0) - self.rows  # table t's first row in self.cdf

    def __call__(self, counts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``counts[t]`` ids of table t, table after table (int64, each in [0, E_t))."""
        table = torch.repeat_interleave(torch.arange(len(counts)), counts)
        u = torch.rand(table.numel(), dtype=torch.float64, generator=generator) + table
        pos = torch.searchsorted(self.cdf, u, right=True)
        return torch.minimum(pos - self.start[table], self.rows[table] - 1)


def make_batch(sampler: ZipfIds, T: int, B: int, L: int, generator: torch.Generator):
    """Feature-major (indices, offsets) for one feature per table, bag lengths 0..2L."""
    lengths = torch.randint(0, 2 * L + 1, (T * B,), generator=generator)
    indices = sampler(lengths.view(T, B).sum(1), generator)
    offsets = torch.zeros(T * B + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return indices, offsets


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--pooling-factor", type=int, default=10)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    tables = [(args.rows, args.dim)] * args.tables
    sampler = ZipfIds([E for E, _ in tables], args.zipf)
    device = torch.device(args.device)
    tbe = TableBatchedEmbedding(tables, optimizer=optim.RowWiseAdagrad(lr=args.lr), device=device)
    truth = TableBatchedEmbedding(tables, device=device)  # the hidden model behind the labels
    head = torch.nn.Linear(args.tables * args.dim, 1).to(device)
    head_opt = torch.optim.Adagrad(head.parameters(), lr=args.lr)
    w_true = torch.randn(args.tables * args.dim, generator=gen).to(device)

    print(
        f"TableBatchedEmbedding: {args.tables} tables x {args.rows:,} rows x D={args.dim}, "
        f"backend={tbe.resolved_backend()} on {device}, B={args.batch_size}, "
        f"L~{args.pooling_factor}, Zipf({args.zipf})"
    )
    ids_seen, t0, losses = 0, None, []
    for step in range(args.steps):
        indices, offsets = make_batch(sampler, len(tables), args.batch_size,
                                      args.pooling_factor, gen)
        indices, offsets = indices.to(device), offsets.to(device)
        with torch.no_grad():
            labels = (truth(indices, offsets) @ w_true > 0).float()
        logits = head(tbe(indices, offsets)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        head_opt.zero_grad()
        loss.backward()  # also updates the embedding rows in place (fused rowwise Adagrad)
        head_opt.step()
        losses.append(loss.item())
        if step == 0:
            t0 = time.perf_counter()  # the first step warms up (kernel compilation)
        else:
            ids_seen += indices.numel()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0 if t0 is not None and args.steps > 1 else float("nan")
    steps = max(args.steps - 1, 1)
    first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
    print(
        f"loss {first:.4f} (first 5 steps) -> {last:.4f} (last 5); "
        f"{steps * args.batch_size / elapsed:,.0f} samples/s, "
        f"{ids_seen / elapsed / 1e6:.2f} M ids/s, {1e3 * elapsed / steps:.1f} ms/step"
    )


if __name__ == "__main__":
    main()
