"""CUDA-graph replay of a whole training step: forward, backward and optimizer in one launch.

A sparse model's step is short on the GPU and long on the host (tens of kernel launches,
autograd, Python): at T=32, B=512 the TBE step is ~0.35 ms of GPU work behind ~1.1 ms of host
time. ``GraphedStep`` records the step once with ``torch.cuda.graph`` and then replays it:
one launch per call, whatever the step does inside.

    step = GraphedStep(train_step)        # train_step(indices, offsets, dense, labels) -> loss
    for batch in loader:
        loss = step(batch.indices, batch.offsets, batch.dense, batch.labels)

Every call is exactly one step on its own arguments (no snapshot/restore is needed, none is
done): the first ``warmup`` calls with a new input signature run ``fn`` eagerly on a side stream
(real steps: this is the warm-up PyTorch's whole-network capture recipe asks for, done with the
caller's batches); the next call with that signature copies its tensors into static buffers,
captures ``fn`` on them (recording executes nothing) and replays the graph once; later calls
copy their tensors in and replay. Without CUDA tensors (CPU, CI) or with ``enabled=False``
every call is simply ``fn(*args)``.

What ``fn`` must be (the usual CUDA-graph contract, PyTorch's "CUDA Graphs" notes):
- its tensor arguments are the only inputs that change between calls; everything else it
  reads (parameters, optimizer state, a TBE's step counter and learning rate) is read at the
  addresses seen at capture, so keep such state in tensors updated in place.
  ``TableBatchedEmbedding`` keeps its step counter and hyper-parameters on the device for this
  (``set_learning_rate`` reaches the graph); torch optimizers need ``capturable=True``, and
  ``fn`` should start with ``optimizer.zero_grad(set_to_none=True)``;
- no host synchronisation: no ``.item()`` / ``.tolist()`` / printing of device values, no
  ``bounds_check="error"`` (``"warn"`` counts on the device; see ``tbe.poll_bounds_check``);
- no fused optimizer with a whole-table step (EMA in place, ensemble): its schedule is chosen
  on the host by the step count before each training lookup, so a captured training lookup
  refuses it (ValueError) rather than replay one step's choice;
- host-side effects of ``fn`` (Python counters, logging) happen once, at capture, not at
  replays; what must run on the host at every step registers itself at capture with
  ``before_each_replay`` (a TBE lookup of cached storage tiers does: its slot map runs
  eagerly on the step's ids before each replay, the lookup and fused update on the slots are
  replayed);
- the tensors it returns are static: the next replay overwrites them (clone to keep one);
  its tensor arguments are data (copied into the static inputs; no gradient reaches them).

Input signatures: each tensor's shape, dtype and device, and each non-tensor argument's value
(they are baked into the graph), form the key of a graph. A new key is warmed up and captured
anew; at most ``max_graphs`` graphs are kept (least recently used dropped, each holds its own
memory pool). Batches whose sizes vary every step never repeat a key and so always run eagerly:
pad them to a few fixed sizes (TBE ``indices`` may carry padding after ``offsets[-1]`` with
``bounds_check="ignore"``). Call ``reset()`` after anything that replaces, rather than updates
in place, a tensor the step reads (moving a module, ``set_optimizer`` with another kind of
optimizer, a new torch optimizer).
"""

import collections
import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# What a capture runs before each replay, with the tensors it may read (the step's static
# inputs): the innermost ``prepared_before_replays`` scope collects it.
_PREPARE_SCOPES: list[tuple[list[Any], list[Callable[[object], None]]]] = []

# Side-stream work a captured step forked and has not joined yet (a TBE lookup's backward
# plan, joined by its backward): the innermost ``joined_at_exit`` scope collects it.
_JOIN_SCOPES: list[list[tuple[torch.device, Any]]] = []

CAPTURE_MODE = "thread_local"
"""``torch.cuda.graph``'s ``capture_error_mode`` for every capture here and in
``sharding/pipeline.py``: only the capturing thread is held to the capture's rules. With
torch's default ("global") a CUDA call that is not capture-safe made by *any* thread invalidates
the capture: the training job's data thread pinning the next batch (``cudaHostAlloc``) while
the step is captured did that ("operation failed due to a previous error during capture")."""


