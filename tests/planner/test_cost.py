"""Cost terms against hand-computed numbers; the Zipf CDF against exact sums."""

import math

import pytest

from fbtriton_dist.planner import (
    CostModel,
    IdDistribution,
    Shard,
    ShardingPlan,
    TableSharding,
    TableSpec,
    evaluate,
    generalized_harmonic,
    header_bytes,
    state_bytes,
)

B = 4
HDR = 8 * (2 * 1 + 4)
"""The header row one rank sends another: 2 int64 per shard-feature (one here) + 3."""


def one_table(sharding, shards, R=2, H=2, E=1000, D=16, dtype="fp16", L=(2.0,), optimizer=None,
              pooling="sum"):
    spec = TableSpec(
        pooling=pooling,
        name="t",
        num_embeddings=E,
        embedding_dim=D,
        features=tuple(f"f{i}" for i in range(len(L))),
        dtype=dtype,
        pooling_factors=L,
        optimizer=optimizer,
    )
    plan = ShardingPlan(
        world_size=R,
        local_world_size=H,
        tables=(
            TableSharding(
                name="t", sharding=sharding, num_embeddings=E, embedding_dim=D, shards=tuple(shards)
            ),
        ),
    )
    return spec, plan


def test_state_bytes():
    assert state_bytes("none", 10, 8) == state_bytes("sgd", 10, 8) == 0
    assert state_bytes("rowwise_adagrad", 10, 8) == 40
    assert state_bytes("adagrad", 10, 8) == 10 * 8 * 4  # one accumulator per element
    assert state_bytes("adam", 10, 8) == 2 * 10 * 8 * 4


@pytest.mark.parametrize(
    "optimizer, state",
    [("sgd", 0), ("rowwise_adagrad", 250 * 4), ("adagrad", 250 * 16 * 4),
     ("adam", 2 * 250 * 16 * 4)],
)
def test_row_wise_by_hand(optimizer, state):
    shards = [
        Shard(rank=0, row_start=0, row_end=250, col_start=0, col_end=16),
        Shard(rank=1, row_start=250, row_end=1000, col_start=0, col_end=16),
    ]
    spec, plan = one_table("row_wise", shards, optimizer=optimizer)
    model = CostModel(batch_size=B)
    r0, r1 = evaluate(plan, [spec], model=model).ranks
    assert r0.weight_bytes == 250 * 16 * 2 and r1.weight_bytes == 750 * 16 * 2
    assert r0.state_bytes == state
    # uniform ids: rank 0 owns a quarter of the lookups of R*B*L = 2*4*2 = 16 ids
    assert r0.lookups == pytest.approx(4.0) and r1.lookups == pytest.approx(12.0)
    assert r0.lookup_bytes == pytest.approx(4.0 * 16 * 2)
    # ids (R-1)*B*L*p*4 B (int32: fewer than 2**31 rows) + lengths (R-1)*B*F*4 B + header
    assert header_bytes(plan, [spec]) == HDR
    assert r0.input_dist_bytes == pytest.approx(1 * 4 * 2 * 0.25 * 4 + 1 * 4 * 1 * 4 + HDR)
    # pooled slice from the other holder B*D*4 + gradients (R-1)*B*D*4
    assert r0.output_dist_bytes == pytest.approx(4 * 16 * 4 + 1 * 4 * 16 * 4)
    assert r0.inter_host_bytes == 0.0
    m = model
    expect = r0.lookup_bytes * 3 / m.hbm_bandwidth + r0.comm_bytes / m.intra_host_bandwidth
    assert r0.time_s == pytest.approx(expect)


def test_table_wise_across_hosts_by_hand():
    shards = [Shard(rank=1, row_start=0, row_end=1000, col_start=0, col_end=16)]
    spec, plan = one_table("table_wise", shards, R=4, H=2, dtype="fp32")
    cost = evaluate(plan, [spec], model=CostModel(batch_size=B), optimizer="adam")
    owner, other = cost.ranks[1], cost.ranks[2]
    assert owner.memory_bytes == 1000 * 16 * 4 + 2 * 1000 * 16 * 4
    assert owner.lookups == 4 * B * 2
    assert owner.input_dist_bytes == 3 * B * (2 * 4 + 1 * 4) + 3 * HDR
    assert owner.output_dist_bytes == 3 * B * 16 * 4
    # 2 of the 3 other ranks are on the other host
    assert owner.inter_host_bytes == pytest.approx((owner.comm_bytes) * 2 / 3)
    # the headers of the 2 ranks of the other host cross too
    assert other.output_dist_bytes == B * 16 * 4 == other.inter_host_bytes - 2 * HDR
    assert cost.ranks[0].inter_host_bytes == 2 * HDR  # same host as the owner
    assert cost.imbalance("lookups") == pytest.approx(4.0)


