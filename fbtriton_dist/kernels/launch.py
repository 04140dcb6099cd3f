"""Launching a @triton.jit kernel with less host time.

``JITFunction.run`` binds and specializes every argument and looks the kernel up on each
launch; for the TBE kernels (20-35 arguments) that is tens of microseconds, several times per
training step. ``launch`` keys its own cache on what Triton specializes on (each tensor's
dtype and 16-byte alignment, each specialized int's divisibility by 16, equality to 1 and
width, every constexpr and launch option, the device), lets Triton compile and launch on a
miss, and on a hit calls the compiled kernel's launcher directly. ``FBTD_FAST_LAUNCH=0`` (or
the interpreter) uses Triton's own path every time.
"""

import inspect

import torch
import triton

from fbtriton_dist import knobs

_ENABLED = knobs.FAST_LAUNCH


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host ints: ``triton.cdiv``'s value without its constexpr-function
    wrapper, which costs microseconds a call (launch grids, several times a step)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): ``triton.next_power_of_2``'s
    value for host ints, without its wrapper."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _int_key(v: int, specialize: bool):
    wide = not -(2**31) <= v < 2**31
    return (wide, v % 16 == 0, v == 1) if specialize else (wide,)


class Launcher:
    """``Launcher(kernel)(grid, *args, num_warps=4, **kwargs)``: ``kernel[grid](...)``, faster."""

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.kernel = kernel
        self.enabled = _ENABLED and hasattr(kernel, "params")  # not under the interpreter
        params = getattr(kernel, "params", None)
        if params is None:  # the interpreter's function: names from the Python signature
            params = inspect.signature(kernel.fn).parameters.values()
            self.params = [(p.name, False, True) for p in params]
        else:
            self.params = [(p.name, p.is_constexpr, not p.do_not_specialize) for p in params]
        self.names = [name for name, _, _ in self.params]
        self.cache: dict = {}

    def _key(self, args: dict, options: dict) -> tuple:
        key = [torch.cuda.current_device(), tuple(sorted(options.items()))]
        for name, constexpr, specialize in self.params:
            v = args[name]
            if constexpr or v is None or isinstance(v, (bool, float, str)):
                key.append(v if not isinstance(v, float) else float)
            elif isinstance(v, torch.Tensor):
                key.append((v.dtype, v.data_ptr() % 16 == 0))
            elif isinstance(v, int):
                key.append(_int_key(v, specialize))
            else:
                key.append(type(v))
        return tuple(key)

    def __call__(self, grid: tuple[int, ...], *positional, **kwargs) -> None:
        options = {}
        for k in ("num_warps", "num_stages", "maxnreg"):
            v = kwargs.pop(k, None)
            if v is not None:
                options[k] = v
        kwargs.update(zip(self.names[: len(positional)], positional, strict=True))
        if not self.enabled:
            self.kernel[grid](**kwargs, **options)
            return
        key = self._key(kwargs, options)
        compiled = self.cache.get(key)
        if compiled is None:
            self.cache[key] = self.kernel[grid](**kwargs, **options)
            return
        grid = (*grid, 1, 1)
        args = [kwargs[name] for name, _, _ in self.params]
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        try:
            compiled.run(
                grid[0],
                grid[1],
                grid[2],
                stream,
                compiled.function,
                compiled.packed_metadata,
                None,
                None,
                None,
                *args,
            )
        except (AttributeError, TypeError):  # another Triton's internals: its own path from now
            self.enabled = False
            self.kernel[grid[:3]](**kwargs, **options)
