"""Which local network interface reaches a peer, so that gloo binds one the peers can connect to.

gloo binds the address its machine's host name resolves to, unless ``GLOO_SOCKET_IFNAME`` names an
interface. Where the name resolves to a loopback address (containers, ``/etc/hosts`` lines such as
``127.0.1.1 node7``) or to an interface the cluster does not route, peers on other hosts cannot connect
and every rendezvous of a generation times out. :func:`bind_gloo_towards` asks the kernel which local
address routes to the peer (a connected UDP socket: nothing is sent) and sets ``GLOO_SOCKET_IFNAME`` to
the interface holding it, before any group is built. It changes nothing when the user set the variable,
when the peer is on this host (loopback), or when the answer is not an IPv4 interface of this machine.

Contract: call it before the process builds a gloo group that spans hosts (torchrun's group of a replica
that spans nodes: towards ``MASTER_ADDR``; the generation groups: towards the coordinator's store).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915
_ours: list[str] = []  # the value this module set (a user's own setting is never replaced)


def route_address(host: str) -> str | None:
    """The local IPv4 address the kernel would send from to reach ``host``; None if it cannot tell."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))  # UDP: no packet leaves
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_of(address: str) -> str | None:
    """The name of this machine's interface holding IPv4 ``address``; None if none does."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def bind_gloo_towards(host: str) -> str | None:
    """Sets ``GLOO_SOCKET_IFNAME`` to the interface that reaches ``host`` (see the module docstring);
    returns the interface set, or None when it left the variable as it was."""
    if os.environ.get(ENV) and os.environ[ENV] not in _ours:
        return None
    local = route_address(host)
    if local is None or ipaddress.ip_address(local).is_loopback:
        return None
    name = interface_of(local)
    if name is None:
        return None
    os.environ[ENV] = name
    _ours.append(name)
    return name
