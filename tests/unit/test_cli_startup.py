"""The ``recover`` command starts without importing torch (the launcher and ``--help`` stay fast)."""

from __future__ import annotations

import subprocess
import sys


def test_building_the_command_line_imports_no_torch() -> None:
    code = "import sys, recover.cli; recover.cli.build_parser(); print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
