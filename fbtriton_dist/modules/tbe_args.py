"""``TableBatchedEmbedding``'s arguments checked and normalised (the constructor's: host
metadata only): each raises ``ValueError("<argument>: expected X, got Y")``."""

from collections.abc import Sequence
from itertools import accumulate

import torch

from fbtriton_dist.pooling import LABELS
from fbtriton_dist.storage import Storage, storage_of

WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The weight and output dtypes of a ``TableBatchedEmbedding``."""


def positive_or_none(**values: float | None) -> list[float | None]:
    """Each value as a float, or None; refuses one that is not > 0, naming it."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name}: expected None or a number > 0, got {value!r}")
    return [None if v is None else float(v) for v in values.values()]


def table_arguments(
    tables: Sequence[tuple[int, int]],
    table_names: Sequence[str] | None,
    storage: Sequence | None,
    feature_table_map: Sequence[int] | None,
) -> tuple[list[tuple[int, int]], list[str], list[Storage], list[int]]:
    """(tables as (E, D) ints, a name per table, a ``Storage`` per table, the feature table
    map), checked against each other."""
    tables = [(int(E), int(D)) for E, D in tables]
    if not tables or any(E < 1 or D < 1 for E, D in tables):
        raise ValueError(f"tables: expected a non-empty list of (E >= 1, D >= 1), got {tables}")
    names = (list(table_names) if table_names is not None
             else [f"table_{t}" for t in range(len(tables))])
    if len(names) != len(tables):
        raise ValueError(f"table_names: expected {len(tables)} names, got {len(names)}")
    if storage is not None and len(storage) != len(tables):
        raise ValueError(f"storage: expected {len(tables)} entries (one per table), got "
                         f"{len(storage)}")
    storages = [storage_of(s, n) for s, n in
                zip(storage if storage is not None else [None] * len(tables), names, strict=True)]
    ftm = (list(range(len(tables))) if feature_table_map is None
           else [int(t) for t in feature_table_map])
    if not ftm or any(not 0 <= t < len(tables) for t in ftm):
        raise ValueError(f"feature_table_map: expected table ids in [0, {len(tables)}), "
                         f"got {ftm}")
    return tables, names, storages, ftm


def check_kinds(pooling: str, weights_dtype: torch.dtype, output_dtype: torch.dtype) -> None:
    """The pooling label and the two dtypes are ones the module has."""
    if pooling not in LABELS:
        raise ValueError(f"pooling: expected one of {list(LABELS)}, got {pooling!r}")
    if weights_dtype not in WEIGHT_DTYPES or output_dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"weights_dtype/output_dtype: expected one of {WEIGHT_DTYPES}, got "
            f"{weights_dtype}/{output_dtype}"
        )


def check_bounds_check(bounds_check: str) -> None:
    if bounds_check not in ("error", "warn", "ignore"):
        raise ValueError(
            f"bounds_check: expected one of ['error', 'warn', 'ignore'], got {bounds_check!r}"
        )


def feature_names_of(feature_names: Sequence[str] | None, num_features: int) -> list[str]:
    """The feature names as a list ([] when not given), one per feature."""
    names = list(feature_names) if feature_names is not None else []
    if feature_names is not None and len(names) != num_features:
        raise ValueError(
            f"feature_names: expected {num_features} names (one per feature), got {len(names)}"
        )
    return names


def row_align(slot_tables: Sequence[tuple[int, int]], table_offsets: Sequence[int],
              element_size: int) -> int:
    """The largest power of two (at most 16 bytes of ``element_size``) that divides every
    table's D and first element in the flat weights: the kernels' vector width for rows."""
    align = max(1, 16 // element_size)
    for (_, D), start in zip(slot_tables, table_offsets, strict=False):
        while align > 1 and (D % align or start % align):
            align //= 2
    return align


def weights_without_grad(offsets: torch.Tensor, per_sample_weights: torch.Tensor,
                         feature_requires_grad: torch.Tensor, T: int,
                         batch_size_per_feature_per_rank) -> torch.Tensor:
    """``per_sample_weights`` of a lookup of ``T`` features whose entries of the features
    flagged 0 in ``feature_requires_grad`` are detached (no gradient flows to them)."""
    if feature_requires_grad.dim() != 1 or feature_requires_grad.numel() != T:
        raise ValueError(f"feature_requires_grad: expected a 1-D tensor of {T} flags (one "
                         f"per feature), got shape {tuple(feature_requires_grad.shape)}")
    if not per_sample_weights.requires_grad:
        return per_sample_weights
    if batch_size_per_feature_per_rank is None:
        bags = [(offsets.numel() - 1) // T] * T
    else:
        bags = [sum(b) for b in batch_size_per_feature_per_rank]
    bounds = torch.tensor([0, *accumulate(bags)], device=offsets.device)
    per_feature = offsets[bounds].diff()
    flags = feature_requires_grad.to(offsets.device, torch.bool)
    keep = flags.repeat_interleave(per_feature, output_size=per_sample_weights.numel())
    return torch.where(keep, per_sample_weights, per_sample_weights.detach())
