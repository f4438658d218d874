"""The engine's front ends: `from_pretrained` (a checkpoint to a running engine), `generate`
(offline, blocking) and `stream` (asyncio).

Both sit on the engine's request API (``add_request`` with a per-request sink, ``step``,
``abort``, ``fail_all``), so they run the same code paths as the server's engine thread.
`generate` runs steps on the caller's thread until its prompts are done; `stream` drives steps
from an asyncio task (each step in a worker thread, so the event loop stays responsive) and
yields incremental outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from spaceserve.runtime.core.request import RequestOutput, SamplingParams
from spaceserve.runtime.engine.config import EngineConfig
from spaceserve.runtime.inputs.processor import load_processor

if TYPE_CHECKING:
    from typing_extensions import Self


class EngineFrontends:
    """`from_pretrained`, `generate` and `stream` for an engine class that provides
    ``add_request``, ``step``, ``abort``, ``has_unfinished``, ``fail_all`` and a ``_driver``
    slot (None: no stream task); its constructor takes (runner, config, tokenizer=,
    processor=)."""

    _driver: asyncio.Task | None

    @classmethod
    def from_pretrained(cls, path: str, *, mode: str = "temporal",
                        attention_backend: str | None = None, dtype: Any = None,
                        device: Any = None, **config: Any) -> Self:
        """Load a Qwen2-VL checkpoint (a local directory) with its tokenizer and processor.
        `attention_backend` None: `config.default_attention_backend` (triton on CUDA except in
        ``shared`` mode, torch on CPU). ``tensor_parallel_size=N`` (an `EngineConfig` field)
        starts N - 1 worker processes, each loading only its slices of the checkpoint; `close`
        stops them."""
        from spaceserve.runtime.engine.assemble import assemble_engine
        from spaceserve.runtime.engine.load_runner import load_runner

        cfg = EngineConfig(mode=mode, **config)
        return assemble_engine(
            cls, cfg, lambda backend, dev: load_runner(path, cfg, attention_backend=backend,
                                                  dtype=dtype, device=dev),
            attention_backend=attention_backend, device=device,
            processors=lambda runner: load_processor(path))

    # Front ends.

    def generate(self, prompts: Any, sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if isinstance(prompts, (dict, str)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for "
                                 f"{len(prompts)} prompts")
        results: dict[str, list[RequestOutput]] = {}

        def collect(out: RequestOutput) -> None:
            if out.finished:
                results.setdefault(out.request_id, []).append(out)

        rids = [self.add_request(p, sp, sink=collect)
                for p, sp in zip(prompts, params, strict=True)]
        want = {r: 1 if sp is None else sp.n for r, sp in zip(rids, params, strict=True)}
        while any(len(results.get(r, ())) < want[r] for r in rids):
            if not self.has_unfinished():
                raise RuntimeError("engine went idle with requests unfinished")
            self.step()
        return [o for r in rids for o in sorted(results[r], key=lambda o: o.index)]

    async def stream(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per new token, the last one with ``finished`` set (with
        ``n`` > 1: until every sequence has yielded its finished one). Leaving the iterator
        early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the loop is gone: nobody listens any more
                pass

        # preprocessing (image processor, tokenizer) runs off the event loop's thread
        rid = await asyncio.to_thread(self.add_request, prompt, sampling_params,
                                      request_id=request_id, sink=sink, stream=True)
        if self._driver is None or self._driver.done():
            self._driver = loop.create_task(self._drive())
        left = 1 if sampling_params is None else sampling_params.n
        done = False
        try:
            while not done:
                out = await queue.get()
                left -= out.finished
                done = left == 0
                yield out
        finally:
            if not done:
                self.abort(rid)

    async def _drive(self) -> None:
        while self.has_unfinished():
            try:
                await asyncio.to_thread(self.step)
            except Exception as exc:  # report on every request instead of hanging streams
                self.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                return
