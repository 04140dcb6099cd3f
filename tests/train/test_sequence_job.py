"""The sequence job (``model.kind: sequence``): target attention over a history looked up by
an EmbeddingCollection, trained by the job in one process and on 2 gloo ranks; it learns,
resumes exactly, and the shipped ``configs/jobs/sequence.yaml`` runs a few steps.
The attention's segment ops against a padded dense softmax."""

import json

import pytest
import torch
import yaml

from fbtriton_dist.train.job import main
from fbtriton_dist.train.models import segment_mean, target_attention
from tests.train.test_job import losses, records
from tests.train.test_multirank import ROOT, ok, torchrun

SEQ = {
    "seed": 1,
    "deterministic": True,
    "tables": [
        {"name": "t_user", "num_embeddings": 200, "embedding_dim": 8, "features": ["user"]},
        {"name": "t_item", "num_embeddings": 300, "embedding_dim": 8,
         "features": ["item", "hist"], "pooling": "none", "pooling_factors": [1, 5],
         "id_distribution": {"kind": "zipf", "alpha": 1.1}},
        {"name": "t_cat", "num_embeddings": 30, "embedding_dim": 4, "features": ["cat"],
         "pooling": "mean", "pooling_factors": 2},
    ],
    "model": {"kind": "sequence", "target": "item", "history": ["hist"],
              "dense_arch": [8, 8], "over_arch": [16, 1]},
    "data": {"num_dense": 4, "synthetic": {"noise": 0.1}},
    "optimizer": {"embedding": {"type": "rowwise_adagrad", "lr": 0.1},
                  "dense": {"type": "adagrad", "lr": 0.05}},
    "train": {"steps": 40, "batch_size": 64, "eval_every": 20, "eval_batches": 2},
    "checkpoint": {"every": 10, "keep": 2},
    "logging": {"log_every": 1, "progress_bar": False},
}  # fmt: skip


def _write(tmp_path, name, **sections):
    data = json.loads(json.dumps(SEQ))
    data.update(sections)
    data["logging"] = {**data["logging"], "run_dir": str(tmp_path / name)}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_sequence_job_learns_and_resumes_exactly(tmp_path):
    full = _write(tmp_path, "full")
    assert main(["--config", str(full)]) == 0
    evals = records(tmp_path / "full", "eval")
    assert evals[-1]["auc"] > 0.7, evals
    steps = losses(tmp_path / "full")
    assert sum(steps[s] for s in range(31, 41)) < sum(steps[s] for s in range(1, 11))
    half = _write(tmp_path, "half")
    assert main(["--config", str(half), "--steps", "20"]) == 0
    assert main(["--config", str(half), "--resume"]) == 0
    got = losses(tmp_path / "half")
    for step in range(21, 41):
        assert got[step] == pytest.approx(steps[step], abs=1e-6, rel=0), step


def test_sequence_job_on_2_ranks_shards_the_sequence_table(tmp_path):
    job = _write(tmp_path, "two", train={**SEQ["train"], "steps": 12, "eval_every": 0},
                 checkpoint={"every": 6, "keep": 2})
    out = ok(torchrun(2, "fbtriton_dist.train", "--config", str(job)))
    assert "world_size: 2" in out
    plan = yaml.safe_load((tmp_path / "two" / "plan.yaml").read_text())
    assert "t_item" in [t["name"] for t in plan["tables"]]
    summary = records(tmp_path / "two", "summary")[-1]
    assert summary["steps"] == 12 and summary["train_loss"] == summary["train_loss"]  # finite
    # resume on 2 ranks continues from the sharded checkpoint
    out = ok(torchrun(2, "fbtriton_dist.train", "--config", str(job), "--resume", "--steps",
                      "15"))
    assert "resumed from" in out


def test_shipped_sequence_job_runs(tmp_path):
    run_dir = tmp_path / "shipped"
    assert main(["--config", f"{ROOT}/configs/jobs/sequence.yaml", "--steps", "6",
                 f"logging.run_dir={run_dir}", "logging.progress_bar=false",
                 "train.eval_every=0", "checkpoint.every=3"]) == 0
    assert records(run_dir, "summary")[-1]["steps"] == 6


def test_a_dlrm_job_with_a_sequence_table_is_refused(tmp_path, capsys):
    path = _write(tmp_path, "bad", model={"dense_arch": [8, 8], "over_arch": [8, 1]})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.kind" in err and "['t_item'] have pooling none" in err


def test_a_target_that_is_not_a_sequence_feature_is_refused(tmp_path, capsys):
    path = _write(tmp_path, "bad", model={**SEQ["model"], "target": "user"})
    assert main(["--config", str(path)]) == 2
    assert "model.target: 'user' is not a feature of a sequence table" in capsys.readouterr().err


def test_attention_matches_a_padded_softmax():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 1, 5])
    D = 4
    history = torch.randn(int(lengths.sum()), D, generator=g, dtype=torch.float64,
                          requires_grad=True)
    target = torch.randn(4, D, generator=g, dtype=torch.float64, requires_grad=True)
    got = target_attention(history, lengths, target)
    want, at = [], 0
    for b, n in enumerate(lengths.tolist()):
        h = history[at : at + n]
        at += n
        if n == 0:
            want.append(torch.zeros(D, dtype=torch.float64))
            continue
        w = torch.softmax(h @ target[b] / D**0.5, dim=0)
        want.append((w[:, None] * h).sum(0))
    want = torch.stack(want)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.sum(), (history, target))
    wants = torch.autograd.grad(want.sum(), (history, target))
    for a, b in zip(grads, wants, strict=True):
        torch.testing.assert_close(a, b)
    mean = segment_mean(history, lengths)
    torch.testing.assert_close(mean[0], history[:3].mean(0))
    assert bool((mean[1] == 0).all())
