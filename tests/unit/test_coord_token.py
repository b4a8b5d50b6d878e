"""The coordinator's token file: read, refused when unusable, and a copy others can read is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from recover.coord.cli import read_token
from recover.errors import ConfigError


def test_a_token_others_can_read_is_named_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    assert read_token(str(token), warn=True) == "s3cret" and capsys.readouterr().err == ""
    token.chmod(0o644)
    assert read_token(str(token)) == "s3cret" and capsys.readouterr().err == ""  # a client's: no warning
    assert read_token(str(token), warn=True) == "s3cret"
    assert capsys.readouterr().err == (f"recover: warning: --token-file {token} is readable by other users (mode 644): "
                                       f"anyone who can read it can register a replica; chmod 600 {token}\n")


def test_an_empty_or_missing_token_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        read_token(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="cannot be read"):
        read_token(str(tmp_path / "missing"))
