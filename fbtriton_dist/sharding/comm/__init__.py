"""The collectives of sharding, below everything else in it: autograd-aware all-to-all and
reduce-scatter (``collectives``), ``CommOptions`` (``options``) and the bytes each collective
moves next to the planner's estimate (``report``). Imports nothing else of ``sharding``."""
