"""The one bridge to TorchRec's sparse types: KeyedJaggedTensor in, KeyedTensor out.

Everything else in the package speaks FBGEMM's TBE batch: ``indices`` [N], ``offsets``
[T*B+1] feature-major, ``per_sample_weights`` [N] or None.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torchrec.modules.embedding_configs import (  # noqa: F401  (re-exported: the modules'
    EmbeddingBagConfig,  # constructors are annotated as TorchRec's stable interface)
    EmbeddingConfig,
)
from torchrec.sparse.jagged_tensor import (
    JaggedTensor,  # noqa: F401  (re-exported: the EC's output)
    KeyedJaggedTensor,
    KeyedTensor,
)


@dataclass(frozen=True, eq=False)
class JaggedBatch:
    """T features of B samples each, feature-major, in a given feature order."""

    indices: torch.Tensor
    """[N] ids of all features, feature after feature."""
    offsets: torch.Tensor
    """[T * B + 1] bag boundaries into indices."""
    per_sample_weights: torch.Tensor | None
    """[N] weight of each id, or None."""
    batch_size: int
    """B (with ``batch_sizes``: the samples the output has after expanding by the inverse
    indices)."""
    batch_sizes: tuple[int, ...] | None = None
    """Variable batch per feature (VBE): ``B_t`` bags of each feature, ``offsets`` then has
    ``sum(B_t) + 1`` entries; None for a fixed batch."""


@dataclass(frozen=True, eq=False)
class KJTParts:
    """A KeyedJaggedTensor's tensors in its own key order, checked without a device sync."""

    keys: tuple[str, ...]
    """The KJT's keys, in its order (K of them)."""
    values: torch.Tensor
    """[N] int32/int64 ids, key after key."""
    lengths: torch.Tensor
    """[K * B] bag lengths, key-major."""
    weights: torch.Tensor | None
    """[N] per-sample weights (None unless ``weighted``)."""
    batch_size: int
    """B (VBE: P, the most bags any key the module reads has; the lengths are padded)."""
    strides: tuple[int, ...] | None = None
    """VBE: each key's real number of bags (its first ``strides[k]`` bags of P hold them,
    the rest are empty); None for a fixed batch."""
    inverse: torch.Tensor | None = None
    """VBE: ``[len(feature_names), B]`` int64, the bag of each feature every sample reads
    (the KJT's inverse indices in ``feature_names`` order; bounds not checked yet)."""


def kjt_parts(
    features: KeyedJaggedTensor, feature_names: Sequence[str], weighted: bool
) -> KJTParts:
    """Check ``features`` against ``feature_names`` from host metadata only (keys, stride,
    dtypes, number of lengths) and return its tensors as they are, in its own key order.
    Whether the lengths add up to the values needs the device: callers check it there.

    Keys no table uses are left where they are (ignored, as TorchRec's EBC does). A missing
    or duplicated feature, per-key batch sizes, non-integer ids, a weighted/unweighted
    mismatch or a wrong number of lengths raise ValueError.
    """
    keys = _check_keys(features, feature_names)
    if features.variable_stride_per_key():
        raise ValueError(
            "KeyedJaggedTensor: a batch size per feature (variable stride per key) is taken by "
            "the eager EmbeddingBagCollection (torch.compile looks it up eagerly between its "
            "graphs) and by shard() without fixed shapes, not under FX / export / "
            "fullgraph=True; give every feature the same number of samples there"
        )
    values, weights = _values_and_weights(features, weighted)
    T, B = len(keys), features.stride()
    lengths = features.lengths()
    if lengths.numel() != T * B:
        raise ValueError(
            f"KeyedJaggedTensor lengths: expected {T} features x {B} samples = {T * B} "
            f"lengths, got {lengths.numel()}"
        )
    return KJTParts(
        keys=tuple(keys),
        values=values,
        lengths=lengths,
        weights=weights,
        batch_size=B,
    )


@dataclass(frozen=True, eq=False)
class KJTSequences:
    """A KeyedJaggedTensor as sequences of ids, for unpooled lookups (any batch size per key)."""

    keys: tuple[str, ...]
    values: torch.Tensor
    """[N] int32/int64 ids, key after key."""
    ids_per_key: tuple[int, ...]
    """How many ids each key has (host)."""
    lengths: torch.Tensor
    """The KJT's lengths, key after key."""
    bags_per_key: tuple[int, ...]
    """How many bags (samples) each key has: its stride."""

    def ids(self, key: str) -> tuple[int, int]:
        k = self.keys.index(key)
        a = sum(self.ids_per_key[:k])
        return a, a + self.ids_per_key[k]

    def key_lengths(self, key: str) -> torch.Tensor:
        k = self.keys.index(key)
        a = sum(self.bags_per_key[:k])
        return self.lengths[a : a + self.bags_per_key[k]]


