"""The fused slot map of the ``cached`` tier on the device (``kernels/slot_map.py``), for
``modules/tier_device_map.py``: the layer between (modules never import kernels). Its torch
twin, the CPU path, is ``tier_device_map``'s own ops."""

from fbtriton_dist.kernels.slot_map import (  # noqa: F401
    RowPlan,
    compact,
    free_targets,
    interpreted,
    keys,
    map_first,
    map_ids,
    rows_in,
    rows_swap,
    slots_of,
    stamp,
)

__all__ = ["RowPlan", "compact", "free_targets", "interpreted", "keys", "map_first",
           "map_ids", "rows_in", "rows_swap", "slots_of", "stamp"]
