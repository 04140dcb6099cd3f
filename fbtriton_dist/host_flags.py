"""Flags a device computed, read on the host later without stalling the GPU.

Deferred input checks (``ops/tbe_checks.py``'s ``BoundsMonitor``, ``sharding/dist/fixed.py``'s
input dist, ``sharding/pipeline.py``'s CUDA-graph step) all do the same thing: copy a small device
tensor of flags to pinned host memory without waiting, record an event behind the copy, and
look at the host copy once the event has passed (or wait for it when told to). ``HostFlags``
is that, once::

    flags = HostFlags(3, err.device)
    flags.start(err)            # enqueue the copy; returns at once
    ...
    values = flags.poll(wait=False)  # None while the copy is still in flight
    if values is not None and any(values): ...

On a device without events (CPU) the copy is done when ``start`` returns, so ``poll`` sees it
at once, whatever ``wait`` says.
"""

from __future__ import annotations

import torch

__all__ = ["HostFlags"]


class HostFlags:
    """``n`` int64 flags copied from ``device`` to host memory (pinned for CUDA), readable once
    the copy is done. Reusable: each ``start`` copies anew."""

    def __init__(self, n: int, device: torch.device | str) -> None:
        cuda = torch.device(device).type == "cuda"
        self.host = torch.empty(n, dtype=torch.int64, pin_memory=cuda)
        """The host copy (``[n]`` int64); valid once ``poll`` returns a list."""
        self._event: torch.cuda.Event | None = None

    def start(self, flags: torch.Tensor) -> HostFlags:
        """Copy ``flags`` (``[n]``, on the device) to the host without waiting; on CUDA an
        event on the current stream marks the copy's end. Returns self."""
        self.host.copy_(flags, non_blocking=True)
        if flags.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._event = None  # the copy above was synchronous
        return self

    def poll(self, wait: bool = False) -> list[int] | None:
        """The flags as ints once the copy has landed; None if it has not and ``wait`` is
        False (``wait``: block until it has)."""
        if self._event is not None and not self._event.query():
            if not wait:
                return None
            self._event.synchronize()
        return self.host.tolist()

    def clear(self) -> None:
        """Zero the host copy (so that a later ``poll`` without a new ``start`` reads no
        flags)."""
        self.host.zero_()
