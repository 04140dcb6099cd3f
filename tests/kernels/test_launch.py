"""The fast launcher: same results as Triton's own launch, recompiles when a specialization
changes (alignment, divisibility by 16, constexprs)."""

import pytest
import torch

from tests.conftest import HAS_CUDA, requires_cuda

if HAS_CUDA:
    import triton
    import triton.language as tl

    from fbtriton_dist.kernels.launch import Launcher

    @triton.jit
    def _axpy_kernel(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(x_ptr + i, mask=m)
        tl.store(out_ptr + i, a * x + tl.load(y_ptr + i, mask=m), mask=m)


@requires_cuda
@pytest.mark.parametrize("n", [16, 17, 1, 256])
def test_launcher_matches_and_respecializes(n):
    launch = Launcher(_axpy_kernel)
    base = torch.randn(600, device="cuda")
    y = torch.randn(600, device="cuda")
    for step in range(4):
        offset = step % 2  # alternately 16-byte aligned and not
        x = base[offset : offset + n]
        out = torch.empty(n, device="cuda")
        launch((triton.cdiv(n, 64),), x, y, out, 0.5 + step, n, BLOCK=64, num_warps=1)
        torch.testing.assert_close(out, (0.5 + step) * x + y[:n])
    assert launch.enabled and len(launch.cache) == 2


def test_host_launch_math_matches_triton():
    import triton  # noqa: PLC0415 (the interpreter's flag is set by conftest first)

    from fbtriton_dist.kernels.launch import cdiv, next_power_of_2  # noqa: PLC0415

    for n in range(1, 2100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 7, 16, 1024):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert cdiv(0, 8) == 0 and next_power_of_2(0) == 1