def kjt_sequences(features: KeyedJaggedTensor, feature_names: Sequence[str]) -> KJTSequences:
    """Check ``features`` against ``feature_names`` (every one present, once) and cut it by
    key: one host read of the ids per key. Lengths that do not add up to the values, or a
    number of lengths that is not the strides', raise ValueError naming the key."""
    keys = _check_keys(features, feature_names)
    values, _ = _values_and_weights(features, False)
    strides = [int(s) for s in features.stride_per_key()]
    lengths = features.lengths()
    if lengths.numel() != sum(strides):
        raise ValueError(
            f"KeyedJaggedTensor lengths: expected {sum(strides)} (the keys' strides {strides}), "
            f"got {lengths.numel()}"
        )
    bounds = torch.tensor([0, *accumulate(strides)], device=lengths.device)
    cum = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=cum[1:])
    smallest = lengths.amin().view(1).to(torch.int64) if lengths.numel() else cum[:1]
    *ends, low = torch.cat([cum[bounds], smallest]).tolist()  # one host read
    if low < 0:
        raise negative_length_error(lengths, keys, strides)
    per_key = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    if ends[-1] != values.numel():
        bad = next((k for k, e in zip(keys, ends[1:], strict=True) if e > values.numel()),
                   keys[-1])
        raise ValueError(
            f"KeyedJaggedTensor feature '{bad}': lengths add up to {ends[-1]} ids in all, "
            f"but values holds {values.numel()}"
        )
    return KJTSequences(tuple(keys), values, tuple(per_key), lengths, tuple(strides))


def check_sequence_keys(features: KeyedJaggedTensor, feature_names: Sequence[str]) -> list[str]:
    """The KJT's keys, from host metadata only; raises ValueError for a duplicated key or a
    missing feature, or ids that are not int32/int64 (a traced EmbeddingCollection's check)."""
    keys = _check_keys(features, feature_names)
    if features.values().dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"KeyedJaggedTensor values: expected int32/int64 ids, got {features.values().dtype}"
        )
    return keys


def _check_keys(features: KeyedJaggedTensor, feature_names: Sequence[str]) -> list[str]:
    """The KJT's keys; raises ValueError for a duplicated key or a missing feature."""
    keys = list(features.keys())
    duplicated = sorted({k for k in keys if keys.count(k) > 1})
    if duplicated:
        raise ValueError(
            f"KeyedJaggedTensor keys must be unique: expected each key once, got {duplicated} "
            f"more than once in {keys}"
        )
    missing = [f for f in dict.fromkeys(feature_names) if f not in keys]
    if missing:
        raise ValueError(
            f"KeyedJaggedTensor keys: missing features {missing}; expected (at least) "
            f"{list(dict.fromkeys(feature_names))}, got {keys}"
        )
    return keys


def _values_and_weights(features: KeyedJaggedTensor, weighted: bool):
    """(ids, per-sample weights if ``weighted`` else None), their dtypes and presence checked."""
    values = features.values()
    if values.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"KeyedJaggedTensor values: expected int32/int64 ids, got {values.dtype}")
    weights = features.weights_or_none()
    if weighted and weights is None:
        raise ValueError(
            "KeyedJaggedTensor: the module is weighted but the features have no weights"
        )
    return values, weights if weighted else None


