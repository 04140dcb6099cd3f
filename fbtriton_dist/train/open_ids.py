"""Synthetic batches from an open id space that drifts (``data.synthetic.drift``,
``drift_config.py``).

Each drifting feature's table has an endless stream of id *positions* 0, 1, 2, ...; the id at
position ``p`` is ``raw_id(p, key)``, a 64-bit mix of ``p`` and the table's key (any int64
value, negative ones too: there is no vocabulary). At training step ``k`` the live ids are
the ``W = window`` positions ``[k * s, k * s + W)`` (``s = new_ids_per_step``): every step
``s`` ids are born and the ``s`` oldest leave, each id living ``W / s`` steps. Position ``p``
has the popularity rank ``rank(p mod W)`` for its whole life (a fixed permutation of
``[0, W)`` spreading neighbours apart); a lookup draws a Zipf rank ``r`` in ``[0, W)`` (the
feature's exponent) and reads the live position of that rank. So a newborn id is as likely
hot as cold, and a hot id that dies is replaced by a new one equally hot: ids churn while
the popularity curve stays put. A table's features share its id stream (``item`` and
``item_history`` name the same items).

A feature whose table is managed (``id_manager:``) gets the raw ids; any other gets them
folded into its rows, ``raw % E`` (the hashing trick, collisions and all). Features not in
``drift.features`` draw stationary Zipf ids in ``[0, E)``. Labels: as ``SyntheticSource``'s,
``1[a * dense . w / sqrt(n) + 2 * mean_f(mean over the bag of h_f(id)) + noise * N(0, 1) > 0]``
(``a = drift.dense_weight``) with a fixed pseudo-random score ``h_f(id)`` in ``[-1, 1)`` per
raw id: a model that keeps one row per live id can learn it, a hashed table only the average
of the ids sharing a row.

Batch ``k`` of rank ``r`` is a pure function of ``(seed, r, k)``, so a resumed job draws
what an uninterrupted one would. Evaluation follows the drift: ``eval_batches_at(step, n)``
draws ``n`` held-out batches (their own stream) from the windows of steps ``step ..
step + n - 1``, the traffic right after the model's last step.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Collection, Iterator, Sequence

import torch

from fbtriton_dist.sparse import KeyedJaggedTensor

from .data import Batch, DataPosition, FeatureSpec, zipf_ids
from .drift_config import DriftConfig

__all__ = ["DriftingSource", "id_score", "mix64", "raw_id", "table_key"]

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's multipliers, as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on ``[N]`` int64 (wrapping arithmetic): a bijection of int64."""
    x = (x ^ _srl(x, 30)) * _M1
    x = (x ^ _srl(x, 27)) * _M2
    return x ^ _srl(x, 31)


