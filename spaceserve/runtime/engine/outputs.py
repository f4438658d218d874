"""Output emission: incremental detokenisation, stop strings, and the `RequestOutput`s callers see.

Each request that needs text keeps a `Detokenizer`: the offsets of the token window it decodes
next (vLLM's prefix / read offsets), the text it has released and the text it holds back, so a
token costs two decodes of a few-token window whatever the output's length (O(1) amortised).
Text is held back while it ends in an incomplete UTF-8 character (decoded as U+FFFD) and while
its end could be the start of a stop string; stop strings are matched across token boundaries
on that stream, so a match ends the output exactly before the string (or after it, with
``include_stop_str_in_output``), in streaming and not.

The engine advances the detokeniser of a request with stop strings after every step that gave
it a token (a match ends the request at once, freeing its KV blocks) and of a streaming request
whenever it emits; a request with neither is decoded once, when it finishes. In a pipelined
engine this work runs while the device computes the next step (see `engine.py`).

Outputs are O(1) per token too: a streaming output's cumulative fields are views of the
request's growing lists (`request.SeqView`), its text is joined only when read, and only the
final output copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spaceserve.runtime.core.request import (
    Request,
    RequestOutput,
    SeqView,
    TextSnapshot,
    TokenLogprob,
)

Decode = Callable[[list[int], bool], str]
REPLACEMENT = "\ufffd"


def make_decoder(tokenizer: Any) -> Decode:
    """``decode(ids, skip_special_tokens)`` of a tokenizer: the Rust backend's own decode when
    the tokenizer is a fast one that adds no post-processing (a few microseconds), else the
    tokenizer's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def held_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `stops`."""
    best = 0
    for s in stops:
        for j in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:j]):
                best = j
                break
    return best


class Detokenizer:
    """Incremental detokenisation of one request's output with stop-string matching (module
    docstring). `ids` is the request's token list (prompt first, `start` tokens of it)."""

    __slots__ = ("decode", "ids", "skip", "stops", "keep_stop", "prefix_offset", "read_offset",
                 "held", "parts", "num_parts_sent", "stop", "stop_at")

    def __init__(self, decode: Decode, ids: list[int], start: int, *, skip_special: bool = True,
                 stops: Sequence[str] = (), include_stop: bool = False,
                 stop_at: int = 0) -> None:
        self.decode, self.ids, self.skip = decode, ids, skip_special
        self.stops, self.keep_stop = tuple(stops), include_stop
        # The window decoded next starts at prefix_offset; text up to read_offset is released.
        # It starts at the output, so the text equals decoding the output ids at once.
        self.prefix_offset = self.read_offset = start
        self.held = ""  # decoded text held back (a possible start of a stop string)
        self.parts: list[str] = []  # released text, in order
        self.num_parts_sent = 0
        self.stop: str | None = None  # the stop string matched
        self.stop_at = stop_at  # stop strings count once the sequence reaches this length

    @property
    def consumed(self) -> int:
        return self.read_offset

    def advance(self, upto: int, *, final: bool = False) -> str | None:
        """Decode tokens up to index `upto`; returns the stop string when one matched (the
        text then ends before it, and later calls do nothing). `final` releases everything
        (an incomplete character as U+FFFD)."""
        if self.stop is not None:
            return self.stop
        new = ""
        if upto > self.read_offset:
            window = self.ids[self.prefix_offset:upto]
            head = self.read_offset - self.prefix_offset
            before = self.decode(window[:head], self.skip) if head else ""
            text = self.decode(window, self.skip)
            if final or not text.endswith(REPLACEMENT):
                new = text[len(before):]
                self.prefix_offset, self.read_offset = self.read_offset, upto
        if self.stops and upto >= self.stop_at:
            return self._match(self.held + new, final)
        if self.held or new:
            self._release(self.held + new)
            self.held = ""
        return None

    def _match(self, buf: str, final: bool) -> str | None:
        first, hit = -1, None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, hit = i, s
        if hit is not None:
            self._release(buf[:first + len(hit)] if self.keep_stop else buf[:first])
            self.held, self.stop = "", hit
            return hit
        keep = 0 if final else held_prefix(buf, self.stops)
        self._release(buf[:len(buf) - keep])
        self.held = buf[len(buf) - keep:]
        return None

    def _release(self, text: str) -> None:
        if text:
            self.parts.append(text)

    def take(self) -> str:
        """Text released since the previous `take`."""
        n = len(self.parts)
        if n == self.num_parts_sent:
            return ""
        delta = self.parts[self.num_parts_sent] if n == self.num_parts_sent + 1 else \
            "".join(self.parts[self.num_parts_sent:])
        self.num_parts_sent = n
        return delta

    def snapshot(self) -> TextSnapshot:
        return TextSnapshot(self.parts, len(self.parts))

    def text(self) -> str:
        return "".join(self.parts)