def _vbe_meta(features: KeyedJaggedTensor, feature_names: Sequence[str], weighted: bool):
    """The host checks of a VBE KJT: (keys, strides per key, values, weights, the inverse
    indices in ``feature_names`` order [T, B] int64 or None, B). Strides that do not add up
    to the lengths, inverse indices of the wrong shape or missing a feature, and different
    strides without inverse indices raise ValueError."""
    keys = _check_keys(features, feature_names)
    strides = [int(s) for s in features.stride_per_key()]
    lengths = features.lengths()
    if sum(strides) != lengths.numel():
        raise ValueError(
            f"KeyedJaggedTensor: strides per key {dict(zip(keys, strides, strict=True))} add up "
            f"to {sum(strides)} bags, but lengths holds {lengths.numel()}"
        )
    values, weights = _values_and_weights(features, weighted)
    order = [keys.index(f) for f in feature_names]
    batch_sizes = [strides[k] for k in order]
    inverse = features.inverse_indices_or_none()
    B, rows = (batch_sizes[0] if batch_sizes else 0), None
    if inverse is not None:
        inv_keys, inv = inverse
        if inv.dim() != 2 or inv.shape[0] != len(inv_keys):
            raise ValueError(
                f"KeyedJaggedTensor inverse_indices: expected [{len(inv_keys)} keys, B], got "
                f"{tuple(inv.shape)}"
            )
        lacking = [f for f in dict.fromkeys(feature_names) if f not in inv_keys]
        if lacking:
            raise ValueError(f"KeyedJaggedTensor inverse_indices: no row for features {lacking}")
        pick = torch.tensor([inv_keys.index(f) for f in feature_names], device=inv.device)
        rows = inv.index_select(0, pick).to(torch.int64)
        B = int(inv.shape[1])
    elif len(set(batch_sizes)) > 1:
        raise ValueError(
            "KeyedJaggedTensor: a batch size per feature "
            f"{dict(zip(feature_names, batch_sizes, strict=True))} without inverse_indices "
            "(TorchRec's EBC cannot concatenate such features either); give the KJT "
            "inverse_indices"
        )
    return keys, strides, values, weights, rows, B


def check_inverse_bounds(rows: torch.Tensor, feature_names: Sequence[str],
                         batch_sizes: Sequence[int]) -> None:
    """Every feature's inverse indices inside its bags (one host read of their bounds);
    raises ValueError naming the feature and the bound."""
    if not rows.numel():
        return
    lows, highs = rows.min(1).values.tolist(), rows.max(1).values.tolist()
    for f, n, a, b in zip(feature_names, batch_sizes, lows, highs, strict=True):
        if a < 0 or b >= n:
            raise ValueError(
                f"KeyedJaggedTensor inverse_indices of feature '{f}': rows in [{a}, {b}], "
                f"outside its {n} bags [0, {n})"
            )


