"""Input-dist bucketize: cut every bag's ids by shard-feature (row range), rebased.

Two launches over a grid of (feature, BAGS samples): each tile of ids is read once and cut by
every shard-feature of its feature (a row-wise table has R of them); count the ids of each
bag inside each shard's row range; after an exclusive cumsum of those lengths (torch), copy
them, compacted and rebased, to their place. Output order is what the all-to-all sends: shard-feature-major (the
shard-features are listed destination rank by destination rank), then sample, then the ids'
original order.
"""

import torch
import triton
import triton.language as tl

from fbtriton_dist import knobs


@triton.jit
def _tile_of(by_feature_ptr, offsets_ptr, B, N, BAGS: tl.constexpr, K: tl.constexpr):
    """(shard-features s [K] of this program's feature (-1: none), their mask, samples b
    [BAGS], their mask, bag starts and ends clamped to [0, N], malformed bags: ending past
    the N ids, before they start, or starting below 0)."""
    per_f = tl.cdiv(B, BAGS)
    pid = tl.program_id(0).to(tl.int64)
    g = pid // per_f
    b = (pid - g * per_f) * BAGS + tl.arange(0, BAGS)
    bm = b < B
    row = by_feature_ptr + g * (K + 1)
    f = tl.load(row)
    s = tl.load(row + 1 + tl.arange(0, K))
    sm = s >= 0
    start = tl.load(offsets_ptr + f * B + b, mask=bm, other=0).to(tl.int64)
    end = tl.load(offsets_ptr + f * B + b + 1, mask=bm, other=0).to(tl.int64)
    bad_bag = bm & ((end > N) | (end < start) | (start < 0))
    start = tl.minimum(tl.maximum(start, 0), N)
    end = tl.minimum(end, N)
    return s, sm, b, bm, start, end, bad_bag


