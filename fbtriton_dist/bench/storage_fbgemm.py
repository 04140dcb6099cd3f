"""FBGEMM's storage tiers for ``bench tbe --storage --device cuda --fbgemm``: the same tables,
initial weights, optimizer and batches as ours, in FBGEMM's
``SplitTableBatchedEmbeddingBagsCodegen`` (EXACT_ROWWISE_ADAGRAD, our lr and eps, fp32 weights
and output, SUM pooling) at three ``EmbeddingLocation``s:

- ``fbgemm_device``: DEVICE, every row in HBM (against our ``device``);
- ``fbgemm_managed``: MANAGED, every row in unified (UVM) memory the kernels read through
  (against our ``host``, where ours builds it);
- ``fbgemm_managed_caching``: MANAGED_CACHING, an HBM cache of ``cache_load_factor`` of the
  rows in front of UVM rows, ``cache_algorithm`` LRU or LFU as our ``--policy`` (against our
  ``cached``). No explicit ``prefetch()`` is called: FBGEMM's forward then prefetches its own
  batch (looks its ids up in the cache, fetches the misses, evicting as needed, and
  linearizes them) before the lookup, in the timed step. Its cache statistics
  (``gather_uvm_cache_stats=True``) give the hit rate: 1 - unique misses / unique ids, per
  lookup, as ours counts it.

CUDA only (FBGEMM's CPU TBE has no UVM tiers). Before timing, ``compare_device`` trains
``fbgemm_device`` and our ``device`` module one step from the same weights: their rows and
rowwise-Adagrad state must agree within ``REL_TOL`` (relative to the largest value)."""

import torch

PROVIDERS = {
    "fbgemm_device": "DEVICE",
    "fbgemm_managed": "MANAGED",
    "fbgemm_managed_caching": "MANAGED_CACHING",
}
"""Provider -> FBGEMM's ``EmbeddingLocation`` member."""
PAIRS = (("device", "fbgemm_device"), ("cached", "fbgemm_managed_caching"),
         ("host", "fbgemm_managed"), ("device (graph)", "fbgemm_device"),
         ("cached (graph)", "fbgemm_managed_caching"), ("host (graph)", "fbgemm_managed"))
"""(our tier, FBGEMM's provider) compared in the printed pairs: fbgemm ms / ours ms."""
UNIQUE_INDICES, UNIQUE_MISSES = 2, 3
"""Positions in FBGEMM's ``get_uvm_cache_stats()`` (its ``UVMCacheStatsIndex``:
num_calls, num_requested_indices, num_unique_indices, num_unique_misses, ...)."""
REL_TOL = 1e-5
"""Ours vs FBGEMM on device after one step: max |diff| / max |FBGEMM's|."""


def unavailable(device: torch.device) -> str | None:
    """Why FBGEMM's tiers cannot run here (None when they can): CUDA only, and fbgemm_gpu must
    import."""
    if device.type != "cuda":
        return ("--fbgemm: FBGEMM's UVM tiers (EmbeddingLocation.MANAGED, MANAGED_CACHING) "
                f"need CUDA; expected --device cuda, got --device {device.type}")
    try:
        _imports()
    except ImportError as e:
        return f"fbgemm_gpu is not importable: {e}"
    return None


