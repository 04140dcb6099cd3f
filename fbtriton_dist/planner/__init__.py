"""The sharding planner: table specs, cost model, ``ShardingPlanner`` and ``ShardingPlan``.

Pure Python: never imports torch, triton or torch.distributed, never touches tensors.
TorchRec ``EmbeddingBagConfig`` objects are accepted by duck typing. See docs/planner.md.
"""

from ._yaml import ConfigError, FieldError
from .cost import CostModel, PlanCost, RankCost, evaluate, header_bytes
from .groups import GroupedCost, evaluate_grouped, plan_grouped, propose_group_size
from .memory import state_bytes
from .plan import PlanValidationError, ShardingPlan
from .planner import PlanError, ShardingPlanner
from .shards import SHARDING_TYPES, Shard, ShardingType, TableSharding
from .stats import (
    IdDistribution,
    balanced_cuts,
    cdf_array,
    equal_cuts,
    generalized_harmonic,
    inverse_cdf_array,
)
from .tables import (
    OPTIMIZERS,
    TableConstraints,
    TableSet,
    TableSpec,
    load_tables,
    table_set_from_dict,
    to_table_specs,
)

__all__ = [
    "OPTIMIZERS",
    "SHARDING_TYPES",
    "ConfigError",
    "CostModel",
    "FieldError",
    "GroupedCost",
    "IdDistribution",
    "PlanCost",
    "PlanError",
    "PlanValidationError",
    "RankCost",
    "Shard",
    "ShardingPlan",
    "ShardingPlanner",
    "ShardingType",
    "TableConstraints",
    "TableSet",
    "TableSharding",
    "TableSpec",
    "balanced_cuts",
    "cdf_array",
    "equal_cuts",
    "inverse_cdf_array",
    "evaluate",
    "evaluate_grouped",
    "plan_grouped",
    "propose_group_size",
    "generalized_harmonic",
    "header_bytes",
    "load_tables",
    "state_bytes",
    "table_set_from_dict",
    "to_table_specs",
]