def table_key(seed: int, table: str) -> int:
    """The id stream of ``table`` under ``seed`` (a signed 64-bit key)."""
    digest = hashlib.blake2b(f"{seed}:{table}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def raw_id(positions: torch.Tensor, key: int) -> torch.Tensor:
    """The raw int64 ids at ``positions`` ``[N]`` of the stream ``key``: distinct positions
    give distinct ids (``mix64`` is a bijection)."""
    return mix64(positions * _GOLDEN + key)


def id_score(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """The hidden score ``h(id)`` in ``[-1, 1)`` (float64) of raw ids for feature ``salt``."""
    h = mix64(ids ^ mix64(torch.tensor([salt], dtype=torch.int64)))
    return _srl(h, 11).double() / float(1 << 52) - 1.0


def _mix(*values: int) -> int:
    digest = hashlib.blake2b(":".join(map(str, values)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class DriftingSource:
    """Batches over an open, drifting id space (the module docstring).

    ``features``: every feature with its rows, pooling factor and Zipf exponent;
    ``tables``: each feature's table name (features of one table share its id stream);
    ``raw_features``: the features handed raw ids (their table is managed), the others get
    ``raw % E``.
    """

    eval_follows_step = True
    """The job asks for its eval batches at each evaluation (``eval_batches_at``)."""

    def __init__(
        self,
        features: Sequence[FeatureSpec],
        drift: DriftConfig,
        *,
        tables: dict[str, str],
        raw_features: Collection[str] = (),
        num_dense: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        noise: float = 0.5,
    ) -> None:
        self.features, self.drift = list(features), drift
        names = [f.name for f in self.features]
        drifting = names if drift.features is None else list(drift.features)
        unknown = [f for f in [*drifting, *raw_features, *tables] if f not in names]
        if unknown:
            raise ValueError(f"data.synthetic.drift: {unknown[0]!r} is not a feature of the "
                             f"source, expected some of {names}")
        self.drifting = frozenset(drifting)
        self.raw = frozenset(raw_features)
        self.keys = {f: table_key(seed, tables.get(f, f)) for f in names}
        self.num_dense, self.batch_size = num_dense, batch_size
        self.seed, self.rank, self.world_size, self.noise = seed, rank, world_size, noise
        W = drift.window
        self._stride = next(a for a in itertools.count(max(1, round(W / 1.618034)))
                            if math.gcd(a, W) == 1)
        g = torch.Generator().manual_seed(_mix(seed, "dense"))
        self._w = torch.randn(num_dense, generator=g, dtype=torch.float64)

    def window(self, k: int) -> tuple[int, int]:
        """The live positions ``[first, first + window)`` of step ``k``."""
        first = k * self.drift.new_ids_per_step
        return first, first + self.drift.window

    def positions(self, rank: torch.Tensor, k: int) -> torch.Tensor:
        """The live positions at step ``k`` of popularity ranks ``rank`` (``[N]`` in
        ``[0, W)``): the one of the window ``[first, first + W)`` congruent to ``slot(r) =
        (r * stride) mod W`` (``stride`` coprime to W, about W / golden ratio)."""
        W, first = self.drift.window, self.window(k)[0]
        slot = rank * self._stride % W
        return first + torch.remainder(slot - first, W)

    def live_ids(self, feature: str, k: int) -> torch.Tensor:
        """The raw ids of ``feature``'s window at step ``k``, hottest first (``[window]``)."""
        ranks = torch.arange(self.drift.window, dtype=torch.int64)
        return raw_id(self.positions(ranks, k), self.keys[feature])

    def _ids(self, f: FeatureSpec, n: int, k: int, g: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids as the table takes them, raw ids)`` of ``n`` draws of feature ``f``."""
        if f.name not in self.drifting:
            ids = zipf_ids(f.num_rows, n, f.zipf, g)
            return ids, ids
        rank = zipf_ids(self.drift.window, n, f.zipf, g)
        raw = raw_id(self.positions(rank, k), self.keys[f.name])
        return (raw if f.name in self.raw else torch.remainder(raw, f.num_rows)), raw

    def batch(self, k: int, split: int = 0) -> Batch:
        """Batch ``k`` of this rank (the window of step ``k``); ``split`` 1: held out."""
        g = torch.Generator().manual_seed(_mix(self.seed, split, self.rank, k))
        B, T = self.batch_size, len(self.features)
        dense = torch.randn(B, self.num_dense, generator=g, dtype=torch.float64)
        logit = self.drift.dense_weight * (dense @ self._w) / math.sqrt(self.num_dense)
        lengths, values = [], []
        signal = torch.zeros(B, dtype=torch.float64)
        for i, f in enumerate(self.features):
            L = torch.poisson(torch.full((B,), float(f.pooling_factor)), generator=g).long()
            ids, raw = self._ids(f, int(L.sum()), k, g)
            bag = torch.repeat_interleave(torch.arange(B), L)
            score = torch.zeros(B, dtype=torch.float64).index_add_(0, bag, id_score(raw, i))
            signal += score / L.clamp(min=1)
            lengths.append(L)
            values.append(ids)
        logit = logit + 2.0 * signal / max(T, 1)
        logit = logit + self.noise * torch.randn(B, generator=g, dtype=torch.float64)
        kjt = KeyedJaggedTensor(keys=[f.name for f in self.features], values=torch.cat(values),
                                lengths=torch.cat(lengths))
        return Batch(dense=dense.float(), sparse=kjt, labels=(logit > 0).float())

    def train_batches(self, position: DataPosition) -> Iterator[tuple[Batch, DataPosition]]:
        step = self.world_size * self.batch_size
        for k in itertools.count(position.samples // step):
            yield self.batch(k), DataPosition(epoch=position.epoch, samples=(k + 1) * step)

    def eval_batches_at(self, step: int, n: int) -> list[Batch]:
        """``n`` held-out batches from the windows of steps ``step .. step + n - 1``."""
        return [self.batch(step + j, split=1) for j in range(n)]

    def eval_batches(self, n: int) -> list[Batch]:
        """Held-out batches of the first windows (``eval_batches_at(0, n)``)."""
        return self.eval_batches_at(0, n)
