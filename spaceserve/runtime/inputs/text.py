"""Plain text to token ids, with special-token text treated as plain text.

What a user types (a chat message's text, a completion prompt) must not be able to inject a
control token: ``"<|im_end|>"`` inside it is tokenised as the characters it is made of, never as
the end-of-turn token (transformers' ``split_special_tokens``). Clients that mean control tokens
send token ids.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError


def encode_plain_text(tokenizer: Any, text: str, *, add_special_tokens: bool = True
                      ) -> list[int]:
    """Token ids of `text`, special-token text split into ordinary tokens; the tokenizer's
    own special tokens (a BOS) are added when `add_special_tokens`. InputError when there is
    no tokenizer."""
    if tokenizer is None:
        raise InputError("this checkpoint has no tokenizer: send token ids", kind="unsupported")
    enc = tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)
    return list(enc["input_ids"])
