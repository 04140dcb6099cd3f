"""Data sources of the training job; each yields :class:`Batch` es of this rank's samples.

* :class:`SyntheticSource`: Zipf ids, Poisson bag lengths around each feature's pooling factor,
  Gaussian dense features, and labels from a hidden function of dense and sparse inputs (so the
  loss can go down). Batch ``k`` of rank ``r`` is a pure function of ``(seed, r, k)`` and the
  kind of device it is made on (the training GPU by default: ``data.synthetic.device``). With
  ``candidates_per_user`` K > 1 its batches are VBE: each user's K candidates share one bag of
  every user feature.
* :class:`RandomRecSource`: TorchRec's ``RandomRecDataset`` (uniform ids, random labels).
* :class:`CriteoSource`: Criteo click-logs TSV lines (label, 13 integer, 26 hex categorical
  columns; any column may be empty), line ``g`` of an epoch going to rank ``g % R``; ids
  ``int(hex, 16) % E``, or raw (no ``% E``) for a managed table's features (``id_manager``).
* ``open_ids.DriftingSource`` (``data.synthetic.drift``): raw ids from an open id space that
  drifts, new ids every step (``sources.make_source`` picks it: it builds on this module).

Every source has ``train_batches(position)`` yielding ``(batch, position after it)`` until the
epoch ends (synthetic ones never end) and ``eval_batches(n)``. A :class:`DataPosition` counts the
samples consumed by all ranks in the current epoch, so a resumed job -- even on another number
of ranks -- continues where the checkpoint left off.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from fbtriton_dist.planner import TableSet
from fbtriton_dist.planner.stats import generalized_harmonic

from .config import CRITEO_DENSE, CRITEO_SPARSE, CriteoConfig, DataConfig, RandomRecConfig

__all__ = [
    "Batch",
    "CriteoSource",
    "DataPosition",
    "FeatureSpec",
    "RandomRecSource",
    "SyntheticSource",
    "expand_bags",
    "feature_specs",
    "make_source",
    "managed_features",
    "parse_criteo_line",
    "zipf_ids",
]


@dataclass(frozen=True, eq=False)
class Batch:
    """B samples of one rank."""

    dense: torch.Tensor
    """[B, num_dense] float32 dense features."""
    sparse: KeyedJaggedTensor
    """Ids of every feature, B bags each."""
    labels: torch.Tensor
    """[B] float32 click labels in {0, 1}."""
    ready: torch.cuda.Event | None = None
    """A batch made on a CUDA side stream: the event recorded after it was made (None: ready).
    :meth:`to` makes the current stream wait for it."""

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def pin_memory(self) -> Batch:
        """The batch in page-locked host memory (CUDA): ``to(cuda, non_blocking=True)`` is
        then an asynchronous copy. A batch already on the GPU is returned as it is."""
        if self.labels.device.type != "cpu":
            return self
        return Batch(dense=self.dense.pin_memory(), sparse=self.sparse.pin_memory(),
                     labels=self.labels.pin_memory())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch on ``device``. A batch made on a side stream (``ready``) is first waited
        for by the current stream, which the allocator is told uses its tensors."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(self.labels.device)
            stream.wait_event(self.ready)
            for t in (self.dense, self.labels):
                t.record_stream(stream)
            self.sparse.record_stream(stream)
            inverse = self.sparse.inverse_indices_or_none()
            if inverse is not None:
                inverse[1].record_stream(stream)
        return Batch(
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse=self.sparse.to(torch.device(device), non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
        )


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: samples consumed by all ranks so far in epoch ``epoch``."""

    epoch: int = 0
    samples: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples": self.samples}


@dataclass(frozen=True)
class FeatureSpec:
    """One sparse feature as the data sources see it."""

    name: str
    num_rows: int
    """E of the feature's table: ids are in [0, E)."""
    pooling_factor: float
    """L, mean ids per bag."""
    zipf: float
    """Zipf exponent of the ids (0: uniform)."""


