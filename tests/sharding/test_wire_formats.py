"""8-bit wire formats (fp8, int8) of the output dist, and the 16-bit ones beside them.

- the codec alone: every element within its format's stated bound per hop, the bound tight
  (random rows reach most of it; truncation instead of nearest rounding breaks it), fp32
  exact, zero / constant rows exact, a NaN or an infinity turns its own row to NaN and no
  other, one width and mixed widths encode alike;
- ``CommOptions``: names, dtypes, TorchRec's ``QCommsConfig`` and clear errors;
- on gloo (2 and 3 ranks, uneven batches): a sharded EBC with every sharding type (mixed
  plan) and a sharded EC, fp8 and int8 both ways, within the per-hop bound of the exact
  result, forward and the SGD weight change; ``"fp32"`` bit-identical to the default; a VBE
  step with int8;
- ``comm_report``: the quantized values plus per-row scales, counted by hand, forward and
  backward in their own formats, and the planner's estimate equal to it.
"""

import copy

import pytest
import torch

from tests.sharding.harness import device, run_ranks
from tests.sharding.test_lean import _reference, _shard
from tests.sharding.test_sharded_ebc import BATCH, _configs, _global_batch, _kjt, _optimizer

EPS = 2.0**-20  # fp32's own rounding in the division and the decode, with room


def _rows(widths_per_peer, device="cpu"):
    from fbtriton_dist.sharding.comm.wire import Rows

    return Rows(widths_per_peer, device)


def _bound(fmt: str, x: torch.Tensor, width: int) -> torch.Tensor:
    """The stated bound per element of one hop, rows of ``width`` values back to back."""
    rows = x.view(-1, width)
    if fmt in ("bf16", "fp16"):  # per element (fp16: its subnormals' half step)
        b = 2.0**-8 * rows.abs() if fmt == "bf16" else 2.0**-11 * rows.abs() + 2.0**-25
    elif fmt == "fp8":
        amax = rows.abs().amax(1, keepdim=True)
        b = 2.0**-4 * rows.abs() + 2.0**-10 * amax / 448
    else:
        b = ((rows.amax(1, keepdim=True) - rows.amin(1, keepdim=True)) / 510).expand_as(rows)
    return (b * (1 + EPS) + 1e-30).reshape(-1)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "bf16", "fp16"])
@pytest.mark.parametrize("width", [1, 3, 16])
def test_codec_within_the_stated_bound_and_tight(fmt, width):
    from fbtriton_dist.sharding.comm.wire import WireFormat

    g = torch.Generator().manual_seed(width)
    # rows of very different magnitudes (fp16: inside its range, subnormals included)
    scales = torch.logspace(*((-6, 6) if fmt != "fp16" else (-6, 4)), 64)[:, None]
    x = (torch.randn(64, width, generator=g) * scales).reshape(-1)
    rows = _rows([[(64, (width,))]])
    y = WireFormat(fmt).roundtrip(x, rows)
    err, bound = (y - x).abs(), _bound(fmt, x, width)
    assert bool((err <= bound).all()), f"{fmt}: over the bound by {(err - bound).max()}"
    if width > 1:
        assert err.max() > 0
        # tight: some element uses most of its bound (nearest rounding's worst case is 1/2 ulp)
        assert float((err / bound).max()) > 0.4
    # truncation instead of nearest rounding overshoots the same bound
    if fmt == "int8" and width > 2:
        q, s = WireFormat(fmt).encode(x, rows)
        lo, sc = rows.expand(s[:, 1]), rows.expand(s[:, 0])
        trunc = ((x - lo) / sc).floor() * sc + lo
        assert bool(((trunc - x).abs() > bound).any())
    if fmt == "fp8" and width > 2:
        v = x.view(-1, width)
        s = v.abs().amax(1, keepdim=True) / 448
        r = (v / s).to(torch.float8_e4m3fn).float()
        up = r.abs() > (v / s).abs()  # nearest rounded away from zero: truncate instead
        trunc = torch.where(up, _fp8_below(r.abs()) * r.sign(), r) * s
        assert bool(((trunc.reshape(-1) - x).abs() > bound).any())


