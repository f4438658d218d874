"""Persistent Triton kernels under an explicit SM budget (see docs/design.md, Kernel contract)."""

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
from .gated_mlp import gated_mlp  # noqa: E402,F401
from .linear import linear  # noqa: E402,F401
from .norms import layer_norm, rms_norm  # noqa: E402,F401
from .paged_attention import (  # noqa: E402,F401
    DecodePlan,
    PrefillPlan,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)
from .rotary import apply_rotary, mrope_cos_sin, rope_cos_sin, vision_rotary_cos_sin  # noqa: E402,F401
from .vit_attention import plan_vit_attention, vit_attention  # noqa: E402,F401
