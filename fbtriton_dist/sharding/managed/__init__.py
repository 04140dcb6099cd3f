"""Managed tables (dynamic ids) sharded: the owners' id managers and the managed sharded
collections (``sharded``), the id hash that picks an id's owner (``hashing``), and loading and
resharding the id maps (``state``). Imports ``sharding.modules`` and below."""
