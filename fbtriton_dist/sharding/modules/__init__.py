"""The sharded collections: what they share (``collection``: local shards, input dist, state
dict), the sharded EmbeddingBagCollection (``sharded_ebc``) and EmbeddingCollection
(``sharded_ec``), and their TorchRec-keyed state dicts (``state_dict``). Imports
``sharding.dist`` and ``sharding.comm``."""