def _fp8_below(a: torch.Tensor) -> torch.Tensor:
    """The next e4m3 value below each (non-negative, representable) ``a``."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0..448
    idx = torch.searchsorted(grid, a.reshape(-1)).clamp(min=1) - 1
    return grid[idx].view_as(a)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "fp8", "int8"])
def test_codec_edge_rows_and_non_finite_rows_stay_in_their_row(fmt):
    from fbtriton_dist.sharding.comm.wire import WireFormat

    x = torch.tensor([[0.0, 0.0, 0.0], [2.5, 2.5, 2.5], [1.0, float("nan"), 3.0],
                      [1.0, float("inf"), -2.0], [0.5, -0.25, 0.125]]).reshape(-1)
    y = WireFormat(fmt).roundtrip(x, _rows([[(5, (3,))]])).view(5, 3)
    assert torch.equal(y[0], torch.zeros(3))
    if fmt != "fp8":  # a constant row: exact (fp8: 2.5/s = 448 exactly, exact too)
        assert torch.equal(y[1], torch.full((3,), 2.5))
    if fmt in ("fp32", "bf16", "fp16"):
        assert torch.equal(y[4], x.view(5, 3)[4])  # powers of two
    if fmt in ("fp8", "int8"):  # the whole row NaN: loud, and no other row touched
        assert bool(y[2].isnan().all()) and bool(y[3].isnan().all())
    else:  # element by element: the value as it is
        assert bool(y[2, 1].isnan()) and y[2, 0] == 1.0 and bool(y[3, 1].isinf())
    assert bool(y[[0, 1, 4]].isfinite().all())
    if fmt == "fp32":
        g = torch.randn(30, generator=torch.Generator().manual_seed(0))
        assert torch.equal(WireFormat(fmt).roundtrip(g, _rows([[(10, (3,))]])), g)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_codec_mixed_widths_match_one_width(fmt):
    from fbtriton_dist.sharding.comm.wire import WireFormat

    x = torch.randn(2 * (3 + 5) + 4 * 3, generator=torch.Generator().manual_seed(1))
    mixed = _rows([[(2, (3, 5))], [(4, (3,))]])
    assert mixed.width is None and mixed.rows == [4, 4] and mixed.values == [16, 12]
    y = WireFormat(fmt).roundtrip(x, mixed)
    # the same rows one by one, each its own width
    at, parts = 0, []
    for w in (3, 5, 3, 5, 3, 3, 3, 3):
        parts.append(WireFormat(fmt).roundtrip(x[at : at + w], _rows([[(1, (w,))]])))
        at += w
    assert torch.equal(y, torch.cat(parts))


def test_comm_options_formats_and_errors():
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    from fbtriton_dist.sharding import CommOptions

    def names(**kw):
        return tuple(f.name for f in CommOptions(**kw).wire)

    assert names() == ("fp32", "fp32")
    assert names(wire_dtype=torch.bfloat16) == ("bf16", "bf16")
    assert names(wire_dtype="int8", backward_wire_dtype="fp8") == ("int8", "fp8")
    assert names(wire_dtype="FP8", backward_wire_dtype=None) == ("fp8", "fp32")
    assert names(wire_dtype=QCommsConfig(forward_precision=CommType.FP8,
                                         backward_precision=CommType.BF16)) == ("fp8", "bf16")
    assert names(wire_dtype=QCommsConfig(forward_precision=CommType.INT8,
                                         backward_precision=CommType.FP8,
                                         fp8_bwd_uses_143=True)) == ("int8", "fp8")
    bad = [
        ({"wire_dtype": "int4"}, "wire_dtype: expected one of [None, fp32, bf16, fp16, fp8, int8]"),
        ({"wire_dtype": torch.int32}, "wire_dtype: expected"),
        ({"backward_wire_dtype": "e5m2"}, "backward_wire_dtype: expected"),
        ({"wire_dtype": QCommsConfig(forward_precision=CommType.MX4)}, "MX4 is not"),
        ({"wire_dtype": QCommsConfig(backward_precision=CommType.FP8)}, "fp8_bwd_uses_143"),
        ({"wire_dtype": QCommsConfig(forward_loss_scale=2.0)}, "forward_loss_scale"),
        ({"wire_dtype": QCommsConfig(), "backward_wire_dtype": "fp8"}, "sets both directions"),
    ]
    for kw, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            CommOptions(**kw)


# ---- on gloo ------------------------------------------------------------------------------

TWO_HOPS = {"f_twrw", "f_grid", "twrw", "grid"}  # summed inside the host, then sent


def _column_info(configs):
    """Per output column: its feature index and hops."""
    feat, hops = [], []
    for c in configs:
        for f in c.feature_names:
            feat += [len(set(feat))] * c.embedding_dim
            hops += [2 if f in TWO_HOPS else 1] * c.embedding_dim
    return torch.tensor(feat), torch.tensor(hops, dtype=torch.float32)


def _row_max(T, feat):
    """Per element, the max of its sample's row over its feature's columns."""
    out = torch.empty_like(T)
    for f in feat.unique():
        cols = feat == f
        out[:, cols] = T[:, cols].amax(1, keepdim=True)
    return out


def _fwd_bound(fmt, T, M, hops, R):
    """sum over parts of one hop's bound, per hop: ``T`` sum|terms|, ``M`` its row max."""
    if fmt == "fp8":
        return hops * (1 + 2.0**-4) * (2.0**-4 * T + R * 2.0**-10 * M / 448)
    return hops * 1.01 * R * M / 255  # (max - min)/510 <= 2M/510 per part


