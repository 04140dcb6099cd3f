"""The cost model: memory, lookup bytes and communication bytes per rank per training step.

Symbols: R ranks, H ranks per host, B local batch per rank, for a table: E rows, D columns,
s bytes per weight, L ids per sample (sum of the pooling factors of its features), F features;
i bytes per id, l bytes per bag length, o bytes per pooled value; for a shard: its rows
``rows``, columns ``c`` and ``p``, the share of the table's lookups that hit its rows (from
the table's :class:`IdDistribution`). Every term below is per rank, per step.

* ``weight_bytes`` = rows x c x s
* ``state_bytes``  (optimizer state, from ``optim.REGISTRY``, in the table's ``state_dtype``:
  4 B a value in fp32 as in FBGEMM, 2 in bf16 / fp16; ``memory.table_state_bytes``): none/sgd
  0, rowwise_adagrad rows x 4, adagrad rows x c x 4, adam 2 x rows x c x 4 (fp32)
* ``lookups``      ids gathered in the forward: row-wise kinds R·B·L·p, table-/column-wise
  R·B·L, data-parallel B·L
* ``lookup_bytes`` = lookups x c x s (the forward gather; backward costs ``backward_factor``
  times as much and is included in the time)
* ``input_dist_bytes``  ids and lengths this rank receives: a row shard (R-1)·B·(L·p·i + F·l),
  a table/column shard (R-1)·B·(L·i + F·l), data-parallel 0
* ``output_dist_bytes`` pooled values and their gradients this rank receives (forward +
  backward): every rank gets its B x c slice from each shard holder other than itself; a
  holder gets the (R-1)·B x c gradients back (row-wise: the reduce-scatter / all-gather pair;
  table-row-wise: (k-1)·R·B/k·c·o twice inside the host for k holders, plus R·B/k·c·o back;
  grid-shard: each column slice of c columns counts as a table-row-wise table of width c on
  its host, so every slice gathers, and receives the ids of, all the table's lookups);
  data-parallel: the ring all-reduce of the dense gradient, 2·(R-1)/R·E·D·s
* a sequence table (``pooling: none``, an EmbeddingCollection's) returns one row per id: the
  pooled B x c above becomes B·L x c (a row block: B·L·p x c from each holder, both ways, and
  no sum inside the host for table-row-wise and grid)
* ``inter_host_bytes``  the part of the two comm terms that crosses hosts: traffic from all
  other ranks crosses with odds (R-H)/(R-1); traffic from a known rank crosses if its host differs
* ``host_tier_bytes`` / ``disk_tier_bytes`` (a ``cached`` / ``file`` shard): the rows its
  cache loads per step and the dirty rows it writes back (as many: training updates every row
  it looks up), misses x 2 x (c·s + the state of one row), the misses from the table's id
  distribution (``cache_model``: the steady-state hit rate of the shard's cache); a ``host``
  shard: its step's distinct rows U copied into device memory and back (the staged
  training lookup), U x 2 x (c·s + the state of one row) in ``host_tier_bytes``
* ``time_s`` = lookup_bytes·(1 + backward_factor)/hbm_bandwidth
  + intra-host bytes/intra_host_bandwidth + inter_host_bytes/inter_host_bandwidth
  + host_tier_bytes/host_tier_bandwidth + disk_tier_bytes/disk_bandwidth

Comm counts bytes *received*: links are full duplex and a step waits for the last arrival.
``evaluate(..., collectives=True)`` also files every comm byte under the collective that
carries it (``PlanCost.collectives``: the input dist's ids and header; the output dist's
forward all-to-all, backward, in-host reduce-scatter and all-gather; the data-parallel
gradient all-gather; a sequence table's rows both ways), which the simulation checks one by
one.
The imbalance of a term is max/mean over ranks. Each holder's terms are linear in p, which
is what makes the skew-aware row cuts (stats.balanced_cuts) exact bisections.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._yaml import check_choice, check_int, check_number
from .cache_model import TierTraffic, block_traffic, staged_traffic
from .memory import as_planned, device_rows, table_state_bytes
from .plan import ShardingPlan
from .shards import Shard, TableSharding
from .stats import IdDistribution, cdf_array
from .tables import TableSpec

__all__ = ["Blocks", "CostModel", "PlanCost", "RankCost", "evaluate", "header_bytes"]

UNIFORM = IdDistribution()
INT32_ROWS = 2**31
"""Ids of a shard with at least this many rows travel as int64 (else int32)."""
TIME_QUANTUM = 1e-8
"""Per-rank times closer than this (seconds) count as equal when the planner compares them."""
WIRE_FORMATS = {"fp32": (4, 0), "bf16": (2, 0), "fp16": (2, 0), "fp8": (1, 4), "int8": (1, 8)}
"""Bytes per value and per row of each wire format of the output dist: a row is one sample's
(sequence: one id's) columns of one shard-feature; fp8 sends an fp32 scale per row, int8 an
fp32 scale and bias (``fbtriton_dist.sharding.comm.wire``)."""
REPLICA_GRAD_BYTES = 4
"""Bytes per gradient value of a data-parallel table's all-gather (fp32 whatever the wire
dtype of the pooled values: every replica takes the same exact update)."""


@dataclass(kw_only=True, frozen=True)
class CostModel:
    """Workload and machine numbers the cost terms are computed from."""

    batch_size: int = 512
    """B, samples per rank per step."""
    index_bytes: int | None = None
    """i, bytes per id sent by input dist; None: as the input dist sends them, 4 (int32) for
    a shard of fewer than 2**31 rows, else 8 (int64)."""
    length_bytes: int = 4
    """l, bytes per bag length sent by input dist (int32)."""
    output_bytes: int = 4
    """o, bytes per pooled value sent by output dist, forward (fp32)."""
    output_row_bytes: int = 0
    """Bytes per row (one sample's columns of one shard; sequence: one id's) the forward output
    dist adds: the scales of an 8-bit wire (``WIRE_FORMATS``)."""
    grad_bytes: int | None = None
    """Bytes per gradient value sent by output dist (backward); None: ``output_bytes``."""
    grad_row_bytes: int | None = None
    """Bytes per gradient row (backward); None: ``output_row_bytes``."""
    hbm_bandwidth: float = 1.5e12
    """Effective bytes/s of random row gathers (about a third of an H100/H200's peak)."""
    intra_host_bandwidth: float = 300e9
    """Bytes/s a rank receives from ranks of its own host (NVLink)."""
    inter_host_bandwidth: float = 40e9
    """Bytes/s a rank receives from other hosts (one 400 Gb/s NIC per GPU)."""
    backward_factor: float = 2.0
    """Backward + optimizer HBM traffic as a multiple of the forward gather."""
    held_byte_seconds: float = 0.0
    """Seconds per step each byte a rank holds (weights + state) costs: the amortised replica
    sync of a grouped plan that averages every N steps (``groups.py``), so that a group's
    planner balances it; 0 for a flat plan."""
    held_weight_byte_seconds: float | None = None
    """``held_byte_seconds`` for the weights' bytes alone (None: the same): the average of a
    grouped plan sends the weights in ``replica_sync_dtype``, the state in fp32."""
    replica_sync_dtype: str = "fp32"
    """The ``WIRE_FORMATS`` name the weights are averaged in by a grouped plan that averages
    every N steps (``CommOptions.replica_sync_dtype``; the optimizer state: fp32)."""
    host_tier_bandwidth: float = 25e9
    """Bytes/s between a ``cached`` table's cache and its backing store in host memory (rows
    in and dirty rows out: gathered copies over PCIe Gen5 x16, about 40 % of its 64 GB/s), and
    of a ``host`` table's staged rows (in and back)."""
    disk_bandwidth: float = 2e9
    """Bytes/s between a ``file`` table's cache and its files (random row-sized reads and
    write-backs through the page cache of one NVMe drive)."""

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1)
        for name in ("index_bytes", "length_bytes", "output_bytes", "grad_bytes"):
            if getattr(self, name) is not None or name not in ("index_bytes", "grad_bytes"):
                check_int(name, getattr(self, name), 1)
        check_int("output_row_bytes", self.output_row_bytes, 0)
        for name in ("host_tier_bandwidth", "disk_bandwidth"):
            check_number(name, getattr(self, name), 0.0, strict=True)
        if self.grad_row_bytes is not None:
            check_int("grad_row_bytes", self.grad_row_bytes, 0)
        for name in ("hbm_bandwidth", "intra_host_bandwidth", "inter_host_bandwidth"):
            check_number(name, getattr(self, name), 0.0, strict=True)
        check_number("backward_factor", self.backward_factor, 0.0)
        check_number("held_byte_seconds", self.held_byte_seconds, 0.0)
        if self.held_weight_byte_seconds is not None:
            check_number("held_weight_byte_seconds", self.held_weight_byte_seconds, 0.0)
        check_choice("replica_sync_dtype", self.replica_sync_dtype, tuple(WIRE_FORMATS))

    @classmethod
    def with_wire(cls, forward: str = "fp32", backward: str | None = None, **kw) -> CostModel:
        """A model whose output dist sends ``forward`` (and ``backward``, default the same)
        wire formats, ``WIRE_FORMATS`` names."""
        for key, name in (("wire_dtype", forward), ("backward_wire_dtype", backward)):
            if name is not None and name not in WIRE_FORMATS:
                raise ValueError(f"{key}: expected one of [{', '.join(WIRE_FORMATS)}], got "
                                 f"{name!r}")
        (o, s), (g, t) = WIRE_FORMATS[forward], WIRE_FORMATS[backward or forward]
        return cls(output_bytes=o, output_row_bytes=s, grad_bytes=g, grad_row_bytes=t, **kw)

    def wire(self) -> tuple[str, str]:
        """The (forward, backward) ``WIRE_FORMATS`` names these byte counts describe (bf16 for
        2 bytes a value: fp16 counts the same)."""
        def name(o, s):
            for k, v in WIRE_FORMATS.items():
                if v == (o, s):
                    return k
            raise ValueError(f"CostModel: no wire format has {o} bytes per value and {s} per "
                             f"row (WIRE_FORMATS: {WIRE_FORMATS})")
        fwd = name(self.output_bytes, self.output_row_bytes)
        g = self.output_bytes if self.grad_bytes is None else self.grad_bytes
        t = self.output_row_bytes if self.grad_row_bytes is None else self.grad_row_bytes
        return fwd, name(g, t)

    def row_bytes(self, columns, backward: bool = False):
        """Bytes of one row of ``columns`` values on the output dist's wire, scales included."""
        if backward:
            g = self.output_bytes if self.grad_bytes is None else self.grad_bytes
            t = self.output_row_bytes if self.grad_row_bytes is None else self.grad_row_bytes
            return columns * g + t
        return columns * self.output_bytes + self.output_row_bytes

    def id_bytes(self, rows, wide=False):
        """i for ids of a shard of ``rows`` rows (a number or an array): ``index_bytes``, or
        the input dist's id dtype, int32 unless the shard or another one on the same rank
        (``wide``) has 2**31 rows or more (the dtype is per destination rank)."""
        if self.index_bytes is not None:
            return self.index_bytes if np.ndim(rows) == 0 else np.full(np.shape(rows),
                                                                      self.index_bytes)
        big = (np.asarray(rows) >= INT32_ROWS) | np.asarray(wide)
        return np.where(big, 8, 4) if np.ndim(big) else (8 if big else 4)


