"""The engine's front ends: `generate` (offline, blocking) and `stream` (asyncio).

Both sit on the engine's request API (``add_request`` with a per-request sink, ``step``,
``abort``, ``fail_all``), so they run the same code paths as the server's engine thread.
`generate` runs steps on the caller's thread until its prompts are done; `stream` drives steps
from an asyncio task (each step in a worker thread, so the event loop stays responsive) and
yields incremental outputs. Fanning one prompt out to n samples belongs here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from .request import RequestOutput, SamplingParams


class EngineFrontends:
    """`generate` and `stream` for an engine class that provides ``add_request``, ``step``,
    ``abort``, ``has_unfinished``, ``fail_all`` and a ``_driver`` slot (None: no stream task)."""

    _driver: asyncio.Task | None

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
        results: dict[str, RequestOutput] = {}

        def collect(out: RequestOutput) -> None:
            if out.finished:
                results[out.request_id] = out

        rids = [self.add_request(p, sp, sink=collect)
                for p, sp in zip(prompts, params, strict=True)]
        while len(results) < len(rids):
            if not self.has_unfinished():
                raise RuntimeError("engine went idle with requests unfinished")
            self.step()
        return [results[r] for r in rids]

    async def stream(self, prompt: Any, sampling_params: SamplingParams | None = None, *,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per new token, the last one with ``finished`` set. Leaving
        the iterator early aborts the request."""
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
        done = False
        try:
            while not done:
                out = await queue.get()
                done = out.finished
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