@triton.jit(do_not_specialize=["B", "N"])
def _bucketize_count_kernel(
    indices_ptr,  # [N] ids, feature-major bags
    offsets_ptr,  # [F * B + 1] bag boundaries
    by_feature_ptr,  # [G, 1 + K] a feature, then its shard-features (-1 after the last)
    sf_lo_ptr,  # [S] first row of each shard
    sf_hi_ptr,  # [S] one past its last row
    lengths_ptr,  # [S * B] out: ids of bag (feature(s), b) in the shard
    cover_ptr,  # [G] (CHECK) shard-features each valid id of row g's feature lands in
    fail_ptr,  # [1] int64 (CHECK, zeroed): programs that found a bad id or a malformed bag
    B,  # local batch size
    N,  # ids (values) given; bags are clamped to them
    CHECK: tl.constexpr,
    K: tl.constexpr,  # shard-features per row of by_feature (a power of two)
    BAGS: tl.constexpr,  # bags (samples) per program
    BLOCK: tl.constexpr,  # ids of each bag read per step
):
    # one program per (feature, BAGS samples): each [BAGS, BLOCK] tile of ids is read once
    # and cut by every shard-feature of the feature ([K, BAGS, BLOCK])
    s, sm, b, bm, start, end, bad_bag = _tile_of(by_feature_ptr, offsets_ptr, B, N, BAGS, K)
    lo = tl.load(sf_lo_ptr + s, mask=sm, other=0)[:, None, None]
    hi = tl.load(sf_hi_ptr + s, mask=sm, other=0)[:, None, None]
    count = tl.zeros([K, BAGS], dtype=tl.int32)
    for l0 in range(0, tl.max(end - start, axis=0), BLOCK):
        p = start[:, None] + l0 + tl.arange(0, BLOCK)[None, :]
        m = bm[:, None] & (p < end[:, None])
        ids = tl.load(indices_ptr + p, mask=m, other=-1).to(tl.int64)[None, :, :]
        hit = ((ids >= lo) & (ids < hi) & m[None, :, :]).to(tl.int32)
        count += tl.sum(hit, axis=2)
    tl.store(lengths_ptr + s[:, None] * B + b[None, :], count.to(tl.int64),
             mask=sm[:, None] & bm[None, :])
    if CHECK:
        # a valid id lands in exactly `cover` of its feature's shard-features and an id out
        # of the table's rows in none (the shards' ranges lie inside them): every id of a
        # bag is valid iff the bag's counts add up to cover x its length. Checked once per
        # bag, after the loop (a check per id and step cost the kernel half its time).
        cover = tl.load(cover_ptr + tl.program_id(0) // tl.cdiv(B, BAGS))
        short = bm & (tl.sum(count, axis=0) != cover * (end - start))
        if tl.max((bad_bag | short).to(tl.int32), axis=0) > 0:
            tl.atomic_add(fail_ptr, 1)


@triton.jit(do_not_specialize=["B", "N", "R", "cap"])
def _bucketize_scatter_kernel(
    indices_ptr,  # [N] ids, feature-major bags
    offsets_ptr,  # [F * B + 1] bag boundaries
    psw_ptr,  # [N] per-sample weights (if HAS_PSW)
    by_feature_ptr,  # [G, 1 + K] a feature, then its shard-features (-1 after the last)
    sf_lo_ptr,  # [S] first row of each shard
    sf_hi_ptr,  # [S] one past its last row
    ends_ptr,  # [S * B] inclusive scan of the lengths: (s, b)'s ids end here
    lengths_ptr,  # [S * B] the count kernel's lengths
    out_ids_ptr,  # [M] out: rebased ids
    out_psw_ptr,  # [M] out: their weights (if HAS_PSW)
    out_lengths_ptr,  # [*] out: int32 bag lengths (SLOTTED)
    sf_first_ptr,  # [S] (SLOTTED) index in the lengths of the first bag of s's destination
    sf_id_start_ptr,  # [S] (SLOTTED) where s's destination's ids start in out_ids
    sf_w_start_ptr,  # [S] (SLOTTED) where they start in out_psw
    sf_len_start_ptr,  # [S] (SLOTTED) where s's B lengths go in out_lengths
    fail_ptr,  # [1] int64 (CHECK) the count kernel's failures
    meta_ptr,  # int64 view of the send buffer (CHECK)
    meta_at_ptr,  # [R] (CHECK) where each destination's failure flag goes in meta_ptr
    B,  # local batch size
    N,  # ids given
    R,  # destinations (CHECK)
    cap,  # id slots of the output (of each destination's, SLOTTED): ids past it are dropped
    HAS_PSW: tl.constexpr,
    SLOTTED: tl.constexpr,  # every destination's ids (and lengths) at their own place
    CHECK: tl.constexpr,  # program 0 writes the failure flag (0/1) into every message
    R_POW2: tl.constexpr,
    K: tl.constexpr,
    BAGS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # the count kernel's programs; each kept id goes to its bag's next output slot
    s, sm, b, bm, start, end, _ = _tile_of(by_feature_ptr, offsets_ptr, B, N, BAGS, K)
    lo = tl.load(sf_lo_ptr + s, mask=sm, other=0)[:, None]
    hi = tl.load(sf_hi_ptr + s, mask=sm, other=0)[:, None]
    sb = sm[:, None] & bm[None, :]  # [K, BAGS]
    at = s[:, None] * B + b[None, :]
    out = (tl.load(ends_ptr + at, mask=sb, other=0)
           - tl.load(lengths_ptr + at, mask=sb, other=0))
    w_out = out
    rel = out  # where in its output (its destination's, SLOTTED) the bag's ids begin
    if SLOTTED:  # out -= where the destination's ids begin, += its place in the buffers
        q0 = tl.load(sf_first_ptr + s, mask=sm, other=0)
        first = (tl.load(ends_ptr + q0, mask=sm, other=0)
                 - tl.load(lengths_ptr + q0, mask=sm, other=0))
        rel = out - first[:, None]
        w_out = out + (tl.load(sf_w_start_ptr + s, mask=sm, other=0) - first)[:, None]
        out = out + (tl.load(sf_id_start_ptr + s, mask=sm, other=0) - first)[:, None]
    # id slots left in the output after each bag's start (int32: compared per id below)
    room = tl.minimum(tl.maximum(cap - rel, 0), 2**30).to(tl.int32)[:, :, None]
    n = tl.zeros([K, BAGS], dtype=tl.int32)
    for l0 in range(0, tl.max(end - start, axis=0), BLOCK):
        p = start[:, None] + l0 + tl.arange(0, BLOCK)[None, :]
        m = bm[:, None] & (p < end[:, None])
        ids = tl.load(indices_ptr + p, mask=m, other=-1).to(tl.int64)
        keep = (ids[None, :, :] >= lo[:, :, None]) & (ids[None, :, :] < hi[:, :, None]) & (
            m[None, :, :] & sm[:, None, None])
        rank = n[:, :, None] + tl.cumsum(keep.to(tl.int32), axis=2) - 1
        # malformed lengths (a negative one makes bags overlap) can count more ids than the
        # output holds: they are dropped (the count kernel flags the batch), never written
        # past it (into the next message's meta and lengths, or past the buffer)
        fits = keep & (rank < room)
        rank = rank.to(tl.int64)
        tl.store(out_ids_ptr + out[:, :, None] + rank,
                 (ids[None, :, :] - lo[:, :, None]).to(out_ids_ptr.dtype.element_ty),
                 mask=fits)
        if HAS_PSW:
            w = tl.load(psw_ptr + p, mask=m, other=0.0)
            tl.store(out_psw_ptr + w_out[:, :, None] + rank,
                     w[None, :, :] + tl.zeros([K, 1, 1], dtype=w.dtype), mask=fits)
        n += tl.sum(keep.to(tl.int32), axis=2)
    if SLOTTED:
        tl.store(out_lengths_ptr + tl.load(sf_len_start_ptr + s, mask=sm, other=0)[:, None]
                 + b[None, :], n, mask=sb)
    if CHECK:  # the count kernel has finished: its failures are all in
        if tl.program_id(0) == 0:
            q = tl.arange(0, R_POW2)
            flag = (tl.load(fail_ptr + q * 0) > 0).to(tl.int64)
            tl.store(meta_ptr + tl.load(meta_at_ptr + q, mask=q < R, other=0), flag,
                     mask=q < R)


MAX_K = 8  # shard-features cut from one tile: a [K, 32, 32] mask per program


def by_feature(sf_feature: list[int]) -> torch.Tensor:
    """``[G, 1 + K]`` int64: each feature that has shard-features, then up to ``MAX_K`` of
    them (-1 after the last; K a power of two); a feature with more (a data-parallel table on
    many ranks) takes several rows. The Triton bucketize's grid walks it: one tile of ids per
    row, cut for all its shards (a row-wise table has R). Built on the host."""
    per: dict[int, list[int]] = {}
    for s, f in enumerate(sf_feature):
        per.setdefault(int(f), []).append(s)
    chunks = [(f, v[i : i + MAX_K]) for f, v in sorted(per.items())
              for i in range(0, len(v), MAX_K)]
    K = 1 << (max((len(v) for _, v in chunks), default=1) - 1).bit_length()
    rows = [[f, *v, *[-1] * (K - len(v))] for f, v in chunks]
    return torch.tensor(rows, dtype=torch.int64).view(-1, 1 + K)


def _launch(indices, offsets, psw, sf_feature, lo, hi, B, lengths, outputs, slotted, table,
            check=None, cap=None):
    """Count into ``lengths`` (every entry written), scan them, then scatter into
    ``outputs`` (the scatter kernel's output arguments, or a function of the lengths that
    returns them). ``check`` = (cover [G] per row of
    ``table``, meta [*] int64, meta_at [R]): the count kernel checks every id and bag, and the
    scatter kernel writes the failure flag at ``meta[meta_at]``."""
    if table is None:  # the grid comes from the host (a sync)
        table = by_feature(sf_feature.tolist())
    table = table.to(indices.device)
    K = table.shape[1] - 1
    BAGS, BLOCK, warps = launch_config()
    grid = (table.shape[0] * triton.cdiv(B, BAGS),)
    N = indices.numel()
    fail = torch.zeros(1, dtype=torch.int64, device=indices.device) if check else lengths
    cover, meta, meta_at = check if check else (lengths, lengths, lengths)
    _bucketize_count_kernel[grid](indices, offsets, table, lo, hi, lengths, cover, fail, B, N,
                                  CHECK=check is not None, K=K, BAGS=BAGS, BLOCK=BLOCK,
                                  num_warps=warps)
    ends = torch.cumsum(lengths, 0)
    R = meta_at.numel() if check else 1
    if callable(outputs):
        outputs = outputs(lengths)
    if cap is None:
        cap = outputs[0].numel()  # the ids output (bucketize_into: the caller's capacity)
    _bucketize_scatter_kernel[grid](
        indices, offsets, psw if psw is not None else indices, table, lo, hi, ends, lengths,
        *outputs, fail, meta, meta_at, B, N, R, cap, HAS_PSW=psw is not None, SLOTTED=slotted,
        CHECK=check is not None, R_POW2=triton.next_power_of_2(R), K=K, BAGS=BAGS,
        BLOCK=BLOCK, num_warps=warps,
    )


def launch_config() -> tuple[int, int, int]:
    """(BAGS, BLOCK, num_warps): 8 bags of up to 16 ids per step, one warp. Measured on an
    H200 (the `bench dist` batch: 26 features, B=8192, L=20, Zipf ids; count + scatter µs):
    one rank 61 (32 bags x 32 ids x 4 warps, the old default: 114), two row-wise shards per
    feature 73 (109). Bigger tiles took 108-168 registers per thread, so few programs fit on
    an SM. ``FBTD_BUCKETIZE=bags,block,warps`` overrides it (powers of two)."""
    fields = knobs.bucketize_config()
    if fields is None:
        return 8, 16, 1
    return fields[0], fields[1], fields[2]


def bucketize(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    sf_feature: torch.Tensor,
    sf_row_start: torch.Tensor,
    sf_row_end: torch.Tensor,
    B: int,
    capacity: int | None = None,
    table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract as reference.bucketize.bucketize: (lengths [S*B], ids, weights). With
    ``capacity`` (>= the ids that can come out, e.g. N times the shards an id can land in)
    the outputs have that length and no host sync is needed to size them; ``table``
    (``by_feature(sf_feature)``, on the device) saves the host read of ``sf_feature``."""
    S = sf_feature.numel()
    device = indices.device
    psw = per_sample_weights
    if S * B == 0:
        lengths = torch.zeros(S * B, dtype=torch.int64, device=device)
        empty = torch.zeros(capacity or 0, dtype=torch.int64, device=device)
        return lengths, empty, psw.new_zeros(capacity or 0) if psw is not None else None
    lengths = torch.empty(S * B, dtype=torch.int64, device=device)
    out = []

    def outputs(lengths):  # after the count: without a capacity, sized by it (a host read)
        M = int(lengths.sum()) if capacity is None else capacity
        ids = torch.empty(M, dtype=torch.int64, device=device)
        w = psw.new_empty(M) if psw is not None else None
        out.extend([ids, w])
        return [ids, w if w is not None else ids, *[lengths] * 5]

    _launch(indices, offsets, psw, sf_feature, sf_row_start, sf_row_end, B, lengths, outputs,
            False, table)
    return lengths, out[0], out[1]


def bucketize_into(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    sf_feature: torch.Tensor,
    sf_row_start: torch.Tensor,
    sf_row_end: torch.Tensor,
    B: int,
    out_ids: torch.Tensor,
    out_weights: torch.Tensor | None,
    out_lengths: torch.Tensor,
    sf_first: torch.Tensor,
    sf_id_start: torch.Tensor,
    sf_w_start: torch.Tensor,
    sf_len_start: torch.Tensor,
    table: torch.Tensor | None = None,
    check: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.bucketize.bucketize_into: the ids written straight into
    their destination's place of a send buffer. Returns lengths [S*B] int64. Bags past the
    ids are clamped to them. ``check`` = (cover, meta, meta_at): ``cover`` [G] int64, for
    each row of ``table``, how many of its shard-features a valid id of its feature lands
    in (every feature in one row); then an id that lands in another number (out of its
    table's range) or a malformed bag (ending past the ids or before it starts) sets the
    flag, written as 0/1 at ``meta[meta_at]`` (int64; one per destination message).
    ``capacity``: id slots of each destination (default: all of ``out_ids``); ids past it
    (only malformed lengths can count that many) are not written."""
    S = sf_feature.numel()
    if S * B == 0:
        if check is not None:
            check[1].index_fill_(0, check[2], 0)  # nothing to find wrong
        return torch.zeros(S * B, dtype=torch.int64, device=indices.device)
    lengths = torch.empty(S * B, dtype=torch.int64, device=indices.device)
    psw = per_sample_weights
    _launch(indices, offsets, psw, sf_feature, sf_row_start, sf_row_end, B, lengths,
            [out_ids, out_weights if psw is not None else out_ids, out_lengths, sf_first,
             sf_id_start, sf_w_start, sf_len_start], True, table, check,
            capacity if capacity is not None else out_ids.numel())
    return lengths


@triton.jit
def _segment_copy_kernel(
    src_ptr,  # ids of every source: source r's segments start at src_base[r]
    src_w_ptr,  # their weights (HAS_W)
    src_base_ptr,  # [R] where source r's ids start in src
    src_w_base_ptr,  # [R] where its weights start in src_w
    ends_ptr,  # [R, n] inclusive cumsum of the segment lengths within each source
    dst_start_ptr,  # [R, n] where segment (r, i) goes in out
    out_ptr,  # out: ids
    out_w_ptr,  # out: weights (HAS_W)
    n,  # segments per source
    HAS_W: tl.constexpr,
    STEPS: tl.constexpr,  # binary-search steps: 2**STEPS > n
    BLOCK: tl.constexpr,
):
    r = tl.program_id(1).to(tl.int64)  # sources on axis 1 (at most 65,535), blocks on axis 0
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = ends_ptr + r * n
    total = tl.load(row + n - 1)
    m = p < total
    # segment of position p: the first i with ends[i] > p
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + n
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        e = tl.load(row + mid, mask=m & active, other=0)
        lo = tl.where(active & (e <= p), mid + 1, lo)
        hi = tl.where(active & (e > p), mid, hi)
    i = tl.minimum(lo, n - 1)
    seg_start = tl.load(row + i - 1, mask=m & (i > 0), other=0)
    dst = tl.load(dst_start_ptr + r * n + i, mask=m, other=0) + p - seg_start
    x = tl.load(src_ptr + tl.load(src_base_ptr + r) + p, mask=m)
    tl.store(out_ptr + dst, x.to(out_ptr.dtype.element_ty), mask=m)
    if HAS_W:
        w = tl.load(src_w_ptr + tl.load(src_w_base_ptr + r) + p, mask=m)
        tl.store(out_w_ptr + dst, w, mask=m)


def segment_copy(
    src: torch.Tensor,
    src_w: torch.Tensor | None,
    src_base: torch.Tensor,
    src_w_base: torch.Tensor,
    ends: torch.Tensor,
    dst_start: torch.Tensor,
    out: torch.Tensor,
    out_w: torch.Tensor | None,
    capacity: int,
) -> None:
    """Same contract as reference.bucketize.segment_copy (no host sync)."""
    R, n = ends.shape
    if R == 0 or n == 0 or capacity == 0:
        return
    BLOCK = 1024
    steps = max(1, int(n).bit_length())
    _segment_copy_kernel[(triton.cdiv(capacity, BLOCK), R)](
        src,
        src_w if src_w is not None else src,
        src_base,
        src_w_base,
        ends,
        dst_start,
        out,
        out_w if out_w is not None else out,
        n,
        HAS_W=src_w is not None,
        STEPS=steps,
        BLOCK=BLOCK,
        num_warps=4,
    )


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _segment_plan_kernel(
    counts_ptr,  # [R, n] int64 ids of segment i from source r
    group_first_ptr,  # [n] int64 first segment of i's group
    group_base_ptr,  # [n] int64 where i's group starts in the output
    ends_ptr,  # [R, n] int64 out: inclusive cumsum of each source's counts
    dst_ptr,  # [R, n] int64 out: where segment (r, i) goes
    R,
    n,
    RP: tl.constexpr,  # powers of two >= R, n
    NP: tl.constexpr,
):
    # one program: the whole [R, n] table in registers
    r = tl.arange(0, RP)[:, None]
    i = tl.arange(0, NP)[None, :]
    m = (r < R) & (i < n)
    c = tl.load(counts_ptr + r * n + i, mask=m, other=0)
    tl.store(ends_ptr + r * n + i, tl.cumsum(c, axis=1), mask=m)
    col = tl.sum(c, axis=0)  # [NP] ids of segment i from every source
    before_i = tl.cumsum(col, axis=0) - col  # every segment before i, all sources
    start = before_i[None, :] + tl.cumsum(c, axis=0) - c  # then sources before r
    iv = tl.arange(0, NP)
    first = tl.load(group_first_ptr + iv, mask=iv < n, other=-1)
    # the group's own start: before_i at its first segment, carried forward (non-decreasing)
    group_start = tl.associative_scan(tl.where(first == iv, before_i, 0), 0, _max_combine)
    base = tl.load(group_base_ptr + iv, mask=iv < n, other=0)
    tl.store(dst_ptr + r * n + i, start + (base - group_start)[None, :], mask=m)


PLAN_MAX = 16384  # cells of segment_plan's [R, n] table (padded) that one program holds


def plan_fits(R: int, n: int) -> bool:
    """Whether ``segment_plan`` takes a [R, n] table (else the reference's torch ops do)."""
    return triton.next_power_of_2(max(R, 1)) * triton.next_power_of_2(max(n, 1)) <= PLAN_MAX


def segment_plan(
    counts: torch.Tensor, group_first: torch.Tensor, group_base: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as reference.bucketize.segment_plan, in one launch (no host sync), for
    tables that ``plan_fits``."""
    R, n = counts.shape
    if not plan_fits(R, n):
        raise ValueError(f"segment_plan: a [{R}, {n}] table is more than one program holds "
                         f"({PLAN_MAX} cells once padded to powers of two)")
    RP, NP = triton.next_power_of_2(max(R, 1)), triton.next_power_of_2(max(n, 1))
    ends = torch.empty_like(counts)
    dst = torch.empty_like(counts)
    if R * n == 0:
        return ends, dst
    _segment_plan_kernel[(1,)](counts, group_first, group_base, ends, dst, R, n, RP=RP, NP=NP,
                               num_warps=4)
    return ends, dst

