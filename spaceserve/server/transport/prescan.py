"""A structural pre-scan of a request body's JSON text, before any full parse.

`json.loads` and pydantic cost time and memory in proportion to the number of values a body
holds, not its size: 30 MB of ``0,`` is 15 million ints (seconds of parsing and validation,
gigabytes of objects), 28 MB of ``{"role":"user","content":""},`` is 900,000 messages. So a
body is first walked as text, token by token between the structural characters (``[]{}"``):
strings are skipped by the json module's C scanner, runs of scalars and separators are
counted with ``str.count``, so the walk's Python steps are one per string or container. It
stops at the first bound passed, which makes it cheap for exactly the bodies it refuses:

- nesting deeper than `ScanLimits.max_depth` levels (400);
- more than `max_messages` messages (``messages``), or more than `max_parts` content parts in
  one message (400, naming the flag);
- a ``prompt`` of more than `max_prompts` prompts, or a token-id list longer than
  `max_prompt_ids` (the context length; 400);
- any other array or object of more than `max_array` elements, more than `max_strings`
  strings or `max_containers` arrays and objects in the body, or more than `max_values`
  values in all (413).

It does not validate: a body that is not JSON is left to the parser, which fails no later
than where the scan stopped. `cancel_point` (the preprocessing pool's) is checked every few
thousand steps, so a scan whose request timed out or went away stops.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from json.decoder import scanstring  # the C scanner when the interpreter has it

from spaceserve.server.transport.errors import APIError

_TOKEN = re.compile(r'[\[\]{}"]')
_VALUE = re.compile(r"[^\s,:]")  # a scalar (number, true, false, null) in a run
CANCEL_EVERY = 4096  # walk steps between cancel checks
RUN_PIECE = 1 << 20  # characters of a run searched or counted by one C call


@dataclass(frozen=True)
class ScanLimits:
    """The pre-scan's bounds (module docstring); `max_prompt_ids` None: no token-id bound
    beyond `max_array`."""

    max_depth: int = 32
    max_messages: int = 10_000
    max_parts: int = 1_000
    max_prompts: int = 64
    max_prompt_ids: int | None = None
    max_array: int = 200_000
    max_strings: int = 400_000
    max_containers: int = 100_000
    max_values: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_messages", "max_parts", "max_prompts", "max_array",
                     "max_strings", "max_containers", "max_values"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.max_prompt_ids is not None and (isinstance(self.max_prompt_ids, bool) or not
                                                isinstance(self.max_prompt_ids, int) or
                                                self.max_prompt_ids < 1):
            raise ValueError(f"max_prompt_ids={self.max_prompt_ids!r} must be an int >= 1")

    def values_bound(self) -> int:
        """Values in a body at most: `max_values`, plus room for a full batch of token-id
        prompts."""
        return self.max_values + self.max_prompts * (self.max_prompt_ids or 0)


class _Frame:
    """An open array or object: its kind (``root``, ``messages``, ``message``, ``parts``,
    ``prompt``, ``ids``, ``other``), separators seen, whether it holds anything, and, for an
    object, the last key and whether a value is due."""

    __slots__ = ("any", "commas", "due", "index", "key", "kind", "nested", "obj")

    def __init__(self, kind: str, obj: bool, index: int = 0) -> None:
        self.kind, self.obj, self.index = kind, obj, index
        self.commas = 0
        self.any = self.due = self.nested = False
        self.key: str | None = None


def _refuse(status: int, message: str, param: str | None = None) -> APIError:
    return APIError(status, message, param=param,
                    code="body_too_complex" if status == 413 else None)


def _check(f: _Frame, lim: ScanLimits) -> None:
    """APIError once frame `f` holds more elements than its kind may (commas + 1 of them)."""
    n = f.commas + 1
    if f.kind == "messages":
        if n > lim.max_messages:
            raise _refuse(400, f"messages: more than {lim.max_messages} messages in one request"
                          " (--max-messages-per-request)", "messages")
    elif f.kind == "parts":
        if n > lim.max_parts:
            raise _refuse(400, f"messages[{f.index}].content: more than {lim.max_parts} content"
                          " parts in one message (--max-parts-per-message)",
                          f"messages[{f.index}].content")
    elif f.kind == "prompt":
        bound = lim.max_prompts if f.nested else max(lim.max_prompts, lim.max_prompt_ids or
                                                     lim.max_array)
        if n > bound:
            what = f"{lim.max_prompts} prompts per request" if bound == lim.max_prompts else \
                f"{bound} token ids (the context length)"
            raise _refuse(400, f"prompt: more than {what}", "prompt")
    elif f.kind == "ids" and lim.max_prompt_ids is not None:
        if n > lim.max_prompt_ids:
            raise _refuse(400, f"prompt[{f.index}]: more than {lim.max_prompt_ids} token ids "
                          "(the context length)", "prompt")
    elif n > lim.max_array:
        raise _refuse(413, f"request body holds an array or object of more than "
                      f"{lim.max_array} elements")


def _kind(parent: _Frame | None, bracket: str) -> tuple[str, int]:
    """The kind of a container opening with `bracket` inside `parent`, and its index there."""
    if parent is None:
        return "root", 0
    key, arr = parent.key if parent.obj else None, bracket == "["
    if parent.kind == "root" and arr and key == "messages":
        return "messages", 0
    if parent.kind == "root" and arr and key == "prompt":
        return "prompt", 0
    if parent.kind == "messages" and not arr:
        return "message", parent.commas
    if parent.kind == "message" and arr and key == "content":
        return "parts", parent.index
    if parent.kind == "prompt" and arr:
        return "ids", parent.commas
    return "other", 0


def scan_json(text: str, limits: ScanLimits, cancel_point: Callable[[], None] = lambda: None
              ) -> None:
    """Walk `text` (a request body's JSON) and raise APIError at the first bound it passes
    (module docstring); returns quietly for bodies within them, and for text that is not JSON
    (the parser says what is wrong)."""
    lim, n, pos = limits, len(text), 0
    stack: list[_Frame] = []
    strings = containers = values = steps = 0
    max_values = lim.values_bound()
    search, count, any_value = _TOKEN.search, text.count, _VALUE.search
    while True:
        while True:  # to the next token, in pieces: one C call never holds the GIL for long
            stop = min(pos + RUN_PIECE, n)
            m = search(text, pos, stop)
            end = m.start() if m is not None else stop
            if end > pos and stack:
                top = stack[-1]
                c = count(",", pos, end)
                if c:
                    values += c
                    top.commas += c
                    top.due = False
                    _check(top, lim)
                    if values > max_values:
                        raise _refuse(413, f"request body holds more than {max_values} JSON "
                                      "values")
                if not top.any and any_value(text, pos, end):
                    top.any = True
            pos = end
            if m is not None or stop >= n:
                break
        if m is None:
            return
        steps += 1
        if steps % CANCEL_EVERY == 0:
            cancel_point()
        ch = text[end]
        if ch == '"':
            try:
                s, pos = scanstring(text, end + 1, True)
            except ValueError:  # not JSON: the parser reports it
                return
            strings += 1
            if strings > lim.max_strings:
                raise _refuse(413, f"request body holds more than {lim.max_strings} strings")
            if stack:
                top = stack[-1]
                top.any = True
                if top.kind == "prompt":
                    top.nested = True
                    _check(top, lim)
                if top.obj and not top.due:
                    top.key, top.due = (s if top.kind in ("root", "message") else None), True
                elif top.obj:
                    top.due = False
            continue
        pos = end + 1
        if ch in "[{":
            containers += 1
            if containers > lim.max_containers:
                raise _refuse(413, f"request body holds more than {lim.max_containers} arrays "
                              "and objects")
            if len(stack) >= lim.max_depth:
                raise _refuse(400, f"request body nests JSON deeper than {lim.max_depth} "
                              "levels")
            parent = stack[-1] if stack else None
            kind, index = _kind(parent, ch)
            if parent is not None:
                parent.any = True
                if parent.kind == "prompt":
                    parent.nested = True
                    _check(parent, lim)
            stack.append(_Frame(kind, ch == "{", index))
        else:
            if not stack:
                return
            stack.pop()
            if stack and stack[-1].obj:
                stack[-1].due = False


__all__ = ["ScanLimits", "scan_json"]
