"""Per-request bounds: how many sequences one request may run, and how many tokens it may
generate in all, so that one client's single request cannot fill the batch or the KV cache.

A request runs prompts x ``n`` sequences (chat: one prompt; /v1/completions: up to 64). They
are bounded by ``--max-seqs-per-request`` (default: the engine's ``max_num_seqs``, the batch
the engine runs at once). Every sequence may generate up to ``max_tokens``; the request's
total, sequences x ``max_tokens``, may be bounded by ``--max-tokens-per-request`` (default:
none, as in vLLM: the engine's fair share already keeps one request from holding more than its
share of the batch and the KV cache while others wait; set it to bound one request's work). A
request without ``max_tokens`` gets the rest of the context per sequence, capped at its share
of that budget when one is set. Both bounds are checked before any preprocessing; each refusal is a
400 whose ``param`` names the parameter to change (``n``, ``prompt``, ``max_tokens``) and whose
message names the bound and its flag. One engine and engine replicas apply the same bounds
(the replicas report their engine's ``max_num_seqs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spaceserve.checks import require_int
from spaceserve.server.openai.sampling import max_choices
from spaceserve.server.transport.errors import APIError

SEQS_FLAG = "--max-seqs-per-request"
TOKENS_FLAG = "--max-tokens-per-request"


@dataclass(frozen=True)
class RequestBounds:
    """Sequences (`max_seqs`) and generated tokens in all (`max_tokens`) one request may
    ask for; None: unbounded."""

    max_seqs: int | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        require_int("max_seqs_per_request", self.max_seqs, optional=True)
        require_int("max_tokens_per_request", self.max_tokens, optional=True)

    @classmethod
    def for_engine(cls, engine: Any, max_seqs: int | None = None,
                   max_tokens: int | None = None) -> RequestBounds:
        """The bounds given, or where None the engine's defaults: `max_num_seqs` sequences and
        no bound on the tokens of all of them."""
        return cls(max_seqs if max_seqs is not None else max_choices(engine), max_tokens)

    def check(self, prompts: int, n: int, max_tokens: int | None,
              tokens_param: str = "max_tokens") -> int | None:
        """APIError 400 when `prompts` x `n` sequences, or that many times `max_tokens`
        generated tokens, are over the bounds; else the cap of each sequence's default output
        length when `max_tokens` is None (its share of the budget; None: no cap).
        `tokens_param` is the field that set `max_tokens` (chat: ``max_completion_tokens``
        when given)."""
        seqs = prompts * n
        if self.max_seqs is not None and seqs > self.max_seqs:
            what = f"{prompts} prompts x n={n} = {seqs} sequences" if prompts > 1 \
                else f"n={n} sequences"
            param = "n" if n > self.max_seqs or prompts == 1 else "prompt"
            raise APIError(400, f"{param}: {what} are more than one request may run "
                           f"(at most {self.max_seqs}, {SEQS_FLAG})", param=param)
        if self.max_tokens is None:
            return None
        if max_tokens is None:
            if seqs > self.max_tokens:
                raise APIError(400, f"n: {seqs} sequences cannot each generate a token within "
                               f"the {self.max_tokens} tokens one request may generate "
                               f"({TOKENS_FLAG})", param="n")
            return self.max_tokens // seqs
        if seqs * max_tokens > self.max_tokens:
            raise APIError(400, f"{tokens_param}: {seqs} sequences x {tokens_param}="
                           f"{max_tokens} = {seqs * max_tokens} tokens, more than one request "
                           f"may generate (at most {self.max_tokens}, {TOKENS_FLAG}; with "
                           f"{seqs} sequences, {tokens_param} <= {self.max_tokens // seqs})",
                           param=tokens_param)
        return None


__all__ = ["SEQS_FLAG", "TOKENS_FLAG", "RequestBounds"]
