"""`spaceserve <cmd> --help`: answered before anything heavy is imported, usage names the
command, every flag has help text and shows its default. (How fast it is, is measured by
bench/serving/cli_help.py, never asserted here.)"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from spaceserve.cli import COMMANDS

HEAVY = ("torch", "triton", "transformers", "fastapi", "uvicorn",
         "spaceserve.runtime.engine.engine",
         "spaceserve.kernels")
HELP_CASES = [(name,) for name in COMMANDS] + [("bench", "serve")]


def parsers() -> dict[str, argparse.ArgumentParser]:
    """{command: its parser}, from each command's light parser builder."""
    out = {}
    for name, (module, _, *light) in COMMANDS.items():
        where, _, func = (light[0] if light else f"{module}:build_parser").partition(":")
        out[name] = getattr(importlib.import_module(where), func)()
    out["bench serve"] = importlib.import_module("spaceserve.bench.serve").build_parser()
    return out


@pytest.mark.parametrize("cmd", HELP_CASES, ids=[" ".join(c) for c in HELP_CASES])
def test_help_imports_nothing_heavy(cmd: tuple[str, ...]) -> None:
    code = ("import sys\nfrom spaceserve import cli\ntry:\n    cli.main(sys.argv[1:])\n"
            "except SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *cmd, "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(f"usage: spaceserve {' '.join(cmd)}"), lines[0]
    assert lines[-1] == "HEAVY []", lines[-1]


def test_every_flag_has_help_and_a_default_shown() -> None:
    for name, parser in parsers().items():
        assert parser.prog == f"spaceserve {name}", parser.prog
        # the formatter appends "(default: X)" unless the help says what the default is
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter), name
        text = parser.format_help()
        assert "(default: None)" not in text, (name, text)
        # a switch shows its default in its own sense ("prefix caching on"), never the stored
        # bool, which reads as the switch's state ("--no-prefix-caching ... (default: True)")
        assert "(default: True)" not in text and "(default: False)" not in text, (name, text)
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, f"spaceserve {name} {action.option_strings[-1]}: no help"


def test_compile_check_runs_through_its_light_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from spaceserve import cli

    seen = {}

    class Fake:
        @staticmethod
        def run(args):
            seen["args"] = args
            return 4

    monkeypatch.setitem(sys.modules, "fake_heavy_mod", Fake)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_heavy_mod", "a heavy tool",
                                               "spaceserve.cli_args:build_compile_check_parser"))
    assert cli.main(["fake", "--jobs", "3", "--no-spills"]) == 4
    assert seen["args"].jobs == 3 and seen["args"].no_spills and seen["args"].module is None


def test_top_level_help_lists_every_bench_suite() -> None:
    """`spaceserve --help` names each `spaceserve bench SUITE`, not just the first."""
    from spaceserve import cli
    from spaceserve.bench.cli import SUITES

    text = " ".join(cli.build_parser().format_help().split())
    for suite in SUITES:
        assert f"`bench {suite}`" in text, (suite, text)
