"""How a sharded collection talks to other ranks, and how its gradients are scaled.

The wire switches (``wire_dtype``, ``dedup``, ``fixed_shapes``) keep results equal to the
default path (``wire_dtype`` within a stated error bound). ``gradient_division`` sets what a
learning rate means: by default the embedding gradients are divided by the world size, as
TorchRec does, so R ranks take the update the unsharded module takes on the global batch.
"""

from dataclasses import dataclass

import torch

from fbtriton_dist.sharding.comm.wire import WireFormat, format_name

SAME = "same"
"""``backward_wire_dtype``'s default: the forward's format."""


@dataclass(kw_only=True, frozen=True)
class CommOptions:
    """Communication options of a sharded collection (``shard(..., comm=CommOptions(...))``)."""

    wire_dtype: "torch.dtype | str | None | object" = None
    """The wire format of pooled embeddings (output dist, forward; an EmbeddingCollection's
    rows) and, unless ``backward_wire_dtype`` says otherwise, of their gradients (backward):
    None or "fp32" (exact), torch.bfloat16 / "bf16", torch.float16 / "fp16", "fp8" (e4m3 with
    an fp32 scale amax/448 per row) or "int8" (255 levels between the row's min and max, an
    fp32 scale and min per row); a row is one sample's (sequence: one id's) columns of one
    shard-feature. Rounding to nearest, decoded and summed in fp32, one rounding per hop (two
    for table-row-wise / grid, which sum inside the host first); per element x of a row and
    hop ``|error| <= 2^-8|x|`` bf16, ``2^-11|x|`` fp16, ``2^-4|x| + 2^-10 amax/448`` fp8,
    ``(max - min)/510`` int8 (``fbtriton_dist.sharding.comm.wire``). A row holding a NaN or
    an infinity decodes to NaN in fp8 / int8; other rows are untouched. Ids never lose
    precision; data-parallel gradients stay exact. TorchRec's ``QCommsConfig`` is taken
    too: its ``forward_precision`` / ``backward_precision`` (FP32, BF16, FP16, FP8, INT8)
    set both directions."""
    backward_wire_dtype: "torch.dtype | str | None" = SAME
    """The gradients' wire format (choices as ``wire_dtype``); "same" (default): the
    forward's."""
    dedup: bool = False
    """Send each destination its distinct ids once plus an inverse map (int16 up to 32,768
    distinct ids, else int32) in the input all-to-all, per message only where that is smaller
    than the ids themselves (ids repeat within a batch under Zipf). The receiver expands the
    ids back before the lookup, so results are bit-identical and the TBE still reads one row
    per id: dedup saves wire bytes, not lookups (``comm_report()['input_dist.dedup']``)."""

    fixed_shapes: bool = False
    """Give every input all-to-all message a size fixed at the first batch (its lengths and
    ``max_ids`` id slots times the most shards an id lands in), so that a step has no host
    sync and the same shapes every time: the host runs ahead of the GPU, and the step can be
    captured in a CUDA graph (``TrainPipeline(cuda_graph=True)``). Costs wire bytes (unused
    slots travel too); the batch size must stay the same; bad ids are reported a few steps
    late (``fbtriton_dist.sharding.dist.fixed``). Not with ``dedup``."""
    max_ids: int | None = None
    """With ``fixed_shapes``: the most ids one rank's batch may hold (default: the first
    batch's count)."""

    gradient_division: bool | None = None
    """Divide the gradient of every sharded table (data-parallel ones included) by the world
    size R of the process group in backward, as TorchRec's output dist does
    (``torchrec.distributed.comm_ops.set_gradient_division``) and as DDP averages the dense
    gradients: each rank's loss is the mean over its own samples, and R ranks then take the
    same step as the unsharded module on the global batch with the loss as its mean (uneven
    batches: when each rank's loss is its sum over its samples times R / global batch).
    False: the gradients of all ranks are summed (a learning rate then acts R times larger
    on R ranks). None (default): True; under TorchRec's ``DistributedModelParallel`` our
    sharders read TorchRec's switch instead (``comm_ops.get_gradient_division()``, when the
    model is sharded)."""

    replica_sync_dtype: "torch.dtype | str | None" = None
    """With replica groups averaged every N steps (``replica_sync=N``): the format the
    weights travel in when the replicas are averaged, choices as ``wire_dtype`` (None or
    "fp32": one fp32 all-reduce, the default). A row is one table row of a shard. Any other
    format averages in two hops, each rounded once (``sharding.comm.replicas``): every
    replica sends each other replica its slice of the rows in the format (a reduce-scatter as
    an all-to-all), the slice's owner averages the decoded rows in fp32 and sends the average
    back in the format (an all-gather), so the replicas end bit-identical; per element of the
    fp32 average a = mean over the K replicas of x_k, ``|error| <= mean_k e(x_k) + e(y)``, e
    the per-hop bound of ``wire_dtype`` above on the row of x_k, and y the averaged decoded
    row. The optimizer state always averages in fp32 (its values span many orders of
    magnitude, fp16 overflows Adagrad's sums of squares, and a rowwise state has one value
    per row, where an 8-bit format's row scales cost more than the fp32 value). Refused with
    ``replica_sync="step"``, whose exchange of row gradients stays fp32 so that the grouped
    plan equals the flat plan. TorchRec has no counterpart (``DMPCollection`` averages in
    fp32 or through ``custom_all_reduce``); under ``DMPCollection`` pass it in our sharders'
    ``comm``."""

    def __post_init__(self) -> None:
        if hasattr(self.wire_dtype, "forward_precision"):  # TorchRec's QCommsConfig
            if self.backward_wire_dtype != SAME:
                raise ValueError("CommOptions: a QCommsConfig sets both directions; leave "
                                 "backward_wire_dtype out")
            fwd, bwd = _from_qcomms(self.wire_dtype)
            object.__setattr__(self, "wire_dtype", fwd)
            object.__setattr__(self, "backward_wire_dtype", bwd)
        format_name(self.wire_dtype, "wire_dtype")
        if self.backward_wire_dtype != SAME:
            format_name(self.backward_wire_dtype, "backward_wire_dtype")
        if format_name(self.replica_sync_dtype, "replica_sync_dtype") == "fp32":
            object.__setattr__(self, "replica_sync_dtype", None)  # one spelling of the default
        if self.gradient_division is not None and not isinstance(self.gradient_division, bool):
            raise ValueError(f"gradient_division: expected True, False or None, got "
                             f"{self.gradient_division!r}")
        if self.fixed_shapes and self.dedup:
            raise ValueError("CommOptions: fixed_shapes and dedup do not combine (dedup sizes "
                             "each message by its distinct ids, which changes every batch)")
        if self.max_ids is not None and not self.fixed_shapes:
            raise ValueError("CommOptions: max_ids is the capacity of fixed_shapes; set "
                             "fixed_shapes=True with it")

    @property
    def wire(self) -> tuple[WireFormat, WireFormat]:
        """The (forward, backward) ``WireFormat``s of the output dist."""
        fwd = WireFormat(format_name(self.wire_dtype))
        if self.backward_wire_dtype == SAME:
            return fwd, fwd
        return fwd, WireFormat(format_name(self.backward_wire_dtype))

    @property
    def replica_sync_format(self) -> WireFormat:
        """The ``WireFormat`` of the weights when replicas are averaged (``replica_sync=N``)."""
        return WireFormat(format_name(self.replica_sync_dtype, "replica_sync_dtype"))


