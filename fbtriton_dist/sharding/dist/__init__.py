"""Input and output dists: the plan's shard layout (``layout``), bucketize + all-to-all of the
ids (``input_dist``, its fixed-shape mode ``fixed``), pooled rows back (``output_dist``) and rows
back per id (``sequence_dist``). Imports ``sharding.comm`` only."""
