"""`--help` works for every `kvfleet` command and subcommand: the parser is walked, so a command
added later is covered without being named here."""
from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from services.cli.cli import Delegate, build_parser, main


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every command path under `parser` (("bench",), ("bench", "serve") ...), parents first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*path, name)
                yield from _commands(child, (*path, name))


COMMANDS = [()] + list(_commands(build_parser()))


def test_the_walk_finds_the_nested_and_the_delegated_commands():
    assert ("bench",) in COMMANDS and ("bench", "telemetry") in COMMANDS
    assert ("sim", "run") in COMMANDS and ("serve",) in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(("kvfleet", *c)))
def test_help_of_every_command_exits_0_and_prints_its_usage(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main([*command, "--help"])
    assert exited.value.code in (0, None)
    assert "usage:" in out.getvalue()


def test_a_delegate_help_is_shown_in_its_parents_list_with_a_literal_percent():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "tracing (100%)" in out.getvalue()
    assert isinstance(build_parser().parse_known_args(["bench", "telemetry"])[0].delegate, Delegate)
