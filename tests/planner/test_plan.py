"""ShardingPlan: structure, coverage/overlap validation, per-rank queries, YAML round trip."""

import os

import pytest

from fbtriton_dist.planner import (
    ConfigError,
    PlanValidationError,
    Shard,
    ShardingPlan,
    TableSharding,
    TableSpec,
)


def rows(rank, a, b, D=8):
    return Shard(rank=rank, row_start=a, row_end=b, col_start=0, col_end=D)


def table(name="t", sharding="row_wise", shards=(), E=100, D=8):
    return TableSharding(
        name=name, sharding=sharding, num_embeddings=E, embedding_dim=D, shards=tuple(shards)
    )


def plan(*tables, R=4, H=None):
    return ShardingPlan(world_size=R, local_world_size=H or R, tables=tuple(tables))


def spec(name="t", E=100, D=8):
    return TableSpec(name=name, num_embeddings=E, embedding_dim=D, features=(f"{name}_f",))


def problems(p, tables=None, **kw):
    with pytest.raises(PlanValidationError) as e:
        p.validate(tables, **kw)
    return str(e.value)


def test_queries():
    rw = table("a", shards=[rows(0, 0, 10), rows(1, 10, 60), rows(3, 60, 100)])
    tw = table("b", "table_wise", [rows(1, 0, 100)])
    p = plan(rw, tw)
    p.validate([spec("a"), spec("b")])
    assert p.row_boundaries("a") == (0, 10, 60, 100)
    assert p.row_boundaries("b") == (0, 100)
    assert p.shards_for_rank(1) == [("a", rows(1, 10, 60)), ("b", rows(1, 0, 100))]
    assert p.shards_for_rank(2) == []
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < 4, got 4"):
        p.shards_for_rank(4)
    with pytest.raises(KeyError, match="'zz' is not in the plan"):
        p.table("zz")


def test_overlap_and_gap():
    msg = problems(plan(table(shards=[rows(0, 0, 60), rows(1, 50, 100)])))
    assert "shards[1] (rank 1: rows 50..100, cols 0..8) overlaps shards[0]" in msg
    msg = problems(plan(table(shards=[rows(0, 0, 40), rows(1, 50, 90)])))
    assert "shards cover 640 of 100 x 8 = 800 cells; uncovered rows 40..50, 90..100" in msg


def test_column_cover_and_shape():
    cw = [
        Shard(rank=0, row_start=0, row_end=100, col_start=0, col_end=4),
        Shard(rank=1, row_start=0, row_end=100, col_start=4, col_end=8),
    ]
    plan(table(sharding="column_wise", shards=cw)).validate()
    msg = problems(plan(table(sharding="column_wise", shards=cw[:1])))
    assert "shards cover 400 of 100 x 8 = 800 cells" in msg
    msg = problems(plan(table(sharding="row_wise", shards=cw)))
    assert "every shard must span all 8 columns" in msg
    msg = problems(plan(table(sharding="table_wise", shards=[rows(0, 0, 50), rows(1, 50, 100)])))
    assert "expected exactly 1 shard, got 2" in msg


def test_rank_out_of_range_and_outside_table():
    msg = problems(plan(table(shards=[rows(0, 0, 50), rows(4, 50, 100)])))
    assert "shards[1].rank: expected 0 <= rank < world_size=4, got 4" in msg
    msg = problems(plan(table(shards=[rows(0, 0, 50), rows(1, 50, 120)])))
    assert "is outside the table (rows 0..100, cols 0..8)" in msg


def test_table_row_wise_one_host_and_data_parallel():
    twrw = table(sharding="table_row_wise", shards=[rows(1, 0, 50), rows(2, 50, 100)])
    msg = problems(plan(twrw, R=4, H=2))
    assert "shards must stay on the ranks of one host (local_world_size=2)" in msg
    full = [rows(r, 0, 100) for r in range(4)]
    plan(table(sharding="data_parallel", shards=full)).validate()
    msg = problems(plan(table(sharding="data_parallel", shards=full[:3])))
    assert "expected one replica on each of ranks 0..3, got ranks [0, 1, 2]" in msg


def test_tables_known_and_matching():
    p = plan(table("a", shards=[rows(0, 0, 100)]))
    msg = problems(p, [spec("b")])
    assert "table 'a' is not in the table set; known: ['b']" in msg
    assert "table 'b' has no entry in the plan" in msg
    msg = problems(p, [spec("a", E=99)])
    assert "plan is for 100 x 8, table set says 99 x 8" in msg


def test_memory_budget_message():
    # 100 rows x 8 x 4 B = 3200 B of weights + 100 x 4 B rowwise adagrad state = 3600 B
    p = plan(table("a", "table_wise", [rows(3, 0, 100)]))
    p.validate([spec("a")], budget_bytes=3600)
    msg = problems(p, [spec("a")], budget_bytes=3599)
    assert (
        "rank 3 needs 3.5 KiB, budget 3.5 KiB: table 'a' rows 0..100 x 8 cols x 4 B + state "
        "400 B (rowwise_adagrad) = 3.5 KiB" in msg
    )


def test_dataclass_checks():
    with pytest.raises(ValueError, match="row_end: expected an integer >= 11, got 10"):
        Shard(rank=0, row_start=10, row_end=10, col_start=0, col_end=1)
    with pytest.raises(ValueError, match=r"sharding: expected one of \[row_wise, table_wise"):
        table(sharding="rowwise", shards=[rows(0, 0, 100)])
    with pytest.raises(ValueError, match="expected a divisor of world_size=4, got 3"):
        plan(R=4, H=3)