_QCOMMS_UNSET = {"forward_loss_scale": None, "backward_loss_scale": None,
                 "fp8_quantize_dim": None, "fp8_quantize_dim_bwd": None,
                 "mx4_quantize_dim": None, "mx4_quantize_dim_bwd": None,
                 "mx4_rounding_mode": None, "fp8_output_dtype": None}


def _from_qcomms(q) -> tuple[str, str]:
    """(forward, backward) format names of TorchRec's ``QCommsConfig`` ``q``; an error naming
    each field that has no counterpart here."""
    names = []
    for key in ("forward_precision", "backward_precision"):
        value = getattr(q, key)
        name = str(getattr(value, "value", value)).lower()
        if name == "mx4":
            raise ValueError(f"QCommsConfig.{key}: MX4 is not a wire format here (choices: "
                             f"FP32, BF16, FP16, FP8, INT8)")
        names.append(format_name(value, f"QCommsConfig.{key}"))
    for key, want in _QCOMMS_UNSET.items():
        if getattr(q, key, want) != want:
            raise ValueError(f"QCommsConfig.{key}: expected None, got {getattr(q, key)!r} (our "
                             f"fp8 and int8 always scale each row: no loss scales, no quantize "
                             f"dims, no MX4 options)")
    out = getattr(q, "output_dtype", None)
    if out is not None and str(getattr(out, "value", out)).lower() != "fp32":
        raise ValueError(f"QCommsConfig.output_dtype: expected None or FP32 (the receiver "
                         f"decodes into fp32), got {out!r}")
    if names[1] == "fp8" and not getattr(q, "fp8_bwd_uses_143", True):
        raise ValueError("QCommsConfig.backward_precision: FP8 with fp8_bwd_uses_143=False is "
                         "e5m2, not a wire format here (ours is e4m3 with a row scale): set "
                         "fp8_bwd_uses_143=True")
    return names[0], names[1]
