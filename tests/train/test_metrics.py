"""AUC against a brute-force pairwise count, the stage timer, the JSONL writer."""

import json
import math
import time

import pytest
import torch

from fbtriton_dist.train.metrics import MetricsWriter, StageTimer, auc, format_summary


def pairwise_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("n, levels", [(2, 0), (50, 0), (200, 5), (301, 2)], ids=str)
def test_auc_matches_pairwise(n, levels):
    g = torch.Generator().manual_seed(n)
    labels = torch.randint(0, 2, (n,), generator=g).float()
    labels[0], labels[-1] = 0.0, 1.0
    scores = torch.randn(n, generator=g) + labels
    if levels:  # many ties
        scores = (scores * levels).round() / levels
    assert auc(scores, labels) == pytest.approx(pairwise_auc(scores.tolist(), labels.tolist()))


def test_auc_edges():
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert auc(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 1.0])) == 0.0
    assert auc(torch.ones(4), torch.tensor([0.0, 1.0, 1.0, 0.0])) == 0.5
    assert math.isnan(auc(torch.rand(3), torch.ones(3)))


def test_stage_timer_means_per_step():
    timer = StageTimer("cpu", warmup_steps=1)
    timer.start("lookup")
    time.sleep(0.05)
    timer.stop("lookup")
    timer.step_done()  # warm-up: dropped
    for _ in range(2):
        timer.start("forward")
        timer.start("lookup")
        time.sleep(0.002)
        timer.stop("lookup")
        timer.stop("forward")
        timer.start("backward")
        timer.stop("backward")
        timer.step_done()
    ms = timer.take()
    assert list(ms) == ["lookup", "backward", "forward"]
    assert 2.0 <= ms["lookup"] < 40.0 and ms["forward"] >= ms["lookup"]
    assert timer.take() == {}
    assert timer.totals()["lookup"] == pytest.approx(ms["lookup"])
    timer.stop("never_started")  # ignored


def test_metrics_writer_jsonl(tmp_path):
    path = tmp_path / "run" / "m.jsonl"
    w = MetricsWriter(str(path))
    w.write("train", 1, loss=0.5, ms={"lookup": 1.0})
    w.write("eval", 2, auc=float("nan"))
    w.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("eval", 2)]
    assert records[0]["ms"] == {"lookup": 1.0} and math.isnan(records[1]["auc"])
    MetricsWriter(None).write("train", 1, loss=1.0)  # other ranks: no file


def test_format_summary():
    text = format_summary({"steps": 3, "samples_per_s": 12345.6, "ms_per_step": {"lookup": 1.5}})
    assert text.splitlines() == [
        "training summary",
        "  steps: 3",
        "  samples_per_s: 12,346",
        "  ms_per_step: lookup 1.50 ms",
    ]


def test_throughput_skips_warmup_and_pauses():
    from fbtriton_dist.train.metrics import Throughput

    meter = Throughput(samples_per_step=100)
    time.sleep(0.05)
    meter.step()  # warm-up step: not counted
    assert math.isnan(meter.window())
    for _ in range(2):
        time.sleep(0.01)
        meter.step()
    time.sleep(0.1)  # an evaluation
    meter.restart_clock()
    time.sleep(0.01)
    meter.step()
    rate = meter.window()
    assert 100 * 3 / 0.05 < rate < 100 * 3 / 0.03  # about 3 steps of 10 ms
    assert meter.run() == pytest.approx(rate)
    assert math.isnan(meter.window())
