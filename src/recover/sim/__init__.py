"""Cluster-scale discrete-event simulator of fault-tolerance strategies (``recover simulate``).

Contract: pure Python + numpy, no process group (it never imports ``torch.distributed``); step
times come from the SAME workload policy as training (:mod:`recover.workload`). A run is a pure
function of its :class:`JobSpec` (seed included):

    spec = preset("paper-512")                 # or JobSpec(gpus=..., ...)
    result = simulate(spec)                    # recover, checkpoint-restart, shrink-drop
    result.strategies["recover"].effective_throughput
    result.ratios()["recover/checkpoint-restart"]

Modules: :mod:`~recover.sim.model` (job and step times), :mod:`~recover.sim.failures` (sampled,
traced or spread failures), :mod:`~recover.sim.members` and :mod:`~recover.sim.track` (one run's
state and record), :mod:`~recover.sim.strategies` and :mod:`~recover.sim.restart` (the
strategies), :mod:`~recover.sim.engine` (running and measuring), :mod:`~recover.sim.presets`,
:mod:`~recover.sim.calibration`, :mod:`~recover.sim.report` and :mod:`~recover.sim.cli`.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule; imported on first use so `recover --help` (which imports recover.sim.cli)
# never pays for numpy
_EXPORTS = {
    "Calibration": "calibration", "calibrate": "calibration",
    "STRATEGIES": "engine", "SimResult": "engine", "StrategyResult": "engine", "simulate": "engine",
    "read_trace": "failures", "sample_failures": "failures", "spread_losses": "failures",
    "JobSpec": "model", "StepModel": "model", "young_daly_interval_s": "model",
    "PRESETS": "presets", "preset": "presets",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'recover.sim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"recover.sim.{_EXPORTS[name]}"), name)
