"""A batch's ids of the cached tables (``modules/tiers.py``): split per table, checked
against the table's rows, and a copy of the batch to write their slots into."""

from collections.abc import Callable

import torch

from fbtriton_dist.modules import tier_device_map


def table_ids(indices: torch.Tensor, offsets: torch.Tensor, feature_table_map: list[int],
              tables) -> dict[int, tuple[torch.Tensor, list[tuple[int, int, int]]]]:
    """Per table of ``tables``: its ids of the batch (int64, where ``indices`` are; one
    host read of the feature bounds) and the (feature, start,
    end) ranges of ``indices`` they come from; tables without ids are left out."""
    T = len(feature_table_map)
    B = (offsets.numel() - 1) // T
    if B == 0 or indices.numel() == 0:
        return {}
    bounds = tier_device_map.host_values(offsets[::B])
    out = {}
    for t in tables:
        parts = [(f, bounds[f], bounds[f + 1]) for f in range(T)
                 if feature_table_map[f] == t and bounds[f + 1] > bounds[f]]
        if not parts:
            continue
        if len(parts) == 1:
            ids = indices[parts[0][1] : parts[0][2]]
        else:
            ids = torch.cat([indices[a:b] for _, a, b in parts])
        out[t] = (ids.to(torch.int64), parts)
    return out


def fresh_copy(indices: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """A tensor like ``indices`` holding its values outside ``ranges`` (the cached
    tables' ranges, written by the caller)."""
    out = torch.empty_like(indices)
    at = 0
    for a, b in [*sorted(ranges), (indices.numel(), indices.numel())]:
        if a > at:
            out[at:a] = indices[at:a]
        at = max(at, b)
    return out


def check_range(cache, lo: int, hi: int, indices: torch.Tensor, parts,
                names: Callable[[int], str]) -> None:
    """Refuse ids outside ``[0, rows)`` (``lo``, ``hi``: the table's smallest and largest
    id of the batch), naming the first feature that has one."""
    if lo >= 0 and hi < cache.rows:
        return
    bad = lo if lo < 0 else hi
    f = next(f for f, a, b in parts
             if bool(((indices[a:b] < 0) | (indices[a:b] >= cache.rows)).any()))
    raise ValueError(
        f"feature '{names(f)}' of table '{cache.name}' (tier {cache.storage.tier!r}): id "
        f"{bad} out of range [0, {cache.rows}) (cached tiers always check ids)"
    )
