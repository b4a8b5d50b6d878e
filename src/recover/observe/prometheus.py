"""A Prometheus endpoint: the text exposition format (version 0.0.4) served from a daemon thread.

Contract: :func:`render` writes metric families as Prometheus' text format: per family one ``# HELP``
and one ``# TYPE`` line, then its samples, label values escaped (backslash, double quote, newline).
:class:`MetricsServer` binds its port when built (one that cannot be bound raises
:class:`~recover.errors.ConfigError` with one line, before anything else starts) and, once started,
serves ``GET /metrics`` with what ``collect()`` returns at that moment (any other path: 404) from daemon
threads of :mod:`http.server`, so a scrape never runs in the caller's loop; ``collect`` must read its
sources consistently itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from recover.errors import ConfigError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Family:
    """One metric: its name, help, type (``gauge`` or ``counter``) and samples (labels, value)."""

    name: str
    help: str
    type: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}} {value!r}" if inner else f"{name} {value!r}"


def render(families: Iterable[Family]) -> str:
    """The text exposition of ``families``."""
    lines = []
    for f in families:
        lines += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {f.type}"]
        lines += [_sample(f.name, labels, float(v)) for labels, v in f.samples]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``collect()`` at ``http://host:port/metrics`` (see the module docstring)."""

    port: int

    def __init__(self, host: str, port: int) -> None:
        """Binds ``host:port`` (0: a free port; ConfigError when it cannot); :meth:`start` serves."""
        if not 0 <= port < 65536:
            raise ConfigError(f"--metrics-port {port} is not a port number (0: off)")
        self.collect: Callable[[], str] = lambda: ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = outer.collect().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # a scrape every few seconds: no log
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror}); choose "
                              "another port, or 0 for no endpoint") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="recover-metrics", daemon=True)

    def start(self, collect: Callable[[], str]) -> MetricsServer:
        """Serves ``collect()`` from now on."""
        self.collect = collect
        self._thread.start()
        return self

    def close(self) -> None:
        """Stops serving (if started) and frees the port."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
