"""TrainPipeline: the next batch's input dist runs while this batch trains.

In the spirit of TorchRec's ``TrainPipelineSparseDist``, without fx tracing: every
``ShardedEmbeddingBagCollection`` in the model is fed, for batch i + 1, by ``prefetch`` (copy to
the device + bucketize + header and id all-to-alls) on a side CUDA stream and its own process
group (so the ids do not queue behind batch i's output dist on one NCCL stream), while batch
i's forward, backward and optimizer step run on the current stream. CUDA events order the
two: the step waits for its batch's input dist; tensors made on the side stream are recorded
on the current one before use. On the CPU (``overlap_input``, the default) batch i + 1's input
dist runs on a worker thread, on the collections' input process groups, while batch i trains
on the calling thread: its waits for the peers (header and id all-to-alls) overlap batch i's
compute, and batch i's waits overlap its bucketize. ``progress`` joins the thread before it
returns (nothing runs between two calls; an error of batch i + 1's input dist is raised by the
call that trains batch i, after that step). Collections with managed or tiered tables run it
on the calling thread, before the step. Results are the plain loop's: the input dist of a
batch does not depend on the weights.

Collections with shards on a cached storage tier (``cached`` / ``file``, docs/storage.md) also
get batch i + 1's rows read ahead (``prefetch_rows``): once batch i's forward has run (its
lookups have mapped and loaded their rows), each tiered TBE's worker thread reads the rows of
batch i + 1's ids that its cache does not hold, while batch i's backward and optimizer step
and batch i + 2's input dist run; batch i + 1's lookup loads them from there. Exact: a copy
made stale by a later write-back is never used (``modules/tiers.py``).

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

import dataclasses
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import fields, is_dataclass

import torch
import torch.distributed as dist
from torch import nn

from fbtriton_dist.graphs import (
    CAPTURE_MODE,
    joined_at_exit,
    prepared_before_replays,
    run_prepares,
)
from fbtriton_dist.host_flags import HostFlags
from fbtriton_dist.modules.fused_optim import refuse_whole_table_steps
from fbtriton_dist.sharding.dist.input_dist import InputDistOut
from fbtriton_dist.sharding.modules.collection import ShardedCollection
from fbtriton_dist.sparse import padded_kjt


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
        cuda_graph: capture the whole step (input dist, lookups, output dist, dense forward
            and backward, fused and dense optimizer updates) in one CUDA graph and replay it
            per batch (``GraphedTrainStep``). Needs ``CommOptions(fixed_shapes=True)`` on every
            sharded collection, batches of one batch size and dense shape, and a dense
            optimizer that can be captured (SGD; Adam/AdamW with ``capturable=True``). The
            first ``warmup`` batches train eagerly. Ignored off CUDA (the eager steps run).
            Fused optimizers with a whole-table step (EMA in place, ensemble) are refused
            here, on every device: the step is chosen on the host by the step count before
            each training lookup, and a replayed graph would skip it.
        warmup: eager steps before the capture (CUDA graph mode; at least 1).
        overlap_input: CUDA graph mode: the graph also runs the next batch's input dist, on a
            side stream and the input process group, while this batch trains (the overlap of
            the eager pipeline, inside the graph; the default: 0.1-0.2 ms less per step on two
            H200s, results equal; needs ``own_group``, without it one batch per graph);
            False: one batch per graph, in order. On the CPU: the next batch's input dist
            runs on a worker thread during this step (needs ``own_group``; see above);
            False: before the step, on the calling thread.
        prefetch_rows: read the next batch's missing rows of the tiered shards ahead (after
            this batch's forward; see above); a collection of tier names (``{"file"}``):
            only the shards on those tiers; False: none. Only where some sharded collection
            has a tiered local shard; eager steps only (a CUDA graph step maps the rows of
            cached tables before each replay instead, ``GraphedTrainStep``). The job passes
            ``train.prefetch_rows`` (``train/modes.py``)."""

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
        cuda_graph: bool = False,
        warmup: int = 3,
        overlap_input: bool = True,
        prefetch_rows: bool | Collection[str] = True,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.loss_fn = loss_fn or _default_loss
        self.sparse = sparse or (lambda batch: batch.sparse)
        self.after_backward = after_backward
        self.sharded = [
            m for m in model.modules() if isinstance(m, ShardedCollection)
        ]
        if own_group:
            for m in self.sharded:
                if m.replicas is not None:  # new_group wants the same call on every rank
                    m.input_group = m.replicas.new_sharding_group()
                    continue
                ranks = None
                if m.group is not None:
                    ranks = dist.get_process_group_ranks(m.group)
                m.input_group = dist.new_group(ranks)
        self.row_tiers = (None if prefetch_rows is True
                          else frozenset(prefetch_rows or ()))
        """The tiers whose rows ``progress`` reads ahead (None: every cached tier)."""
        self.tiered = [m for m in self.sharded if m.tiered() and (
            self.row_tiers is None or any(s.tier in self.row_tiers
                                          for tbe in m.tbes for s in tbe.storage))]
        """The sharded collections whose rows ``progress`` reads ahead."""
        if cuda_graph:  # on every device, so that a run tried on the CPU fails as on a GPU
            refuse_whole_table_steps(
                [tbe.optimizer for m in self.sharded for tbe in m.tbes],
                "TrainPipeline(cuda_graph=True) (use cuda_graph=False)")
        cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(device=self.device) if cuda else None
        self._next = None  # (batch on the device, CUDA event of its input dist)
        self.worker = None
        """CPU: the thread that runs the next batch's input dist during a step (see above)."""
        if (not cuda and overlap_input and own_group and self.sharded
                and all(m.input_dist_is_pure() for m in self.sharded)):
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="fbtd-input-dist")
        self.graph = None
        if cuda_graph and cuda:
            not_fixed = [m for m in self.sharded if not m.fixed_shapes]
            if not_fixed:
                raise ValueError(
                    "TrainPipeline(cuda_graph=True): every sharded collection needs "
                    "CommOptions(fixed_shapes=True) (the default input dist syncs with the host)"
                )
            # the overlapped input dist needs its own process group: two streams must not
            # issue collectives on one communicator
            self.graph = GraphedTrainStep(self._step, self.sharded, self.sparse, warmup,
                                          overlap_input=overlap_input and own_group)

    def _start(self, batch):
        """Copy ``batch`` to the device and run its input dist (side stream on CUDA)."""
        if self.side is None:
            batch = batch.to(self.device)
            return batch, None, [m.prefetch(self.sparse(batch)) for m in self.sharded]
        with torch.cuda.stream(self.side):
            batch = batch.to(self.device, non_blocking=True)
            outs = [m.prefetch(self.sparse(batch)) for m in self.sharded]
            event = torch.cuda.Event()
            event.record(self.side)
        return batch, event, outs

    def _step(self, batch, after_forward: Callable[[], None] | None = None) -> torch.Tensor:
        """Forward, backward, optimizer: the part a CUDA graph captures (``after_forward``:
        called between forward and backward)."""
        loss = self.loss_fn(self.model, batch)
        if after_forward is not None:
            after_forward()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the embedding rows are updated here, by the fused optimizer
        if self.after_backward is not None:
            self.after_backward()
        if self.optimizer is not None:
            self.optimizer.step()
        return loss.detach()

    def progress(self, iterator: Iterator) -> torch.Tensor:
        """Train on the next batch; returns its loss (detached). Raises StopIteration when
        ``iterator`` is exhausted and no batch is left in flight."""
        if self.graph is not None:
            if self.graph.overlap_input:
                return self.graph.progress(iterator, self.device)
            return self.graph(next(iterator).to(self.device, non_blocking=True))
        if self.worker is not None:
            return self._progress_on_worker(iterator)
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
        ahead = self._read_rows_ahead if self._next is not None and self.tiered else None
        return self._step(batch, ahead)

    def _progress_on_worker(self, iterator: Iterator) -> torch.Tensor:
        """CPU ``progress``: batch i + 1's input dist on the worker thread while batch i trains
        here; joined before returning, its results offered to the collections for batch
        i + 1's forward (the forward of batch i takes batch i's, offered the same way)."""
        if self._next is None:
            self._next = self._start(next(iterator))
        batch, _, outs = self._next
        self._next = None
        for m, out in zip(self.sharded, outs, strict=True):
            m.offer(self.sparse(batch), out)
        try:
            upcoming = next(iterator)
        except StopIteration:
            upcoming = None
        ahead = None
        if upcoming is not None:
            ahead = self.worker.submit(self._start_here, upcoming)
        try:
            loss = self._step(batch)
        except BaseException:
            if ahead is not None:  # joined on every path: no input dist outlives the call
                wait([ahead])  # the step's error is the one raised
                if ahead.exception() is None:
                    self._next = ahead.result()  # as the serial path keeps it
            raise
        if ahead is not None:
            self._next = ahead.result()
        return loss

    def _start_here(self, batch):
        """The worker's ``_start``: the input dists only (``offer`` registers them on the
        calling thread, so the collections' prefetched lists change on one thread)."""
        batch = batch.to(self.device)
        return batch, None, [m.input_dist(self.sparse(batch)) for m in self.sharded]

    def _read_rows_ahead(self) -> None:
        """After this step's forward (its lookups have taken their rows): start reading the
        next batch's missing rows of every tiered collection (``prefetch_rows``; the ids go
        to the host on the side stream, behind the input dist that made them)."""
        _, _, outs = self._next
        tiered = [(m, out) for m, out in zip(self.sharded, outs, strict=True)
                  if m in self.tiered]
        if self.side is None:
            for m, out in tiered:
                m.prefetch_rows(out, self.row_tiers)
            return
        with torch.cuda.stream(self.side):
            for m, out in tiered:
                m.prefetch_rows(out, self.row_tiers)


