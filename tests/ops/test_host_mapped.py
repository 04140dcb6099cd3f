"""ops/host_mapped.py: a tensor over host memory handed to torch as a DLPack capsule. On the
CPU the very same capsule and deleter code runs with DLPack's CPU device type."""

import pytest
import torch

from fbtriton_dist import knobs
from fbtriton_dist.ops import cuda_managed, host_mapped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_wrap_shares_memory_and_frees_it_once(dtype):
    before = host_mapped.live_count()
    for shape in [(0,), (5,), (3, 4), (0, 3)]:
        host = torch.arange(torch.Size(shape).numel()).to(dtype).reshape(shape)
        mapped = host_mapped.wrap(host, host_mapped.DL_CPU)
        assert mapped.shape == host.shape and mapped.dtype == dtype
        assert mapped.stride() == host.stride() and mapped.device.type == "cpu"
        assert host_mapped.live_count() == before + 1
        assert host_mapped.is_host_mapped(mapped)
        if host.numel():
            assert mapped.data_ptr() == host.data_ptr()
            assert host_mapped.host_of(mapped[1:]) is host  # a view finds its memory
            mapped.view(-1)[0] = 7
            assert host.view(-1)[0] == 7
            host.view(-1)[-1] = 9
            assert mapped.view(-1)[-1] == 9
            assert not host_mapped.is_host_mapped(host.clone())
        view = mapped.view(-1)[:2]
        del mapped
        assert host_mapped.live_count() == before + 1  # the view keeps the mapping alive
        del view
        assert host_mapped.live_count() == before  # the deleter ran, once
        host.add_(1)  # the caller's own reference still owns its memory: no double free


def test_empty_and_copy_of():
    filled = host_mapped.empty((2, 3), torch.bfloat16, "cpu", fill=0)
    assert filled.shape == (2, 3) and torch.equal(filled, torch.zeros(2, 3, dtype=torch.bfloat16))
    assert host_mapped.is_host_mapped(filled)
    source = torch.randn(4, 2)
    copy = host_mapped.copy_of(source, "cpu")
    assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    assert host_mapped.is_host_mapped(copy)


def test_refusals():
    with pytest.raises(ValueError, match="expected a contiguous CPU tensor"):
        host_mapped.wrap(torch.zeros(3, 4).t(), host_mapped.DL_CPU)
    with pytest.raises(ValueError, match=r"dtype: expected one of .*, got torch.complex64"):
        host_mapped.wrap(torch.zeros(2, dtype=torch.complex64), host_mapped.DL_CPU)
    with pytest.raises(ValueError, match="a CUDA mapping needs pinned or managed host memory"):
        host_mapped.wrap(torch.zeros(2), host_mapped.DL_CUDA)
    with pytest.raises(ValueError, match="device: expected a CUDA or CPU device, got meta"):
        host_mapped.empty(2, torch.float32, "meta")


def test_host_memory_knob(monkeypatch):
    monkeypatch.delenv("FBTD_HOST_MEMORY", raising=False)
    assert knobs.host_memory() == "managed"
    monkeypatch.setenv("FBTD_HOST_MEMORY", "pinned")
    assert knobs.host_memory() == "pinned"
    monkeypatch.setenv("FBTD_HOST_MEMORY", "uvm")
    with pytest.raises(ValueError, match=r"FBTD_HOST_MEMORY: expected one of \['managed', "
                       r"'pinned'\], got 'uvm'"):
        knobs.host_memory()
    assert not cuda_managed.is_managed(torch.zeros(3))  # ordinary memory


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("memory", ["managed", "pinned"])
def test_cuda_host_memory_kinds(memory, monkeypatch):
    """On CUDA: managed memory kept on the host by default (where the device allows it),
    pinned memory with the knob; either way the CUDA tensor and its host tensor are the same
    bytes, kernels write through, and the memory is freed with the last tensor."""
    monkeypatch.setenv("FBTD_HOST_MEMORY", memory)
    blocks = cuda_managed.live_blocks()
    managed = memory == "managed" and cuda_managed.available(torch.cuda.current_device())
    mapped = host_mapped.empty((1000, 8), torch.float32, "cuda", fill=0.5)
    host = host_mapped.host_of(mapped)
    assert mapped.is_cuda and host.data_ptr() == mapped.data_ptr()
    assert cuda_managed.is_managed(host) == managed and host.is_pinned() == (not managed)
    assert cuda_managed.live_blocks() == blocks + managed
    rows = torch.tensor([999, 0, 7], device="cuda")
    mapped.index_copy_(0, rows, torch.arange(24.0, device="cuda").view(3, 8))
    torch.cuda.synchronize()
    assert torch.equal(host[999], torch.arange(8.0)) and host[1].eq(0.5).all()
    copy = host_mapped.copy_of(torch.randn(5, 3, dtype=torch.bfloat16), "cuda")
    assert torch.equal(copy.cpu(), host_mapped.host_of(copy))
    del mapped, host, copy
    assert cuda_managed.live_blocks() == blocks
