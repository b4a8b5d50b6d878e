"""A real Prometheus server (Debian's ``prometheus``) for the cluster tier, scraping a job's coordinator.

``Prometheus(workdir, hosts, target)`` writes a configuration that scrapes ``http://TARGET/metrics`` every
second and starts the server in the hub namespace of a :class:`netns.Hosts`, listening on that
namespace's loopback (nothing outside the test's namespaces can reach it). ``value(expr)`` asks the
server's own query API (``/api/v1/query``) for an instant vector's single value: what a dashboard or an
alert rule of a user's Prometheus would read. ``stop()`` ends it by PID.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path

from netns import Hosts

PORT = 9090
CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: recover
    static_configs:
      - targets: ["{target}"]
"""


def prometheus_missing() -> str | None:
    """None when the server and curl are installed, else why the Prometheus check cannot run."""
    missing = [name for name in ("prometheus", "curl") if shutil.which(name) is None]
    if missing and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], capture_output=True, timeout=600)
        missing = [name for name in missing if shutil.which(name) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


class Prometheus:
    """A Prometheus server scraping ``target`` (HOST:PORT); see the module docstring."""

    def __init__(self, workdir: Path, hosts: Hosts, target: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(CONFIG.format(target=target))
        self.hosts = hosts
        with open(workdir / "prometheus.log", "ab") as log:
            self.proc = subprocess.Popen(
                hosts.enter(hosts.hub, ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
                                        f"--storage.tsdb.path={workdir / 'data'}",
                                        f"--web.listen-address=127.0.0.1:{PORT}", "--log.level=warn"]),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{PORT}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        got = subprocess.run(self.hosts.enter(self.hosts.hub, ["curl", "-sf", url]), capture_output=True,
                             text=True, timeout=30)
        if got.returncode:
            raise RuntimeError(f"Prometheus query {expr!r}: curl exit {got.returncode}")
        body = json.loads(got.stdout)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The single value of ``expr`` now; None when it has no series."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else None

    def samples(self, expr: str) -> list[float]:
        """The values of a range vector ``expr`` (one series, e.g. ``recover_live_replicas[10m]``), oldest first."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return [float(v) for _, v in result[0]["values"]] if result else []

    def wait_up(self, timeout: float) -> None:
        """Until a scrape of the target has succeeded."""
        deadline = time.time() + timeout
        while True:
            try:
                if self.value('up{job="recover"}') == 1:
                    return
            except RuntimeError:
                pass  # still starting
            if time.time() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"Prometheus never scraped its target (exit {self.proc.poll()})")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