class GraphedTrainStep:
    """``step(batch) -> loss`` captured once in a CUDA graph, then replayed per batch.

    The sharded sibling of ``fbtriton_dist.graphs.GraphedStep`` (a step over flat tensors):
    this one knows batches (a dataclass with a KeyedJaggedTensor), the capacity the fixed input
    dist agreed on, and the sharded collections' failure flags.

    The first ``warmup`` calls run ``step`` eagerly on a side stream (they train: NCCL
    communicators, Triton kernels and the fixed input dist's shapes are set up there). The
    next call copies its batch into static buffers made like it (every tensor field of a
    dataclass batch, the KeyedJaggedTensor's values and weights padded to the capacity the
    sharded collections agreed on), captures ``step`` on them and replays; later calls copy
    and replay. A batch whose shapes differ (batch size, dense width, keys, more ids than the
    capacity) raises ValueError. Bad ids (fixed shapes drop them) are reported one step late:
    the sharded collections' failure flags are read without waiting, and the rank that sent
    the batch names the id from the batches it kept.

    With ``overlap_input`` (``progress``, the pipeline's way) one replay trains batch i and,
    on a side stream and the sharded collections' input process groups, runs batch i + 1's
    input dist: the ids travel while batch i computes. Batch i's input dist results sit in
    static buffers (``_cur``), filled eagerly for the first batch after the warm-up and, at
    the end of every replay, copied from what the replay's input dist made (tens of µs);
    the dense fields of the next batch move to the current slot the same way. The last batch
    trains eagerly from those buffers (there is no next batch to overlap with). Since batch
    i's ids are in those buffers before the replay that trains it, a lookup of cached tables
    maps them then, eagerly (``graphs.before_each_replay``: the slot map, its one host read,
    the row moves), and the replay looks up and updates the slots, as ``GraphedStep`` does;
    without ``overlap_input`` the input dist is inside the graph and such a lookup is refused.
    """

    KEEP = 4  # recent batches kept to name a bad id in

    def __init__(self, step, sharded, sparse, warmup: int = 3, overlap_input: bool = True) -> None:
        if warmup < 1:
            raise ValueError(f"warmup: expected >= 1 eager step before the capture, got {warmup}")
        self.step, self.sharded, self.sparse, self.warmup = step, sharded, sparse, warmup
        self.overlap_input = overlap_input
        self._cur = None  # overlap_input: (static batch, its input dist outputs) to train next
        self._next = None  # overlap_input: the static batch whose input dist a replay runs
        self._ready = False  # overlap_input: _cur holds a batch not trained yet
        self.calls = 0
        self.graph = None
        self.static = None
        self.loss = None
        self.recent: list = []
        self._flags = None  # HostFlags: the last replay's input flags, on the host
        self._prepares: list = []  # overlap_input: run before each replay (cached tables)

    def __call__(self, batch) -> torch.Tensor:
        self._check_flags(wait=False)
        self.recent = [*self.recent[-(self.KEEP - 1):], batch]
        if self.calls < self.warmup:
            return self._eager(batch)
        if self.graph is None:
            self._capture(batch)
        else:
            _copy_batch(self.static, batch, self.sparse)
        self.graph.replay()
        self.calls += 1
        self._watch_flags()
        return self.loss.clone()  # the static loss is overwritten by the next replay

    def _eager(self, batch) -> torch.Tensor:
        """A warm-up step: eager, on a side stream (what the capture will use)."""
        self.calls += 1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = self.step(batch)
        torch.cuda.current_stream().wait_stream(side)
        for m in self.sharded:
            m.poll_input()  # eager steps: their flags, now
        return loss

    def progress(self, iterator, device) -> torch.Tensor:
        """Train the next batch (``overlap_input``); StopIteration when none is left. A new
        iterator after that (another epoch) starts over in the same buffers and graph."""
        self._check_flags(wait=False)
        if self.calls < self.warmup:
            batch = next(iterator).to(device, non_blocking=True)
            self.recent = [*self.recent[-(self.KEEP - 1):], batch]
            return self._eager(batch)
        if not self._ready:  # the first batch (of an epoch): its input dist, eagerly
            self._start(next(iterator).to(device, non_blocking=True))
        try:
            upcoming = next(iterator).to(device, non_blocking=True)
        except StopIteration:
            upcoming = None
        if upcoming is None:  # the last batch: train it eagerly from the static buffers
            self._ready = False
            self._offer()
            loss = self.step(self._cur[0])
            for m in self.sharded:
                m.drop_prefetched()
                m.poll_input()  # the eager input dist of _start, if no replay read it
            self.poll()
            return loss
        self.recent = [*self.recent[-(self.KEEP - 1):], upcoming]
        if self._next is None:
            self._next = _static_batch(upcoming, self.sparse, self._capacity())
        _copy_batch(self._next, upcoming, self.sparse)
        if self.graph is None:
            self._capture_overlapped()
        run_prepares(self._prepares)  # cached tables: their slot maps, on batch i's ids
        self.graph.replay()
        self.calls += 1
        self._watch_flags()
        return self.loss.clone()

    def _capacity(self) -> int:
        return min((m.input_capacity() for m in self.sharded), default=0)

    def _start(self, batch) -> None:
        """The static buffers of the batch to train next (made at the first call, refilled
        in place later: the graph reads them), filled with ``batch`` and its input dist (run
        now, eagerly)."""
        self.recent = [*self.recent[-(self.KEEP - 1):], batch]
        if self._cur is None:
            static = _static_batch(batch, self.sparse, self._capacity())
            _copy_batch(static, batch, self.sparse)
            outs = [_static_dist_out(m.input_dist(self.sparse(static))) for m in self.sharded]
            self._cur = (static, outs)
        else:
            static, outs = self._cur
            _copy_batch(static, batch, self.sparse)
            for m, cur in zip(self.sharded, outs, strict=True):
                for a, b in _dist_tensors(m.input_dist(self.sparse(static)), cur):
                    b.copy_(a)
        self._ready = True

    def _offer(self) -> None:
        """Hand each sharded collection the current batch's input dist (its ``forward``
        finds it by the KeyedJaggedTensor the model passes)."""
        static, outs = self._cur
        kjt = self.sparse(static)
        for m, out in zip(self.sharded, outs, strict=True):
            m.offer(kjt, out)

    def _capture_overlapped(self) -> None:
        static, outs = self._cur
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        # batch i's input dist outputs hold their ids before the replay that trains it: a
        # lookup of cached tables maps them then (graphs.before_each_replay)
        ready = [b for cur in outs for _, b in _dist_tensors(cur, cur)]
        with (prepared_before_replays(ready) as self._prepares,
              torch.cuda.graph(self.graph, capture_error_mode=CAPTURE_MODE), joined_at_exit()):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):  # batch i + 1's input dist ...
                made = [m.input_dist(self.sparse(self._next)) for m in self.sharded]
            self._offer()
            self.loss = self.step(static)  # ... while batch i trains
            main.wait_stream(side)
            for m in self.sharded:
                m.drop_prefetched()
            for new, cur in zip(made, outs, strict=True):  # batch i + 1 becomes current
                for a, b in _dist_tensors(new, cur):
                    b.copy_(a)
            _copy_static(static, self._next, self.sparse)
        # the comm report reads the stats of the replay's input dist (refreshed every replay)
        for i, (new, cur) in enumerate(zip(made, outs, strict=True)):
            outs[i] = cur._replace(lookup=dataclasses.replace(cur.lookup,
                                                               stats=new.lookup.stats))

    def _capture(self, batch) -> None:
        caps = [m.input_capacity() for m in self.sharded]
        self.static = _static_batch(batch, self.sparse, min(caps, default=0))
        _copy_batch(self.static, batch, self.sparse)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode=CAPTURE_MODE), joined_at_exit():
            self.loss = self.step(self.static)

    def _watch_flags(self) -> None:
        if not self.sharded:
            return
        flags = torch.stack([m.input_failed for m in self.sharded])
        if self._flags is None:
            self._flags = HostFlags(flags.numel(), flags.device)
        self._flags.start(flags)

    def _check_flags(self, wait: bool) -> None:
        if self._flags is None:
            return
        flags = self._flags.poll(wait)
        if flags is None or not any(flags):
            return
        self._flags.clear()
        for m in self.sharded:
            if not int(m.input_failed):
                continue
            m.clear_input_failed()
            for batch in self.recent:  # this rank's batches: name the bad id if it sent it
                error = m.explain_input(self.sparse(batch))
                if not isinstance(error, RuntimeError):
                    raise error
            raise RuntimeError(
                "input dist (fixed_shapes, CUDA graph): some rank sent bad input (an id out "
                "of its table's range, or lengths that do not add up) in a recent batch; its "
                "ids were dropped from that step (see the sending rank's error)"
            )

    def poll(self) -> None:
        """Raise now if a replayed batch had bad input (waits for the last replay)."""
        self._check_flags(wait=True)