def _bwd_bound(fmt, Gabs, Gmax, hops):
    """Weight change: sum over uses of the gradient element's bound (``Gabs``: sum|coef·g|,
    ``Gmax``: sum |coef|·max|g|)."""
    if fmt == "fp8":
        return hops * (1 + 2.0**-4) * (2.0**-4 * Gabs + 2.0**-10 * Gmax / 448)
    return hops * 1.01 * Gmax / 255


def _ebc_wire(rank, world, formats):
    import fbtriton_dist

    dev, sizes = device(), BATCH[:world]
    lo, weighted, opt = sum(sizes[:rank]), True, "sgd"
    configs = _configs(weighted)
    feat, hops = _column_info(configs)
    ref = _reference(configs, weighted, opt, dev)
    abs_ref = fbtriton_dist.EmbeddingBagCollection(tables=configs, is_weighted=weighted,
                                                   device=dev)
    abs_ref.load_state_dict({k: v.abs() for k, v in ref.state_dict().items()})
    exact = _shard(ref, "mixed", world, opt)
    fp32 = _shard(ref, "mixed", world, opt, wire_dtype="fp32")
    quantized = {f: _shard(ref, "mixed", world, opt, wire_dtype=f[0], backward_wire_dtype=f[1])
                 for f in formats}  # before the reference's fused step changes its weights
    batch = _global_batch(configs, sum(sizes), 0, weighted)
    kjt = _kjt(*batch, 0, sum(sizes)).to(dev)
    C = torch.randn(sum(sizes), len(feat), generator=torch.Generator().manual_seed(3)).to(dev)
    Cmax = float(C.abs().max())
    want = ref(kjt).values()
    ((want * C).sum() / world).backward()
    mine = slice(lo, lo + sizes[rank])
    with torch.no_grad():
        T = abs_ref(kjt).values()
    M = _row_max(T, feat)
    abs_ref.requires_grad_(True)
    weights = [abs_ref.embedding_bags[c.name].weight for c in configs]
    Gabs = torch.autograd.grad((abs_ref(kjt).values() * C.abs()).sum() / world, weights)
    Gmax = torch.autograd.grad(abs_ref(kjt).values().sum() * Cmax / world, weights)
    local = _kjt(*batch, lo, lo + sizes[rank]).to(dev)
    a, b = exact(local).values(), fp32(local).values()
    result = {"fp32_identical": torch.equal(a, b)}
    lr = _optimizer(opt)[1]["lr"]
    for fwd, bwd in formats:
        sharded = quantized[(fwd, bwd)]
        got = sharded(local).values()
        (got * C[mine]).sum().backward()
        err = (got - want[mine]).abs()
        over = err - _fwd_bound(fwd, T[mine], M[mine], hops, world) - 1e-6
        full = sharded.gather_full_state_dict()
        over_w, err_w = -1.0, 0.0
        for c, ga, gm in zip(configs, Gabs, Gmax, strict=True):
            d = (full[f"embedding_bags.{c.name}.weight"] - ref.embedding_bags[c.name].weight)
            h = 2 if c.name in TWO_HOPS else 1
            over_w = max(over_w, float((d.abs() - lr * _bwd_bound(bwd, ga, gm, h)).max()) - 1e-6)
            err_w = max(err_w, float(d.abs().max()))
        result[(fwd, bwd)] = (float(over.max()), float(err.max()), over_w, err_w)
    return result


EBC_FORMATS = {2: [("fp8", "fp8"), ("int8", "int8")], 3: [("fp8", "int8")]}  # per world
EC_FORMAT = {2: "fp8", 3: "int8"}  # the sequence dist's wire per world
REPORT_KINDS = ["table_wise", "row_wise", "column_wise"]  # the comm report's plans, 2 ranks


