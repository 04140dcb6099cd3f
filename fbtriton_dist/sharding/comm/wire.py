"""Wire formats of the output dist: how pooled rows (sequence: looked-up rows) and their
gradients travel, and the all-to-all that encodes, exchanges and decodes them.

A *row* is one sample's (sequence: one id's) columns of one shard-feature; the payload of a
message is a flat run of rows, whose widths both sides know from the plan (``Rows``).

========  =================  ==========================================================
format    bytes              one hop, per element x of a row (nearest rounding)
========  =================  ==========================================================
fp32      4 per value        exact
bf16      2 per value        ``|e| <= 2^-8 |x|`` (bf16's subnormals aside)
fp16      2 per value        ``|e| <= 2^-11 |x| + 2^-25`` (fp16 subnormals)
fp8       1 per value + 4    e4m3 of x / s, s = amax/448 (amax: the row's max |x|), fp32 s:
          per row            ``|e| <= 2^-4 |x| + 2^-10 s``
int8      1 per value + 8    round((x - min) / s), s = (max - min)/255 (the row's min, max),
          per row            fp32 s and min: ``|e| <= s/2 = (max - min)/510``
========  =================  ==========================================================

(Bounds up to fp32's own rounding of the division and the decode, a relative 2^-23.)
Rounding is to nearest (ties to even) in every format. The receiver decodes into fp32 and
sums parts there; table-row-wise and grid rows take two hops (summed inside the host, then
sent), each rounded once. Non-finite values: a row holding a NaN or an infinity gets a NaN
scale in fp8 and int8 and decodes to NaN in every column (the loss turns NaN, loudly); other
rows are untouched (bf16 / fp16 keep the value as it is, per element). A row of zeros (or of
one constant, int8) decodes exactly.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fbtriton_dist.planner.cost import WIRE_FORMATS

FP8_MAX = 448.0
"""The largest finite ``torch.float8_e4m3fn``."""

_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.float8_e4m3fn: "fp8"}


def format_name(value, key: str = "wire_dtype") -> str:
    """The ``WIRE_FORMATS`` name of ``value``: None (fp32), a name, a torch dtype
    (float32 / bfloat16 / float16 / float8_e4m3fn) or TorchRec's ``CommType``."""
    if value is None:
        return "fp32"
    if isinstance(value, torch.dtype):
        if value in _NAMES:
            return _NAMES[value]
    else:
        name = getattr(value, "value", value)  # torchrec CommType is a str Enum
        if isinstance(name, str) and name.lower() in WIRE_FORMATS:
            return name.lower()
    raise ValueError(f"{key}: expected one of [None, {', '.join(WIRE_FORMATS)}] (a name, a torch "
                     f"dtype or TorchRec's CommType), got {value!r}")


@dataclass(frozen=True)
class WireFormat:
    """One of ``WIRE_FORMATS``: values in ``value_bytes`` each, plus ``row_bytes`` of scales per
    row (fp8: s; int8: s and min)."""

    name: str = "fp32"

    @property
    def value_bytes(self) -> int:
        return WIRE_FORMATS[self.name][0]

    @property
    def row_bytes(self) -> int:
        return WIRE_FORMATS[self.name][1]

    @property
    def scaled(self) -> bool:
        return self.row_bytes > 0

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype values travel in (None for the scaled formats: bytes)."""
        return _DTYPE.get(self.name)

    def nbytes(self, values: int, rows: int) -> int:
        return values * self.value_bytes + rows * self.row_bytes

    def encode(self, x: torch.Tensor, rows: "Rows") -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (fp32, flat, rows back to back) -> (values [numel] uint8, scales [rows, k]
        fp32), k = 1 (fp8: s) or 2 (int8: s, min)."""
        x = x.float()
        bad = rows.reduce(x.isfinite().logical_not().float(), "amax") > 0
        nan = torch.full_like(bad, float("nan"), dtype=torch.float32)
        if self.name == "fp8":
            amax = rows.reduce(x.abs(), "amax")
            s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            s = torch.where(bad, nan, s)
            q = (x / rows.expand(s)).nan_to_num(0.0).to(torch.float8_e4m3fn).view(torch.uint8)
            return q, s[:, None]
        lo, hi = rows.reduce(x, "amin"), rows.reduce(x, "amax")
        s = (hi - lo) / 255.0
        s = torch.where(bad, nan, torch.where(s > 0, s, torch.ones_like(s)))
        lo = torch.where(bad, nan, lo)
        q = ((x - rows.expand(lo)) / rows.expand(s)).nan_to_num(0.0).round().clamp_(0, 255)
        return q.to(torch.uint8), torch.stack([s, lo], 1)

    def decode(self, q: torch.Tensor, scales: torch.Tensor, rows: "Rows") -> torch.Tensor:
        """The fp32 values of ``encode``'s output."""
        if self.name == "fp8":
            return q.view(torch.float8_e4m3fn).float() * rows.expand(scales[:, 0])
        return q.float() * rows.expand(scales[:, 0]) + rows.expand(scales[:, 1])

    def roundtrip(self, x: torch.Tensor, rows: "Rows") -> torch.Tensor:
        """``x`` as the receiver of one hop sees it (fp32)."""
        if not self.scaled:
            return x.to(self.dtype).float()
        return self.decode(*self.encode(x, rows), rows)


