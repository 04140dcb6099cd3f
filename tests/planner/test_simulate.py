"""The cost model's per-rank estimate against the simulation (``bench.simulate``: ids drawn from
each table's distribution, the real bucketize, the input dist's message layout and the output
dist's own byte counts), for every sharding type the planner emits, pooled and sequence tables.

Every rank of every plan below must agree within ``TOLERANCE`` on lookups, input-dist,
output-dist and inter-host bytes, and on the bytes of each collective; ``test_a_wrong_cost_model_is_caught`` shows that the check
catches a cost model that is off (ids counted as int64, the old data-parallel terms).
"""

import dataclasses

import pytest

from fbtriton_dist.bench import simulate  # our own module: an import error fails, never skips
from fbtriton_dist.planner import (
    SHARDING_TYPES,
    CostModel,
    IdDistribution,
    ShardingPlanner,
    TableConstraints,
    TableSpec,
    evaluate,
)

TOLERANCE = 0.10
B = 256
R, H = 8, 4  # two hosts: table-row-wise and grid-shard need them
TABLES = (
    # two features, one with a fractional pooling factor (bags of 7 or 8 ids)
    TableSpec(name="ads", num_embeddings=200_000, embedding_dim=64, features=("ad", "ad_hist"),
              pooling_factors=(1.0, 7.5), dtype="fp16"),
    TableSpec(name="user", num_embeddings=50_000, embedding_dim=64, features=("user",),
              pooling_factors=(3.0,)),
    TableSpec(name="item", num_embeddings=10_000, embedding_dim=128, features=("item",),
              pooling_factors=(4.5,), pooling="mean"),
    TableSpec(name="tiny", num_embeddings=7, embedding_dim=64, features=("country",)),
)
STATS = {
    "ads": IdDistribution(kind="zipf", alpha=1.1),
    "user": IdDistribution(kind="zipf", alpha=0.8),
    "item": IdDistribution(kind="histogram", histogram=(8.0, 4.0, 2.0, 1.0, 1.0, 0.5, 0.5, 3.0)),
}


def plan_for(tables, sharding=None, world_size=R, local_world_size=H, model=None):
    cons = None
    if sharding is not None:
        cons = {t.name: TableConstraints(sharding=(sharding,)) for t in tables}
    planner = ShardingPlanner(world_size=world_size, local_world_size=local_world_size,
                              cost_model=model or CostModel(batch_size=B))
    plan = planner.plan(tables, cons, {t.name: STATS[t.name] for t in tables if t.name in STATS})
    if sharding is not None:
        assert {t.sharding for t in plan.tables} == {sharding}
    return plan


def check(plan, tables, model=None, **kw):
    """(worst |error| per term and per collective, the comparison text); asserts nothing."""
    model = model or CostModel(batch_size=B)
    cost = evaluate(plan, tables, STATS, model, collectives=True)
    sim = simulate.simulate(plan, tables, STATS, batch_size=B, estimate=cost, **kw)
    worst = {**simulate.max_errors(sim, cost), **simulate.max_collective_errors(sim, cost)}
    return worst, simulate.format_comparison(sim, cost, model)


@pytest.mark.parametrize("sharding", SHARDING_TYPES)
def test_estimate_agrees_with_simulation(sharding):
    plan = plan_for(TABLES, sharding)
    worst, text = check(plan, TABLES)
    assert max(worst.values()) < TOLERANCE, text


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise", "table_row_wise",
                                      "data_parallel"])
def test_sequence_tables_agree_with_simulation(sharding):
    seq = tuple(dataclasses.replace(t, pooling="none") for t in TABLES if t.name != "item")
    plan = plan_for(seq, sharding)
    worst, text = check(plan, seq)
    assert max(worst.values()) < TOLERANCE, text


def test_planned_mix_of_pooled_and_sequence_tables_agrees():
    """The planner's own choice, pooled and sequence tables together (two collections, two
    headers)."""
    mixed = (*TABLES, TableSpec(name="clicks", num_embeddings=30_000, embedding_dim=64,
                                features=("clicks",), pooling_factors=(6.0,), pooling="none"))
    plan = plan_for(mixed)
    worst, text = check(plan, mixed)
    assert max(worst.values()) < TOLERANCE, text


