"""Persistent Triton kernels under an explicit SM budget (see DESIGN.md's kernel contract)."""

from .budget import (
    LaunchRecord,
    device_num_sms,
    record_launches,
    resolve_num_sms,
)
from .configs import kernel_config
from .persistent import CompileSpec, launch_persistent

__all__ = [
    "CompileSpec",
    "LaunchRecord",
    "device_num_sms",
    "kernel_config",
    "launch_persistent",
    "record_launches",
    "resolve_num_sms",
]
# Kernel exports (one line per kernel module):