@contextlib.contextmanager
def joined_at_exit() -> Iterator[None]:
    """Wrap what is captured in a CUDA graph (inside ``torch.cuda.graph``): side-stream work
    that a TBE training lookup forks (``defer_join``) may then stay unjoined until its
    backward waits for it, and at exit the current stream waits for whatever is still
    pending, so the capture ends joined (a captured forward without its backward, too).
    ``GraphedStep`` and ``TrainPipeline(cuda_graph=True)`` capture inside one."""
    pending: list[tuple[torch.device, Any]] = []
    _JOIN_SCOPES.append(pending)
    try:
        yield
    except BaseException:
        _JOIN_SCOPES.pop()  # the capture is lost anyway: no joins to hide the cause
        raise
    _JOIN_SCOPES.pop()
    for device, event in pending:
        torch.cuda.current_stream(device).wait_event(event)


def defer_join(device: torch.device, event) -> bool:
    """Hand ``event`` (recorded on a side stream under capture) to the innermost
    ``joined_at_exit`` scope; False when there is none (the caller must join now)."""
    if not _JOIN_SCOPES:
        return False
    _JOIN_SCOPES[-1].append((device, event))
    return True


def before_each_replay(reads: Sequence[torch.Tensor], prepare: Callable[[object], None],
                       what: str) -> None:
    """Under a capture that runs work before its replays (``GraphedStep``; the overlapped
    ``TrainPipeline(cuda_graph=True)``): run ``prepare(replay)`` eagerly, on the current
    stream, before every replay of the graph being captured (after the call's tensors are in
    its static inputs; a raise there skips the replay), in the order of registration;
    ``replay``: an object new at each replay, the same for all of that replay's prepares.
    ``reads``: the tensors ``prepare`` reads, which must hold their values before the replay:
    the step's static inputs or views of them, not tensors the graph computes. ``what`` names
    the caller in errors. RuntimeError outside such a capture, or for a tensor computed in the
    graph."""
    if not _PREPARE_SCOPES:
        raise RuntimeError(
            f"{what}: needs work on the host before each replay of a CUDA graph; only "
            "fbtriton_dist.graphs.GraphedStep and TrainPipeline(cuda_graph=True) with its "
            "overlapped input dist (overlap_input=True, own_group=True) run it (a bare "
            "torch.cuda.graph capture, or the pipeline's graph of the input dist and the step "
            "together, cannot): capture it so, or run it eagerly")
    inputs, prepares = _PREPARE_SCOPES[-1]
    given = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
    for t in reads:
        if t.untyped_storage().data_ptr() not in given:
            raise RuntimeError(
                f"{what}: in a GraphedStep its ids must be the step's own tensor arguments "
                f"(or views of them): a {tuple(t.shape)} {t.dtype} tensor computed inside the "
                "step has no value before the replay that computes it; pass the lookup's "
                "indices and offsets to the step")
    prepares.append(prepare)


@contextlib.contextmanager
def prepared_before_replays(inputs: list[Any]) -> Iterator[list[Callable[[object], None]]]:
    """The scope of one capture whose replays ``run_prepares`` precedes: yields the list
    ``before_each_replay`` fills. ``inputs``: the tensors that hold their values before each
    replay (the step's static inputs)."""
    prepares: list[Callable[[object], None]] = []
    _PREPARE_SCOPES.append((inputs, prepares))
    try:
        yield prepares
    finally:
        _PREPARE_SCOPES.pop()


def run_prepares(prepares: Sequence[Callable[[object], None]]) -> None:
    """What a capture registered with ``before_each_replay``, before one replay."""
    replay = object()
    for prepare in prepares:
        prepare(replay)


@dataclass(eq=False)
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: list[Any]  # static copies of the tensor arguments (others as given)
    output: Any
    prepares: list[Callable[[object], None]]  # run before each replay (``before_each_replay``)


