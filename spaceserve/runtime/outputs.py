"""Output emission: a request's state turned into the `RequestOutput` its caller sees.

The engine asks for an output after every token of a streaming request and once when any
request finishes. Text is decoded here (the whole output so far, special tokens skipped) only
when someone will read it: on the final output, and on every output of a streaming request.
Incremental detokenisation and stop strings belong here, beside the per-request state they need.
"""

from __future__ import annotations

from typing import Any

from .request import Request, RequestOutput


class OutputProcessor:
    """Builds `RequestOutput`s with the checkpoint's tokenizer (None: token ids only)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def make(self, req: Request, finished: bool) -> RequestOutput:
        """The output of `req` now; advances what it has emitted (the ``new`` token ids)."""
        out_ids = req.token_ids[req.num_prompt_tokens:]
        new = out_ids[req.num_emitted:]
        req.num_emitted = len(out_ids)
        text = None
        if self.tokenizer is not None and (finished or req.stream):
            text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        return RequestOutput(req.request_id, req.prompt_token_ids, out_ids, new, text, finished,
                             req.finish_reason if finished else None, req.error, req.metrics(),
                             index=req.index)
