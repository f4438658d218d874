"""The check a green-context split passes before it is used: its two streams run a Triton kernel.

`probe_partition` launches the SM probe (`spaceserve.kernels.smprobe`: a persistent Triton
kernel writing the ``%smid`` of the program that ran each tile) on each stage's stream under the
stage's granted budget, waits for both streams, and checks that every tile ran, that no stage
used more SMs than it was granted, and that the two stages used disjoint SMs. A split that fails
(a launch error, a stream the driver refuses, SMs shared) falls back to kernel budgets alone,
for that split only (`PartitionSet`). Where the probe kernel cannot run (the Triton interpreter
on a CUDA machine), a torch op on each stream is the check.

`green_stream_facts` is the longer look the GPU harness takes at one split (about 2 s): a
Triton kernel on both streams at once and how much the two overlap in time (``%globaltimer``
per program), events across green and ordinary streams, a CUDA graph captured and replayed on
a green stream.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["green_stream_facts", "probe_partition"]


def _hand_offs(part: Any, device: torch.device) -> None:
    """Events both ways between the split's streams and the ordinary current stream, as a
    switch and an embeddings hand-off use them (an event recorded in one context and waited
    in another): each green stream waits for the ordinary stream, which then waits for both."""
    here = torch.cuda.current_stream(device)
    start = torch.cuda.Event()
    start.record(here)
    done = []
    for stream in (part.encoder_stream, part.decoder_stream):
        stream.wait_event(start)
        ev = torch.cuda.Event()
        ev.record(stream)
        done.append(ev)
    for ev in done:
        here.wait_event(ev)
    here.synchronize()


def probe_partition(part: Any, device: torch.device) -> str:
    """Run the check on `part` (a green `Partition`); returns the probe's summary line, raises
    RuntimeError (or the launch's own error) when the split cannot be trusted. Event hand-offs
    between its streams and an ordinary one are exercised first."""
    from spaceserve.kernels.smprobe import probe_available, probe_report, probe_sms

    stages = (("encoder", part.encoder_sms, part.encoder_scope, part.encoder_stream),
              ("decoder", part.decoder_sms, part.decoder_scope, part.decoder_stream))
    _hand_offs(part, device)
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


def _check(results: dict[str, Any], name: str, fn: Any) -> None:
    """Run one check; its dict (or the error that stopped it) goes under `name`."""
    t0 = time.perf_counter()
    try:
        results[name] = {"ok": True, **fn()}
    except Exception as exc:  # a check that fails is a finding, not a crash
        results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    results[name]["s"] = round(time.perf_counter() - t0, 3)


def green_stream_facts(pset: Any, encoder_sms: int, *, tiles_per_sm: int = 256,
                       spin: int = 2048) -> dict[str, Any]:
    """What one split of `pset` does on the device, in about a second or two (CUDA only):

    - ``concurrent``: the time probe (a Triton kernel) on the encoder and the decoder stream at
      once, each under its granted budget; the overlap of the two launches in time
      (`overlap_fraction`), the SMs each used and whether they were disjoint;
    - ``events``: an event recorded on the encoder stream and waited on an ordinary stream, one
      recorded there and waited on the decoder stream, a value passed along the chain;
    - ``graph``: a CUDA graph of a budgeted SpaceServe kernel (RMSNorm) captured and replayed
      on the decoder stream, matching eager results on fresh inputs, and the SM probe replayed
      from a graph there staying off the encoder's SMs.

    The row also names the split, its granted budgets and whether it is green (else why not).
    """
    from spaceserve.kernels import rms_norm
    from spaceserve.kernels.smprobe import overlap_fraction, probe_sms, probe_times

    if not pset.cuda:
        raise RuntimeError("green_stream_facts needs a CUDA device")
    part = pset.get(encoder_sms)
    dev = pset.device
    out: dict[str, Any] = {"split": encoder_sms, "encoder_sms": part.encoder_sms,
                           "decoder_sms": part.decoder_sms, "green": part.green,
                           "reason": part.reason or pset.reason}
    t0 = time.perf_counter()
    enc_s, dec_s = part.encoder_stream, part.decoder_stream
    seen: dict[str, set[int]] = {}

    def concurrent() -> dict[str, Any]:
        for scope, budget in ((part.encoder_scope, part.encoder_sms),
                              (part.decoder_scope, part.decoder_sms)):
            with scope():  # compile and warm outside the timed pair
                probe_times(budget, tiles_per_sm=1, spin=8, device=dev)
        torch.cuda.synchronize(dev)
        go = torch.cuda.Event()
        go.record()
        enc_s.wait_event(go)
        dec_s.wait_event(go)
        with part.encoder_scope():
            a = probe_times(part.encoder_sms, tiles_per_sm=tiles_per_sm, spin=spin, device=dev)
        with part.decoder_scope():
            b = probe_times(part.decoder_sms, tiles_per_sm=tiles_per_sm, spin=spin, device=dev)
        enc_s.synchronize()
        dec_s.synchronize()
        seen["encoder"] = set(a[:, 2].tolist())
        seen["decoder"] = set(b[:, 2].tolist())
        shared = seen["encoder"] & seen["decoder"]
        return {**overlap_fraction(a, b), "encoder_sms_used": len(seen["encoder"]),
                "decoder_sms_used": len(seen["decoder"]), "disjoint": not shared}

    def events() -> dict[str, Any]:
        plain = torch.cuda.Stream(dev)
        x = torch.zeros(1 << 20, device=dev)
        enc_s.wait_stream(torch.cuda.current_stream(dev))
        with part.encoder_scope():
            probe_times(part.encoder_sms, tiles_per_sm=64, spin=spin, device=dev)  # a delay
            x.fill_(7.0)
            e1 = torch.cuda.Event()
            e1.record()
        plain.wait_event(e1)
        with torch.cuda.stream(plain):
            y = x * 2
            e2 = torch.cuda.Event()
            e2.record()
        dec_s.wait_event(e2)
        with part.decoder_scope():
            z = y + 1
        dec_s.synchronize()  # z waited for y, y for x: every stream is done
        bad = int((z != 15).sum())
        if bad:
            raise RuntimeError(f"{bad} of {z.numel()} values read before their event")
        return {"chain": "encoder -> ordinary -> decoder"}

    def graph() -> dict[str, Any]:
        gen = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(300, 256, device=dev, generator=gen)
        w = torch.randn(256, device=dev, generator=gen)
        budget = part.decoder_sms
        dec_s.wait_stream(torch.cuda.current_stream(dev))
        with part.decoder_scope():
            rms_norm(x, w, 1e-6, num_sms=budget)  # compiled before capture
            probe_sms(budget, spin=64, device=dev)
        dec_s.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=dec_s):
            y = rms_norm(x, w, 1e-6, num_sms=budget)
            sms = probe_sms(budget, spin=64, device=dev)
        errs = []
        for i in range(2):
            with part.decoder_scope():  # fresh inputs, the replay and eager, in stream order
                x.copy_(torch.randn(x.shape, device=dev, generator=gen))
                g.replay()
                ref = rms_norm(x, w, 1e-6, num_sms=budget)
            dec_s.synchronize()
            errs.append(float((y - ref).abs().max()))
            if not torch.equal(y, ref):
                raise RuntimeError(f"replay {i} differs from eager by {errs[-1]:.3g}")
        used = set(sms.tolist())
        clash = used & seen.get("encoder", set())
        if clash and part.green:
            raise RuntimeError(f"graph replay on the decoder stream used {len(clash)} of the "
                               "encoder's SMs")
        return {"replays": 2, "max_abs_diff": max(errs), "sms_used": len(used)}

    _check(out, "concurrent", concurrent)
    _check(out, "events", events)
    _check(out, "graph", graph)
    out["overlap_fraction"] = out["concurrent"].get("overlap_fraction")
    out["ok"] = all(out[k]["ok"] for k in ("concurrent", "events", "graph"))
    out["wall_s"] = round(time.perf_counter() - t0, 3)
    return out
