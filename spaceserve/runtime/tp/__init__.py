"""Tensor parallelism in the runtime: rank 0's runner, the worker processes, the protocol
between them and the collectives (torch.distributed: gloo on CPU, NCCL on GPU)."""

from .group import TensorParallelError
from .protocol import ModelSource, PartitionSpec
from .runner import TensorParallelRunner

__all__ = ["ModelSource", "PartitionSpec", "TensorParallelError", "TensorParallelRunner"]
