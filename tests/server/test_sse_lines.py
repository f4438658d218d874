"""One server-sent event is one line for every client: the characters str.splitlines() (and so
httpx's ``aiter_lines``) takes as line ends are escaped in the JSON, which stays the same."""

import json

import pytest

from spaceserve.server.openai.protocol import sse

TEXTS = ["a\x85b", "c\u2028d", "e\u2029f", "g\x1ch\x0bi\x0cj\x1d\x1e", "plain é ✓ 😀"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_event_is_one_line(text: str) -> None:
    from httpx._decoders import LineDecoder

    raw = sse({"choices": [{"delta": {"content": text}}]})
    lines = [ln for ln in LineDecoder().decode(raw.decode()) if ln]
    assert len(lines) == 1 and lines[0].startswith("data: {")
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["content"] == text
    assert raw.decode().count("\n") == 2  # the event's own blank line only
