"""Which device each process of ``recover launch`` gets (torch-free: the launcher never imports torch).

Contract:
- :func:`visible_gpus` lists the GPUs this machine shows: ``CUDA_VISIBLE_DEVICES`` when set (ids or
  UUIDs, as given), else the NVIDIA driver's entries under ``/proc/driver/nvidia/gpus``, else the
  GPUs ``nvidia-smi -L`` lists (containers often show neither of the first two while CUDA works);
  none on a machine without NVIDIA GPUs.
- :func:`place` gives rank k of replica r the GPU ``gpus[r * P + k]``: every rank of every replica a
  device of its own, passed to the process as ``CUDA_VISIBLE_DEVICES`` (it then sees that one GPU as
  ``cuda:0``, whatever its ``LOCAL_RANK``). More ranks than GPUs is refused, with one line, unless
  ``share`` (``--share-gpus``, for tests on one GPU): ranks then share the GPUs round robin and every
  collective runs on gloo (NCCL allows one rank per device), also when no GPU was found.
- A process given no GPU is told so (``RECOVER_PLACEMENT``: ``none``, or ``shared`` under
  ``--share-gpus``), and :func:`recover.train.processes.worker.worker_device` decides in the worker, which
  can ask CUDA: the CPU, ``cuda:0`` when the GPU is its alone or shared on purpose, or a refusal in one
  line when several processes would silently share GPU 0 because the launcher could not see the GPUs.
- A replica that rejoins takes the devices of the one it replaces; a warm spare waits on the CPU, or on
  GPUs no rank was placed on (:meth:`Placement.spare_devices`), and a replica it becomes keeps them.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from recover.errors import ConfigError
from recover.train.processes.exits import PLACEMENT_ENV

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def visible_gpus() -> list[str]:
    """The GPUs processes started from here can use (see the module docstring)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    if NVIDIA_PROC.is_dir():
        return [str(i) for i in range(len(list(NVIDIA_PROC.iterdir())))]
    return smi_gpus()


def smi_gpus(timeout_s: float = 10.0) -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists (``GPU 0: ...`` lines; MIG instances under them are not counted),
    or none when it is missing, fails or does not answer in time."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(line for line in out.stdout.splitlines() if line.startswith("GPU "))]


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
    """Several ranks share a GPU (``--share-gpus`` with fewer GPUs than ranks, or none found): every
    collective must run on gloo."""
    unused: tuple[str, ...] = ()
    """The GPUs given that no rank was placed on (warm spares may wait there, :mod:`recover.launch.spares`)."""

    def env(self, replica: int, rank: int) -> dict[str, str]:
        """The environment that puts rank ``rank`` of ``replica`` on its device."""
        return self.env_on(self.gpus.get((replica, rank)))

    def env_on(self, gpu: str | None) -> dict[str, str]:
        """The environment that puts a process on ``gpu`` (None: no GPU of its own)."""
        if gpu is None:
            return {PLACEMENT_ENV: "shared" if self.shared else "none"}
        return {"CUDA_VISIBLE_DEVICES": gpu}

    def devices(self, replica: int, ranks: int) -> tuple[str | None, ...]:
        """The GPU of each rank of ``replica`` (None: none of its own)."""
        return tuple(self.gpus.get((replica, k)) for k in range(ranks))

    def spare_devices(self, ranks: int, want: int) -> list[tuple[str | None, ...]]:
        """Up to ``want`` device sets of ``ranks`` ranks for warm spares: the CPU's when no rank has a GPU,
        else groups of GPUs no rank was placed on (none when ranks share GPUs)."""
        if not self.gpus:
            return [(None,) * ranks] * want
        return [tuple(self.unused[i:i + ranks]) for i in range(0, len(self.unused) - ranks + 1, ranks)][:want]

    def device(self, replica: int, rank: int) -> str:
        gpu = self.gpus.get((replica, rank))
        return "cpu" if gpu is None else f"GPU {gpu} (cuda:0 in the process)"


def place(replicas: int, ranks: int, gpus: list[str], share: bool = False) -> Placement:
    """Rank k of replica r on ``gpus[r * ranks + k]`` (see the module docstring). Raises ConfigError."""
    if not gpus:
        return Placement(shared=share)
    need = replicas * ranks
    if need > len(gpus) and not share:
        raise ConfigError(f"{replicas} replicas x {ranks} ranks need {need} GPUs, {len(gpus)} given "
                          f"({','.join(gpus)}): use fewer replicas or ranks, more --gpus, or --share-gpus "
                          "(ranks share GPUs, collectives on gloo: for tests)")
    return Placement({(r, k): gpus[(r * ranks + k) % len(gpus)] for r in range(replicas) for k in range(ranks)},
                     shared=need > len(gpus), unused=tuple(gpus[need:]))
