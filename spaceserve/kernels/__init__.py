"""Persistent Triton kernels under an explicit SM budget (see docs/design.md, Kernel contract)."""

from spaceserve.kernels.budget import (
    LaunchRecord,
    device_num_sms,
    record_launches,
    resolve_num_sms,
)
from spaceserve.kernels.configs import kernel_config
from spaceserve.kernels.persistent import CompileSpec, launch_persistent

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
from spaceserve.kernels.attention.paged import (  # noqa: E402,F401
    DecodePlan,
    PrefillPlan,
    paged_decode_attention,
    paged_prefill_attention,
    store_kv,
)
from spaceserve.kernels.attention.vit import plan_vit_attention, vit_attention  # noqa: E402,F401
from spaceserve.kernels.gated_mlp import gated_mlp  # noqa: E402,F401
from spaceserve.kernels.linear import linear  # noqa: E402,F401
from spaceserve.kernels.norms import layer_norm, rms_norm  # noqa: E402,F401
from spaceserve.kernels.rotary import (  # noqa: E402,F401
    apply_rotary,
    mrope_cos_sin,
    rope_cos_sin,
    vision_rotary_cos_sin,
)