@dataclass(kw_only=True, frozen=True)
class RankCost:
    """Every cost term of one rank (see the module docstring for the formulas)."""

    rank: int
    """The rank."""
    weight_bytes: int
    """Embedding weights stored on the rank."""
    state_bytes: int
    """Optimizer state stored on the rank."""
    lookups: float
    """Expected ids gathered per step (forward)."""
    lookup_bytes: float
    """Expected bytes gathered per step (forward)."""
    input_dist_bytes: float
    """Ids and lengths received per step."""
    output_dist_bytes: float
    """Pooled values, gradients and data-parallel gradient sync received per step."""
    inter_host_bytes: float
    """Part of the comm bytes that crosses hosts."""
    time_s: float
    """Estimated seconds per step spent on embeddings by this rank."""
    host_tier_bytes: float = 0.0
    """Rows (+ state) its ``cached`` shards' caches load and write back per step, and its
    ``host`` shards' distinct rows copied in and back."""
    disk_tier_bytes: float = 0.0
    """The same for its ``file`` shards."""
    slot_map_bytes: int = 0
    """Device memory of its ``cached`` shards' slot maps (``Storage.device_map_bytes``)."""

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes + self.slot_map_bytes

    @property
    def comm_bytes(self) -> float:
        return self.input_dist_bytes + self.output_dist_bytes


