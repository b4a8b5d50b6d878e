"""A slow checkpoint store, for tests/e2e/test_slow_checkpoints.py: on PYTHONPATH, every process sleeps
SLOW_STORE_S seconds in the fsync of a checkpoint's COMMITTED marker whose path holds SLOW_STORE_MATCH (default
``.partial``): each checkpoint takes that much longer to write, wherever it is written from (the training
thread for a synchronous save, the writer thread or process for an asynchronous one)."""
import os
import time

_DELAY = float(os.environ.get("SLOW_STORE_S", "0") or 0)
_MATCH = os.environ.get("SLOW_STORE_MATCH", ".partial")

if _DELAY > 0:
    _fsync = os.fsync

    def _slow_fsync(fd: int) -> None:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if path.endswith("COMMITTED") and _MATCH in path:
            time.sleep(_DELAY)
        _fsync(fd)

    os.fsync = _slow_fsync
