"""The documentation says what the code does: README.md and docs/ are checked, not trusted.

- Every ``spaceserve ...`` command in a fenced shell block of README.md or docs/ (and every
  inline one in README.md and docs/running-a-real-model.md) parses with the real argument
  parsers of `spaceserve.cli.COMMANDS`, without running.
- Every repository path the docs cite exists, and every relative link points at a file.
- Nothing in the repository cites a DESIGN.md (the design lives in docs/design.md).
- README.md stays short and keeps CI's test command; each results page names the commit and
  the command behind its figures.

The README's examples run against a live server in tests/test_readme_examples.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from spaceserve.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
REAL_MODEL = DOCS / "running-a-real-model.md"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "console", "shell", ""}


def fenced_shell(text: str) -> list[str]:
    """The shell command lines of `text`'s fenced shell blocks, continuation lines joined."""
    lines = []
    for lang, body in FENCE.findall(text):
        if lang in SHELL:
            lines += body.replace("\\\n", " ").splitlines()
    return lines


def spaceserve_argv(line: str) -> list[str] | None:
    """The arguments after ``spaceserve`` in one shell line (comments dropped), or None."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    start = 0
    for i, word in enumerate([*words, "&&"]):
        if word in ("&&", "||", ";", "|"):  # one command of a list or pipeline at a time
            segment = words[start:i]
            start = i + 1
            while segment and "=" in segment[0]:  # VAR=value assignments before the command
                segment = segment[1:]
            if segment and (segment[0] == "spaceserve" or segment[0].endswith("/spaceserve")):
                return [w for w in segment[1:] if w != "&"]
    return None


def commands(path: Path) -> list[tuple[str, list[str]]]:
    """(the line as written, its arguments) of every ``spaceserve`` command in `path`."""
    text = path.read_text()
    lines = fenced_shell(text)
    if path in (README, REAL_MODEL):
        lines += re.findall(r"`((?:\S*/)?spaceserve [^`]+)`", FENCE.sub("", text))
    found = []
    for line in lines:
        argv = spaceserve_argv(line)
        if argv is not None:
            found.append((line.strip(), argv))
    return found


def parser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The real parser of the (sub)command `argv` names, and the arguments it gets."""
    name, rest = argv[0], argv[1:]
    assert name in COMMANDS, f"spaceserve has no command {name!r} (it has {sorted(COMMANDS)})"
    module, _, *light = COMMANDS[name]
    if name == "bench":
        from spaceserve.bench.cli import SUITES

        assert rest and rest[0] in SUITES, f"spaceserve bench has no suite {rest[:1]}"
        module, rest = SUITES[rest[0]][0], rest[1:]
        light = []
    where, _, func = (light[0] if light else f"{module}:build_parser").partition(":")
    return getattr(importlib.import_module(where), func)(), rest