class Rows:
    """The rows of one side of an all-to-all: ``pattern[i]``, peer i's message, a list of
    ``(count, widths)``: the row widths ``widths`` repeated ``count`` times (a block of
    ``count`` samples, one row per shard-feature of it)."""

    def __init__(self, pattern, device) -> None:
        self.values = [sum(n * sum(w) for n, w in peer) for peer in pattern]
        self.rows = [sum(n * len(w) for n, w in peer) for peer in pattern]
        widths = {x for peer in pattern for n, w in peer if n for x in w}
        self.width = widths.pop() if len(widths) == 1 else None  # one width: a view, no index
        self.device = device
        if self.width is None:
            parts = [torch.tensor(w, dtype=torch.int64).repeat(n)
                     for peer in pattern for n, w in peer if n and w]
            lengths = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            self.index = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)

    def reduce(self, x: torch.Tensor, how: str) -> torch.Tensor:
        """[rows] ``how`` ("amax" / "amin") of every row of flat ``x``."""
        n = sum(self.rows)
        if self.width is not None:
            v = x.view(n, self.width)
            return v.amax(1) if how == "amax" else v.amin(1)
        return x.new_zeros(n).scatter_reduce_(0, self.index, x, how, include_self=False)

    def expand(self, per_row: torch.Tensor) -> torch.Tensor:
        """A [rows] tensor repeated over every value of its row (flat)."""
        if self.width is not None:
            return per_row[:, None].expand(-1, self.width).reshape(-1)
        return per_row.index_select(0, self.index)


def wire_all_to_all(x: torch.Tensor, send: Rows, recv: Rows, formats, group=None):
    """All-to-all of flat fp32 ``x`` (``send.values[i]`` values to peer i, rows ``send``),
    forward in ``formats[0]``, the gradient back in ``formats[1]`` (``WireFormat``s); the
    received values come back fp32."""
    return _WireAllToAll.apply(x, send, recv, tuple(formats), group)


class _WireAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, formats, group):
        ctx.args = (send, recv, formats[1], group)
        return exchange_rows(x, send, recv, formats[0], group)

    @staticmethod
    def backward(ctx, grad):
        send, recv, fmt, group = ctx.args
        return exchange_rows(grad.contiguous(), recv, send, fmt, group), None, None, None, None


def exchange_rows(x, send: Rows, recv: Rows, fmt: WireFormat, group) -> torch.Tensor:
    """One all-to-all of flat fp32 ``x`` (rows ``send``, ``send.values[i]`` values to peer i)
    in ``fmt``, encoded per row (scales after each peer's values), decoded to fp32 in the
    order of ``recv``; no autograd (``wire_all_to_all`` wraps it)."""
    if not fmt.scaled:
        wire = x.to(fmt.dtype).contiguous()
        out = wire.new_empty(sum(recv.values))
        dist.all_to_all_single(out, wire, recv.values, send.values, group=group)
        return out.float()
    q, s = fmt.encode(x, send)
    s = s.contiguous().view(torch.uint8).reshape(-1)  # [rows * k * 4] bytes
    rb = fmt.row_bytes
    pieces, at_v, at_s = [], 0, 0
    for n, m in zip(send.values, send.rows, strict=True):  # peer i: its values, its scales
        pieces += [q[at_v : at_v + n], s[at_s : at_s + m * rb]]
        at_v, at_s = at_v + n, at_s + m * rb
    buf = torch.cat(pieces)
    got_n = [fmt.nbytes(n, m) for n, m in zip(recv.values, recv.rows, strict=True)]
    got = buf.new_empty(sum(got_n))
    dist.all_to_all_single(got, buf, got_n, [fmt.nbytes(n, m) for n, m in
                                              zip(send.values, send.rows, strict=True)],
                           group=group)
    values, scales, at = [], [], 0
    for n, m in zip(recv.values, recv.rows, strict=True):
        values.append(got[at : at + n])
        scales.append(got[at + n : at + n + m * rb])
        at += n + m * rb
    q = torch.cat(values)
    s = torch.cat(scales).view(torch.float32).view(-1, rb // 4)
    return fmt.decode(q, s, recv)


def wire_formats(wire) -> tuple[WireFormat, WireFormat]:
    """(forward, backward) ``WireFormat``s of ``wire``: such a pair, or one ``format_name``
    value for both directions."""
    if isinstance(wire, tuple) and all(isinstance(f, WireFormat) for f in wire):
        return wire
    f = WireFormat(format_name(wire))
    return f, f
