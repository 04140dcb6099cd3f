"""The reader of MLPerf DLRM-dcnv2's multi-hot Criteo 1TB files (``data.source: multihot``).

The reference (mlcommons/training ``recommendation_v2/torchrec_dlrm``: TorchRec's one-hot
preprocessing, then ``materialize_synthetic_multihot_dataset.py``) writes per day ``i``:

* ``day_<i>_dense.npy``: ``[N, 13]`` float32, already ``log``-transformed;
* ``day_<i>_sparse_multi_hot.npz``: an uncompressed zip of 26 arrays ``0.npy``..``25.npy``,
  array ``f`` ``[N, L_f]`` int32: sample ``n``'s bag of feature ``f`` (``L_f`` fixed ids);
* ``day_<i>_labels.npy``: ``[N, 1]`` int32 (or ``[N]``), 0 or 1.

Every array is memory-mapped (the npz members too, at their offset in the zip), so a batch
reads only its rows. As the reference's ``MultiHotCriteoIterDataPipe``, the rows of the days,
one after the other, are cut into R contiguous parts, rank ``r`` taking part ``r`` (the first
``N mod R`` parts one row longer), and ids are taken ``% E`` of their table. Every rank runs
``floor(N // R / B)`` full batches an epoch (the rest of its part is dropped, so that all ranks
run the same steps; the eval set is cut the same way, so its last ``< R B`` rows are not
evaluated, where the reference evaluates a last short batch). A ``DataPosition`` counts the
samples all ranks consumed: batch ``k`` of rank ``r`` is rows ``start_r + k B`` to
``start_r + (k + 1) B``, so a resume on the same world size and batch size continues with the
batch that comes next.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from fbtriton_dist.sparse import KeyedJaggedTensor

from .config import MultiHotConfig
from .data import Batch, DataPosition, FeatureSpec

__all__ = ["MultiHotDay", "MultiHotSource", "npz_memmap", "rank_range"]


def npz_memmap(path: str, member: str) -> np.memmap:
    """The array ``member`` (``"3.npy"``) of the npz ``path``, memory-mapped where it lies in
    the zip; a compressed member (``np.savez_compressed``) is refused by name."""
    with zipfile.ZipFile(path) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ValueError(f"{path}: no array {member!r} (has {len(zf.namelist())}: "
                             f"{', '.join(zf.namelist()[:4])}...)") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{path}: {member} is compressed; expected np.savez (stored), "
                             "as the reference writes it, not np.savez_compressed")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)  # the local file header: its name and extra field lengths
        if local[:4] != b"PK\x03\x04":
            raise ValueError(f"{path}: {member}: bad zip local header")
        name_len = int.from_bytes(local[26:28], "little")
        extra_len = int.from_bytes(local[28:30], "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read(f)
        offset = f.tell()
    return np.memmap(path, dtype=dtype, mode="r", shape=shape, offset=offset,
                     order="F" if fortran else "C")


class MultiHotDay:
    """One day's three files, memory-mapped: ``rows`` samples, ``dense`` [N, 13],
    ``sparse`` (one [N, L_f] array per feature), ``labels`` [N, ...]."""

    def __init__(self, prefix: str, num_features: int) -> None:
        paths = {k: f"{prefix}_{k}" for k in ("dense.npy", "sparse_multi_hot.npz", "labels.npy")}
        for p in paths.values():
            if not os.path.isfile(p):
                raise ValueError(f"data.multihot: {p} not found (a day of the reference's "
                                 "multi-hot files: docs/mlperf.md)")
        self.dense = np.load(paths["dense.npy"], mmap_mode="r")
        self.labels = np.load(paths["labels.npy"], mmap_mode="r")
        npz = paths["sparse_multi_hot.npz"]
        self.sparse = [npz_memmap(npz, f"{f}.npy") for f in range(num_features)]
        self.rows = self.dense.shape[0]
        for what, a in [("labels.npy", self.labels)] + [
                (f"sparse_multi_hot.npz {f}.npy", s) for f, s in enumerate(self.sparse)]:
            if a.shape[0] != self.rows or (what != "labels.npy" and a.ndim != 2):
                raise ValueError(f"{prefix}_{what}: shape {a.shape}, expected {self.rows} rows "
                                 f"as {prefix}_dense.npy {self.dense.shape}")


def rank_range(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s contiguous part of ``total`` rows: R parts, the
    first ``total mod R`` one row longer (the reference's split)."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


class _Rows:
    """Rows ``[a, b)`` of several days read as one array (a batch may span two days)."""

    def __init__(self, days: Sequence[MultiHotDay], first: int = 0, stop: int | None = None):
        self.days = list(days)
        self.starts = np.cumsum([0] + [d.rows for d in self.days]).tolist()
        self.first = first
        self.stop = self.starts[-1] if stop is None else stop

    @property
    def rows(self) -> int:
        return self.stop - self.first

    def take(self, a: int, b: int) -> list[tuple[MultiHotDay, slice]]:
        """Rows ``[a, b)`` (of this view) as ``(day, rows of that day)`` pieces, in order."""
        a, b = a + self.first, b + self.first
        out = []
        for day, s in zip(self.days, self.starts, strict=False):
            lo, hi = max(a, s), min(b, s + day.rows)
            if lo < hi:
                out.append((day, slice(lo - s, hi - s)))
        return out


class MultiHotSource:
    """The job's source over the multi-hot files (see the module docstring): this rank's
    contiguous part of the training days, ``B`` rows a batch; the eval days (or their half,
    ``eval_part``) cut the same way."""

    def __init__(self, features: Sequence[FeatureSpec], cfg: MultiHotConfig, *,
                 batch_size: int, rank: int = 0, world_size: int = 1,
                 resolve=lambda p: p) -> None:
        by_name = {f.name: f for f in features}
        self.keys = list(cfg.features) if cfg.features else [f.name for f in features]
        self.hash_sizes = np.array([by_name[k].num_rows for k in self.keys], dtype=np.int64)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        n = len(self.keys)
        self.train = _Rows([MultiHotDay(resolve(cfg.prefix(d)), n) for d in cfg.train_days])
        self._eval_days = [MultiHotDay(resolve(cfg.prefix(d)), n) for d in cfg.eval_days]
        whole = _Rows(self._eval_days)
        half = math.ceil(whole.rows / 2)
        lo, hi = {"val": (0, half), "test": (half, whole.rows), "all": (0, whole.rows)}[
            cfg.eval_part]
        self.eval = _Rows(self._eval_days, lo, hi)
        self.bag_sizes = [int(s.shape[1]) for s in self.train.days[0].sparse]

    def _part(self, rows: _Rows) -> tuple[int, int]:
        return rank_range(rows.rows, self.rank, self.world_size)

    @property
    def steps_per_epoch(self) -> int:
        """Full batches every rank runs in an epoch of the training days."""
        return self.train.rows // self.world_size // self.batch_size

    def _batch(self, rows: _Rows, a: int, b: int) -> Batch:
        pieces = rows.take(a, b)
        B = b - a
        dense = np.concatenate([d.dense[s] for d, s in pieces]).astype(np.float32, copy=False)
        labels = np.concatenate([d.labels[s].reshape(-1) for d, s in pieces])
        values, lengths = [], []
        for f, (L, E) in enumerate(zip(self.bag_sizes, self.hash_sizes, strict=True)):
            ids = np.concatenate([d.sparse[f][s] for d, s in pieces]).astype(np.int64)
            values.append(torch.from_numpy(ids.reshape(-1) % E))
            lengths.append(torch.full((B,), L, dtype=torch.int64))
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.cat(values),
                                lengths=torch.cat(lengths))
        return Batch(dense=torch.from_numpy(np.ascontiguousarray(dense)),
                     sparse=kjt, labels=torch.from_numpy(labels.astype(np.float32)))

    def train_batches(self, position: DataPosition) -> Iterator[tuple[Batch, DataPosition]]:
        start, _ = self._part(self.train)
        step = self.world_size * self.batch_size
        for k in range(position.samples // step, self.steps_per_epoch):
            a = start + k * self.batch_size
            yield (self._batch(self.train, a, a + self.batch_size),
                   DataPosition(epoch=position.epoch, samples=(k + 1) * step))

    def eval_batches(self, n: int | str) -> _EvalBatches:
        """This rank's first ``n`` eval batches (``all``: every full batch of its part, the
        same count on every rank: ``floor(N // R / B)``), read lazily when iterated."""
        start, _ = self._part(self.eval)
        count = self.eval.rows // self.world_size // self.batch_size
        if n != "all":
            count = min(count, int(n))
        B = self.batch_size
        return _EvalBatches(self, [(start + k * B, start + (k + 1) * B) for k in range(count)])


class _EvalBatches:
    """Eval batches made when iterated (the whole eval set never sits in memory)."""

    def __init__(self, source: MultiHotSource, bounds: list[tuple[int, int]]) -> None:
        self.source, self.bounds = source, bounds

    def __len__(self) -> int:
        return len(self.bounds)

    def __iter__(self) -> Iterator[Batch]:
        for a, b in self.bounds:
            yield self.source._batch(self.source.eval, a, b)
