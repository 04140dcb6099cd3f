"""The MLPerf DLRM-dcnv2 parts of the job file (docs/mlperf.md), torch-free:

* ``data.multihot`` (:class:`MultiHotConfig`): the reference's preprocessed multi-hot Criteo
  1TB files, per day ``day_<i>_dense.npy``, ``day_<i>_sparse_multi_hot.npz``,
  ``day_<i>_labels.npy`` (``multihot.py`` reads them);
* ``model.kind: dcnv2``'s default layer sizes (MLPerf's);
* ``table_scale``: every table's rows scaled down, so MLPerf's tables fit a CPU.

The numbers are the reference's (mlcommons/training ``recommendation_v2/torchrec_dlrm``
README: ``--num_embeddings_per_feature``, ``--multi_hot_sizes``, the DCN flags).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fbtriton_dist.planner import FieldError, TableSet
from fbtriton_dist.planner._yaml import check_choice, check_name, check_number

from .config_values import _feature_names

__all__ = [
    "DCNV2_DENSE_ARCH",
    "DCNV2_OVER_ARCH",
    "MLPERF_BAG_SIZES",
    "MLPERF_ROWS",
    "MLPERF_TARGET_AUC",
    "MultiHotConfig",
    "check_multihot_only",
    "day_list",
    "model_defaults",
    "scale_tables",
]

MLPERF_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956,
               405282, 10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152,
               12973, 108, 36)
"""Rows of the 26 tables (Criteo 1TB's categorical cardinalities capped at 40M)."""
MLPERF_BAG_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3,
                    1, 1)
"""Ids per bag of each of the 26 features in the multi-hot dataset (fixed per feature)."""
MLPERF_TARGET_AUC = 0.80275
"""MLPerf Training's quality target for DLRM-dcnv2 (v3.0 on): eval AUC on the validation set."""
DCNV2_DENSE_ARCH = (512, 256, 128)
DCNV2_OVER_ARCH = (1024, 1024, 512, 256, 1)


@dataclass(kw_only=True, frozen=True)
class MultiHotConfig:
    """The reference's multi-hot Criteo files: ``<dir>/day_<i>_{dense.npy,
    sparse_multi_hot.npz,labels.npy}``, memory-mapped, each rank a contiguous part."""

    dir: str
    """The folder of the day files (relative: from the job file's folder)."""
    train_days: tuple[int, ...] = tuple(range(23))
    """Training days, read in this order (Criteo 1TB: days 0-22)."""
    eval_days: tuple[int, ...] = (23,)
    """Evaluation days (day 23), split in halves as the reference: ``eval_part``."""
    eval_part: Literal["val", "test", "all"] = "val"
    """``val``: the first ceil(N/2) rows of the eval days (MLPerf's validation set), ``test``
    the rest, ``all`` every row."""
    features: tuple[str, ...] = ()
    """Feature of each array ``0.npy``.. of the npz; empty: the tables' features in order."""

    def __post_init__(self) -> None:
        check_name("dir", self.dir)
        check_choice("eval_part", self.eval_part, ("val", "test", "all"))
        if not self.train_days:
            raise FieldError("train_days", "expected at least one day")

    def prefix(self, day: int) -> str:
        """``<dir>/day_<day>``: the day's files are this plus ``_dense.npy`` etc."""
        return os.path.join(self.dir, f"day_{day}")


def day_list(value: Any, key: str) -> tuple[int, ...]:
    """A list of day numbers (``[0, 1]``), or a range as ``first-last`` (``0-22``)."""
    if isinstance(value, str) and "-" in value:
        first, _, last = value.partition("-")
        if first.strip().isdigit() and last.strip().isdigit():
            value = list(range(int(first), int(last) + 1))
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise FieldError(key, f"expected a list of day numbers or a range 'first-last', "
                              f"got {value!r}")
    return tuple(value)


MULTIHOT_CONVERT = {"train_days": day_list, "eval_days": day_list, "features": _feature_names}
"""How ``data.multihot``'s keys are read."""


def model_defaults(value: Any) -> Any:
    """The ``model`` section with MLPerf's layer sizes filled in for ``kind: dcnv2``."""
    if isinstance(value, Mapping) and value.get("kind") == "dcnv2":
        value = {"dense_arch": list(DCNV2_DENSE_ARCH), "over_arch": list(DCNV2_OVER_ARCH),
                 **value}
    return value


def scale_tables(tables: TableSet, scale: Any, key: str = "table_scale") -> TableSet:
    """``tables`` with ``ceil(rows * scale)`` rows each (at least 1); ``scale`` in (0, 1]."""
    check_number(key, scale, 0.0, strict=True)
    if scale > 1:
        raise FieldError(key, f"expected a number in (0, 1], got {scale}")
    if scale == 1:
        return tables
    if tables.id_managers:
        raise FieldError(key, f"managed tables {sorted(tables.id_managers)} have a fixed "
                              "capacity: table_scale needs tables without id_manager")
    scaled = tuple(dataclasses.replace(t, num_embeddings=max(1, math.ceil(t.num_embeddings
                                                                          * scale)))
                   for t in tables.tables)
    return dataclasses.replace(tables, tables=scaled)


def check_multihot_only(train: Any, source: str) -> None:
    """``train.eval_batches: all`` and ``train.eval_every_epochs`` need a known eval set and
    epoch length: ``data.source: multihot``."""
    on = [k for k, v in (("eval_batches", train.eval_batches == "all"),
                         ("eval_every_epochs", train.eval_every_epochs is not None)) if v]
    if on and source != "multihot":
        raise FieldError(f"train.{on[0]}", "needs data.source: multihot (a known eval set and "
                         f"epoch length), got data.source: {source}")