def parse(argv: list[str]) -> argparse.Namespace:
    parser, rest = parser_for(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(rest)
    except SystemExit:
        message = err.getvalue().strip().splitlines()[-1:]  # argparse's error line
        raise AssertionError(f"spaceserve {' '.join(argv)}: {message}") from None


ALL_COMMANDS = [(p.relative_to(ROOT).as_posix(), line, argv)
                for p in PAGES for line, argv in commands(p)]


@pytest.mark.parametrize("page,line,argv", ALL_COMMANDS,
                         ids=[f"{p}:{' '.join(a[:2])}" for p, _, a in ALL_COMMANDS])
def test_documented_command_parses(page: str, line: str, argv: list[str]) -> None:
    parse(argv)


def test_the_pages_that_must_have_commands_have_them() -> None:
    readme = {a[0] for _, a in commands(README)}
    assert {"serve", "bench"} <= readme, readme
    real = [a for _, a in commands(REAL_MODEL)]
    serve = [a for a in real if a[0] == "serve"]
    assert serve, "docs/running-a-real-model.md shows no `spaceserve serve`"
    assert parse(serve[0]).model.startswith("models/"), serve[0]


def test_a_wrong_flag_is_caught() -> None:
    # the check above is only worth something if a command the CLI refuses fails it
    (line, argv), = commands_of("```bash\n.venv/bin/spaceserve serve --no-such-flag 1\n```\n")
    with pytest.raises(AssertionError, match="no-such-flag"):
        parse(argv)
    with pytest.raises(AssertionError, match="no command"):
        parse(["serv", "--model", "tiny"])


def commands_of(text: str) -> list[tuple[str, list[str]]]:
    return [(line, argv) for line in fenced_shell(text)
            if (argv := spaceserve_argv(line)) is not None]


# --- cited paths and links ------------------------------------------------------------------

# bench/ scripts are cited by their `python -m bench.x` commands and are not checked here.
CITED = re.compile(r"`((?:spaceserve|autotune|tests|scripts|docs|runtime|models|server|kernels)"
                   r"/[\w./-]*)")
IN_PACKAGE = ("runtime/", "models/", "server/", "kernels/")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def cited_paths(path: Path) -> list[str]:
    return [m for m in CITED.findall(path.read_text()) if not re.search(r"[<>*{}]", m)]


def resolve(cited: str) -> Path:
    return ROOT / ("spaceserve/" + cited if cited.startswith(IN_PACKAGE) else cited)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_cited_paths_and_links_exist(page: str | Path) -> None:
    page = Path(page)
    missing = [c for c in cited_paths(page) if not resolve(c.rstrip(".")).exists()]
    for target in LINK.findall(page.read_text()):
        if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
            missing.append(f"link {target}")
    assert not missing, f"{page.relative_to(ROOT)} cites what is not there: {missing}"


def test_nothing_cites_a_design_md() -> None:
    hits, this = [], Path(__file__).resolve()
    for top in ("spaceserve", "autotune", "bench", "tests", "scripts", ".ci", "docs"):
        for f in (ROOT / top).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".md", ".sh", "") and f != this:
                hits += [f"{f.relative_to(ROOT)}:{i}" for i, line in
                         enumerate(f.read_text(errors="replace").splitlines(), 1)
                         if "DESIGN.md" in line]
    hits += [f"README.md:{i}" for i, line in enumerate(README.read_text().splitlines(), 1)
             if "DESIGN.md" in line]
    assert not hits, f"cite docs/design.md instead: {hits}"


# --- the README and the results -------------------------------------------------------------

def test_readme_is_short_and_keeps_the_quick_start() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    # CI runs the second command; both are the quick start a new user copies
    assert "bash scripts/setup.sh && .venv/bin/spaceserve bench serve" in text
    assert "bash scripts/setup.sh && .venv/bin/python -m pytest -q" in text
    for page in sorted(DOCS.glob("*.md")):
        assert f"docs/{page.name}" in text, f"README's map of docs/ misses {page.name}"


RESULTS = sorted((DOCS / "results").glob("*.md"))


@pytest.mark.parametrize("page", [p for p in RESULTS if p.name != "README.md"],
                         ids=lambda p: p.name)
def test_results_carry_provenance(page: Path) -> None:
    text = page.read_text()
    assert re.search(r"\bcommit [0-9a-f]{7,40}\b", text), f"{page.name}: no commit"
    assert re.search(r"\b20\d\d-\d\d-\d\d\b", text), f"{page.name}: no date"
    assert any(spaceserve_argv(line) is not None or "python -m " in line
               for line in fenced_shell(text)), f"{page.name}: no command"
    intro = text.split("\n\n", 2)[1]
    assert re.search(r"\b(Modelled|Measured)\b", intro), \
        f"{page.name}: does not say up front whether it is measured or modelled"
    assert page.name in (DOCS / "results" / "README.md").read_text(), page.name


def test_serving_flag_table_names_real_flags() -> None:
    parser, _ = parser_for(["serve"])
    flags = {o for a in parser._actions for o in a.option_strings}
    rows = "\n".join(line for line in (DOCS / "serving.md").read_text().splitlines()
                     if line.startswith("| "))
    cited = set(re.findall(r"`(--?[a-z][a-z-]*)`", rows))
    assert {"--model", "--mode", "--max-pending"} <= cited, "the flag table is gone"
    assert cited <= flags, f"docs/serving.md names flags serve does not have: {cited - flags}"
