"""Building a ``file`` table bigger than RAM: the initial draw of a cached table
(``modules/ebc.py`` ``draw_normal_like``: TorchRec's N(0, 1) draw that the uniform init
overwrites is taken in scratch pieces, not written into the backing store, so the file is
written once at construction, not twice, and the generator ends where ``normal_`` of the
whole table leaves it), and its mappings advised for random reads (``modules/tiers.py``)."""

import os

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from fbtriton_dist.modules import ebc as ebc_module
from fbtriton_dist.modules.ebc import EmbeddingBagCollection, draw_normal_like
from fbtriton_dist.storage import Storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("n", [5, 16, 47, 48, 63, 100])
def test_draw_normal_like_takes_the_draws_of_normal(dtype, n):
    """Pieces of 16 / 32 values, a last piece of 16..31 (never under 16), n < 16 in one go:
    the next values drawn are those after one ``normal_`` of n."""
    torch.manual_seed(7)
    torch.empty(n, dtype=dtype).normal_()
    want = torch.rand(8)
    for chunk in (16, 32):
        torch.manual_seed(7)
        draw_normal_like(torch.empty(n, dtype=dtype), chunk=chunk)
        assert torch.equal(torch.rand(8), want), (n, chunk)
    torch.manual_seed(7)
    torch.empty(n + 16, dtype=dtype).normal_()
    assert not torch.equal(torch.rand(8), want)  # 16 values more take 16 draws more


def configs():
    return [EmbeddingBagConfig(name="t0", num_embeddings=50, embedding_dim=3,
                               feature_names=["f0"]),
            EmbeddingBagConfig(name="t1", num_embeddings=20, embedding_dim=4,
                               feature_names=["f1"])]


def test_file_table_built_as_device_without_a_normal_draw_into_it(tmp_path, monkeypatch):
    """A seeded build with ``t0`` on ``file`` (150 values: pieces 32, 32, 32, 54) has the
    weights of the ``device`` build, ``t1``'s after it too; ``nn.init.normal_`` never gets
    ``t0``'s backing store (``t1``, on ``device``, still draws into its table)."""
    monkeypatch.setattr(ebc_module, "NORMAL_CHUNK", 32)
    drawn = []
    real = torch.nn.init.normal_

    def record(tensor, *args, **kwargs):
        drawn.append(tuple(tensor.shape))
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "normal_", record)
    torch.manual_seed(0)
    device = EmbeddingBagCollection(configs())
    assert drawn == [(50, 3), (20, 4)]
    drawn.clear()
    torch.manual_seed(0)
    tiered = EmbeddingBagCollection(configs(), storage={
        "t0": Storage(tier="file", path=str(tmp_path), cache_slots=8)})
    assert drawn == [(20, 4)]
    want, got = device.state_dict(), tiered.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_file_table_mapped_for_random_reads(tmp_path):
    """A ``file`` table's weights and optimizer state are mappings advised ``MADV_RANDOM``
    (``rr`` in smaps' VmFlags): a missed row reads its page, not a read-around window;
    what the module writes (a trained row, flushed) lands in the file."""
    tiered = EmbeddingBagCollection(configs(), storage={
        "t0": Storage(tier="file", path=str(tmp_path), cache_slots=8)})
    apply_optimizer_in_backward(torch.optim.Adagrad, tiered.parameters(), {"lr": 0.1})
    kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([3, 49, 7]),
                            lengths=torch.tensor([2, 0, 1, 0]))
    tiered(kjt).values().sum().backward()  # the optimizer state's file is made here
    flags, current = {}, None
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 6 and head[-1].startswith(str(tmp_path)):
                current = os.path.basename(head[-1])
            elif line.startswith("VmFlags:") and current is not None:
                flags[current] = line.split()[1:]
                current = None
    assert sorted(flags) == ["t0.momentum1", "t0.weight"]
    assert all("rr" in f for f in flags.values()), flags
    whole = tiered.state_dict()["embedding_bags.t0.weight"]
    on_disk = torch.from_file(str(tmp_path / "t0.weight"), size=whole.numel())
    assert torch.equal(on_disk.view_as(whole), whole)