class GraphedStep:
    """``GraphedStep(fn)(*args)``: ``fn(*args)``, replayed from a CUDA graph after ``warmup``
    eager calls per input signature (see the module docstring for the contract).

    Args:
        fn: the step, a function of its positional arguments.
        warmup: eager calls per signature before it is captured (>= 1: the first call builds
            lazily created state, compiles kernels, and TBE's dropped-id counter).
        max_graphs: captured signatures kept (least recently used dropped beyond that).
        enabled: False runs every call eagerly; None (default): capture when CUDA is there.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        warmup: int = 3,
        max_graphs: int = 4,
        enabled: bool | None = None,
    ) -> None:
        if warmup < 1:
            raise ValueError(f"warmup: expected >= 1 eager calls before capture, got {warmup}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs: expected >= 1, got {max_graphs}")
        self.fn = fn
        self.warmup = warmup
        self.max_graphs = max_graphs
        self.enabled = torch.cuda.is_available() if enabled is None else bool(enabled)
        self._graphs: collections.OrderedDict[Hashable, _Captured] = collections.OrderedDict()
        self._seen: dict[Hashable, int] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.eager_calls = 0
        """Calls run eagerly (warm-up, fallback)."""
        self.captures = 0
        """Graphs captured (signatures, and again after eviction or ``reset``)."""
        self.replays = 0
        """Calls served by a graph replay."""

    def __call__(self, *args: Any) -> Any:
        device = self._device(args) if self.enabled else None
        if device is None:
            self.eager_calls += 1
            return self.fn(*args)
        key = _signature(args)
        captured = self._graphs.get(key)
        if captured is None:
            seen = self._seen.get(key, 0)
            if seen < self.warmup:
                if len(self._seen) >= 64 * self.max_graphs:  # signatures that never repeat
                    self._seen.clear()
                self._seen[key] = seen + 1
                return self._eager(device, args)
            captured = self._capture(device, args)  # its inputs hold this call's values
            self._seen.pop(key, None)
            self._graphs[key] = captured
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            with torch.no_grad():
                for static, arg in zip(captured.inputs, args, strict=True):
                    if isinstance(arg, torch.Tensor) and arg.data_ptr() != static.data_ptr():
                        static.copy_(arg)
        run_prepares(captured.prepares)
        captured.graph.replay()
        self.replays += 1
        return captured.output

    def reset(self) -> None:
        """Drop every captured graph (and warm-up count): the next calls warm up and capture
        again. Needed when a tensor the step reads was replaced rather than updated in place."""
        self._graphs.clear()
        self._seen.clear()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _device(self, args: tuple) -> torch.device | None:
        """The CUDA device of the tensor arguments; None (run eagerly) when none is on CUDA."""
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        cuda = {d for d in devices if d.type == "cuda"}
        if not cuda:
            return None
        if len(devices) > 1:
            raise ValueError(
                "GraphedStep: expected every tensor argument on one CUDA device, got "
                f"{sorted(str(d) for d in devices)}"
            )
        return cuda.pop()

    def _eager(self, device: torch.device, args: tuple) -> Any:
        """One eager call on a side stream (PyTorch's warm-up recipe), ordered both ways with
        the caller's stream."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            out = self.fn(*args)
        current.wait_stream(stream)
        self.eager_calls += 1
        return out

    def _capture(self, device: torch.device, args: tuple) -> _Captured:
        inputs = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        graph = torch.cuda.CUDAGraph()
        try:
            with (torch.cuda.device(device), prepared_before_replays(inputs) as prepares,
                  torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE), joined_at_exit()):
                output = self.fn(*inputs)
        except Exception as e:
            raise RuntimeError(
                f"GraphedStep: capturing {getattr(self.fn, '__name__', 'the step')} in a CUDA "
                f"graph failed: {type(e).__name__}: {e}. A captured step must not read device "
                "values on the host (.item(), .tolist(), printing, TBE bounds_check='error'); "
                "pass enabled=False to run it eagerly"
            ) from e
        self.captures += 1
        return _Captured(graph, inputs, output, prepares)


def _signature(args: tuple) -> Hashable:
    """What a captured graph is specific to: tensor shapes, dtypes, devices; other values."""
    return tuple(
        ("tensor", tuple(a.shape), a.dtype, a.device)
        if isinstance(a, torch.Tensor)
        else ("value", a)
        for a in args
    )
