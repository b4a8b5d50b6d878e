"""What only a fresh Python process shows: which modules an import pulls in, that the sampler's tokens depend
on nothing in the process that draws them, and that a read stuck on storage does not hold up the exit."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from conftest import subprocess_env
from recover.data.shards import write_shard

DIGEST = """
import hashlib
from recover.data.sampler import Sampler
from recover.data.shards import TokenDataset

def digest(path):
    s = Sampler(TokenDataset(path), 16, 4, 8, seed=1234)
    h = hashlib.sha256()
    for step in (0, 3, 26):
        for mb in range(8):
            x, y = s.microbatch(step, mb)
            h.update(x.numpy().tobytes()); h.update(y.numpy().tobytes())
    return h.hexdigest()
"""

STUCK_READ = """
import time
from recover.data import prefetch
prefetch.JOIN_S = 0.5  # the exit waits this long for the read in flight (5 s by default), never the read
reads = prefetch.Prefetcher(lambda step, mb: time.sleep(600), steps=1)
reads.ahead(0, [0, 1])
time.sleep(0.2)
assert reads.alive
print('done', flush=True)
"""


def python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(), cwd=Path(__file__).resolve().parents[2])


def test_the_command_line_and_the_config_validation_import_no_torch() -> None:
    code = ("import sys, recover.cli; recover.cli.build_parser(); print('torch' in sys.modules, 'numpy' in sys.modules)\n"
            "from recover.config import ModelConfig, load_config; load_config('debug'); ModelConfig(n_layers=2)\n"
            "print('torch' in sys.modules)")
    out = python(code)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False", "False"], out.stdout + out.stderr


def test_a_fresh_process_draws_the_same_tokens_and_a_stuck_read_does_not_hold_up_its_exit(tmp_path: Path) -> None:
    write_shard(tmp_path / "train_000000.bin", np.arange(0, 1000), "llmc")
    write_shard(tmp_path / "train_000001.bin", np.arange(5000, 5700), "nanogpt")
    t0 = time.monotonic()
    out = python(DIGEST + "import sys\nprint(digest(sys.argv[1]), flush=True)\n" + STUCK_READ, str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 60  # torch's import on loaded cores; never the 600 s read
    here: dict = {}
    exec(DIGEST, here)  # the same code, in this process (another hash seed, other imports)
    assert out.stdout.split() == [here["digest"](tmp_path), "done"]
