"""Which device each process of ``recover launch`` gets (torch-free: the launcher never imports torch).

Contract:
- :func:`visible_gpus` lists the GPUs this machine shows: ``CUDA_VISIBLE_DEVICES`` when set (ids or
  UUIDs, as given), else the NVIDIA driver's entries under ``/proc/driver/nvidia/gpus``; none on a
  machine without NVIDIA GPUs.
- :func:`place` gives rank k of replica r the GPU ``gpus[r * P + k]``: every rank of every replica a
  device of its own, passed to the process as ``CUDA_VISIBLE_DEVICES`` (it then sees that one GPU as
  ``cuda:0``, whatever its ``LOCAL_RANK``). More ranks than GPUs is refused, with one line, unless
  ``share`` (``--share-gpus``, for tests on one GPU): ranks then share the GPUs round robin and every
  collective runs on gloo (NCCL allows one rank per device). Without GPUs every rank computes on
  the CPU and nothing is set.
- A replica that rejoins takes the devices of the one it replaces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from recover.errors import ConfigError

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def visible_gpus() -> list[str]:
    """The GPUs processes started from here can use (see the module docstring)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    if NVIDIA_PROC.is_dir():
        return [str(i) for i in range(len(list(NVIDIA_PROC.iterdir())))]
    return []


def parse_gpus(text: str) -> list[str]:
    """``--gpus 0,1,2,3`` as a list (ids or UUIDs, no repeats). Raises ConfigError."""
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or len(set(gpus)) != len(gpus):
        raise ConfigError(f"--gpus {text!r}: give distinct device ids, comma-separated, e.g. 0,1,2,3")
    return gpus


@dataclass(frozen=True)
class Placement:
    """Devices of a job: ``gpus[(replica, rank)]`` is a process's GPU (absent: the CPU)."""

    gpus: dict[tuple[int, int], str] = field(default_factory=dict)
    shared: bool = False
    """Several ranks share a GPU: every collective must run on gloo."""

    def env(self, replica: int, rank: int) -> dict[str, str]:
        """The environment that puts rank ``rank`` of ``replica`` on its device."""
        gpu = self.gpus.get((replica, rank))
        return {} if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu}

    def device(self, replica: int, rank: int) -> str:
        gpu = self.gpus.get((replica, rank))
        return "cpu" if gpu is None else f"GPU {gpu} (cuda:0 in the process)"


def place(replicas: int, ranks: int, gpus: list[str], share: bool = False) -> Placement:
    """Rank k of replica r on ``gpus[r * ranks + k]`` (see the module docstring). Raises ConfigError."""
    if not gpus:
        return Placement()
    need = replicas * ranks
    if need > len(gpus) and not share:
        raise ConfigError(f"{replicas} replicas x {ranks} ranks need {need} GPUs, {len(gpus)} given "
                          f"({','.join(gpus)}): use fewer replicas or ranks, more --gpus, or --share-gpus "
                          "(ranks share GPUs, collectives on gloo: for tests)")
    return Placement({(r, k): gpus[(r * ranks + k) % len(gpus)] for r in range(replicas) for k in range(ranks)},
                     shared=need > len(gpus))
