"""Which interface gloo binds: the one that reaches the peer, never a user's own choice replaced (the cluster
tier shows the cross-host case: nodes whose machine name resolves to 127.0.0.1)."""

from __future__ import annotations

import pytest

from recover.comm import netaddr


@pytest.fixture(autouse=True)
def no_gloo_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLOO_SOCKET_IFNAME absent in each test and as it was after it (what bind_gloo_towards sets is undone)."""
    monkeypatch.setenv(netaddr.ENV, "")  # records the variable's state before the test, to restore it
    monkeypatch.delenv(netaddr.ENV)


def test_a_peer_on_this_host_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert netaddr.route_address("127.0.0.1") == "127.0.0.1" and netaddr.interface_of("127.0.0.1") == "lo"
    assert netaddr.bind_gloo_towards("127.0.0.1") is None and netaddr.ENV not in __import__("os").environ


def test_the_interface_holding_the_route_is_bound_unless_the_user_chose_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(netaddr, "route_address", lambda host: "10.1.2.3")
    monkeypatch.setattr(netaddr, "interface_of", lambda addr: "ib0" if addr == "10.1.2.3" else None)
    monkeypatch.setattr(netaddr, "_ours", [])
    assert netaddr.bind_gloo_towards("node7") == "ib0" and os.environ[netaddr.ENV] == "ib0"
    assert netaddr.bind_gloo_towards("node8") == "ib0"  # its own choice may be made again
    monkeypatch.setenv(netaddr.ENV, "eth1")  # the user's
    assert netaddr.bind_gloo_towards("node7") is None and os.environ[netaddr.ENV] == "eth1"


def test_an_unroutable_or_unknown_peer_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(netaddr, "route_address", lambda host: None)
    assert netaddr.bind_gloo_towards("nowhere.invalid") is None and netaddr.ENV not in os.environ
