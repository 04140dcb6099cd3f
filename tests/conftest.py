"""Shared test set-up. Without CUDA, Triton kernels run in its interpreter: TRITON_INTERPRET must
be set before triton is first imported, so it is set here, before any test module imports it."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
# backends a test can run on here: the reference always, Triton on GPU or interpreted on CPU
TRITON_OK = HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
