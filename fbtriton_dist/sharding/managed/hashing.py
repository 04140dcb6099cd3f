"""Which owner of a sharded managed table holds an id: its hash and the owners' hash ranges
(``sharding/managed/sharded.py`` states the formula; ``sharding/managed/state.py`` re-inserts ids by
it when a map is loaded onto other owners)."""

import torch

HASH_BITS = 62
_MULT = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64


def id_hash(ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 raw ids -> their hashes in ``[0, 2**62)`` (``sharding/managed/sharded.py``'s
    h)."""
    h = ids * _MULT
    return (h ^ (h >> 31)) & ((1 << HASH_BITS) - 1)


def hash_bounds(capacities: list[int]) -> list[int]:
    """The first hash of owners 1.. (owner i holds a share ``c_i / sum(c)`` of the space)."""
    total, at, out = sum(capacities), 0, []
    for c in capacities[:-1]:
        at += c
        out.append((at << HASH_BITS) // total)
    return out


def hash_ranges(capacities: list[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` of the hashes each owner holds."""
    cuts = [0, *hash_bounds(capacities), 1 << HASH_BITS]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def owners_of(ids: torch.Tensor, capacities: list[int]) -> torch.Tensor:
    """``[N]``: the index of the owner (of owners with these slots) that holds each id."""
    bounds = torch.tensor(hash_bounds(capacities), dtype=torch.int64, device=ids.device)
    return torch.searchsorted(bounds, id_hash(ids), right=True)