def test_sampled_ranks_and_sources_agree_at_64_ranks():
    """Past 16 ranks a sample of ranks is simulated; with --sim-sources 16 of 64 batches
    drawn, what comes from each class of ranks is scaled from the sampled ones."""
    plan = plan_for(TABLES, world_size=64, local_world_size=8)
    cost = evaluate(plan, TABLES, STATS, CostModel(batch_size=B))
    sim = simulate.simulate(plan, TABLES, STATS, batch_size=B, estimate=cost, sources=16)
    slowest = max(range(64), key=lambda r: cost.ranks[r].time_s)
    assert slowest in [r.rank for r in sim.ranks] and 9 <= len(sim.ranks) <= 10
    assert len(sim.sources) < 64
    worst = simulate.max_errors(sim, cost)
    assert max(worst.values()) < TOLERANCE, simulate.format_comparison(sim, cost)


def test_a_wrong_cost_model_is_caught():
    """The check is not vacuous: ids counted as int64 (the input dist sends int32 to shards
    below 2**31 rows) put the row-wise input-dist estimate over the tolerance."""
    plan = plan_for(TABLES, "row_wise")
    wrong = CostModel(batch_size=B, index_bytes=8)
    worst, _ = check(plan, TABLES, wrong)
    assert worst["input_dist_bytes"] > TOLERANCE
    assert worst["lookups"] < TOLERANCE  # the lookups did not change


def test_old_data_parallel_terms_are_caught(monkeypatch):
    """The cost model before the simulation: a replica looked up only its own batch and
    received no ids. The simulation says every replica gets and looks up the global batch."""
    from fbtriton_dist.planner import cost as cost_module

    plan = plan_for(TABLES, "data_parallel")

    def old(self, spec):
        L, D = spec.ids_per_sample, spec.embedding_dim
        self.add(slice(None), lookups=self.model.batch_size * L,
                 lookup_bytes=self.model.batch_size * L * D * spec.dtype_bytes)

    monkeypatch.setattr(cost_module.CostAccumulator, "_add_replicas", old)
    worst, _ = check(plan, TABLES)
    assert worst["lookups"] > TOLERANCE and worst["input_dist_bytes"] > TOLERANCE


def test_simulation_is_deterministic_and_seeded():
    plan = plan_for(TABLES, "row_wise")
    a = simulate.simulate(plan, TABLES, STATS, batch_size=B, ranks=[1])
    b = simulate.simulate(plan, TABLES, STATS, batch_size=B, ranks=[1])
    c = simulate.simulate(plan, TABLES, STATS, batch_size=B, ranks=[1], seed=1)
    assert a.ranks[0].lookups == b.ranks[0].lookups != c.ranks[0].lookups
    with pytest.raises(ValueError, match="expected 0 <= rank < 8"):
        simulate.simulate(plan, TABLES, STATS, batch_size=B, ranks=[8])


def test_int64_ids_to_a_rank_with_a_huge_shard():
    """The input dist sends int64 ids to a rank that holds a shard of 2**31 rows or more, for
    all its shards: rank 1's small table-wise table too."""
    from fbtriton_dist.planner import Shard, ShardingPlan, TableSharding

    E = 3 * 2**30
    tables = (TableSpec(name="huge", num_embeddings=E, embedding_dim=32, features=("h",),
                        pooling_factors=(4.0,), dtype="fp16"),
              TableSpec(name="small", num_embeddings=1000, embedding_dim=32, features=("s",),
                        pooling_factors=(8.0,)),
              TableSpec(name="other", num_embeddings=1000, embedding_dim=32, features=("o",),
                        pooling_factors=(8.0,)))

    def whole(name, rank):
        return TableSharding(name=name, sharding="table_wise", num_embeddings=1000,
                             embedding_dim=32, shards=(Shard(rank=rank, row_start=0,
                                                             row_end=1000, col_start=0,
                                                             col_end=32),))

    huge = TableSharding(name="huge", sharding="row_wise", num_embeddings=E, embedding_dim=32,
                         shards=(Shard(rank=0, row_start=0, row_end=2**30, col_start=0,
                                       col_end=32),
                                 Shard(rank=1, row_start=2**30, row_end=E, col_start=0,
                                       col_end=32)))
    plan = ShardingPlan(world_size=2, local_world_size=2,
                        tables=(huge, whole("small", 1), whole("other", 0)))
    r0, r1 = evaluate(plan, tables, {}, CostModel(batch_size=B)).ranks
    hdr = 8 * (2 * 2 + 4)
    assert r0.input_dist_bytes == pytest.approx(B * (4 / 3 * 4 + 4 + 8 * 4 + 4) + hdr)
    assert r1.input_dist_bytes == pytest.approx(B * (8 / 3 * 8 + 4 + 8 * 8 + 4) + hdr)
    worst, text = check(plan, tables)
    assert max(worst.values()) < TOLERANCE, text


