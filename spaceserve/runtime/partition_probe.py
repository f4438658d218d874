"""The check a green-context split passes before it is used: its two streams run a Triton kernel.

`probe_partition` launches the SM probe (`spaceserve.kernels.smprobe`: a persistent Triton
kernel writing the ``%smid`` of the program that ran each tile) on each stage's stream under the
stage's granted budget, waits for both streams, and checks that every tile ran, that no stage
used more SMs than it was granted, and that the two stages used disjoint SMs. A split that fails
(a launch error, a stream the driver refuses, SMs shared) falls back to kernel budgets alone,
for that split only (`PartitionSet`). Where the probe kernel cannot run (the Triton interpreter
on a CUDA machine), a torch op on each stream is the check.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["probe_partition"]


def probe_partition(part: Any, device: torch.device) -> str:
    """Run the check on `part` (a green `Partition`); returns the probe's summary line, raises
    RuntimeError (or the launch's own error) when the split cannot be trusted."""
    from spaceserve.kernels.smprobe import probe_available, probe_report, probe_sms

    stages = (("encoder", part.encoder_sms, part.encoder_scope, part.encoder_stream),
              ("decoder", part.decoder_sms, part.decoder_scope, part.decoder_stream))
    if probe_available(device) is not None:
        for _, _, scope, stream in stages:
            with scope():
                x = torch.ones(256, device=device)
                x.add_(1)
            stream.synchronize()
        return "streams ran a torch op (SM probe unavailable)"
    outs = {}
    for name, budget, scope, _ in stages:
        with scope():
            outs[name] = probe_sms(budget, tiles_per_sm=2, spin=256, device=device)
    for _, _, _, stream in stages:
        stream.synchronize()
    rep = probe_report(outs, {name: budget for name, budget, _, _ in stages})
    if not rep.within_budgets() or not rep.disjoint:
        raise RuntimeError(f"SM probe: {rep.summary()}")
    return rep.summary()