def vbe_kjt_to_batch(
    features: KeyedJaggedTensor, feature_names: Sequence[str], weighted: bool
) -> tuple[JaggedBatch, torch.Tensor | None]:
    """A KJT with a batch size per key (VBE: ``stride_per_key``) as a TBE batch in
    ``feature_names`` order (``batch_sizes`` set), and the inverse indices
    (``[len(feature_names), B]`` int64, the row of feature ``i``'s bags each sample reads) or
    None if the KJT has none. Checks as ``kjt_to_batch``, and: strides that do not add up to
    the lengths, inverse indices of the wrong shape, missing a feature or out of a feature's
    range raise ValueError (one host read of their bounds)."""
    keys, strides, values, weights, rows, B = _vbe_meta(features, feature_names, weighted)
    lengths = features.lengths()
    per_key_lengths = list(torch.split(lengths, strides))
    per_key_ids = []
    if keys:  # the per-key id counts and the smallest length in one host read
        smallest = lengths.amin().view(1) if lengths.numel() else lengths.new_zeros(1)
        *per_key_ids, low = torch.cat(
            [torch.stack([seg.sum() for seg in per_key_lengths]), smallest]).tolist()
        if low < 0:
            raise negative_length_error(lengths, keys, strides)
    if sum(per_key_ids) != values.numel():
        raise ValueError(
            f"KeyedJaggedTensor: lengths add up to {sum(per_key_ids)} ids in all, but values "
            f"holds {values.numel()}"
        )
    order = [keys.index(f) for f in feature_names]
    values = permute_segments(values, per_key_ids, order)
    weights = permute_segments(weights, per_key_ids, order) if weights is not None else None
    new_lengths = permute_segments(lengths, strides, order)
    offsets = torch.zeros(new_lengths.numel() + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(new_lengths, 0, out=offsets[1:])
    batch_sizes = tuple(strides[k] for k in order)
    if rows is not None:
        check_inverse_bounds(rows, feature_names, batch_sizes)
    batch = JaggedBatch(
        indices=values, offsets=offsets.to(values.dtype), per_sample_weights=weights,
        batch_size=B, batch_sizes=batch_sizes,
    )
    return batch, rows


def padding_positions(strides: Sequence[int], P: int, device) -> torch.Tensor:
    """[sum(strides)] int64: where bag ``b`` of segment ``k`` (``strides[k]`` bags, back to
    back) lands when every segment is padded to ``P`` bags (``k * P + b``)."""
    n = sum(strides)
    s = torch.tensor(list(strides), dtype=torch.int64, device=device)
    shift = torch.arange(len(strides), dtype=torch.int64, device=device) * P - (
        torch.cumsum(s, 0) - s
    )
    return torch.arange(n, device=device) + torch.repeat_interleave(shift, s, output_size=n)


def vbe_kjt_parts(
    features: KeyedJaggedTensor, feature_names: Sequence[str], weighted: bool
) -> KJTParts:
    """``kjt_parts`` of a KJT with a batch size per key (VBE), host checks only (as
    ``vbe_kjt_to_batch``'s; the inverse indices' bounds are the caller's to check on the
    device). Every key's lengths are padded with empty bags to P, the most bags a key has
    (the values do not move), so the fixed-batch machinery reads it;
    ``strides`` and ``inverse`` say what is real. Equal strides without inverse indices are
    a fixed batch (``strides`` None)."""
    keys, strides, values, weights, rows, _ = _vbe_meta(features, feature_names, weighted)
    lengths = features.lengths()
    P = max(strides, default=0)
    if rows is None:  # equal strides (else _vbe_meta raised), keys no table reads included
        if any(s != P for s in strides):
            raise ValueError(
                f"KeyedJaggedTensor: strides per key {dict(zip(keys, strides, strict=True))} "
                "differ (for keys no table reads) and there are no inverse_indices"
            )
        return KJTParts(keys=tuple(keys), values=values, lengths=lengths, weights=weights,
                        batch_size=P)
    at = padding_positions(strides, P, lengths.device)
    padded = lengths.new_zeros(len(keys) * P).index_copy_(0, at, lengths)
    return KJTParts(keys=tuple(keys), values=values, lengths=padded, weights=weights,
                    batch_size=P, strides=tuple(strides), inverse=rows)


def negative_length_error(lengths: torch.Tensor, keys: Sequence[str],
                          strides: Sequence[int]) -> ValueError:
    """The error for ``lengths`` (a KJT's, key after key, ``strides[k]`` bags per key) that
    hold a negative length: it names the feature, the bag and the length (one host read; call
    it only once a negative length is known to be there)."""
    flat = lengths.reshape(-1)
    first = int((flat < 0).nonzero()[0, 0])
    start = 0
    for key, stride in zip(keys, strides, strict=True):
        if first < start + stride:
            return ValueError(
                f"KeyedJaggedTensor feature '{key}': lengths[{first - start}] = "
                f"{int(flat[first])} (bag {first - start} of {stride}) is negative; a length is "
                "the number of ids in a bag, 0 or more")
        start += stride
    return ValueError(f"KeyedJaggedTensor: lengths[{first}] = {int(flat[first])} is negative; "
                      "a length is the number of ids in a bag, 0 or more")


def kjt_to_batch(
    features: KeyedJaggedTensor, feature_names: Sequence[str], weighted: bool
) -> JaggedBatch:
    """Reorder ``features`` to ``feature_names`` and flatten it to a TBE batch.

    Keys may come in any order and keys no table uses are dropped; a missing or duplicated
    feature, per-key batch sizes, lengths that do not add up to the values, or a
    weighted/unweighted mismatch raise ValueError.
    """
    parts = kjt_parts(features, feature_names, weighted)
    keys = list(parts.keys)
    order = [keys.index(f) for f in feature_names]
    return order_batch(
        parts.values, parts.lengths.reshape(len(keys), parts.batch_size), parts.weights, order, keys
    )


def order_batch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
    order: Sequence[int],
    keys: Sequence[str] | None = None,
) -> JaggedBatch:
    """A KJT's tensors (``values`` [N], ``lengths`` [K, B], ``weights`` [N] or None, in its
    key order) as the TBE batch of the keys ``order`` picks (an index may repeat): the eager
    part of ``kjt_to_batch``, which reads the per-key lengths on the host. ``keys`` name the
    keys in errors (default: their positions).

    Lengths that do not add up to the values raise ValueError.
    """
    K, B = lengths.shape
    keys = list(keys) if keys is not None else [f"#{k}" for k in range(K)]
    per_key = []
    if K and B:  # the per-key id counts and the smallest length in one host read
        *per_key, smallest = torch.cat([lengths.sum(dim=1), lengths.amin().view(1)]).tolist()
        if smallest < 0:
            raise negative_length_error(lengths, keys, [B] * K)
    elif K:
        per_key = [0] * K
    if sum(per_key) != values.numel():
        ends = list(accumulate(per_key))
        bad = next((k for k, e in zip(keys, ends, strict=True) if e > values.numel()), keys[-1])
        raise ValueError(
            f"KeyedJaggedTensor feature '{bad}': lengths add up to {sum(per_key)} ids in all, "
            f"but values holds {values.numel()}"
        )
    lengths = lengths.reshape(-1)
    T = K
    if list(order) != list(range(K)):
        # reorder the per-feature segments with plain torch ops (KJT.permute needs fbgemm's
        # CUDA ops on GPU tensors); a feature may be asked for twice (two tables), a key
        # no table uses is left out
        values = permute_segments(values, per_key, order)
        weights = permute_segments(weights, per_key, order) if weights is not None else None
        lengths = lengths.view(K, B)[torch.tensor(order, device=lengths.device)].reshape(-1)
        T = len(order)
    offsets = torch.zeros(T * B + 1, dtype=lengths.dtype, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return JaggedBatch(
        indices=values,
        offsets=offsets.to(values.dtype),
        per_sample_weights=weights,
        batch_size=B,
    )


def unorder_weights_grad(
    grad: torch.Tensor, lengths: torch.Tensor, order: Sequence[int]
) -> torch.Tensor:
    """The gradient of ``order_batch``'s per-sample weights (``grad`` [N'] in batch order)
    back in the KJT's order: summed where a key was picked twice, zero where not picked."""
    K = lengths.shape[0]
    per_key = lengths.sum(dim=1).tolist() if K else []
    N = sum(per_key)
    position = permute_segments(torch.arange(N, device=grad.device), per_key, order)
    return grad.new_zeros(N).index_add_(0, position, grad)


def permute_segments(
    values: torch.Tensor, sizes: Sequence[int], order: Sequence[int]
) -> torch.Tensor:
    """``values`` cut into consecutive segments of ``sizes``, put back together in ``order``
    (an index may repeat or be left out). Plain torch gather, no sync beyond the host sizes."""
    starts = [0, *accumulate(sizes)]
    new_sizes = [sizes[k] for k in order]
    new_starts = [0, *accumulate(new_sizes)]
    n = new_starts[-1]
    shift = torch.tensor(
        [starts[k] - new_starts[i] for i, k in enumerate(order)],
        dtype=torch.int64,
        device=values.device,
    )
    gather = torch.arange(n, device=values.device) + torch.repeat_interleave(
        shift, torch.tensor(new_sizes, dtype=torch.int64, device=values.device), output_size=n
    )
    return values[gather]


def keyed_tensor(keys: Sequence[str], dims: Sequence[int], values: torch.Tensor) -> KeyedTensor:
    """``[B, sum(dims)]`` pooled embeddings as a KeyedTensor, one key per feature."""
    return KeyedTensor(keys=list(keys), length_per_key=list(dims), values=values, key_dim=1)


def padded_kjt(features: KeyedJaggedTensor, capacity: int) -> KeyedJaggedTensor:
    """A KeyedJaggedTensor with ``features``' keys and (copied) lengths over fresh zero
    values (and weights) of ``capacity`` slots: the static buffers a captured step reads."""
    w = features.weights_or_none()
    return KeyedJaggedTensor(
        keys=features.keys(), values=features.values().new_zeros(capacity),
        lengths=features.lengths().clone(),
        weights=w.new_zeros(capacity) if w is not None else None,
    )


def kjt_key_ranges(features: KeyedJaggedTensor) -> dict[str, tuple[int, int]]:
    """Where each key's ids are in ``features.values()`` (host ints: one read of lengths)."""
    at = features.offset_per_key()
    return {k: (int(at[i]), int(at[i + 1])) for i, k in enumerate(features.keys())}


def kjt_with_values(features: KeyedJaggedTensor, values: torch.Tensor) -> KeyedJaggedTensor:
    """``features`` with other ``values`` of the same length: keys, lengths, weights, strides
    (a variable batch per key too) and inverse indices kept."""
    vbe = features.variable_stride_per_key()
    return KeyedJaggedTensor(
        keys=features.keys(), values=values, weights=features.weights_or_none(),
        lengths=features.lengths(),
        stride=None if vbe else features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if vbe else None,
        inverse_indices=features.inverse_indices_or_none(),
    )
