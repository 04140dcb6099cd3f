"""The backward's first half made ahead: linearize the ids into row keys, sort them and number
their runs (``tbe_backward_plan``) reads only the batch, not the gradient. On CUDA it runs on a
side stream forked before the forward, beside the forward and the rest of the model, its loss
and the output dist; the forward kernel then writes no keys. FBTD_TBE_AHEAD=0
(``knobs.TBE_AHEAD``) keeps it in the forward/backward (to measure the difference);
``tbe_lookup(plan_ahead=...)`` decides per call.

The side stream forks (``fork``) before the forward is queued, its kernels are queued after the
forward's, and it has the higher priority: the forward's grid (one program per bag) is then
already in flight, and the sort's short kernels take each SM slot a finished bag frees instead
of waiting behind the whole grid. Queued before the forward, they ran while the host was still
queueing it and hardly overlapped (docs/results/tbe-h200-2026-12-04.md: 0-2.5% of GPU-busy time
either way; the eager step is host-bound, and a CUDA graph's side branch fills only the
forward's tail).
"""

import torch

from fbtriton_dist import reference

_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}
SIDE_PRIORITY = -1  # the side stream's priority (CUDA: lower is higher; -1 the highest)


def fork(device: torch.device):
    """An event on the current stream, recorded before the forward is queued: where the side
    stream starts (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def plan_ahead(impl, layout, pooling: int, indices, offsets, per_sample_weights,
               check: bool, here: bool = False, fork=None):
    """Linearize + ``tbe_backward_plan`` of a training batch (``layout``: an ``ops.tbe``
    TBELayout) on a side stream that starts at ``fork`` (``fork()``'s event; None: the
    current stream's present end): (plan, its done event, the event after which the side
    stream no longer reads the batch). On the CPU (``plan_ahead=True``) it is made here, in
    order, and the events are None; so with ``here`` (a retained graph's second backward,
    whose plan the first one freed)."""

    def make():
        keys, bag_ids, counts = impl.tbe_linearize(
            indices, offsets, layout.rows, layout.row_offsets, num_rows=layout.num_rows,
            pooling=pooling, check=check,
        )
        # the runs kernel reads the weights later: a copy, so that the side stream reads
        # nothing of the batch once the forward is done (a captured step refills its static
        # batch buffers after the forward, and only then waits for the side stream)
        psw = per_sample_weights.clone() if per_sample_weights is not None else None
        consumed = torch.cuda.Event() if device.type == "cuda" else None
        if consumed is not None:
            consumed.record()
        plan = impl.tbe_backward_plan(
            indices,
            offsets,
            psw,
            layout.D_offsets,
            layout.row_offsets,
            w_offsets=layout.w_offsets,
            dims=layout.dims,
            pooling=pooling,
            grad_stride=layout.max_D if pooling == reference.POOL_NONE else layout.total_D,
            num_rows=layout.num_rows,
            keys=keys,
            bag_ids=bag_ids,
            counts=counts,
        )
        return plan, consumed

    device = indices.device
    if device.type != "cuda" or here:
        return make()[0], None, None
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device, priority=SIDE_PRIORITY)
    if fork is None:
        side.wait_stream(torch.cuda.current_stream(device))
    else:
        side.wait_event(fork)
    with torch.cuda.stream(side):
        plan, consumed = make()
        done = torch.cuda.Event()
        done.record(side)
    return plan, done, consumed


def use_plan(plan, done, device) -> None:
    """The current stream waits for the plan and keeps its memory from being reused (it was
    allocated on the side stream) until the kernels queued here have read it."""
    if done is None:
        return
    stream = torch.cuda.current_stream(device)
    stream.wait_event(done)
    for t in {t.untyped_storage().data_ptr(): t for t in plan.tensors()}.values():
        t.record_stream(stream)
