"""Versions at registration: a register names its release, and another release's is refused naming both."""

from __future__ import annotations

import pytest

from recover import __version__
from recover.coord.protocol import PROTOCOL_VERSION, RELEASE, ProtocolError, check_release, validate


def test_a_register_of_this_release_or_of_none_is_admitted_and_another_is_refused_naming_both() -> None:
    assert RELEASE == __version__
    check_release({"replica": 1, "release": RELEASE})
    check_release({"replica": 1})  # a peer from before the field: its wire protocol is what is checked
    with pytest.raises(ProtocolError, match=rf"bad_release: replica 1 runs recover 9.9 \(wire protocol "
                                            rf"{PROTOCOL_VERSION}\), the coordinator recover {RELEASE}"):
        check_release({"replica": 1, "release": "9.9"})


def test_a_frame_of_another_wire_protocol_is_refused_naming_both_versions_and_releases() -> None:
    with pytest.raises(ProtocolError, match=rf"the peer speaks wire protocol 7 \(recover 9.9\), this side wire "
                                            rf"protocol {PROTOCOL_VERSION} \(recover {RELEASE}\)"):
        validate({"v": 7, "type": "register", "release": "9.9"})
