"""Random TBE batches for tests: mixed dims, empty bags, duplicate and hot ids."""

import torch


def make_batch(
    tables: list[tuple[int, int]],
    feature_table_map: list[int],
    B: int,
    max_L: int,
    *,
    index_dtype: torch.dtype = torch.int64,
    hot: bool = False,
    weighted: bool = False,
    device: str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(indices [N], offsets [T*B+1], per_sample_weights [N] | None), feature-major.

    Bag lengths are uniform in [0, max_L] (so some bags are empty); with ``hot`` half the ids
    of every feature are its table's row 0 (a hot row hit many times in one batch).
    """
    T = len(feature_table_map)
    lengths = torch.randint(0, max_L + 1, (T * B,), generator=generator)
    ids = []
    for fb in range(T * B):
        E = tables[feature_table_map[fb // B]][0]
        bag = torch.randint(0, E, (int(lengths[fb]),), generator=generator)
        if hot:
            bag[torch.rand(bag.shape, generator=generator) < 0.5] = 0
        ids.append(bag)
    indices = torch.cat(ids).to(index_dtype) if ids else torch.zeros(0, dtype=index_dtype)
    offsets = torch.zeros(T * B + 1, dtype=index_dtype)
    offsets[1:] = lengths.cumsum(0)
    psw = torch.rand(indices.numel(), generator=generator) + 0.5 if weighted else None
    move = (lambda t: t.to(device)) if device != "cpu" else (lambda t: t)
    return move(indices), move(offsets), None if psw is None else move(psw)


def upstream_grad(out: torch.Tensor, step: int) -> torch.Tensor:
    """A fixed, non-uniform gradient for the pooled output of a given step."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(out.shape, generator=g).to(out.device, torch.float32)


def device_for(backend: str) -> str:
    """Where a test runs a backend: Triton on the GPU if there is one (else interpreted on the
    CPU), the reference on the CPU."""
    from tests.conftest import DEVICE

    return DEVICE if backend == "triton" else "cpu"


def to(device: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if t is None else t.to(device) for t in tensors)
