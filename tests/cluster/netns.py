"""Hosts for the cluster tier (`make test-slurm`; pyproject's testpaths leave tests/cluster out of `make test`):
network namespaces on a private bridge, each with its own address.

``Hosts(prefix, names)`` makes one namespace ``{prefix}-hub`` holding a bridge (the "switch", address
``SUBNET.1``) and one namespace per host name, each joined to the bridge by a veth pair and given
``SUBNET.(10 + i)``. Nothing is connected to the machine's own network namespace, so no packet of a
test can leave the namespaces the test made: every address is one of these hosts'. The hub's address
is where the test's own servers listen (the Slurm controller, Prometheus).

``ip netns exec NS`` bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts`` for the command it runs:
``hosts_file(ns, {name: address})`` is how a host resolves names (a Kubernetes Service's name, say) the
way a cluster's DNS would; a name not written there does not resolve, as on a cluster whose node names
are not in DNS.

A link can be cut and restored (``cut``/``mend``: the host's end of its veth down or up). ``close()``
removes every namespace, link and ``/etc/netns`` entry it made (the links go with their namespaces).
Processes are not this module's: whoever starts one in a namespace stops it by PID.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SUBNET = "10.213.7"
ETC = Path("/etc/netns")


def usable() -> str | None:
    """None when namespaces can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """Namespaces ``{prefix}-hub`` and ``{prefix}-{name}`` per host; see the module docstring."""

    def __init__(self, prefix: str, names: list[str]) -> None:
        self.prefix = prefix
        self.hub = f"{prefix}-hub"
        self.hub_addr = f"{SUBNET}.1"
        self.ns = {name: f"{prefix}-{name}" for name in names}
        self.addr = {name: f"{SUBNET}.{10 + i}" for i, name in enumerate(names)}
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        self._netns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{self.hub_addr}/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.ns.items()):
            self._netns(ns)
            port = f"p{i}"
            _ip("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _netns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def hosts_file(self, ns: str, names: dict[str, str]) -> None:
        """What ``ns`` resolves: localhost plus ``names`` (name -> address)."""
        (ETC / ns).mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", *(f"{addr} {name}" for name, addr in names.items())]
        (ETC / ns / "hosts").write_text("\n".join(lines) + "\n")

    def cmd(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def enter(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run in namespace ``ns``'s network only: unlike ``cmd`` it keeps the machine's mounts
        (``ip netns exec`` mounts a sysfs of its own, which hides ``/sys/fs/cgroup``) and ``/etc/hosts``."""
        return ["nsenter", f"--net=/run/netns/{ns}", *argv]

    def cut(self, name: str) -> None:
        """The host's link to the switch goes down (its processes live on, unreachable)."""
        _ip("-n", self.ns[name], "link", "set", "eth0", "down")

    def mend(self, name: str) -> None:
        _ip("-n", self.ns[name], "link", "set", "eth0", "up")

    def pids_in(self, name: str) -> list[int]:
        """Every process whose network namespace is host ``name``'s."""
        out = subprocess.run(["ip", "netns", "pids", self.ns[name]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def commands_in(self, name: str) -> dict[int, bytes]:
        """The command line (NUL-separated) of every process in host ``name``'s namespace that still lives when read:
        one listed may exit before its ``/proc`` entry is read, and is left out."""
        commands = {}
        for pid in self.pids_in(name):
            try:
                commands[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
        return commands

    def close(self) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(ETC / ns, ignore_errors=True)
        self._made.clear()