def test_yaml_round_trip(tmp_path):
    cw = [
        Shard(rank=2, row_start=0, row_end=100, col_start=0, col_end=4),
        Shard(rank=3, row_start=0, row_end=100, col_start=4, col_end=8),
    ]
    p = plan(
        table("a", shards=[rows(0, 0, 7), rows(1, 7, 100)]),
        table("b", "column_wise", cw),
        R=4,
        H=2,
    )
    path = tmp_path / "plan.yaml"
    p.save_yaml(path, header="hello\nworld")
    text = path.read_text()
    assert text.startswith("# hello\n# world\nversion: 1\n")
    assert ShardingPlan.load_yaml(path) == p
    assert [f for f in os.listdir(tmp_path)] == ["plan.yaml"]  # no temp file left behind


@pytest.mark.parametrize(
    "text, message",
    [
        ("tables: [\n", "not valid YAML: line 2"),
        ("[1, 2]", "expected a mapping, got list"),
        (
            "version: 2\nworld_size: 2\nlocal_world_size: 2\ntables: []",
            "version: expected 1, got 2",
        ),
        ("world_size: 2\nlocal_world_size: 2\ntables: []\nextra: 1", "extra: unknown key"),
        ("world_size: 2\ntables: []", "missing required key(s) [local_world_size]"),
        (
            "world_size: 2\nlocal_world_size: 2\ntables:\n- {name: a, sharding: rowwise, "
            "num_embeddings: 4, embedding_dim: 2, shards: [{rank: 0, rows: [0, 4], cols: [0, 2]}]}",
            "tables[0].sharding: expected one of [row_wise, table_wise, column_wise, "
            "table_row_wise, grid_shard, data_parallel], got 'rowwise'",
        ),
        (
            "world_size: 2\nlocal_world_size: 2\ntables:\n- {name: a, sharding: row_wise, "
            "num_embeddings: 4, embedding_dim: 2, shards: [{rank: 0, rows: [3, 1], cols: [0, 2]}]}",
            "tables[0].shards[0].rows: expected an integer >= 4, got 1",
        ),
        (
            "world_size: 2\nlocal_world_size: 2\ntables:\n- {name: a, sharding: row_wise, "
            "num_embeddings: 4, embedding_dim: 2, shards: [{rank: 0, rows: [0, 4]}]}",
            "tables[0].shards[0]: expected a mapping with keys [rank, rows, cols]",
        ),
    ],
)
def test_yaml_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        ShardingPlan.load_yaml(path)
    assert str(e.value).startswith(str(path))
    assert message in str(e.value)


def cols(rank, a, b, c0, c1):
    return Shard(rank=rank, row_start=a, row_end=b, col_start=c0, col_end=c1)


def test_grid_shard_slices_each_on_one_host():
    good = [
        cols(0, 0, 50, 0, 4),
        cols(1, 50, 100, 0, 4),
        cols(2, 0, 30, 4, 8),
        cols(3, 30, 100, 4, 8),
    ]
    t = table(sharding="grid_shard", shards=good)
    plan(t, R=4, H=2).validate()
    slices = [(a, b, [s.rank for s in sh]) for a, b, sh in t.column_slices()]
    assert slices == [(0, 4, [0, 1]), (4, 8, [2, 3])]
    spread = [cols(0, 0, 50, 0, 4), cols(2, 50, 100, 0, 4), cols(1, 0, 100, 4, 8)]
    msg = problems(plan(table(sharding="grid_shard", shards=spread), R=4, H=2))
    assert (
        "the shards of column slice 0..4 must stay on the ranks of one host "
        "(local_world_size=2), got ranks [0, 2]"
    ) in msg
    msg = problems(plan(table(sharding="grid_shard", shards=good[2:] + good[:2]), R=4, H=2))
    assert "shards must be listed slice by slice (by col_start), each in increasing row" in msg
    overlap = [cols(0, 0, 100, 0, 6), cols(2, 0, 100, 4, 8)]
    msg = problems(plan(table(sharding="grid_shard", shards=overlap), R=4, H=2))
    assert "column slices overlap: cols 0..6 and cols 4..8" in msg


def test_yaml_is_what_pyyaml_writes():
    """The plan's hand-written YAML equals PyYAML's dump of its dict (names that need quotes
    included), and reads back to the same plan."""
    import yaml

    plan = ShardingPlan(
        world_size=4,
        local_world_size=2,
        tables=(
            TableSharding(name="yes", sharding="row_wise", num_embeddings=10, embedding_dim=8,
                          shards=(Shard(rank=0, row_start=0, row_end=3, col_start=0, col_end=8),
                                  Shard(rank=3, row_start=3, row_end=10, col_start=0,
                                        col_end=8))),
            TableSharding(name="t: 1", sharding="table_wise", num_embeddings=5, embedding_dim=4,
                          shards=(Shard(rank=1, row_start=0, row_end=5, col_start=0,
                                        col_end=4),)),
        ),
    )
    text = plan.to_yaml("a header\nsecond line")
    body = yaml.safe_dump(plan.to_dict(), sort_keys=False, default_flow_style=None, width=100)
    assert text == "# a header\n# second line\n" + body
    assert ShardingPlan.from_dict(yaml.safe_load(text), "x") == plan
