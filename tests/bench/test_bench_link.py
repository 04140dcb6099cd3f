"""``bench link`` (``bench/link.py``): the ``cost:`` YAML it writes on the CPU loads back and
feeds a plan."""

import pytest

from fbtriton_dist.bench import link
from fbtriton_dist.cli import main
from fbtriton_dist.planner.cost_inputs import read_cost_file

TABLES = ("tables:\n"
          "  - {name: f, num_embeddings: 20000, embedding_dim: 16, features: [f],\n"
          "     storage: {tier: file, cache_load_factor: 0.1, path: /rows}}\n")


def test_cpu_cost_file_loads_back_and_feeds_a_plan(tmp_path, capsys):
    cost = tmp_path / "cost.yaml"
    measured = link.main(["--device", "cpu", "--tiny", "--repeats", "2", "--dim", "16",
                          "--dir", str(tmp_path), "--out", str(cost)])
    text = capsys.readouterr().out
    assert "file tier: cold + fsync" in text and "file tier: page cache warm" in text
    assert cost.read_text().startswith("# measured by: python -m fbtriton_dist.bench link")
    # what was measured on the CPU, nothing else; every value a YAML float as written
    assert set(measured) == {"hbm_bandwidth", "host_tier_bandwidth", "disk_bandwidth"}
    assert read_cost_file(str(cost)) == measured and all(v > 0 for v in measured.values())
    assert list(tmp_path.iterdir()) == [cost]  # the file tier's folder is gone
    tables = tmp_path / "tables.yaml"
    tables.write_text(TABLES)
    plan = tmp_path / "plan.yaml"
    assert main(["plan", str(tables), "--world-size", "1", "--cost", str(cost),
                 "--out", str(plan)]) == 0
    assert f"disk_bandwidth {measured['disk_bandwidth']:.4g}" in plan.read_text()


def test_host_memory_choice_is_checked(capsys):
    for bad in ("uvm", "pinned,pinned", ""):
        with pytest.raises(SystemExit):
            link.main(["--device", "cpu", "--tiny", "--host-memory", bad])
        assert "--host-memory: expected managed, pinned or both" in capsys.readouterr().err
