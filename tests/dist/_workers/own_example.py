"""Runs the README's own-loop example (``examples/train_own.py``) as it is, then writes this rank's losses and an
exact fingerprint of its parameters to ``OUT/rank_RANK.json``: what a plain ``torchrun`` of the example leaves."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]

out = Path(sys.argv[1])
printed: list[str] = []
scope = runpy.run_path(str(ROOT / "examples" / "train_own.py"), run_name="__main__")
model = scope["model"]
params = [p.detach().double() for p in model.parameters()]
bits = sum(int(p.detach().view(torch.int32).long().sum()) for p in model.parameters() if p.dtype == torch.float32)
(out / f"rank_{os.environ.get('RANK', '0')}.json").write_text(json.dumps({
    "param_sum": float(sum(p.sum() for p in params)), "bits": bits,
    "loss": scope["step"].loss}))