class OutputProcessor:
    """Builds `RequestOutput`s with the checkpoint's tokenizer (None: token ids only)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.decode: Decode | None = make_decoder(tokenizer) if tokenizer is not None else None

    def needs_text(self, req: Request) -> bool:
        """Whether `req` is detokenised as it goes (it streams or has stop strings)."""
        return self.decode is not None and (req.stream or bool(req.params.stop))

    def detokenizer(self, req: Request) -> Detokenizer:
        """`req`'s detokeniser, made on first use."""
        det = req.detok
        if det is None:
            assert self.decode is not None
            p = req.params
            det = req.detok = Detokenizer(
                self.decode, req.token_ids, req.num_prompt_tokens,
                skip_special=p.skip_special_tokens, stops=p.stop,
                include_stop=p.include_stop_str_in_output,
                stop_at=req.num_prompt_tokens + p.min_tokens)
        return det

    def check_stop(self, req: Request) -> str | None:
        """Advance `req`'s text over its new tokens; the stop string it now ends with, if any
        (its finish reason and stop reason are then set)."""
        hit = self.detokenizer(req).advance(len(req.token_ids))
        if hit is not None:
            req.finish_reason, req.stop_reason = "stop", hit
        return hit

    def add_logprobs(self, reqs: Sequence[Request], rows: list[list[float]]) -> None:
        """Record the step's logprob rows (`sampling_ops.logprob_rows`) on the requests that
        asked, before their tokens are accounted (a request whose draw is dropped is
        skipped)."""
        for req, row in zip(reqs, rows, strict=True):
            lps = req.logprobs
            if lps is None or not req.num_placeholders:
                continue
            k = req.params.logprobs or 0
            width = (len(row) - 3) // 2
            top = tuple(zip(map(int, row[3 + width:3 + width + k]), row[3:3 + k], strict=True))
            lps.append(TokenLogprob(int(row[0]), row[1], int(row[2]), top))

    def make(self, req: Request, finished: bool) -> RequestOutput:
        """The output of `req` now; advances what it has emitted (the ``new`` token ids)."""
        ids, p = req.token_ids, req.num_prompt_tokens
        n = len(ids)
        start = p + req.num_emitted
        new = ids[start:n]
        req.num_emitted = n - p
        lps = req.logprobs
        new_lps = None if lps is None else lps[start - p:]
        text: Any = None
        delta = ""
        if self.decode is not None and (finished or req.stream or req.detok is not None):
            det = self.detokenizer(req)
            if finished:
                upto = n
                by_token = req.finish_reason == "stop" and det.stop is None  # eos / stop id
                if by_token and not req.params.include_stop_str_in_output and n > p:
                    upto = n - 1  # the stop token's own text is not part of the output
                hit = det.advance(upto, final=True)
                if hit is not None and req.finish_reason != "stop":
                    req.finish_reason, req.stop_reason = "stop", hit
                text = det.text()
            else:
                det.advance(n)
                text = det.snapshot()
            delta = det.take()
        if finished:
            return RequestOutput(req.request_id, req.prompt_ids, ids[p:], new, True,
                                 req.finish_reason, req.error, req.metrics(True), delta,
                                 None if lps is None else list(lps), new_lps, req.stop_reason,
                                 text_source=text, index=req.index)
        return RequestOutput(req.request_id, req.prompt_ids, SeqView(ids, p, n), new, False,
                             None, None, req.metrics(False), delta,
                             None if lps is None else SeqView(lps, 0, len(lps)), new_lps,
                             text_source=text, index=req.index)
