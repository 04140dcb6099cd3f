"""fbtriton_dist: sharded embedding bags on Triton TBE kernels, a drop-in for TorchRec."""

from fbtriton_dist import optim
from fbtriton_dist.modules import TableBatchedEmbedding

__version__ = "0.1.0"
__all__ = ["TableBatchedEmbedding", "optim"]