def _check_ebc_every_sharding_type_within_the_bound_per_hop(results, formats):
    for rank, res in enumerate(results):
        assert res["fp32_identical"], f"rank {rank}: wire_dtype='fp32' changed the result"
        for fmt in formats:
            over, err, over_w, err_w = res[fmt]
            where = f"rank {rank} {fmt}"
            assert over <= 0, f"{where}: forward over the bound by {over}"
            assert over_w <= 0, f"{where}: weight change over the bound by {over_w}"
            assert err > 1e-4 or BATCH[rank] == 0, f"{where}: the wire format had no effect"
            assert err_w > 1e-5, f"{where}: the gradient's wire format had no effect"


def _ec_wire(rank, world, fmt):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    import fbtriton_dist
    from fbtriton_dist.sharding import CommOptions
    from tests.sharding.test_sharded_ec import _configs as ec_configs
    from tests.sharding.test_sharded_ec import _feature_batch, _plan_for

    configs, dev, sizes = ec_configs(), device(), BATCH[:world]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    torch.manual_seed(0)
    ref = fbtriton_dist.EmbeddingCollection(tables=configs, device=dev)
    cls, kwargs = _optimizer("sgd")
    names = ref._embedding_names
    out = {}
    for wire in ("fp32", fmt):
        m = copy.deepcopy(ref)
        apply_optimizer_in_backward(cls, m.parameters(), kwargs)
        m = fbtriton_dist.shard(m, _plan_for("mixed", world, False), device=dev,
                                comm=CommOptions(wire_dtype=wire))
        batch = _feature_batch(configs, sum(sizes), 0)
        rows = m(_kjt(*batch, lo, hi).to(dev))
        g = torch.Generator().manual_seed(rank)
        Cs = {n: torch.randn(rows[n].values().shape, generator=g).to(dev) for n in names}
        sum((rows[n].values() * Cs[n]).sum() for n in names).backward()
        out[wire] = ({n: rows[n].values().detach() for n in names}, m.gather_full_state_dict(),
                     max(float(c.abs().max()) for c in Cs.values() if c.numel()))
    (exact, w_exact, cmax), (got, w_got, _) = out["fp32"], out[fmt]
    over, err = -1.0, 0.0
    for n in names:
        x, y = exact[n], got[n]
        if not x.numel():
            continue
        amax = x.abs().amax(1, keepdim=True)
        if fmt == "fp8":
            bound = 2.0**-4 * x.abs() + 2.0**-10 * amax / 448
        else:
            bound = (2 * amax / 510).expand_as(x)
        over = max(over, float(((y - x).abs() - bound * (1 + EPS)).max()))
        err = max(err, float((y - x).abs().max()))
    # weight change: each id's gradient row once per use; SGD, lr 0.3, R divides
    lr = _optimizer("sgd")[1]["lr"]
    w_err = max(float((w_got[k] - w_exact[k]).abs().max()) for k in w_exact)
    ids = _feature_batch(configs, sum(sizes), 0)[2]
    uses = sum(int(v.bincount().max()) for v in ids.values() if v.numel())
    per_use = (2.0**-4 + 2.0**-10 / 448) * cmax if fmt == "fp8" else 2 * cmax / 510
    w_bound = lr * uses * per_use * 1.01  # every rank's gradients of one row: at most `uses`
    return over, err, w_err, w_bound


def _check_ec_sequence_dist_within_the_bound(results):
    for rank, (over, err, w_err, w_bound) in enumerate(results):
        assert over <= 0, f"rank {rank}: rows over the bound by {over}"
        assert err > 0, f"rank {rank}: the wire format had no effect"
        assert 0 < w_err <= w_bound, f"rank {rank}: weight change error {w_err} vs {w_bound}"


def _report(rank, world, kind, fwd, bwd):
    import fbtriton_dist
    from fbtriton_dist.sharding import CommOptions

    configs = _configs(False)
    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs, device=device())
    from tests.sharding.test_sharded_ebc import _plan

    plan = _plan(kind, world)
    sharded = fbtriton_dist.shard(ebc, plan, optimizer=fbtriton_dist.optim.SGD(),
                                  comm=CommOptions(wire_dtype=fwd, backward_wire_dtype=bwd))
    B = 4
    feats, lengths, values, _ = _global_batch(configs, B * world, 0, False)
    out = sharded(_kjt(feats, lengths, values, None, rank * B, rank * B + B).to(device()))
    out.values().sum().backward()
    return sharded.comm_report()


