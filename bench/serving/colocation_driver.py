"""Which encoder driver keeps decode launches on time, measured on the host side only (CPU): a
model whose "device" is a virtual clock with one queue per partition, whose launches cost busy
host time (holding the GIL, like Python launch overhead) and whose syncs sleep (releasing it).
It measures when decode steps are issued, not GPU execution.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bench.serving.colocation_load import BACKGROUND, ms
from spaceserve.bench.prompts import Prompts

SECTION = "colocation"


def _busy(seconds: float) -> None:
    """Host work that holds the GIL (Python launch overhead)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _VirtualEvent:
    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.perf_counter()))


def driver_experiment(*, seconds: float = 2.0, launch_s: float = 20e-6, layer_launches: int = 12,
                      layer_s: float = 4e-3, decode_launch_s: float = 0.5e-3,
                      decode_s: float = 6e-3, image_every_s: float = 0.12,
                      drivers: tuple[str, ...] = ("none", "cooperative", "thread", "temporal")
                      ) -> list[dict[str, Any]]:
    """Decode inter-token gaps (host side) beside a stream of 32-layer images, per driver.

    A virtual device keeps one queue per partition: an encoder layer costs `layer_launches` x
    `launch_s` of busy host time and `layer_s` on the encoder queue; a decode step costs
    `decode_launch_s` of host time and `decode_s` on the decoder queue, and reading its tokens
    sleeps until then. "none" runs no images; "temporal" puts encoder layers on the decoder's
    queue (one GPU, time-multiplexed).
    """
    from spaceserve import Engine, EngineConfig, SamplingParams
    from spaceserve.runtime.worker.null import NullModelRunner

    class Device:
        def __init__(self) -> None:
            self.free = {"encoder": 0.0, "decoder": 0.0}

        def submit(self, lane: str, s: float) -> float:
            self.free[lane] = max(time.perf_counter(), self.free[lane]) + s
            return self.free[lane]

    class Runner(NullModelRunner):
        def __init__(self, device: Device, temporal: bool) -> None:
            super().__init__(check=False, encoder_layers=32, max_model_len=1 << 16)
            self.dev, self.lane = device, "decoder" if temporal else "encoder"

        def advance_encode(self, job: Any, layers: int, *, num_sms: int | None = None) -> int:
            for _ in range(layers):
                _busy(launch_s * layer_launches)
                self.dev.submit(self.lane, layer_s)
            return super().advance_encode(job, layers)

        def encode(self, mms: Any) -> list[torch.Tensor]:
            if self.lane == "decoder":  # temporal: the whole pass on the one queue, then wait
                for _ in range(self.encoder_layers):
                    _busy(launch_s * layer_launches)
                    self.dev.submit("decoder", layer_s)
            return super().encode(mms)

        def execute(self, batch: Any, *, stage: str = "decoder") -> torch.Tensor:
            _busy(decode_launch_s)
            self.dev.submit("decoder", decode_s)
            return super().execute(batch)

    class Ids:
        """A step's draws, read back once the virtual decoder has finished the step."""

        def __init__(self, sampled: Any, at: float) -> None:
            self.sampled, self.at, self.batch = sampled, at, sampled.batch

        def fetch(self) -> Any:
            time.sleep(max(0.0, self.at - time.perf_counter()))
            return self.sampled.fetch()

    rows = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: intra-op threads only add noise
    for driver in drivers:
        dev = Device()
        runner = Runner(dev, driver == "temporal")
        mode = "temporal" if driver == "temporal" else "spatial-static"
        cfg = EngineConfig(mode=mode, num_kv_blocks=4096, block_size=16, max_num_seqs=40,
                           max_num_batched_tokens=4096, prefill_on="decode",
                           encoder_driver="thread" if driver == "thread" else "cooperative")
        eng = Engine(runner, cfg)
        sample = eng.sampler.sample
        eng.sampler.sample = lambda logits, b, s=sample, d=dev: Ids(s(logits, b), d.free[
            "decoder"])
        if eng.spatial is not None:
            eng.encoder.event_factory = lambda d=dev: _VirtualEvent(d.free["encoder"])
        prompts = Prompts(runner.info, {"img": (1, 16, 16)})
        params = SamplingParams(max_tokens=1 << 14, temperature=0.0, ignore_eos=True)
        bg = [eng.add_request(prompts.text(32), params) for _ in range(BACKGROUND)]
        times: list[float] = []
        start = next_image = time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            if driver != "none" and now >= next_image:
                eng.add_request(prompts.image("img", 4), SamplingParams(max_tokens=2))
                next_image += image_every_s
            eng.step()
            times.append(time.perf_counter())
        for rid in bg:
            eng.abort(rid)
        eng.close()
        tail = times[len(times) // 5:]
        gaps = [b - a for a, b in zip(tail, tail[1:], strict=False)]
        rows.append({"section": SECTION, "driver": driver, "steps": len(times),
                     "gap_p50_ms": ms(gaps, 50), "gap_p99_ms": ms(gaps, 99),
                     "gap_max_ms": 1e3 * max(gaps, default=math.nan),
                     "encoder_layers": runner.num_encoder_layers_run})
    torch.set_num_threads(threads)
    return rows
