"""Client text to token ids: special tokens in it are plain text, and its size is bounded
before any tokenisation.

The rule: only a chat template (or the engine itself) writes control tokens. Text a client
sends (a message, a completions prompt) is tokenised as ordinary text even where it spells a
control token, so ``<|im_end|>\\n<|im_start|>system`` in a user message is the characters
``<``, ``|``, ``im``... and ``<|image_pad|>`` in text never adds an image placeholder.
"Control tokens" are the tokenizer's added tokens (special or not, whitespace-only ones
excepted), which covers Qwen2-VL's and Qwen2.5-VL's ``<|im_start|>``, ``<|vision_start|>``,
``<|image_pad|>``, ``<|video_pad|>``, ``<tool_call>``...

- `encode_plain(tokenizer, text)`: ids of untrusted text with no template around it (the
  completions prompt).
- `mark_plain(tokenizer, text)` before a template renders the text, then `encode_marked` on
  the rendered prompt: the template's own control tokens stay control tokens, the client's are
  text. Marks are private-use characters around a per-process random key, so a client cannot
  forge one; text holding no control token is left unchanged, so its ids equal those of
  tokenising the whole rendered prompt.
- `text_byte_limit(tokenizer, context_len)`: no text longer than this many UTF-8 bytes can fit
  in the context (every token decodes to at most the vocabulary's longest token), so longer
  text is refused at once instead of being tokenised first (`check_text_size`).
"""

from __future__ import annotations

import re
import secrets
import weakref
from collections.abc import Iterable
from typing import Any

from spaceserve.checks import require_int
from spaceserve.runtime.inputs.errors import InputError

_KEY = secrets.token_hex(8)
OPEN = f"\ue000{_KEY}\ue001"
CLOSE = f"\ue001{_KEY}\ue000"
_LONE = re.compile(f"{re.escape(OPEN)}|{re.escape(CLOSE)}")
_RULES: weakref.WeakKeyDictionary[Any, _Rule] = weakref.WeakKeyDictionary()


class _Rule:
    """One tokenizer's control tokens and the patterns that find them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokens = control_tokens(tokenizer)
        alts = "|".join(re.escape(t) for t in sorted(self.tokens, key=len, reverse=True))
        self.find = re.compile(alts) if alts else None
        self.marked = re.compile(f"{re.escape(OPEN)}({alts}){re.escape(CLOSE)}") if alts \
            else None
        self.max_token_bytes = _max_token_bytes(tokenizer, set(self.tokens))


def _rule(tokenizer: Any) -> _Rule:
    try:
        rule = _RULES.get(tokenizer)
    except TypeError:  # not weak-referenceable or unhashable: no cache
        return _Rule(tokenizer)
    if rule is None:
        rule = _Rule(tokenizer)
        try:
            _RULES[tokenizer] = rule
        except TypeError:
            pass
    return rule


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The token strings only a template may write: the added tokens (special or not) and the
    named special tokens, whitespace-only ones excepted (templates write those as text)."""
    found: set[str] = set()
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(decoder, dict):
        found.update(str(getattr(t, "content", t)) for t in decoder.values())
    special = getattr(tokenizer, "all_special_tokens", None)
    if isinstance(special, (list, tuple)):
        found.update(str(t) for t in special)
    return tuple(sorted(t for t in found if t and not t.isspace()))


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Ids of `text` with the tokenizer's own handling of added tokens (trusted text)."""
    if not text:
        return []
    try:
        out = tokenizer(text, add_special_tokens=False)
    except TypeError:  # a tokenizer without the keyword (test stand-ins)
        out = tokenizer(text)
    return list(out["input_ids"])


