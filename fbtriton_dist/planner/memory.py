"""Bytes a block of a table occupies on its rank: weights plus fused-optimizer state.

Read by the plan's budget check, the cost model and the planner's search alike, so all three
count memory the same way.
"""

from __future__ import annotations

from fbtriton_dist import optim

from .shards import Shard
from .tables import TableSpec

__all__ = ["GiB", "block_bytes", "fmt_bytes", "shard_equation", "state_bytes"]

GiB = 1024**3


def state_bytes(optimizer: str, rows: int, cols: int) -> int:
    """Optimizer state of a rows x cols block, fp32 as FBGEMM keeps it (``optim.REGISTRY``'s
    state layout; ``none``: 0)."""
    return 0 if optimizer == "none" else optim.spec(optimizer).state_bytes(rows, cols)


def block_bytes(spec: TableSpec, rows: int, cols: int, optimizer: str) -> int:
    """Weights + optimizer state of a rows x cols block of ``spec``; ``optimizer`` is the
    default for a table that does not name its own."""
    opt = spec.optimizer or optimizer
    return rows * cols * spec.dtype_bytes + state_bytes(opt, rows, cols)


def fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def shard_equation(spec: TableSpec, sh: Shard, optimizer: str) -> str:
    """``rows 0..1000 x 128 cols x 4 B + state 4.0 KiB (rowwise_adagrad) = 504.0 KiB``."""
    opt = spec.optimizer or optimizer
    w = sh.num_rows * sh.num_cols * spec.dtype_bytes
    st = state_bytes(opt, sh.num_rows, sh.num_cols)
    return (
        f"rows {sh.row_start}..{sh.row_end} x {sh.num_cols} cols x {spec.dtype_bytes} B"
        f" + state {fmt_bytes(st)} ({opt}) = {fmt_bytes(w + st)}"
    )