def test_sequence_tables_send_a_row_per_id_by_hand():
    """A sequence table (pooling none): the output dist carries B*L rows, not B pooled ones;
    row-wise, each holder returns only the rows of the ids its rows hold."""
    shards = [
        Shard(rank=0, row_start=0, row_end=250, col_start=0, col_end=16),
        Shard(rank=1, row_start=250, row_end=1000, col_start=0, col_end=16),
    ]
    spec, plan = one_table("row_wise", shards, L=(3.0,), pooling="none")
    r0, r1 = evaluate(plan, [spec], model=CostModel(batch_size=B)).ranks
    # rank 0 receives the rows of its B*L ids held by rank 1 (3/4 of them), and the
    # gradients of the other rank's ids its quarter holds
    assert r0.output_dist_bytes == pytest.approx(B * 3 * 0.75 * 16 * 4 + B * 3 * 0.25 * 16 * 4)
    assert r1.output_dist_bytes == pytest.approx(B * 3 * 0.25 * 16 * 4 + B * 3 * 0.75 * 16 * 4)
    assert r0.input_dist_bytes == pytest.approx(B * (3 * 0.25 * 4 + 4) + HDR)  # as pooled
    tw = [Shard(rank=1, row_start=0, row_end=1000, col_start=0, col_end=16)]
    spec, plan = one_table("table_wise", tw, R=4, H=2, L=(3.0,), pooling="none")
    cost = evaluate(plan, [spec], model=CostModel(batch_size=B))
    assert cost.ranks[1].output_dist_bytes == 3 * B * 3 * 16 * 4  # every other rank's rows
    assert cost.ranks[2].output_dist_bytes == B * 3 * 16 * 4
    assert cost.ranks[2].inter_host_bytes == B * 3 * 16 * 4 + 2 * HDR


def test_to_table_specs_reads_an_embedding_config_as_a_sequence_table():
    from torchrec import EmbeddingBagConfig, EmbeddingConfig

    from fbtriton_dist.planner import to_table_specs

    seq, bag = to_table_specs([
        EmbeddingConfig(name="s", num_embeddings=10, embedding_dim=4, feature_names=["a"]),
        EmbeddingBagConfig(name="b", num_embeddings=10, embedding_dim=4, feature_names=["b"]),
    ])
    assert (seq.pooling, bag.pooling) == ("none", "sum")


def test_data_parallel_by_hand():
    """Every replica gets every rank's ids and looks up the global batch; backward all-gathers
    the gradients of every rank's pooled rows (fp32, though the weights are fp16)."""
    shards = [Shard(rank=r, row_start=0, row_end=10, col_start=0, col_end=16) for r in range(2)]
    spec, plan = one_table("data_parallel", shards, E=10)
    r0 = evaluate(plan, [spec], model=CostModel(batch_size=B)).ranks[0]
    assert r0.lookups == 2 * B * 2 and r0.lookup_bytes == 2 * B * 2 * 16 * 2
    assert r0.input_dist_bytes == pytest.approx(1 * B * (2 * 4 + 1 * 4) + HDR)
    assert r0.output_dist_bytes == pytest.approx(1 * B * 1 * 16 * 4)


