"""Every ``recover`` command starts: for each sub-command the parser registers (``recover bench`` ones too), every
recover import its entry point can reach resolves. That is each ``import`` and ``from ... import`` of the module
that defines the function the command dispatches to, module-level and deferred (inside functions: they run only
after parsing, where ``--help`` never looks), and so on through every recover module those reach. A name that
left its module fails here, not on a user's first run."""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from recover.cli import build_parser


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, Callable]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*prefix, name))
    if prefix and parser.get_default("func") is not None:
        yield " ".join(prefix), parser.get_default("func")


COMMANDS = dict(commands(build_parser()))


@functools.cache
def imported(module: str) -> tuple[str, ...]:
    """The recover modules ``module``'s import statements (anywhere in it) name; fails on a name that is not there."""
    found = []
    for node in ast.walk(ast.parse(Path(importlib.util.find_spec(module).origin).read_text())):
        pairs = ([(a.name, None) for a in node.names] if isinstance(node, ast.Import) else
                 [(node.module, a.name) for a in node.names] if isinstance(node, ast.ImportFrom) else [])
        for target, name in (pair for pair in pairs if pair[0].split(".")[0] == "recover"):
            try:
                value = importlib.import_module(target)
            except ImportError as exc:
                pytest.fail(f"{module}: {exc}")
            if name is not None and (hasattr(value, "__path__") and importlib.util.find_spec(f"{target}.{name}")):
                value = importlib.import_module(f"{target}.{name}")  # a submodule
            else:
                assert name is None or hasattr(value, name), f"{module}: cannot import {name!r} from {target}"
            found.append(value.__name__)
    return tuple(found)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_imports_resolve(command: str) -> None:
    seen, todo = set(), [COMMANDS[command].__module__]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(imported(module))


def test_every_command_is_found() -> None:
    assert {"train", "launch", "coordinator", "bench coordinator", "bench collectives", "sample"} <= set(COMMANDS)
