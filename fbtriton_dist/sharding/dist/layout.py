"""Who looks up what: a ShardingPlan and the tables' configs turned into index lists.

Every sharding type is one thing here: a table is a set of shards (rank, rows [r0, r1), cols
[c0, c1)); every feature of the table becomes one *shard-feature* per shard, looked up on the
shard's rank. Input dist sends each id of a feature to every shard-feature whose row range
holds it (rebased to the shard's first row); output dist adds each shard-feature's pooled
block into the feature's columns [c0, c1) on the rank that owns the sample. That one rule gives
row-wise (sum of row blocks), table-wise (one shard), column-wise (column blocks side by side),
table-row-wise and grid (both), and data-parallel (a full replica on every rank, see
``ShardedEmbeddingBagCollection``). Table-row-wise and grid shard-features are marked
``in_host``: the holders of one column slice (all on one host) first sum their blocks inside the
host, and one of them, ``responsible(sf, dest)``, sends each destination rank the sum.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fbtriton_dist.modules.ebc import DATA_TYPES, POOLINGS, embedding_names
from fbtriton_dist.planner import ShardingPlan, to_table_specs
from fbtriton_dist.storage import Storage


@dataclass(frozen=True)
class ShardFeature:
    """Feature ``feature`` of table ``table`` looked up in one shard of that table."""

    feature: int  # global feature index, config order
    table: int  # table index, config order
    rank: int  # where the shard lives
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    data_parallel: bool
    in_host: bool = False  # table-row-wise / grid: summed inside the holders' host first

    @property
    def slice_key(self) -> tuple[int, int, int]:
        """(feature, first column, end column): the same for every row block of one slice."""
        return (self.feature, self.col_start, self.col_end)

    @property
    def dim(self) -> int:
        return self.col_end - self.col_start


@dataclass(frozen=True)
class LocalTable:
    """One shard stored on this rank: a table of the local TableBatchedEmbedding."""

    table: int
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    dtype: torch.dtype
    host: bool = False
    """It is on the ``host`` storage tier (its own or its table's): a local TBE of its own
    (``modules/host_tier.py``)."""
    storage: Storage | None = None
    """Its own storage in the plan (``Shard.storage``); None: its table's."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.row_end - self.row_start, self.col_end - self.col_start)


def _key(sf: ShardFeature) -> tuple[int, int, int, int, int]:
    """The local table (shard) ``sf`` is looked up in."""
    return (sf.table, sf.row_start, sf.row_end, sf.col_start, sf.col_end)


class ShardLayout:
    """Index lists for one rank of a sharded EmbeddingBagCollection (the same on every rank,
    computed from the plan alone)."""

    def __init__(self, configs: Sequence, plan: ShardingPlan, world_size: int,
                 host_tables: Sequence[str] = ()) -> None:
        if plan.world_size != world_size:
            raise ValueError(
                f"plan: made for world_size={plan.world_size}, but the process group has "
                f"{world_size} ranks"
            )
        plan.validate(to_table_specs(configs))  # every table covered exactly once, same shapes
        self.configs = list(configs)
        self.world_size = world_size
        self.feature_names = [f for c in configs for f in c.feature_names]
        """The KJT key each feature reads (a name two tables share appears twice)."""
        self.output_names = embedding_names(configs)
        """The output key of each feature (``feature@table`` for a shared name, as TorchRec)."""
        self.feature_table = [t for t, c in enumerate(configs) for _ in c.feature_names]
        self.feature_dims = [c.embedding_dim for c in configs for _ in c.feature_names]
        self.feature_mean = [
            POOLINGS.get(getattr(pooling, "name", str(pooling))) == "mean"
            for c in configs
            for pooling in [getattr(c, "pooling", None)]  # an EmbeddingConfig has none
            for _ in c.feature_names
        ]
        self.feature_cols = [0, *torch.tensor(self.feature_dims).cumsum(0).tolist()]
        self.table_rows = [c.num_embeddings for c in configs]
        dtypes = [DATA_TYPES[getattr(c.data_type, "name", str(c.data_type))] for c in configs]

        shard_features = []
        for f, t in enumerate(self.feature_table):
            ts = plan.table(configs[t].name)
            dp = ts.sharding == "data_parallel"
            in_host = ts.sharding in ("table_row_wise", "grid_shard")
            for s in ts.shards:
                shard_features.append(
                    ShardFeature(
                        f, t, s.rank, s.row_start, s.row_end, s.col_start, s.col_end, dp, in_host
                    )
                )
        # per rank: its shard-features grouped by (dtype, host tier) (one TBE each: shards on
        # ``host``, their table's ``host_tables`` or their own ``Shard.storage``, apart), then
        # feature order
        self.host = [c.name in set(host_tables) for c in configs]
        self.shard_storage: dict[tuple[int, int, int, int, int], Storage] = {
            (t, s.row_start, s.row_end, s.col_start, s.col_end): s.storage
            for t, c in enumerate(configs) for s in plan.table(c.name).shards
            if s.storage is not None
        }
        """``(table, row_start, row_end, col_start, col_end) -> Storage`` of every shard with
        a storage of its own in the plan (per-shard tiers; ``Shard.storage``)."""
        group = {sf: (dtypes[sf.table], self._on_host(_key(sf))) for sf in shard_features}
        group_of = {g: i for i, g in enumerate(dict.fromkeys(group.values()))}
        self.local: list[list[ShardFeature]] = [
            sorted(
                (sf for sf in shard_features if sf.rank == q),
                key=lambda sf: (group_of[group[sf]], sf.feature, sf.row_start, sf.col_start),
            )
            for q in range(world_size)
        ]
        self.dtypes = dtypes
        self.local_world_size = plan.local_world_size
        self.holders: dict[tuple[int, int, int], list[int]] = {}  # in-host slice -> its ranks
        for sf in shard_features:
            if sf.in_host:
                self.holders.setdefault(sf.slice_key, []).append(sf.rank)
        self.holders = {k: sorted(set(v)) for k, v in self.holders.items()}
        self.table_data_parallel = [
            plan.table(c.name).sharding == "data_parallel" for c in configs
        ]

    def _on_host(self, key: tuple[int, int, int, int, int]) -> bool:
        """The shard ``key`` lives on the ``host`` tier: its own storage's, else its table's."""
        st = self.shard_storage.get(key)
        return st.tier == "host" if st is not None else self.host[key[0]]

    def responsible(self, sf: ShardFeature, dest: int) -> int:
        """The holder of ``sf``'s slice that sums it for ``dest``'s samples and sends it there:
        ``dest`` itself if it is a holder, else round-robin by destination rank."""
        holders = self.holders[sf.slice_key]
        return dest if dest in holders else holders[dest % len(holders)]

    def host_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s host (``local_world_size`` consecutive ranks)."""
        first = rank - rank % self.local_world_size
        return list(range(first, first + self.local_world_size))

    def local_tables(self, rank: int) -> tuple[list[LocalTable], list[int]]:
        """The shards on ``rank`` (one per (table, shard), shared by that table's features)
        and, per local shard-feature, the index of its local table."""
        tables: dict[tuple, int] = {}
        ftm = []
        for sf in self.local[rank]:
            key = (sf.table, sf.row_start, sf.row_end, sf.col_start, sf.col_end)
            if key not in tables:
                tables[key] = len(tables)
            ftm.append(tables[key])
        local = [LocalTable(*key, dtype=self.dtypes[key[0]], host=self._on_host(key),
                            storage=self.shard_storage.get(key))
                 for key in tables]
        return local, ftm

    def local_columns(self, rank: int) -> list[int]:
        """Start column of each of ``rank``'s shard-features in its local lookup output."""
        return [0, *torch.tensor([sf.dim for sf in self.local[rank]] or [0]).cumsum(0).tolist()]

    def output_columns(self, rank: int, data_parallel: bool) -> tuple[list[int], list[int]]:
        """For ``rank``'s shard-features of one kind (data-parallel or not): their columns in
        its local output, and the columns they add into in the pooled output ``[B, sum(D)]``."""
        src, dst = [], []
        starts = self.local_columns(rank)
        for i, sf in enumerate(self.local[rank]):
            if sf.data_parallel != data_parallel:
                continue
            src += range(starts[i], starts[i] + sf.dim)
            first = self.feature_cols[sf.feature] + sf.col_start
            dst += range(first, first + sf.dim)
        return src, dst
