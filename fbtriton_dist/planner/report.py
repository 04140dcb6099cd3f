"""The readable summary ``fbtriton-dist plan`` prints: tables, then per-rank costs and imbalance."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .cost import UNIFORM, PlanCost
from .memory import fmt_bytes
from .plan import ShardingPlan
from .stats import IdDistribution
from .tables import TableSpec

__all__ = ["format_report", "rank_ranges", "tier_lines"]

MB = 1e6


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``."""
    out, ordered = [], sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [line(header), *(line(r) for r in rows)]


def format_report(
    plan: ShardingPlan,
    tables: Sequence[TableSpec],
    cost: PlanCost,
    stats: Mapping[str, IdDistribution] | None = None,
    title: str = "",
) -> str:
    """Tables with their sharding, then one line per rank and the max/mean of every column."""
    by_name = {t.name: t for t in tables}
    lines = [title] if title else []
    rows = []
    for ts in plan.tables:
        t = by_name[ts.name]
        rows.append(
            [
                t.name,
                str(t.num_embeddings),
                str(t.embedding_dim),
                t.dtype,
                f"{t.ids_per_sample:g}",
                (stats or {}).get(t.name, UNIFORM).describe(),
                ts.sharding,
                str(len(ts.shards)),
                rank_ranges(ts.ranks),
            ]
        )
    header = [
        "table",
        "rows E",
        "dim D",
        "dtype",
        "ids/sample",
        "ids",
        "sharding",
        "shards",
        "ranks",
    ]
    lines += _table(header, rows, right={1, 2, 4, 7})
    lines += tier_lines(plan, cost)
    lines.append("")
    rows = [
        [
            str(r.rank),
            fmt_bytes(r.memory_bytes),
            fmt_bytes(r.weight_bytes),
            fmt_bytes(r.state_bytes),
            f"{r.lookups:,.0f}",
            f"{r.lookup_bytes / MB:.1f}",
            f"{r.input_dist_bytes / MB:.2f}",
            f"{r.output_dist_bytes / MB:.2f}",
            f"{r.inter_host_bytes / MB:.2f}",
            f"{r.time_s * 1e3:.3f}",
        ]
        for r in cost.ranks
    ]
    terms = (
        "memory_bytes",
        "weight_bytes",
        "state_bytes",
        "lookups",
        "lookup_bytes",
        "input_dist_bytes",
        "output_dist_bytes",
        "inter_host_bytes",
        "time_s",
    )
    rows.append(["max/mean", *(f"{cost.imbalance(t):.3f}" for t in terms)])
    header = [
        "rank",
        "memory",
        "weights",
        "opt state",
        "lookups/step",
        "lookup MB",
        "in-dist MB",
        "out-dist MB",
        "inter-host MB",
        "est. ms",
    ]
    lines += _table(header, rows, right=set(range(1, 10)))
    slowest = max(cost.ranks, key=lambda r: r.time_s)
    lines.append(
        f"step estimate {slowest.time_s * 1e3:.3f} ms (rank {slowest.rank}); "
        f"imbalance (max/mean) time {cost.imbalance():.3f}, memory "
        f"{cost.imbalance('memory_bytes'):.3f}, lookups {cost.imbalance('lookups'):.3f}, "
        f"comm {cost.imbalance('comm_bytes'):.3f}"
    )
    return "\n".join(lines)


def tier_lines(plan: ShardingPlan, cost: PlanCost) -> list[str]:
    """The tables on a cached tier: cache, estimated hit rate and the misses' traffic per step
    (``PlanCost.tiers``; a table with per-shard storage: a line per cached group of shards,
    ``table[shard indices]``); none when there are none."""
    if not cost.tiers:
        return []
    rows = []
    for ts in plan.tables:
        # a table with per-shard storage: one line per group of shards on one cached storage
        parts = ([(f"{ts.name}[{','.join(map(str, idx))}]", st)
                  for st, idx in ts.storage_groups(ts.storage)]
                 if ts.per_shard_storage else [(ts.name, ts.storage)])
        for key, st in parts:
            t = cost.tiers.get(key)
            if t is None or st is None:
                continue
            cache = (f"{st.cache_slots} slots" if st.cache_slots is not None
                     else f"{st.cache_load_factor:g} of rows")
            rows.append([key, st.tier, cache, t.policy, f"{t.distinct_rows:,.0f}",
                         f"{t.hit_rate:.3f}" + ("" if t.fits else " (cache < a step!)"),
                         f"{t.misses:,.0f}", f"{t.bytes / MB:.2f}"])
    if not rows:
        return []
    header = ["cached table", "tier", "cache", "policy", "distinct rows/step", "est. hit rate",
              "misses/step", "tier MB/step"]
    return ["", *_table(header, rows, right={4, 5, 6, 7})]
