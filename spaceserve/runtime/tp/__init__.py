"""Tensor parallelism in the runtime: rank 0's runner, the worker processes, the protocol
between them and the collectives (torch.distributed: gloo on CPU, NCCL on GPU)."""

from spaceserve.runtime.tp.group import TensorParallelError
from spaceserve.runtime.tp.protocol import ModelSource, PartitionSpec
from spaceserve.runtime.tp.runner import TensorParallelRunner

__all__ = ["ModelSource", "PartitionSpec", "TensorParallelError", "TensorParallelRunner"]
