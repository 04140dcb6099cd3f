"""TrainPipeline: the next batch's input dist runs while this batch trains.

In the spirit of TorchRec's ``TrainPipelineSparseDist``, without fx tracing: every
``ShardedEmbeddingBagCollection`` in the model is fed, for batch i + 1, by ``prefetch`` (copy to
the device + bucketize + header and id all-to-alls) on a side CUDA stream and its own process
group (so the ids do not queue behind batch i's output dist on one NCCL stream), while batch
i's forward, backward and optimizer step run on the current stream. CUDA events order the
two: the step waits for its batch's input dist; tensors made on the side stream are recorded
on the current one before use. On the CPU the same stages run one after the other. Results
are the plain loop's: the input dist of a batch does not depend on the weights.

Usage::

    pipe = TrainPipeline(model, optimizer, device,
                         loss_fn=lambda m, b: bce(m(b.dense, b.sparse).squeeze(-1), b.labels),
                         after_backward=lambda: allreduce_dense_grads())
    it = iter(batches)   # batches: objects with .to(device, non_blocking=True) and .sparse
    while True:
        try:
            loss = pipe.progress(it)   # one step; StopIteration when the data runs out
        except StopIteration:
            break

``model(batch)`` must call each sharded collection with ``sparse(batch)`` itself (the same
KeyedJaggedTensor object, as DLRM's sparse arch does); a collection called with anything
else runs its input dist in place, which is still correct.
"""

from collections.abc import Callable, Iterator
from dataclasses import fields, is_dataclass

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist.dist.sharded_ebc import ShardedEmbeddingBagCollection


def _default_loss(model: nn.Module, batch) -> torch.Tensor:
    out = model(batch)
    return out[0] if isinstance(out, tuple) else out  # TorchRec's (loss, output) convention


def _record(obj, stream) -> None:
    """Tell the caching allocator that ``stream`` uses every tensor in ``obj``."""
    if isinstance(obj, torch.Tensor):
        obj.record_stream(stream)
    elif hasattr(obj, "record_stream"):  # KeyedJaggedTensor, TorchRec Pipelineable
        obj.record_stream(stream)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _record(x, stream)
    elif isinstance(obj, dict):
        for x in obj.values():
            _record(x, stream)
    elif is_dataclass(obj):
        for f in fields(obj):
            _record(getattr(obj, f.name), stream)


class TrainPipeline:
    """One training step per ``progress`` call, with the next batch's input dist overlapped.

    Args:
        model: the model, holding ShardedEmbeddingBagCollection modules (any depth).
        optimizer: the dense optimizer (the sharded tables update in backward); None: none.
        device: where the batches go.
        loss_fn: ``(model, batch) -> loss``; default ``model(batch)`` (or its first element).
        sparse: ``batch -> KeyedJaggedTensor`` fed to the sharded collections (default
            ``batch.sparse``).
        after_backward: called after ``loss.backward()``, before ``optimizer.step()`` (e.g. an
            all-reduce of dense gradients).
        own_group: give each sharded collection's input dist a process group of its own
            (made here, collectively: every rank builds the pipeline in the same order).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device | str,
        *,
        loss_fn: Callable[[nn.Module, object], torch.Tensor] | None = None,
        sparse: Callable[[object], object] | None = None,
        after_backward: Callable[[], None] | None = None,
        own_group: bool = True,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.loss_fn = loss_fn or _default_loss
        self.sparse = sparse or (lambda batch: batch.sparse)
        self.after_backward = after_backward
        self.sharded = [
            m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)
        ]
        if own_group:
            for m in self.sharded:
                ranks = None
                if m.group is not None:
                    ranks = dist.get_process_group_ranks(m.group)
                m.input_group = dist.new_group(ranks)
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(device=self.device) if cuda else None
        self._next = None  # (batch on the device, CUDA event of its input dist)

    def _start(self, batch):
        """Copy ``batch`` to the device and run its input dist (side stream on CUDA)."""
        if self.side is None:
            batch = batch.to(self.device)
            for m in self.sharded:
                m.prefetch(self.sparse(batch))
            return batch, None, []
        with torch.cuda.stream(self.side):
            batch = batch.to(self.device, non_blocking=True)
            outs = [m.prefetch(self.sparse(batch)) for m in self.sharded]
            event = torch.cuda.Event()
            event.record(self.side)
        return batch, event, outs

    def progress(self, iterator: Iterator) -> torch.Tensor:
        """Train on the next batch; returns its loss (detached). Raises StopIteration when
        ``iterator`` is exhausted and no batch is left in flight."""
        if self._next is None:
            self._next = self._start(next(iterator))
        batch, event, outs = self._next
        self._next = None
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            _record(batch, current)
            _record(outs, current)
        try:
            upcoming = next(iterator)
        except StopIteration:
            upcoming = None
        if upcoming is not None:  # the next batch's input dist, before this step's compute
            self._next = self._start(upcoming)
        loss = self.loss_fn(self.model, batch)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the embedding rows are updated here, by the fused optimizer
        if self.after_backward is not None:
            self.after_backward()
        if self.optimizer is not None:
            self.optimizer.step()
        return loss.detach()