def feature_specs(tables: TableSet, data: DataConfig) -> list[FeatureSpec]:
    """Every feature of ``tables`` in table order, with its rows, pooling factor and exponent
    (``data.synthetic.zipf_per_feature``, else the table's ``id_distribution``, else
    ``data.synthetic.zipf``)."""
    out = []
    for t in tables.tables:
        stats = tables.stats.get(t.name)
        alpha = data.synthetic.zipf
        if stats is not None and stats.kind in ("zipf", "uniform"):
            alpha = stats.alpha if stats.kind == "zipf" else 0.0
        for i, f in enumerate(t.features):
            L = t.pooling_factors[i] if t.pooling_factors else 1.0
            a = data.synthetic.zipf_per_feature.get(f, alpha)
            out.append(FeatureSpec(name=f, num_rows=t.num_embeddings, pooling_factor=L, zipf=a))
    return out


def zipf_ids(E: int, n: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """``n`` ids in [0, E), row 0 hottest: Zipf(alpha), ``P(id = r) ~ (r + 1) ** -alpha``, the
    law the planner assumes (``planner.stats``; see :func:`power_law_rows`)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)
    return power_law_rows(u, E, alpha)


PREFIX_ROWS = 1024
"""Rows whose ids :func:`zipf_rows` finds exactly (the planner sums as many terms exactly)."""


def zipf_rows(u: torch.Tensor, feature: torch.Tensor | None, num_rows: Sequence[int],
              alphas: Sequence[float]) -> torch.Tensor:
    """The ids of uniforms ``u`` (float64), id i of feature ``feature[i]`` (None: all of
    feature 0) over ``num_rows[f]`` rows, Zipf(``alphas[f]``) (0: uniform): ``P(id = r) =
    (r + 1) ** -alpha / H(E)``, the planner's discrete law (``planner.stats``). Exact on the
    first ``PREFIX_ROWS`` rows, where most ids go (a search of the summed terms); beyond, the
    row where the Euler-Maclaurin sum the planner uses reaches ``u * H(E)``, from the
    integral's closed-form inverse (its end corrections make it half a row high, taken off),
    floored: within a row of the planner's. A few elementwise kernels whatever the number of
    features (their constants gathered per id)."""
    dev, K = u.device, float(PREFIX_ROWS)
    levels = sorted(set(alphas))
    top = 1.0 + max(generalized_harmonic(K, a) for a in levels)  # per level, apart
    terms = torch.arange(1, PREFIX_ROWS + 1, dtype=torch.float64)
    heads = torch.cat([torch.cat([terms.new_zeros(1), torch.cumsum(terms**-a, 0)]) + j * top
                       for j, a in enumerate(levels)]).to(dev)
    consts = []  # per feature: H(E), E, p = 1 - alpha, K ** p, the tail's x offset, level
    for E, a in zip(num_rows, alphas, strict=True):
        p = 1.0 - a if abs(1.0 - a) > 1e-9 else 1e-9
        head_total = generalized_harmonic(K, a)
        consts.append((generalized_harmonic(E, a), float(E), p, K**p,
                       K**-a / 2.0 - a * K ** (-a - 1.0) / 12.0 - head_total, levels.index(a)))
    columns = torch.tensor(consts, dtype=torch.float64, device=dev).T.contiguous()
    total, E, p, Kp, offset, level = (col[feature] if feature is not None else col[0]
                                      for col in columns)
    h = u * total  # id r: H(r) <= h < H(r + 1)
    if len(levels) == 1:
        head = torch.searchsorted(heads, h, right=True) - 1  # PREFIX_ROWS: beyond the terms
    else:  # each level's terms shifted apart by ``top``
        head = torch.searchsorted(heads, h + level * top, right=True) - (
            level.long() * (PREFIX_ROWS + 1) + 1)
    x = h + offset  # the integral from K to the row
    r = K * torch.exp(torch.log1p((p * x / Kp).clamp(min=-1.0 + 1e-16)) / p) - 0.5
    tail = torch.minimum(r.clamp(min=K), E - 1.0).floor().long()
    return torch.where(head >= PREFIX_ROWS, tail, head).clamp_(min=0)


def power_law_rows(u: torch.Tensor, E: int, alpha: float) -> torch.Tensor:
    """:func:`zipf_rows` of one table: ``E`` rows, Zipf(``alpha``) (0: uniform)."""
    return zipf_rows(u, None, [E], [alpha])


def _row_score(ids: torch.Tensor, salt: torch.Tensor | int) -> torch.Tensor:
    """A fixed pseudo-random score in [-1, 1) per (feature ``salt``, row): the hidden
    embedding."""
    h = ((ids % 2147483647) * 2654435761 + salt * 40503 + 12345) % 4294967296
    h = (h ^ (h >> 15)) * 2246822519 % 4294967296
    return h.double() / 2147483648.0 - 1.0


def _mix(*values: int) -> int:
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = ((x ^ (v & 0xFFFFFFFFFFFF)) * 0x100000001B3) % (1 << 63)
    return x


def expand_bags(lengths: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The ids of bags ``rows`` (``lengths`` [n] bags of ``ids``), one after the other (the
    fixed-batch copy of a VBE feature: ``rows`` its inverse indices)."""
    starts = torch.cumsum(lengths, 0) - lengths
    picked = lengths[rows]
    n = int(picked.sum())
    first = torch.repeat_interleave(starts[rows] - (torch.cumsum(picked, 0) - picked), picked,
                                    output_size=n)
    return ids[torch.arange(n, device=ids.device) + first]


class SyntheticSource:
    """Synthetic batches, batch ``k`` of rank ``rank`` a pure function of ``(seed, rank, k)``
    on a given kind of ``device`` (CPU and CUDA draw different random streams). On CUDA the
    ids are made on the GPU, in the data thread, on a side stream: a CPU cannot draw the
    hundreds of millions of Zipf ids per second a GPU trains on.

    Bag lengths are Poisson(L); ids Zipf over the table's rows. The label of a sample is
    ``1[dense . w / sqrt(n) + 2 * mean_f(mean of h_f(id) over the bag) + noise * N(0,1) > 0]``
    with fixed hidden ``w`` and per-row scores ``h_f`` in [-1, 1): the dense and embedding
    layers can both learn it.

    ``candidates_per_user`` K > 1: sample ``b`` is candidate ``b % K`` of user ``b // K``
    (ceil(B / K) users). ``user_features`` (default: the first half) then have one bag per
    user, the others one per sample: a KJT with ``stride_per_key_per_rank`` and
    ``inverse_indices`` (each sample's row of every feature), as TorchRec's VBE batches;
    ``vbe=False``: the same samples as a fixed batch (each user bag copied per candidate).
    ``fixed_bags``: every bag exactly L ids (L rounded), as MLPerf's multi-hot data.
    """

    def __init__(
        self,
        features: Sequence[FeatureSpec],
        *,
        num_dense: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        noise: float = 0.5,
        candidates_per_user: int = 1,
        user_features: Sequence[str] | None = None,
        vbe: bool = True,
        device: torch.device | str = "cpu",
        fixed_bags: bool = False,
    ) -> None:
        self.features = list(features)
        self.fixed_bags = fixed_bags
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream: torch.cuda.Stream | None = None
        names = [f.name for f in self.features]
        if user_features is None:
            user_features = names[: len(names) // 2]
        unknown = [f for f in user_features if f not in names]
        if unknown:
            raise ValueError(f"user_features: {unknown} are not features of the source, "
                             f"expected some of {names}")
        self.candidates_per_user, self.vbe = candidates_per_user, vbe
        self.user_features = frozenset(user_features) if candidates_per_user > 1 else frozenset()
        self.num_dense, self.batch_size = num_dense, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.noise = noise
        g = torch.Generator().manual_seed(_mix(seed, 0xD15E))
        self._w = torch.randn(num_dense, generator=g, dtype=torch.float64).to(self.device)

    def batch(self, k: int, split: int = 0) -> Batch:
        """Batch ``k`` of this rank; ``split`` 0 trains, 1 evaluates (a disjoint stream).

        On CUDA it is made on a side stream of its own (the data thread's work overlaps the
        training step) and carries the event that marks it ready: :meth:`Batch.to` makes the
        consumer's stream wait for it."""
        if self.device.type != "cuda":
            return self._make(k, split)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            batch = self._make(k, split)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        return Batch(dense=batch.dense, sparse=batch.sparse, labels=batch.labels, ready=ready)

    def _make(self, k: int, split: int) -> Batch:
        """The batch, every feature at once: one draw of the bag lengths, of the ids and of
        their scores (a few kernels whatever the number of features; one host sync)."""
        dev = self.device
        g = torch.Generator(device=dev).manual_seed(_mix(self.seed, split, self.rank, k))
        B, T, K = self.batch_size, len(self.features), self.candidates_per_user
        f64 = {"dtype": torch.float64, "device": dev}
        dense = torch.randn(B, self.num_dense, generator=g, **f64)
        logit = dense @ self._w / math.sqrt(self.num_dense)
        user_side = [f.name in self.user_features for f in self.features]
        bags = [-(-B // K) if u else B for u in user_side]  # bags of each feature
        rate = torch.tensor([f.pooling_factor for f in self.features], **f64)
        bag_feature = torch.repeat_interleave(torch.arange(T, device=dev),
                                              torch.tensor(bags, device=dev))
        if self.fixed_bags:  # MLPerf's multi-hot bags: exactly L ids each
            lengths = rate[bag_feature].round().long()
        else:
            lengths = torch.poisson(rate[bag_feature], generator=g).long()
        n = int(lengths.sum())  # the one host sync
        id_feature = torch.repeat_interleave(bag_feature, lengths, output_size=n)
        u = torch.rand(n, generator=g, **f64)
        ids = zipf_rows(u, id_feature, [f.num_rows for f in self.features],
                        [f.zipf for f in self.features])
        score = _row_score(ids, id_feature)
        ends = torch.cumsum(lengths, 0)
        # each bag's mean hidden score: differences of one running sum (deterministic)
        total = torch.cumsum(score, 0)
        total = torch.cat([total.new_zeros(1), total])
        mean = (total[ends] - total[ends - lengths]) / lengths.clamp(min=1)
        # the bag of feature f that sample b reads: its user's (user features) or its own
        first = torch.tensor([0, *itertools.accumulate(bags)][:T], device=dev)
        sample = torch.arange(B, device=dev)
        own = torch.where(torch.tensor(user_side, device=dev)[:, None],
                          (sample // K)[None, :], sample[None, :])  # [T, B]
        read = first[:, None] + own
        logit = logit + 2.0 * mean[read].sum(0) / max(T, 1)
        logit = logit + self.noise * torch.randn(B, generator=g, **f64)
        keys = [f.name for f in self.features]
        vbe = {}
        if self.user_features and self.vbe:
            vbe = {"stride_per_key_per_rank": [[b] for b in bags],
                   "inverse_indices": (keys, own)}
        elif self.user_features:  # every sample gets its own copy of its user's bags
            ids = expand_bags(lengths, ids, read.reshape(-1))
            lengths = lengths[read.reshape(-1)]
        kjt = KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths, **vbe)
        return Batch(dense=dense.float(), sparse=kjt, labels=(logit > 0).float())

    def train_batches(self, position: DataPosition) -> Iterator[tuple[Batch, DataPosition]]:
        step = self.world_size * self.batch_size
        for k in itertools.count(position.samples // step):
            yield self.batch(k), DataPosition(epoch=position.epoch, samples=(k + 1) * step)

    def eval_batches(self, n: int) -> list[Batch]:
        return [self.batch(k, split=1) for k in range(n)]


class RandomRecSource:
    """``torchrec.datasets.random.RandomRecDataset`` batches (rank ``r`` seeded by ``seed`` and
    ``r``), converted to :class:`Batch`. Ids are uniform and labels random: nothing to learn,
    the source measures speed."""

    def __init__(
        self,
        features: Sequence[FeatureSpec],
        cfg: RandomRecConfig,
        *,
        num_dense: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.features, self.cfg = list(features), cfg
        self.num_dense, self.batch_size = num_dense, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size

    def _dataset(self, split: int) -> Iterable:
        from torchrec.datasets.random import RandomRecDataset

        ids = [self.cfg.ids_per_feature or max(1, round(f.pooling_factor)) for f in self.features]
        return RandomRecDataset(
            keys=[f.name for f in self.features],
            batch_size=self.batch_size,
            hash_sizes=[f.num_rows for f in self.features],
            ids_per_features=ids,
            num_dense=self.num_dense,
            manual_seed=_mix(self.seed, split, self.rank) % (1 << 31),
            num_generated_batches=self.cfg.num_generated_batches,
        )

    @staticmethod
    def _convert(b) -> Batch:
        return Batch(
            dense=b.dense_features.float(), sparse=b.sparse_features, labels=b.labels.float()
        )

    def train_batches(self, position: DataPosition) -> Iterator[tuple[Batch, DataPosition]]:
        step = self.world_size * self.batch_size
        k0 = position.samples // step
        for k, b in enumerate(itertools.islice(self._dataset(0), k0, None), start=k0):
            yield self._convert(b), DataPosition(epoch=position.epoch, samples=(k + 1) * step)

    def eval_batches(self, n: int) -> list[Batch]:
        return [self._convert(b) for b in itertools.islice(self._dataset(1), n)]


def _dense_value(text: str, i: int) -> float:
    """One integer column: ``log(1 + max(x, 0))``, empty = 0; nan / inf refused by name."""
    if not text:
        return 0.0
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"integer column {i + 1}: {text!r} is not a finite number")
    return math.log1p(max(x, 0.0))


_HEX_ID = re.compile(r"[0-9a-fA-F]{1,16}")
"""A categorical value: hex digits only (Criteo's are 8), at most 64 bits; ``int(x, 16)``
alone also took ``-5f``, ``0x5f``, ``5_f`` and surrounding blanks."""


def _hex_id(text: str, j: int) -> int:
    """A categorical column's hex value; anything but 1-16 hex digits is refused by name."""
    if not _HEX_ID.fullmatch(text):
        raise ValueError(f"categorical column C{j + 1}: {text!r} is not a 64-bit hex id "
                         "(1-16 hex digits, no sign or prefix; Criteo's are 8)")
    return int(text, 16)


def _raw_id(text: str, j: int) -> int:
    """A categorical column's hex value as a raw int64 id: up to 64 bits, those of 2**63 and
    above wrapped to negative ids (two's complement, as in the id's bits)."""
    x = _hex_id(text, j)
    return x - (1 << 64) if x >= 1 << 63 else x


def parse_criteo_line(
    line: str, hash_sizes: Sequence[int | None], where: str = "<line>"
) -> tuple[float, list[float], list[int | None]]:
    """One Criteo TSV line -> (label, 13 dense values ``log(1 + max(x, 0))`` with empty = 0,
    26 categorical ids ``int(hex, 16) % E_j`` with empty = None). ``E_j`` None: the raw
    hashed id ``int(hex, 16)`` as an int64 (a managed table's, ``_raw_id``)."""
    cols = line.rstrip("\r\n").split("\t")
    n = 1 + CRITEO_DENSE + CRITEO_SPARSE
    if len(cols) != n:
        raise ValueError(f"{where}: expected {n} tab-separated columns, got {len(cols)}")
    try:
        label = float(cols[0] or 0)
        dense = [_dense_value(c, i) for i, c in enumerate(cols[1 : 1 + CRITEO_DENSE])]
        cats = [
            (_raw_id(c, j) if E is None else _hex_id(c, j) % E) if c else None
            for j, (c, E) in enumerate(zip(cols[1 + CRITEO_DENSE :], hash_sizes, strict=True))
        ]
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if label not in (0.0, 1.0):
        raise ValueError(f"{where}: expected label 0 or 1, got {cols[0]!r}")
    return label, dense, cats


class CriteoSource:
    """Criteo TSV files, read in order; global line ``g`` of an epoch belongs to rank ``g % R``.

    One step consumes ``R * B`` lines; a last group shorter than that is dropped (every rank
    runs the same number of steps). Resuming at ``samples`` skips that many lines. The files
    are streamed: ``R * B`` lines in memory at a time, whatever their size.
    """

    def __init__(
        self,
        features: Sequence[FeatureSpec],
        cfg: CriteoConfig,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        resolve=lambda p: p,
        raw_features: Collection[str] = (),
    ) -> None:
        by_name = {f.name: f for f in features}
        columns = list(cfg.features) if cfg.features else [f.name for f in features]
        self.columns = columns
        # ``raw_features`` (a managed table's): the raw hashed id, no ``% E``
        self.hash_sizes = [None if c in raw_features else by_name[c].num_rows for c in columns]
        self.train_paths = [resolve(p) for p in cfg.train]
        self.eval_paths = [resolve(p) for p in cfg.eval]
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        for key, paths in (("train", self.train_paths), ("eval", self.eval_paths)):
            for i, path in enumerate(paths):
                if not os.path.exists(path) or os.path.isdir(path):  # a pipe is fine
                    what = "is a folder" if os.path.isdir(path) else "not found"
                    raise ValueError(f"data.criteo.{key}[{i}]: {path}: {what} (relative paths "
                                     "are from the job file's folder)")
                if key == "eval" and os.path.isfile(path) and os.path.getsize(path) == 0:
                    raise ValueError(f"data.criteo.eval[{i}]: {path} is empty: no full batch "
                                     "to evaluate on (eval_auc would be nan); give a file with "
                                     "lines, or no data.criteo.eval")

    @staticmethod
    def _lines(paths: Sequence[str], skip: int = 0) -> Iterator[tuple[str, str, int]]:
        """``(line, path, line number)`` of the files in order, the first ``skip`` lines left
        out: a stream, one buffered line at a time (never a whole file in memory); skipped
        lines are read past without being parsed or kept."""
        for path in paths:
            i = 0
            try:
                with open(path, encoding="utf-8") as f:
                    skipped = sum(1 for _ in itertools.islice(f, skip)) if skip else 0
                    skip -= skipped
                    i = skipped
                    for i, line in enumerate(f, start=skipped + 1):
                        yield line, path, i
            except UnicodeDecodeError as e:
                byte = e.object[e.start]
                raise ValueError(f"{path}:{i + 1}: not text ({e.reason}, byte 0x{byte:02x}): "
                                 "expected a Criteo TSV file (uncompressed)") from e

    def _batch(self, lines: Sequence[tuple[str, str, int]]) -> Batch:
        parsed = [parse_criteo_line(line, self.hash_sizes, f"{path}:{i}")
                  for line, path, i in lines]
        B = len(parsed)
        labels = torch.tensor([p[0] for p in parsed], dtype=torch.float32)
        dense = torch.tensor([p[1] for p in parsed], dtype=torch.float32).reshape(B, CRITEO_DENSE)
        lengths, values = [], []
        for j in range(CRITEO_SPARSE):  # feature-major
            col = [p[2][j] for p in parsed]
            lengths += [0 if v is None else 1 for v in col]
            values += [v for v in col if v is not None]
        kjt = KeyedJaggedTensor(
            keys=self.columns,
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64),
        )
        return Batch(dense=dense, sparse=kjt, labels=labels)

    def _batches(self, paths: Sequence[str], skip: int) -> Iterator[tuple[Batch, int]]:
        R, B = self.world_size, self.batch_size
        lines = self._lines(paths, skip)
        consumed = skip
        while True:
            group = list(itertools.islice(lines, R * B))
            if len(group) < R * B:
                return
            consumed += R * B
            yield self._batch(group[self.rank :: R]), consumed

    def train_batches(self, position: DataPosition) -> Iterator[tuple[Batch, DataPosition]]:
        for batch, consumed in self._batches(self.train_paths, position.samples):
            yield batch, DataPosition(epoch=position.epoch, samples=consumed)

    def eval_batches(self, n: int) -> list[Batch]:
        if not self.eval_paths:
            return []
        out = [b for b, _ in itertools.islice(self._batches(self.eval_paths, 0), n)]
        if n and not out:  # else no evaluation at all, and eval_auc: nan without a word
            need = self.world_size * self.batch_size
            raise ValueError(f"data.criteo.eval: {', '.join(self.eval_paths)} gave no full batch "
                             f"of {need} lines ({self.world_size} rank(s) x {self.batch_size}) "
                             "to evaluate on; give more lines, or no data.criteo.eval")
        return out


def managed_features(tables: TableSet) -> set[str]:
    """The features of managed tables (``id_manager``): they take raw ids of any value."""
    return {f for t in tables.tables if t.name in tables.id_managers for f in t.features}


def make_source(
    tables: TableSet,
    data: DataConfig,
    *,
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    resolve=lambda p: p,
    device: torch.device | str = "cpu",
) -> SyntheticSource | RandomRecSource | CriteoSource:
    """The source ``data.source`` names, for this rank; ``device`` is the training device
    (synthetic batches are made there unless ``data.synthetic.device: cpu``)."""
    features = feature_specs(tables, data)
    common = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
    raw = managed_features(tables)  # their ids raw, no `% E`
    if data.source == "synthetic":
        syn = data.synthetic
        return SyntheticSource(
            features, num_dense=data.num_dense, seed=seed, noise=syn.noise,
            candidates_per_user=syn.candidates_per_user, user_features=syn.user_features,
            vbe=syn.vbe, device=device if syn.device == "auto" else "cpu",
            fixed_bags=syn.fixed_bags,
            **common,
        )
    if data.source == "random_rec":
        return RandomRecSource(
            features, data.random_rec, num_dense=data.num_dense, seed=seed, **common
        )
    if data.criteo is None:  # JobConfig checks it; a direct caller may not have
        raise ValueError("data.criteo: required with data.source: criteo")
    return CriteoSource(features, data.criteo, resolve=resolve, raw_features=raw, **common)