def _check_comm_report_counts_values_and_row_scales(reports, kind):
    """2 ranks, B = 4 each, fp8 forward (1 byte + a 4-byte scale per row), int8 backward
    (1 byte + 8 bytes per row). A row: one sample's columns of one shard-feature."""
    B = 4
    configs = _configs(False)
    dims = [c.embedding_dim for c in configs for _ in c.feature_names]  # 4,3,3,6,5,4,2
    for rank, rep in enumerate(reports):
        if kind == "table_wise":  # every table on rank 1: rank 0 gets all its rows from it
            rows, values = (len(dims), sum(dims)) if rank == 0 else (0, 0)
        elif kind == "row_wise":  # each rank gets the other's partial of every feature
            rows, values = len(dims), sum(dims)
        else:  # column-wise: half of every table on each rank
            rows, values = len(dims), sum(d - d // 2 if rank == 0 else d // 2 for d in dims)
        fwd = B * (values * 1 + rows * 4)
        bwd = B * (values * 1 + rows * 8)
        assert rep["output_dist.forward"]["received"] == fwd, (rank, rep)
        assert rep["output_dist.backward"]["sent"] == bwd, (rank, rep)
        assert rep["output_dist.total"]["received"] == rep["output_dist.total"]["planner_estimate"]
    for key in ("output_dist.forward", "output_dist.backward"):
        assert sum(r[key]["sent"] for r in reports) == sum(r[key]["received"] for r in reports)


def _vbe_wire(rank, world, fmt):
    import fbtriton_dist
    from fbtriton_dist.sharding import CommOptions
    from tests.sharding.test_sharded_ebc import _plan
    from tests.sharding.test_sharded_vbe import _bags, _local_kjt

    configs = _configs(False)
    torch.manual_seed(0)
    ebc = fbtriton_dist.EmbeddingBagCollection(tables=configs, device=device())
    out, reports = {}, {}
    for wire in ("fp32", fmt):
        m = fbtriton_dist.shard(copy.deepcopy(ebc), _plan("mixed", world),
                                optimizer=fbtriton_dist.optim.SGD(),
                                comm=CommOptions(wire_dtype=wire))
        got = m(_local_kjt(configs, _bags(configs, world, 0, False), rank).to(device()))
        got.values().sum().backward()
        out[wire], reports[wire] = got.values().detach(), m.comm_report()
    err = float((out[fmt] - out["fp32"]).abs().max()) if out[fmt].numel() else 0.0
    return err, float(out["fp32"].abs().max()) if out[fmt].numel() else 0.0, reports


def _check_vbe_step_with_an_8bit_wire(results, world):
    """A VBE step (each feature its own rows on the wire), mixed plan, 3 ranks, one with no
    samples: int8 close to fp32 (a sanity check: the bound per element is checked above), and
    the bytes every rank sends are the bytes the others receive, scales included."""
    errs = [e for e, _, _ in results]
    assert max(errs) > 0
    for e, scale, _ in results:
        assert e <= 0.02 * max(scale, 1e-6) * 2 * world
    for key in ("output_dist.forward", "output_dist.backward", "output_dist.host_reduce_scatter"):
        sent = sum(r["int8"][key]["sent"] for _, _, r in results)
        assert sent == sum(r["int8"][key]["received"] for _, _, r in results)
        assert sent < sum(r["fp32"][key]["sent"] for _, _, r in results) or sent == 0


# -- one start-up of the ranks per world size for the checks above ------------------------------
def _on_world(rank, world):
    out = [_ebc_wire(rank, world, EBC_FORMATS[world]), _ec_wire(rank, world, EC_FORMAT[world])]
    if world == 2:
        out.append([_report(rank, world, kind, "fp8", "int8") for kind in REPORT_KINDS])
    else:
        out.append(_vbe_wire(rank, world, "int8"))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_wire_formats_on_one_start_up_of_the_ranks(world):
    """Every sharding type's pooled values and gradients within the bound per hop, the sequence
    dist's rows within theirs; on 2 ranks the comm report's values and row scales of each of
    REPORT_KINDS, on 3 a VBE step with an 8-bit wire."""
    ebc, ec, last = zip(*run_ranks(_on_world, world), strict=True)
    _check_ebc_every_sharding_type_within_the_bound_per_hop(ebc, EBC_FORMATS[world])
    _check_ec_sequence_dist_within_the_bound(ec)
    if world == 2:
        for i, kind in enumerate(REPORT_KINDS):
            _check_comm_report_counts_values_and_row_scales([r[i] for r in last], kind)
    else:
        _check_vbe_step_with_an_8bit_wire(last, world)