@dataclass(kw_only=True, frozen=True)
class PlanCost:
    """The cost of a plan: one :class:`RankCost` per rank."""

    ranks: tuple[RankCost, ...]
    """Indexed by rank."""
    tiers: Mapping[str, TierTraffic] = field(default_factory=dict)
    """Per ``cached`` / ``file`` table: its caches' estimated hit rate and the misses'
    traffic per step (``cache_model.block_traffic``); only from ``evaluate``."""
    collectives: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Bytes each rank receives per collective (``input_dist.data``, ``input_dist.header``,
    ``output_dist.forward`` / ``backward`` / ``host_reduce_scatter`` / ``host_all_gather``,
    ``data_parallel.grad_all_gather``, ``sequence_dist.forward`` / ``backward``; the names of
    ``sharding``'s collectives), indexed by rank: the two comm terms split; only from
    ``evaluate(..., collectives=True)``."""

    def imbalance(self, term: str = "time_s") -> float:
        """max / mean of ``term`` over ranks (1.0 is perfect; 1.0 when every value is 0)."""
        values = [float(getattr(r, term)) for r in self.ranks]
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else 1.0

    def max(self, term: str = "time_s") -> float:
        return max(float(getattr(r, term)) for r in self.ranks)


@dataclass(frozen=True, eq=False)
class Blocks:
    """Shards as arrays, one element per shard (what the planner scores: building thousands
    of validated :class:`Shard` objects per proposal at 4,096 ranks cost more than scoring)."""

    rank: np.ndarray
    row_start: np.ndarray
    row_end: np.ndarray
    col_start: np.ndarray
    col_end: np.ndarray

    @staticmethod
    def make(rank, row_start, row_end, col_start, col_end) -> Blocks:
        """Blocks from arrays or numbers (numbers are repeated for every rank)."""
        rank = np.atleast_1d(np.asarray(rank, dtype=np.int64))
        n = rank.shape[0]

        def full(x):
            if isinstance(x, np.ndarray) and x.shape == (n,):
                return x.astype(np.int64, copy=False)
            return np.full(n, x, dtype=np.int64)

        return Blocks(rank, full(row_start), full(row_end), full(col_start), full(col_end))

    @staticmethod
    def of(shards: Sequence[Shard]) -> Blocks:
        return Blocks.make(*(np.array([getattr(sh, f) for sh in shards], dtype=np.int64)
                             for f in ("rank", "row_start", "row_end", "col_start", "col_end")))

    @staticmethod
    def join(parts: Sequence[Blocks]) -> Blocks:
        return Blocks(*(np.concatenate([getattr(b, f) for b in parts])
                        for f in ("rank", "row_start", "row_end", "col_start", "col_end")))

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    def shards(self) -> tuple[Shard, ...]:
        cols = zip(self.rank.tolist(), self.row_start.tolist(), self.row_end.tolist(),
                   self.col_start.tolist(), self.col_end.tolist(), strict=True)
        return tuple(Shard(rank=r, row_start=a, row_end=b, col_start=c, col_end=d)
                     for r, a, b, c, d in cols)

    def column_slices(self) -> list[tuple[int, int, np.ndarray]]:
        """``(col_start, col_end, indices)`` per distinct column range, in column order."""
        pairs = sorted(set(zip(self.col_start.tolist(), self.col_end.tolist(), strict=True)))
        if len(pairs) == 1:
            return [(pairs[0][0], pairs[0][1], np.arange(len(self)))]
        return [(a, b, np.nonzero((self.col_start == a) & (self.col_end == b))[0])
                for a, b in pairs]


class CostAccumulator:
    """Per-rank running sums of the cost terms; the planner adds tables one at a time. The
    sums are one numpy array ``[len(TERMS), R]``: adding a table is a few vector operations
    over the ranks, not a Python loop per rank (the planner adds thousands at 4,096 ranks)."""

    TERMS = (
        "weight_bytes",
        "state_bytes",
        "lookups",
        "lookup_bytes",
        "input_dist_bytes",
        "output_dist_bytes",
        "inter_host_bytes",
        "host_tier_bytes",
        "disk_tier_bytes",
        "slot_map_bytes",  # held, like the weights, but priced at no time
    )
    _ROW = {t: i for i, t in enumerate(TERMS)}

    def __init__(self, world_size: int, local_world_size: int, model: CostModel) -> None:
        self.R, self.H, self.model = world_size, local_world_size, model
        self.values = np.zeros((len(self.TERMS), world_size))
        m = model
        # time = coef . terms: lookup bytes at HBM speed (forward + backward), communication
        # inside the host at its bandwidth, the part that crosses hosts at the network's
        coef = np.zeros(len(self.TERMS))
        coef[self._ROW["lookup_bytes"]] = (1.0 + m.backward_factor) / m.hbm_bandwidth
        coef[self._ROW["weight_bytes"]] = coef[self._ROW["state_bytes"]] = m.held_byte_seconds
        if m.held_weight_byte_seconds is not None:
            coef[self._ROW["weight_bytes"]] = m.held_weight_byte_seconds
        coef[self._ROW["input_dist_bytes"]] = 1.0 / m.intra_host_bandwidth
        coef[self._ROW["output_dist_bytes"]] = 1.0 / m.intra_host_bandwidth
        coef[self._ROW["inter_host_bytes"]] = (
            1.0 / m.inter_host_bandwidth - 1.0 / m.intra_host_bandwidth
        )
        coef[self._ROW["host_tier_bytes"]] = 1.0 / m.host_tier_bandwidth
        coef[self._ROW["disk_tier_bytes"]] = 1.0 / m.disk_bandwidth
        self._coef = coef
        self.tiers: dict[str, TierTraffic] | None = None
        """``{table: its misses' traffic}`` of the cached tables added, when set to a dict
        (``evaluate``)."""
        self._hosts = np.arange(world_size) // local_world_size  # [R] host of each rank
        self.wide = np.zeros(world_size, dtype=bool)
        """[R] ranks known to hold a shard of 2**31 rows or more (their ids are all int64);
        ``evaluate`` sets it from the plan, the planner's search leaves it (each shard's own
        rows decide there)."""
        self.ledger: dict[str, np.ndarray] | None = None
        """``{collective: [R] bytes received}`` when set to a dict (``evaluate(...,
        collectives=True)``): every comm term added is also filed under its collective."""

    @property
    def coefficients(self) -> np.ndarray:
        """[len(TERMS)] seconds per unit of each term: a rank's time is ``coef @ values[:, r]``."""
        return self._coef

    def copy(self) -> CostAccumulator:
        other = CostAccumulator.__new__(CostAccumulator)
        other.R, other.H, other.model, other._coef = self.R, self.H, self.model, self._coef
        other._hosts, other.wide = self._hosts, self.wide
        other.values = self.values.copy()
        other.tiers = None if self.tiers is None else dict(self.tiers)
        other.ledger = None if self.ledger is None else {
            k: v.copy() for k, v in self.ledger.items()}
        return other

    def add(self, rank, out_via: str | Mapping[str, Any] | None = None,
            in_via: str = "input_dist.data", **terms) -> None:
        """Add ``terms`` to ``rank``: an int, a slice, or an index array (then each term is a
        number or an array of its length; repeated ranks add up). ``out_via`` / ``in_via``:
        the collective that carries the ``output_dist_bytes`` / ``input_dist_bytes``, or
        ``{collective: its part}`` (kept only with a ``ledger``)."""
        for name, value in terms.items():
            if isinstance(rank, np.ndarray):
                np.add.at(self.values[self._ROW[name]], rank, value)
            else:
                self.values[self._ROW[name], rank] += value
        if self.ledger is not None:
            self._file(rank, terms.get("input_dist_bytes"), in_via)
            if isinstance(out_via, Mapping):
                for via, part in out_via.items():
                    self._file(rank, part, via)
            else:
                self._file(rank, terms.get("output_dist_bytes"), out_via)

    def _file(self, rank, value, via: str | None) -> None:
        """Add ``value`` (bytes received on ``rank``) to the ledger under ``via``."""
        if value is None or not np.any(value):
            return
        if via is None:
            raise ValueError("output_dist_bytes added without its collective (out_via)")
        row = self.ledger.setdefault(via, np.zeros(self.R))
        if isinstance(rank, np.ndarray):
            np.add.at(row, rank, value)
        else:
            row[rank] += value

    def merge(self, other: CostAccumulator) -> None:
        self.values += other.values

    @property
    def terms(self) -> dict[str, list[float]]:
        """``{term: [value per rank]}`` (a copy, for reading)."""
        return {t: self.values[i].tolist() for i, t in enumerate(self.TERMS)}

    def memory(self, rank: int) -> float:
        return float(self.values[0, rank] + self.values[1, rank])

    def memories(self) -> np.ndarray:
        """[R] device bytes of every rank: weights + state + slot maps."""
        return self.values[0] + self.values[1] + self.values[9]

    def terms_time(self, terms: Mapping[str, float]) -> float:
        """Time of a set of terms on their own (time is linear in every term)."""
        return float(sum(self._coef[self._ROW[k]] * v for k, v in terms.items()))

    def time(self, rank: int) -> float:
        return float(self._coef @ self.values[:, rank])

    def time_array(self) -> np.ndarray:
        """[R] estimated step time of every rank."""
        return self._coef @ self.values

    def times(self) -> list[float]:
        return self.time_array().tolist()

    def result(self) -> PlanCost:
        v, times = self.values, self.times()
        return PlanCost(
            ranks=tuple(
                RankCost(
                    rank=r,
                    weight_bytes=int(v[0, r]),
                    state_bytes=int(v[1, r]),
                    lookups=float(v[2, r]),
                    lookup_bytes=float(v[3, r]),
                    input_dist_bytes=float(v[4, r]),
                    output_dist_bytes=float(v[5, r]),
                    inter_host_bytes=float(v[6, r]),
                    host_tier_bytes=float(v[7, r]),
                    disk_tier_bytes=float(v[8, r]),
                    slot_map_bytes=int(v[9, r]),
                    time_s=times[r],
                )
                for r in range(self.R)
            )
        )

    # -- one table ------------------------------------------------------------------------
    def _cross(self, a: int, b: int) -> float:
        return 0.0 if a // self.H == b // self.H else 1.0

    def _from_all(self) -> float:
        """Share of traffic from all other ranks that crosses hosts: (R-H)/(R-1)."""
        return (self.R - self.H) / (self.R - 1) if self.R > 1 else 0.0

    def add_table(
        self, spec: TableSpec, ts: TableSharding, dist: IdDistribution, optimizer: str
    ) -> None:
        """Add the terms of every shard of ``ts`` (one table's sharding) to the sums; shards
        with a storage of their own (``Shard.storage``) are priced on it (their memory and
        their caches' misses; ``tiers`` keys them ``table[i,j]`` by shard index)."""
        blocks = Blocks.of(ts.shards)
        if not ts.per_shard_storage:
            self.add_blocks(spec, ts.sharding, blocks, dist, optimizer)
            return
        for st, idx in ts.storage_groups(ts.storage):  # the report's groups (tier_lines)
            part = np.asarray(idx)
            sub = Blocks(*(getattr(blocks, f)[part] for f in
                           ("rank", "row_start", "row_end", "col_start", "col_end")))
            here = (spec if st is None or st == spec.storage
                    else dataclasses.replace(spec, storage=st, auto_storage=False))
            self._add_held(here, ts.sharding, sub, dist, optimizer,
                           f"{spec.name}[{','.join(map(str, idx))}]")
        self.add_blocks(spec, ts.sharding, blocks, dist, optimizer, held=False)

    def _add_held(self, spec: TableSpec, sharding: str, blocks: Blocks, dist: IdDistribution,
                  optimizer: str, key: str) -> None:
        """The memory of ``blocks`` on ``spec``'s storage, and on a cached tier their misses'
        traffic (its summary in ``tiers[key]``)."""
        rows = (blocks.row_end - blocks.row_start).astype(np.float64)
        cols = (blocks.col_end - blocks.col_start).astype(np.float64)
        held = device_rows(spec, rows)  # a cached tier: its caches' slots
        self.add(blocks.rank, weight_bytes=held * cols * spec.dtype_bytes,
                 state_bytes=table_state_bytes(spec, held, cols, optimizer))
        if spec.storage is not None and spec.storage.map_on_device:
            self.add(blocks.rank, slot_map_bytes=spec.storage.device_map_bytes(rows, held))
        n = (1 if sharding == "data_parallel" else self.R) * self.model.batch_size
        if spec.tier == "host":  # a training batch's distinct rows in and back over the link
            self.add(blocks.rank, host_tier_bytes=staged_traffic(
                spec, dist, n * spec.ids_per_sample, blocks.row_start, blocks.row_end, cols,
                optimizer))
        if spec.storage is not None and spec.storage.cached:  # the misses' rows in and out
            moved, summary = block_traffic(spec, dist, n * spec.ids_per_sample,
                                           blocks.row_start, blocks.row_end, cols, optimizer)
            term = "disk_tier_bytes" if spec.tier == "file" else "host_tier_bytes"
            self.add(blocks.rank, **{term: moved})
            if self.tiers is not None:
                self.tiers[key] = summary

    def add_blocks(
        self, spec: TableSpec, sharding: str, blocks: Blocks, dist: IdDistribution,
        optimizer: str, held: bool = True
    ) -> None:
        """:meth:`add_table` for shards given as :class:`Blocks` (``held``: with their memory
        and tier traffic on ``spec``'s storage; else their lookups and traffic only)."""
        rows = (blocks.row_end - blocks.row_start).astype(np.float64)
        cols = (blocks.col_end - blocks.col_start).astype(np.float64)
        if held:
            self._add_held(spec, sharding, blocks, dist, optimizer, spec.name)
        if sharding == "data_parallel":
            self._add_replicas(spec)
        elif sharding in ("table_wise", "column_wise"):
            for r, c in zip(blocks.rank.tolist(), cols.tolist(), strict=True):
                self._add_whole_rows(spec, r, int(c))
        else:  # row_wise, table_row_wise, grid_shard (one table-row-wise part per slice)
            kind = "table_row_wise" if sharding == "grid_shard" else sharding
            E = spec.num_embeddings
            for a, b, idx in blocks.column_slices():
                holders = blocks.rank[idx]
                p = cdf_array(dist, E, blocks.row_end[idx]) - cdf_array(
                    dist, E, blocks.row_start[idx])
                # the terms are linear in the lookup share p: every holder in one addition
                self.add(holders, out_via="sequence_dist.backward", **self.row_holder_terms(
                    spec, p, len(holders), kind, b - a, rows[idx], holders))
                if spec.pooling == "none":
                    self._add_sequence_rows(spec, holders, p, b - a)
                else:
                    self._add_pooled_slices(spec, holders, b - a, kind)

    def _pooled(self, spec: TableSpec) -> float:
        """Values per sample and column a rank gets back per shard: one pooled row per
        feature, or (a sequence table) one row per id."""
        return spec.ids_per_sample if spec.pooling == "none" else float(len(spec.features))

    def _add_replicas(self, spec: TableSpec) -> None:
        """A data-parallel table: every rank gets every rank's ids (the input dist sends them
        to each replica, as to a table-wise owner), looks up the global batch in its replica,
        keeps its own rows and all-gathers the gradients of every rank's rows (fp32), so every
        replica applies the same update."""
        m, R, B = self.model, self.R, self.model.batch_size
        L, D, s = spec.ids_per_sample, spec.embedding_dim, spec.dtype_bytes
        lookups = R * B * L
        inp = (R - 1) * B * (L * m.id_bytes(spec.num_embeddings, self.wide)
                             + len(spec.features) * m.length_bytes)
        grads = (R - 1) * B * self._pooled(spec) * D * REPLICA_GRAD_BYTES
        self.add(
            slice(None),
            out_via="data_parallel.grad_all_gather",
            lookups=lookups,
            lookup_bytes=lookups * D * s,
            input_dist_bytes=inp,
            output_dist_bytes=grads,
            inter_host_bytes=(inp + grads) * self._from_all(),
        )

    def _other_host(self, rank: int) -> np.ndarray:
        """[R] 1.0 for the ranks on another host than ``rank``, else 0.0."""
        return (self._hosts != rank // self.H).astype(float)

    def _add_whole_rows(self, spec: TableSpec, rank: int, c: int) -> None:
        """A table-wise table or one column slice (``c`` columns, on ``rank``): its owner
        serves all R·B samples."""
        m, R, B = self.model, self.R, self.model.batch_size
        L, F = spec.ids_per_sample, len(spec.features)
        lookups = R * B * L
        inp = (R - 1) * B * (L * m.id_bytes(spec.num_embeddings, self.wide[rank])
                             + F * m.length_bytes)
        per_sample = self._pooled(spec)  # values per sample and column on the wire
        grads = (R - 1) * B * per_sample * m.row_bytes(c, backward=True)
        dist = "sequence_dist" if spec.pooling == "none" else "output_dist"
        self.add(
            rank,
            out_via=f"{dist}.backward",
            lookups=lookups,
            lookup_bytes=lookups * c * spec.dtype_bytes,
            input_dist_bytes=inp,
            output_dist_bytes=grads,
            inter_host_bytes=(inp + grads) * self._from_all(),
        )
        pooled = B * per_sample * m.row_bytes(c)
        others = np.ones(R)
        others[rank] = 0.0  # every other rank receives its samples' pooled slice
        self.add(slice(None), out_via=f"{dist}.forward", output_dist_bytes=pooled * others,
                 inter_host_bytes=pooled * self._other_host(rank))

    def row_holder_terms(
        self, spec: TableSpec, p: float, k: int, sharding: str, cols: int | None = None,
        rows: float | np.ndarray | None = None, ranks: np.ndarray | None = None,
    ) -> dict[str, float]:
        """The terms of a rank holding a row block with lookup share ``p`` (one of ``k``
        holders, ``cols`` columns wide, default all D; ``rows`` rows and on ``ranks``, for the
        id dtype, default E/k rows) that
        come with its ids: lookups, ids and lengths in, and for a sequence table the rows of
        the other ranks' ids back. Linear in ``p``, which may be an array (one per holder;
        the terms come out as arrays). A pooled table's output dist does not depend on the ids
        (``_add_pooled_slices``)."""
        m, R, B = self.model, self.R, self.model.batch_size
        L, F = spec.ids_per_sample, len(spec.features)
        D = spec.embedding_dim if cols is None else cols
        lookups = R * B * L * p
        rows = spec.num_embeddings / k if rows is None else rows
        wide = False if ranks is None else self.wide[ranks]
        inp = (R - 1) * B * (L * p * m.id_bytes(rows, wide) + F * m.length_bytes)
        out = ((R - 1) * B * L * p * m.row_bytes(D, backward=True) if spec.pooling == "none"
               else 0.0 * p)
        return {
            "lookups": lookups,
            "lookup_bytes": lookups * D * spec.dtype_bytes,
            "input_dist_bytes": inp,
            "output_dist_bytes": out,
            "inter_host_bytes": (inp + out) * self._from_all(),
        }

    def add_row_holder(
        self, spec: TableSpec, rank: int, p: float, k: int, sharding: str, cols: int
    ) -> None:
        self.add(rank, out_via="sequence_dist.backward",
                 **self.row_holder_terms(spec, p, k, sharding, cols))

    def _add_pooled_slices(
        self, spec: TableSpec, holders: Sequence[int], c: int, sharding: str
    ) -> None:
        """Output dist of one column slice (``c`` columns) of a pooled row-sharded table held
        by ``holders``, forward and backward, for every rank; ``u`` = B·F·(c·o + s), one rank's
        pooled slice with its row scales (``g``: its gradient). Row-wise: every rank gets
        ``u`` from each holder but itself, a holder the gradients of all R-1 other ranks'
        samples. Table-row-wise: holder h is responsible for
        its own samples and for the ranks d outside the holders with ``holders[d % k] == h``
        (``ShardLayout.responsible``), n_h ranks in all; inside the host it gets the other
        k-1 holders' partials of those n_h ranks (reduce-scatter) and, backward, their gradients
        of the rest (all-gather: R - n_h), and from across, the gradients of its n_h - 1 other
        ranks; a rank outside the holders gets ``u`` from the one responsible for it."""
        m, B, R, H = self.model, self.model.batch_size, self.R, self.H
        u = B * len(spec.features) * m.row_bytes(c)  # forward; backward: ``g``
        g = B * len(spec.features) * m.row_bytes(c, backward=True)
        holders = np.asarray(holders, dtype=np.int64)
        held = np.zeros(R)
        held[holders] = 1.0
        hosts = self._hosts
        if sharding != "table_row_wise":
            per_host = np.bincount(holders // H, minlength=R // H)
            k = len(holders)
            self.add(slice(None), out_via="output_dist.forward",  # from each holder but itself
                     output_dist_bytes=u * (k - held), inter_host_bytes=u * (k - per_host[hosts]))
            self.add(holders, out_via="output_dist.backward", output_dist_bytes=(R - 1) * g,
                     inter_host_bytes=(R - H) * g)
            return
        unique = np.unique(holders)
        k, ranks = len(unique), np.arange(R)
        resp = np.where(held > 0, ranks, unique[ranks % k])  # who sends each rank its sum
        far = (hosts[resp] != hosts).astype(float)
        n = np.bincount(resp, minlength=R)[unique].astype(float)
        back_far = np.bincount(resp, weights=far, minlength=R)[unique]
        self.add(unique, out_via={"output_dist.host_reduce_scatter": (k - 1) * n * u,
                                  "output_dist.host_all_gather": (R - n) * g,
                                  "output_dist.backward": (n - 1) * g},
                 output_dist_bytes=(k - 1) * n * u + ((R - n) + (n - 1)) * g,
                 inter_host_bytes=back_far * g)
        rest = 1.0 - held
        self.add(slice(None), out_via="output_dist.forward", output_dist_bytes=u * rest,
                 inter_host_bytes=u * rest * far)

    def _add_sequence_rows(
        self, spec: TableSpec, holders: Sequence[int], p: np.ndarray, c: int
    ) -> None:
        """Forward rows every rank receives for its B·L ids of a row-sharded sequence table
        (one column slice): from each holder h other than itself, the p_h share of them."""
        rows = self.model.batch_size * spec.ids_per_sample * self.model.row_bytes(c)
        share = np.zeros(self.R)
        np.add.at(share, np.asarray(holders), p)
        hosts = self._hosts
        per_host = np.bincount(hosts, weights=share, minlength=self.R // self.H)
        self.add(slice(None), out_via="sequence_dist.forward",
                 output_dist_bytes=rows * (share.sum() - share),
                 inter_host_bytes=rows * (share.sum() - per_host[hosts]))


def evaluate(
    plan: ShardingPlan,
    tables: Sequence[TableSpec],
    stats: Mapping[str, IdDistribution] | None = None,
    model: CostModel | None = None,
    optimizer: str = "rowwise_adagrad",
    collectives: bool = False,
) -> PlanCost:
    """The per-rank cost of ``plan`` for ``tables`` (any plan: ours, loaded, TorchRec's);
    ``collectives``: also split the comm terms per collective (``PlanCost.collectives``).
    A grouped plan (``group_size`` < ``world_size``) is ``groups.evaluate_grouped``'s."""
    if plan.group_world != plan.world_size:
        raise ValueError(f"plan: expected a flat plan, got group_size={plan.group_size} of "
                         f"world_size={plan.world_size} (planner.groups.evaluate_grouped costs "
                         f"it; plan.group_plan() is one group's flat plan)")
    acc = CostAccumulator(plan.world_size, plan.local_world_size, model or CostModel())
    acc.tiers = {}
    tables = as_planned(tables, plan.tables)  # a tier the planner chose is in the plan
    if collectives:
        acc.ledger = {}
    acc.wide[[sh.rank for ts in plan.tables for sh in ts.shards
              if sh.num_rows >= INT32_ROWS]] = True
    by_name = {t.name: t for t in tables}
    for ts in plan.tables:
        acc.add_table(by_name[ts.name], ts, (stats or {}).get(ts.name, UNIFORM), optimizer)
    header = header_bytes(plan, tables)
    acc.add(slice(None), in_via="input_dist.header", input_dist_bytes=header,
            inter_host_bytes=header * acc._from_all())
    cost = dataclasses.replace(acc.result(), tiers=acc.tiers)
    if acc.ledger is None:
        return cost
    return dataclasses.replace(
        cost, collectives={k: tuple(v.tolist()) for k, v in sorted(acc.ledger.items())})


def header_bytes(plan: ShardingPlan, tables: Sequence[TableSpec]) -> float:
    """Bytes of the input dist's header all-to-all every rank receives per step: from each
    other rank a fixed row of 2·n + 4 int64 (ids and bags per shard-feature, batch size,
    failure, VBE and weights-require-grad flags), n the most shard-features (a table's
    features x its shards) any rank holds; one per collection (pooled tables, sequence
    tables). The same on every rank, so the planner's search leaves it out;
    :func:`evaluate` adds it."""
    R = plan.world_size
    features = {t.name: len(t.features) for t in tables}
    sequence = {t.name for t in tables if t.pooling == "none"}
    total = 0.0
    for seq in (False, True):
        per_rank = np.zeros(R)
        for ts in plan.tables:
            if (ts.name in sequence) == seq:
                np.add.at(per_rank, [sh.rank for sh in ts.shards], features[ts.name])
        if per_rank.any():
            total += (R - 1) * 8 * (2 * per_rank.max() + 4)
    return total