def test_the_job_ids_agree_with_the_estimate():
    """``ids="job"`` draws Zipf ids as a training job's synthetic data does
    (``train.data.power_law_rows``): on a skew-aware row-wise plan, whose hot block's rank
    sees any difference in the hottest rows' share (the floored continuous power law the job
    drew before gave it ~20 % fewer lookups there), it agrees with the estimate as the
    planner's own law does."""
    ads = (TableSpec(name="ads", num_embeddings=10_000_000, embedding_dim=64, features=("ad",),
                     pooling_factors=(4.0,)),)
    plan = plan_for(ads, "row_wise")
    assert len({s.rank for s in plan.tables[0].shards}) > 1  # row cuts to be off by
    worst, text = check(plan, ads)
    assert max(worst.values()) < TOLERANCE, text
    worst_job, text_job = check(plan, ads, ids="job")
    assert max(worst_job.values()) < TOLERANCE, text_job
    with pytest.raises(ValueError, match=r"ids: expected one of \['planner', 'job'\], got 'x'"):
        check(plan, ads, ids="x")


def test_the_collectives_split_the_comm_terms():
    """``evaluate(..., collectives=True)`` files every comm byte under one collective: per
    rank they sum to input-dist + output-dist, and leave the terms as they were; every
    collective the simulation sees has an estimate (a pooled and a sequence table, all
    types)."""
    seq = TableSpec(name="clicks", num_embeddings=30_000, embedding_dim=64,
                    features=("clicks",), pooling_factors=(6.0,), pooling="none")
    mixed = (*TABLES, seq)
    plan = plan_for(mixed)
    plain = evaluate(plan, mixed, STATS, CostModel(batch_size=B))
    split = evaluate(plan, mixed, STATS, CostModel(batch_size=B), collectives=True)
    assert split.ranks == plain.ranks and not plain.collectives
    for r in split.ranks:
        total = sum(v[r.rank] for v in split.collectives.values())
        assert total == pytest.approx(r.input_dist_bytes + r.output_dist_bytes, rel=1e-12)
    sim = simulate.simulate(plan, mixed, STATS, batch_size=B, estimate=split)
    seen = {k for r in sim.ranks for k, v in r.collectives.items() if v}
    assert seen <= set(split.collectives), seen - set(split.collectives)
    assert {"input_dist.header", "input_dist.data", "sequence_dist.forward"} <= seen


@pytest.mark.parametrize("sharding", ["table_row_wise", "column_wise", "row_wise"])
def test_8bit_wire_formats_agree_with_simulation(sharding):
    """fp8 forward (1 byte a value + a 4-byte scale a row), int8 backward (+ 8 bytes a row):
    the cost model and the simulated output dist count the same bytes, pooled and sequence."""
    model = CostModel.with_wire("fp8", "int8", batch_size=B)
    assert model.wire() == ("fp8", "int8")
    assert (model.row_bytes(64), model.row_bytes(64, backward=True)) == (68, 72)
    tables = (*TABLES, TableSpec(name="clicks", num_embeddings=30_000, embedding_dim=64,
                                 features=("clicks",), pooling_factors=(6.0,), pooling="none"))
    plan = plan_for(tables, sharding)
    worst, text = check(plan, tables, model=model, wire=model.wire())
    assert max(worst.values()) < TOLERANCE, text
    fp32 = evaluate(plan, tables, STATS, CostModel(batch_size=B))
    q = evaluate(plan, tables, STATS, model)
    assert sum(q.ranks[r].output_dist_bytes for r in range(R)) < 0.5 * sum(
        fp32.ranks[r].output_dist_bytes for r in range(R))
    with pytest.raises(ValueError, match=r"wire_dtype: expected one of \[.*fp8, int8\]"):
        CostModel.with_wire("int4")
