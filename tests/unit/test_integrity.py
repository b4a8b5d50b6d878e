"""Integrity checks: parameter fingerprints and checkpoint manifests (pure, in process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from recover.config import load_config
from recover.errors import CheckpointError
from recover.faults import kind
from recover.train.checkpoints.integrity import verify, write_manifest
from recover.train.replicas.replica import Replica


class _Data:
    microbatch_size, seq_len = 2, 8

    def microbatch(self, step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(2, 8, dtype=torch.long)
        return x, x


def test_any_single_changed_bit_changes_the_fingerprint() -> None:
    cfg = load_config("debug", [])
    replica = Replica(cfg.model, cfg.training, _Data())
    base = replica.fingerprint()
    assert replica.fingerprint() == base  # a pure read
    for k in (0, len(replica.params) // 2, len(replica.params) - 1):
        bits = replica.params[k].detach().view(-1).view(torch.int32)
        for bit in range(32):  # every bit of one element, sign and exponent included
            bits[7] ^= 1 << bit if bit < 31 else -(1 << 31)
            assert replica.fingerprint() != base, (k, bit)
            bits[7] ^= 1 << bit if bit < 31 else -(1 << 31)
        assert replica.fingerprint() == base
    with torch.no_grad():  # moving a value to another parameter changes it too
        a, b = replica.params[0].view(-1), replica.params[1].view(-1)
        a[0], b[0] = b[0].item(), a[0].item()
    assert replica.fingerprint() != base


def test_corrupt_and_nan_specs() -> None:
    spec = kind("corrupt").parse("2@12")
    assert (spec.replica, spec.step, spec.fault, spec.kills) == (2, 12, "corrupt", True)
    spec = kind("nan").parse("1@5:3")
    assert (spec.replica, spec.step, spec.fault, int(spec.arg), spec.kills) == (1, 5, "nan", 3, False)
    assert str(spec) == "1@5:forward=nan:3"
    with pytest.raises(ValueError, match="write R@STEP:ID"):
        kind("nan").parse("1@5")
    with pytest.raises(ValueError, match="write R@STEP, e.g. 2@12"):
        kind("corrupt").parse("1@5:forward")


def test_a_manifest_finds_any_changed_cut_missing_or_foreign_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_000005"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (ckpt / "sub" / ".metadata").write_bytes(b"meta" * 10)
    write_manifest(ckpt)
    assert verify(ckpt) is True
    data = bytearray((ckpt / "__0_0.distcp").read_bytes())
    data[5000] ^= 0x10
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_000005 is damaged: __0_0.distcp does not match its sha256"):
        verify(ckpt)
    data[5000] ^= 0x10
    (ckpt / "__0_0.distcp").write_bytes(bytes(data[:-1]))
    with pytest.raises(CheckpointError, match="has 16,383 bytes, 16,384 were written"):
        verify(ckpt)
    (ckpt / "__0_0.distcp").write_bytes(bytes(data))
    (ckpt / "sub" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"sub/.metadata is missing"):
        verify(ckpt)
    (ckpt / "sub" / ".metadata").write_bytes(b"meta" * 10)
    (ckpt / "stray.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="stray.bin is not part of it"):
        verify(ckpt)
    (ckpt / "stray.bin").unlink()
    assert verify(ckpt) is True
    (ckpt / "manifest.json").unlink()
    assert verify(ckpt) is False  # an older checkpoint: unchecked, still loadable
