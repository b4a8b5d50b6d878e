"""Every process the launcher starts dies with it, whatever kills the launcher.

Contract:
- :func:`child_env` marks a child's environment with the launcher's PID (``RECOVER_LAUNCHER_PID``).
- :func:`die_with_launcher`, called first thing by a marked child (``recover worker``, ``recover
  coordinator``), asks the kernel to SIGKILL it when the launcher dies (Linux ``PR_SET_PDEATHSIG``:
  it fires even when the launcher itself was SIGKILLed and can clean nothing up) and exits at once if
  the launcher is already gone. Elsewhere (no ``prctl``) it does nothing: the launcher's own cleanup
  on SIGINT and SIGTERM is then all there is.

It sits below every package (stdlib only): the coordinator, the replica workers and a user's script
(:mod:`recover.api`) call it, and ``recover launch`` marks their environments.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV = "RECOVER_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) marked with this launcher's PID."""
    return {**(os.environ if env is None else env), ENV: str(os.getpid())}


def die_with_launcher() -> None:
    """In a child of ``recover launch``: die when the launcher dies (see the module docstring)."""
    launcher = os.environ.get(ENV)
    if launcher:
        die_with(int(launcher))


def die_with(parent: int) -> None:
    """Asks the kernel to SIGKILL this process when its parent ``parent`` dies (Linux; elsewhere nothing), and
    exits at once if it already has."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)