def _static_batch(batch, sparse_of, capacity: int):
    """A batch like ``batch`` over fresh device buffers; the KeyedJaggedTensor's values (and
    weights) get ``capacity`` slots."""
    kjt = sparse_of(batch)
    n = kjt.values().numel()
    if n > capacity:
        raise ValueError(f"cuda_graph: {n} ids in the batch, more than the capacity {capacity}")
    static_kjt = padded_kjt(kjt, capacity)
    if not is_dataclass(batch):
        raise ValueError(f"cuda_graph: expected a dataclass batch, got {type(batch).__name__}")
    fields_ = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if v is kjt:
            fields_[f.name] = static_kjt
        elif isinstance(v, torch.Tensor):
            fields_[f.name] = v.clone()
        else:
            fields_[f.name] = v
    return type(batch)(**fields_)


def _copy_batch(static, batch, sparse_of) -> None:
    """Copy ``batch`` into the static buffers of ``static`` (same shapes, fewer ids allowed)."""
    kjt, skjt = sparse_of(batch), sparse_of(static)
    if list(kjt.keys()) != list(skjt.keys()) or kjt.lengths().shape != skjt.lengths().shape:
        raise ValueError(
            f"cuda_graph: the batch's features {list(kjt.keys())} x {kjt.stride()} samples do "
            f"not match the captured {list(skjt.keys())} x {skjt.stride()}"
        )
    n, cap = kjt.values().numel(), skjt.values().numel()
    if n > cap:
        raise ValueError(f"cuda_graph: {n} ids in the batch, more than the capacity {cap} "
                         "(CommOptions.max_ids)")
    skjt.values()[:n].copy_(kjt.values(), non_blocking=True)
    skjt.lengths().copy_(kjt.lengths(), non_blocking=True)
    w = kjt.weights_or_none()
    if w is not None:
        skjt.weights()[:n].copy_(w, non_blocking=True)
    for f in fields(static):
        dst, src = getattr(static, f.name), getattr(batch, f.name)
        if isinstance(dst, torch.Tensor):
            if dst.shape != src.shape:
                raise ValueError(f"cuda_graph: batch field {f.name} has shape "
                                 f"{tuple(src.shape)}, captured {tuple(dst.shape)}")
            dst.copy_(src, non_blocking=True)


