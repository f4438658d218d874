"""A settings field with its documentation and, where it has one, its command-line flag.

`setting` declares an `EngineConfig` field once: its default, the one text that documents it
(shown as the flag's help), and a `Flag` saying how a command line sets it. `engine/args.py`
turns these declarations into argparse flags and parsed flags back into an `EngineConfig`, so
a flag's name, help and default live next to the field and nowhere else. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Flag:
    """How a command line sets a field.

    `names`: the option strings (the first long one names the parsed attribute, as argparse
    does; a `negate` flag ``--no-X`` is stored as ``X``). `type` parses the flag's text
    (ValueError with a message on bad text); `choices` bounds it. `to_field` / `from_field`
    convert between the flag's unit and the field's (``--encoder-window-ms`` sets a field in
    seconds); the flag's default is `from_field` of the field's. `negate`: a bool field the flag
    turns off. `help`: the flag's own text where the field's doc reads wrongly for it."""

    names: tuple[str, ...]
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    negate: bool = False
    to_field: Callable[[Any], Any] | None = None
    from_field: Callable[[Any], Any] | None = None
    help: str | None = None

    @property
    def dest(self) -> str:
        """The attribute of the parsed arguments holding the flag's value."""
        long = next(n for n in self.names if n.startswith("--"))[2:]
        if self.negate:
            long = long.removeprefix("no-")
        return long.replace("-", "_")


def setting(default: Any, doc: str, flag: Flag | None = None) -> Any:
    """A dataclass field with `default`, documented by `doc` (a flag's help unless the flag
    says its own), set on the command line by `flag` when given."""
    return field(default=default, metadata={"doc": doc, "flag": flag})


def parse_ints(text: str) -> tuple[int, ...]:
    """``"32,48,64"`` -> (32, 48, 64); ValueError naming the bad entry."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"{part!r} is not an integer (want e.g. 32,48,64)") from None
    if not out:
        raise ValueError(f"{text!r}: no integer given (want e.g. 32,48,64)")
    return tuple(out)


def ms_to_s(ms: float) -> float:
    return ms / 1e3


def s_to_ms(s: float) -> float:
    return s * 1e3


__all__ = ["Flag", "ms_to_s", "parse_ints", "s_to_ms", "setting"]
