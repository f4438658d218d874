"""Log-probabilities in OpenAI's two wire formats, from the engine's `TokenLogprob`s.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}``. Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}``, where the sampled token is always among its position's top
logprobs. A token's text is the token decoded alone (a byte that is part of a multi-byte
character decodes to U+FFFD, its bytes then say what it is); texts are cached per id. With
``return_tokens_as_token_ids`` (vLLM's extension) a token is written ``token_id:<id>`` instead,
which is unambiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FLOOR = -9999.0  # OpenAI's stand-in for a -inf logprob


class TokenText:
    """Token id -> (text, UTF-8 bytes) with the tokenizer, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, tid: int, as_id: bool = False) -> tuple[str, list[int]]:
        if as_id:
            text = f"token_id:{tid}"
            return text, list(text.encode())
        hit = self._cache.get(tid)
        if hit is None:
            if self.tokenizer is None:
                text = f"token_id:{tid}"
            else:
                text = self.tokenizer.decode([tid], skip_special_tokens=False)
            hit = self._cache[tid] = (text, list(text.encode("utf-8", errors="replace")))
        return hit


def _lp(x: float) -> float:
    return x if x > FLOOR else FLOOR


def chat_logprobs(entries: Sequence[Any], text: TokenText, as_ids: bool = False
                  ) -> dict[str, Any]:
    """The chat ``logprobs`` object of these tokens' entries."""
    content = []
    for e in entries:
        tok, raw = text(e.token_id, as_ids)
        top = []
        for tid, lp in e.top:
            t, b = text(tid, as_ids)
            top.append({"token": t, "logprob": _lp(lp), "bytes": b})
        content.append({"token": tok, "logprob": _lp(e.logprob), "bytes": raw,
                        "top_logprobs": top})
    return {"content": content}


def completion_logprobs(entries: Sequence[Any], text: TokenText, offset: int,
                        as_ids: bool = False) -> tuple[dict[str, Any], int]:
    """(the completions ``logprobs`` object of these entries, the text offset after them);
    `offset` is where their text starts in the choice's text. Tokens of the same text keep
    the most likely one's logprob."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tok, _ = text(e.token_id, as_ids)
        tokens.append(tok)
        lps.append(_lp(e.logprob))
        top: dict[str, float] = {}
        for tid, lp in e.top:
            top.setdefault(text(tid, as_ids)[0], _lp(lp))
        top.setdefault(tok, _lp(e.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(text(e.token_id)[0])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}, offset