def _copy_static(dst, src, sparse_of) -> None:
    """Every tensor of static batch ``src`` into static batch ``dst`` (same shapes): the
    dense fields and the KeyedJaggedTensor's values, lengths and weights."""
    for f in fields(dst):
        a, b = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(a, torch.Tensor):
            a.copy_(b)
    kd, ks = sparse_of(dst), sparse_of(src)
    kd.values().copy_(ks.values())
    kd.lengths().copy_(ks.lengths())
    if kd.weights_or_none() is not None:
        kd.weights().copy_(ks.weights())


def _dist_tensors(out, like):
    """(tensor of ``out``, the same tensor of ``like``) pairs of two input dist outputs of
    the same shapes: the own lengths and every TBE group's indices, offsets and weights."""
    pairs = [(out.lengths, like.lengths)]
    for g_out, g_like in zip(out.lookup.groups, like.lookup.groups, strict=True):
        pairs += [(a, b) for a, b in zip(g_out, g_like, strict=True) if a is not None]
    return pairs


def _static_dist_out(out):
    """A copy of a fixed-shape input dist output in buffers of its own (the first group's
    tensors stay the lookup's ``indices``/``offsets``/``per_sample_weights``)."""
    groups = tuple(tuple(x.clone() if x is not None else None for x in g)
                   for g in out.lookup.groups)
    first = groups[0] if groups else (out.lookup.indices.clone(), out.lookup.offsets.clone(),
                                      None)
    lookup = dataclasses.replace(out.lookup, indices=first[0], offsets=first[1],
                                 per_sample_weights=first[2], groups=groups)
    return InputDistOut(out.lengths.clone(), lookup, list(out.batch_sizes))