def test_index_bytes_follow_the_shard_rows():
    """Ids travel as int32 to shards below 2**31 rows, int64 above; ``index_bytes`` fixes it."""
    big = 3 * 2**30
    cut = [Shard(rank=0, row_start=0, row_end=2**30, col_start=0, col_end=16),
           Shard(rank=1, row_start=2**30, row_end=big, col_start=0, col_end=16)]
    spec, plan = one_table("row_wise", cut, E=big)
    r0, r1 = evaluate(plan, [spec], model=CostModel(batch_size=B)).ranks
    lengths = 1 * B * 1 * 4 + HDR
    assert r0.input_dist_bytes == pytest.approx(B * 2 * (1 / 3) * 4 + lengths)
    assert r1.input_dist_bytes == pytest.approx(B * 2 * (2 / 3) * 8 + lengths)
    fixed = evaluate(plan, [spec], model=CostModel(batch_size=B, index_bytes=8)).ranks[0]
    assert fixed.input_dist_bytes == pytest.approx(B * 2 * (1 / 3) * 8 + lengths)


def test_pooled_output_counts_every_feature():
    """Two features of one table: two pooled rows per sample each way."""
    cut = [Shard(rank=0, row_start=0, row_end=1000, col_start=0, col_end=16)]
    spec, plan = one_table("table_wise", cut, R=2, H=2, L=(1.0, 3.0))
    owner, other = evaluate(plan, [spec], model=CostModel(batch_size=B)).ranks
    assert owner.output_dist_bytes == 1 * B * 2 * 16 * 4
    assert other.output_dist_bytes == B * 2 * 16 * 4
    assert header_bytes(plan, [spec]) == 8 * (2 * 2 + 4)


def test_zipf_cdf_matches_exact_sum():
    E, alpha = 200_000, 1.1
    exact = math.fsum(k**-alpha for k in range(1, E + 1))
    assert generalized_harmonic(E, alpha) == pytest.approx(exact, rel=1e-12)
    exact1 = math.fsum(1 / k for k in range(1, E + 1))
    assert generalized_harmonic(E, 1.0) == pytest.approx(exact1, rel=1e-12)
    z = IdDistribution(kind="zipf", alpha=alpha)
    head = math.fsum(k**-alpha for k in range(1, 5001)) / exact
    assert z.cdf(E, 5000) == pytest.approx(head, rel=1e-12)
    assert z.fraction(E, 0, E) == 1.0
    assert z.cdf(10_000_000_000, 1) == pytest.approx(1 / generalized_harmonic(1e10, alpha))
    r = z.inverse_cdf(E, 0.5)
    assert z.cdf(E, r) <= 0.5 < z.cdf(E, r + 1)


def test_grid_shard_by_hand():
    # two slices of 8 columns: cols 0..8 on host 0 (ranks 0, 1), cols 8..16 on host 1 (2, 3)
    shards = [
        Shard(rank=0, row_start=0, row_end=250, col_start=0, col_end=8),
        Shard(rank=1, row_start=250, row_end=1000, col_start=0, col_end=8),
        Shard(rank=2, row_start=0, row_end=500, col_start=8, col_end=16),
        Shard(rank=3, row_start=500, row_end=1000, col_start=8, col_end=16),
    ]
    spec, plan = one_table("grid_shard", shards, R=4, H=2)
    plan.validate([spec])
    cost = evaluate(plan, [spec], model=CostModel(batch_size=B))
    r0 = cost.ranks[0]
    assert r0.weight_bytes == 250 * 8 * 2 and r0.state_bytes == 250 * 4
    # a quarter of all R*B*L = 32 ids, 8 columns wide
    assert r0.lookups == pytest.approx(8.0) and r0.lookup_bytes == pytest.approx(8 * 8 * 2)
    # every slice gathers every id once: the table's lookups counted once per slice
    assert sum(r.lookups for r in cost.ranks) == pytest.approx(2 * 4 * B * 2)
    inp = 3 * B * (2 * 0.25 * 4 + 1 * 4) + 3 * HDR
    assert r0.input_dist_bytes == pytest.approx(inp)
    # rank 0 is responsible for its own samples and rank 2's (2 % 2 = 0: n = 2): it gets the
    # other holder's partials of them ((k-1) n u), backward the gradients of the other
    # holder's ranks ((R - n) u, the in-host all-gather) and rank 2's gradients ((n-1) u,
    # across hosts), and the pooled 8 columns of the other slice from rank 2 (0 % 2 = 0)
    u = B * 1 * 8 * 4
    assert r0.output_dist_bytes == pytest.approx((1 * 2 + 2 + 1) * u + u)
    assert r0.inter_host_bytes == pytest.approx(inp * 2 / 3 + u + u)