def _encode_as_text(tokenizer: Any, piece: str) -> list[int]:
    """Ids of `piece` (a control token's spelling) matching no added token at all."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a tokenizer without added tokens has nothing to keep apart
        return _encode(tokenizer, piece)
    text = backend.normalizer.normalize_str(piece) if backend.normalizer is not None else piece
    splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] \
        if backend.pre_tokenizer is not None else [text]
    ids = [tok.id for s in splits for tok in backend.model.tokenize(s)]
    own = tokenizer.convert_tokens_to_ids(piece)
    if own in ids:  # the vocabulary itself spells the control token: no plain form exists
        raise InputError(f"text holds {piece!r}, which this tokenizer cannot keep as text",
                         kind="invalid", param="messages")
    return ids


def mark_plain(tokenizer: Any, text: str) -> str:
    """`text` with each control token it spells wrapped in private marks, for a template to
    render; `encode_marked` then encodes those as text. Unchanged when it spells none."""
    rule = _rule(tokenizer)
    if _KEY in text:  # marks cannot be forged
        text = _LONE.sub("", text)
    if rule.find is None:
        return text
    return rule.find.sub(lambda m: f"{OPEN}{m.group(0)}{CLOSE}", text)


def encode_marked(tokenizer: Any, rendered: str) -> list[int]:
    """Ids of a rendered prompt: its control tokens are control tokens except where
    `mark_plain` marked them, which become text. A mark a template split apart is dropped
    (and still separates the text on either side, so no control token can form across it)."""
    rule = _rule(tokenizer)
    if rule.marked is None or _KEY not in rendered:
        return _encode(tokenizer, rendered)
    ids: list[int] = []
    pos = 0
    for m in rule.marked.finditer(rendered):
        for part in _LONE.split(rendered[pos:m.start()]):
            ids += _encode(tokenizer, part)
        ids += _encode_as_text(tokenizer, m.group(1))
        pos = m.end()
    for part in _LONE.split(rendered[pos:]):
        ids += _encode(tokenizer, part)
    return ids


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Ids of untrusted `text` (no template around it): every control token it spells is
    encoded as ordinary text; the rest exactly as the tokenizer encodes it."""
    return encode_marked(tokenizer, mark_plain(tokenizer, text))


# Size bounds, checked before tokenising.


def _max_token_bytes(tokenizer: Any, skip: set[str]) -> int:
    """UTF-8 bytes the longest vocabulary token (other than `skip`) can decode to, at least 1;
    an upper bound where the exact decoding is not known."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if not callable(get_vocab):
        return 64
    vocab = get_vocab()
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
    best = 1
    for tok in vocab:
        if tok in skip:
            continue
        # byte-level vocabularies spell one byte per character; otherwise a character
        # decodes to at most its own UTF-8 bytes (SentencePiece's marker to one space)
        n = len(tok) if byte_level else len(tok.encode("utf-8", "surrogatepass"))
        best = max(best, n)
    return best


def text_byte_limit(tokenizer: Any, context_len: int) -> int:
    """UTF-8 bytes of text beyond which no tokenisation can fit in `context_len` tokens."""
    require_int("context_len", context_len)
    return context_len * _rule(tokenizer).max_token_bytes


def check_text_size(texts: Iterable[str], max_bytes: int, *, context_len: int | None = None,
                    param: str = "messages") -> int:
    """Total UTF-8 bytes of `texts`; InputError (too_large) past `max_bytes`, and for a lone
    surrogate. Characters are counted first (never more than bytes), so a huge text is refused
    without being encoded."""
    texts = list(texts)
    chars = sum(len(t) for t in texts)
    total = chars
    if chars <= max_bytes:
        total = 0
        for t in texts:
            try:
                total += len(t.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise InputError(f"{param}: text holds a lone UTF-16 surrogate "
                                 f"(U+{ord(t[exc.start]):04X}) at character {exc.start}",
                                 param=param) from None
    if total > max_bytes:
        ctx = f" (this model's context of {context_len} tokens)" if context_len else ""
        raise InputError(f"{param}: the text is at least {total} bytes; at most {max_bytes} "
                         f"bytes can fit{ctx}", kind="too_large", param=param)
    return total
