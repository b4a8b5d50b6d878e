"""A link probe that cannot even try (this process is out of descriptors) names nobody: the fault is its own."""

from __future__ import annotations

import errno

import pytest

from recover.coord import probe
from recover.coord.probe import LinkProbe


@pytest.mark.parametrize(("code", "named"), [(errno.EMFILE, []), (errno.ENFILE, []), (errno.ECONNREFUSED, [3]),
                                             (errno.ETIMEDOUT, [3])])
def test_only_a_failure_of_the_link_names_the_peer(monkeypatch: pytest.MonkeyPatch, code: int,
                                                   named: list[int]) -> None:
    def fail(*_a: object, **_k: object) -> None:
        raise OSError(code, "injected")

    monkeypatch.setattr(probe.socket, "create_connection", fail)
    assert LinkProbe(1, lambda r: False).unreachable({3: "10.0.0.3:7"}, timeout_s=0.1) == named
