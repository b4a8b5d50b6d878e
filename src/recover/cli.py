"""The ``recover`` command.

Each sub-command lives next to the code it drives, in a module exposing ``register(subparsers)``
that adds its parser and sets ``func(args) -> int``. This file only lists those modules, so the
command stays cheap to start (torch is imported by a sub-command only when it runs).

A write to stdout or stderr that the storage refuses (a log on a full disk) is lost, never the process.
Bad input never ends in a traceback: a :class:`~recover.errors.RecoverError` (a config error
among them) and a malformed command line are both one line on stderr, ``recover: error: ...``,
with exit status 2. Any other exception (a bug, a failure nobody foresaw) is one line too, naming its
type, message and place, with exit status 1; ``recover --debug ...`` (or ``RECOVER_DEBUG=1``, which the
processes a command starts inherit) lets its traceback through instead. ``recover worker`` and ``recover
coordinator``, whose stderr is a log file, keep the traceback in it above the line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import traceback
import typing

from recover import __version__
from recover.errors import RecoverError

# Modules that register sub-commands, in the order `recover --help` lists them.
COMMAND_MODULES = (
    "recover.launch.demo",  # demo
    "recover.train.processes.cli",  # train
    "recover.train.checkpoints.checkpoint_cli",  # sample, export
    "recover.data.cli",  # prepare
    "recover.launch.cli",  # launch, compare, worker
    "recover.launch.forkserver",  # forkserver (internal)
    "recover.launch.report",  # report
    "recover.launch.collect",  # collect
    "recover.launch.status",  # status
    "recover.coord.cli",  # coordinator
    "recover.ops.check",  # check
    "recover.bench.cli",  # bench ...
    "recover.sim.cli",  # simulate
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (sub-command parsers inherit the class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="recover",
        description="Resilient LLM pre-training: keep the training trajectory through replica failures.",
    )
    parser.add_argument("--version", action="version", version=f"recover {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="let an unexpected error's traceback through (also RECOVER_DEBUG=1; inherited by the "
                             "processes the command starts)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def one_line(text: str) -> str:
    """``text`` with its lines joined by ``; ``: an error message is always one line."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


class _Tolerant:
    """A text stream whose writes never raise the storage's errors: a process whose log is on a full disk
    (its stdout and stderr are files ``recover launch`` opened) trains on; what it could not say is lost,
    never the process."""

    def __init__(self, stream: typing.TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> typing.Any:
        return getattr(self.stream, name)


def main(argv: list[str] | None = None) -> int:
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if isinstance(s, _Tolerant) else _Tolerant(s) for s in streams)  # type: ignore
    try:
        code = _main(argv)
    finally:
        sys.stdout, sys.stderr = streams
    dist = sys.modules.get("recover.train.replicas.dist")
    if dist is not None and getattr(dist, "abandoned", None) is not None:  # a teardown left waiting for good:
        sys.stdout.flush()  # ending normally would wait on it again in the interpreter's own teardown
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str] | None) -> int:
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR2") and threading.current_thread() is threading.main_thread():
        try:  # `kill -USR2 PID`: every thread's stack, on the process's standard error
            faulthandler.register(signal.SIGUSR2, all_threads=True)
        except (OSError, ValueError, AttributeError):  # a standard error without a descriptor (captured)
            pass
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    script: list[str] = []
    if "--" in argv:  # recover launch [flags] -- CMD ...: the replicas run CMD
        script, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    args, extra = parser.parse_known_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the coordinator and workers a launch starts inherit it
    if script and args.command != "launch":
        parser.error("only `recover launch ... -- CMD` takes a command after --")
    args.script = script
    if args.command is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        result = args.func(args)
        if isinstance(result, list):  # a worker forked by `recover forkserver`: it runs its own command line
            return _main(result)
        return int(result or 0)
    except RecoverError as exc:
        print(f"recover: error: {one_line(str(exc))}", file=sys.stderr)
        if args.command == "worker":
            from recover.train.processes.exits import record_exit

            record_exit(2)
        return 2
    except KeyboardInterrupt:
        print("recover: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        if args.command in LOGGED:  # its stderr is a log file: the traceback is kept there, above the line
            traceback.print_exc()
        print(f"recover: internal error: {unexpected(exc)}; run `recover --debug {args.command} ...` for the "
              "traceback", file=sys.stderr)
        return 1


DEBUG_ENV = "RECOVER_DEBUG"
LOGGED = ("worker", "coordinator")
"""Commands whose stderr is a log file (a launcher's, a cluster recipe's): an unexpected error's traceback is kept
there, above its one line; the launcher shows the line and the log's path."""


def unexpected(exc: BaseException) -> str:
    """One line for an exception nobody foresaw: its type, message and the innermost frame of recover's own."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if f"{os.sep}recover{os.sep}" in f.filename] or frames
    where = f" (at {os.path.basename(ours[-1].filename)}:{ours[-1].lineno} in {ours[-1].name})" if ours else ""
    return f"{type(exc).__name__}: {one_line(str(exc)) or '(no message)'}{where}"


if __name__ == "__main__":
    sys.exit(main())