def _imports() -> dict:
    import fbgemm_gpu  # noqa: F401, PLC0415  (loads the operator libraries)
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType  # noqa: PLC0415
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (  # noqa: PLC0415
        CacheAlgorithm,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: PLC0415
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return dict(TBE=SplitTableBatchedEmbeddingBagsCodegen, OptimType=EmbOptimType,
                SparseType=SparseType, CacheAlgorithm=CacheAlgorithm,
                EmbeddingLocation=EmbeddingLocation, PoolingMode=PoolingMode,
                ComputeDevice=ComputeDevice)


def build(provider: str, tables: list[tuple[int, int]], weights: list[torch.Tensor], *,
          lr: float, eps: float, load_factor: float, policy: str, device: torch.device):
    """FBGEMM's TBE for ``provider`` (``PROVIDERS``) with ``weights`` (ours,
    ``split_embedding_weights()``, one ``[E, D]`` per table) copied into its own. On the CPU
    (tests only: the benchmark refuses ``--fbgemm`` there) ``fbgemm_device`` is FBGEMM's CPU
    TBE (HOST), the others raise ValueError."""
    fb = _imports()
    location = getattr(fb["EmbeddingLocation"], PROVIDERS[provider])
    compute = fb["ComputeDevice"].CUDA
    if device.type != "cuda":
        if provider != "fbgemm_device":
            raise ValueError(f"{provider}: expected --device cuda (FBGEMM's UVM tiers), got "
                             f"{device.type}")
        location, compute = fb["EmbeddingLocation"].HOST, fb["ComputeDevice"].CPU
    caching = provider == "fbgemm_managed_caching"
    emb = fb["TBE"](
        embedding_specs=[(E, D, location, compute) for E, D in tables],
        optimizer=fb["OptimType"].EXACT_ROWWISE_ADAGRAD,
        learning_rate=lr,
        eps=eps,
        weights_precision=fb["SparseType"].FP32,
        output_dtype=fb["SparseType"].FP32,
        pooling_mode=fb["PoolingMode"].SUM,
        cache_load_factor=load_factor,
        cache_algorithm=getattr(fb["CacheAlgorithm"], policy.upper()),
        gather_uvm_cache_stats=caching,
        device=device,
    )
    with torch.no_grad():
        for theirs, ours in zip(emb.split_embedding_weights(), weights, strict=True):
            theirs.copy_(ours.reshape(theirs.shape))
    for t, (theirs, ours) in enumerate(zip(emb.split_embedding_weights(), weights, strict=True)):
        if not torch.equal(theirs, ours.reshape(theirs.shape)):  # views of its rows, read back
            raise RuntimeError(f"{provider}: table {t}'s rows did not take our weights")
    return emb


def hit_rate(emb) -> float | None:
    """A MANAGED_CACHING module's hit rate so far: 1 - unique misses / unique ids, summed over
    its lookups (None for the other locations)."""
    if not getattr(emb, "gather_uvm_cache_stats", False):
        return None
    stats = emb.get_uvm_cache_stats().tolist()
    unique = stats[UNIQUE_INDICES]
    return 1 - stats[UNIQUE_MISSES] / unique if unique else None


def reset_stats(emb) -> None:
    """Zero a MANAGED_CACHING module's cache statistics (before the timed steps)."""
    if getattr(emb, "gather_uvm_cache_stats", False):
        emb.reset_uvm_cache_stats()


def compare(ours, theirs, batch) -> dict:
    """One training step of both from the same weights on ``batch``: per table, rows and
    rowwise-Adagrad state, max |diff| / max |FBGEMM's|; ``failures`` lists those over
    ``REL_TOL``."""
    for m in (ours, theirs):
        m(*batch).sum().backward()
    out: dict = {"weights_rel_err": 0.0, "state_rel_err": 0.0}
    pairs = {
        "weights_rel_err": zip(ours.split_embedding_weights(), theirs.split_embedding_weights(),
                               strict=True),
        "state_rel_err": zip([s[0] for s in ours.split_optimizer_states()],
                             [s[0] for s in theirs.split_optimizer_states()], strict=True),
    }
    for key, tensors in pairs.items():
        for a, b in tensors:
            b = b.reshape(a.shape).double()
            err = (a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)
            out[key] = max(out[key], err.item())
    out["failures"] = [f"{k} {v:.3g} > {REL_TOL:g}" for k, v in out.items()
                       if k.endswith("_rel_err") and not v <= REL_TOL]
    return out


def pair_ratios(rows: list[dict]) -> list[dict]:
    """Per ``PAIRS`` entry with both rows timed: ``fbgemm_over_ours`` = FBGEMM's median ms /
    ours' (> 1: ours is faster)."""
    ms = {r["tier"]: r["median_ms"] for r in rows if r.get("median_ms")}
    return [{"ours": a, "fbgemm": b, "ours_ms": ms[a], "fbgemm_ms": ms[b],
             "fbgemm_over_ours": ms[b] / ms[a]}
            for a, b in PAIRS if a in ms and b in ms]


def print_pairs(pairs: list[dict]) -> None:
    if not pairs:
        return
    print(f"  {'ours':<16} {'fbgemm':<24} {'ours ms':>9} {'fbgemm ms':>9}  "
          "fbgemm ms / ours ms (> 1: ours faster)")
    for p in pairs:
        print(f"  {p['ours']:<16} {p['fbgemm']:<24} {p['ours_ms']:9.3f} {p['fbgemm_ms']:9.3f}  "
              f"{p['fbgemm_over_ours']:.2f}x")
